use super::{Failure, Http1Pool};
use crate::ingress::{answers::empty, body::ProxyBody};
use http_body_util::{BodyExt, Full};
use hyper::{
    Request, Response, StatusCode,
    body::{Body, Bytes},
    header,
};
use hyper_util::rt::TokioIo;
use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

/// An HTTP/1.1 server on loopback answering `ok`, counting its connections.
async fn server() -> (SocketAddr, Arc<AtomicUsize>) {
    raw_server(|stream| async move {
        let service = hyper::service::service_fn(|_req| async {
            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .await;
    })
    .await
}

/// A server on loopback running `serve` on each connection, counting them.
async fn raw_server<F, Fut>(serve: F) -> (SocketAddr, Arc<AtomicUsize>)
where
    F: Fn(TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(serve(stream));
        }
    });
    (addr, accepted)
}

/// Reads one request head (requests here have no body): false at end of stream.
async fn read_head(stream: &mut TcpStream) -> bool {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return false,
        }
    }
    true
}

/// Whether the peer closes `stream` within a second (reading past anything sent).
async fn closed_by_peer(stream: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    let wait = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(1), wait)
        .await
        .is_ok()
}

/// Reads one request head, writes `response`, keeps the connection open for
/// `hold` (reading nothing more), then closes it.
async fn answer_then_hold(mut stream: TcpStream, response: &[u8], hold: Duration) {
    if read_head(&mut stream).await {
        let _ = stream.write_all(response).await;
        tokio::time::sleep(hold).await;
    }
}

/// Answers one request (keep-alive by its headers), then closes the connection a
/// moment later (once the client has put it back in its pool).
async fn one_then_close(stream: TcpStream) {
    let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    answer_then_hold(stream, ok, Duration::from_millis(50)).await;
}

/// A pool with a 1 s connect timeout and a 5 s stall timeout.
fn pool() -> Arc<Http1Pool> {
    Arc::new(Http1Pool::new(
        Duration::from_secs(1),
        Duration::from_secs(5),
    ))
}

fn get() -> Request<ProxyBody> {
    Request::builder()
        .uri("/")
        .header(header::HOST, "a.example")
        .body(empty())
        .unwrap()
}

async fn body_of(resp: Response<ProxyBody>) -> Bytes {
    resp.into_body().collect().await.unwrap().to_bytes()
}

