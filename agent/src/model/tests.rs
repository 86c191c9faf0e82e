use super::*;

const WEB: &str = r#"
apiVersion: rune/v1
kind: Service
metadata: {namespace: default, name: web, labels: {app: web}}
spec:
  ports:
    - {name: http, port: 80, protocol: TCP, targetPort: 8080}
    - {name: dns, port: 53, protocol: UDP}
  discovery:
    vips: [198.18.100.10, "fd00:100::10"]
  sessionAffinity: {type: ClientIP, timeoutSeconds: 60}
  drainSeconds: 10
---
apiVersion: rune/v1
kind: Endpoints
metadata: {name: web}
spec:
  endpoints:
    - {address: 198.18.1.2, node: node-a}
    - {address: "fd00:1::3", node: node-b.example, ready: true, terminating: true, ports: {http: 8081}}
"#;

#[test]
fn parses_the_design_example() {
    let objs = parse_documents(WEB).unwrap();
    assert_eq!(objs.len(), 2);
    let Object::Service(s) = &objs[0] else {
        panic!("not a service")
    };
    assert_eq!(s.spec.ports[0].target(), 8080);
    assert_eq!(s.spec.ports[1].target(), 53);
    assert_eq!(s.spec.ports[1].protocol, Protocol::Udp);
    assert_eq!(s.spec.discovery.vips.len(), 2);
    assert_eq!(
        s.spec.session_affinity,
        SessionAffinity::ClientIp {
            timeout_seconds: 60
        }
    );
    let Object::Endpoints(e) = &objs[1] else {
        panic!("not endpoints")
    };
    assert_eq!(e.metadata.namespace, "default");
    assert!(e.spec.endpoints[0].accepts_new());
    assert!(!e.spec.endpoints[1].accepts_new());
    assert!(e.spec.endpoints[1].is_serving());
    assert_eq!(e.spec.endpoints[1].ports.get("http"), Some(&8081));
}

/// Port overrides are written as the map they were given, and an empty map reads
/// as none and is not written.
#[test]
fn port_overrides_serialize_as_a_map_and_empty_ones_are_left_out() {
    let objs = parse_documents(WEB).unwrap();
    let Object::Endpoints(e) = &objs[1] else {
        panic!("not endpoints")
    };
    let json = objs[1].to_json();
    assert_eq!(json["spec"]["endpoints"][1]["ports"]["http"], 8081);
    assert!(json["spec"]["endpoints"][0].get("ports").is_none());
    assert!(e.spec.endpoints[0].ports.is_empty());
    let empty = "apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: web}\nspec: {endpoints: [{address: 198.18.1.2, ports: {}}]}\n";
    let Object::Endpoints(e) = &parse_documents(empty).unwrap()[0] else {
        panic!("not endpoints")
    };
    assert!(e.spec.endpoints[0].ports.is_empty());
    assert_eq!(e.spec.endpoints[0].ports.iter().count(), 0);
}

#[test]
fn json_round_trip_keeps_every_field() {
    for obj in parse_documents(WEB).unwrap() {
        let json = obj.to_json();
        assert_eq!(json["apiVersion"], "rune/v1");
        let back = parse_json(&json.to_string()).unwrap();
        assert_eq!(back, obj);
    }
}

#[test]
fn defaults_apply() {
    let objs = parse_documents(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: a}\nspec: {ports: [{port: 80}]}\n",
    )
    .unwrap();
    let Object::Service(s) = &objs[0] else {
        panic!()
    };
    assert_eq!(s.metadata.namespace, "default");
    assert_eq!(s.spec.ports[0].protocol, Protocol::Tcp);
    assert_eq!(s.spec.session_affinity, SessionAffinity::None);
    assert_eq!(s.spec.drain_seconds, 30);
    assert_eq!(
        s.spec.discovery.locality_preference,
        LocalityPreference::Any
    );
}

