//! Every map the load-balancing and policy programs share, declared once.
//!
//! Names and layouts are the contract with the agent (`agent_common::lb`). All maps
//! are pinned by name, so the agent can reopen them after a restart and established
//! flows keep their conntrack entries. The sizes here are placeholders: the agent
//! sets every map's capacity at load time from its configuration.

use agent_common::lb::{
    AffinityKey, AffinityValue, Backend, CtKeyV4, CtKeyV6, CtReplyV4, CtReplyV6, CtValue,
    ServiceKeyV4, ServiceKeyV6, ServiceValue, SockRevKey, SockRevValue, TrafficStats,
};
use agent_common::policy::{
    EndpointKey, EndpointPolicy, PeerV4, PeerV6, PeerValue, PolicyCtKeyV4, PolicyCtKeyV6,
    PolicyCtValue, PortKey,
};
use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf},
};

/// IPv4 frontends (`agent_common::lb::SERVICES_V4`).
#[map]
pub static RUNE_SVC_V4: HashMap<ServiceKeyV4, ServiceValue> = HashMap::pinned(65536, 0);

/// IPv6 frontends (`agent_common::lb::SERVICES_V6`).
#[map]
pub static RUNE_SVC_V6: HashMap<ServiceKeyV6, ServiceValue> = HashMap::pinned(65536, 0);

/// Backends by id (`agent_common::lb::BACKENDS`).
#[map]
pub static RUNE_BACKENDS: Array<Backend> = Array::pinned(65536, 0);

/// Every frontend's Maglev table of backend ids, two slots per entry
/// (`agent_common::lb::MAGLEV`);
/// mmapable so the agent writes whole tables without a syscall per slot.
#[map]
pub static RUNE_MAGLEV: Array<[u32; 2]> = Array::pinned(1, BPF_F_MMAPABLE);

/// IPv4 conntrack of the tc/XDP path (`agent_common::lb::CONNTRACK_V4`). One
/// common LRU, as Cilium's conntrack, not per-CPU lists (`BPF_F_NO_COMMON_LRU`):
/// those split the entries over the *possible* CPUs and a CPU evicts from its own
/// share only, so a node whose NIC queues feed a few of its CPUs could keep a
/// fraction of the table's flows; and new flows cost more with them
/// (docs/modes/ebpf.md).
#[map]
pub static RUNE_CT_V4: LruHashMap<CtKeyV4, CtValue> = LruHashMap::pinned(262_144, 0);

/// IPv6 conntrack of the tc/XDP path (`agent_common::lb::CONNTRACK_V6`).
#[map]
pub static RUNE_CT_V6: LruHashMap<CtKeyV6, CtValue> = LruHashMap::pinned(262_144, 0);

/// IPv4 reply entries (`agent_common::lb::CONNTRACK_REPLY_V4`): a backend's reply,
/// by its own tuple, to the forward entry of its flow. As large as the conntrack:
/// every flow has one of each.
#[map]
pub static RUNE_CT_REPLY_V4: LruHashMap<CtKeyV4, CtReplyV4> = LruHashMap::pinned(262_144, 0);

/// IPv6 reply entries (`agent_common::lb::CONNTRACK_REPLY_V6`).
#[map]
pub static RUNE_CT_REPLY_V6: LruHashMap<CtKeyV6, CtReplyV6> = LruHashMap::pinned(262_144, 0);

/// ClientIP session affinity (`agent_common::lb::AFFINITY`).
#[map]
pub static RUNE_AFFINITY: LruHashMap<AffinityKey, AffinityValue> = LruHashMap::pinned(65536, 0);

/// Unconnected-UDP reverse translation for `recvmsg` (`agent_common::lb::SOCK_REVERSE`).
#[map]
pub static RUNE_SOCK_REV: LruHashMap<SockRevKey, SockRevValue> = LruHashMap::pinned(65536, 0);

/// Per-frontend counters (`agent_common::lb::SERVICE_STATS`): one region of
/// [`RUNE_SVC_STATS_PER_CPU`] entries per possible CPU, CPU-major. A plain array
/// is one allocation; a per-CPU array makes one per entry, which slows the start.
#[map]
pub static RUNE_SVC_STATS: Array<TrafficStats> = Array::pinned(65536, 0);

