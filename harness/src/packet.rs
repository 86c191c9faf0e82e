//! Hand-built Ethernet frames (IPv4 with optional options, IPv6; TCP or UDP) with
//! full, valid checksums, and a parser that recomputes every checksum from scratch,
//! for tests that feed packets to eBPF programs through `BPF_PROG_TEST_RUN`.

use std::net::IpAddr;

use anyhow::{bail, ensure};

/// IP protocol number of TCP.
pub const TCP: u8 = 6;
/// IP protocol number of UDP.
pub const UDP: u8 = 17;

/// A TCP or UDP packet to build.
#[derive(Clone, Debug)]
pub struct PacketSpec {
    /// Source address (the family decides IPv4 or IPv6; both must agree).
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// [`TCP`] or [`UDP`].
    pub proto: u8,
    /// Payload after the transport header.
    pub payload: Vec<u8>,
    /// IPv4 options (a multiple of 4 bytes, at most 40); ignored for IPv6.
    pub ip_options: Vec<u8>,
    /// UDP over IPv4 only: send checksum 0 ("no checksum").
    pub udp_zero_checksum: bool,
    /// TCP only: the flags byte ([`TCP_SYN`] by default).
    pub tcp_flags: u8,
    /// TCP only: the sequence number.
    pub seq: u32,
    /// TCP only: the acknowledgment number.
    pub ack: u32,
}

/// TCP flag FIN.
pub const TCP_FIN: u8 = 0x01;
/// TCP flag SYN.
pub const TCP_SYN: u8 = 0x02;
/// TCP flag RST.
pub const TCP_RST: u8 = 0x04;
/// TCP flag ACK.
pub const TCP_ACK: u8 = 0x10;

impl PacketSpec {
    /// A TCP SYN-like packet with a small payload.
    pub fn tcp(src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> Self {
        Self {
            src,
            dst,
            sport,
            dport,
            proto: TCP,
            payload: b"rune tcp payload".to_vec(),
            ip_options: Vec::new(),
            udp_zero_checksum: false,
            tcp_flags: TCP_SYN,
            seq: 0x0102_0304,
            ack: 0,
        }
    }

    /// A UDP datagram with a small payload.
    pub fn udp(src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> Self {
        Self {
            proto: UDP,
            payload: b"rune udp payload!".to_vec(),
            ..Self::tcp(src, sport, dst, dport)
        }
    }

    /// The frame: Ethernet + IP + TCP/UDP + payload, every checksum valid.
    pub fn build(&self) -> Vec<u8> {
        let l4 = self.l4_header_and_payload();
        let mut frame = Vec::new();
        frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x02]); // dst MAC
        frame.extend_from_slice(&[0x02, 0, 0, 0, 0, 0x01]); // src MAC
        let (ip, pseudo) = match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                frame.extend_from_slice(&0x0800u16.to_be_bytes());
                assert!(self.ip_options.len().is_multiple_of(4) && self.ip_options.len() <= 40);
                let ihl = 5 + self.ip_options.len() / 4;
                let total = ihl * 4 + l4.len();
                let mut ip = vec![0x40 | ihl as u8, 0];
                ip.extend_from_slice(&(total as u16).to_be_bytes());
                ip.extend_from_slice(&[0x12, 0x34, 0x40, 0x00, 64, self.proto, 0, 0]);
                ip.extend_from_slice(&s.octets());
                ip.extend_from_slice(&d.octets());
                ip.extend_from_slice(&self.ip_options);
                let c = checksum(&ip);
                ip[10..12].copy_from_slice(&c.to_be_bytes());
                (
                    ip,
                    pseudo_v4(&s.octets(), &d.octets(), self.proto, l4.len()),
                )
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                frame.extend_from_slice(&0x86ddu16.to_be_bytes());
                let mut ip = vec![0x60, 0, 0, 0];
                ip.extend_from_slice(&(l4.len() as u16).to_be_bytes());
                ip.extend_from_slice(&[self.proto, 64]);
                ip.extend_from_slice(&s.octets());
                ip.extend_from_slice(&d.octets());
                (
                    ip,
                    pseudo_v6(&s.octets(), &d.octets(), self.proto, l4.len()),
                )
            }
            _ => panic!("source and destination families differ"),
        };
        frame.extend_from_slice(&ip);
        let mut l4 = l4;
        let check_at = if self.proto == TCP { 16 } else { 6 };
        let zero = self.proto == UDP && self.udp_zero_checksum && self.src.is_ipv4();
        if !zero {
            let mut all = pseudo;
            all.extend_from_slice(&l4);
            let mut c = checksum(&all);
            if self.proto == UDP && c == 0 {
                c = 0xffff;
            }
            l4[check_at..check_at + 2].copy_from_slice(&c.to_be_bytes());
        }
        frame.extend_from_slice(&l4);
        frame
    }

    fn l4_header_and_payload(&self) -> Vec<u8> {
        let mut l4 = Vec::new();
        l4.extend_from_slice(&self.sport.to_be_bytes());
        l4.extend_from_slice(&self.dport.to_be_bytes());
        if self.proto == TCP {
            l4.extend_from_slice(&self.seq.to_be_bytes());
            l4.extend_from_slice(&self.ack.to_be_bytes());
            l4.extend_from_slice(&[0x50, self.tcp_flags]); // data offset 5
            l4.extend_from_slice(&64240u16.to_be_bytes()); // window
            l4.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent
        } else {
            let len = 8 + self.payload.len();
            l4.extend_from_slice(&(len as u16).to_be_bytes());
            l4.extend_from_slice(&[0, 0]);
        }
        l4.extend_from_slice(&self.payload);
        l4
    }
}

