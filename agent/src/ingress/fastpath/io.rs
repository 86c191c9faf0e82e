//! Reads and writes that give up at a deadline, sharing one timer per client
//! connection: the timer is armed only when a read or write has to wait, so one
//! done at once costs no timer and no clock.

use bytes::BytesMut;
use std::{
    future::{Future, poll_fn},
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    time::{Instant, Sleep},
};

/// Room kept free in a read buffer.
const READ_ROOM: usize = 8 << 10;

/// Makes room for the next read into `buf`.
pub fn room(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < READ_ROOM / 4 {
        buf.reserve(READ_ROOM);
    }
}

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

/// After a read or write found nothing to do: ready once `deadline` has passed,
/// arming `timer` for it the first time (`armed`); pending forever without one.
fn expiry(
    mut timer: Pin<&mut Sleep>,
    cx: &mut Context<'_>,
    deadline: &mut Deadline,
    armed: &mut bool,
) -> Poll<TimedOut> {
    let Some(at) = deadline.at() else {
        return Poll::Pending;
    };
    if !*armed {
        timer.as_mut().reset(at);
        *armed = true;
    }
    timer.as_mut().poll(cx).map(|()| TimedOut::Yes)
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
        expiry(timer.as_mut(), cx, deadline, &mut armed).map(Err)
    })
    .await
}

/// Writes all of `bytes` to `w` and flushes it, waiting until `deadline` at most
/// on `timer`: a peer that stops reading holds nothing forever.
pub async fn write_all_within<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut bytes: &[u8],
    mut timer: Pin<&mut Sleep>,
    deadline: &mut Deadline,
) -> Result<(), TimedOut> {
    let mut armed = false;
    poll_fn(|cx| {
        loop {
            let progress = if bytes.is_empty() {
                Pin::new(&mut *w).poll_flush(cx).map_ok(|()| None)
            } else {
                Pin::new(&mut *w).poll_write(cx, bytes).map_ok(Some)
            };
            match progress {
                Poll::Ready(Ok(None)) => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(Some(0))) | Poll::Ready(Err(_)) => {
                    return Poll::Ready(Err(TimedOut::No));
                }
                Poll::Ready(Ok(Some(n))) => bytes = &bytes[n..],
                Poll::Pending => break,
            }
        }
        expiry(timer.as_mut(), cx, deadline, &mut armed).map(Err)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    fn timer() -> Pin<Box<Sleep>> {
        Box::pin(tokio::time::sleep(Duration::ZERO))
    }

    #[tokio::test]
    async fn a_peer_that_stops_reading_or_sending_is_given_up_at_the_deadline() {
        let (mut near, mut far) = tokio::io::duplex(16);
        let mut t = timer();
        let mut deadline = Deadline::after(Duration::from_millis(50));
        let r = write_all_within(&mut near, &[0; 64], t.as_mut(), &mut deadline).await;
        assert!(matches!(r, Err(TimedOut::Yes)), "{r:?}");

        let mut buf = BytesMut::with_capacity(64);
        let mut deadline = Deadline::after(Duration::from_millis(50));
        far.write_all(b"x").await.unwrap();
        let n = read_more(&mut near, &mut buf, t.as_mut(), &mut deadline).await;
        assert!(matches!(n, Ok(1)), "{n:?}");
        let r = read_more(&mut near, &mut buf, t.as_mut(), &mut deadline).await;
        assert!(matches!(r, Err(TimedOut::Yes)), "{r:?}");
    }

    #[tokio::test]
    async fn without_a_deadline_a_read_waits_for_the_peer() {
        let (mut near, mut far) = tokio::io::duplex(16);
        let mut buf = BytesMut::with_capacity(64);
        let (mut t, mut never) = (timer(), Deadline::never());
        let read = read_more(&mut near, &mut buf, t.as_mut(), &mut never);
        let late = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            far.write_all(b"late").await.unwrap();
        };
        let (n, ()) = tokio::join!(read, late);
        assert!(matches!(n, Ok(4)), "{n:?}");
    }
}
