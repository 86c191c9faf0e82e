//! The client stream hyper serves: the bytes the fast path already read of it put
//! back in front (it handed the connection over mid-stream), and a note in the
//! connection's [`Activity`] whenever bytes move, so a connection asked to close
//! is given up once its client stops reading.

use super::activity::Activity;
use bytes::{Buf, Bytes};
use std::{
    io::{self, IoSlice},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// `inner`, read from `prefix` first, its moves noted in `activity`.
pub struct ClientStream<S> {
    prefix: Bytes,
    inner: S,
    activity: Arc<Activity>,
}

impl<S> ClientStream<S> {
    /// `inner` with `prefix` to be read before anything more of it.
    pub fn new(inner: S, prefix: Bytes, activity: Arc<Activity>) -> ClientStream<S> {
        ClientStream {
            prefix,
            inner,
            activity,
        }
    }

    /// `r`, noting a move when it is ready with `any` of its bytes.
    fn noted<T>(
        &self,
        r: Poll<io::Result<T>>,
        any: impl FnOnce(&T) -> bool,
    ) -> Poll<io::Result<T>> {
        if let Poll::Ready(Ok(v)) = &r
            && any(v)
        {
            self.activity.moved();
        }
        r
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ClientStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.prefix.has_remaining() && buf.remaining() > 0 {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len() > before;
        self.noted(r, |()| read)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ClientStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.noted(r, |n| *n > 0)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.noted(r, |n| *n > 0)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn the_prefix_is_read_before_the_stream_and_moves_are_noted() {
        let (mut near, far) = tokio::io::duplex(64);
        let activity = Arc::new(Activity::new());
        let mut rewound = ClientStream::new(far, Bytes::from_static(b"GET / HT"), activity.clone());
        tokio::time::sleep(std::time::Duration::from_millis(30)).await;
        near.write_all(b"TP/1.1\r\n").await.unwrap();
        let mut got = vec![0; 16];
        rewound.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"GET / HTTP/1.1\r\n");
        rewound.write_all(b"ok").await.unwrap();
        let mut back = [0; 2];
        near.read_exact(&mut back).await.unwrap();
        assert_eq!(&back, b"ok");
        assert!(activity.io_idle_for() < std::time::Duration::from_millis(30));
    }
}
