use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::metrics::BytesLabels;

/// One HTTP/1.0 request; returns the status code and the body.
async fn get(addr: SocketAddr, method: &str, path: &str) -> (u16, String, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("{method} {path} HTTP/1.0\r\nHost: test\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut raw = String::new();
    tokio::time::timeout(Duration::from_secs(2), stream.read_to_string(&mut raw))
        .await
        .expect("server did not close the connection")
        .unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_owned(), body.to_owned())
}

struct Server {
    addr: SocketAddr,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

async fn start(metrics: Arc<Metrics>, ready: Readiness) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cancel = CancellationToken::new();
    let task = tokio::spawn(serve(listener, metrics, ready, cancel.clone()));
    Server { addr, cancel, task }
}

#[tokio::test]
async fn readyz_is_503_until_ready_then_200() {
    let (setter, ready) = Readiness::new();
    let server = start(Arc::new(Metrics::new()), ready).await;

    let (status, _, body) = get(server.addr, "GET", "/readyz").await;
    assert_eq!((status, body.as_str()), (503, "not ready"));
    setter.set_ready();
    let (status, _, body) = get(server.addr, "GET", "/readyz").await;
    assert_eq!((status, body.as_str()), (200, "ok"));
    setter.set_not_ready();
    assert_eq!(get(server.addr, "GET", "/readyz").await.0, 503);

    server.cancel.cancel();
    tokio::time::timeout(Duration::from_secs(2), server.task)
        .await
        .expect("serve did not end on cancel")
        .unwrap();
}

#[tokio::test]
async fn metrics_healthz_and_unknown_paths() {
    let metrics = Arc::new(Metrics::new());
    metrics.outbox_depth.set(3);
    let (_setter, ready) = Readiness::new();
    let server = start(metrics, ready).await;

    let (status, head, body) = get(server.addr, "GET", "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("content-type: {OPENMETRICS_CONTENT_TYPE}")),
        "{head}"
    );
    assert!(body.contains("rune_outbox_depth 3"), "{body}");
    assert!(body.contains("rune_outbox_dropped_total 0"), "{body}");

    assert_eq!(get(server.addr, "GET", "/healthz").await.0, 200);
    assert_eq!(get(server.addr, "GET", "/healthz").await.2, "ok");
    assert_eq!(get(server.addr, "GET", "/nope").await.0, 404);
    assert_eq!(get(server.addr, "POST", "/metrics").await.0, 405);

    server.cancel.cancel();
    tokio::time::timeout(Duration::from_secs(2), server.task)
        .await
        .expect("serve did not end on cancel")
        .unwrap();
}

#[tokio::test]
async fn cancel_ends_serve_with_an_idle_connection_open() {
    let (_setter, ready) = Readiness::new();
    let server = start(Arc::new(Metrics::new()), ready).await;
    // A client that connects and never sends a request.
    let _idle = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    // Make sure the server accepted it: a full request on another connection.
    assert_eq!(get(server.addr, "GET", "/healthz").await.0, 200);
    server.cancel.cancel();
    tokio::time::timeout(Duration::from_secs(2), server.task)
        .await
        .expect("serve did not end on cancel while a connection was idle")
        .unwrap();
}

#[tokio::test]
async fn cancel_ends_serve_while_a_client_does_not_read_its_answer() {
    use tokio::io::AsyncWriteExt;
    // A body far larger than the socket buffers (about 15 MB).
    let metrics = Metrics::new();
    for i in 0..150_000 {
        metrics
            .proxy_bytes
            .get_or_create(&BytesLabels {
                service: format!("default/service-{i}"),
                protocol: "TCP".into(),
                direction: "to_backend".into(),
            })
            .inc();
    }
    let (_setter, ready) = Readiness::new();
    let server = start(Arc::new(metrics), ready).await;
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut stuck = sock.connect(server.addr).await.unwrap();
    stuck
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    // Let the server start answering into the full socket.
    tokio::time::sleep(Duration::from_millis(500)).await;
    server.cancel.cancel();
    tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(3), server.task)
        .await
        .expect("a client that does not read held the listener's stop")
        .unwrap();
}
