//! A small gRPC service for the ingress tests, run in the test's own runtime:
//! `/test.Echo/Say` answers `echo: ` and the request's bytes, or, for the request
//! `fail`, the status `FAILED_PRECONDITION` with a message and a metadata entry.
//! Messages are raw bytes ([`RawCodec`]), so no protobuf code is generated; the
//! framing, HTTP/2 and trailers are tonic's own.

use bytes::{Buf, BufMut, Bytes};
use std::{convert::Infallible, future::Future, net::SocketAddr, pin::Pin};
use tonic::{
    Code, Request, Response, Status,
    body::Body,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    codegen::{Service, http},
    server::{Grpc, NamedService, UnaryService},
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Server, server::TcpIncoming},
};

/// The method's path.
pub const SAY: &str = "/test.Echo/Say";

/// Messages as they are: bytes in, bytes out.
#[derive(Clone, Copy, Debug, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }

    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The `test.Echo` service.
#[derive(Clone, Debug)]
pub struct Echo;

impl NamedService for Echo {
    const NAME: &'static str = "test.Echo";
}

impl Service<http::Request<Body>> for Echo {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        Box::pin(async move {
            if req.uri().path() != SAY {
                return Ok(Status::unimplemented("no such method").into_http());
            }
            Ok(Grpc::new(RawCodec).unary(Say, req).await)
        })
    }
}

/// The one method.
struct Say;

impl UnaryService<Bytes> for Say {
    type Response = Bytes;
    type Future = BoxFuture<Result<Response<Bytes>, Status>>;

    fn call(&mut self, req: Request<Bytes>) -> Self::Future {
        Box::pin(async move {
            let body = req.into_inner();
            if body.as_ref() == b"fail" {
                let mut status = Status::new(Code::FailedPrecondition, "told to fail");
                status
                    .metadata_mut()
                    .insert("x-detail", "from the server".parse().unwrap());
                return Err(status);
            }
            Ok(Response::new(Bytes::from(
                [b"echo: ", body.as_ref()].concat(),
            )))
        })
    }
}

/// Serves [`Echo`] (h2c) on a free port of `ip` in `runtime` until the runtime
/// ends; returns its address.
pub fn serve_echo(runtime: &tokio::runtime::Runtime, ip: std::net::IpAddr) -> SocketAddr {
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind((ip, 0)))
        .expect("bind the gRPC server");
    let addr = listener.local_addr().unwrap();
    runtime.spawn(
        Server::builder()
            .add_service(Echo)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    addr
}

/// Calls `/test.Echo/Say` with `message` over the h2c channel `channel`.
pub async fn say(channel: Channel, message: &str) -> Result<Response<Bytes>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static(SAY);
    grpc.unary(
        Request::new(Bytes::copy_from_slice(message.as_bytes())),
        path,
        RawCodec,
    )
    .await
}

/// A channel to `addr` (h2c with prior knowledge) whose requests name `host` as
/// their authority, as a client of a published name would.
pub async fn channel(addr: SocketAddr, host: &str) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .origin(format!("http://{host}").parse().unwrap())
        .connect()
        .await
        .expect("connect the gRPC channel")
}

/// A channel to `addr` over TLS (HTTP/2 chosen by ALPN) that sends `host` as SNI
/// and authority and trusts only `ca_pem`.
pub async fn tls_channel(addr: SocketAddr, host: &str, ca_pem: &str) -> Channel {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name(host);
    Endpoint::from_shared(format!("https://{addr}"))
        .unwrap()
        .origin(format!("https://{host}").parse().unwrap())
        .tls_config(tls)
        .expect("the client TLS configuration")
        .connect()
        .await
        .expect("connect the gRPC channel over TLS")
}
