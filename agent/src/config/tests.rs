//! The settings' tests: defaults, overrides, and every refusal naming its setting.

use super::*;
use std::collections::BTreeSet;

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
    assert_eq!(names, modes::DATAPLANE_REQUEST_NAMES);
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

/// Values tried for every setting: each takes the first three its flag accepts that
/// resolve to three different configs, the first not the default one. A new setting
/// none of these fit fails [`every_setting_is_read_from_its_flag_variable_and_file_key`]
/// until one that does is added here.
const CANDIDATES: &[&str] = &[
    "a",
    "b",
    "c",
    "ebpf",
    "nftables",
    "userspace",
    "101",
    "103",
    "107",
    "127.0.0.1:1",
    "127.0.0.1:2",
    "127.0.0.1:3",
    "198.18.0.0/15",
    "10.0.0.0/8",
    "fd00::/8",
    "9000",
    "16384",
    "32768",
    "0",
    "0.25",
    "0.5",
    "https://a.test/directory",
    "https://b.test/directory",
    "https://c.test/directory",
];

/// One setting's three values: `file` for the config file, `env` for its variable
/// (over the file), `flag` for its flag (over the variable); each with the layer it
/// makes.
struct Values {
    setting: Setting,
    file: FileConfig,
    env: (String, FileConfig),
    flag: (Vec<String>, FileConfig),
}

/// Every group's flags, without their variables (the test's own environment must
/// not leak in).
fn flags_only() -> clap::Command {
    let mut command = FileConfig::augment_args(clap::Command::new("settings"))
        .mut_args(|arg| arg.env(None::<&str>));
    command.build();
    command
}

/// The layer `args` make, or `None` when clap refuses them.
fn layer(args: &[&str]) -> Option<FileConfig> {
    let matches = flags_only()
        .try_get_matches_from(std::iter::once("settings").chain(args.iter().copied()))
        .ok()?;
    Some(FileConfig::from_arg_matches(&matches).unwrap())
}

/// Three values for each of [`SETTINGS`], from [`CANDIDATES`]; a switch (a flag
/// without a value) gets `true` from the file, `false` from its variable, and the
/// flag.
fn values() -> Vec<Values> {
    let command = flags_only();
    let default = FileConfig::default().resolve().unwrap();
    SETTINGS
        .iter()
        .map(|&setting| {
            let arg = command
                .get_arguments()
                .find(|a| a.get_long().map(|l| format!("--{l}")).as_deref() == Some(setting.flag))
                .unwrap_or_else(|| panic!("{}: no such flag", setting.flag));
            assert_eq!(
                arg.get_env().and_then(|e| e.to_str()),
                None,
                "flags_only() keeps no variable"
            );
            let switch = !arg.get_num_args().unwrap().takes_values();
            if switch {
                let on = layer(&[setting.flag]).unwrap();
                let off: FileConfig =
                    serde_yaml_ng::from_str(&format!("{}: false", setting.file_key())).unwrap();
                return Values {
                    setting,
                    file: on.clone(),
                    env: ("false".into(), off),
                    flag: (vec![setting.flag.into()], on),
                };
            }
            let mut picked: Vec<(&str, FileConfig, Config)> = Vec::new();
            for value in CANDIDATES {
                let Some(l) = layer(&[setting.flag, value]) else {
                    continue;
                };
                let Ok(config) = l.clone().resolve() else {
                    continue;
                };
                if config != default && picked.iter().all(|(_, _, c)| *c != config) {
                    picked.push((value, l, config));
                }
            }
            assert!(
                picked.len() >= 3,
                "{}: fewer than three of CANDIDATES are accepted and make different configs; \
                 add some that do",
                setting.flag
            );
            let mut picked = picked
                .into_iter()
                .map(|(value, l, _)| (value.to_owned(), l));
            let (file, env, (flag, flag_layer)) = (
                picked.next().unwrap().1,
                picked.next().unwrap(),
                picked.next().unwrap(),
            );
            Values {
                setting,
                file,
                env,
                flag: (vec![setting.flag.into(), flag], flag_layer),
            }
        })
        .collect()
}

/// Makes [`probe`] a child process of the tests below: the `rune-agent` arguments it
/// parses, as JSON.
const PROBE_ARGS: &str = "SETTINGS_PROBE_ARGS";

