use super::*;
use crate::model::parse_documents;

fn svc(name: &str, vips: &str) -> Object {
    let text = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
         spec: {{ports: [{{port: 80}}], discovery: {{vips: [{vips}]}}}}\n"
    );
    parse_documents(&text).unwrap().remove(0)
}

fn key(name: &str) -> ObjectKey {
    ObjectKey::new(Kind::Service, "default", name)
}

#[test]
fn a_batch_naming_one_object_twice_is_refused() {
    let err = check_batch(&[svc("web", "198.18.0.1"), svc("web", "198.18.0.2")]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Service default/web: metadata.name: the same object appears twice in one apply"
    );
}

#[test]
fn a_vip_owned_by_another_stored_service_is_refused_on_the_batch_service() {
    let batch = [svc("web", "198.18.0.1")];
    let keys = check_batch(&batch).unwrap();
    let err = check_claim_owners(&batch, &keys, |_| Ok(Some(key("api")))).unwrap_err();
    let VipCheckError::Invalid(e) = err else {
        panic!("expected a VIP conflict, got {err:?}")
    };
    assert_eq!(
        e.to_string(),
        "Service default/web: spec.discovery.vips[0]: VIP 198.18.0.1 is already used by Service default/api"
    );
}

#[test]
fn a_stored_owner_the_batch_rewrites_is_judged_by_its_new_vips() {
    // api gives 198.18.0.1 up in the same batch in which web takes it.
    let batch = [svc("web", "198.18.0.1"), svc("api", "198.18.0.2")];
    let keys = check_batch(&batch).unwrap();
    check_claim_owners(&batch, &keys, |vip| {
        Ok((vip == "198.18.0.1").then(|| key("api")))
    })
    .unwrap();
    // Both keeping it is a conflict inside the batch, named on the later key.
    let batch = [svc("web", "198.18.0.1"), svc("api", "198.18.0.1")];
    let keys = check_batch(&batch).unwrap();
    let err = check_claim_owners(&batch, &keys, |_| Ok(None)).unwrap_err();
    assert!(
        matches!(&err, VipCheckError::Invalid(e) if e.to_string().starts_with("Service default/web:")),
        "{err:?}"
    );
}

fn exposed(name: &str, host: &str, path: &str) -> Object {
    let text = format!(
        "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\n\
         spec: {{ports: [{{port: 80}}], expose: {{host: {host:?}, path: {path:?}}}}}\n"
    );
    parse_documents(&text).unwrap().remove(0)
}

#[test]
fn two_services_exposing_one_host_and_path_are_refused_naming_both() {
    let batch = [exposed("web", "a.example", "/api")];
    let keys = check_batch(&batch).unwrap();
    let err = check_claim_owners(&batch, &keys, |k| {
        Ok((k == "route:a.example/api").then(|| key("api")))
    })
    .unwrap_err();
    let VipCheckError::Invalid(e) = err else {
        panic!("expected a route conflict, got {err:?}")
    };
    assert_eq!(
        e.to_string(),
        "Service default/web: spec.expose: host a.example path /api is already used by Service default/api"
    );
    // Another path on the same host is free.
    let batch = [
        exposed("web", "a.example", "/api"),
        exposed("api", "a.example", "/"),
    ];
    let keys = check_batch(&batch).unwrap();
    check_claim_owners(&batch, &keys, |_| Ok(None)).unwrap();
}

#[test]
fn a_claim_move_releases_what_the_new_version_no_longer_holds() {
    let old = svc("a", "198.18.0.1, 'fd00::1'");
    let new = svc("a", "198.18.0.2, 'fd00::1'");
    let moved = claim_move(Some(&old), Some(&new));
    assert_eq!(moved.released, ["198.18.0.1"]);
    assert_eq!(moved.claimed, ["198.18.0.2", "fd00::1"]);
    // A create claims everything, a delete releases everything.
    assert_eq!(claim_move(None, Some(&old)).released, Vec::<String>::new());
    assert_eq!(
        claim_move(Some(&old), None).released,
        ["198.18.0.1", "fd00::1"]
    );
}
