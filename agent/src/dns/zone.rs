//! The `rune.` zone: answers kept ready in wire form per (lower-cased name, type), in
//! an immutable, sharded table that the server reads without a lock and a
//! [`ZoneWriter`] updates per cache delta.
//!
//! Each name's record sets are stored as the bytes a response carries after the
//! owner name (type, class, TTL, length, data), so the UDP fast path copies them
//! behind a pointer to the question, and the hickory path decodes them on demand.
//! A delta rewrites only the shards holding the names of the services it changes
//! (copy on write): the zone is never rebuilt whole, and an update never holds two
//! whole zones at once.
//!
//! Here the zone's storage and lookups; [`ZoneWriter`] in `writer`.

use crate::{config::Mode, endpoints::ServiceView};
use hickory_proto::{
    ProtoError,
    op::ResponseCode,
    rr::{LowerName, Name, Record, RecordType},
    serialize::binary::{BinDecodable, BinDecoder, BinEncodable, BinEncoder, NameEncoding},
};
use std::{collections::HashMap, sync::Arc};

mod writer;

pub use writer::ZoneWriter;

/// SOA refresh, retry and expire (seconds): nothing transfers this zone, the values
/// only have to be sane.
const SOA_REFRESH: i32 = 3600;
const SOA_RETRY: i32 = 600;
const SOA_EXPIRE: i32 = 86_400;

/// Shards of the name table: a delta copies only the shards it touches.
const SHARDS: usize = 256;

/// Type, class, TTL and RDLENGTH: the fixed part of a record after its owner name.
const RR_FIXED: usize = 10;

/// What a zone is built from, besides the services.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZoneConfig {
    /// The zone's apex, e.g. `rune.` (lower case, absolute).
    pub domain: String,
    /// TTL of every record, and the negative-caching TTL in the SOA.
    pub ttl: u32,
    /// Dev mode: every service name answers A 127.0.0.1 (where the dev proxies
    /// listen), no AAAA, no PTR.
    pub mode: Mode,
    /// Dev mode: added to SRV ports, as the dev proxies add it to service ports.
    pub dev_port_offset: u16,
}

/// A zone setting the DNS server cannot use.
#[derive(Debug, thiserror::Error)]
#[error("invalid DNS domain {domain:?}")]
pub struct InvalidDomain {
    /// The rejected domain.
    pub domain: String,
    /// Why hickory refused it.
    #[source]
    pub source: ProtoError,
}

/// Whether a name is one the server answers for, for the `zone` metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Authority {
    /// Inside the zone (or a VIP's reverse name): answered authoritatively.
    Zone,
    /// Anywhere else: forwarded upstream, or refused when there is no upstream.
    Other,
}

/// The records of one record set in wire form, each without its owner name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireRecords<'z> {
    /// How many records `bytes` holds.
    pub count: u16,
    /// Type, class, TTL, RDLENGTH and RDATA of each record, back to back.
    pub bytes: &'z [u8],
}

impl<'z> WireRecords<'z> {
    const EMPTY: WireRecords<'static> = WireRecords {
        count: 0,
        bytes: &[],
    };

    /// Each record's bytes (after the owner name).
    pub fn iter(&self) -> impl Iterator<Item = &'z [u8]> + 'z {
        let mut rest = self.bytes;
        std::iter::from_fn(move || {
            let len = RR_FIXED + usize::from(u16::from_be_bytes([*rest.get(8)?, *rest.get(9)?]));
            let (record, tail) = rest.split_at_checked(len)?;
            rest = tail;
            Some(record)
        })
    }
}

/// The answer to one question, borrowed from the zone in wire form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireAnswer<'z> {
    /// The response code.
    pub rcode: ResponseCode,
    /// Whether the AA flag is set.
    pub authoritative: bool,
    /// The answer section; every record's owner is the question's name.
    pub answers: WireRecords<'z>,
    /// The SOA record (with its owner, the apex) when the authority section holds it
    /// (NXDOMAIN and empty answers).
    pub authority: Option<&'z [u8]>,
    /// In the zone or not.
    pub authority_kind: Authority,
}

/// The answer to one question as hickory records (the slow path's view).
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    /// The response code.
    pub rcode: ResponseCode,
    /// Whether the AA flag is set.
    pub authoritative: bool,
    /// The answer section.
    pub answers: Vec<Record>,
    /// The authority section (the SOA on NXDOMAIN and empty answers).
    pub authority: Vec<Record>,
    /// In the zone or not.
    pub authority_kind: Authority,
}

