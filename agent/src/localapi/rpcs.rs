//! The local API's calls, as the agent answers them: each checks its arguments,
//! runs the store or status work off the async threads, and streams large answers
//! in chunks.

use super::{
    Answers, Chunker, LocalApi, LocalApiService, MAX_APPLY_BYTES, QUEUED_MESSAGES,
    RESULTS_PER_MESSAGE, blocking, codes::log_status, json, kind_arg, non_empty, produce,
    service_key, split_documents, status_error, too_large,
};
use crate::{model::ObjectKey, status::StatusSource};
use rune_proto::v1 as pb;
use std::{ops::ControlFlow, sync::Arc};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

#[tonic::async_trait]
impl LocalApiService for LocalApi {
    async fn apply(
        &self,
        request: Request<pb::ApplyRequest>,
    ) -> Result<Response<pb::ApplyResponse>, Status> {
        let (results, revision) = self
            .apply_documents(request.into_inner().objects_json)
            .await?;
        Ok(Response::new(pb::ApplyResponse { results, revision }))
    }

    async fn get(
        &self,
        request: Request<pb::GetRequest>,
    ) -> Result<Response<pb::GetResponse>, Status> {
        let r = request.into_inner();
        let kind = kind_arg(&r.kind)?;
        let (revision, objects) = self
            .store
            .get(kind, non_empty(&r.namespace), non_empty(&r.name))
            .await
            .map_err(log_status)?;
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
        let (deleted, revision) = match self.store.delete(&key).await.map_err(log_status)? {
            Some(revision) => (true, revision),
            None => (
                false,
                self.store.current_revision().await.map_err(log_status)?,
            ),
        };
        Ok(Response::new(pb::DeleteResponse { deleted, revision }))
    }

