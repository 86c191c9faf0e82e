//! Unprivileged tests of the sync engine over [`FakeMaps`] and [`FaultyMaps`]: what
//! ends up in the maps for a set of services (golden file), that a change writes
//! only what differs, drain, restart adoption, and repair after failed writes. One
//! privileged test holds the fake to the kernel: the golden deltas applied to both
//! must leave the same maps ([`golden_deltas_leave_the_fake_and_the_kernel_maps_equal`]).

use super::{
    maps::{Capacity, FakeMaps, FaultyMaps, KernelMaps, LbMaps},
    sync::{LbSync, SyncError},
};
use crate::{
    endpoints::{Delta, EndpointCache, ServiceView},
    model::{ServiceKey, parse_documents},
    orderedlog::Snapshot,
};
use agent_common::codec::{backend_addr, backend_value, frontend_addr, frontend_key};
use agent_common::lb::{self, BACKEND_ACTIVE, BACKEND_DRAINING, Backend};
use aya::maps::{Array, Map, MapData};
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::{Duration, Instant},
};

const GOLDEN: &str = include_str!("testdata/golden.yaml");
const NODE: &str = "node-a";

/// The golden test's maps: 16 frontends, backend ids 1..63, 13-slot tables.
fn small() -> Capacity {
    Capacity {
        frontends: 16,
        backends: 64,
        table_size: 13,
        flows: 64,
    }
}

/// Every service's view, as the endpoint cache builds them from `yaml`.
fn views(yaml: &str) -> Vec<ServiceView> {
    let cache = EndpointCache::new();
    cache.apply_snapshot(&Snapshot {
        revision: 1,
        objects: parse_documents(yaml).unwrap(),
    });
    cache.views()
}

fn full(yaml: &str) -> Delta {
    Delta {
        revision: 1,
        full: true,
        upserted: views(yaml),
        removed: Vec::new(),
    }
}

/// An incremental delta with only service `name` of `yaml`.
fn only(yaml: &str, name: &str) -> Delta {
    let view = views(yaml)
        .into_iter()
        .find(|v| v.key() == key(name))
        .unwrap_or_else(|| panic!("no service {name}"));
    Delta {
        revision: 2,
        full: false,
        upserted: vec![view],
        removed: Vec::new(),
    }
}

fn key(name: &str) -> ServiceKey {
    ServiceKey::new("default", name)
}

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn synced(yaml: &str, capacity: Capacity, now: Instant) -> LbSync<FakeMaps> {
    let mut sync = LbSync::new(FakeMaps::new(capacity), NODE);
    sync.apply(&full(yaml), now).unwrap();
    sync
}

fn proto(p: u8) -> &'static str {
    match p {
        lb::PROTO_TCP => "TCP",
        lb::PROTO_UDP => "UDP",
        _ => "?",
    }
}

/// The backend address of `id` in `backends`, or a marker that makes a dangling id
/// visible.
fn backend_name(backends: &BTreeMap<u32, Backend>, id: u32) -> String {
    match backends.get(&id).and_then(backend_addr) {
        Some(a) => a.to_string(),
        None => format!("<no backend {id}>"),
    }
}

