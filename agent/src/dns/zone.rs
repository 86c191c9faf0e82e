//! The `rune.` zone as an immutable table of precomputed answers, rebuilt from the
//! endpoint cache's views and looked up per (lower-cased name, type).
//!
//! A lookup is one hash probe and a scan of at most a handful of record sets: no
//! allocation, no lock. Names are lower-cased by hickory on the wire
//! ([`LowerName`]), so lookups are case-insensitive.

use crate::{agent::Mode, endpoints::ServiceView, model::Protocol};
use hickory_proto::{
    op::ResponseCode,
    rr::{
        LowerName, Name, RData, Record, RecordType,
        rdata::{A, AAAA, NS, PTR, SOA, SRV},
    },
};
use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr},
};

/// SOA refresh, retry and expire (seconds): nothing transfers this zone, the values
/// only have to be sane.
const SOA_REFRESH: i32 = 3600;
const SOA_RETRY: i32 = 600;
const SOA_EXPIRE: i32 = 86_400;

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
    pub source: hickory_proto::ProtoError,
}

/// Whether a name is one the server answers for, for the `zone` metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Authority {
    /// Inside the zone (or a VIP's reverse name): answered authoritatively.
    Zone,
    /// Anywhere else: forwarded upstream, or refused when there is no upstream.
    Other,
}

/// The answer to one question, borrowed from the zone.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Answer<'z> {
    /// The response code.
    pub rcode: ResponseCode,
    /// Whether the AA flag is set.
    pub authoritative: bool,
    /// The answer section.
    pub answers: &'z [Record],
    /// The authority section (the SOA on NXDOMAIN and empty answers).
    pub authority: &'z [Record],
    /// In the zone or not.
    pub authority_kind: Authority,
}

/// The record sets of one owner name; empty for an empty non-terminal
/// (`default.rune.` when `web.default.rune.` exists).
#[derive(Debug, Default)]
struct Node {
    rrsets: Vec<(RecordType, Vec<Record>)>,
}

impl Node {
    fn push(&mut self, record: Record) {
        let rtype = record.record_type();
        match self.rrsets.iter_mut().find(|(t, _)| *t == rtype) {
            Some((_, records)) => {
                if !records.contains(&record) {
                    records.push(record);
                }
            }
            None => self.rrsets.push((rtype, vec![record])),
        }
    }
}

/// One immutable version of the zone.
#[derive(Debug)]
pub struct Zone {
    origin: LowerName,
    names: HashMap<LowerName, Node>,
    soa: [Record; 1],
}

