//! The local API's client: how the CLI reaches a running agent.
//!
//! Large requests and answers stream (`ApplyStream`, `List`, `StatusStream`), and
//! every wait has a deadline, so a stuck agent cannot hang the CLI: 30 s for an
//! answer to start and between two messages of it, plus 1 ms per object for an
//! apply, which the agent answers only once it has stored everything. An agent
//! older than this CLI (the binary was replaced, the agent not yet restarted) does
//! not know the streaming calls: the client then falls back to its unary calls,
//! which carry at most 4 MiB each way, and says so when that is not enough.

use super::{Chunker, LocalApiError, MAX_APPLY_BYTES, service_key, too_large};
use crate::{
    model::{Kind, Object, ObjectKey, ServiceKey, parse_json},
    orderedlog::Revision,
    status::{AgentStatus, SUMMARY_SERVICES, ServiceStatus},
};
use hyper_util::rt::TokioIo;
use rune_proto::v1::{self as pb, local_api_client::LocalApiClient};
use std::{future::Future, io, path::Path, time::Duration};
use tokio::net::UnixStream;
use tonic::{Code, Status, Streaming, transport::Channel};

/// How long the CLI waits for the agent to start answering, and between two
/// messages of a streamed answer, before giving up (a stuck agent must not hang
/// `rune-agent status`).
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(30);

/// What an apply may take per object on top of [`CLIENT_TIMEOUT`]: the agent
/// answers once it has validated and stored the whole apply, which grows with the
/// objects.
const APPLY_TIME_PER_OBJECT: Duration = Duration::from_millis(1);

/// What `status` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StatusQuery {
    /// The summary: services listed only when there are at most
    /// [`SUMMARY_SERVICES`].
    Summary,
    /// One service.
    Service(ServiceKey),
    /// The summary, then every service and orphan endpoints object.
    All,
}

/// One part of a status answer, in the order they come.
#[derive(Clone, Debug, PartialEq)]
pub enum StatusPart {
    /// The summary (first, always).
    Summary(Box<AgentStatus>),
    /// A service (`Service` and `All`).
    Service(ServiceStatus),
    /// An Endpoints object without a service (`All`), as `Endpoints ns/name`.
    Orphan(String),
}

/// A connection to a running agent.
pub struct Client {
    inner: LocalApiClient<Channel>,
}

/// Waits for `f` at most `limit`; `what` names the wait in the error.
async fn deadline<T>(
    limit: Duration,
    what: &str,
    f: impl Future<Output = T>,
) -> Result<T, LocalApiError> {
    tokio::time::timeout(limit, f)
        .await
        .map_err(|_| LocalApiError::Timeout {
            what: what.to_owned(),
            after: limit,
        })
}

/// The next message of a streamed answer, within [`CLIENT_TIMEOUT`].
async fn next<T>(stream: &mut Streaming<T>, what: &str) -> Result<Option<T>, LocalApiError> {
    deadline(CLIENT_TIMEOUT, what, stream.message())
        .await?
        .map_err(call_error)
}

/// A refused call as an error; the transport's message-size refusal (from an
/// agent too old to stream) says what to do about it.
fn call_error(s: Status) -> LocalApiError {
    if s.message().contains("message length too large") {
        return LocalApiError::Call(format!(
            "{} (the running agent is older than this CLI and takes and answers at most \
             4 MiB per call: restart it with this version)",
            s.message()
        ));
    }
    LocalApiError::from(s)
}

/// Whether the agent does not know a call (it is older than this CLI).
fn unknown_call<T>(r: &Result<T, Status>) -> bool {
    matches!(r, Err(s) if s.code() == Code::Unimplemented)
}

/// Reassembles newline-separated documents from chunks that may split them.
#[derive(Default)]
struct Lines {
    partial: Vec<u8>,
}

impl Lines {
    /// Passes each document `chunk` completes to `each`.
    fn feed(
        &mut self,
        chunk: &[u8],
        mut each: impl FnMut(&str) -> Result<(), LocalApiError>,
    ) -> Result<(), LocalApiError> {
        let mut rest = chunk;
        while let Some(end) = rest.iter().position(|b| *b == b'\n') {
            let line = if self.partial.is_empty() {
                &rest[..end]
            } else {
                self.partial.extend_from_slice(&rest[..end]);
                &self.partial[..]
            };
            let text = std::str::from_utf8(line)
                .map_err(|_| LocalApiError::BadAnswer("a document is not UTF-8".into()))?;
            each(text)?;
            self.partial.clear();
            rest = &rest[end + 1..];
        }
        self.partial.extend_from_slice(rest);
        Ok(())
    }

    /// Fails when the answer ended inside a document.
    fn finish(self) -> Result<(), LocalApiError> {
        if self.partial.is_empty() {
            Ok(())
        } else {
            Err(LocalApiError::BadAnswer(
                "the answer ended inside a document".into(),
            ))
        }
    }
}

