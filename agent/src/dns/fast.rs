//! The UDP fast path for zone answers: a well-formed, single-question query for a
//! name in the zone is answered straight from the zone's wire-form record sets,
//! without decoding the query into hickory's types or encoding a response from them.
//!
//! The response copies the query's id, RD and CD bits and question bytes (so the
//! client's case is kept), points each answer's owner at the question, adds an EDNS
//! OPT record when the query had one, and sets TC when the answer does not fit the
//! client's UDP limit. Anything else — a name outside the zone, another class, an
//! unusual opcode or flag, a compressed or malformed question, EDNS version other
//! than 0, trailing bytes — is left to the hickory path (`None`), which answers it
//! as before.

use super::zone::{Authority, Zone};
use hickory_proto::{op::ResponseCode, rr::RecordType};

/// The DNS header's length.
const HEADER: usize = 12;
/// The longest name in wire form (RFC 1035).
pub const MAX_NAME: usize = 255;
/// The UDP limit of a query without EDNS (RFC 1035).
const PLAIN_UDP_LIMIT: usize = 512;
/// OPT record type.
const OPT: u16 = 41;
/// A pointer to the question's name (offset 12).
const QNAME_POINTER: [u8; 2] = [0xc0, 0x0c];

/// What the fast path answered, for the metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FastAnswer {
    /// The response's length in the output buffer.
    pub len: usize,
    /// The question's type.
    pub qtype: RecordType,
    /// The response code.
    pub rcode: ResponseCode,
}

/// A query the fast path can answer, parsed.
struct Query {
    /// Where the question ends (after QTYPE and QCLASS).
    question_end: usize,
    /// Length of the lower-cased name in the caller's buffer.
    name_len: usize,
    qtype: RecordType,
    /// The client's UDP payload size when it sent EDNS.
    edns_payload: Option<u16>,
}

/// Parses `packet` as a query the fast path answers, lower-casing its name into
/// `lower`; `None` when anything about it is unusual.
fn parse(packet: &[u8], lower: &mut [u8; MAX_NAME]) -> Option<Query> {
    if packet.len() < HEADER + 5 {
        return None;
    }
    // QR = 0, OPCODE = QUERY, AA = TC = 0 (RD may be set).
    if packet[2] & 0xfe != 0 {
        return None;
    }
    // RA = Z = 0, RCODE = 0 (AD and CD may be set).
    if packet[3] & 0xcf != 0 {
        return None;
    }
    let count = |at: usize| u16::from_be_bytes([packet[at], packet[at + 1]]);
    let additionals = count(10);
    if count(4) != 1 || count(6) != 0 || count(8) != 0 || additionals > 1 {
        return None;
    }
    let mut at = HEADER;
    let mut name_len = 0;
    loop {
        let len = usize::from(*packet.get(at)?);
        // Compression pointers and extended label types are left to hickory.
        if len > 63 || name_len + 1 + len > MAX_NAME {
            return None;
        }
        let label = packet.get(at..at + 1 + len)?;
        for (dst, src) in lower[name_len..name_len + 1 + len].iter_mut().zip(label) {
            *dst = src.to_ascii_lowercase();
        }
        // The length byte is below 64, so lower-casing left it alone.
        name_len += 1 + len;
        at += 1 + len;
        if len == 0 {
            break;
        }
    }
    let fixed = packet.get(at..at + 4)?;
    let qtype = u16::from_be_bytes([fixed[0], fixed[1]]);
    let qclass = u16::from_be_bytes([fixed[2], fixed[3]]);
    // IN only; meta types (OPT, zone transfers, MAILA/MAILB) go to hickory.
    if qclass != 1 || matches!(qtype, 0 | OPT | 251..=254) {
        return None;
    }
    let question_end = at + 4;
    let mut edns_payload = None;
    let mut end = question_end;
    if additionals == 1 {
        // OPT with the root name, EDNS version 0, no extended RCODE.
        let opt = packet.get(end..end + 11)?;
        if opt[0] != 0 || u16::from_be_bytes([opt[1], opt[2]]) != OPT || opt[5] != 0 || opt[6] != 0
        {
            return None;
        }
        edns_payload = Some(u16::from_be_bytes([opt[3], opt[4]]));
        end += 11 + usize::from(u16::from_be_bytes([opt[9], opt[10]]));
    }
    if end != packet.len() {
        return None;
    }
    Some(Query {
        question_end,
        name_len,
        qtype: RecordType::from(qtype),
        edns_payload,
    })
}

