//! The node's conditions: each one True or False, with a reason, a message, and
//! the time of its last transition (which changes only when the status does, as
//! in Kubernetes: a new message alone is not a transition).

use super::{
    Timestamp,
    facts::{HostSample, MapFill},
};
use serde::{Deserialize, Serialize};

/// A map at least this full (percent) is under pressure.
pub const MAP_PRESSURE_PERCENT: u64 = 90;
/// Less memory available than this (percent of the total) is pressure.
pub const MEMORY_AVAILABLE_PERCENT: u64 = 10;
/// Less free space than this (percent) on the state dir's filesystem is pressure.
pub const DISK_FREE_PERCENT: u64 = 10;

/// Which condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Kind {
    /// The agent serves: every subsystem ready.
    Ready,
    /// The data plane runs in a lesser mode than it could, or ports fail.
    DataplaneDegraded,
    /// The agent's last request to etcd failed.
    StoreDisconnected,
    /// A data plane map is at least [`MAP_PRESSURE_PERCENT`] % full.
    MapPressure,
    /// Less than [`MEMORY_AVAILABLE_PERCENT`] % of memory is available.
    MemoryPressure,
    /// Less than [`DISK_FREE_PERCENT`] % of the state dir's filesystem is free.
    DiskPressure,
}

/// Every condition, in the order of the document.
pub const ALL: [Kind; 6] = [
    Kind::Ready,
    Kind::DataplaneDegraded,
    Kind::StoreDisconnected,
    Kind::MapPressure,
    Kind::MemoryPressure,
    Kind::DiskPressure,
];

/// A condition's status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Status {
    /// The condition holds.
    True,
    /// It does not.
    False,
}

impl From<bool> for Status {
    fn from(b: bool) -> Self {
        if b { Status::True } else { Status::False }
    }
}

/// One condition as the document holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Which condition.
    #[serde(rename = "type")]
    pub kind: Kind,
    /// True or False.
    pub status: Status,
    /// A word for machines (`AgentReady`, `MapFull`).
    pub reason: String,
    /// A sentence for people.
    pub message: String,
    /// When the status last changed.
    pub last_transition_time: Timestamp,
}

/// A condition as observed now, before its transition time is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    /// Which condition.
    pub kind: Kind,
    /// True or False.
    pub status: Status,
    /// A word for machines.
    pub reason: &'static str,
    /// A sentence for people.
    pub message: String,
}

impl Observed {
    fn new(kind: Kind, holds: bool, reason: &'static str, message: String) -> Self {
        Self {
            kind,
            status: holds.into(),
            reason,
            message,
        }
    }
}

/// Everything the conditions are decided from (by default: ready, nothing wrong,
/// nothing known about maps or the host).
#[derive(Clone, Debug)]
pub struct Inputs<'a> {
    /// `Ok`, or why the agent is not ready.
    pub ready: Result<(), String>,
    /// Why the data plane is degraded, if it is.
    pub degraded: Option<String>,
    /// The last etcd failure, while it lasts.
    pub store_error: Option<String>,
    /// The data plane's maps; `None` when the mode keeps no fixed-size maps.
    pub maps: Option<&'a [MapFill]>,
    /// Memory and disk readings.
    pub host: HostSample,
}

impl Default for Inputs<'_> {
    fn default() -> Self {
        Self {
            ready: Ok(()),
            degraded: None,
            store_error: None,
            maps: None,
            host: HostSample::default(),
        }
    }
}

/// The conditions `inputs` make, in [`ALL`]'s order.
pub fn observe(inputs: &Inputs<'_>) -> Vec<Observed> {
    let ready = match &inputs.ready {
        Ok(()) => Observed::new(
            Kind::Ready,
            true,
            "AgentReady",
            "every subsystem is ready".into(),
        ),
        Err(why) => Observed::new(Kind::Ready, false, "NotReady", why.clone()),
    };
    let degraded = match &inputs.degraded {
        Some(why) => Observed::new(Kind::DataplaneDegraded, true, "Degraded", why.clone()),
        None => Observed::new(
            Kind::DataplaneDegraded,
            false,
            "AsChosen",
            "the data plane runs as preflight chose".into(),
        ),
    };
    let store = match &inputs.store_error {
        Some(e) => Observed::new(Kind::StoreDisconnected, true, "RequestFailed", e.clone()),
        None => Observed::new(
            Kind::StoreDisconnected,
            false,
            "Connected",
            "etcd answers".into(),
        ),
    };
    let full: Vec<String> = inputs
        .maps
        .unwrap_or_default()
        .iter()
        .filter(|m| m.at_least(MAP_PRESSURE_PERCENT))
        .map(|m| format!("{} {}/{}", m.name, m.used.unwrap_or(0), m.capacity))
        .collect();
    let maps = if inputs.maps.is_none() {
        Observed::new(
            Kind::MapPressure,
            false,
            "NoMaps",
            "the data plane keeps no fixed-size maps".into(),
        )
    } else if full.is_empty() {
        Observed::new(
            Kind::MapPressure,
            false,
            "MapsHaveRoom",
            format!("every map known is below {MAP_PRESSURE_PERCENT}% full"),
        )
    } else {
        Observed::new(
            Kind::MapPressure,
            true,
            "MapFull",
            format!("at least {MAP_PRESSURE_PERCENT}% full: {}", full.join(", ")),
        )
    };
    let memory = match inputs.host.memory {
        Some((total, available)) if available * 100 < total * MEMORY_AVAILABLE_PERCENT => {
            Observed::new(
                Kind::MemoryPressure,
                true,
                "LowMemory",
                format!("{} of {} MiB available", available >> 20, total >> 20),
            )
        }
        Some((total, available)) => Observed::new(
            Kind::MemoryPressure,
            false,
            "EnoughMemory",
            format!("{} of {} MiB available", available >> 20, total >> 20),
        ),
        None => Observed::new(
            Kind::MemoryPressure,
            false,
            "Unknown",
            "/proc/meminfo could not be read".into(),
        ),
    };
    let disk = match inputs.host.disk {
        Some((free, size)) if free * 100 < size * DISK_FREE_PERCENT => Observed::new(
            Kind::DiskPressure,
            true,
            "LowDisk",
            format!("{} of {} MiB free in the state dir", free >> 20, size >> 20),
        ),
        Some((free, size)) => Observed::new(
            Kind::DiskPressure,
            false,
            "EnoughDisk",
            format!("{} of {} MiB free in the state dir", free >> 20, size >> 20),
        ),
        None => Observed::new(
            Kind::DiskPressure,
            false,
            "Unknown",
            "the state dir's filesystem could not be read".into(),
        ),
    };
    vec![ready, degraded, store, maps, memory, disk]
}

