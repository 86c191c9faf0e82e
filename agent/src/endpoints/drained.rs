//! Endpoints on drained nodes: the cache hands them to every subscriber as
//! terminating (no new flows; established ones kept for the service's
//! `drainSeconds`; not in headless DNS answers), whatever the stored object says,
//! so a drain changes no object and an undrain restores them as stored.

use super::EndpointCache;
use crate::{
    lock::lock,
    model::{Endpoint, Endpoints, ServiceKey},
};
use std::{collections::BTreeSet, sync::Arc};

impl EndpointCache {
    /// Sets the host names of the drained nodes (the whole set, replacing the
    /// last): their endpoints (by [`Endpoint::node`]) are terminating in every
    /// view from now on, and the services with endpoints on a node that entered or
    /// left the set are handed to subscribers as changed, at the same revision.
    pub fn set_drained_nodes(&self, nodes: BTreeSet<String>) {
        let mut st = lock(&self.state);
        if st.drained == nodes {
            return;
        }
        let flipped: BTreeSet<&str> = st
            .drained
            .symmetric_difference(&nodes)
            .map(String::as_str)
            .collect();
        let changed: BTreeSet<ServiceKey> = st
            .objects
            .iter()
            .filter(|(_, e)| {
                e.endpoints
                    .as_ref()
                    .is_some_and(|eps| has_endpoint_on(eps, &flipped))
            })
            .map(|(k, _)| k.clone())
            .collect();
        st.drained = nodes;
        Self::mark(&mut st, changed);
    }

    /// The host names of the drained nodes ([`EndpointCache::set_drained_nodes`]).
    pub fn drained_nodes(&self) -> BTreeSet<String> {
        lock(&self.state).drained.clone()
    }
}

/// `endpoints` with every endpoint whose node is in `drained` terminating; the
/// same `Arc` (no copy) when none is affected, as when nothing is drained.
pub(super) fn terminating_on(
    endpoints: &Arc<Endpoints>,
    drained: &BTreeSet<String>,
) -> Arc<Endpoints> {
    let affected = |e: &Endpoint| !e.terminating && drained.contains(&*e.node);
    if drained.is_empty() || !endpoints.spec.endpoints.iter().any(affected) {
        return endpoints.clone();
    }
    let mut copy = Endpoints::clone(endpoints);
    for e in copy.spec.endpoints.iter_mut().filter(|e| affected(e)) {
        e.terminating = true;
    }
    Arc::new(copy)
}

/// Whether an endpoint of `endpoints` is on one of `nodes`.
fn has_endpoint_on(endpoints: &Endpoints, nodes: &BTreeSet<&str>) -> bool {
    !nodes.is_empty()
        && endpoints
            .spec
            .endpoints
            .iter()
            .any(|e| nodes.contains(&*e.node))
}

#[cfg(test)]
mod tests {
    use super::super::{EndpointCache, ServiceView};
    use crate::{
        model::{Object, parse_documents},
        orderedlog::Snapshot,
    };
    use std::{collections::BTreeSet, sync::Arc};

    /// A service `name` with one endpoint per `(address, node)`.
    fn service(name: &str, endpoints: &[(&str, &str)]) -> Vec<Object> {
        let list: Vec<String> = endpoints
            .iter()
            .map(|(a, n)| format!("{{address: {a}, node: {n}}}"))
            .collect();
        parse_documents(&format!(
            "apiVersion: rune/v1\nkind: Service\nmetadata: {{name: {name}}}\nspec: {{ports: [{{port: 80}}]}}\n\
             ---\napiVersion: rune/v1\nkind: Endpoints\nmetadata: {{name: {name}}}\n\
             spec: {{endpoints: [{}]}}\n",
            list.join(", ")
        ))
        .unwrap()
    }

    /// `(address, terminating)` of each endpoint of `view`.
    fn states(view: &ServiceView) -> Vec<(String, bool)> {
        view.endpoint_list()
            .iter()
            .map(|e| (e.address.to_string(), e.terminating))
            .collect()
    }

    fn drained(nodes: &[&str]) -> BTreeSet<String> {
        nodes.iter().map(|n| (*n).to_owned()).collect()
    }

