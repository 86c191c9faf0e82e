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

use crate::{
    config::Mode,
    endpoints::{Delta, ServiceView},
    model::{Protocol, ServiceKey},
};
use hickory_proto::{
    ProtoError,
    op::ResponseCode,
    rr::{
        LowerName, Name, RData, Record, RecordType,
        rdata::{A, AAAA, NS, PTR, SOA, SRV},
    },
    serialize::binary::{BinDecodable, BinDecoder, BinEncodable, BinEncoder, NameEncoding},
};
use std::{
    collections::{HashMap, HashSet},
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

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

/// One record of a service: its owner (lower-cased wire name), type, and bytes
/// after the owner name.
type OwnedRecord = (Box<[u8]>, RecordType, Box<[u8]>);

/// The records one service puts in the zone.
#[derive(Debug, Default)]
struct Contribution {
    /// The service's records.
    records: Vec<OwnedRecord>,
    /// Names in the zone that exist because of the service (its own name and SRV
    /// names): they and their ancestors below the apex are counted.
    names: Vec<Box<[u8]>>,
    /// Reverse names (outside the zone): counted themselves only.
    reverse: Vec<Box<[u8]>>,
}

/// Keeps a zone current from the endpoint cache's deltas and publishes versions.
#[derive(Debug)]
pub struct ZoneWriter {
    config: ZoneConfig,
    origin: Name,
    origin_wire: Box<[u8]>,
    mname: Name,
    rname: Name,
    shards: Vec<Arc<Shard>>,
    services: usize,
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

/// A record in wire form without its owner name, and its owner's wire length.
fn record_bytes(record: &Record) -> Box<[u8]> {
    let mut bytes = Vec::with_capacity(64);
    {
        let mut encoder = BinEncoder::new(&mut bytes);
        let mut encoder = encoder.with_name_encoding(NameEncoding::Uncompressed);
        // Encoding records built from valid names into a vector cannot fail.
        let _ = record.emit(&mut encoder);
    }
    let owner = wire(&record.name).len();
    bytes.split_off(owner.min(bytes.len())).into_boxed_slice()
}

impl ZoneWriter {
    /// An empty zone for `config`. Fails when the domain is not a valid name.
    pub fn new(config: &ZoneConfig) -> Result<Self, InvalidDomain> {
        let invalid = |source| InvalidDomain {
            domain: config.domain.clone(),
            source,
        };
        let mut origin = Name::from_ascii(&config.domain)
            .map_err(invalid)?
            .to_lowercase();
        origin.set_fqdn(true);
        let host = |label: &str| {
            Name::from_ascii(label)
                .and_then(|l| l.append_domain(&origin))
                .map_err(invalid)
        };
        let mname = host("ns")?;
        let rname = host("hostmaster")?;
        let origin_wire = wire(&origin);
        let mut writer = ZoneWriter {
            config: config.clone(),
            origin: origin.clone(),
            origin_wire: origin_wire.clone(),
            mname: mname.clone(),
            rname,
            shards: (0..SHARDS).map(|_| Arc::default()).collect(),
            services: 0,
        };
        let ns = Record::from_rdata(origin, config.ttl, RData::NS(NS(mname)));
        let apex = writer.node_mut(&origin_wire);
        apex.refs = 1;
        apex.add(RecordType::NS, &record_bytes(&ns));
        Ok(writer)
    }

    fn node_mut(&mut self, name: &[u8]) -> &mut Node {
        let shard = Arc::make_mut(&mut self.shards[shard_of(name)]);
        if !shard.contains_key(name) {
            shard.insert(name.into(), Node::default());
        }
        // Just inserted when missing.
        shard.get_mut(name).unwrap_or_else(|| unreachable!())
    }

    /// Drops `name`'s node when nothing keeps it (no records, no count).
    fn prune(&mut self, name: &[u8]) {
        let index = shard_of(name);
        let empty = self.shards[index]
            .get(name)
            .is_some_and(|n| n.refs == 0 && n.rrsets.is_empty());
        if empty {
            Arc::make_mut(&mut self.shards[index]).remove(name);
        }
    }

    /// Applies one cache delta: only the services it names are touched.
    pub fn apply(&mut self, delta: Delta) {
        if delta.full {
            let all: Vec<ServiceView> = self
                .shards
                .iter()
                .flat_map(|shard| shard.values().filter_map(|n| n.service.clone()))
                .collect();
            for view in &all {
                self.take_service(&view.key());
                self.remove(view);
            }
        }
        for key in &delta.removed {
            if let Some(view) = self.take_service(key) {
                self.remove(&view);
            }
        }
        for view in delta.upserted {
            if let Some(old) = self.take_service(&view.key()) {
                self.remove(&old);
            }
            self.add(&view);
        }
    }

    /// Adds every view (for a zone built in one go).
    pub fn add_all<'v>(&mut self, views: impl IntoIterator<Item = &'v ServiceView>) {
        for view in views {
            if let Some(old) = self.take_service(&view.key()) {
                self.remove(&old);
            }
            self.add(view);
        }
    }

    /// Services in the zone.
    pub fn services(&self) -> usize {
        self.services
    }

    /// The DNS name of a service, lower case; an error when it is not a DNS name.
    fn service_name(&self, namespace: &str, name: &str) -> Result<Name, ProtoError> {
        Name::from_ascii(format!("{name}.{namespace}"))
            .and_then(|n| n.append_domain(&self.origin))
            .map(|n| n.to_lowercase())
    }

    /// Takes the service `key` out of its name's node; `None` when the zone does not
    /// hold it.
    fn take_service(&mut self, key: &ServiceKey) -> Option<ServiceView> {
        let name = wire(&self.service_name(&key.namespace, &key.name).ok()?);
        let held = self.shards[shard_of(&name)]
            .get(&name)
            .is_some_and(|n| n.service.is_some());
        if !held {
            return None;
        }
        self.services -= 1;
        self.node_mut(&name).service.take()
    }

    fn add(&mut self, view: &ServiceView) {
        let contribution = self.contribution(view);
        let Some(own) = contribution.names.first() else {
            return;
        };
        self.services += 1;
        self.node_mut(own).service = Some(view.clone());
        for name in &contribution.names {
            self.for_name_and_parents(name, |node| node.refs += 1);
        }
        for name in &contribution.reverse {
            self.node_mut(name).refs += 1;
        }
        for (owner, rtype, record) in &contribution.records {
            self.node_mut(owner).add(*rtype, record);
        }
    }

    fn remove(&mut self, view: &ServiceView) {
        let contribution = self.contribution(view);
        for (owner, rtype, record) in &contribution.records {
            let index = shard_of(owner);
            if self.shards[index].contains_key(&owner[..]) {
                self.node_mut(owner).remove(*rtype, record);
            }
        }
        for name in &contribution.names {
            self.for_name_and_parents(name, |node| node.refs = node.refs.saturating_sub(1));
        }
        for name in &contribution.reverse {
            if self.shards[shard_of(name)].contains_key(&name[..]) {
                let node = self.node_mut(name);
                node.refs = node.refs.saturating_sub(1);
            }
        }
        for (owner, _, _) in &contribution.records {
            self.prune(owner);
        }
        for name in contribution.names.iter().chain(&contribution.reverse) {
            self.prune(name);
        }
    }

    /// Runs `f` on `name`'s node and on each ancestor's below the apex, then drops
    /// the nodes nothing keeps.
    fn for_name_and_parents(&mut self, name: &[u8], f: impl Fn(&mut Node)) {
        let apex = self.origin_wire.len();
        let mut at = 0;
        let mut visited = Vec::new();
        while name.len() - at > apex {
            let suffix = &name[at..];
            f(self.node_mut(suffix));
            visited.push(at);
            let label = usize::from(name[at]);
            if label == 0 {
                break;
            }
            at += 1 + label;
        }
        for at in visited {
            self.prune(&name[at..]);
        }
    }

    /// The records and names `view` puts in the zone.
    fn contribution(&self, view: &ServiceView) -> Contribution {
        let mut out = Contribution::default();
        let config = &self.config;
        let ttl = config.ttl;
        let svc = &view.service;
        let name = match self.service_name(&svc.metadata.namespace, &svc.metadata.name) {
            Ok(n) => n,
            Err(error) => {
                tracing::warn!(service = %view.key(), %error, "service name is not a DNS name; not in DNS");
                return out;
            }
        };
        let name_wire = wire(&name);
        out.names.push(name_wire.clone());
        let push = |out: &mut Contribution, owner: &[u8], record: Record| {
            out.records
                .push((owner.into(), record.record_type(), record_bytes(&record)));
        };
        let dev = config.mode == Mode::Dev;
        // A headless service's SRV records name each endpoint (production only: in
        // dev mode clients go through the proxies).
        let headless = svc.spec.discovery.headless && !dev;
        if dev {
            let record = Record::from_rdata(name.clone(), ttl, RData::A(A(Ipv4Addr::LOCALHOST)));
            push(&mut out, &name_wire, record);
        } else {
            let addresses: Vec<IpAddr> = if headless {
                // Each address once, however many endpoints (ports) it has.
                let mut ready: Vec<IpAddr> = view
                    .endpoint_list()
                    .iter()
                    .filter(|e| e.accepts_new())
                    .map(|e| e.address)
                    .collect();
                let mut seen = HashSet::with_capacity(ready.len());
                ready.retain(|ip| seen.insert(*ip));
                ready
            } else {
                svc.spec.discovery.vips.clone()
            };
            for ip in addresses {
                push(&mut out, &name_wire, address_record(&name, ttl, ip));
            }
            if !svc.spec.discovery.headless {
                for vip in &svc.spec.discovery.vips {
                    let mut reverse = Name::from(*vip);
                    reverse.set_fqdn(true);
                    let reverse_wire = wire(&reverse);
                    let record = Record::from_rdata(reverse, ttl, RData::PTR(PTR(name.clone())));
                    push(&mut out, &reverse_wire, record);
                    out.reverse.push(reverse_wire);
                }
            }
        }
        // The endpoint names made so far (headless SRV targets).
        let mut named: HashSet<IpAddr> = HashSet::new();
        for port in svc.spec.ports.iter().filter(|p| !p.name.is_empty()) {
            let proto = match port.protocol {
                Protocol::Tcp => "_tcp",
                Protocol::Udp => "_udp",
            };
            let number = if dev {
                match port.port.checked_add(config.dev_port_offset) {
                    Some(p) => p,
                    None => continue,
                }
            } else {
                port.port
            };
            let srv_name = match Name::from_ascii(format!("_{}.{proto}", port.name))
                .and_then(|n| n.append_domain(&name))
            {
                Ok(n) => n.to_lowercase(),
                Err(error) => {
                    tracing::warn!(service = %view.key(), port = %port.name, %error, "port name is not a DNS label; no SRV record");
                    continue;
                }
            };
            let srv_wire = wire(&srv_name);
            out.names.push(srv_wire.clone());
            if !headless {
                let record = Record::from_rdata(
                    srv_name,
                    ttl,
                    RData::SRV(SRV::new(0, 0, number, name.clone())),
                );
                push(&mut out, &srv_wire, record);
                continue;
            }
            // One record per ready backend (address and port), naming the
            // endpoint's own address record: endpoints sharing an address differ
            // by port.
            for backend in view.port_backends(port) {
                if !backend.endpoint.accepts_new() {
                    continue;
                }
                let ip = backend.addr.ip();
                let target = match Name::from_ascii(endpoint_label(ip))
                    .and_then(|l| l.append_domain(&name))
                {
                    Ok(n) => n,
                    Err(error) => {
                        tracing::warn!(service = %view.key(), %ip, %error, "endpoint name too long; no SRV record");
                        continue;
                    }
                };
                if named.insert(ip) {
                    let target_wire = wire(&target);
                    out.names.push(target_wire.clone());
                    push(&mut out, &target_wire, address_record(&target, ttl, ip));
                }
                let srv = SRV::new(0, 0, backend.addr.port(), target);
                let record = Record::from_rdata(srv_name.clone(), ttl, RData::SRV(srv));
                push(&mut out, &srv_wire, record);
            }
        }
        out
    }

    /// The current zone, with SOA serial `serial` (the cache revision), sharing
    /// every shard with the writer (the next change copies the shards it touches).
    pub fn publish(&self, serial: u32) -> Zone {
        let ttl = self.config.ttl;
        let soa = Record::from_rdata(
            self.origin.clone(),
            ttl,
            RData::SOA(SOA::new(
                self.mname.clone(),
                self.rname.clone(),
                serial,
                SOA_REFRESH,
                SOA_RETRY,
                SOA_EXPIRE,
                ttl,
            )),
        );
        let soa_answer = record_bytes(&soa);
        let mut with_owner = self.origin_wire.to_vec();
        with_owner.extend_from_slice(&soa_answer);
        Zone {
            origin: LowerName::new(&self.origin),
            origin_wire: self.origin_wire.clone(),
            soa: with_owner.into_boxed_slice(),
            soa_answer,
            shards: self.shards.clone(),
        }
    }
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

/// The label of an endpoint's name below its headless service's (the target of its
/// SRV records): the address with `-` between its parts, `198-18-1-2`, or every
/// IPv6 group written out, `fd00-1-0-0-0-0-0-2` (no `::`, so never a leading `-`).
fn endpoint_label(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.octets().map(|o| o.to_string()).join("-"),
        IpAddr::V6(v6) => v6.segments().map(|g| format!("{g:x}")).join("-"),
    }
}

fn address_record(name: &Name, ttl: u32, ip: IpAddr) -> Record {
    let rdata = match ip {
        IpAddr::V4(v4) => RData::A(A(v4)),
        IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
    };
    Record::from_rdata(name.clone(), ttl, rdata)
}