/// What starts [`probe`]'s line of output.
const PROBE_OUT: &str = "settings probe: ";

/// Not a test of its own: run by [`run_probe`] in a child process, with the
/// `RUNE_*` variables a test chose (a test must not set variables in its own
/// process), it prints the layer `rune-agent ARGS` reads from its flags and
/// variables, and the config it resolves.
#[test]
fn probe() {
    let Ok(args) = std::env::var(PROBE_ARGS) else {
        return;
    };
    let args: Vec<String> = serde_json::from_str(&args).unwrap();
    let cli = <crate::cli::Cli as clap::Parser>::try_parse_from(&args).unwrap();
    let config = match cli.config() {
        Ok(config) => format!("{config:?}"),
        Err(e) => format!("error: {e}"),
    };
    let out = serde_json::json!({ "flags": cli.flags(), "config": config });
    println!("{PROBE_OUT}{out}");
}

/// `rune-agent ARGS` parsed by [`probe`] with the variables `env` (and no other
/// `RUNE_*` one): the layer of its flags and variables, and its config's `Debug`.
fn run_probe(args: &[String], env: &[(&str, &str)]) -> (FileConfig, String) {
    let name = module_path!().split_once("::").unwrap().1.to_owned() + "::probe";
    let mut child = std::process::Command::new(std::env::current_exe().unwrap());
    child.args([&name, "--exact", "--nocapture", "--test-threads=1"]);
    for (variable, _) in std::env::vars_os() {
        if variable.to_string_lossy().starts_with("RUNE_") {
            child.env_remove(variable);
        }
    }
    let mut argv = vec!["rune-agent".to_owned()];
    argv.extend_from_slice(args);
    child
        .env(PROBE_ARGS, serde_json::to_string(&argv).unwrap())
        .envs(env.iter().copied());
    let out = child.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.split_once(PROBE_OUT).map(|(_, out)| out))
        .unwrap_or_else(|| {
            panic!(
                "{args:?}: no probe output\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    let mut out: serde_json::Value = serde_json::from_str(line).unwrap();
    let flags = serde_json::from_value(out["flags"].take()).unwrap();
    (flags, out["config"].as_str().unwrap().to_owned())
}

/// Every setting is checked in `got` against `want`, naming it when they differ.
fn assert_layer(scenario: &str, got: &FileConfig, want: &FileConfig) {
    let (got, want) = (
        serde_json::to_value(got).unwrap(),
        serde_json::to_value(want).unwrap(),
    );
    for s in SETTINGS {
        let key = s.file_key();
        assert_eq!(
            got.get(&key),
            want.get(&key),
            "{scenario}: setting {} ({}, {key})",
            s.flag,
            s.env
        );
    }
    assert_eq!(got, want, "{scenario}");
}

/// The layers of `values` merged into one.
fn all(values: &[Values], of: impl Fn(&Values) -> &FileConfig) -> FileConfig {
    values
        .iter()
        .fold(FileConfig::default(), |l, v| l.overridden_by(of(v).clone()))
}

#[test]
fn every_setting_is_read_from_its_flag_variable_and_file_key() {
    let values = values();
    assert_eq!(values.len(), SETTINGS.len());
    // Each file value is one key, the setting's field in camelCase.
    for v in &values {
        let json = serde_json::to_value(&v.file).unwrap();
        let keys: Vec<&String> = json.as_object().unwrap().keys().collect();
        assert_eq!(keys, [&v.setting.file_key()], "{}", v.setting.flag);
    }
    let (file, env, flags) = (
        all(&values, |v| &v.file),
        all(&values, |v| &v.env.1),
        all(&values, |v| &v.flag.1),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.yaml");
    std::fs::write(&path, serde_yaml_ng::to_string(&file).unwrap()).unwrap();
    assert_layer("the file", &FileConfig::load(&path).unwrap(), &file);
    let variables: Vec<(&str, &str)> = values
        .iter()
        .map(|v| (v.setting.env, v.env.0.as_str()))
        .collect();
    let run = vec![
        "run".to_owned(),
        "--config".to_owned(),
        path.to_str().unwrap().to_owned(),
    ];
    let with_flags: Vec<String> = run
        .iter()
        .cloned()
        .chain(values.iter().flat_map(|v| v.flag.0.iter().cloned()))
        .collect();
    let resolved = |layer: &FileConfig| format!("{:?}", layer.clone().resolve().unwrap());

    // Defaults < file: every setting from its key.
    let (got, config) = run_probe(&run, &[]);
    assert_layer("no flag, no variable", &got, &FileConfig::default());
    assert_eq!(config, resolved(&file), "the file alone");
    // File < variables: every setting from its variable.
    let (got, config) = run_probe(&run, &variables);
    assert_layer("variables", &got, &env);
    assert_layer(
        "variables over the file",
        &file.clone().overridden_by(got),
        &env,
    );
    assert_eq!(config, resolved(&env), "variables over the file");
    // Variables < flags: every setting from its flag.
    let (got, config) = run_probe(&with_flags, &variables);
    assert_layer("flags and variables", &got, &flags);
    assert_layer("flags over the file", &file.overridden_by(got), &flags);
    assert_eq!(
        config,
        resolved(&flags),
        "flags over variables over the file"
    );
}

#[test]
fn other_commands_read_the_variables_of_their_settings() {
    let values = values();
    let variables: Vec<(&str, &str)> = values
        .iter()
        .map(|v| (v.setting.env, v.env.0.as_str()))
        .collect();
    for (command, keys) in [
        ("cleanup", &["stateDir", "bpfPinDir"][..]),
        ("preflight", &["stateDir", "dataplane", "cgroup"]),
        (
            "status",
            &[
                "stateDir",
                "etcdEndpoints",
                "etcdCa",
                "etcdCert",
                "etcdKey",
                "etcdInsecure",
                "etcdPrefix",
                "etcdMaxTxnOps",
                "etcdMaxRequestBytes",
            ],
        ),
        (
            "get",
            &[
                "stateDir",
                "etcdEndpoints",
                "etcdCa",
                "etcdCert",
                "etcdKey",
                "etcdInsecure",
                "etcdPrefix",
                "etcdMaxTxnOps",
                "etcdMaxRequestBytes",
            ],
        ),
    ] {
        let (got, _) = run_probe(&[command.to_owned()], &variables);
        let json = serde_json::to_value(&got).unwrap();
        let got: BTreeSet<&str> = json.as_object().unwrap().keys().map(|k| &k[..]).collect();
        assert_eq!(got, keys.iter().copied().collect(), "{command}");
    }
}

#[test]
fn every_setting_is_documented() {
    let docs = [
        include_str!("../../../docs/configuration.md"),
        include_str!("../../../docs/dns.md"),
        include_str!("../../../docs/ingress.md"),
    ];
    for s in SETTINGS {
        let flag = format!("`{}", s.flag);
        let key = format!("`{}`", s.file_key());
        let row = docs.iter().flat_map(|d| d.lines()).find(|line| {
            line.starts_with('|')
                && line
                    .split(&flag)
                    .nth(1)
                    .is_some_and(|rest| rest.starts_with([' ', '`']))
        });
        let row = row.unwrap_or_else(|| panic!("{}: no row in docs/", s.flag));
        assert!(row.contains(&format!("`{}`", s.env)), "{}: {row}", s.env);
        assert!(row.contains(&key), "{key}: {row}");
    }
}

#[test]
fn the_ingress_listeners_follow_the_dev_port_offset() {
    let dev = |offset: u16, ingress: bool| {
        FileConfig {
            dev: Some(true),
            dev_port_offset: Some(offset),
            ingress: Some(ingress),
            ..FileConfig::default()
        }
        .resolve()
    };
    let c = dev(10000, true).unwrap();
    assert_eq!(c.ingress_addr, "127.0.0.1:18080".parse().unwrap());
    assert_eq!(c.ingress_tls_addr, "127.0.0.1:18443".parse().unwrap());
    // An offset too large for the ingress' defaults matters only with --ingress.
    assert!(dev(60000, false).is_ok());
    let err = dev(60000, true).unwrap_err().to_string();
    assert!(
        err.starts_with("setting --ingress-addr: port 8080"),
        "{err}"
    );
    let production = FileConfig::default().resolve().unwrap();
    assert_eq!(production.ingress_addr, "0.0.0.0:80".parse().unwrap());
}