/// Per-backend counters (`agent_common::lb::BACKEND_STATS`), laid out as
/// [`RUNE_SVC_STATS`] with [`RUNE_BACKEND_STATS_PER_CPU`] entries per CPU.
#[map]
pub static RUNE_BACKEND_STATS: Array<TrafficStats> = Array::pinned(65536, 0);

/// Entries per CPU of [`RUNE_SVC_STATS`] (`agent_common::lb::SERVICE_STATS_PER_CPU`),
/// set by the loader; 0 (an object loaded without it) counts nothing.
#[unsafe(no_mangle)]
pub static RUNE_SVC_STATS_PER_CPU: u32 = 0;

/// Entries per CPU of [`RUNE_BACKEND_STATS`] (`agent_common::lb::BACKEND_STATS_PER_CPU`).
#[unsafe(no_mangle)]
pub static RUNE_BACKEND_STATS_PER_CPU: u32 = 0;

/// The VIP prefilter (`agent_common::lb::VIP_FILTER`, see `agent_common::filter`):
/// a set bit means no frontend hashes there. An array, so the verifier inlines its
/// lookup; a fixed size, the same on every node.
#[map]
pub static RUNE_VIP_FILTER: Array<u64> = Array::pinned(agent_common::filter::VIP_FILTER_WORDS, 0);

/// Drop counters by reason (`agent_common::lb::DROPS`).
#[map]
pub static RUNE_DROPS: PerCpuArray<u64> = PerCpuArray::pinned(agent_common::lb::DROP_REASONS, 0);

/// Guarded endpoint addresses (`agent_common::policy::ENDPOINTS`).
#[map]
pub static RUNE_POL_EP: HashMap<EndpointKey, EndpointPolicy> = HashMap::pinned(65536, 0);

/// IPv4 peer prefixes per rule set (`agent_common::policy::PEERS_V4`).
#[map]
pub static RUNE_POL_PEER4: LpmTrie<PeerV4, PeerValue> = LpmTrie::pinned(16384, 0);

/// IPv6 peer prefixes per rule set (`agent_common::policy::PEERS_V6`).
#[map]
pub static RUNE_POL_PEER6: LpmTrie<PeerV6, PeerValue> = LpmTrie::pinned(16384, 0);

/// Port sets (`agent_common::policy::PORTS`).
#[map]
pub static RUNE_POL_PORTS: HashMap<PortKey, u32> = HashMap::pinned(16384, 0);

/// Flows a policy check allowed, IPv4 (`agent_common::policy::POLICY_CONNTRACK_V4`).
#[map]
pub static RUNE_POL_CT4: LruHashMap<PolicyCtKeyV4, PolicyCtValue> = LruHashMap::pinned(262_144, 0);

/// Flows a policy check allowed, IPv6 (`agent_common::policy::POLICY_CONNTRACK_V6`).
#[map]
pub static RUNE_POL_CT6: LruHashMap<PolicyCtKeyV6, PolicyCtValue> = LruHashMap::pinned(262_144, 0);

/// Verdict counters (`agent_common::policy::VERDICTS`).
#[map]
pub static RUNE_POL_VERDICTS: PerCpuArray<u64> = PerCpuArray::pinned(
    agent_common::policy::MAX_COUNTERS * agent_common::policy::VERDICT_SLOTS,
    0,
);

/// Verdict events (`agent_common::policy::EVENTS`).
#[map]
pub static RUNE_POL_EVENTS: RingBuf = RingBuf::pinned(agent_common::policy::EVENTS_BYTES, 0);

/// Each CPU's event budget (`agent_common::policy::EVENT_BUDGET`).
#[map]
pub static RUNE_POL_EVENT_BUDGET: PerCpuArray<[u64; 2]> = PerCpuArray::pinned(1, 0);

/// Events not written (`agent_common::policy::EVENT_DROPS`).
#[map]
pub static RUNE_POL_EVENT_DROPS: PerCpuArray<u64> = PerCpuArray::pinned(2, 0);