/// A sorted, readable dump of the maps (any [`LbMaps`]: the fake's or the kernel's,
/// read through the trait). Without `ids`, frontends and backends are listed by
/// address only (for comparing maps whose ids were allocated in another order);
/// tables are always shown as backend addresses.
fn dump(maps: &impl LbMaps, ids: bool) -> String {
    let cap = maps.capacity();
    let mut out = String::new();
    let mut fronts: Vec<(SocketAddr, u8, lb::ServiceValue)> = maps
        .frontends()
        .unwrap()
        .iter()
        .map(|(k, v)| {
            let (a, p) = frontend_addr(k);
            (a, p, *v)
        })
        .collect();
    let by_id: BTreeMap<u32, Backend> = maps.backends().unwrap().into_iter().collect();
    fronts.sort_by_key(|(a, p, _)| (*a, *p));
    out.push_str("frontends:\n");
    for (a, p, v) in &fronts {
        let id = if ids {
            format!(" id={}", v.id)
        } else {
            String::new()
        };
        let base = if v.maglev_base == v.id * cap.table_size {
            String::new()
        } else {
            format!(" BAD maglev_base={}", v.maglev_base)
        };
        writeln!(
            out,
            "  {a}/{}{id} maglev_size={} affinity={}{base}",
            proto(*p),
            v.maglev_size,
            v.affinity_timeout
        )
        .unwrap();
    }
    out.push_str("backends:\n");
    let mut backends: Vec<(SocketAddr, u32, Backend)> = by_id
        .iter()
        .map(|(id, b)| (backend_addr(b).unwrap(), *id, *b))
        .collect();
    backends.sort_by_key(|(a, id, _)| if ids { (*id, *a) } else { (0, *a) });
    for (a, id, b) in backends {
        let id = if ids { format!("{id} ") } else { String::new() };
        let family = match b.family {
            lb::FAMILY_V4 => "v4",
            lb::FAMILY_V6 => "v6",
            _ => "family?",
        };
        let state = match b.state {
            BACKEND_ACTIVE => "active",
            BACKEND_DRAINING => "draining",
            _ => "state?",
        };
        writeln!(out, "  {id}{a} {family} {state}").unwrap();
    }
    out.push_str("tables:\n");
    for (a, p, v) in fronts.iter().filter(|f| f.2.maglev_size > 0) {
        let table = maps.table(v.id).unwrap();
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for id in table {
            *counts.entry(backend_name(&by_id, *id)).or_default() += 1;
        }
        let counts: Vec<String> = counts.iter().map(|(b, n)| format!("{b}×{n}")).collect();
        writeln!(out, "  {a}/{}: {}", proto(*p), counts.join(", ")).unwrap();
        for (slot, id) in table.iter().enumerate() {
            writeln!(out, "    {slot:2} {}", backend_name(&by_id, *id)).unwrap();
        }
    }
    out
}

/// What must hold in any synced maps: tables name only active backends, frontend
/// ids are unique and below capacity, each frontend's table is its own.
fn check_invariants(maps: &FakeMaps) {
    let cap = maps.capacity();
    let mut ids = BTreeSet::new();
    for (k, v) in &maps.frontends {
        assert!(v.id < cap.frontends, "{k:?}: id {} out of range", v.id);
        assert!(ids.insert(v.id), "{k:?}: id {} used twice", v.id);
        assert_eq!(v.maglev_base, v.id * cap.table_size, "{k:?}");
        assert!(
            v.maglev_size == 0 || v.maglev_size == cap.table_size,
            "{k:?}"
        );
        if v.maglev_size > 0 {
            for slot in maps.table(v.id).unwrap() {
                let b = maps.backends[*slot as usize];
                assert!(
                    *slot != 0 && b.family != 0 && b.state == BACKEND_ACTIVE,
                    "{k:?} names backend {slot} = {b:?}"
                );
            }
        }
    }
    assert_eq!(
        maps.backends[0],
        Backend::default(),
        "backend id 0 is never used"
    );
    // The VIP prefilter lets exactly the frontends' bits through.
    let mut filter = vec![u64::MAX; agent_common::filter::VIP_FILTER_WORDS as usize];
    for k in maps.frontends.keys() {
        let bit = super::prefilter::bit_of(k);
        filter[(bit / 64) as usize] &= !(1 << (bit % 64));
    }
    assert!(
        maps.vip_filter == filter,
        "the VIP prefilter differs from the frontends"
    );
}

/// The lines that differ between `want` and `got`, numbered: `-want`, `+got`.
fn line_diff(want: &str, got: &str) -> String {
    let mut diff = String::new();
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    for i in 0..g.len().max(w.len()) {
        let (a, b) = (w.get(i).copied(), g.get(i).copied());
        if a != b {
            writeln!(diff, "line {}: -{}", i + 1, a.unwrap_or("<end>")).unwrap();
            writeln!(diff, "line {}: +{}", i + 1, b.unwrap_or("<end>")).unwrap();
        }
    }
    diff
}

fn golden_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/dataplane/ebpf/testdata/golden_maps.txt")
}

