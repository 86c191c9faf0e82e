//! gRPC through the ingress in dev mode: a tonic service (h2c) behind a route whose
//! service port is named `grpc`, a tonic client over h2c with prior knowledge to
//! the ingress's plain listener, and over TLS (HTTP/2 by ALPN) to its TLS listener
//! with a certificate from a Secret. Answers, statuses and trailers arrive intact.
//! Needs no root.

use rune_agent_tests::{
    grpc::{channel, say, serve_echo, tls_channel},
    http::{TestCa, tls_secret},
    ingress::{Ingress, OFFSET, ip},
};
use rune_harness::agent::free_port;
use std::net::SocketAddr;
use tonic::Code;

/// A service `name` exposed as `expose` (its flow-map fields) whose one port,
/// named `port_name`, reaches `server`.
fn grpc_service(name: &str, expose: &str, port_name: &str, server: SocketAddr) -> String {
    let service_port = free_port() - OFFSET;
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
         spec: {{ports: [{{name: {port_name}, port: {service_port}, targetPort: {}}}], \
         expose: {{{expose}}}}}\n---\n\
         apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\n\
         spec: {{endpoints: [{{address: {}, ready: true}}]}}\n---\n",
        server.port(),
        server.ip()
    )
}

/// The ingress, a runtime for the test's gRPC server and client, and the server.
fn scene() -> (Ingress, tokio::runtime::Runtime, SocketAddr) {
    let ingress = Ingress::start();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server = serve_echo(&runtime, ip("127.0.0.1"));
    (ingress, runtime, server)
}

#[test]
fn a_grpc_call_passes_through_to_an_h2c_upstream() {
    let (ingress, runtime, server) = scene();
    let mut yaml = grpc_service("echo", "host: grpc.test", "grpc", server);
    // The same server behind a port whose name says nothing: HTTP/1.1 upstream.
    yaml += &grpc_service("plain", "host: plain.test", "web", server);
    ingress.apply(&yaml);
    // A plain GET reaches the gRPC server (which answers 200 with a gRPC status).
    ingress.until("grpc.test", "/", 200);

    let front: SocketAddr = (ip("127.0.0.1"), ingress.http).into();
    runtime.block_on(async {
        let ch = channel(front, "grpc.test").await;
        let reply = say(ch.clone(), "hello").await.expect("a gRPC call");
        assert_eq!(reply.get_ref().as_ref(), b"echo: hello");
        // Several calls share the multiplexed connections both ways.
        for i in 0..5 {
            let text = format!("call {i}");
            let reply = say(ch.clone(), &text).await.expect("a gRPC call");
            assert_eq!(
                reply.into_inner().as_ref(),
                format!("echo: {text}").as_bytes()
            );
        }
        // An error status, its message and its metadata come through.
        let status = say(ch.clone(), "fail").await.expect_err("a failed call");
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert_eq!(status.message(), "told to fail");
        assert_eq!(
            status
                .metadata()
                .get("x-detail")
                .map(|v| v.to_str().unwrap()),
            Some("from the server"),
            "{status:?}"
        );
        // Over HTTP/1.1 to the same server, the call cannot work: the port name is
        // what selects h2c.
        let ch = channel(front, "plain.test").await;
        let status = say(ch, "hello").await.expect_err("gRPC over HTTP/1.1");
        assert_ne!(status.code(), Code::Ok);
    });
    let ok =
        "rune_ingress_requests_total{host=\"grpc.test\",service=\"default/echo\",code=\"200\"}";
    assert!(ingress.metric(ok) >= 7.0, "{}", ingress.metric(ok));
}

#[test]
fn a_grpc_call_over_tls_passes_through_to_an_h2c_upstream() {
    let (ingress, runtime, server) = scene();
    let ca = TestCa::new("grpc test CA");
    let (cert, key) = ca.leaf("grpcs.test");
    let mut yaml = tls_secret("grpcs-cert", &cert, &key) + "\n---\n";
    yaml += &grpc_service(
        "secure",
        "host: grpcs.test, tls: {secret: grpcs-cert}",
        "grpc",
        server,
    );
    ingress.apply(&yaml);
    // Plain HTTP to a route with TLS is redirected: the route is live.
    ingress.until("grpcs.test", "/", 308);

    let front: SocketAddr = (ip("127.0.0.1"), ingress.https).into();
    runtime.block_on(async {
        let ch = tls_channel(front, "grpcs.test", &ca.pem).await;
        for i in 0..3 {
            let text = format!("secure call {i}");
            let reply = say(ch.clone(), &text).await.expect("a gRPC call over TLS");
            assert_eq!(
                reply.into_inner().as_ref(),
                format!("echo: {text}").as_bytes()
            );
        }
        let status = say(ch, "fail").await.expect_err("a failed call");
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert_eq!(status.message(), "told to fail");
    });
    let ok =
        "rune_ingress_requests_total{host=\"grpcs.test\",service=\"default/secure\",code=\"200\"}";
    assert!(ingress.metric(ok) >= 4.0, "{}", ingress.metric(ok));
}
