//! A watch as both backends deliver it: events read ahead in batches by a
//! backend's [`Feed`], handed out one at a time, the stream ending after the
//! first error (the consumer then takes a new snapshot).

use super::{Event, EventStream, LogError};
use async_trait::async_trait;
use std::collections::VecDeque;

/// Where a watch's events come from.
#[async_trait]
pub(super) trait Feed: Send + 'static {
    /// Appends the next events to `pending`, waiting until there are any (it may
    /// append none, and is then asked again); an error ends the watch.
    async fn fill(&mut self, pending: &mut VecDeque<Event>) -> Result<(), LogError>;
}

/// What the stream carries from one event to the next.
struct ReadAhead<F> {
    feed: F,
    /// Events read and not yet delivered.
    pending: VecDeque<Event>,
    /// An error was delivered: the stream is over.
    done: bool,
}

/// The stream of `feed`'s events.
pub(super) fn events<F: Feed>(feed: F) -> EventStream {
    let start = ReadAhead {
        feed,
        pending: VecDeque::new(),
        done: false,
    };
    Box::pin(futures::stream::unfold(start, next))
}

async fn next<F: Feed>(mut r: ReadAhead<F>) -> Option<(Result<Event, LogError>, ReadAhead<F>)> {
    if r.done {
        return None;
    }
    loop {
        if let Some(event) = r.pending.pop_front() {
            return Some((Ok(event), r));
        }
        if let Err(e) = r.feed.fill(&mut r.pending).await {
            r.done = true;
            return Some((Err(e), r));
        }
    }
}
