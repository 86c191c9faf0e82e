use crate::model::{ModelError, Object, parse_documents};

/// A service `web` (ports http 80→8080/TCP and dns 53/UDP) with `policy` as its
/// `networkPolicy` (YAML flow text).
fn web(policy: &str) -> String {
    format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: web, namespace: shop}}\n\
         spec:\n  ports:\n    - {{name: http, port: 80, targetPort: 8080}}\n    \
         - {{name: dns, port: 53, protocol: UDP}}\n  networkPolicy: {policy}\n"
    )
}

fn invalid(policy: &str) -> (String, String) {
    match parse_documents(&web(policy)) {
        Err(ModelError::Invalid {
            object,
            field,
            message,
        }) => {
            assert_eq!(object, "Service shop/web");
            (field, message)
        }
        other => panic!("{policy}: expected an invalid field, got {other:?}"),
    }
}

#[test]
fn the_issue_example_parses_and_round_trips() {
    let policy = "{mode: audit, ingress: [{from: [{service: api, namespace: shop}, \
                  {namespace: ops}, {cidr: 198.18.0.0/24}, {cidr: \"fd00:1::/64\"}], \
                  ports: [\"80/tcp\", http, \"53/udp\", \"8080\"]}], \
                  egress: [{to: [{service: db}, {cidr: 0.0.0.0/0}], ports: [\"5432/tcp\"]}]}";
    let objs = parse_documents(&web(policy)).unwrap();
    let Object::Service(s) = &objs[0] else {
        panic!("not a service")
    };
    let p = s.spec.network_policy.as_ref().unwrap();
    assert_eq!(p.mode, super::PolicyMode::Audit);
    assert_eq!(p.ingress[0].from.len(), 4);
    assert_eq!(p.egress[0].to[0].service.as_deref(), Some("db"));
    let again = crate::model::parse_json(&objs[0].to_json().to_string()).unwrap();
    assert_eq!(again, objs[0]);
    let json = objs[0].to_json();
    assert_eq!(json["spec"]["networkPolicy"]["mode"], "audit");
    assert_eq!(
        json["spec"]["networkPolicy"]["egress"][0]["to"][1]["cidr"],
        "0.0.0.0/0"
    );
}

#[test]
fn mode_defaults_to_enforce_and_no_policy_is_not_written() {
    let objs = parse_documents(&web("{ingress: [{}]}")).unwrap();
    let Object::Service(s) = &objs[0] else {
        panic!("not a service")
    };
    assert_eq!(
        s.spec.network_policy.as_ref().unwrap().mode,
        super::PolicyMode::Enforce
    );
    let mut plain = s.clone();
    plain.spec.network_policy = None;
    let json = Object::Service(plain).to_json();
    assert!(json["spec"].get("networkPolicy").is_none(), "{json}");
}

#[test]
fn unknown_fields_and_modes_are_refused() {
    for policy in [
        "{ingres: []}",
        "{mode: block}",
        "{ingress: [{from: [{cidr: 198.18.0.0/24, label: x}]}]}",
        "{ingress: [{to: []}]}",
    ] {
        assert!(
            parse_documents(&web(policy)).is_err(),
            "{policy} was accepted"
        );
    }
}

#[test]
fn a_bad_cidr_names_the_field_and_value() {
    let (field, message) =
        invalid("{ingress: [{from: [{cidr: 198.18.0.0/24}, {cidr: 198.18.0.0/33}]}]}");
    assert_eq!(field, "spec.networkPolicy.ingress[0].from[1].cidr");
    assert!(message.contains("198.18.0.0/33"), "{message}");
    let (field, message) = invalid("{egress: [{to: [{cidr: nonsense}]}]}");
    assert_eq!(field, "spec.networkPolicy.egress[0].to[0].cidr");
    assert!(message.contains("nonsense"), "{message}");
}