fn svc(spec: &str) -> String {
    format!("apiVersion: rune/v1\nkind: Service\nmetadata: {{name: web}}\nspec: {spec}\n")
}

fn eps(spec: &str) -> String {
    format!("apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: web}}\nspec: {spec}\n")
}

/// Each bad input with the object, field and a fragment of the message it must name.
#[test]
fn bad_inputs_are_refused_with_object_field_and_value() {
    let cases: Vec<(String, &str, &str, &str)> = vec![
        (svc("{ports: [{port: 0}]}"), "Service default/web", "spec.ports[0].port", "port 0"),
        (svc("{ports: [{port: 70000}]}"), "Service default/web", "spec.ports[0].port", "70000"),
        (svc("{ports: [{port: -1}]}"), "Service default/web", "spec.ports[0].port", "-1"),
        (svc("{ports: [{port: 80, targetPort: 0}]}"), "Service default/web", "spec.ports[0].targetPort", "port 0"),
        (svc("{ports: [{name: a, port: 80}, {name: b, port: 80}]}"), "Service default/web", "spec.ports[1].port", "duplicate port 80/TCP"),
        (svc("{ports: [{name: a, port: 80}, {name: a, port: 81}]}"), "Service default/web", "spec.ports[1].name", "duplicate port name \"a\""),
        (svc("{ports: [{port: 80}, {port: 81}]}"), "Service default/web", "spec.ports[0].name", "needs a name"),
        (svc("{ports: [{port: 80, protocol: SCTP}]}"), "Service default/web", "spec.ports[0].protocol", "SCTP"),
        (svc("{ports: [{port: 80}], discovery: {vips: [300.1.2.3]}}"), "Service default/web", "spec.discovery.vips[0]", "300.1.2.3"),
        (svc("{ports: [{port: 80}], discovery: {vips: [0.0.0.0]}}"), "Service default/web", "spec.discovery.vips[0]", "0.0.0.0"),
        (svc("{ports: [{port: 80}], discovery: {vips: [198.18.0.1, 198.18.0.2]}}"), "Service default/web", "spec.discovery.vips[1]", "198.18.0.2"),
        (svc("{ports: [{port: 80}], discovery: {vips: [\"::ffff:198.18.0.1\"]}}"), "Service default/web", "spec.discovery.vips[0]", "write 198.18.0.1"),
        (svc("{ports: [{port: 80}], discovery: {vips: [255.255.255.255]}}"), "Service default/web", "spec.discovery.vips[0]", "broadcast"),
        (eps("{endpoints: [{address: \"::ffff:127.0.0.2\"}]}"), "Endpoints default/web", "spec.endpoints[0].address", "IPv4-mapped"),
        (svc("{ports: [{port: 80}], discovery: {vips: [198.18.0.1], headless: true}}"), "Service default/web", "spec.discovery.vips", "headless"),
        (svc("{ports: [{port: 80}], discovery: {localityPreference: nearby}}"), "Service default/web", "spec.discovery.localityPreference", "nearby"),
        (svc("{ports: [{port: 80}], sessionAffinity: {type: ClientIP, timeoutSeconds: 0}}"), "Service default/web", "spec.sessionAffinity.timeoutSeconds", "0 is out of range"),
        (svc("{ports: [{port: 80}], sessionAffinity: {type: Sticky}}"), "Service default/web", "spec.sessionAffinity.type", "Sticky"),
        (svc("{ports: [{port: 80}], drainSeconds: 99999}"), "Service default/web", "spec.drainSeconds", "99999"),
        (svc("{ports: []}"), "Service default/web", "spec.ports", "at least one port"),
        (svc("{ports: [{port: 80, tragetPort: 8080}]}"), "Service default/web", "spec.ports[0].tragetPort", "unknown field `tragetPort`"),
        (eps("{endpoints: [{address: 198.18.1.300}]}"), "Endpoints default/web", "spec.endpoints[0].address", "198.18.1.300"),
        (eps("{endpoints: [{address: 198.18.1.2}, {address: 198.18.1.2}]}"), "Endpoints default/web", "spec.endpoints[1]", "duplicate endpoint 198.18.1.2 (on the service's target ports): spec.endpoints[0] has the same address and ports"),
        (eps("{endpoints: [{address: 127.0.0.1, ports: {http: 8081}}, {address: 127.0.0.1, ports: {http: 8082}}, {address: 127.0.0.1, ports: {http: 8081}}]}"), "Endpoints default/web", "spec.endpoints[2]", "duplicate endpoint 127.0.0.1:8081 (http): spec.endpoints[0]"),
        (eps("{endpoints: [{address: \"fd00::1\", ports: {a: 81, b: 82}}, {address: \"fd00::1\", ports: {b: 82, a: 81}}]}"), "Endpoints default/web", "spec.endpoints[1]", "[fd00::1]:81 (a), [fd00::1]:82 (b)"),
        (eps("{endpoints: [{address: 198.18.1.2, ports: {http: 0}}]}"), "Endpoints default/web", "spec.endpoints[0].ports.http", "port 0"),
        (eps("{endpoints: [{address: 198.18.1.2, node: Node_A}]}"), "Endpoints default/web", "spec.endpoints[0].node", "Node_A"),
        (eps("{endpoints: [{address: 224.0.0.1}]}"), "Endpoints default/web", "spec.endpoints[0].address", "multicast"),
        ("apiVersion: rune/v1\nkind: Gateway\nmetadata: {name: x}\n".into(), "document 1", "kind", "unknown kind \"Gateway\""),
        ("apiVersion: rune/v2\nkind: Service\nmetadata: {name: x}\n".into(), "document 1", "apiVersion", "rune/v2"),
        ("kind: Service\nmetadata: {name: x}\n".into(), "document 1", "apiVersion", "missing"),
        ("apiVersion: rune/v1\nkind: Service\nmetadata: {namespace: a}\nspec: {ports: [{port: 80}]}\n".into(), "Service in document 1", "metadata.name", "missing"),
        ("apiVersion: rune/v1\nkind: Service\nmetadata: {name: Web_1}\nspec: {ports: [{port: 80}]}\n".into(), "Service default/Web_1", "metadata.name", "Web_1"),
        ("apiVersion: rune/v1\nkind: Service\nmetadata: {name: web, namespace: \"\"}\nspec: {ports: [{port: 80}]}\n".into(), "Service /web", "metadata.namespace", "must not be empty"),
    ];
    assert!(cases.len() >= 15);
    for (input, object, field, fragment) in cases {
        // The same document as JSON (keys sorted, as the store writes them) takes the
        // one-pass read first and must fail the same way.
        let json: serde_json::Value = serde_yaml_ng::from_str(&input).unwrap();
        for result in [
            parse_documents(&input),
            parse_json(&json.to_string()).map(|o| vec![o]),
        ] {
            match result {
                Err(ModelError::Invalid {
                    object: o,
                    field: f,
                    message,
                }) => {
                    assert_eq!(
                        (o.as_str(), f.as_str()),
                        (object, field),
                        "input:\n{input}\nmessage: {message}"
                    );
                    assert!(
                        message.contains(fragment),
                        "input:\n{input}\nmessage {message:?} lacks {fragment:?}"
                    );
                }
                other => panic!("input:\n{input}\nexpected an Invalid error, got {other:?}"),
            }
        }
    }
}

