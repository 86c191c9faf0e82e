//! The settings' tests: defaults, overrides, and every refusal naming its setting.

use super::*;

#[test]
fn defaults() {
    let c = FileConfig::default().resolve().unwrap();
    assert_eq!(c.metrics_addr.to_string(), DEFAULT_METRICS_ADDR);
    assert_eq!(c.ready_timeout, Duration::from_secs(30));
    assert_eq!(c.outbox_capacity, 4096);
    assert_eq!(c.maglev_table_size, 16381);
    assert_eq!(c.mode, Mode::Production);
    assert_eq!(c.dns_addrs, ["127.0.0.123:53".parse().unwrap()]);
    assert_eq!(c.dns_domain, "rune.");
    assert_eq!(c.dns_ttl_seconds, 5);
    assert!(c.dns_upstreams.is_empty());
    assert_eq!(c.dns_resolv_conf, PathBuf::from("/etc/resolv.conf"));
    assert_eq!(c.dns_upstream_timeout, Duration::from_secs(2));
    assert_eq!(c.dns_cache_size, 10_000);
    let dev = FileConfig {
        dev: Some(true),
        ..FileConfig::default()
    };
    assert_eq!(
        dev.resolve().unwrap().dns_addrs,
        ["127.0.0.1:15353".parse().unwrap()]
    );
}

#[test]
fn dns_forwarding_settings_are_checked() {
    let c = FileConfig {
        dns_upstreams: Some(vec![
            "127.0.0.1:5300".into(),
            "192.0.2.53".into(),
            "::1".into(),
            "[::1]:5300".into(),
            "192.0.2.53:53".into(),
        ]),
        dns_upstream_timeout_ms: Some(500),
        dns_cache_size: Some(0),
        dns_resolv_conf: Some("/tmp/r.conf".into()),
        ..FileConfig::default()
    }
    .resolve()
    .unwrap();
    let expected: Vec<SocketAddr> = ["127.0.0.1:5300", "192.0.2.53:53", "[::1]:53", "[::1]:5300"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    assert_eq!(c.dns_upstreams, expected);
    assert_eq!(c.dns_upstream_timeout, Duration::from_millis(500));
    assert_eq!(c.dns_cache_size, 0);
    assert_eq!(c.dns_resolv_conf, PathBuf::from("/tmp/r.conf"));
    for (bad, setting) in [
        (
            FileConfig {
                dns_upstreams: Some(vec!["resolver.example".into()]),
                ..FileConfig::default()
            },
            "--dns-upstream",
        ),
        (
            FileConfig {
                dns_upstreams: Some(vec!["127.0.0.1:0".into()]),
                ..FileConfig::default()
            },
            "--dns-upstream",
        ),
        (
            FileConfig {
                dns_upstream_timeout_ms: Some(0),
                ..FileConfig::default()
            },
            "--dns-upstream-timeout-ms",
        ),
        (
            FileConfig {
                dns_cache_size: Some(MAX_DNS_CACHE_SIZE + 1),
                ..FileConfig::default()
            },
            "--dns-cache-size",
        ),
    ] {
        match bad.resolve() {
            Err(ConfigError::Invalid { setting: s, .. }) => assert_eq!(s, setting),
            other => panic!("{setting}: {other:?}"),
        }
    }
    let file: FileConfig = serde_yaml_ng::from_str(
        "dnsUpstreams: [127.0.0.1:5300]\ndnsUpstreamTimeoutMs: 100\ndnsCacheSize: 5\n\
         dnsResolvConf: /x\n",
    )
    .unwrap();
    assert_eq!(file.dns_upstreams, Some(vec!["127.0.0.1:5300".into()]));
}

#[test]
fn dns_settings_are_checked_and_normalised() {
    let c = FileConfig {
        dns_addrs: Some(vec!["127.0.0.1:1053".into(), "[::1]:1053".into()]),
        dns_domain: Some("Cluster.Example".into()),
        dns_ttl_seconds: Some(30),
        ..FileConfig::default()
    }
    .resolve()
    .unwrap();
    assert_eq!(c.dns_addrs.len(), 2);
    assert_eq!(c.dns_domain, "cluster.example.");
    assert_eq!(c.dns_ttl_seconds, 30);
    for (bad, setting) in [
        (
            FileConfig {
                dns_addrs: Some(vec!["nowhere".into()]),
                ..FileConfig::default()
            },
            "--dns-addr",
        ),
        (
            FileConfig {
                dns_domain: Some(".".into()),
                ..FileConfig::default()
            },
            "--dns-domain",
        ),
        (
            FileConfig {
                dns_domain: Some("bad_label.rune".into()),
                ..FileConfig::default()
            },
            "--dns-domain",
        ),
        (
            FileConfig {
                dns_ttl_seconds: Some(MAX_DNS_TTL_SECONDS + 1),
                ..FileConfig::default()
            },
            "--dns-ttl-seconds",
        ),
    ] {
        let err = bad.resolve().unwrap_err().to_string();
        assert!(err.starts_with(&format!("setting {setting}:")), "{err}");
    }
}

#[test]
fn flags_override_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.yaml");
    std::fs::write(
        &path,
        "dev: true\ndevPortOffset: 10000\nmetricsAddr: 127.0.0.1:1\n",
    )
    .unwrap();
    let file = FileConfig::load(&path).unwrap();
    let flags = FileConfig {
        metrics_addr: Some("127.0.0.1:2".into()),
        ..FileConfig::default()
    };
    let c = file.overridden_by(flags).resolve().unwrap();
    assert_eq!(c.mode, Mode::Dev);
    assert_eq!(c.dev_port_offset, 10000);
    assert_eq!(c.metrics_addr.to_string(), "127.0.0.1:2");
}

