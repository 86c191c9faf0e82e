//! The local API: how `rune-agent apply/get/delete/status` reach a running agent.
//!
//! gRPC (tonic) over the unix socket `<state-dir>/agent.sock`, mode 0600, so only the
//! agent's own user (root on a node) may change the desired state. Objects travel as
//! JSON documents and are parsed and validated by the agent with the same code as
//! files, so a client can never slip an unchecked object into the store.
//!
//! Requests and answers of any size stream: `ApplyStream`, `List` and `StatusStream`
//! carry newline-separated JSON documents in byte chunks of [`CHUNK_BYTES`] (the
//! transport refuses messages over 4 MiB). The one limit left is
//! [`MAX_APPLY_BYTES`] per apply, which the agent holds in memory to apply it as
//! one transaction. The unary `Apply`, `Get` and `Status` of earlier CLIs are still
//! served, with the transport's 4 MiB ceiling. The calls are answered in `rpcs`,
//! the client is in [`client`].

mod client;
mod codes;
mod rpcs;

pub use client::{Client, StatusPart, StatusQuery};
use codes::log_status;

use crate::{
    model::{Kind, ModelError, ObjectKey, ServiceKey, parse_json},
    orderedlog::store::{ApplyError, Change, ObjectStore},
    status::{AgentStatus, ServiceStatus, StatusError, StatusSource},
};
use futures::Stream;
use rune_proto::v1::local_api_server::{LocalApi as LocalApiService, LocalApiServer as GrpcServer};
use std::{
    io,
    ops::ControlFlow,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    pin::Pin,
    sync::Arc,
};
use thiserror::Error;
use tokio::{
    net::{UnixListener, UnixStream},
    sync::mpsc,
};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// Size of the byte chunks the streaming calls send: well under the transport's
/// 4 MiB message limit, large enough that a message's overhead does not count.
pub const CHUNK_BYTES: usize = 1 << 20;

/// The most JSON one apply may carry through the agent (256 MiB: about five times
/// 100,000 services with 10 endpoints each). The agent holds an apply in memory to
/// validate it as a whole and store it in one transaction; a larger one is refused
/// with an error naming this limit (split it: each apply is all or nothing).
pub const MAX_APPLY_BYTES: usize = 256 << 20;

/// Result lines per message of `ApplyStream`'s answer (~40 bytes each).
const RESULTS_PER_MESSAGE: usize = 10_000;

/// Messages a streaming answer may have queued before its producer waits for the
/// client: bounds the agent's memory per call, whatever the client's pace.
const QUEUED_MESSAGES: usize = 4;