/// The maps for `testdata/golden.yaml` as node-a, compared with
/// `testdata/golden_maps.txt`. After an intended change, regenerate the expected
/// file with `RUNE_UPDATE_GOLDEN=1 cargo test -p rune-agent --lib dataplane::ebpf`
/// and review the diff by hand.
#[test]
fn golden_maps() {
    let sync = synced(GOLDEN, small(), Instant::now());
    check_invariants(sync.maps());
    let got = dump(sync.maps(), true);
    let path = golden_path();
    if std::env::var("RUNE_UPDATE_GOLDEN").as_deref() == Ok("1") {
        std::fs::write(&path, &got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    if got != want {
        let diff = line_diff(&want, &got);
        panic!(
            "maps differ from {} (- expected, + got); if the change is intended, rerun \
         with RUNE_UPDATE_GOLDEN=1 and review the file:\n{diff}",
            path.display()
        );
    }
}

#[test]
fn one_endpoint_change_writes_only_that_service() {
    let now = Instant::now();
    let mut sync = synced(GOLDEN, small(), now);
    let before = sync.maps().clone();
    sync.maps_mut().writes.clear();
    let changed = GOLDEN.replace(
        "- {address: 198.18.2.3, node: node-a}",
        "- {address: 198.18.2.4, node: node-a}",
    );
    assert_ne!(changed, GOLDEN);
    let old = sync.backend_id(&sa("198.18.2.3:80")).unwrap();
    sync.apply(&only(&changed, "local"), now).unwrap();
    let new = sync.backend_id(&sa("198.18.2.4:80")).unwrap();
    let frontend = sync
        .frontend_id(&frontend_key(ip("198.18.100.13"), 80, lb::PROTO_TCP))
        .unwrap();
    let mut writes = sync.maps().writes.clone();
    writes.sort();
    let mut want = vec![
        format!("put_backend {new}"), // the new endpoint, before any table names it
        format!("put_backend {old}"), // the old one: draining
        format!("table {frontend}"),
    ];
    want.sort();
    assert_eq!(writes, want);
    let maps = sync.maps();
    assert_eq!(maps.backends[old as usize].state, BACKEND_DRAINING);
    assert_eq!(maps.backends[new as usize].state, BACKEND_ACTIVE);
    // Nothing else moved: other frontends, their tables, other backends.
    assert_eq!(maps.frontends, before.frontends);
    let size = small().table_size as usize;
    for (i, (a, b)) in maps.maglev.iter().zip(&before.maglev).enumerate() {
        if i / size != frontend as usize {
            assert_eq!(a, b, "slot {i} of another frontend changed");
        }
    }
    check_invariants(maps);
}

/// A service with `addrs` as endpoints (port 80), VIP 198.18.100.20.
fn api(addrs: &[&str], drain: u32) -> String {
    let eps: Vec<String> = addrs.iter().map(|a| format!("{{address: {a}}}")).collect();
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: api}}\n\
     spec: {{ports: [{{port: 80}}], discovery: {{vips: [198.18.100.20]}}, drainSeconds: {drain}}}\n\
     ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: api}}\n\
     spec: {{endpoints: [{}]}}\n",
        eps.join(", ")
    )
}

#[test]
fn removing_one_of_five_backends_remaps_about_one_fifth() {
    let m = crate::maglev::DEFAULT_TABLE_SIZE;
    let cap = Capacity {
        frontends: 2,
        backends: 16,
        table_size: m,
        flows: 16,
    };
    let all = [
        "198.18.5.1",
        "198.18.5.2",
        "198.18.5.3",
        "198.18.5.4",
        "198.18.5.5",
    ];
    let now = Instant::now();
    let mut sync = synced(&api(&all, 30), cap, now);
    let fk = frontend_key(ip("198.18.100.20"), 80, lb::PROTO_TCP);
    let id = sync.frontend_id(&fk).unwrap();
    let gone = sync.backend_id(&sa("198.18.5.3:80")).unwrap();
    let before = sync.maps().table(id).unwrap().to_vec();
    sync.maps_mut().writes.clear();

    let rest = [all[0], all[1], all[3], all[4]];
    sync.apply(&only(&api(&rest, 30), "api"), now).unwrap();
    let after = sync.maps().table(id).unwrap().to_vec();
    assert!(!after.contains(&gone));
    let moved = |pred: &dyn Fn(u32) -> bool| {
        before
            .iter()
            .zip(&after)
            .filter(|(b, a)| pred(**b) && b != a)
            .count()
    };
    let total = moved(&|_| true);
    let survivors_moved = moved(&|b| b != gone);
    let (m, n) = (f64::from(m), 5.0);
    assert!(
        total as f64 <= m / n + 0.01 * m,
        "{total} of {m} slots changed"
    );
    assert!(
        survivors_moved as f64 <= 0.01 * m,
        "{survivors_moved} slots of surviving backends moved"
    );
    // Every slot of the removed backend moved, so at least ~1/N changed.
    assert!(total as f64 >= m / n - 1.0, "{total}");
    assert_eq!(
        sync.maps()
            .writes
            .iter()
            .filter(|w| w.starts_with("table"))
            .count(),
        1
    );
}

