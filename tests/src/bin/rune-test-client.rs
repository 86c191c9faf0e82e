//! A tiny client for socket-level tests, run as a child process (e.g. inside a test
//! cgroup, see `rune_harness::cgroup`):
//!
//! ```text
//! rune-test-client tcp|udp-connected|udp-unconnected ADDR [COUNT]
//! ```
//!
//! Each round opens a fresh socket to ADDR, sends the line "hello\n", reads one reply
//! (a line for TCP, a datagram for UDP) and prints one JSON line:
//! `{"reply": ..., "peer": ..., "local": ...}`. `peer` is what `getpeername` returns
//! (TCP, connected UDP) or the address `recvfrom` reported (unconnected UDP); for
//! connected UDP `from` is the `recvfrom` address as well. COUNT (default 1) repeats
//! the round. Every wait is bounded by 5 s; any failure exits with status 1 and one
//! line on stderr.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    process::ExitCode,
    time::Duration,
};

const TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST: &[u8] = b"hello\n";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rune-test-client: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = || "usage: rune-test-client tcp|udp-connected|udp-unconnected ADDR [COUNT]";
    let (mode, addr) = match args.as_slice() {
        [mode, addr] | [mode, addr, _] => (mode.as_str(), addr.as_str()),
        _ => return Err(usage().into()),
    };
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| format!("bad address {addr:?}: {e}"))?;
    let count: u32 = match args.get(2) {
        Some(n) => n.parse().map_err(|e| format!("bad count {n:?}: {e}"))?,
        None => 1,
    };
    for round in 0..count {
        let line = match mode {
            "tcp" => tcp(addr),
            "udp-connected" => udp_connected(addr),
            "udp-unconnected" => udp_unconnected(addr),
            _ => return Err(usage().into()),
        }
        .map_err(|e| format!("{mode} {addr} (round {}): {e}", round + 1))?;
        println!("{line}");
    }
    Ok(())
}

fn tcp(addr: SocketAddr) -> Result<serde_json::Value, String> {
    let stream = TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(TIMEOUT)))
        .map_err(|e| format!("setting timeouts: {e}"))?;
    let peer = stream
        .peer_addr()
        .map_err(|e| format!("getpeername: {e}"))?;
    let local = stream
        .local_addr()
        .map_err(|e| format!("getsockname: {e}"))?;
    (&stream)
        .write_all(REQUEST)
        .map_err(|e| format!("send: {e}"))?;
    let mut reply = String::new();
    BufReader::new(&stream)
        .read_line(&mut reply)
        .map_err(|e| format!("reading the reply: {e}"))?;
    if reply.is_empty() {
        return Err("the server closed without a reply".into());
    }
    Ok(serde_json::json!({
        "reply": reply.trim_end(),
        "peer": peer.to_string(),
        "local": local.to_string(),
    }))
}

fn udp_socket(addr: SocketAddr) -> Result<UdpSocket, String> {
    let any: SocketAddr = if addr.is_ipv4() {
        "0.0.0.0:0".parse().expect("literal")
    } else {
        "[::]:0".parse().expect("literal")
    };
    let socket = UdpSocket::bind(any).map_err(|e| format!("bind: {e}"))?;
    socket
        .set_read_timeout(Some(TIMEOUT))
        .and_then(|()| socket.set_write_timeout(Some(TIMEOUT)))
        .map_err(|e| format!("setting timeouts: {e}"))?;
    Ok(socket)
}

fn udp_connected(addr: SocketAddr) -> Result<serde_json::Value, String> {
    let socket = udp_socket(addr)?;
    socket.connect(addr).map_err(|e| format!("connect: {e}"))?;
    let peer = socket
        .peer_addr()
        .map_err(|e| format!("getpeername: {e}"))?;
    socket.send(REQUEST).map_err(|e| format!("send: {e}"))?;
    let mut buf = [0u8; 1500];
    let (len, from) = socket
        .recv_from(&mut buf)
        .map_err(|e| format!("waiting for the reply: {e}"))?;
    let local = socket
        .local_addr()
        .map_err(|e| format!("getsockname: {e}"))?;
    Ok(serde_json::json!({
        "reply": String::from_utf8_lossy(&buf[..len]).trim_end(),
        "peer": peer.to_string(),
        "from": from.to_string(),
        "local": local.to_string(),
    }))
}

fn udp_unconnected(addr: SocketAddr) -> Result<serde_json::Value, String> {
    let socket = udp_socket(addr)?;
    socket
        .send_to(REQUEST, addr)
        .map_err(|e| format!("sendto: {e}"))?;
    let mut buf = [0u8; 1500];
    let (len, from) = socket
        .recv_from(&mut buf)
        .map_err(|e| format!("waiting for the reply: {e}"))?;
    let local = socket
        .local_addr()
        .map_err(|e| format!("getsockname: {e}"))?;
    Ok(serde_json::json!({
        "reply": String::from_utf8_lossy(&buf[..len]).trim_end(),
        "peer": from.to_string(),
        "local": local.to_string(),
    }))
}