/// Bytes before each record set's records in [`RRsets`]: its type (2), record
/// count (2) and byte length (4).
const SET_HEADER: usize = 8;

/// The record sets of one owner name in one allocation (none when it has no
/// records): per set its type, record count and byte length (big-endian, 2 + 2 + 4
/// bytes), then its records in wire form. One box instead of a vector of sets each
/// boxing its records, so a name in the zone costs one allocation.
#[derive(Clone, Debug, Default)]
struct RRsets(Box<[u8]>);

/// One record set inside [`RRsets`]: its type and records.
struct SetAt<'z> {
    rtype: RecordType,
    records: WireRecords<'z>,
}

impl RRsets {
    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Each record set, in the order they were added.
    fn iter(&self) -> impl Iterator<Item = SetAt<'_>> {
        let bytes = &self.0[..];
        let mut at = 0;
        std::iter::from_fn(move || {
            let header = bytes.get(at..at + SET_HEADER)?;
            let rtype = RecordType::from(u16::from_be_bytes([header[0], header[1]]));
            let count = u16::from_be_bytes([header[2], header[3]]);
            let len = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
            let end = (at + SET_HEADER).checked_add(usize::try_from(len).ok()?)?;
            let records = bytes.get(at + SET_HEADER..end)?;
            at = end;
            Some(SetAt {
                rtype,
                records: WireRecords {
                    count,
                    bytes: records,
                },
            })
        })
    }

    /// The set answering `qtype` (the first one for ANY).
    fn find(&self, qtype: RecordType) -> Option<WireRecords<'_>> {
        self.iter()
            .find(|s| s.rtype == qtype || qtype == RecordType::ANY)
            .map(|s| s.records)
    }

    /// These sets with set `rtype`'s records replaced by `records` (`count` of
    /// them; the set left out when `count` is 0).
    fn with_set(&self, rtype: RecordType, count: u16, records: &[u8]) -> RRsets {
        let mut out = Vec::with_capacity(self.0.len() + SET_HEADER + records.len());
        let push = |out: &mut Vec<u8>, rtype: RecordType, count: u16, records: &[u8]| {
            if count == 0 {
                return;
            }
            out.extend_from_slice(&u16::from(rtype).to_be_bytes());
            out.extend_from_slice(&count.to_be_bytes());
            // A set holds at most u16::MAX records of at most 64 KiB each.
            out.extend_from_slice(&(records.len() as u32).to_be_bytes());
            out.extend_from_slice(records);
        };
        let mut replaced = false;
        for set in self.iter() {
            if set.rtype == rtype {
                push(&mut out, rtype, count, records);
                replaced = true;
            } else {
                push(&mut out, set.rtype, set.records.count, set.records.bytes);
            }
        }
        if !replaced {
            push(&mut out, rtype, count, records);
        }
        RRsets(out.into_boxed_slice())
    }
}

/// The record sets of one owner name and how many service names lie at or below it
/// (a name with no records but a count above zero is an empty non-terminal, such as
/// `default.rune.` when `web.default.rune.` exists); at a service's name, the
/// service as last applied (what to take out when it changes), shared with the
/// endpoint cache.
#[derive(Clone, Debug, Default)]
struct Node {
    refs: u32,
    rrsets: RRsets,
    service: Option<ServiceView>,
}

impl Node {
    fn add(&mut self, rtype: RecordType, record: &[u8]) {
        let current = self
            .rrsets
            .iter()
            .find(|s| s.rtype == rtype)
            .map_or(WireRecords::EMPTY, |s| s.records);
        if current.iter().any(|r| r == record) || current.count == u16::MAX {
            return;
        }
        let mut bytes = Vec::with_capacity(current.bytes.len() + record.len());
        bytes.extend_from_slice(current.bytes);
        bytes.extend_from_slice(record);
        self.rrsets = self.rrsets.with_set(rtype, current.count + 1, &bytes);
    }

    fn remove(&mut self, rtype: RecordType, record: &[u8]) {
        let Some(current) = self.rrsets.iter().find(|s| s.rtype == rtype) else {
            return;
        };
        let records = current.records;
        let Some(pos) = records.iter().position(|r| r == record) else {
            return;
        };
        let kept: Vec<u8> = records
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != pos)
            .flat_map(|(_, r)| r.iter().copied())
            .collect();
        self.rrsets = self.rrsets.with_set(rtype, records.count - 1, &kept);
    }
}

type Shard = HashMap<Box<[u8]>, Node>;

