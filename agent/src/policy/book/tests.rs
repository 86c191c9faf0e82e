use super::PolicyBook;
use crate::{
    endpoints::Delta,
    model::ServiceKey,
    policy::compile::tests::{service, views},
};
use std::net::IpAddr;

fn delta(full: bool, yaml: &str, removed: &[(&str, &str)]) -> Delta {
    Delta {
        revision: Default::default(),
        full,
        upserted: views(yaml).into_values().collect(),
        removed: removed
            .iter()
            .map(|(ns, n)| ServiceKey::new(*ns, *n))
            .collect(),
    }
}

/// Takes `delta` into `book`; whether the plan changed.
fn changes(book: &mut PolicyBook, delta: &Delta) -> bool {
    !book.apply(delta).is_empty()
}

fn web() -> String {
    service(
        "shop",
        "web",
        "[{port: 80}]",
        "",
        "{ingress: [{from: [{service: api}]}]}",
        "[{address: 198.18.11.2}]",
    )
}

fn api(eps: &str) -> String {
    service("shop", "api", "[{port: 80}]", "", "", eps)
}

fn allowed(book: &PolicyBook) -> Vec<String> {
    let plan = book.plan();
    let ip: IpAddr = "198.18.11.2".parse().unwrap();
    plan.endpoints[&ip]
        .ingress
        .as_ref()
        .unwrap()
        .rules
        .iter()
        .flat_map(|r| r.peers.iter().map(|p| p.to_string()))
        .collect()
}

#[test]
fn a_peer_services_endpoint_change_changes_the_plan_without_touching_the_policy() {
    let mut book = PolicyBook::new("node-a");
    assert!(changes(
        &mut book,
        &delta(true, &(web() + &api("[{address: 198.18.1.2}]")), &[])
    ));
    assert_eq!(allowed(&book), ["198.18.1.2/32"]);
    assert!(changes(
        &mut book,
        &delta(false, &api("[{address: 198.18.1.3}]"), &[])
    ));
    assert_eq!(allowed(&book), ["198.18.1.3/32"]);
    assert!(changes(&mut book, &delta(false, "", &[("shop", "api")])));
    assert_eq!(allowed(&book), Vec::<String>::new());
}

#[test]
fn changes_no_policy_sees_are_told_apart() {
    let mut book = PolicyBook::new("node-a");
    assert!(
        !changes(
            &mut book,
            &delta(true, &api("[{address: 198.18.1.2}]"), &[])
        ),
        "no policy anywhere"
    );
    assert!(changes(&mut book, &delta(false, &web(), &[])));
    let other = service(
        "shop",
        "other",
        "[{port: 80}]",
        "",
        "",
        "[{address: 198.18.1.9}]",
    );
    assert!(
        !changes(&mut book, &delta(false, &other, &[])),
        "not a peer of any policy"
    );
    assert!(changes(&mut book, &delta(false, &api("[]"), &[])), "a peer");
    assert!(
        changes(&mut book, &delta(false, "", &[("shop", "web")])),
        "the policy went"
    );
    assert!(book.plan().endpoints.is_empty());
    assert!(
        !changes(
            &mut book,
            &delta(false, &api("[{address: 198.18.1.4}]"), &[])
        ),
        "no longer a peer"
    );
}

#[test]
fn a_full_delta_replaces_everything() {
    let mut book = PolicyBook::new("node-a");
    book.apply(&delta(true, &web(), &[]));
    assert_eq!(book.plan().services.len(), 1);
    assert!(changes(&mut book, &delta(true, &api("[]"), &[])));
    assert!(book.plan().services.is_empty());
}