#[test]
fn terminating_endpoint_drains_then_is_purged() {
    let t0 = Instant::now();
    let addrs = ["198.18.5.1", "198.18.5.2", "198.18.5.3"];
    let mut sync = synced(&api(&addrs, 5), small(), t0);
    let [a, b, c] = addrs.map(|x| sync.backend_id(&sa(&format!("{x}:80"))).unwrap());
    sync.maps_mut().flows = vec![a, a, b, c];
    let fid = sync
        .frontend_id(&frontend_key(ip("198.18.100.20"), 80, lb::PROTO_TCP))
        .unwrap();

    let t1 = t0 + Duration::from_secs(1);
    let yaml = api(&addrs, 5).replace(
        "{address: 198.18.5.1}",
        "{address: 198.18.5.1, terminating: true}",
    );
    sync.apply(&only(&yaml, "api"), t1).unwrap();
    let maps = sync.maps();
    assert!(
        !maps.table(fid).unwrap().contains(&a),
        "out of the table at once"
    );
    assert_eq!(
        maps.backends[a as usize],
        backend_value(sa("198.18.5.1:80"), BACKEND_DRAINING)
    );
    assert_eq!(maps.flows, [a, a, b, c], "established flows stay");
    check_invariants(maps);

    // Still draining just before the deadline, also across an unrelated resync.
    sync.expire(t1 + Duration::from_secs(4)).unwrap();
    sync.apply(&full(&yaml), t1 + Duration::from_secs(4))
        .unwrap();
    assert_eq!(sync.maps().backends[a as usize].state, BACKEND_DRAINING);
    assert_eq!(sync.maps().flows.len(), 4);

    sync.expire(t1 + Duration::from_secs(5 + 1)).unwrap();
    let maps = sync.maps();
    assert_eq!(maps.backends[a as usize], Backend::default());
    assert_eq!(maps.flows, [b, c]);
    assert_eq!(sync.backend_id(&sa("198.18.5.1:80")), None);
    check_invariants(sync.maps());

    // Deleting the service frees its frontend and backends; ids are reused.
    sync.maps_mut().flows = vec![b, c, c];
    let t2 = t1 + Duration::from_secs(10);
    let delete = Delta {
        revision: 3,
        full: false,
        upserted: Vec::new(),
        removed: vec![key("api")],
    };
    sync.apply(&delete, t2).unwrap();
    let maps = sync.maps();
    assert!(maps.frontends.is_empty());
    assert!(maps.backends().unwrap().is_empty());
    assert!(maps.flows.is_empty());
    assert!(sync.backends().is_empty());
    let other = api(&["198.18.6.1", "198.18.6.2"], 5).replace("198.18.100.20", "198.18.100.21");
    sync.apply(&full(&other), t2).unwrap();
    let fk = frontend_key(ip("198.18.100.21"), 80, lb::PROTO_TCP);
    assert_eq!(sync.frontend_id(&fk), Some(fid));
    assert_eq!(BTreeSet::from([a, b, c]), BTreeSet::from([1, 2, 3]));
    let ids: BTreeSet<u32> = sync.backends().iter().map(|(_, id)| *id).collect();
    assert_eq!(ids, BTreeSet::from([1, 2]), "freed backend ids are reused");
}

#[test]
fn restart_adopts_the_maps_without_writing() {
    let now = Instant::now();
    let old = synced(GOLDEN, small(), now);
    let mut maps = old.maps().clone();
    maps.writes.clear();
    let mut new = LbSync::new(maps, NODE);
    new.apply(&full(GOLDEN), now + Duration::from_secs(3))
        .unwrap();
    assert_eq!(new.maps().writes, Vec::<String>::new());
    assert_eq!(
        new.backends(),
        old.backends(),
        "flows keep their backend ids"
    );
    assert_eq!(new.frontends(), old.frontends());
    assert_eq!(dump(new.maps(), true), dump(old.maps(), true));

    // A full delta without `local` removes exactly its entries.
    let local_backends: Vec<u32> = ["198.18.2.1:80", "198.18.2.3:80"]
        .map(|a| new.backend_id(&sa(a)).unwrap())
        .to_vec();
    new.maps_mut().writes.clear();
    new.maps_mut().flows = vec![local_backends[0], 1000];
    let mut delta = full(GOLDEN);
    delta.upserted.retain(|v| v.key() != key("local"));
    new.apply(&delta, now).unwrap();
    let mut writes = new.maps().writes.clone();
    writes.sort();
    let mut want: Vec<String> = ["198.18.100.13", "fd00:100::13"]
        .map(|v| {
            format!(
                "delete_frontend {:?}",
                frontend_key(ip(v), 80, lb::PROTO_TCP)
            )
        })
        .to_vec();
    want.extend(local_backends.iter().map(|id| format!("put_backend {id}")));
    want.sort();
    assert_eq!(writes, want);
    assert_eq!(new.maps().flows, [1000]);
    check_invariants(new.maps());
}

