//! The VIP addresses the production userspace proxy listens on: each VIP a /32
//! (IPv4) or /128 (IPv6, no DAD) address on `lo`, reference-counted by the service
//! ports that listen on it, and removed when the last one goes.
//!
//! Our addresses carry a mark of our own: the `IFA_PROTO` address attribute set to
//! [`RUNE_ADDR_PROTO`] (kernel ≥ 6.1 stores it, for both families, and reports it
//! in dumps). The mark is what lets a restarted agent adopt the addresses a crashed
//! one left (and remove those no longer wanted), and what keeps [`cleanup`] from
//! ever removing an address somebody else configured: an address that exists
//! without our mark is used as it is and never removed. A label (`lo:rune`) would
//! only work for IPv4 and a state file could go stale; the mark lives with the
//! address itself.
//!
//! [`VipAddrs`] holds the bookkeeping and talks to the kernel through
//! [`AddressOps`], so that unit tests can use a fake; [`NetlinkAddressOps`] is the
//! real one (rtnetlink).

use crate::lock::lock;
use async_trait::async_trait;
use futures::TryStreamExt;
use rtnetlink::packet_route::address::{
    AddressAttribute, AddressHeaderFlags, AddressMessage, AddressProtocol, AddressScope,
};
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

/// The `IFA_PROTO` value marking addresses this agent added (`R`); the kernel uses
/// 0–3 for its own (`ip -d addr` shows `proto 0x52`).
pub const RUNE_ADDR_PROTO: u8 = 0x52;

/// The interface VIPs are added to.
pub const VIP_INTERFACE: &str = "lo";

/// Why an address could not be listed, added or removed.
#[derive(Debug, thiserror::Error)]
pub enum VipAddrError {
    /// No netlink socket could be opened (e.g. not allowed in this sandbox).
    #[error("cannot open a netlink socket: {0}")]
    Socket(#[source] std::io::Error),
    /// The interface does not exist in this network namespace.
    #[error("interface {VIP_INTERFACE} not found")]
    NoInterface,
    /// The kernel refused the request (e.g. without CAP_NET_ADMIN).
    #[error("{action} {ip} on {VIP_INTERFACE}: {reason} (adding VIPs needs CAP_NET_ADMIN)")]
    Kernel {
        /// What was being done (`adding`, `removing`, `listing`).
        action: &'static str,
        /// The address (unspecified when listing).
        ip: IpAddr,
        /// The kernel's answer.
        reason: String,
    },
}

/// What adding an address found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddOutcome {
    /// The address was added, with our mark.
    Added,
    /// The address was already there (ours or not: the caller knows which are ours).
    AlreadyPresent,
}

/// The kernel side of the VIP addresses: what [`VipAddrs`] needs, nothing more.
#[async_trait]
pub trait AddressOps: Send + Sync {
    /// The addresses on the VIP interface that carry our mark.
    async fn list_ours(&self) -> Result<Vec<IpAddr>, VipAddrError>;
    /// Adds `ip` (/32 or /128, no DAD) with our mark.
    async fn add(&self, ip: IpAddr) -> Result<AddOutcome, VipAddrError>;
    /// Removes `ip`; an address already gone is not an error.
    async fn remove(&self, ip: IpAddr) -> Result<(), VipAddrError>;
}

/// Whether an address present on the interface is ours to remove.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    /// Added by us (now or by an earlier agent): removed when unused.
    Us,
    /// Configured by somebody else: used, never removed.
    Other,
}

/// Reference-counted VIP addresses. The holders of a VIP are opaque keys (the
/// proxy uses one per service port); the address exists while it has one.
pub struct VipAddrs {
    ops: Box<dyn AddressOps>,
    state: tokio::sync::Mutex<VipState>,
    /// Why a held address could not be added (retried by [`VipAddrs::retry`]);
    /// read without waiting by the proxy when a bind fails.
    failed: std::sync::Mutex<BTreeMap<IpAddr, String>>,
}

#[derive(Default)]
struct VipState {
    /// Holders per VIP.
    holders: BTreeMap<IpAddr, BTreeSet<String>>,
    /// Addresses present on the interface, and whose they are.
    present: BTreeMap<IpAddr, Owner>,
    /// Whether addresses left by an earlier agent were looked for.
    adopted: bool,
}