#[tokio::test]
async fn a_connection_is_reused_once_its_body_was_read_and_not_before() {
    let (addr, accepted) = server().await;
    let pool = pool();
    for _ in 0..3 {
        let Ok(resp) = pool.send(addr, get()).await else {
            panic!("no response")
        };
        assert_eq!(&body_of(resp).await[..], b"ok");
    }
    assert_eq!(accepted.load(Ordering::Relaxed), 1);
    // A response whose body is still unread holds its connection.
    let Ok(_unread) = pool.send(addr, get()).await else {
        panic!("no response")
    };
    let Ok(resp) = pool.send(addr, get()).await else {
        panic!("no response")
    };
    drop(resp);
    assert_eq!(accepted.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn nothing_listening_is_a_connect_failure() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let pool = pool();
    assert!(matches!(
        pool.send(addr, get()).await,
        Err(Failure::Connect)
    ));
}

/// A pool whose one idle connection to the returned endpoint was closed by it
/// after answering; the endpoint's count of accepted connections.
async fn idle_closed_by_endpoint() -> (Arc<Http1Pool>, SocketAddr, Arc<AtomicUsize>) {
    let (addr, accepted) = raw_server(one_then_close).await;
    let pool = pool();
    let Ok(resp) = pool.send(addr, get()).await else {
        panic!("no response")
    };
    assert_eq!(&body_of(resp).await[..], b"ok");
    assert_eq!(pool.idle_count(addr), 1);
    // Time for the close to reach this side's socket.
    tokio::time::sleep(Duration::from_millis(200)).await;
    (pool, addr, accepted)
}

#[tokio::test]
async fn a_request_goes_on_a_new_connection_when_the_endpoint_closed_the_idle_one() {
    let (pool, addr, accepted) = idle_closed_by_endpoint().await;
    let Ok(resp) = pool.send(addr, get()).await else {
        panic!("the request was not resent on a new connection")
    };
    assert_eq!(&body_of(resp).await[..], b"ok");
    assert_eq!(accepted.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn an_idle_connection_the_endpoint_closed_is_swept() {
    let (pool, addr, _) = idle_closed_by_endpoint().await;
    pool.sweep();
    assert_eq!(pool.idle_count(addr), 0);
}

#[tokio::test]
async fn a_connection_broken_mid_body_errs_the_body_and_is_not_reused() {
    // The first connection promises 10 bytes, sends 2 and closes.
    let (addr, accepted) = raw_server(|mut stream| async move {
        if read_head(&mut stream).await {
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nok")
                .await;
        }
    })
    .await;
    let pool = pool();
    let Ok(resp) = pool.send(addr, get()).await else {
        panic!("no response")
    };
    assert!(resp.into_body().collect().await.is_err());
    assert_eq!(pool.idle_count(addr), 0);
    let _ = pool.send(addr, get()).await;
    assert_eq!(accepted.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn an_unfinished_body_dropped_closes_its_connection() {
    let (closed_tx, mut closed_rx) = tokio::sync::mpsc::unbounded_channel();
    let (addr, accepted) = raw_server(move |mut stream| {
        let closed = closed_tx.clone();
        async move {
            if read_head(&mut stream).await {
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nok")
                    .await;
                let _ = closed.send(closed_by_peer(&mut stream).await);
            }
        }
    })
    .await;
    let pool = pool();
    let Ok(resp) = pool.send(addr, get()).await else {
        panic!("no response")
    };
    let mut body = resp.into_body();
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), Bytes::from_static(b"ok"));
    assert!(!body.is_end_stream());
    drop(body);
    assert_eq!(pool.idle_count(addr), 0);
    assert_eq!(closed_rx.recv().await, Some(true));
    let _ = pool.send(addr, get()).await;
    assert_eq!(accepted.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn a_send_given_up_on_closes_its_connection() {
    // Reads the request and never answers.
    let (closed_tx, mut closed_rx) = tokio::sync::mpsc::unbounded_channel();
    let (addr, _) = raw_server(move |mut stream| {
        let closed = closed_tx.clone();
        async move {
            if read_head(&mut stream).await {
                let _ = closed.send(closed_by_peer(&mut stream).await);
            }
        }
    })
    .await;
    let pool = pool();
    let late = tokio::time::timeout(Duration::from_millis(100), pool.send(addr, get())).await;
    assert!(late.is_err());
    assert_eq!(closed_rx.recv().await, Some(true));
    assert_eq!(pool.idle_count(addr), 0);
}

#[tokio::test]
async fn a_protocol_switch_completes_over_its_connection_left_running() {
    // Switches to an echo of whatever comes next.
    let (addr, _) = raw_server(|mut stream| async move {
        if read_head(&mut stream).await {
            let _ = stream
                .write_all(
                    b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n",
                )
                .await;
            let mut buf = [0u8; 64];
            while let Ok(n @ 1..) = stream.read(&mut buf).await {
                if stream.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
    let pool = pool();
    let mut req = get();
    req.headers_mut()
        .insert(header::CONNECTION, "upgrade".parse().unwrap());
    req.headers_mut()
        .insert(header::UPGRADE, "echo".parse().unwrap());
    let Ok(mut resp) = pool.send(addr, req).await else {
        panic!("no response")
    };
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    let upgraded = tokio::time::timeout(Duration::from_secs(1), hyper::upgrade::on(&mut resp))
        .await
        .expect("the upgrade did not complete")
        .unwrap();
    let mut io = TokioIo::new(upgraded);
    io.write_all(b"ping").await.unwrap();
    let mut echoed = [0u8; 4];
    io.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, b"ping");
    assert_eq!(pool.idle_count(addr), 0);
}

/// Answers 401 with an empty body as soon as the request head is in, without
/// reading the request's body, and keeps the connection open.
async fn refuse_before_the_upload(stream: TcpStream) {
    let refused = b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n";
    answer_then_hold(stream, refused, Duration::from_secs(5)).await;
}

#[tokio::test]
async fn a_connection_still_sending_the_upload_is_not_pooled() {
    let (addr, accepted) = raw_server(refuse_before_the_upload).await;
    let pool = pool();
    // An upload whose body never ends: the client keeps sending.
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<hyper::body::Frame<Bytes>, _>>(1);
    tx.send(Ok(hyper::body::Frame::data(Bytes::from_static(b"part"))))
        .await
        .unwrap();
    let upload = http_body_util::StreamBody::new(tokio_stream_of(rx));
    let req = Request::builder()
        .method("POST")
        .uri("/")
        .header(header::HOST, "a.example")
        .header(header::TRANSFER_ENCODING, "chunked")
        .body(upload.boxed_unsync())
        .unwrap();
    let Ok(resp) = pool.send(addr, req).await else {
        panic!("no response")
    };
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert!(body_of(resp).await.is_empty());
    assert_eq!(pool.idle_count(addr), 0, "pooled while its upload went on");
    // The next request does not wait behind the upload: a new connection.
    let next = tokio::time::timeout(Duration::from_secs(2), pool.send(addr, get())).await;
    assert!(matches!(next, Ok(Ok(_))), "the next request waited");
    assert_eq!(accepted.load(Ordering::Relaxed), 2);
    drop(tx);
}

/// The frames `rx` receives, as a stream.
fn tokio_stream_of<T>(mut rx: tokio::sync::mpsc::Receiver<T>) -> impl futures::Stream<Item = T> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// Promises 10 bytes, sends 2, then neither sends nor closes for a while.
async fn stall_mid_body(stream: TcpStream) {
    let partial = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nok";
    answer_then_hold(stream, partial, Duration::from_secs(10)).await;
}

#[tokio::test]
async fn a_body_the_endpoint_stalls_is_cut_after_the_stall_timeout() {
    let (addr, _) = raw_server(stall_mid_body).await;
    let pool = Arc::new(Http1Pool::new(
        Duration::from_secs(1),
        Duration::from_millis(300),
    ));
    let Ok(resp) = pool.send(addr, get()).await else {
        panic!("no response")
    };
    let started = std::time::Instant::now();
    let read = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect()).await;
    let Ok(Err(error)) = read else {
        panic!("the stalled body was not cut")
    };
    assert!(error.to_string().contains("stalled"), "{error}");
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(pool.idle_count(addr), 0);
}