#[test]
fn restart_drains_an_endpoint_removed_while_no_agent_ran() {
    let t0 = Instant::now();
    let addrs = ["198.18.5.1", "198.18.5.2", "198.18.5.3"];
    let old = synced(&api(&addrs, 5), small(), t0);
    let [a, b, c] = addrs.map(|x| old.backend_id(&sa(&format!("{x}:80"))).unwrap());
    let fid = old
        .frontend_id(&frontend_key(ip("198.18.100.20"), 80, lb::PROTO_TCP))
        .unwrap();
    let mut maps = old.maps().clone();
    maps.flows = vec![a, b, c];

    // The next agent starts after 198.18.5.1 left the service.
    let t1 = t0 + Duration::from_secs(60);
    let mut new = LbSync::new(maps, NODE);
    new.apply(&full(&api(&addrs[1..], 5)), t1).unwrap();
    let maps = new.maps();
    assert!(!maps.table(fid).unwrap().contains(&a), "no new flows to it");
    assert_eq!(
        maps.backends[a as usize],
        backend_value(sa("198.18.5.1:80"), BACKEND_DRAINING),
        "its established flows drain, as with a running agent"
    );
    assert_eq!(maps.flows, [a, b, c]);
    assert_eq!(new.backend_id(&sa("198.18.5.2:80")), Some(b), "ids kept");
    check_invariants(maps);

    new.expire(t1 + Duration::from_secs(4)).unwrap();
    assert_eq!(new.maps().backends[a as usize].state, BACKEND_DRAINING);
    new.expire(t1 + Duration::from_secs(5 + 1)).unwrap();
    assert_eq!(new.maps().backends[a as usize], Backend::default());
    assert_eq!(new.maps().flows, [b, c]);
    check_invariants(new.maps());
}

#[test]
fn restart_deletes_what_an_earlier_agent_left() {
    let now = Instant::now();
    let clean = synced(GOLDEN, small(), now);
    let mut maps = FakeMaps::new(small());
    let orphan = frontend_key(ip("198.18.200.1"), 80, lb::PROTO_TCP);
    maps.put_frontend(
        &orphan,
        &lb::ServiceValue {
            id: 15,
            maglev_base: 15 * 13,
            maglev_size: 13,
            affinity_timeout: 0,
        },
    )
    .unwrap();
    maps.put_backend(63, &backend_value(sa("198.18.9.9:80"), BACKEND_ACTIVE))
        .unwrap();
    let fill: Vec<(usize, u32)> = (0..13).map(|slot| (slot, 63)).collect();
    maps.set_slots(15, &fill).unwrap();
    maps.flows = vec![63, 63];
    // A prefilter that lets nothing through, as a wrong pinned one would.
    maps.vip_filter.fill(u64::MAX);
    let mut sync = LbSync::new(maps, NODE);
    sync.apply(&full(GOLDEN), now).unwrap();
    assert!(!sync.maps().frontends.contains_key(&orphan));
    assert_eq!(sync.maps().backends[63], Backend::default());
    assert!(
        sync.maps().flows.is_empty(),
        "flows to the orphan backend purged"
    );
    assert_eq!(dump(sync.maps(), true), dump(clean.maps(), true));
    check_invariants(sync.maps());
}

/// `GOLDEN` changed: `prefer` gone, one web endpoint terminating and one new, a new
/// service.
fn golden2() -> String {
    let mut y = GOLDEN
        .replace(
            "- {address: 198.18.1.3, node: node-b, ports: {http: 8081}}",
            "- {address: 198.18.1.3, node: node-b, ports: {http: 8081}, terminating: true}\n    \
         - {address: 198.18.1.6, node: node-b}",
        )
        .replace("metadata: {name: prefer}", "metadata: {name: preferx}");
    y.push_str(
        "---\napiVersion: rune/v1\nkind: Service\nmetadata: {name: extra}\n\
     spec: {ports: [{port: 443}], discovery: {vips: [198.18.100.16]}}\n\
     ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: extra}\n\
     spec: {endpoints: [{address: 198.18.7.1}]}\n",
    );
    y
}

