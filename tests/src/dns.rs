//! Raw DNS exchanges for the DNS tests: loopback only, bounded by a timeout.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

/// Sends one query over TCP (two-byte length prefix, RFC 1035 §4.2.2) and returns
/// the raw answer; panics on a non-loopback server, a timeout or a short read.
pub fn exchange_tcp(server: SocketAddr, query: &[u8], timeout: Duration) -> Vec<u8> {
    assert!(server.ip().is_loopback(), "tests query loopback only");
    let mut s = TcpStream::connect_timeout(&server, timeout).unwrap();
    s.set_read_timeout(Some(timeout)).unwrap();
    s.write_all(&(query.len() as u16).to_be_bytes()).unwrap();
    s.write_all(query).unwrap();
    let mut len = [0u8; 2];
    s.read_exact(&mut len).unwrap();
    let mut buf = vec![0u8; u16::from_be_bytes(len) as usize];
    s.read_exact(&mut buf).unwrap();
    buf
}
