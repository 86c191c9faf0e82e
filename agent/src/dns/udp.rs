//! The UDP socket loop: a thread per socket that blocks in `recvmmsg` for a batch of
//! queries, answers zone names through the [fast path](super::fast) and sends those
//! answers in one `sendmmsg`; every other datagram goes to the hickory path in a
//! task of its own on the runtime, as hickory-server's own UDP loop would send it.
//!
//! A thread rather than a task: blocked in the receive call it is woken by the
//! kernel when queries arrive, without the reactor's hop from one worker thread to
//! another (measured: context switches were half the agent's CPU time per answer
//! with a task).

use super::{Handler, fast, rcode_label};
use crate::metrics::{DnsQueryLabels, DnsZoneLabels};
use hickory_proto::{
    op::{Header, HeaderCounts, MessageType, Metadata, OpCode, ResponseCode},
    rr::{Record, RecordType},
    serialize::binary::{BinDecodable, BinDecoder, BinEncodable, BinEncoder},
};
use hickory_server::{
    net::{NetError, runtime::TokioTime, xfer::Protocol},
    server::{Request, RequestHandler, ResponseHandler, ResponseInfo},
    zone_handler::{MessageResponse, MessageResponseBuilder, Queries},
};
use prometheus_client::metrics::{counter::Counter, histogram::Histogram};
use std::{
    collections::HashMap,
    io,
    mem::MaybeUninit,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6},
    os::fd::AsRawFd,
    sync::Arc,
    time::{Duration, Instant},
};
use tokio_util::sync::CancellationToken;

/// The server's UDP socket, shared by the loop and the hickory path's answers.
type UdpSocket = std::net::UdpSocket;

/// Datagrams received (and answers sent) per system call.
const BATCH: usize = 32;
/// How often the loop, blocked waiting for queries, checks whether to stop.
const STOP_CHECK: Duration = Duration::from_millis(200);
/// Tries to send a hickory answer into a full socket buffer before giving up.
const SEND_TRIES: u32 = 10;
/// Receive buffer per datagram: larger queries arrive cut (MSG_TRUNC) and go to
/// the hickory path, which answers FORMERR.
const RECEIVE_BUFFER: usize = 4096;
/// Answer buffer per datagram: the largest answer the fast path builds; larger
/// ones (for clients announcing more) go to the hickory path.
const ANSWER_BUFFER: usize = 4096;

/// The sockets' buffers, reused for every batch.
struct Buffers {
    received: Vec<u8>,
    received_len: [usize; BATCH],
    received_truncated: [bool; BATCH],
    sources: [libc::sockaddr_storage; BATCH],
    source_lens: [libc::socklen_t; BATCH],
    answers: Vec<u8>,
    answer_len: [usize; BATCH],
    destinations: [usize; BATCH],
}

impl Buffers {
    fn new() -> Box<Self> {
        // SAFETY: sockaddr_storage is plain data, valid when zeroed.
        let storage: libc::sockaddr_storage = unsafe { MaybeUninit::zeroed().assume_init() };
        Box::new(Buffers {
            received: vec![0; BATCH * RECEIVE_BUFFER],
            received_len: [0; BATCH],
            received_truncated: [false; BATCH],
            sources: [storage; BATCH],
            source_lens: [0; BATCH],
            answers: vec![0; BATCH * ANSWER_BUFFER],
            answer_len: [0; BATCH],
            destinations: [0; BATCH],
        })
    }

    fn datagram(&self, i: usize) -> &[u8] {
        &self.received[i * RECEIVE_BUFFER..i * RECEIVE_BUFFER + self.received_len[i]]
    }