#[test]
fn failed_writes_are_repaired_by_the_next_full_sync() {
    let now = Instant::now();
    let g2 = golden2();
    assert!(g2.contains("198.18.1.6") && g2.contains("preferx"));
    // The clean references: GOLDEN then the changed state, and the changed state
    // from empty maps (where web's terminating endpoint never had a backend).
    let reference = |start: Option<&str>| {
        let mut clean = LbSync::new(FakeMaps::new(small()), NODE);
        if let Some(y) = start {
            clean.apply(&full(y), now).unwrap();
        }
        clean.maps_mut().writes.clear();
        clean.apply(&full(&g2), now).unwrap();
        (dump(clean.maps(), false), clean.maps().writes.len())
    };
    let (from_golden, from_empty) = (reference(Some(GOLDEN)), reference(None));
    assert!(from_golden.0.contains("198.18.1.3:8081 v4 draining"));
    assert!(!from_empty.0.contains("198.18.1.3"));
    assert!(from_golden.1 > 5 && from_empty.1 > 20);

    for (start, (want, writes)) in [(Some(GOLDEN), from_golden), (None, from_empty)] {
        for k in 0..writes {
            let faulty = FaultyMaps {
                inner: FakeMaps::new(small()),
                writes_left: None,
            };
            let mut sync = LbSync::new(faulty, NODE);
            if let Some(y) = start {
                sync.apply(&full(y), now).unwrap();
            }
            sync.maps_mut().writes_left = Some(k);
            let err = sync.apply(&full(&g2), now);
            assert!(
                matches!(err, Err(SyncError::Maps(_))),
                "k={k}: {err:?} after {k} of {writes} writes"
            );
            sync.maps_mut().writes_left = None;
            sync.apply(&full(&g2), now).unwrap();
            check_invariants(&sync.maps().inner);
            assert_eq!(
                dump(&sync.maps().inner, false),
                want,
                "start {:?}, k={k}",
                start.is_some()
            );
            // And an incremental delta afterwards works on the repaired state.
            sync.apply(&only(GOLDEN, "prefer"), now).unwrap();
            check_invariants(&sync.maps().inner);
        }
    }
}