/// A TCP/UDP frame read back, with its checksums verified by recomputing them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parsed {
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// Source port.
    pub sport: u16,
    /// Destination port.
    pub dport: u16,
    /// IP protocol.
    pub proto: u8,
    /// The TCP/UDP checksum field as found.
    pub l4_checksum: u16,
    /// TCP: the flags byte (0 for UDP).
    pub tcp_flags: u8,
    /// TCP: the sequence number (0 for UDP).
    pub seq: u32,
    /// TCP: the acknowledgment number (0 for UDP).
    pub ack: u32,
    /// Bytes after the transport header (TCP: after its options).
    pub payload_len: usize,
}

/// Parses `frame` and checks that the IPv4 header checksum and the TCP/UDP
/// checksum equal fully recomputed ones (a UDP/IPv4 checksum of 0 must be 0 and is
/// accepted as "none").
pub fn parse_and_verify(frame: &[u8]) -> anyhow::Result<Parsed> {
    ensure!(frame.len() >= 14, "short frame");
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let ip = &frame[14..];
    let (src, dst, proto, l4, pseudo): (IpAddr, IpAddr, u8, &[u8], Vec<u8>) = match ethertype {
        0x0800 => {
            let ihl = usize::from(ip[0] & 0xf) * 4;
            let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            let mut hdr = ip[..ihl].to_vec();
            let found = u16::from_be_bytes([hdr[10], hdr[11]]);
            hdr[10..12].fill(0);
            let want = checksum(&hdr);
            ensure!(
                found == want,
                "IPv4 header checksum {found:#06x}, recomputed {want:#06x}"
            );
            let s: [u8; 4] = ip[12..16].try_into()?;
            let d: [u8; 4] = ip[16..20].try_into()?;
            let l4 = &ip[ihl..total];
            (
                s.into(),
                d.into(),
                ip[9],
                l4,
                pseudo_v4(&s, &d, ip[9], l4.len()),
            )
        }
        0x86dd => {
            let len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            let s: [u8; 16] = ip[8..24].try_into()?;
            let d: [u8; 16] = ip[24..40].try_into()?;
            let l4 = &ip[40..40 + len];
            (
                s.into(),
                d.into(),
                ip[6],
                l4,
                pseudo_v6(&s, &d, ip[6], l4.len()),
            )
        }
        other => bail!("ethertype {other:#06x}"),
    };
    let check_at = match proto {
        TCP => 16,
        UDP => 6,
        other => bail!("protocol {other}"),
    };
    let found = u16::from_be_bytes([l4[check_at], l4[check_at + 1]]);
    if !(proto == UDP && found == 0 && src.is_ipv4()) {
        let mut all = pseudo;
        all.extend_from_slice(l4);
        all[pseudo_len(src) + check_at..pseudo_len(src) + check_at + 2].fill(0);
        let mut want = checksum(&all);
        if proto == UDP && want == 0 {
            want = 0xffff;
        }
        ensure!(
            found == want,
            "L4 checksum {found:#06x}, recomputed {want:#06x}"
        );
    }
    let (tcp_flags, seq, ack, header) = if proto == TCP {
        let word = |i: usize| u32::from_be_bytes([l4[i], l4[i + 1], l4[i + 2], l4[i + 3]]);
        (l4[13], word(4), word(8), usize::from(l4[12] >> 4) * 4)
    } else {
        (0, 0, 0, 8)
    };
    Ok(Parsed {
        src,
        dst,
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dport: u16::from_be_bytes([l4[2], l4[3]]),
        proto,
        l4_checksum: found,
        tcp_flags,
        seq,
        ack,
        payload_len: l4.len().saturating_sub(header),
    })
}