impl VipAddrs {
    /// A manager over `ops`; nothing is touched before the first call.
    pub fn new(ops: Box<dyn AddressOps>) -> Self {
        Self {
            ops,
            state: tokio::sync::Mutex::new(VipState::default()),
            failed: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    /// Makes `holder` a holder of `ip`, adding the address when it is missing.
    /// The first call adopts marked addresses left by an earlier agent (they are
    /// not added again; [`retain`](Self::retain) removes those nobody holds).
    pub async fn acquire(&self, holder: &str, ips: &[IpAddr]) {
        let mut st = self.state.lock().await;
        self.adopt(&mut st).await;
        for &ip in ips {
            st.holders.entry(ip).or_default().insert(holder.to_owned());
            self.ensure(&mut st, ip).await;
        }
    }

    /// Drops every hold for which `keep(holder, ip)` is false, and removes our
    /// addresses nobody holds any more (adopted ones included).
    pub async fn retain(&self, keep: impl Fn(&str, IpAddr) -> bool) {
        let mut st = self.state.lock().await;
        self.adopt(&mut st).await;
        for (ip, hs) in &mut st.holders {
            hs.retain(|h| keep(h, *ip));
        }
        st.holders.retain(|_, hs| !hs.is_empty());
        let unused: Vec<IpAddr> = st
            .present
            .keys()
            .filter(|ip| !st.holders.contains_key(ip))
            .copied()
            .collect();
        for ip in unused {
            self.drop_address(&mut st, ip).await;
        }
        lock(&self.failed).retain(|ip, _| st.holders.contains_key(ip));
    }

    /// Tries again to add the held addresses that could not be added.
    pub async fn retry(&self) {
        let mut st = self.state.lock().await;
        let missing: Vec<IpAddr> = lock(&self.failed).keys().copied().collect();
        for ip in missing {
            self.ensure(&mut st, ip).await;
        }
    }

    /// Drops every hold and removes every address of ours (on Stop).
    pub async fn release_all(&self) {
        self.retain(|_, _| false).await;
    }

    /// Why `ip` is not on the interface although held, if so.
    pub fn failure(&self, ip: IpAddr) -> Option<String> {
        lock(&self.failed).get(&ip).cloned()
    }

    /// The addresses present and held, each with whether it is ours.
    pub async fn present(&self) -> Vec<(IpAddr, bool)> {
        let st = self.state.lock().await;
        st.present
            .iter()
            .map(|(ip, o)| (*ip, *o == Owner::Us))
            .collect()
    }

    /// How many holders `ip` has.
    pub async fn holders(&self, ip: IpAddr) -> usize {
        let st = self.state.lock().await;
        st.holders.get(&ip).map_or(0, BTreeSet::len)
    }

    async fn adopt(&self, st: &mut VipState) {
        if st.adopted {
            return;
        }
        match self.ops.list_ours().await {
            Ok(ours) => {
                st.adopted = true;
                if !ours.is_empty() {
                    tracing::info!(addresses = ?ours, "adopting VIP addresses left by an earlier agent");
                }
                for ip in ours {
                    st.present.insert(ip, Owner::Us);
                }
            }
            // Tried again on the next call; adds below may find EEXIST and treat
            // such an address as somebody else's until then.
            Err(e) => {
                tracing::warn!(error = %e, "cannot list VIP addresses left by an earlier agent")
            }
        }
    }

    async fn ensure(&self, st: &mut VipState, ip: IpAddr) {
        if st.present.contains_key(&ip) {
            lock(&self.failed).remove(&ip);
            return;
        }
        match self.ops.add(ip).await {
            Ok(outcome) => {
                let owner = match outcome {
                    AddOutcome::Added => Owner::Us,
                    AddOutcome::AlreadyPresent => {
                        tracing::info!(%ip, "VIP address already configured by somebody else; using it, never removing it");
                        Owner::Other
                    }
                };
                st.present.insert(ip, owner);
                lock(&self.failed).remove(&ip);
            }
            Err(e) => {
                if lock(&self.failed).insert(ip, e.to_string()).is_none() {
                    tracing::warn!(%ip, error = %e, "cannot add VIP address");
                }
            }
        }
    }

    async fn drop_address(&self, st: &mut VipState, ip: IpAddr) {
        match st.present.get(&ip) {
            Some(Owner::Us) => match self.ops.remove(ip).await {
                Ok(()) => {
                    st.present.remove(&ip);
                }
                // Kept as present: the next retain tries again.
                Err(e) => tracing::warn!(%ip, error = %e, "cannot remove VIP address"),
            },
            Some(Owner::Other) => {
                st.present.remove(&ip);
            }
            None => {}
        }
    }
}

/// The real [`AddressOps`]: rtnetlink on `lo` of the agent's network namespace.
#[derive(Clone, Copy, Debug, Default)]
pub struct NetlinkAddressOps;

impl NetlinkAddressOps {
    async fn handle(&self) -> Result<(rtnetlink::Handle, u32), VipAddrError> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(VipAddrError::Socket)?;
        // Ends when the last handle is dropped.
        tokio::spawn(conn);
        let name = std::ffi::CString::new(VIP_INTERFACE).map_err(|_| VipAddrError::NoInterface)?;
        // SAFETY: a valid NUL-terminated string.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if index == 0 {
            return Err(VipAddrError::NoInterface);
        }
        Ok((handle, index))
    }

    async fn dump(&self) -> Result<(rtnetlink::Handle, Vec<AddressMessage>), VipAddrError> {
        let (handle, index) = self.handle().await?;
        let msgs: Vec<AddressMessage> = handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute()
            .try_collect()
            .await
            .map_err(|e| kernel_error("listing", IpAddr::from([0, 0, 0, 0]), &e))?;
        Ok((handle, msgs))
    }
}