/// The store's one-pass read gives the object the two-step parse gives; documents
/// it does not take (keys in another order, a duplicate key) are read by the two-step
/// parse as before.
#[test]
fn stored_documents_are_read_in_one_pass() {
    let mut objs = parse_documents(WEB).unwrap();
    objs.extend(
        parse_documents("apiVersion: rune/v1\nkind: Endpoints\nmetadata: {name: bare}\n").unwrap(),
    );
    for obj in objs {
        let text = obj.to_json().to_string();
        let one_pass: document::Stored =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("one pass refused {text}: {e}"));
        assert_eq!(one_pass.0, obj);
        assert_eq!(parse_stored(&text).unwrap(), obj);
    }
    // Lists are sized to their length, whichever way they were read.
    let many: Vec<String> = (1..=20)
        .map(|i| format!(r#"{{"address":"198.18.1.{i}"}}"#))
        .collect();
    let text = format!(
        r#"{{"apiVersion":"rune/v1","kind":"Endpoints","metadata":{{"name":"web"}},"spec":{{"endpoints":[{}]}}}}"#,
        many.join(",")
    );
    for n in [3, 20] {
        let text = text.replacen(
            &many[n..]
                .iter()
                .map(|m| format!(",{m}"))
                .collect::<String>(),
            "",
            1,
        );
        let Object::Endpoints(e) = parse_stored(&text).unwrap() else {
            panic!("not endpoints")
        };
        assert_eq!(e.spec.endpoints.len(), n);
        assert_eq!(e.spec.endpoints.capacity(), n, "spare capacity kept");
    }
    let reordered = r#"{"spec":{"endpoints":[{"address":"198.18.1.2"}]},"metadata":{"name":"web"},"kind":"Endpoints","apiVersion":"rune/v1"}"#;
    let duplicate = r#"{"apiVersion":"rune/v1","kind":"Endpoints","kind":"Endpoints","metadata":{"name":"web"},"spec":{"endpoints":[{"address":"198.18.1.2"}]}}"#;
    for text in [reordered, duplicate] {
        assert!(
            serde_json::from_str::<document::Stored>(text).is_err(),
            "{text}"
        );
        let Object::Endpoints(e) = parse_stored(text).unwrap() else {
            panic!("not endpoints: {text}")
        };
        assert_eq!(e.spec.endpoints.len(), 1, "{text}");
    }
}

#[test]
fn syntax_errors_name_the_document() {
    let text = format!("{}---\n[unclosed", svc("{ports: [{port: 80}]}"));
    let err = parse_documents(&text).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::Syntax { index: 1, .. } | ModelError::Syntax { index: 2, .. }
        ),
        "{err}"
    );
    let err = parse_documents("- a\n- b\n").unwrap_err();
    assert_eq!(
        err,
        ModelError::Syntax {
            index: 1,
            message: "expected a mapping, got a list".into()
        }
    );
}

