//! Reads that give up at a deadline, sharing one timer per client connection: the
//! timer is armed only when a read has to wait, so a read answered at once costs
//! no timer and no clock.

use bytes::BytesMut;
use std::{
    future::{Future, poll_fn},
    pin::Pin,
    task::Poll,
    time::Duration,
};
use tokio::{
    io::AsyncRead,
    time::{Instant, Sleep},
};

/// A time limit counted from the first wait under it.
pub struct Deadline {
    after: Option<Duration>,
    at: Option<Instant>,
}

impl Deadline {
    /// `after` from the first wait.
    pub fn after(after: Duration) -> Deadline {
        Deadline {
            after: Some(after),
            at: None,
        }
    }

    /// No limit.
    pub fn never() -> Deadline {
        Deadline {
            after: None,
            at: None,
        }
    }

    /// When it expires (fixed by the first call), if ever.
    fn at(&mut self) -> Option<Instant> {
        let after = self.after?;
        Some(*self.at.get_or_insert_with(|| Instant::now() + after))
    }
}

/// Why a read gave nothing.
#[derive(Debug)]
pub enum TimedOut {
    /// The deadline passed.
    Yes,
    /// The read failed.
    No,
}

/// Reads what `r` has into `buf` (0 at its end), waiting until `deadline` at most
/// on `timer`.
pub async fn read_more<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
    mut timer: Pin<&mut Sleep>,
    deadline: &mut Deadline,
) -> Result<usize, TimedOut> {
    let mut armed = false;
    poll_fn(|cx| {
        match tokio_util::io::poll_read_buf(Pin::new(&mut *r), cx, buf) {
            Poll::Ready(Ok(n)) => return Poll::Ready(Ok(n)),
            Poll::Ready(Err(_)) => return Poll::Ready(Err(TimedOut::No)),
            Poll::Pending => {}
        }
        let Some(at) = deadline.at() else {
            return Poll::Pending;
        };
        if !armed {
            timer.as_mut().reset(at);
            armed = true;
        }
        timer.as_mut().poll(cx).map(|()| Err(TimedOut::Yes))
    })
    .await
}