    async fn status(
        &self,
        _request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusResponse>, Status> {
        let source = self.status.clone();
        let st =
            blocking(move || crate::status::whole(source.as_ref()).map_err(status_error)).await?;
        Ok(Response::new(pb::StatusResponse {
            status_json: serde_json::to_string(&st).map_err(|e| Status::internal(e.to_string()))?,
        }))
    }

    type ApplyStreamStream = Answers<pb::ApplyResponse>;

    async fn apply_stream(
        &self,
        request: Request<Streaming<pb::ApplyChunk>>,
    ) -> Result<Response<Self::ApplyStreamStream>, Status> {
        let mut chunks = request.into_inner();
        let mut bytes = Vec::new();
        while let Some(chunk) = chunks.message().await? {
            if bytes.len() + chunk.json_lines.len() > MAX_APPLY_BYTES {
                return Err(Status::resource_exhausted(too_large(
                    bytes.len() + chunk.json_lines.len(),
                )));
            }
            bytes.extend_from_slice(&chunk.json_lines);
        }
        let documents = split_documents(&bytes)?;
        drop(bytes);
        let (results, revision) = self.apply_documents(documents).await?;
        let mut messages: Vec<Result<pb::ApplyResponse, Status>> = results
            .chunks(RESULTS_PER_MESSAGE)
            .map(|lines| {
                Ok(pb::ApplyResponse {
                    results: lines.to_vec(),
                    revision,
                })
            })
            .collect();
        if messages.is_empty() {
            messages.push(Ok(pb::ApplyResponse {
                results: Vec::new(),
                revision,
            }));
        }
        Ok(Response::new(Box::pin(futures::stream::iter(messages))))
    }

    type ListStream = Answers<pb::ListChunk>;

    async fn list(
        &self,
        request: Request<pb::GetRequest>,
    ) -> Result<Response<Self::ListStream>, Status> {
        let r = request.into_inner();
        let kind = kind_arg(&r.kind)?;
        let store = self.store.clone();
        let (tx, rx) = mpsc::channel(QUEUED_MESSAGES);
        tokio::spawn(async move {
            // The scan's callback runs on the blocking pool: it may wait for the
            // client (`blocking_send`), which bounds the memory of a large answer.
            let chunker = Arc::new(std::sync::Mutex::new(Chunker::default()));
            let gone = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let (feed, each_chunker, each_gone) = (tx.clone(), chunker.clone(), gone.clone());
            let each: crate::orderedlog::store::ScanFn = Box::new(move |revision, object| {
                let full =
                    crate::lock::lock(&each_chunker).push(object.to_json().to_string().as_bytes());
                for json_lines in full {
                    let chunk = pb::ListChunk {
                        json_lines,
                        revision,
                    };
                    if feed.blocking_send(Ok(chunk)).is_err() {
                        each_gone.store(true, std::sync::atomic::Ordering::SeqCst);
                        return ControlFlow::Break(());
                    }
                }
                ControlFlow::Continue(())
            });
            let scanned = store
                .scan(
                    kind,
                    non_empty(&r.namespace).map(str::to_owned),
                    non_empty(&r.name).map(str::to_owned),
                    each,
                )
                .await;
            let last = match scanned {
                Err(e) => Err(log_status(e)),
                Ok(_) if gone.load(std::sync::atomic::Ordering::SeqCst) => return,
                // The last chunk, possibly empty: it also carries the revision of an
                // empty answer.
                Ok(revision) => Ok(pb::ListChunk {
                    json_lines: std::mem::take(&mut *crate::lock::lock(&chunker)).finish(),
                    revision,
                }),
            };
            let _ = tx.send(last).await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type ObserveStream = Answers<pb::ObserveEvent>;

    async fn observe(
        &self,
        request: Request<pb::ObserveRequest>,
    ) -> Result<Response<Self::ObserveStream>, Status> {
        let filter = request.into_inner();
        if !matches!(filter.verdict.as_str(), "" | "all" | "denied" | "audit") {
            return Err(Status::invalid_argument(format!(
                "verdict {:?}: not denied, audit or all",
                filter.verdict
            )));
        }
        let mut verdicts = crate::policy::events::hub().subscribe();
        let (tx, rx) = mpsc::channel(QUEUED_MESSAGES);
        tokio::spawn(async move {
            let mut missed = 0u64;
            loop {
                use tokio::sync::broadcast::error::RecvError;
                let v = tokio::select! {
                    () = tx.closed() => return,
                    v = verdicts.recv() => v,
                };
                let v = match v {
                    Ok(v) => v,
                    Err(RecvError::Lagged(n)) => {
                        missed += n;
                        continue;
                    }
                    Err(RecvError::Closed) => return,
                };
                let wanted = (filter.namespace.is_empty() || filter.namespace == v.namespace)
                    && (filter.service.is_empty() || filter.service == v.service)
                    && (matches!(filter.verdict.as_str(), "" | "all")
                        || filter.verdict == v.verdict);
                if !wanted {
                    continue;
                }
                let Ok(json) = serde_json::to_string(&v) else {
                    continue;
                };
                let event = pb::ObserveEvent { json, missed };
                missed = 0;
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type StatusStreamStream = Answers<pb::StatusChunk>;

    async fn status_stream(
        &self,
        request: Request<pb::StatusStreamRequest>,
    ) -> Result<Response<Self::StatusStreamStream>, Status> {
        let r = request.into_inner();
        let source = self.status.clone();
        Ok(Response::new(produce(move |tx| {
            stream_status(source.as_ref(), &r, tx)
        })))
    }
}

/// `StatusStream`'s answer: the summary, then the services and orphans asked for.
fn stream_status(
    source: &dyn StatusSource,
    r: &pb::StatusStreamRequest,
    tx: &mpsc::Sender<Result<pb::StatusChunk, Status>>,
) -> Result<(), Status> {
    use pb::status_chunk::Part;
    let send = |part: Part| {
        tx.blocking_send(Ok(pb::StatusChunk { part: Some(part) }))
            .is_ok()
    };
    let only = non_empty(&r.service).map(service_key);
    let summary = if r.all || only.is_some() {
        source.summary()
    } else {
        crate::status::summarize(source)
    }
    .map_err(status_error)?;
    if !send(Part::SummaryJson(json(&summary)?)) || !(r.all || only.is_some()) {
        return Ok(());
    }
    let mut chunker = Chunker::default();
    let (mut found, mut gone) = (false, false);
    let mut failed = None;
    source
        .services(only.as_ref(), &mut |s| {
            found = true;
            let doc = match json(&s) {
                Ok(d) => d,
                Err(e) => {
                    failed = Some(e);
                    return ControlFlow::Break(());
                }
            };
            for chunk in chunker.push(doc.as_bytes()) {
                if !send(Part::ServicesJsonLines(chunk)) {
                    gone = true;
                    return ControlFlow::Break(());
                }
            }
            ControlFlow::Continue(())
        })
        .map_err(status_error)?;
    if let Some(e) = failed {
        return Err(e);
    }
    if gone {
        return Ok(());
    }
    if let Some(key) = &only
        && !found
    {
        return Err(Status::not_found(format!("service {key} not found")));
    }
    let last = chunker.finish();
    if !last.is_empty() && !send(Part::ServicesJsonLines(last)) {
        return Ok(());
    }
    if r.all {
        let mut chunker = Chunker::default();
        for orphan in source.orphans().map_err(status_error)? {
            for chunk in chunker.push(json(&orphan)?.as_bytes()) {
                if !send(Part::OrphansJsonLines(chunk)) {
                    return Ok(());
                }
            }
        }
        let last = chunker.finish();
        if !last.is_empty() {
            send(Part::OrphansJsonLines(last));
        }
    }
    Ok(())
}
