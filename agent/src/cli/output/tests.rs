use super::*;
use crate::{
    model::parse_documents,
    status::{BackendStatus, PortStatus},
};

fn objects(n: usize) -> Vec<Object> {
    let mut yaml = String::new();
    for i in 0..n {
        yaml.push_str(&format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: s{i}}}\n\
             spec: {{ports: [{{port: 80}}], discovery: {{vips: [198.18.0.{i}]}}}}\n---\n\
             apiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: s{i}}}\n\
             spec: {{endpoints: [{{address: 10.0.0.{i}}}]}}\n---\n"
        ));
    }
    parse_documents(&yaml).unwrap()
}

/// Objects as `get` printed them before it streamed: all at once.
fn render_objects(objects: &[Object], output: Option<Format>, single: bool) -> String {
    match output {
        None => table(objects.iter().map(row).collect()),
        Some(Format::Json) if single && objects.len() == 1 => {
            serde_json::to_string_pretty(&objects[0].to_json()).unwrap_or_default() + "\n"
        }
        Some(Format::Json) => {
            let docs: Vec<serde_json::Value> = objects.iter().map(Object::to_json).collect();
            let list =
                serde_json::json!({"apiVersion": API_VERSION, "kind": "List", "items": docs});
            serde_json::to_string_pretty(&list).unwrap_or_default() + "\n"
        }
        Some(Format::Yaml) => objects
            .iter()
            .map(|o| serde_yaml_ng::to_string(&o.to_json()).unwrap_or_default())
            .collect::<Vec<_>>()
            .join("---\n"),
    }
}

fn streamed(objects: &[Object], format: Option<Format>, single: bool) -> String {
    let mut out = Out::memory();
    let mut printer = ObjectsOut::new(format, single).unwrap();
    for o in objects {
        printer.push(&mut out, o.clone()).unwrap();
    }
    printer.finish(&mut out).unwrap();
    out.text()
}

#[test]
fn get_streams_what_it_printed_at_once() {
    for n in [0, 1, 3] {
        let objs = objects(n);
        for format in [None, Some(Format::Json), Some(Format::Yaml)] {
            assert_eq!(
                streamed(&objs, format, false),
                render_objects(&objs, format, false),
                "{n} objects as {format:?}"
            );
        }
    }
    let one = &objects(1)[..1];
    for format in [None, Some(Format::Json), Some(Format::Yaml)] {
        assert_eq!(
            streamed(one, format, true),
            render_objects(one, format, true)
        );
    }
    let json: serde_json::Value =
        serde_json::from_str(&streamed(&objects(2), Some(Format::Json), false)).unwrap();
    assert_eq!(json["items"].as_array().unwrap().len(), 4);
}

fn service(i: usize) -> ServiceStatus {
    ServiceStatus {
        service: format!("default/s{i}"),
        vips: vec![format!("198.18.0.{i}")],
        endpoints: "1".into(),
        ports: vec![PortStatus {
            port: 80,
            protocol: "TCP".into(),
            target_port: 80,
            state: Some("listening".into()),
            ..PortStatus::default()
        }],
        backends: vec![BackendStatus {
            address: format!("10.0.0.{i}"),
            state: "accepting".into(),
            ..BackendStatus::default()
        }],
        ..ServiceStatus::default()
    }
}

#[test]
fn status_all_streams_the_whole_document() {
    for (n, orphans) in [(0, 0), (1, 0), (3, 2), (0, 1)] {
        let whole = AgentStatus {
            running: true,
            state_dir: "/var/lib/rune".into(),
            mode: Some("dev".into()),
            revision: 7,
            objects: [("Service".to_owned(), n)].into(),
            services: (0..n).map(service).collect(),
            orphan_endpoints: (0..orphans)
                .map(|i| format!("Endpoints default/o{i}"))
                .collect(),
            ..AgentStatus::default()
        };
        for format in [None, Some(Format::Json), Some(Format::Yaml)] {
            let mut out = Out::memory();
            let mut printer = StatusOut::new(format, StatusShape::All);
            let mut head = whole.clone();
            head.services.clear();
            head.orphan_endpoints.clear();
            printer
                .push(&mut out, StatusPart::Summary(Box::new(head)))
                .unwrap();
            for s in &whole.services {
                printer
                    .push(&mut out, StatusPart::Service(s.clone()))
                    .unwrap();
            }
            for o in &whole.orphan_endpoints {
                printer
                    .push(&mut out, StatusPart::Orphan(o.clone()))
                    .unwrap();
            }
            printer.finish(&mut out).unwrap();
            assert_eq!(
                out.text(),
                render_summary(&whole, format).unwrap(),
                "{n} services, {orphans} orphans as {format:?}"
            );
        }
    }
}