/// The shard of a lower-cased wire name (FNV-1a).
fn shard_of(name: &[u8]) -> usize {
    let mut hash: u32 = 0x811c_9dc5;
    for &b in name {
        hash = (hash ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    (hash as usize) % SHARDS
}

/// One immutable version of the zone.
#[derive(Debug)]
pub struct Zone {
    origin: LowerName,
    /// The apex in lower-cased wire form.
    origin_wire: Box<[u8]>,
    /// The SOA record in wire form with its owner (for authority sections).
    soa: Box<[u8]>,
    /// The SOA record without its owner (for answers at the apex).
    soa_answer: Box<[u8]>,
    shards: Vec<Arc<Shard>>,
}

/// The lower-cased wire form of a name.
fn wire(name: &Name) -> Box<[u8]> {
    let mut bytes = Vec::with_capacity(name.len() + 2);
    {
        let mut encoder = BinEncoder::new(&mut bytes);
        let mut encoder = encoder.with_name_encoding(NameEncoding::UncompressedLowercase);
        // Encoding a valid name into a vector cannot fail.
        let _ = name.emit(&mut encoder);
    }
    bytes.into_boxed_slice()
}

impl Zone {
    /// The zone for `views` with SOA serial `serial`, built in one go.
    pub fn build<'v>(
        config: &ZoneConfig,
        serial: u32,
        views: impl IntoIterator<Item = &'v ServiceView>,
    ) -> Result<Zone, InvalidDomain> {
        let mut writer = ZoneWriter::new(config)?;
        writer.add_all(views);
        Ok(writer.publish(serial))
    }

    /// The zone's apex.
    pub fn origin(&self) -> &LowerName {
        &self.origin
    }

    /// Answers one question for a lower-cased wire name, in wire form.
    pub fn lookup_wire(&self, name: &[u8], qtype: RecordType) -> WireAnswer<'_> {
        let nodata = WireAnswer {
            rcode: ResponseCode::NoError,
            authoritative: true,
            answers: WireRecords::EMPTY,
            authority: Some(&self.soa),
            authority_kind: Authority::Zone,
        };
        if let Some(node) = self.shards[shard_of(name)].get(name) {
            if *name == *self.origin_wire && matches!(qtype, RecordType::SOA | RecordType::ANY) {
                return WireAnswer {
                    answers: WireRecords {
                        count: 1,
                        bytes: &self.soa_answer,
                    },
                    authority: None,
                    ..nodata
                };
            }
            return match node.rrsets.find(qtype) {
                Some(answers) => WireAnswer {
                    answers,
                    authority: None,
                    ..nodata
                },
                None => nodata,
            };
        }
        if is_subdomain_wire(name, &self.origin_wire) {
            return WireAnswer {
                rcode: ResponseCode::NXDomain,
                ..nodata
            };
        }
        WireAnswer {
            rcode: ResponseCode::Refused,
            authoritative: false,
            answers: WireRecords::EMPTY,
            authority: None,
            authority_kind: Authority::Other,
        }
    }

    /// Answers one question with hickory records (for the hickory path).
    pub fn lookup(&self, name: &LowerName, qtype: RecordType) -> Answer {
        let owner = wire(name);
        let answer = self.lookup_wire(&owner, qtype);
        let owner_name = Name::from(name);
        let answers = answer
            .answers
            .iter()
            .filter_map(|r| {
                let mut bytes = owner.to_vec();
                bytes.extend_from_slice(r);
                decode_record(&bytes, &owner_name)
            })
            .collect();
        let authority = answer
            .authority
            .and_then(|soa| decode_record(soa, &Name::from(&self.origin)))
            .into_iter()
            .collect();
        Answer {
            rcode: answer.rcode,
            authoritative: answer.authoritative,
            answers,
            authority,
            authority_kind: answer.authority_kind,
        }
    }
}

/// A record this module encoded, read back; its owner set to `owner` (which keeps
/// the case a client asked with, as the wire form is lower case).
fn decode_record(bytes: &[u8], owner: &Name) -> Option<Record> {
    let mut decoder = BinDecoder::new(bytes);
    match Record::read(&mut decoder) {
        Ok(mut record) => {
            record.name = owner.clone();
            Some(record)
        }
        Err(error) => {
            tracing::error!(%error, "DNS zone record does not decode");
            None
        }
    }
}

/// Whether wire name `name` equals or lies below wire name `apex` (label-aligned).
pub(crate) fn is_subdomain_wire(name: &[u8], apex: &[u8]) -> bool {
    let mut at = 0;
    while at < name.len() {
        if name[at..] == *apex {
            return true;
        }
        at += 1 + usize::from(name[at]);
    }
    false
}