impl Zone {
    /// The zone for `views` with SOA serial `serial` (the cache revision).
    pub fn build<'v>(
        config: &ZoneConfig,
        serial: u32,
        views: impl IntoIterator<Item = &'v ServiceView>,
    ) -> Result<Zone, InvalidDomain> {
        let origin = Name::from_ascii(&config.domain).map_err(|source| InvalidDomain {
            domain: config.domain.clone(),
            source,
        })?;
        let mut origin = origin.to_lowercase();
        origin.set_fqdn(true);
        let ttl = config.ttl;
        let host = |label: &str| {
            Name::from_ascii(label)
                .and_then(|l| l.append_domain(&origin))
                .map_err(|source| InvalidDomain {
                    domain: config.domain.clone(),
                    source,
                })
        };
        let mname = host("ns")?;
        let rname = host("hostmaster")?;
        let soa = Record::from_rdata(
            origin.clone(),
            ttl,
            RData::SOA(SOA::new(
                mname.clone(),
                rname,
                serial,
                SOA_REFRESH,
                SOA_RETRY,
                SOA_EXPIRE,
                ttl,
            )),
        );
        let mut zone = Zone {
            origin: LowerName::new(&origin),
            names: HashMap::new(),
            soa: [soa.clone()],
        };
        zone.insert(soa);
        zone.insert(Record::from_rdata(
            origin.clone(),
            ttl,
            RData::NS(NS(mname)),
        ));

        let dev = config.mode == Mode::Dev;
        for view in views {
            let svc = &view.service;
            let name = match Name::from_ascii(format!(
                "{}.{}",
                svc.metadata.name, svc.metadata.namespace
            ))
            .and_then(|n| n.append_domain(&origin))
            {
                Ok(n) => n.to_lowercase(),
                Err(error) => {
                    tracing::warn!(service = %view.key(), %error, "service name is not a DNS name; not in DNS");
                    continue;
                }
            };
            // Make the name exist even without addresses (NOERROR, empty answer).
            zone.names.entry(LowerName::new(&name)).or_default();
            zone.insert_parents(&name);
            if dev {
                zone.insert(Record::from_rdata(
                    name.clone(),
                    ttl,
                    RData::A(A(Ipv4Addr::LOCALHOST)),
                ));
            } else {
                let addresses: Vec<IpAddr> = if svc.spec.discovery.headless {
                    view.endpoints
                        .iter()
                        .flat_map(|e| e.spec.endpoints.iter())
                        .filter(|e| e.accepts_new())
                        .map(|e| e.address)
                        .collect()
                } else {
                    svc.spec.discovery.vips.clone()
                };
                for ip in addresses {
                    zone.insert(address_record(&name, ttl, ip));
                }
                if !svc.spec.discovery.headless {
                    for vip in &svc.spec.discovery.vips {
                        let mut reverse = Name::from(*vip);
                        reverse.set_fqdn(true);
                        zone.insert(Record::from_rdata(
                            reverse,
                            ttl,
                            RData::PTR(PTR(name.clone())),
                        ));
                    }
                }
            }
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
                zone.insert_parents(&srv_name);
                zone.insert(Record::from_rdata(
                    srv_name,
                    ttl,
                    RData::SRV(SRV::new(0, 0, number, name.clone())),
                ));
            }
        }
        Ok(zone)
    }

    fn insert(&mut self, record: Record) {
        self.names
            .entry(LowerName::new(&record.name))
            .or_default()
            .push(record);
    }

    /// Makes every name between `name` and the apex exist (empty non-terminals), so
    /// that `default.rune.` answers NOERROR rather than NXDOMAIN.
    fn insert_parents(&mut self, name: &Name) {
        let mut parent = name.base_name();
        while parent.num_labels() > self.origin.num_labels() {
            self.names.entry(LowerName::new(&parent)).or_default();
            parent = parent.base_name();
        }
    }

    /// The zone's apex.
    pub fn origin(&self) -> &LowerName {
        &self.origin
    }

    /// Answers one question.
    pub fn lookup(&self, name: &LowerName, qtype: RecordType) -> Answer<'_> {
        if let Some(node) = self.names.get(name) {
            let rrset = node
                .rrsets
                .iter()
                .find(|(t, _)| *t == qtype || qtype == RecordType::ANY);
            return match rrset {
                Some((_, records)) => Answer {
                    rcode: ResponseCode::NoError,
                    authoritative: true,
                    answers: records,
                    authority: &[],
                    authority_kind: Authority::Zone,
                },
                None => Answer {
                    rcode: ResponseCode::NoError,
                    authoritative: true,
                    answers: &[],
                    authority: &self.soa,
                    authority_kind: Authority::Zone,
                },
            };
        }
        if self.origin.zone_of(name) {
            return Answer {
                rcode: ResponseCode::NXDomain,
                authoritative: true,
                answers: &[],
                authority: &self.soa,
                authority_kind: Authority::Zone,
            };
        }
        Answer {
            rcode: ResponseCode::Refused,
            authoritative: false,
            answers: &[],
            authority: &[],
            authority_kind: Authority::Other,
        }
    }
}

fn address_record(name: &Name, ttl: u32, ip: IpAddr) -> Record {
    let rdata = match ip {
        IpAddr::V4(v4) => RData::A(A(v4)),
        IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
    };
    Record::from_rdata(name.clone(), ttl, rdata)
}