/// Answers `packet` from `zone` into `out` when the fast path can; `None` leaves the
/// query to the hickory path. `recursion_available` is the RA bit (whether names
/// outside the zone are forwarded).
pub fn answer(
    zone: &Zone,
    packet: &[u8],
    recursion_available: bool,
    out: &mut [u8],
) -> Option<FastAnswer> {
    let mut lower = [0u8; MAX_NAME];
    let query = parse(packet, &mut lower)?;
    let found = zone.lookup_wire(&lower[..query.name_len], query.qtype);
    if found.authority_kind != Authority::Zone {
        return None;
    }
    let limit = match query.edns_payload {
        Some(payload) => usize::from(payload).max(PLAIN_UDP_LIMIT),
        None => PLAIN_UDP_LIMIT,
    };
    // An answer that a larger buffer would hold whole is the hickory path's job.
    let truncate_at = if limit <= out.len() { limit } else { out.len() };
    let question = &packet[HEADER..query.question_end];
    let mut len = HEADER + question.len();
    if len > truncate_at {
        return None;
    }
    out[HEADER..len].copy_from_slice(question);
    let mut truncated = false;
    let mut answers: u16 = 0;
    for record in found.answers.iter() {
        let end = len + QNAME_POINTER.len() + record.len();
        if end > truncate_at {
            truncated = true;
            break;
        }
        out[len..len + 2].copy_from_slice(&QNAME_POINTER);
        out[len + 2..end].copy_from_slice(record);
        len = end;
        answers += 1;
    }
    let mut authorities: u16 = 0;
    if let Some(soa) = found.authority {
        if len + soa.len() <= truncate_at {
            out[len..len + soa.len()].copy_from_slice(soa);
            len += soa.len();
            authorities = 1;
        } else {
            truncated = true;
        }
    }
    let mut additionals: u16 = 0;
    if query.edns_payload.is_some() {
        // OPT: root name, type 41, our payload size (the client's, at least 512),
        // extended RCODE 0, version 0, no flags, no options.
        let payload = u16::try_from(limit).unwrap_or(u16::MAX).to_be_bytes();
        let opt = [0, 0, 41, payload[0], payload[1], 0, 0, 0, 0, 0, 0];
        if len + opt.len() <= truncate_at {
            out[len..len + opt.len()].copy_from_slice(&opt);
            len += opt.len();
            additionals = 1;
        } else {
            truncated = true;
        }
    }
    if truncated && limit > out.len() {
        return None;
    }
    out[0] = packet[0];
    out[1] = packet[1];
    out[2] = 0x80
        | if found.authoritative { 0x04 } else { 0 }
        | if truncated { 0x02 } else { 0 }
        | (packet[2] & 0x01);
    out[3] = if recursion_available { 0x80 } else { 0 }
        | (packet[3] & 0x10)
        | (u16::from(found.rcode) & 0x0f) as u8;
    out[4..6].copy_from_slice(&1u16.to_be_bytes());
    out[6..8].copy_from_slice(&answers.to_be_bytes());
    out[8..10].copy_from_slice(&authorities.to_be_bytes());
    out[10..12].copy_from_slice(&additionals.to_be_bytes());
    Some(FastAnswer {
        len,
        qtype: query.qtype,
        rcode: found.rcode,
    })
}

#[cfg(test)]
mod tests;
