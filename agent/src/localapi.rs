//! The local API: how `rune-agent apply/get/delete/status` reach a running agent.
//!
//! gRPC (tonic) over the unix socket `<state-dir>/agent.sock`, mode 0600, so only the
//! agent's own user (root on a node) may change the desired state. Objects travel as
//! JSON documents and are parsed and validated by the agent with the same code as
//! files, so a client can never slip an unchecked object into the store.

use crate::{
    model::{Kind, ModelError, Object, ObjectKey, parse_json},
    orderedlog::{
        LogError, Revision,
        embedded::{ApplyError, Change, EmbeddedLog},
    },
};
use hyper_util::rt::TokioIo;
use rune_proto::v1::{
    self as pb,
    local_api_client::LocalApiClient,
    local_api_server::{LocalApi as LocalApiService, LocalApiServer as GrpcServer},
};
use std::{
    io,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    sync::Arc,
};
use thiserror::Error;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, transport::Channel};

/// File name of the socket inside the state dir.
pub const SOCKET_NAME: &str = "agent.sock";

/// The socket path for a state dir.
pub fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join(SOCKET_NAME)
}

/// Errors of the local API, on either side.
#[derive(Debug, Error)]
pub enum LocalApiError {
    /// Another agent already serves this state dir.
    #[error("another agent is already listening on {path}")]
    InUse {
        /// The socket.
        path: PathBuf,
    },
    /// The socket could not be created or reached.
    #[error("socket {path}: {source}")]
    Socket {
        /// The socket.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The agent refused or failed the call.
    #[error("{0}")]
    Call(String),
    /// The agent's answer could not be read.
    #[error("bad answer from the agent: {0}")]
    BadAnswer(String),
}

impl From<Status> for LocalApiError {
    fn from(s: Status) -> Self {
        LocalApiError::Call(s.message().to_owned())
    }
}

/// Binds the socket: removes a stale one left by a dead agent, refuses when a live
/// agent answers on it, and restricts it to mode 0600.
pub async fn bind(path: &Path) -> Result<UnixListener, LocalApiError> {
    let sock_err = |source| LocalApiError::Socket {
        path: path.to_owned(),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        match UnixStream::connect(path).await {
            Ok(_) => {
                return Err(LocalApiError::InUse {
                    path: path.to_owned(),
                });
            }
            // Only a socket nobody listens on is stale; anything else (a regular file,
            // a socket we may not open) is left alone and reported.
            Err(e)
                if e.kind() == io::ErrorKind::ConnectionRefused && meta.file_type().is_socket() =>
            {
                std::fs::remove_file(path).map_err(sock_err)?;
            }
            Err(e) => return Err(sock_err(e)),
        }
    }
    // Created 0600 from the start (not chmod-ed after bind, which would leave a
    // window where other users could connect).
    // SAFETY: umask(2) cannot fail; the previous mask is restored right after.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let listener = bound.map_err(sock_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(sock_err)?;
    Ok(listener)
}

/// Builds the agent's status document on request.
pub type StatusFn = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

/// The server side: the store writer and the status source.
pub struct LocalApi {
    store: Arc<EmbeddedLog>,
    status: StatusFn,
}

impl LocalApi {
    /// A server over `store`, answering `status` with `status()`.
    pub fn new(store: Arc<EmbeddedLog>, status: StatusFn) -> Self {
        Self { store, status }
    }

    /// Serves on `listener` until `cancel` fires.
    pub async fn serve(
        self,
        listener: UnixListener,
        cancel: CancellationToken,
    ) -> Result<(), tonic::transport::Error> {
        tonic::transport::Server::builder()
            .add_service(GrpcServer::new(self))
            .serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                cancel.cancelled_owned(),
            )
            .await
    }
}

fn kind_arg(kind: &str) -> Result<Option<Kind>, Status> {
    if kind.is_empty() {
        return Ok(None);
    }
    Kind::parse(kind).map(Some).ok_or_else(|| {
        Status::invalid_argument(format!("unknown kind {kind:?} (known: Service, Endpoints)"))
    })
}

fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

fn log_status(e: LogError) -> Status {
    Status::internal(e.to_string())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("store task failed: {e}")))?
}

#[tonic::async_trait]
impl LocalApiService for LocalApi {
    async fn apply(
        &self,
        request: Request<pb::ApplyRequest>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        let objects = request
            .into_inner()
            .objects_json
            .iter()
            .map(|j| parse_json(j))
            .collect::<Result<Vec<_>, ModelError>>()
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let store = self.store.clone();
        let outcome = blocking(move || {
            store.apply(objects).map_err(|e| match e {
                ApplyError::Invalid(e) => Status::invalid_argument(e.to_string()),
                ApplyError::Log(e) => log_status(e),
            })
        })
        .await?;
        Ok(Response::new(pb::ApplyResponse {
            results: outcome
                .results
                .iter()
                .map(|(key, change)| format_change(key, *change))
                .collect(),
            revision: outcome.revision,
        }))
    }

    async fn get(
        &self,
        request: Request<pb::GetRequest>,
    ) -> Result<Response<pb::GetResponse>, Status> {
        let r = request.into_inner();
        let kind = kind_arg(&r.kind)?;
        let store = self.store.clone();
        let (revision, objects) = blocking(move || {
            store
                .get(kind, non_empty(&r.namespace), non_empty(&r.name))
                .map_err(log_status)
        })
        .await?;
        Ok(Response::new(pb::GetResponse {
            objects_json: objects.iter().map(|o| o.to_json().to_string()).collect(),
            revision,
        }))
    }

    async fn delete(
        &self,
        request: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        let r = request.into_inner();
        let kind =
            kind_arg(&r.kind)?.ok_or_else(|| Status::invalid_argument("kind is required"))?;
        let key = ObjectKey::new(kind, r.namespace, r.name);
        let store = self.store.clone();
        let (deleted, revision) = blocking(move || {
            let rev = store.delete(&key).map_err(log_status)?;
            Ok((rev.is_some(), rev.unwrap_or_else(|| store.revision())))
        })
        .await?;
        Ok(Response::new(pb::DeleteResponse { deleted, revision }))
    }

    async fn status(
        &self,
        _request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        Ok(Response::new(pb::StatusResponse {
            status_json: (self.status)().to_string(),
        }))
    }
}

/// `service/default/web created`, as `apply` prints it.
pub fn format_change(key: &ObjectKey, change: Change) -> String {
    format!("{} {change}", object_path(key))
}

/// `service/default/web`: how the CLI names an object in its answers.
pub fn object_path(key: &ObjectKey) -> String {
    format!(
        "{}/{}/{}",
        key.kind.as_str().to_ascii_lowercase(),
        key.namespace,
        key.name
    )
}

/// How long the CLI waits for the agent before giving up (a stuck agent must not
/// hang `rune-agent status`).
pub const CLIENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A connection to a running agent.
pub struct Client {
    inner: LocalApiClient<Channel>,
}