#[test]
fn full_maps_name_the_setting_and_are_counted() {
    let yaml = "apiVersion: rune/v1\nkind: Service\nmetadata: {name: big}\n\
            spec: {ports: [{name: a, port: 80}, {name: b, port: 81}], \
            discovery: {vips: [198.18.100.30, \"fd00::30\"]}}\n";
    let cap = Capacity {
        frontends: 3,
        ..small()
    };
    let mut sync = LbSync::new(FakeMaps::new(cap), NODE);
    let err = sync.apply(&full(yaml), Instant::now()).unwrap_err();
    assert!(
        matches!(
            err,
            SyncError::Full {
                what: "frontends",
                capacity: 3,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("--lb-max-frontends"), "{err}");
    assert_eq!(sync.full_errors(), 1);

    let cap = Capacity {
        backends: 3, // ids 1 and 2
        ..small()
    };
    let mut sync = LbSync::new(FakeMaps::new(cap), NODE);
    let err = sync
        .apply(
            &full(&api(&["198.18.5.1", "198.18.5.2", "198.18.5.3"], 5)),
            Instant::now(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("--lb-max-backends"), "{err}");
    assert_eq!(sync.full_errors(), 1);
    // A map error is not a "full" error.
    let mut sync = LbSync::new(
        FaultyMaps {
            inner: FakeMaps::new(small()),
            writes_left: Some(0),
        },
        NODE,
    );
    assert!(sync.apply(&full(GOLDEN), Instant::now()).is_err());
    assert_eq!(sync.full_errors(), 0);
}

/// A VIP moving from one service to another in one delta stays programmed, in
/// whichever order the two services come.
#[test]
fn vip_moving_between_services_stays_programmed() {
    let svc = |name: &str, vip: &str| {
        format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
         spec: {{ports: [{{port: 80}}], discovery: {{vips: [{vip}]}}}}\n\
         ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\n\
         spec: {{endpoints: [{{address: 198.18.8.1}}]}}\n---\n"
        )
    };
    let moved = frontend_key(ip("198.18.100.40"), 80, lb::PROTO_TCP);
    for (from, to) in [("aaa", "zzz"), ("zzz", "aaa")] {
        let before = svc(from, "198.18.100.40") + &svc(to, "198.18.100.41");
        let after = svc(from, "198.18.100.42") + &svc(to, "198.18.100.40");
        let now = Instant::now();
        // As a full delta (services in key order)…
        let mut sync = synced(&before, small(), now);
        sync.apply(&full(&after), now).unwrap();
        assert!(
            sync.maps().frontends.contains_key(&moved),
            "{from} → {to}: full"
        );
        assert_eq!(sync.frontends().len(), 2);
        check_invariants(sync.maps());
        // …and as an incremental one.
        let mut sync = synced(&before, small(), now);
        let mut delta = full(&after);
        delta.full = false;
        sync.apply(&delta, now).unwrap();
        assert!(
            sync.maps().frontends.contains_key(&moved),
            "{from} → {to}: incremental"
        );
        assert_eq!(
            sync.frontends()
                .iter()
                .find(|(k, _, _)| *k == moved)
                .map(|(_, _, s)| s.name.clone()),
            Some(to.to_owned())
        );
        check_invariants(sync.maps());
    }
}

/// A drain that ends while a map write fails never leaves flows naming a freed
/// (and later reused) backend id.
#[test]
fn failed_release_never_strands_flows() {
    let t0 = Instant::now();
    let late = t0 + Duration::from_secs(60);
    let addrs = ["198.18.5.1", "198.18.5.2"];
    // Releasing a backend takes two writes (its flows, its slot): fail each.
    for k in 0..3 {
        let mut s = LbSync::new(
            FaultyMaps {
                inner: FakeMaps::new(small()),
                writes_left: None,
            },
            NODE,
        );
        s.apply(&full(&api(&addrs, 5)), t0).unwrap();
        let a = s.backend_id(&sa("198.18.5.1:80")).unwrap();
        let b = s.backend_id(&sa("198.18.5.2:80")).unwrap();
        s.maps_mut().inner.flows = vec![a, b];
        // .1 leaves the list: it drains for 5 s.
        s.apply(&only(&api(&addrs[1..], 5), "api"), t0).unwrap();
        assert_eq!(s.maps().inner.backends[a as usize].state, BACKEND_DRAINING);

        s.maps_mut().writes_left = Some(k);
        let result = s.expire(late);
        assert_eq!(result.is_err(), k < 2, "k={k}: {result:?}");
        s.maps_mut().writes_left = None;
        for id in &s.maps().inner.flows {
            assert_ne!(
                s.maps().inner.backends[*id as usize].family,
                0,
                "k={k}: a flow names freed backend {id}"
            );
        }
        // The repair, then a new endpoint, which takes the lowest free id.
        s.apply(&full(&api(&addrs[1..], 5)), late).unwrap();
        s.apply(&full(&api(&["198.18.5.2", "198.18.5.9"], 5)), late)
            .unwrap();
        assert_eq!(s.backend_id(&sa("198.18.5.9:80")), Some(a), "k={k}");
        assert_eq!(
            s.maps().inner.flows,
            [b],
            "k={k}: the flow to .1 must be gone"
        );
        check_invariants(&s.maps().inner);
    }
}

/// `count` services, each with its own VIP and three endpoints, the last one of
/// every fifth service also in the next service (shared backends).
fn many_services(count: u32) -> String {
    let mut yaml = String::new();
    for i in 0..count {
        let vip = format!("198.18.{}.{}", 100 + i / 250, i % 250 + 1);
        let (a, b) = (i / 200, i % 200);
        let shared = if i % 5 == 4 { i + 1 } else { i };
        let _ = write!(
            yaml,
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: s{i:04}}}\n\
         spec: {{ports: [{{port: 80, targetPort: 8080}}], discovery: {{vips: [{vip}]}}}}\n\
         ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: s{i:04}}}\n\
         spec: {{endpoints: [{{address: 198.18.{a}.{b}}}, {{address: 198.18.{}.{b}}}, \
         {{address: 198.18.{}.{}}}]}}\n---\n",
            a + 10,
            20 + shared / 200,
            shared % 200,
        );
    }
    yaml
}

/// A full sync large enough to build its tables on a second thread, a chunk of
/// services at a time, ends with the same maps (ids included) as the same
/// services applied in deltas small enough for one thread; and a second full
/// sync of the same services (whose tables are kept, not rebuilt) writes nothing.
#[test]
fn tables_built_on_another_thread_give_the_same_maps() {
    let capacity = Capacity {
        frontends: 1200,
        backends: 4096,
        table_size: 31,
        flows: 64,
    };
    let yaml = many_services(1100);
    let now = Instant::now();
    let mut parallel = LbSync::new(FakeMaps::new(capacity), NODE);
    parallel.apply(&full(&yaml), now).unwrap();
    check_invariants(parallel.maps());

    let all = full(&yaml);
    let mut sequential = LbSync::new(FakeMaps::new(capacity), NODE);
    for (i, chunk) in all.upserted.chunks(100).enumerate() {
        let delta = Delta {
            revision: 1,
            // The first adopts the (empty) maps.
            full: i == 0,
            upserted: chunk.to_vec(),
            removed: Vec::new(),
        };
        sequential.apply(&delta, now).unwrap();
    }
    assert_eq!(parallel.frontends().len(), 1100);
    assert_eq!(dump(parallel.maps(), true), dump(sequential.maps(), true));

    parallel.maps_mut().writes.clear();
    parallel.apply(&full(&yaml), now).unwrap();
    assert_eq!(parallel.maps().writes, Vec::<String>::new());
}