/// The error for an apply over [`MAX_APPLY_BYTES`].
pub fn too_large(bytes: usize) -> String {
    format!(
        "the apply is {} MiB of JSON, more than the local API's limit of {} MiB per apply \
         (MAX_APPLY_BYTES): split the objects into several applies (each one is all or nothing)",
        bytes.div_ceil(1 << 20),
        MAX_APPLY_BYTES >> 20
    )
}

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
    /// The agent did not answer in time.
    #[error("waited {after:?} for {what}: giving up (is the agent stuck?)")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        after: std::time::Duration,
    },
    /// The request is over a limit of the local API (the message names it).
    #[error("{0}")]
    TooLarge(String),
    /// Writing what the agent answered failed (the CLI's standard output).
    #[error("writing the output: {0}")]
    Output(#[source] io::Error),
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

/// The status document of an agent whose status is one closure (every service
/// included). Also a [`StatusSource`]: each call builds the whole document and takes
/// what it needs from it, so it is only as fast as the closure; the running agent
/// passes a [`crate::status::LiveStatus`] instead.
pub type StatusFn = Arc<dyn Fn() -> serde_json::Value + Send + Sync>;

fn whole_document(f: &StatusFn) -> Result<AgentStatus, StatusError> {
    serde_json::from_value(f()).map_err(|e| StatusError::Document(e.to_string()))
}

impl StatusSource for StatusFn {
    fn summary(&self) -> Result<AgentStatus, StatusError> {
        let mut st = whole_document(self)?;
        st.services.clear();
        st.orphan_endpoints.clear();
        Ok(st)
    }

    fn services(
        &self,
        only: Option<&ServiceKey>,
        each: &mut dyn FnMut(ServiceStatus) -> ControlFlow<()>,
    ) -> Result<(), StatusError> {
        let wanted = only.map(ToString::to_string);
        for s in whole_document(self)?.services {
            if wanted.as_ref().is_none_or(|w| *w == s.service) && each(s).is_break() {
                break;
            }
        }
        Ok(())
    }

    fn orphans(&self) -> Result<Vec<String>, StatusError> {
        Ok(whole_document(self)?.orphan_endpoints)
    }
}

/// The server side: the store writer (the embedded store or etcd) and the status
/// source.
pub struct LocalApi {
    store: Arc<dyn ObjectStore>,
    status: Arc<dyn StatusSource>,
}

impl LocalApi {
    /// A server over `store`, answering `status` from `status`.
    pub fn new(store: Arc<dyn ObjectStore>, status: Arc<dyn StatusSource>) -> Self {
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

    /// Parses, validates and stores one apply's documents; the answer's lines.
    async fn apply_documents(&self, documents: Vec<String>) -> Result<(Vec<String>, u64), Status> {
        // Parsing is CPU work: off the runtime's workers.
        let objects = blocking(move || {
            documents
                .iter()
                .map(|j| parse_json(j))
                .collect::<Result<Vec<_>, ModelError>>()
                .map_err(|e| Status::invalid_argument(e.to_string()))
        })
        .await?;
        let count = objects.len();
        let started = std::time::Instant::now();
        let outcome = self.store.apply(objects).await.map_err(|e| match e {
            ApplyError::Invalid(e) => Status::invalid_argument(e.to_string()),
            ApplyError::Log(e) => log_status(e),
        })?;
        tracing::debug!(
            objects = count,
            revision = outcome.revision,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "applied through the local API"
        );
        let lines = outcome
            .results
            .iter()
            .map(|(key, change)| format_change(key, *change))
            .collect();
        Ok((lines, outcome.revision))
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

fn status_error(e: StatusError) -> Status {
    Status::internal(e.to_string())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(format!("store task failed: {e}")))?
}

/// Splits newline-separated documents into strings; a document must be UTF-8.
fn split_documents(bytes: &[u8]) -> Result<Vec<String>, Status> {
    bytes
        .split(|b| *b == b'\n')
        .filter(|line| !line.is_empty())
        .enumerate()
        .map(|(i, line)| {
            String::from_utf8(line.to_vec()).map_err(|_| {
                Status::invalid_argument(format!("document {} of the apply is not UTF-8", i + 1))
            })
        })
        .collect()
}

/// Cuts newline-terminated documents into chunks of exactly [`CHUNK_BYTES`] (the
/// last one shorter), splitting documents wherever a chunk ends.
#[derive(Default)]
pub(crate) struct Chunker {
    buf: Vec<u8>,
}

impl Chunker {
    /// Adds one document; returns the chunks it completed.
    pub(crate) fn push(&mut self, document: &[u8]) -> Vec<Vec<u8>> {
        self.buf.extend_from_slice(document);
        self.buf.push(b'\n');
        let mut full = Vec::new();
        while self.buf.len() >= CHUNK_BYTES {
            let rest = self.buf.split_off(CHUNK_BYTES);
            full.push(std::mem::replace(&mut self.buf, rest));
        }
        full
    }

    /// The last, partial chunk (empty when nothing is left).
    pub(crate) fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// A stream of answers fed by a blocking producer through a bounded channel.
type Answers<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Runs `f` on the blocking pool with a sender of at most
/// [`QUEUED_MESSAGES`] queued answers; an error it returns ends the stream. The
/// producer stops when the client goes away (a send fails).
fn produce<T: Send + 'static>(
    f: impl FnOnce(&mpsc::Sender<Result<T, Status>>) -> Result<(), Status> + Send + 'static,
) -> Answers<T> {
    let (tx, rx) = mpsc::channel(QUEUED_MESSAGES);
    tokio::task::spawn_blocking(move || {
        if let Err(e) = f(&tx) {
            let _ = tx.blocking_send(Err(e));
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

/// Parses `namespace/name` (or `name`, in `default`).
pub fn service_key(s: &str) -> ServiceKey {
    match s.split_once('/') {
        Some((ns, name)) => ServiceKey::new(ns, name),
        None => ServiceKey::new(crate::model::DEFAULT_NAMESPACE, s),
    }
}

/// Compact JSON of a status part.
fn json<T: serde::Serialize>(v: &T) -> Result<String, Status> {
    serde_json::to_string(v).map_err(|e| Status::internal(e.to_string()))
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

/// The `localapi` subsystem: binds `<state-dir>/agent.sock` at start and serves the
/// local API until stopped; removes the socket on stop.
pub struct LocalApiServer {
    path: PathBuf,
    store: Arc<dyn ObjectStore>,
    status: Arc<dyn StatusSource>,
    tasks: tokio_util::task::TaskTracker,
    /// Whether this server bound the socket (and so may remove it on stop).
    bound: std::sync::atomic::AtomicBool,
}

impl LocalApiServer {
    /// A server on `path` over `store`, answering `status` from `status` (the
    /// running agent's [`crate::status::LiveStatus`]).
    pub fn new(
        path: PathBuf,
        store: Arc<dyn ObjectStore>,
        status: impl StatusSource + 'static,
    ) -> Self {
        Self {
            path,
            store,
            status: Arc::new(status),
            tasks: tokio_util::task::TaskTracker::new(),
            bound: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

#[async_trait::async_trait]
impl crate::subsystem::Subsystem for LocalApiServer {
    fn name(&self) -> &str {
        "localapi"
    }

    async fn start(
        &self,
        ctx: &crate::subsystem::StartContext,
    ) -> Result<(), crate::subsystem::SubsystemError> {
        let listener = bind(&self.path)
            .await
            .map_err(|e| crate::subsystem::SubsystemError::failed("local API", e))?;
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

    fn ready(&self) -> crate::subsystem::Readiness {
        crate::subsystem::Readiness::ready()
    }

    async fn stop(&self) -> Result<(), crate::subsystem::SubsystemError> {
        self.tasks.close();
        self.tasks.wait().await;
        // Never remove a socket another agent bound (our bind may have failed on it).
        if !self.bound.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(crate::subsystem::SubsystemError::io(
                format!("remove {}", self.path.display()),
                e,
            )),
        }
    }
}