fn pseudo_len(addr: IpAddr) -> usize {
    if addr.is_ipv4() { 12 } else { 40 }
}

fn pseudo_v4(s: &[u8; 4], d: &[u8; 4], proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(s);
    p.extend_from_slice(d);
    p.extend_from_slice(&[0, proto]);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    p
}

fn pseudo_v6(s: &[u8; 16], d: &[u8; 16], proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(s);
    p.extend_from_slice(d);
    p.extend_from_slice(&(len as u32).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, proto]);
    p
}

/// The Internet checksum (RFC 1071) of `bytes`: the complement of the folded
/// ones'-complement sum of big-endian 16-bit words (odd length padded with zero).
pub fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for chunk in bytes.chunks(2) {
        let word = u16::from_be_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]);
        sum += u32::from(word);
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An ICMP or ICMPv6 error read back, its checksums verified by recomputing them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IcmpError {
    /// Source of the error (outer IP header).
    pub src: IpAddr,
    /// Destination of the error.
    pub dst: IpAddr,
    /// ICMP type.
    pub icmp_type: u8,
    /// ICMP code.
    pub code: u8,
    /// The quoted datagram (its IP header and what follows, as carried).
    pub quote: Vec<u8>,
}

/// Parses an Ethernet frame carrying an ICMP (IPv4) or ICMPv6 message, checking the
/// IPv4 header checksum, the lengths and the ICMP checksum (ICMPv6: with the
/// pseudo header).
pub fn parse_icmp_error(frame: &[u8]) -> anyhow::Result<IcmpError> {
    ensure!(frame.len() >= 14, "short frame");
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let ip = &frame[14..];
    let (src, dst, msg, pseudo): (IpAddr, IpAddr, &[u8], Vec<u8>) = match ethertype {
        0x0800 => {
            ensure!(
                ip.len() >= 20 && ip[0] == 0x45,
                "IPv4 header {:02x?}",
                &ip[..1]
            );
            ensure!(ip[9] == 1, "protocol {}, not ICMP", ip[9]);
            let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            ensure!(
                total == ip.len(),
                "IP total length {total}, frame has {}",
                ip.len()
            );
            let mut hdr = ip[..20].to_vec();
            hdr[10..12].fill(0);
            let want = checksum(&hdr);
            let found = u16::from_be_bytes([ip[10], ip[11]]);
            ensure!(
                found == want,
                "IPv4 checksum {found:#06x}, recomputed {want:#06x}"
            );
            let s: [u8; 4] = ip[12..16].try_into()?;
            let d: [u8; 4] = ip[16..20].try_into()?;
            (s.into(), d.into(), &ip[20..], Vec::new())
        }
        0x86dd => {
            ensure!(ip.len() >= 40 && ip[0] >> 4 == 6, "IPv6 header");
            ensure!(ip[6] == 58, "next header {}, not ICMPv6", ip[6]);
            let len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            ensure!(
                len == ip.len() - 40,
                "payload length {len}, frame has {}",
                ip.len() - 40
            );
            let s: [u8; 16] = ip[8..24].try_into()?;
            let d: [u8; 16] = ip[24..40].try_into()?;
            (s.into(), d.into(), &ip[40..], pseudo_v6(&s, &d, 58, len))
        }
        other => bail!("ethertype {other:#06x}"),
    };
    ensure!(msg.len() >= 8, "short ICMP message");
    let mut all = pseudo;
    let at = all.len();
    all.extend_from_slice(msg);
    all[at + 2..at + 4].fill(0);
    let want = checksum(&all);
    let found = u16::from_be_bytes([msg[2], msg[3]]);
    ensure!(
        found == want,
        "ICMP checksum {found:#06x}, recomputed {want:#06x}"
    );
    Ok(IcmpError {
        src,
        dst,
        icmp_type: msg[0],
        code: msg[1],
        quote: msg[8..].to_vec(),
    })
}
