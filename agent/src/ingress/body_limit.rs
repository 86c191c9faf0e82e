//! The request body limit for bodies whose length is not announced (chunked
//! HTTP/1.1, HTTP/2 without `Content-Length`): counted as they stream to the
//! endpoint (http-body-util's `Limited`), and the exchange stops at the limit. A
//! flag tells the proxy that the limit, not the endpoint, ended it, so the client
//! gets 413 rather than 502. An announced length above the limit is refused before
//! anything is sent.

use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Body;
use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

/// Any body error.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Set once a body went past its limit.
#[derive(Clone, Debug, Default)]
pub struct Tripped(Arc<AtomicBool>);

impl Tripped {
    /// Whether the body went past its limit.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// `body`, failing once more than `max` bytes have passed; the flag tells when it
/// did.
pub fn limited<B>(body: B, max: u64) -> (impl Body<Data = B::Data, Error = BoxError>, Tripped)
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let tripped = Tripped::default();
    let flag = tripped.0.clone();
    let max = usize::try_from(max).unwrap_or(usize::MAX);
    let body = Limited::new(body, max).map_err(move |e| {
        if e.is::<LengthLimitError>() {
            flag.store(true, Ordering::Relaxed);
        }
        e
    });
    (body, tripped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{StreamBody, combinators::BoxBody};
    use hyper::body::{Bytes, Frame};

    /// A body of `chunks` frames of `size` bytes each, of unknown length.
    fn chunked(chunks: usize, size: usize) -> BoxBody<Bytes, BoxError> {
        let frames =
            (0..chunks).map(move |_| Ok::<_, BoxError>(Frame::data(Bytes::from(vec![b'x'; size]))));
        BodyExt::boxed(StreamBody::new(futures::stream::iter(frames)))
    }

    #[tokio::test]
    async fn a_body_past_the_limit_fails_and_says_so() {
        let (body, tripped) = limited(chunked(10, 100), 999);
        assert!(body.collect().await.is_err());
        assert!(tripped.is_set());
    }

    #[tokio::test]
    async fn a_body_within_the_limit_passes_whole() {
        let (body, tripped) = limited(chunked(10, 100), 1000);
        let bytes = body.collect().await.unwrap().to_bytes();
        assert_eq!(bytes.len(), 1000);
        assert!(!tripped.is_set());
    }
}
