//! What only the nftables data plane does, end to end (the VIP scenarios every mode
//! shares are in `vip_modes.rs`): a production-mode agent with `--dataplane
//! nftables` in the node namespace of a [`Topology`] programs exactly its own table
//! `inet rune`, changes only the changed service's objects, removes the table on
//! stop and cleanup, and keeps ClientIP affinity.
//!
//! Needs root. Each test builds its own namespaces and removes them on drop; all
//! `nft` commands run inside the test's node namespace (never the root one), and
//! traffic goes only to 198.18.0.0/15 and fd00::/8 inside them. Tests run one at a
//! time (they share the CPU with the agent they start).

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    sync::Mutex,
};

use rune_agent_tests::{
    modes::{
        Ep, Mode, TCP_PORT, UDP_PORT, VIP4, VIP6, all_ready, service_yaml, start_agent,
        start_agent_with, web_yaml,
    },
    vip::{BACKEND_PORT, PATIENCE, apply, backend_name, topology, wait_reachable},
};
use rune_harness::{agent::eventually, bpffs::PinDir, netns::require_root, topology::Topology};
use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

/// The VIP of a second service, to show that changes of one leave the other alone.
const OTHER_VIP4: &str = "198.18.100.20";

/// Runs `nft ARGS` in the node namespace; its standard output.
fn nft(topo: &Topology, args: &[&str]) -> std::process::Output {
    topo.node()
        .command("nft")
        .unwrap()
        .args(args)
        .output()
        .unwrap()
}

/// `nft -j list table inet NAME` in the node namespace; `None` when there is none.
fn list_table(topo: &Topology, name: &str) -> Option<Value> {
    let out = nft(topo, &["-j", "list", "table", "inet", name]);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).unwrap())
}

