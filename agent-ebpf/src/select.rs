//! Backend selection and counting, shared by every load-balancing program.
//!
//! A frontend's new flow goes to the backend its ClientIP affinity entry names (when
//! affinity is on, the entry is fresh and the backend still active), else to the
//! backend in the frontend's Maglev table at `hash % size`. The tables hold only
//! backends eligible for new flows; terminating ones stay in `RUNE_BACKENDS` so that
//! their established flows (conntrack) keep working.

use agent_common::lb::{
    Addr, AffinityKey, AffinityValue, BACKEND_ACTIVE, Backend, DropReason, ServiceValue,
    TrafficStats,
};
use aya_ebpf::{
    helpers::{bpf_get_smp_processor_id, bpf_ktime_get_ns},
    maps::Array,
};

use crate::maps::{
    RUNE_AFFINITY, RUNE_BACKEND_STATS, RUNE_BACKEND_STATS_PER_CPU, RUNE_BACKENDS, RUNE_DROPS,
    RUNE_MAGLEV, RUNE_SVC_STATS, RUNE_SVC_STATS_PER_CPU,
};

/// Picks the backend for a new flow of `svc` from `client`, whose flow hash is
/// `hash`. Returns the backend id and a copy of the backend, or why there is none.
#[inline(always)]
pub fn pick_backend(
    svc: &ServiceValue,
    client: &Addr,
    hash: u32,
) -> Result<(u32, Backend), DropReason> {
    if svc.maglev_size == 0 {
        return Err(DropReason::NoBackend);
    }
    let now = if svc.affinity_timeout != 0 {
        let now = unsafe { bpf_ktime_get_ns() };
        if let Some(found) = affine_backend(svc, client, now) {
            return Ok(found);
        }
        now
    } else {
        0
    };
    let slot = svc.maglev_base.wrapping_add(hash % svc.maglev_size);
    let pair = RUNE_MAGLEV
        .get(slot / 2)
        .ok_or(DropReason::BackendMissing)?;
    let id = pair[(slot & 1) as usize];
    let backend = *RUNE_BACKENDS.get(id).ok_or(DropReason::BackendMissing)?;
    if id == 0 || backend.family == 0 {
        return Err(DropReason::BackendMissing);
    }
    if svc.affinity_timeout != 0 {
        let key = AffinityKey {
            client: *client,
            service_id: svc.id,
        };
        let value = AffinityValue {
            last_used_ns: now,
            backend_id: id,
            pad: 0,
        };
        // Affinity is best effort: a full map only loses stickiness, not the flow.
        let _ = RUNE_AFFINITY.insert(&key, &value, 0);
    }
    Ok((id, backend))
}

/// The backend `client`'s affinity entry for `svc` names, if it is fresh and the
/// backend still takes new flows; refreshes the entry's timestamp.
#[inline(always)]
fn affine_backend(svc: &ServiceValue, client: &Addr, now: u64) -> Option<(u32, Backend)> {
    let key = AffinityKey {
        client: *client,
        service_id: svc.id,
    };
    let entry = RUNE_AFFINITY.get_ptr_mut(&key)?;
    // SAFETY: a pointer from a successful lookup stays valid for this program run.
    let entry = unsafe { &mut *entry };
    let timeout_ns = u64::from(svc.affinity_timeout) * 1_000_000_000;
    if now.wrapping_sub(entry.last_used_ns) > timeout_ns {
        return None;
    }
    let backend = *RUNE_BACKENDS.get(entry.backend_id)?;
    if backend.state != BACKEND_ACTIVE || backend.family == 0 {
        return None;
    }
    entry.last_used_ns = now;
    Some((entry.backend_id, backend))
}

/// Counts a new flow of frontend `service_id` to backend `backend_id`.
#[inline(always)]
pub fn count_flow(service_id: u32, backend_id: u32) {
    bump(service_id, backend_id, 1, 0, 0);
}

/// Counts one translated packet of `bytes` bytes (and, with `new_flow`, a new flow).
#[inline(always)]
pub fn count_packet(service_id: u32, backend_id: u32, bytes: u64, new_flow: bool) {
    bump(service_id, backend_id, u64::from(new_flow), 1, bytes);
}

#[inline(always)]
fn bump(service_id: u32, backend_id: u32, flows: u64, packets: u64, bytes: u64) {
    let add = |stats: *mut TrafficStats| {
        // SAFETY: a slot in this CPU's region from a successful lookup; only this
        // CPU writes it.
        unsafe {
            (*stats).flows = (*stats).flows.wrapping_add(flows);
            (*stats).packets = (*stats).packets.wrapping_add(packets);
            (*stats).bytes = (*stats).bytes.wrapping_add(bytes);
        }
    };
    // SAFETY: the helper only reads the CPU number.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    // SAFETY: plain reads of constants the loader sets (read volatile: their value
    // is only known at load time, the verifier then treats them as constants).
    let (svc_per_cpu, backend_per_cpu) = unsafe {
        (
            core::ptr::read_volatile(&raw const RUNE_SVC_STATS_PER_CPU),
            core::ptr::read_volatile(&raw const RUNE_BACKEND_STATS_PER_CPU),
        )
    };
    if let Some(stats) = cpu_slot(&RUNE_SVC_STATS, svc_per_cpu, cpu, service_id) {
        add(stats);
    }
    if let Some(stats) = cpu_slot(&RUNE_BACKEND_STATS, backend_per_cpu, cpu, backend_id) {
        add(stats);
    }
}

/// Entry `id` of `cpu`'s region in a CPU-major counters array of `per_cpu` entries
/// per CPU (none for an id outside the region).
#[inline(always)]
fn cpu_slot(
    map: &Array<TrafficStats>,
    per_cpu: u32,
    cpu: u32,
    id: u32,
) -> Option<*mut TrafficStats> {
    if id >= per_cpu {
        return None;
    }
    map.get_ptr_mut(agent_common::lb::stats_slot(cpu, per_cpu, id))
}

/// Counts a refused or dropped packet or connection.
#[inline(always)]
pub fn count_drop(reason: DropReason) {
    if let Some(count) = RUNE_DROPS.get_ptr_mut(reason as u32) {
        // SAFETY: a per-CPU slot from a successful lookup; only this CPU writes it.
        unsafe { *count = (*count).wrapping_add(1) };
    }
}