/// The kernel's maps as the agent opens them: the embedded object loaded with maps
/// of `cap`'s sizes, pinned in `pins`, handed to [`KernelMaps`]; and the VIP
/// prefilter array, opened a second time (by id) for reading.
fn kernel_maps(pins: &std::path::Path, cap: Capacity) -> (KernelMaps, Array<MapData, u64>) {
    let pinned = super::pins::PinnedBefore::probe(pins);
    let sizes = super::MapSizes {
        frontends: cap.frontends,
        backends: cap.backends,
        table_size: cap.table_size,
        flows: cap.flows,
        affinity: cap.flows,
        policy_entries: 16,
    };
    let mut ebpf = super::load_lb(pins, &sizes).unwrap_or_else(|e| panic!("{e:#}"));
    let filter_id = match ebpf.map(lb::VIP_FILTER) {
        Some(Map::Array(data)) => data.info().unwrap().id(),
        _ => panic!("no {} array in the object", lb::VIP_FILTER),
    };
    let filter = Array::try_from(Map::Array(MapData::from_id(filter_id).unwrap())).unwrap();
    let mut taken = BTreeMap::new();
    let names: Vec<String> = ebpf.maps().map(|(n, _)| n.to_owned()).collect();
    for name in names {
        if let Some(map) = ebpf.take_map(&name) {
            taken.insert(name, map);
        }
    }
    let maps = KernelMaps::new(&mut taken)
        .unwrap_or_else(|e| panic!("{e}"))
        .pinned_before(pinned);
    (maps, filter)
}

/// The sync engine's golden deltas (`testdata/golden.yaml`, a one-endpoint change,
/// the changed state of [`golden2`], the golden state again, nothing) applied to
/// [`FakeMaps`] and to the kernel's maps ([`KernelMaps`], the embedded object loaded
/// in a private pin directory): after every delta both hold the same frontends,
/// backends, tables and VIP prefilter, so the fake the unprivileged tests trust
/// cannot drift from the kernel. Needs root (BPF) and the embedded programs.
#[test]
fn golden_deltas_leave_the_fake_and_the_kernel_maps_equal() {
    rune_harness::netns::require_root().unwrap_or_else(|e| panic!("{e}"));
    assert!(
        super::programs_embedded(),
        "this test loads the embedded eBPF object: build the agent with its programs \
     (without AYA_BUILD_SKIP=1)"
    );
    let pins = rune_harness::bpffs::PinDir::new("maps-contract");
    let cap = small();
    let (kernel, filter) = kernel_maps(pins.path(), cap);
    assert_eq!(kernel.capacity(), cap, "the kernel maps' sizes");
    let now = Instant::now();
    let mut in_kernel = LbSync::new(kernel, NODE);
    let mut fake = LbSync::new(FakeMaps::new(cap), NODE);
    let changed = GOLDEN.replace(
        "- {address: 198.18.2.3, node: node-a}",
        "- {address: 198.18.2.4, node: node-a}",
    );
    assert_ne!(changed, GOLDEN);
    let steps = [
        ("golden.yaml", full(GOLDEN)),
        ("one endpoint of `local` replaced", only(&changed, "local")),
        ("golden2", full(&golden2())),
        ("golden.yaml again", full(GOLDEN)),
        ("nothing", full("")),
    ];
    for (what, delta) in &steps {
        in_kernel.apply(delta, now).unwrap();
        fake.apply(delta, now).unwrap();
        let (k, f) = (dump(in_kernel.maps(), true), dump(fake.maps(), true));
        if k != f {
            let diff = line_diff(&f, &k);
            panic!(
                "after {what}, the kernel's maps differ from the fake's (- fake, + kernel):\n{diff}"
            );
        }
        let words: Vec<u64> = (0..filter.len())
            .map(|i| filter.get(&i, 0).unwrap())
            .collect();
        assert!(
            words == fake.maps().vip_filter,
            "after {what}, the kernel's VIP prefilter differs from the fake's"
        );
    }
}