/// The objects of a listing (without the metainfo).
fn objects(table: &Value) -> Vec<Value> {
    table["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o.get("metainfo").is_none())
        .cloned()
        .collect()
}

/// A concatenation of a listing (`a . b . c`).
fn concat_text(value: &Value) -> String {
    let parts: Vec<String> = value["concat"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
        .collect();
    parts.join(" . ")
}

/// The elements of map `map` in a listing, as `key -> value` text (a verdict's
/// target chain, or a data map's `addr . port`), sorted.
fn map_elements(table: &Value, map: &str) -> Vec<String> {
    let mut out = Vec::new();
    for o in objects(table) {
        let Some(m) = o.get("map") else { continue };
        if m["name"] != map {
            continue;
        }
        for el in m["elem"].as_array().into_iter().flatten() {
            // Elements of a map with counters come wrapped with theirs.
            let key = el[0].get("elem").map_or(&el[0], |e| &e["val"]);
            let value = match el[1]["goto"]["target"].as_str() {
                Some(target) => target.to_owned(),
                None => concat_text(&el[1]),
            };
            out.push(format!("{} -> {value}", concat_text(key)));
        }
    }
    out.sort();
    out
}

/// The backends (`addr . port`) of one IPv4 service port in its data map.
fn backends_of(table: &Value, vip: &str, proto: &str, port: u16) -> Vec<String> {
    let prefix = format!("{vip} . {port} . ");
    map_elements(table, &format!("backends4-{proto}"))
        .into_iter()
        .filter(|e| e.starts_with(&prefix))
        .filter_map(|e| e.split(" -> ").nth(1).map(str::to_owned))
        .collect()
}

/// The rules of chain `chain`, as JSON text (counters zeroed out).
fn chain_rules(table: &Value, chain: &str) -> Vec<String> {
    objects(table)
        .iter()
        .filter_map(|o| o.get("rule"))
        .filter(|r| r["chain"] == chain)
        .map(|r| {
            let mut expr = r["expr"].clone();
            for e in expr.as_array_mut().into_iter().flatten() {
                if let Some(c) = e.get_mut("counter") {
                    *c = Value::Null;
                }
            }
            expr.to_string()
        })
        .collect()
}

/// Every object of `table` whose name mentions service `name` (chains, rules,
/// sets) and every map element keyed by one of its `vips`, handles and counters
/// left out: what a change of it may touch.
fn objects_of(table: &Value, name: &str, vips: &[&str]) -> Vec<String> {
    let needle = format!("default/{name}/");
    let mut out: Vec<String> = objects(table)
        .iter()
        .filter_map(|o| {
            let mut o = o.clone();
            if let Some(r) = o.get_mut("rule") {
                r["handle"] = Value::Null;
                for e in r["expr"].as_array_mut().into_iter().flatten() {
                    if let Some(c) = e.get_mut("counter") {
                        *c = Value::Null;
                    }
                }
            }
            for kind in ["chain", "set"] {
                if let Some(c) = o.get_mut(kind) {
                    c["handle"] = Value::Null;
                }
            }
            let text = o.to_string();
            text.contains(&needle).then_some(text)
        })
        .collect();
    for map in [
        "service-vips",
        "service-vips6",
        "no-endpoints",
        "no-endpoints6",
        "backends4-tcp",
        "backends4-udp",
        "backends6-tcp",
        "backends6-udp",
    ] {
        out.extend(
            map_elements(table, map)
                .into_iter()
                .filter(|e| vips.iter().any(|v| e.starts_with(&format!("{v} . ")))),
        );
    }
    out.sort();
    out
}

/// A table of someone else's, created before the agent starts.
fn foreign_table(topo: &Topology) -> Value {
    let script = "add table inet bystander
add chain inet bystander prerouting { type nat hook prerouting priority -100; policy accept; }
add set inet bystander friends { type ipv4_addr; }
add element inet bystander friends { 198.18.200.1 }
add rule inet bystander prerouting ip daddr @friends counter accept
";
    let mut child = topo
        .node()
        .command("nft")
        .unwrap()
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(child.wait().unwrap().success());
    list_table(topo, "bystander").unwrap()
}

#[test]
fn table_holds_exactly_the_services_and_changes_touch_only_their_service() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let bystander = foreign_table(&topo);
    let state = tempfile::tempdir().unwrap();
    let pins = PinDir::new("nftables");
    let mut agent = start_agent(Mode::Nftables, &topo, state.path(), &pins);
    apply(&agent, &web_yaml(&all_ready(&topo)));
    let other_eps: Vec<Ep> = topo.backends()[1..]
        .iter()
        .map(|b| Ep {
            address: b.addr().v4.into(),
            terminating: false,
            http_port: None,
        })
        .collect();
    apply(&agent, &service_yaml("other", &[OTHER_VIP4], &other_eps));
    wait_reachable(
        &topo,
        SocketAddr::new(OTHER_VIP4.parse().unwrap(), TCP_PORT),
    );

    let table = list_table(&topo, "rune").expect("table inet rune");
    // Each service port goes to the shared chain for its backend count.
    assert_eq!(
        map_elements(&table, "service-vips"),
        vec![
            format!("{VIP4} . tcp . {TCP_PORT} -> pick4-3"),
            format!("{VIP4} . udp . {UDP_PORT} -> pick4-3"),
            format!("{OTHER_VIP4} . tcp . {TCP_PORT} -> pick4-2"),
            format!("{OTHER_VIP4} . udp . {UDP_PORT} -> pick4-2"),
        ]
    );
    assert_eq!(
        map_elements(&table, "service-vips6"),
        vec![
            format!("{VIP6} . tcp . {TCP_PORT} -> pick6-3"),
            format!("{VIP6} . udp . {UDP_PORT} -> pick6-3"),
        ]
    );
    assert!(map_elements(&table, "no-endpoints").is_empty());
    // The web port's backends are exactly the three IPv4 backends, as data.
    let backend_text =
        |b: &rune_harness::topology::Backend| format!("{} . {BACKEND_PORT}", b.addr().v4);
    let mut expected: Vec<String> = topo.backends().iter().map(backend_text).collect();
    expected.sort();
    assert_eq!(backends_of(&table, VIP4, "tcp", TCP_PORT), expected);
    // No chain per service: the shared pick chains DNAT through the data map.
    let chains: Vec<String> = objects(&table)
        .iter()
        .filter_map(|o| o["chain"]["name"].as_str().map(str::to_owned))
        .collect();
    assert!(!chains.iter().any(|c| c.starts_with("svc")), "{chains:?}");
    let pick = chain_rules(&table, "pick4-3");
    assert_eq!(pick.len(), 2, "{pick:?}");
    assert!(pick[0].contains("backends4-tcp"), "{pick:?}");
    assert!(pick[1].contains("backends4-udp"), "{pick:?}");
    assert_eq!(list_table(&topo, "bystander").unwrap(), bystander);

    // One endpoint change of `web`: `other`'s objects are exactly as before, and
    // web's port moves to the two-backend chain.
    let (web_vips, other_vips) = ([VIP4, VIP6], [OTHER_VIP4]);
    let other_before = objects_of(&table, "other", &other_vips);
    let web_before = objects_of(&table, "web", &web_vips);
    let mut eps = all_ready(&topo);
    eps.retain(|e| e.address != IpAddr::from(topo.backends()[0].addr().v4));
    apply(&agent, &web_yaml(&eps));
    let after = eventually(PATIENCE, "the change reached the table", || {
        let t = list_table(&topo, "rune")?;
        (objects_of(&t, "web", &web_vips) != web_before).then_some(t)
    });
    assert_eq!(objects_of(&after, "other", &other_vips), other_before);
    let victim = backend_text(&topo.backends()[0]);
    let remaining: Vec<String> = expected.into_iter().filter(|b| *b != victim).collect();
    let web = backends_of(&after, VIP4, "tcp", TCP_PORT);
    assert_eq!(web, remaining, "{web:?}");
    assert!(
        map_elements(&after, "service-vips")
            .contains(&format!("{VIP4} . tcp . {TCP_PORT} -> pick4-2"))
    );

    // Stop removes our table and only ours.
    assert_eq!(agent.terminate(PATIENCE), Some(0));
    assert!(
        list_table(&topo, "rune").is_none(),
        "stop removes inet rune"
    );
    assert_eq!(list_table(&topo, "bystander").unwrap(), bystander);

    // With --keep-rules-on-stop the table stays; cleanup removes it.
    let mut agent = start_agent_with(
        Mode::Nftables,
        &topo,
        state.path(),
        &pins,
        &["--keep-rules-on-stop"],
    );
    wait_reachable(
        &topo,
        SocketAddr::new(OTHER_VIP4.parse().unwrap(), TCP_PORT),
    );
    assert_eq!(agent.terminate(PATIENCE), Some(0));
    assert!(list_table(&topo, "rune").is_some(), "kept on stop");
    let removed = topo
        .node()
        .run(rune_agent::dataplane::nftables::cleanup)
        .unwrap()
        .unwrap();
    assert!(removed);
    assert!(
        list_table(&topo, "rune").is_none(),
        "cleanup removes inet rune"
    );
    assert_eq!(list_table(&topo, "bystander").unwrap(), bystander);
}

#[test]
fn client_ip_affinity_keeps_each_client_on_one_backend() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_root().unwrap();
    let topo = topology(3);
    let state = tempfile::tempdir().unwrap();
    let pins = PinDir::new("nftables");
    let agent = start_agent(Mode::Nftables, &topo, state.path(), &pins);
    let yaml = web_yaml(&all_ready(&topo)).replacen(
        "  discovery:",
        "  sessionAffinity: {type: ClientIP, timeoutSeconds: 600}\n  discovery:",
        1,
    );
    apply(&agent, &yaml);
    for vip in [VIP4, VIP6] {
        let vip = SocketAddr::new(vip.parse().unwrap(), TCP_PORT);
        wait_reachable(&topo, vip);
        for src in [topo.client_addr(), topo.client_alt_addr()] {
            let src = src.like(vip.ip());
            let mut seen = BTreeMap::new();
            for i in 0..30 {
                let (reply, peer, _) = topo
                    .tcp_request_from(Some(src), vip, &format!("sticky{i}"))
                    .unwrap_or_else(|e| panic!("connection {i} from {src} to {vip}: {e:#}"));
                assert_eq!(peer, vip);
                *seen.entry(backend_name(&reply)).or_insert(0) += 1;
            }
            assert_eq!(
                seen.len(),
                1,
                "{src} → {vip} stays on one backend: {seen:?}"
            );
        }
    }
    // The client addresses are in the endpoints' affinity sets, with a timeout.
    let table = list_table(&topo, "rune").unwrap();
    let remembered: usize = objects(&table)
        .iter()
        .filter_map(|o| o.get("set"))
        .filter(|s| s["name"].as_str().unwrap_or("").starts_with("aff"))
        .map(|s| s["elem"].as_array().map_or(0, Vec::len))
        .sum();
    assert_eq!(remembered, 4, "two clients per family: {table}");
}