/// The conditions with their transition times, kept across observations.
#[derive(Clone, Debug, Default)]
pub struct ConditionSet {
    current: Vec<Condition>,
}

impl ConditionSet {
    /// Takes in what was observed at `now`: a condition whose status changed (or
    /// that is new) gets `now` as its transition time, the others keep theirs.
    pub fn update(&mut self, observed: Vec<Observed>, now: Timestamp) {
        self.current = observed
            .into_iter()
            .map(|o| {
                let since = self
                    .current
                    .iter()
                    .find(|c| c.kind == o.kind && c.status == o.status)
                    .map_or(now, |c| c.last_transition_time);
                Condition {
                    kind: o.kind,
                    status: o.status,
                    reason: o.reason.to_owned(),
                    message: o.message,
                    last_transition_time: since,
                }
            })
            .collect();
    }

    /// The conditions now.
    pub fn conditions(&self) -> &[Condition] {
        &self.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(set: &ConditionSet, kind: Kind) -> (Status, Timestamp, String) {
        let c = set.conditions().iter().find(|c| c.kind == kind).unwrap();
        (c.status, c.last_transition_time, c.message.clone())
    }

    #[test]
    fn transition_times_change_only_on_transitions() {
        let maps = [MapFill {
            name: "flows".into(),
            capacity: 100,
            used: Some(10),
        }];
        let mut inputs = Inputs {
            ready: Err("dns is not ready".into()),
            maps: Some(&maps),
            ..Inputs::default()
        };
        let mut set = ConditionSet::default();
        set.update(observe(&inputs), Timestamp(100));
        assert_eq!(set.conditions().len(), ALL.len());
        let kinds: Vec<Kind> = set.conditions().iter().map(|c| c.kind).collect();
        assert_eq!(kinds, ALL);
        assert_eq!(status(&set, Kind::Ready).0, Status::False);

        // Same status, new message: no transition.
        inputs.ready = Err("dataplane is not ready".into());
        set.update(observe(&inputs), Timestamp(200));
        assert_eq!(
            status(&set, Kind::Ready),
            (
                Status::False,
                Timestamp(100),
                "dataplane is not ready".into()
            )
        );

        // Ready now: a transition at 300; the others keep 100.
        inputs.ready = Ok(());
        set.update(observe(&inputs), Timestamp(300));
        assert_eq!(status(&set, Kind::Ready).0, Status::True);
        assert_eq!(status(&set, Kind::Ready).1, Timestamp(300));
        assert_eq!(status(&set, Kind::MapPressure).1, Timestamp(100));

        // A map fills up: MapPressure goes True at 400, Ready keeps 300.
        let full = [MapFill {
            name: "flows".into(),
            capacity: 100,
            used: Some(95),
        }];
        inputs.maps = Some(&full);
        set.update(observe(&inputs), Timestamp(400));
        let (s, t, message) = status(&set, Kind::MapPressure);
        assert_eq!((s, t), (Status::True, Timestamp(400)));
        assert!(message.contains("flows 95/100"), "{message}");
        assert_eq!(status(&set, Kind::Ready).1, Timestamp(300));
    }

    #[test]
    fn pressure_thresholds() {
        let host = HostSample {
            memory: Some((1000 << 20, 99 << 20)),
            disk: Some((10 << 20, 100 << 20)),
        };
        let observed = observe(&Inputs {
            ready: Ok(()),
            store_error: Some("etcd at x is unavailable".into()),
            host,
            ..Inputs::default()
        });
        let get = |k| observed.iter().find(|o| o.kind == k).unwrap().status;
        assert_eq!(get(Kind::MemoryPressure), Status::True);
        assert_eq!(get(Kind::DiskPressure), Status::False, "10% free is enough");
        assert_eq!(get(Kind::StoreDisconnected), Status::True);
        assert_eq!(get(Kind::MapPressure), Status::False);
        let maps = observed
            .iter()
            .find(|o| o.kind == Kind::MapPressure)
            .unwrap();
        assert_eq!(maps.reason, "NoMaps", "no maps: said so");
    }
}