    /// Receives up to [`BATCH`] datagrams, blocking (up to the socket's read
    /// timeout) for the first only.
    fn receive(&mut self, fd: i32) -> io::Result<usize> {
        // SAFETY: zeroed iovec and mmsghdr are valid (null pointers, zero lengths)
        // and every pointer set below points into `self`, which outlives the call.
        let mut iov: [libc::iovec; BATCH] = unsafe { MaybeUninit::zeroed().assume_init() };
        let mut headers: [libc::mmsghdr; BATCH] = unsafe { MaybeUninit::zeroed().assume_init() };
        for (i, (chunk, (io, header))) in self
            .received
            .chunks_exact_mut(RECEIVE_BUFFER)
            .zip(iov.iter_mut().zip(headers.iter_mut()))
            .enumerate()
        {
            io.iov_base = chunk.as_mut_ptr().cast();
            io.iov_len = RECEIVE_BUFFER;
            header.msg_hdr.msg_iov = io;
            header.msg_hdr.msg_iovlen = 1;
            header.msg_hdr.msg_name = (&raw mut self.sources[i]).cast();
            header.msg_hdr.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        }
        // SAFETY: `headers` describes BATCH valid buffers and address slots.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                headers.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        for (i, header) in headers.iter().enumerate().take(n) {
            self.received_len[i] = (header.msg_len as usize).min(RECEIVE_BUFFER);
            self.received_truncated[i] = header.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
            self.source_lens[i] = header.msg_hdr.msg_namelen;
        }
        Ok(n)
    }

    /// Sends answers `from..count`; returns how many went out.
    fn send(&mut self, fd: i32, from: usize, count: usize) -> io::Result<usize> {
        // SAFETY: as in `receive`.
        let mut iov: [libc::iovec; BATCH] = unsafe { MaybeUninit::zeroed().assume_init() };
        let mut headers: [libc::mmsghdr; BATCH] = unsafe { MaybeUninit::zeroed().assume_init() };
        let pending = count - from;
        for k in 0..pending {
            let slot = from + k;
            let source = self.destinations[slot];
            iov[k].iov_base = self.answers[slot * ANSWER_BUFFER..].as_mut_ptr().cast();
            iov[k].iov_len = self.answer_len[slot];
            headers[k].msg_hdr.msg_iov = &raw mut iov[k];
            headers[k].msg_hdr.msg_iovlen = 1;
            headers[k].msg_hdr.msg_name = (&raw mut self.sources[source]).cast();
            headers[k].msg_hdr.msg_namelen = self.source_lens[source];
        }
        // SAFETY: `headers[..pending]` describes valid answers and addresses.
        let n = unsafe { libc::sendmmsg(fd, headers.as_mut_ptr(), pending as libc::c_uint, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

/// The socket address in a `sockaddr_storage` the kernel filled in.
fn socket_addr(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let v4: &libc::sockaddr_in = unsafe { &*(storage as *const _ as *const _) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr)),
                u16::from_be(v4.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let v6: &libc::sockaddr_in6 = unsafe { &*(storage as *const _ as *const _) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(v6.sin6_addr.s6_addr),
                u16::from_be(v6.sin6_port),
                v6.sin6_flowinfo,
                v6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// Metric handles of the fast path, kept per socket loop so that counting an
/// answer is an atomic add, not a label lookup.
struct FastMetrics {
    metrics: Arc<crate::metrics::Metrics>,
    queries: HashMap<(RecordType, ResponseCode), Counter>,
    duration: Histogram,
}

impl FastMetrics {
    fn new(metrics: Arc<crate::metrics::Metrics>) -> Self {
        let duration = metrics
            .dns_query_duration
            .get_or_create(&DnsZoneLabels { zone: "rune" })
            .clone();
        FastMetrics {
            metrics,
            queries: HashMap::new(),
            duration,
        }
    }

    fn count(&mut self, qtype: RecordType, rcode: ResponseCode) {
        let metrics = &self.metrics;
        self.queries
            .entry((qtype, rcode))
            .or_insert_with(|| {
                metrics
                    .dns_queries
                    .get_or_create(&DnsQueryLabels {
                        r#type: <&'static str>::from(qtype),
                        rcode: rcode_label(rcode),
                        zone: "rune",
                    })
                    .clone()
            })
            .inc();
    }
}

/// Serves `socket` until `cancel` (on the calling thread: it blocks); the hickory
/// path's tasks run on `runtime`.
pub(super) fn serve(
    socket: UdpSocket,
    handler: Arc<Handler>,
    cancel: CancellationToken,
    runtime: tokio::runtime::Handle,
) {
    if let Err(error) = socket
        .set_nonblocking(false)
        .and_then(|()| socket.set_read_timeout(Some(STOP_CHECK)))
    {
        tracing::error!(%error, "DNS UDP socket cannot be set up; not serving it");
        return;
    }
    let socket = Arc::new(socket);
    let fd = socket.as_raw_fd();
    let mut buffers = Buffers::new();
    let mut metrics = FastMetrics::new(handler.metrics.clone());
    let recursion_available = handler.forwarder.is_some();
    while !cancel.is_cancelled() {
        let received = match buffers.receive(fd) {
            Ok(n) => n,
            Err(error)
                if matches!(
                    error.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(error) => {
                tracing::error!(%error, "DNS UDP socket failed; no longer serving it");
                return;
            }
        };
        let started = Instant::now();
        let zone = handler.zone.load();
        let mut answered = 0;
        for i in 0..received {
            let source = socket_addr(&buffers.sources[i]);
            // hickory answers nobody at port 0 (nor at an unknown family).
            let Some(source) = source.filter(|s| s.port() != 0) else {
                continue;
            };
            let slot = answered;
            let fast = if buffers.received_truncated[i] {
                None
            } else {
                let (received, answers) = (&buffers.received, &mut buffers.answers);
                let query =
                    &received[i * RECEIVE_BUFFER..i * RECEIVE_BUFFER + buffers.received_len[i]];
                let out = &mut answers[slot * ANSWER_BUFFER..(slot + 1) * ANSWER_BUFFER];
                fast::answer(&zone, query, recursion_available, out)
            };
            match fast {
                Some(done) => {
                    buffers.answer_len[slot] = done.len;
                    buffers.destinations[slot] = i;
                    answered += 1;
                    metrics.count(done.qtype, done.rcode);
                    metrics.duration.observe(started.elapsed().as_secs_f64());
                }
                None => {
                    let packet = buffers.datagram(i).to_vec();
                    runtime.spawn(answer_slowly(
                        handler.clone(),
                        socket.clone(),
                        packet,
                        source,
                    ));
                }
            }
        }
        drop(zone);
        let mut sent = 0;
        while sent < answered {
            match buffers.send(fd, sent, answered) {
                Ok(n) => sent += n.max(1),
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => {
                    // The first pending answer could not be sent (its client is
                    // gone, say): skip it, send the rest.
                    tracing::debug!(%error, "DNS UDP answer not sent");
                    sent += 1;
                }
            }
        }
    }
}

/// Answers one datagram through hickory, as hickory-server's UDP loop does: no
/// answer to fewer than 12 bytes or to a response, FORMERR to what does not parse.
async fn answer_slowly(
    handler: Arc<Handler>,
    socket: Arc<UdpSocket>,
    packet: Vec<u8>,
    source: SocketAddr,
) {
    let header = match Header::read(&mut BinDecoder::new(&packet)) {
        Ok(header) => header,
        Err(_) => return,
    };
    let responder = UdpResponder {
        socket,
        destination: source,
    };
    match Request::from_bytes(packet, source, Protocol::Udp) {
        Ok(request) => {
            if request.metadata.message_type == MessageType::Response {
                return;
            }
            handler
                .handle_request::<_, TokioTime>(&request, responder)
                .await;
        }
        Err(error) => {
            tracing::debug!(%error, %source, "malformed DNS query");
            // No question is read back from a message that does not parse.
            let Ok(queries) = Queries::read(&mut BinDecoder::new(&[]), 0) else {
                return;
            };
            let response = MessageResponseBuilder::new(&queries, None)
                .error_msg(&header.metadata, ResponseCode::FormErr);
            let mut responder = responder;
            if let Err(error) = responder.send_response(response).await {
                tracing::debug!(%error, "FORMERR not sent");
            }
        }
    }
}

/// Sends one hickory response to one client over the shared socket, limited to the
/// client's UDP payload size as hickory-server does.
#[derive(Clone)]
struct UdpResponder {
    socket: Arc<UdpSocket>,
    destination: SocketAddr,
}

#[async_trait::async_trait]
impl ResponseHandler for UdpResponder {
    async fn send_response<'a>(
        &mut self,
        response: MessageResponse<
            '_,
            'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
        >,
    ) -> Result<ResponseInfo, NetError> {
        let (info, bytes) = encode_udp_response(response)?;
        // The loop's thread blocks on this socket: never block here, wait a little
        // when its buffer is full.
        let destination = socket2::SockAddr::from(self.destination);
        for _ in 0..SEND_TRIES {
            match socket2::SockRef::from(&*self.socket).send_to_with_flags(
                &bytes,
                &destination,
                libc::MSG_DONTWAIT,
            ) {
                Ok(_) => return Ok(info),
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                Err(error) => return Err(error.into()),
            }
        }
        Err(io::Error::from(io::ErrorKind::WouldBlock).into())
    }
}

/// Encodes a hickory response for UDP as hickory-server does: limited to the
/// client's EDNS payload size (512 bytes without EDNS), records that do not fit left
/// out and TC set; SERVFAIL when the response does not encode.
pub(super) fn encode_udp_response<'a>(
    response: MessageResponse<
        '_,
        'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
    >,
) -> Result<(ResponseInfo, Vec<u8>), NetError> {
    let id = response.metadata().id;
    let limit = response.edns().map_or(512, |e| e.max_payload());
    let mut bytes = Vec::with_capacity(512);
    let mut encoder = BinEncoder::new(&mut bytes);
    encoder.set_max_size(limit);
    let info = match response.destructive_emit(&mut encoder) {
        Ok(info) => info,
        Err(error) => {
            tracing::error!(%error, "DNS response does not encode; SERVFAIL");
            bytes.clear();
            let mut encoder = BinEncoder::new(&mut bytes);
            let mut metadata = Metadata::new(id, MessageType::Response, OpCode::Query);
            metadata.response_code = ResponseCode::ServFail;
            let header = Header {
                metadata,
                counts: HeaderCounts::default(),
            };
            header.emit(&mut encoder)?;
            ResponseInfo::from(header)
        }
    };
    Ok((info, bytes))
}