#[test]
fn host_bits_in_a_cidr_are_refused_with_the_normalized_prefix() {
    let (field, message) = invalid("{ingress: [{from: [{cidr: 198.18.1.2/24}]}]}");
    assert_eq!(field, "spec.networkPolicy.ingress[0].from[0].cidr");
    assert!(message.contains("write 198.18.1.0/24"), "{message}");
    let (_, message) = invalid("{ingress: [{from: [{cidr: \"fd00:1::2/64\"}]}]}");
    assert!(message.contains("write fd00:1::/64"), "{message}");
}

#[test]
fn a_peer_needs_exactly_one_selector() {
    let (field, message) = invalid("{ingress: [{from: [{}]}]}");
    assert_eq!(field, "spec.networkPolicy.ingress[0].from[0]");
    assert!(
        message.contains("one of service, namespace or cidr"),
        "{message}"
    );
    let (field, message) =
        invalid("{egress: [{to: [{service: db}, {namespace: ops, cidr: 10.0.0.0/8}]}]}");
    assert_eq!(field, "spec.networkPolicy.egress[0].to[1]");
    assert!(message.contains("namespace and cidr"), "{message}");
    let (_, message) = invalid("{ingress: [{from: [{service: api, cidr: 10.0.0.0/8}]}]}");
    assert!(message.contains("service and cidr"), "{message}");
}

#[test]
fn peer_names_must_be_dns_labels() {
    let (field, message) = invalid("{ingress: [{from: [{service: Api}]}]}");
    assert_eq!(field, "spec.networkPolicy.ingress[0].from[0].service");
    assert!(message.contains("\"Api\""), "{message}");
    let (field, _) = invalid("{ingress: [{from: [{service: api, namespace: \"-x\"}]}]}");
    assert_eq!(field, "spec.networkPolicy.ingress[0].from[0].namespace");
}

#[test]
fn bad_port_entries_name_the_field_and_value() {
    for (port, expect) in [
        ("\"0\"", "out of range"),
        ("\"65536\"", "out of range"),
        ("\"99999999999\"", "out of range"),
        ("\"80/sctp\"", "unknown protocol \\\"sctp\\\""),
        ("grpc", "\\\"grpc\\\" is neither"),
        ("\"http/tcp\"", "is not a port"),
        ("\"/tcp\"", "is not a port"),
    ] {
        let (field, message) = invalid(&format!("{{ingress: [{{ports: [\"80\", {port}]}}]}}"));
        assert_eq!(field, "spec.networkPolicy.ingress[0].ports[1]", "{port}");
        assert!(
            message.contains(expect.replace('\\', "").as_str()),
            "{port}: {message}"
        );
    }
}

#[test]
fn egress_ports_are_numbers() {
    let (field, message) = invalid("{egress: [{ports: [http]}]}");
    assert_eq!(field, "spec.networkPolicy.egress[0].ports[0]");
    assert!(
        message.contains("egress ports are destination port numbers"),
        "{message}"
    );
    assert!(parse_documents(&web("{egress: [{ports: [\"5432\", \"53/UDP\"]}]}")).is_ok());
}

#[test]
fn port_entries_parse_to_numbers_and_names() {
    use super::PortEntry;
    use crate::model::Protocol;
    let objs = parse_documents(&web("{}")).unwrap();
    let Object::Service(s) = &objs[0] else {
        panic!("not a service")
    };
    let parse = |t: &str| PortEntry::parse(t, &s.spec).unwrap();
    assert_eq!(
        parse("80"),
        PortEntry::Number {
            port: 80,
            protocol: Protocol::Tcp
        }
    );
    assert_eq!(
        parse("53/udp"),
        PortEntry::Number {
            port: 53,
            protocol: Protocol::Udp
        }
    );
    assert_eq!(
        parse("65535/TCP"),
        PortEntry::Number {
            port: 65535,
            protocol: Protocol::Tcp
        }
    );
    assert_eq!(parse("dns"), PortEntry::Name("dns".into()));
}
