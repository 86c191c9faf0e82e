//! What each production data plane leaves in the kernel when the agent stops or
//! dies, and its removal. A start in one mode removes what the other modes left (a
//! mode switch across a restart leaves nothing of the old mode behind), and
//! `rune-agent cleanup` removes everything. What belongs to the chosen mode stays:
//! the data plane adopts it, so a restart drops no flow.

use crate::{
    config::DataplaneMode,
    dataplane::{
        ebpf::pins,
        nftables::{self, nft::NftError},
        proxy::vip_addrs,
    },
};
use std::{fmt, net::IpAddr, path::Path};

/// What [`remove`] removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// eBPF pins (links and maps) under the pin directory; removing a link's pin
    /// detaches its program.
    pub pins: usize,
    /// VIP addresses of the userspace mode, taken off `lo`.
    pub vips: Vec<IpAddr>,
    /// Whether the nftables mode's table `inet rune` was there (and is gone).
    pub nft_table: bool,
}

impl Removed {
    /// Whether nothing was left.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

impl fmt::Display for Removed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} eBPF pins, {} VIP addresses on lo, {} nftables table",
            self.pins,
            self.vips.len(),
            if self.nft_table { "the" } else { "no" }
        )
    }
}

/// Removes what the data planes in `modes` left: eBPF pins under `pin_dir`, the
/// userspace mode's marked VIP addresses on `lo`, and the table `inet rune`.
/// Addresses and tables the agent did not create are never touched. Without an
/// `nft` binary there can be no table of ours to remove.
pub async fn remove(modes: &[DataplaneMode], pin_dir: &Path) -> anyhow::Result<Removed> {
    use anyhow::Context;
    let mut removed = Removed::default();
    for mode in modes {
        match mode {
            DataplaneMode::Ebpf => {
                removed.pins = pins::remove_pins(pin_dir).with_context(|| {
                    format!("removing the eBPF pins under {}", pin_dir.display())
                })?;
            }
            DataplaneMode::Userspace => {
                removed.vips = vip_addrs::cleanup()
                    .await
                    .context("removing the userspace mode's VIP addresses from lo")?;
            }
            DataplaneMode::Nftables => {
                removed.nft_table = match tokio::task::spawn_blocking(nftables::cleanup).await? {
                    Ok(existed) => existed,
                    Err(NftError::Spawn { source, .. })
                        if source.kind() == std::io::ErrorKind::NotFound =>
                    {
                        false
                    }
                    Err(e) => {
                        return Err(e).context("removing the nftables table inet rune");
                    }
                };
            }
        }
    }
    Ok(removed)
}

/// Every production mode but `keep`.
pub fn others(keep: DataplaneMode) -> Vec<DataplaneMode> {
    DataplaneMode::ALL
        .into_iter()
        .filter(|m| *m != keep)
        .collect()
}