#[test]
fn bad_values_name_the_setting() {
    let bad = FileConfig {
        maglev_table_size: Some(1000),
        ..FileConfig::default()
    };
    let err = bad.resolve().unwrap_err().to_string();
    assert_eq!(
        err,
        "setting --maglev-table-size: 1000 is not a prime from 101 to 131071"
    );
    let bad = FileConfig {
        metrics_addr: Some("nowhere".into()),
        ..FileConfig::default()
    };
    assert!(
        bad.resolve()
            .unwrap_err()
            .to_string()
            .contains("\"nowhere\"")
    );
}

#[test]
fn unknown_keys_in_the_file_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.yaml");
    std::fs::write(&path, "devPortOfset: 1\n").unwrap();
    let err = FileConfig::load(&path).unwrap_err().to_string();
    assert!(err.contains("devPortOfset"), "{err}");
}

#[test]
fn mode_display_serde_and_parse() {
    assert_eq!(Mode::Production.to_string(), "production");
    assert_eq!(Mode::Dev.to_string(), "dev");
    assert_eq!(serde_json::to_string(&Mode::Dev).unwrap(), "\"dev\"");
    assert_eq!(
        serde_json::from_str::<Mode>("\"production\"").unwrap(),
        Mode::Production
    );
    assert_eq!("dev".parse::<Mode>().unwrap(), Mode::Dev);
    let error = "Dev".parse::<Mode>().unwrap_err();
    assert!(error.to_string().contains("\"Dev\""), "{error}");
    assert_eq!(Mode::default(), Mode::Production);
}

#[test]
fn a_dataplane_request_is_auto_or_one_mode_forced() {
    assert_eq!(DataplaneRequest::ALL[0], DataplaneRequest::Auto);
    let forced: Vec<DataplaneMode> = DataplaneRequest::ALL[1..]
        .iter()
        .map(|r| match r {
            DataplaneRequest::Forced(mode) => *mode,
            DataplaneRequest::Auto => panic!("auto twice"),
        })
        .collect();
    assert_eq!(forced, DataplaneMode::ALL);
    let names: Vec<&str> = DataplaneRequest::ALL.map(DataplaneRequest::as_str).into();
    assert_eq!(names, DATAPLANE_REQUEST_NAMES);
    for request in DataplaneRequest::ALL {
        let yaml = format!("dataplane: {}\n", request.as_str());
        let file: FileConfig = serde_yaml_ng::from_str(&yaml).unwrap();
        assert_eq!(file.dataplane, Some(request));
    }
    let err = serde_yaml_ng::from_str::<FileConfig>("dataplane: foo\n")
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "dataplane: unknown variant `foo`, expected one of `auto`, `ebpf`, `nftables`, \
         `userspace` at line 1 column 12"
    );
}
