//! [`ZoneWriter`]: keeps the zone current from the endpoint cache's deltas, each
//! service's records added and taken out as a unit, and publishes versions.

use super::{
    InvalidDomain, Node, SHARDS, SOA_EXPIRE, SOA_REFRESH, SOA_RETRY, Shard, Zone, ZoneConfig,
    shard_of, wire,
};
use crate::{
    config::Mode,
    endpoints::{Delta, ServiceView},
    model::{Protocol, ServiceKey},
};
use hickory_proto::{
    ProtoError,
    rr::{
        LowerName, Name, RData, Record, RecordType,
        rdata::{A, AAAA, NS, PTR, SOA, SRV},
    },
    serialize::binary::{BinEncodable, BinEncoder, NameEncoding},
};
use std::{
    collections::HashSet,
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

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