#[test]
fn a_vip_used_by_two_services_is_refused() {
    let a = &parse_documents(&svc(
        "{ports: [{port: 80}], discovery: {vips: [198.18.100.10]}}",
    ))
    .unwrap()[0];
    let b = &parse_documents(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {name: other}\nspec: {ports: [{port: 81}], discovery: {vips: [198.18.100.10]}}\n",
    )
    .unwrap()[0];
    let err = check_vips([a, b], std::slice::from_ref(b)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Service default/other: spec.discovery.vips[0]: VIP 198.18.100.10 is already used by Service default/web"
    );
    // Its own earlier version is no conflict.
    check_vips([a], std::slice::from_ref(a)).unwrap();
    // The error lands on the object being written, whichever order the state has.
    let err = check_vips([b, a], std::slice::from_ref(a)).unwrap_err();
    assert!(err.to_string().starts_with("Service default/web:"), "{err}");
}

/// Endpoints on one address are different backends when their ports differ: three
/// processes on 127.0.0.1, or a default and an overriding one.
#[test]
fn endpoints_share_an_address_on_different_ports() {
    let objs = parse_documents(&eps(
        "{endpoints: [{address: 127.0.0.1, ports: {http: 8081}}, {address: 127.0.0.1, ports: {http: 8082}}, \
         {address: 127.0.0.1, ports: {http: 8083}}, {address: 127.0.0.1}]}",
    ))
    .unwrap();
    let Object::Endpoints(e) = &objs[0] else {
        panic!("not endpoints")
    };
    let http = ServicePort {
        name: "http".into(),
        port: 80,
        protocol: Protocol::Tcp,
        target_port: Some(8080),
    };
    let ports: Vec<u16> = e.spec.endpoints.iter().map(|e| e.port_for(&http)).collect();
    assert_eq!(ports, [8081, 8082, 8083, 8080]);
}