    #[test]
    fn a_drained_nodes_endpoints_are_terminating_until_it_is_undrained() {
        let cache = Arc::new(EndpointCache::new());
        let mut objects = service("web", &[("198.18.1.1", "node-1"), ("198.18.2.1", "node-2")]);
        objects.extend(service("db", &[("198.18.2.2", "node-2")]));
        cache.apply_snapshot(&Snapshot {
            revision: 7,
            objects,
        });
        let mut sub = cache.subscribe();
        assert!(sub.try_next().unwrap().full);

        cache.set_drained_nodes(drained(&["node-1"]));
        let d = sub.try_next().expect("a delta for the drain");
        assert_eq!(d.revision, 7, "a drain is no new revision");
        assert!(!d.full && d.removed.is_empty());
        assert_eq!(d.upserted.len(), 1, "only web has endpoints on node-1");
        assert_eq!(
            states(&d.upserted[0]),
            [
                ("198.18.1.1".to_owned(), true),
                ("198.18.2.1".to_owned(), false)
            ]
        );
        assert!(sub.try_next().is_none());
        // Every reader sees it: status, and later subscribers' full deltas.
        let db = cache
            .views()
            .into_iter()
            .find(|v| v.key().name == "db")
            .unwrap();
        assert_eq!(states(&db), [("198.18.2.2".to_owned(), false)]);
        let mut late = cache.subscribe();
        let web = late
            .try_next()
            .unwrap()
            .upserted
            .into_iter()
            .find(|v| v.key().name == "web");
        assert!(web.unwrap().endpoint_list()[0].terminating);

        // The same set again changes nothing.
        cache.set_drained_nodes(drained(&["node-1"]));
        assert!(sub.try_next().is_none());

        cache.set_drained_nodes(BTreeSet::new());
        let d = sub.try_next().expect("a delta for the undrain");
        assert_eq!(d.upserted.len(), 1);
        assert_eq!(
            states(&d.upserted[0]),
            [
                ("198.18.1.1".to_owned(), false),
                ("198.18.2.1".to_owned(), false)
            ]
        );
        assert_eq!(cache.drained_nodes(), BTreeSet::new());
    }

    #[test]
    fn headless_dns_leaves_a_drained_nodes_endpoints_out() {
        use crate::{
            config::Mode,
            dns::{Zone, ZoneConfig},
        };
        use hickory_proto::rr::{LowerName, RData, RecordType};
        let cache = Arc::new(EndpointCache::new());
        let mut objects = service("db", &[("198.18.1.1", "node-1"), ("198.18.2.1", "node-2")]);
        if let Object::Service(s) = &mut objects[0] {
            s.spec.discovery.headless = true;
        }
        cache.apply_snapshot(&Snapshot {
            revision: 1,
            objects,
        });
        let answers = |cache: &EndpointCache| {
            let config = ZoneConfig {
                domain: "rune.".into(),
                ttl: 5,
                mode: Mode::Production,
                dev_port_offset: 0,
            };
            let zone = Zone::build(&config, 1, &cache.views()).unwrap();
            let name: LowerName = "db.default.rune.".parse().unwrap();
            let answer = zone.lookup(&name, RecordType::A);
            answer
                .answers
                .iter()
                .map(|r| match &r.data {
                    RData::A(a) => a.0.to_string(),
                    other => panic!("not an address: {other:?}"),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(answers(&cache), ["198.18.1.1", "198.18.2.1"]);
        cache.set_drained_nodes(drained(&["node-1"]));
        assert_eq!(answers(&cache), ["198.18.2.1"]);
        cache.set_drained_nodes(BTreeSet::new());
        assert_eq!(answers(&cache), ["198.18.1.1", "198.18.2.1"]);
    }

    #[test]
    fn an_event_on_a_drained_node_stays_terminating_and_the_stored_object_is_untouched() {
        let cache = Arc::new(EndpointCache::loaded());
        cache.set_drained_nodes(drained(&["node-2"]));
        let mut sub = cache.subscribe();
        sub.try_next().unwrap();
        let objects = service("web", &[("198.18.2.1", "node-2")]);
        let events: Vec<_> = objects
            .into_iter()
            .map(|object| crate::orderedlog::Event::Put {
                revision: 3,
                object,
            })
            .collect();
        cache.apply_events(&events);
        let d = sub.try_next().unwrap();
        assert_eq!(states(&d.upserted[0]), [("198.18.2.1".to_owned(), true)]);
        // What the cache holds is the stored object: only views are changed.
        let state = crate::lock::lock(&cache.state);
        let entry = state.objects.values().next().unwrap();
        assert!(!entry.endpoints.as_ref().unwrap().spec.endpoints[0].terminating);
    }
}
