use super::*;

#[test]
fn every_metric_is_registered_under_its_documented_name() {
    let metrics = Metrics::new();
    metrics
        .subsystem_ready
        .get_or_create(&SubsystemLabels {
            subsystem: "dns".into(),
        })
        .set(1);
    metrics
        .objects
        .get_or_create(&KindLabels {
            kind: "Service".into(),
        })
        .set(2);
    metrics
        .proxy_connections
        .get_or_create(&ConnectionLabels {
            service: "default/web".into(),
            protocol: "TCP".into(),
            result: "ok".into(),
        })
        .inc();
    metrics
        .proxy_bytes
        .get_or_create(&BytesLabels {
            service: "default/web".into(),
            protocol: "TCP".into(),
            direction: "to_backend".into(),
        })
        .inc_by(10);
    metrics
        .proxy_listener_up
        .get_or_create(&ServicePortLabels {
            service: "default/web".into(),
            port: 80,
            protocol: "TCP".into(),
        })
        .set(1);
    metrics.revision_applied.set(7);
    metrics.store_connected.set(1);
    metrics.store_skipped_keys.inc_by(2);
    metrics.set_dataplane(
        "ebpf",
        &[("btf".to_owned(), true), ("nft".to_owned(), false)],
    );
    let text = metrics.encode();
    for line in [
        "rune_subsystem_ready{subsystem=\"dns\"} 1",
        "rune_objects{kind=\"Service\"} 2",
        "rune_revision_applied 7",
        "rune_proxy_connections_total{service=\"default/web\",protocol=\"TCP\",result=\"ok\"} 1",
        "rune_proxy_bytes_total{service=\"default/web\",protocol=\"TCP\",direction=\"to_backend\"} 10",
        "rune_proxy_listener_up{service=\"default/web\",port=\"80\",protocol=\"TCP\"} 1",
        "rune_outbox_depth 0",
        "rune_outbox_dropped_total 0",
        "rune_dataplane_mode{mode=\"ebpf\"} 1",
        "rune_preflight_check{check=\"btf\"} 1",
        "rune_preflight_check{check=\"nft\"} 0",
        "rune_store_connected 1",
        "rune_store_skipped_keys_total 2",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
    assert!(text.ends_with("# EOF\n"), "{text}");
}