fn kernel_error(action: &'static str, ip: IpAddr, e: &rtnetlink::Error) -> VipAddrError {
    let reason = match e {
        rtnetlink::Error::NetlinkError(m) => m.to_io().to_string(),
        other => other.to_string(),
    };
    VipAddrError::Kernel { action, ip, reason }
}

fn errno_of(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.to_io().raw_os_error(),
        _ => None,
    }
}

/// The address of `msg` when it carries our mark.
fn ours(msg: &AddressMessage) -> Option<IpAddr> {
    let marked = msg
        .attributes
        .iter()
        .any(|a| matches!(a, AddressAttribute::Protocol(p) if u8::from(*p) == RUNE_ADDR_PROTO));
    if !marked {
        return None;
    }
    msg.attributes.iter().find_map(|a| match a {
        AddressAttribute::Address(ip) => Some(*ip),
        _ => None,
    })
}

#[async_trait]
impl AddressOps for NetlinkAddressOps {
    async fn list_ours(&self) -> Result<Vec<IpAddr>, VipAddrError> {
        let (_, msgs) = self.dump().await?;
        Ok(msgs.iter().filter_map(ours).collect())
    }

    async fn add(&self, ip: IpAddr) -> Result<AddOutcome, VipAddrError> {
        let (handle, index) = self.handle().await?;
        let prefix = if ip.is_ipv4() { 32 } else { 128 };
        let mut req = handle.address().add(index, ip, prefix);
        let msg = req.message_mut();
        msg.header.scope = AddressScope::Universe;
        if ip.is_ipv6() {
            msg.header.flags |= AddressHeaderFlags::Nodad;
        }
        msg.attributes
            .push(AddressAttribute::Protocol(AddressProtocol::Other(
                RUNE_ADDR_PROTO,
            )));
        match req.execute().await {
            Ok(()) => Ok(AddOutcome::Added),
            Err(e) if errno_of(&e) == Some(libc::EEXIST) => Ok(AddOutcome::AlreadyPresent),
            Err(e) => Err(kernel_error("adding", ip, &e)),
        }
    }

    async fn remove(&self, ip: IpAddr) -> Result<(), VipAddrError> {
        let (handle, msgs) = self.dump().await?;
        // Only the marked address: never one somebody else configured meanwhile.
        let Some(msg) = msgs.into_iter().find(|m| ours(m) == Some(ip)) else {
            return Ok(());
        };
        match handle.address().del(msg).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno_of(&e) == Some(libc::EADDRNOTAVAIL) => Ok(()),
            Err(e) => Err(kernel_error("removing", ip, &e)),
        }
    }
}

/// Removes every address of ours from `lo` (with the agent stopped): what
/// `rune-agent cleanup` does for the userspace mode. Addresses without our mark
/// are left alone. Returns the addresses removed.
pub async fn cleanup() -> Result<Vec<IpAddr>, VipAddrError> {
    let ops = NetlinkAddressOps;
    let mut removed = Vec::new();
    for ip in ops.list_ours().await? {
        ops.remove(ip).await?;
        removed.push(ip);
    }
    Ok(removed)
}

/// An in-memory [`AddressOps`] for unit tests.
#[cfg(test)]
pub(crate) mod fake {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// An interface in memory: address → marked as ours.
    #[derive(Clone, Default)]
    pub(crate) struct FakeOps {
        pub(crate) addrs: Arc<Mutex<BTreeMap<IpAddr, bool>>>,
        pub(crate) fail_adds: Arc<Mutex<bool>>,
    }

    #[async_trait]
    impl AddressOps for FakeOps {
        async fn list_ours(&self) -> Result<Vec<IpAddr>, VipAddrError> {
            let a = self.addrs.lock().unwrap();
            Ok(a.iter().filter(|(_, o)| **o).map(|(ip, _)| *ip).collect())
        }
        async fn add(&self, ip: IpAddr) -> Result<AddOutcome, VipAddrError> {
            if *self.fail_adds.lock().unwrap() {
                return Err(VipAddrError::Kernel {
                    action: "adding",
                    ip,
                    reason: "Operation not permitted".into(),
                });
            }
            let mut a = self.addrs.lock().unwrap();
            if a.contains_key(&ip) {
                return Ok(AddOutcome::AlreadyPresent);
            }
            a.insert(ip, true);
            Ok(AddOutcome::Added)
        }
        async fn remove(&self, ip: IpAddr) -> Result<(), VipAddrError> {
            let mut a = self.addrs.lock().unwrap();
            if a.get(&ip) == Some(&true) {
                a.remove(&ip);
            }
            Ok(())
        }
    }

    impl FakeOps {
        pub(crate) fn on_interface(&self) -> BTreeMap<IpAddr, bool> {
            self.addrs.lock().unwrap().clone()
        }
    }
}

#[cfg(test)]
mod tests;