fn bad_answer(e: impl std::fmt::Display) -> LocalApiError {
    LocalApiError::BadAnswer(e.to_string())
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
        // No per-call timeout here: each call sets its own deadlines.
        let endpoint = tonic::transport::Endpoint::from_static("http://agent.sock")
            .connect_timeout(CLIENT_TIMEOUT);
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

    /// Applies objects as one apply, all or nothing; returns one result line per
    /// object and the new revision. Fails naming [`MAX_APPLY_BYTES`] when the
    /// objects are more JSON than that, before sending anything.
    pub async fn apply(
        &mut self,
        objects: &[Object],
    ) -> Result<(Vec<String>, Revision), LocalApiError> {
        let mut chunker = Chunker::default();
        let (mut chunks, mut total) = (Vec::new(), 0usize);
        for o in objects {
            let doc = o.to_json().to_string();
            total += doc.len() + 1;
            if total > MAX_APPLY_BYTES {
                return Err(LocalApiError::TooLarge(too_large(total)));
            }
            chunks.extend(chunker.push(doc.as_bytes()));
        }
        chunks.push(chunker.finish());
        let limit = CLIENT_TIMEOUT + APPLY_TIME_PER_OBJECT * objects.len() as u32;
        let what = "the agent to store the apply";
        let request = futures::stream::iter(
            chunks
                .into_iter()
                .filter(|c| !c.is_empty())
                .map(|json_lines| pb::ApplyChunk { json_lines }),
        );
        let answer = deadline(limit, what, self.inner.apply_stream(request)).await?;
        if unknown_call(&answer) {
            return self.apply_unary(objects, limit).await;
        }
        let mut stream = answer.map_err(call_error)?.into_inner();
        let (mut lines, mut revision) = (Vec::with_capacity(objects.len()), 0);
        while let Some(m) = next(&mut stream, "the apply's results").await? {
            lines.extend(m.results);
            revision = m.revision;
        }
        Ok((lines, revision))
    }

    /// [`Client::apply`] through an older agent's unary call.
    async fn apply_unary(
        &mut self,
        objects: &[Object],
        limit: Duration,
    ) -> Result<(Vec<String>, Revision), LocalApiError> {
        let request = pb::ApplyRequest {
            objects_json: objects.iter().map(|o| o.to_json().to_string()).collect(),
        };
        let r = deadline(
            limit,
            "the agent to store the apply",
            self.inner.apply(request),
        )
        .await?
        .map_err(call_error)?
        .into_inner();
        Ok((r.results, r.revision))
    }

    /// Passes the objects matching the filters to `each` as they arrive, in key
    /// order; returns the revision they were read at. An error of `each` (the CLI's
    /// output) ends the call as [`LocalApiError::Output`].
    pub async fn list(
        &mut self,
        kind: Option<Kind>,
        namespace: Option<&str>,
        name: Option<&str>,
        mut each: impl FnMut(Object) -> io::Result<()>,
    ) -> Result<Revision, LocalApiError> {
        let request = pb::GetRequest {
            kind: kind.map(|k| k.as_str().to_owned()).unwrap_or_default(),
            namespace: namespace.unwrap_or_default().to_owned(),
            name: name.unwrap_or_default().to_owned(),
        };
        let what = "the agent's list of objects";
        let answer = deadline(CLIENT_TIMEOUT, what, self.inner.list(request.clone())).await?;
        if unknown_call(&answer) {
            let r = deadline(CLIENT_TIMEOUT, what, self.inner.get(request))
                .await?
                .map_err(call_error)?
                .into_inner();
            for doc in &r.objects_json {
                each(parse_json(doc).map_err(bad_answer)?).map_err(LocalApiError::Output)?;
            }
            return Ok(r.revision);
        }
        let mut stream = answer.map_err(call_error)?.into_inner();
        let (mut lines, mut revision) = (Lines::default(), 0);
        while let Some(chunk) = next(&mut stream, what).await? {
            revision = chunk.revision;
            lines.feed(&chunk.json_lines, |doc| {
                let object = parse_json(doc).map_err(bad_answer)?;
                each(object).map_err(LocalApiError::Output)
            })?;
        }
        lines.finish()?;
        Ok(revision)
    }

    /// Lists objects into memory (small answers: tests, tools).
    pub async fn get(
        &mut self,
        kind: Option<Kind>,
        namespace: Option<&str>,
        name: Option<&str>,
    ) -> Result<(Revision, Vec<Object>), LocalApiError> {
        let mut objects = Vec::new();
        let revision = self
            .list(kind, namespace, name, |o| {
                objects.push(o);
                Ok(())
            })
            .await?;
        Ok((revision, objects))
    }

    /// Deletes one object; `None` when it did not exist.
    pub async fn delete(&mut self, key: &ObjectKey) -> Result<Option<Revision>, LocalApiError> {
        let request = pb::DeleteRequest {
            kind: key.kind.as_str().to_owned(),
            namespace: key.namespace.clone(),
            name: key.name.clone(),
        };
        let r = deadline(
            CLIENT_TIMEOUT,
            "the agent's delete",
            self.inner.delete(request),
        )
        .await?
        .map_err(call_error)?
        .into_inner();
        Ok(r.deleted.then_some(r.revision))
    }

    /// Streams the agent's policy verdicts that `filter` selects, each as its JSON
    /// document and the number of events missed before it, to `each` until it
    /// fails or the agent goes away.
    pub async fn observe(
        &mut self,
        filter: pb::ObserveRequest,
        mut each: impl FnMut(&str, u64) -> io::Result<()>,
    ) -> Result<(), LocalApiError> {
        let what = "the agent's policy verdicts";
        let answer = deadline(CLIENT_TIMEOUT, what, self.inner.observe(filter)).await?;
        let mut stream = answer.map_err(call_error)?.into_inner();
        // No deadline per message: verdicts come when traffic is refused.
        while let Some(event) = stream.message().await.map_err(call_error)? {
            each(&event.json, event.missed).map_err(LocalApiError::Output)?;
        }
        Ok(())
    }

    /// The agent's status as `query` asks, part by part: the summary first, then
    /// services and orphan endpoints as they arrive. A service asked for that does
    /// not exist is an error naming it.
    pub async fn status(
        &mut self,
        query: &StatusQuery,
        mut each: impl FnMut(StatusPart) -> io::Result<()>,
    ) -> Result<(), LocalApiError> {
        let request = pb::StatusStreamRequest {
            service: match query {
                StatusQuery::Service(key) => key.to_string(),
                _ => String::new(),
            },
            all: *query == StatusQuery::All,
        };
        let what = "the agent's status";
        let answer = deadline(CLIENT_TIMEOUT, what, self.inner.status_stream(request)).await?;
        if unknown_call(&answer) {
            return self.status_unary(query, each).await;
        }
        let mut stream = answer.map_err(call_error)?.into_inner();
        let (mut services, mut orphans) = (Lines::default(), Lines::default());
        let mut output = |part| each(part).map_err(LocalApiError::Output);
        while let Some(chunk) = next(&mut stream, what).await? {
            use pb::status_chunk::Part;
            match chunk.part {
                Some(Part::SummaryJson(doc)) => {
                    output(StatusPart::Summary(Box::new(
                        serde_json::from_str(&doc).map_err(bad_answer)?,
                    )))?;
                }
                Some(Part::ServicesJsonLines(bytes)) => services.feed(&bytes, |doc| {
                    output(StatusPart::Service(
                        serde_json::from_str(doc).map_err(bad_answer)?,
                    ))
                })?,
                Some(Part::OrphansJsonLines(bytes)) => orphans.feed(&bytes, |doc| {
                    output(StatusPart::Orphan(
                        serde_json::from_str(doc).map_err(bad_answer)?,
                    ))
                })?,
                None => {}
            }
        }
        services.finish()?;
        orphans.finish()
    }

    /// [`Client::status`] from an older agent's whole document.
    async fn status_unary(
        &mut self,
        query: &StatusQuery,
        mut each: impl FnMut(StatusPart) -> io::Result<()>,
    ) -> Result<(), LocalApiError> {
        let r = deadline(
            CLIENT_TIMEOUT,
            "the agent's status",
            self.inner.status(pb::StatusRequest {}),
        )
        .await?
        .map_err(call_error)?
        .into_inner();
        let mut whole: AgentStatus = serde_json::from_str(&r.status_json).map_err(bad_answer)?;
        let services = std::mem::take(&mut whole.services);
        let orphans = std::mem::take(&mut whole.orphan_endpoints);
        let mut output = |part| each(part).map_err(LocalApiError::Output);
        match query {
            StatusQuery::Summary => {
                if services.len() > SUMMARY_SERVICES {
                    whole.services_omitted = services.len();
                } else {
                    whole.services = services;
                }
                if orphans.len() > SUMMARY_SERVICES {
                    whole.orphans_omitted = orphans.len();
                } else {
                    whole.orphan_endpoints = orphans;
                }
                output(StatusPart::Summary(Box::new(whole)))
            }
            StatusQuery::Service(key) => {
                output(StatusPart::Summary(Box::new(whole)))?;
                let wanted = key.to_string();
                let one = services.into_iter().find(|s| s.service == wanted);
                let one = one.ok_or_else(|| {
                    LocalApiError::Call(format!("service {} not found", service_key(&wanted)))
                })?;
                output(StatusPart::Service(one))
            }
            StatusQuery::All => {
                output(StatusPart::Summary(Box::new(whole)))?;
                for s in services {
                    output(StatusPart::Service(s))?;
                }
                for o in orphans {
                    output(StatusPart::Orphan(o))?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests;