/// The examples users start from are valid: `local.yaml`'s three endpoints are
/// three backends on 127.0.0.1.
#[test]
fn the_examples_parse() {
    parse_documents(include_str!("../../../examples/web.yaml")).unwrap();
    let local = parse_documents(include_str!("../../../examples/local.yaml")).unwrap();
    check_endpoint_ports(&local, &local).unwrap();
    let (Object::Service(s), Object::Endpoints(e)) = (&local[0], &local[1]) else {
        panic!("a service and its endpoints")
    };
    let ports: Vec<u16> = e
        .spec
        .endpoints
        .iter()
        .map(|e| e.port_for(&s.spec.ports[0]))
        .collect();
    assert_eq!(ports, [8081, 8082, 8083]);
}

/// With its Service known, two endpoints are the same backend when every service
/// port resolves to the same address and port, whichever way it was written; the
/// error names the object, the entry and every address:port that repeats.
#[test]
fn endpoints_resolving_to_the_same_ports_are_refused_against_their_service() {
    let service = &parse_documents(&svc(
        "{ports: [{name: http, port: 80, targetPort: 8080}, {name: dns, port: 53, protocol: UDP}]}",
    ))
    .unwrap()[0];
    let check = |endpoints: &str| {
        let e = parse_documents(&eps(endpoints)).unwrap();
        check_endpoint_ports([service, &e[0]], &e)
    };
    // An override equal to the target port, or for a port the service lacks.
    for same in [
        "{endpoints: [{address: 127.0.0.1}, {address: 127.0.0.1, ports: {http: 8080}}]}",
        "{endpoints: [{address: 127.0.0.1}, {address: 127.0.0.1, ports: {metrics: 9090}}]}",
    ] {
        let err = check(same).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Endpoints default/web: spec.endpoints[1]: duplicate endpoint 127.0.0.1:8080 (http), \
             127.0.0.1:53 (dns): spec.endpoints[0] has the same address and ports (endpoints on \
             one address need different ports)",
            "{same}"
        );
    }
    // One port differs: two backends (they share 127.0.0.1:53 for dns, one backend
    // there).
    check("{endpoints: [{address: 127.0.0.1}, {address: 127.0.0.1, ports: {http: 8081}}]}")
        .unwrap();
    // Without its Service nothing is resolved, and nothing is refused.
    let e = parse_documents(&eps(
        "{endpoints: [{address: 127.0.0.1}, {address: 127.0.0.1, ports: {http: 8080}}]}",
    ))
    .unwrap();
    check_endpoint_ports(&e, &e).unwrap();
    // A Service with no ports: the address alone is the backend.
    let bare = &parse_documents(&svc("{discovery: {headless: true}}")).unwrap()[0];
    let e = parse_documents(&eps(
        "{endpoints: [{address: 127.0.0.1}, {address: 127.0.0.1, ports: {http: 8081}}]}",
    ))
    .unwrap();
    let err = check_endpoint_ports([bare, &e[0]], &e).unwrap_err();
    assert!(
        err.to_string()
            .contains("spec.endpoints[1]: duplicate endpoint 127.0.0.1: spec.endpoints[0]"),
        "{err}"
    );
}

#[test]
fn kinds_parse_as_users_type_them() {
    assert_eq!(Kind::parse("svc"), Some(Kind::Service));
    assert_eq!(Kind::parse("Endpoints"), Some(Kind::Endpoints));
    assert_eq!(Kind::parse("pods"), None);
}