impl Client {
    /// Connects to the agent on `path`; `Ok(None)` when no agent listens there (no
    /// socket, or a stale one), so the caller can work on the store directly.
    pub async fn connect(path: &Path) -> Result<Option<Client>, LocalApiError> {
        if UnixStream::connect(path).await.is_err() {
            return Ok(None);
        }
        let path = path.to_owned();
        // The URI is required by tonic but unused: the connector dials the socket.
        let endpoint = tonic::transport::Endpoint::from_static("http://agent.sock")
            .connect_timeout(CLIENT_TIMEOUT)
            .timeout(CLIENT_TIMEOUT);
        let channel = endpoint
            .connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                async move { UnixStream::connect(path).await.map(TokioIo::new) }
            }))
            .await
            .map_err(|e| LocalApiError::Call(format!("connecting to the agent: {e}")))?;
        Ok(Some(Client {
            inner: LocalApiClient::new(channel),
        }))
    }

    /// Applies objects; returns one result line per object and the new revision.
    pub async fn apply(
        &mut self,
        objects: &[Object],
    ) -> Result<(Vec<String>, Revision), LocalApiError> {
        let r = self
            .inner
            .apply(pb::ApplyRequest {
                objects_json: objects.iter().map(|o| o.to_json().to_string()).collect(),
            })
            .await?
            .into_inner();
        Ok((r.results, r.revision))
    }

    /// Lists objects.
    pub async fn get(
        &mut self,
        kind: Option<Kind>,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Result<(Revision, Vec<Object>), LocalApiError> {
        let r = self
            .inner
            .get(pb::GetRequest {
                kind: kind.map(|k| k.as_str().to_owned()).unwrap_or_default(),
                namespace: namespace.unwrap_or_default().to_owned(),
                name: name.unwrap_or_default().to_owned(),
            })
            .await?
            .into_inner();
        let objects = r
            .objects_json
            .iter()
            .map(|j| parse_json(j).map_err(|e| LocalApiError::BadAnswer(e.to_string())))
            .collect::<Result<_, _>>()?;
        Ok((r.revision, objects))
    }

    /// Deletes one object; `None` when it did not exist.
    pub async fn delete(&mut self, key: &ObjectKey) -> Result<Option<Revision>, LocalApiError> {
        let r = self
            .inner
            .delete(pb::DeleteRequest {
                kind: key.kind.as_str().to_owned(),
                namespace: key.namespace.clone(),
                name: key.name.clone(),
            })
            .await?
            .into_inner();
        Ok(r.deleted.then_some(r.revision))
    }

    /// The agent's status document.
    pub async fn status(&mut self) -> Result<serde_json::Value, LocalApiError> {
        let r = self.inner.status(pb::StatusRequest {}).await?.into_inner();
        serde_json::from_str(&r.status_json).map_err(|e| LocalApiError::BadAnswer(e.to_string()))
    }
}

/// The `localapi` subsystem: binds `<state-dir>/agent.sock` at start and serves the
/// local API until stopped; removes the socket on stop.
pub struct LocalApiServer {
    path: PathBuf,
    store: Arc<EmbeddedLog>,
    status: StatusFn,
    tasks: tokio_util::task::TaskTracker,
    /// Whether this server bound the socket (and so may remove it on stop).
    bound: std::sync::atomic::AtomicBool,
}

impl LocalApiServer {
    /// A server on `path` over `store`.
    pub fn new(path: PathBuf, store: Arc<EmbeddedLog>, status: StatusFn) -> Self {
        Self {
            path,
            store,
            status,
            tasks: tokio_util::task::TaskTracker::new(),
            bound: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

#[async_trait::async_trait]
impl crate::agent::Subsystem for LocalApiServer {
    fn name(&self) -> &str {
        "localapi"
    }

    async fn start(
        &self,
        ctx: &crate::agent::StartContext,
    ) -> Result<(), crate::agent::SubsystemError> {
        let listener = bind(&self.path)
            .await
            .map_err(|e| crate::agent::SubsystemError::failed("local API", e))?;
        self.bound.store(true, std::sync::atomic::Ordering::SeqCst);
        let api = LocalApi::new(self.store.clone(), self.status.clone());
        let cancel = ctx.cancel.clone();
        let path = self.path.clone();
        self.tasks.spawn(async move {
            if let Err(e) = api.serve(listener, cancel).await {
                tracing::error!(socket = %path.display(), error = %e, "local API stopped");
            }
        });
        Ok(())
    }

    fn ready(&self) -> crate::agent::Readiness {
        crate::agent::Readiness::ready()
    }

    async fn stop(&self) -> Result<(), crate::agent::SubsystemError> {
        self.tasks.close();
        self.tasks.wait().await;
        // Never remove a socket another agent bound (our bind may have failed on it).
        if !self.bound.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(crate::agent::SubsystemError::io(
                format!("remove {}", self.path.display()),
                e,
            )),
        }
    }
}
