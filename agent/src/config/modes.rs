//! The kinds of mode a setting names: the agent's [`Mode`] (production or dev),
//! the [`DataplaneRequest`] (what `--dataplane` asks for) and the
//! [`DataplaneMode`] it names (what runs).

use serde::{Deserialize, Serialize};
use std::{fmt, str::FromStr};

/// A data plane the agent can run in production: what preflight chooses (from a
/// [`DataplaneRequest`] and the checks), what carries services, what `status` and
/// `rune_dataplane_mode` show.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataplaneMode {
    /// eBPF programs (cgroup socket hooks, tc, XDP) and pinned maps.
    Ebpf,
    /// nftables DNAT in the agent's own table.
    Nftables,
    /// Userspace proxies listening on the VIPs.
    Userspace,
}

impl DataplaneMode {
    /// Every mode, best first (the order `auto` tries them in).
    pub const ALL: [DataplaneMode; 3] = [Self::Ebpf, Self::Nftables, Self::Userspace];

    /// The mode's name, as `--dataplane` spells it.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ebpf => "ebpf",
            Self::Nftables => "nftables",
            Self::Userspace => "userspace",
        }
    }
}

impl fmt::Display for DataplaneMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The data plane asked for (`--dataplane`, `RUNE_DATAPLANE`, `dataplane:`): let
/// preflight pick, or force one [`DataplaneMode`]. Only a production start turns it
/// into the mode that runs ([`crate::preflight::decide()`]); dev mode always uses the
/// userspace proxies on 127.0.0.1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DataplaneRequest {
    /// The best the kernel can run, as preflight decides: eBPF when every eBPF
    /// check passes, else nftables when `nft` works, else userspace proxies.
    #[default]
    Auto,
    /// This mode and no other: the start fails when a check it needs fails.
    Forced(DataplaneMode),
}

impl DataplaneRequest {
    /// Every request, in the order `--help` lists them: `auto`, then each mode forced.
    pub const ALL: [DataplaneRequest; 4] = [
        Self::Auto,
        Self::Forced(DataplaneMode::Ebpf),
        Self::Forced(DataplaneMode::Nftables),
        Self::Forced(DataplaneMode::Userspace),
    ];

    /// The name as written on the command line and in the config file.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Forced(mode) => mode.as_str(),
        }
    }

    /// The request named `name`, as [`DataplaneRequest::as_str`] spells it.
    fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.as_str() == name)
    }

    /// What the request does, for `--help`.
    fn help(self) -> &'static str {
        match self {
            Self::Auto => {
                "The best the kernel can run, as preflight decides: eBPF when every eBPF \
                 check passes, else nftables when `nft` works, else userspace proxies"
            }
            Self::Forced(DataplaneMode::Ebpf) => {
                "The eBPF data plane; the start fails when a check it needs fails"
            }
            Self::Forced(DataplaneMode::Nftables) => {
                "nftables DNAT in the agent's own table; the start fails without a working `nft`"
            }
            Self::Forced(DataplaneMode::Userspace) => {
                "Userspace proxies listening on the VIPs themselves (the last resort)"
            }
        }
    }
}

impl clap::ValueEnum for DataplaneRequest {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.as_str()).help(self.help()))
    }
}

/// The names of [`DataplaneRequest::ALL`], for the error about any other.
pub(super) const DATAPLANE_REQUEST_NAMES: &[&str] = &["auto", "ebpf", "nftables", "userspace"];

/// A YAML scalar naming a request, read the way serde reads a unit-variant enum (the
/// same errors for a wrong name or a wrong shape).
impl<'de> Deserialize<'de> for DataplaneRequest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;

        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = DataplaneRequest;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("enum DataplaneRequest")
            }

            fn visit_enum<A: serde::de::EnumAccess<'de>>(
                self,
                data: A,
            ) -> Result<Self::Value, A::Error> {
                use serde::de::{Error as _, VariantAccess as _};
                let (name, variant) = data.variant::<String>()?;
                let request = DataplaneRequest::named(&name)
                    .ok_or_else(|| A::Error::unknown_variant(&name, DATAPLANE_REQUEST_NAMES))?;
                variant.unit_variant()?;
                Ok(request)
            }
        }

        deserializer.deserialize_enum("DataplaneRequest", DATAPLANE_REQUEST_NAMES, Visitor)
    }
}

/// A request written as its name, as the config file spells it.
impl Serialize for DataplaneRequest {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// How the agent runs: on a real node, or on a laptop (`--dev`). Subsystems branch on
/// it (dev mode: userspace proxies on 127.0.0.1, no nftables, no eBPF, no root
/// needed); which data plane a production node runs is [`DataplaneRequest`]'s and
/// preflight's business, not this.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A real node: eBPF, nftables or VIP proxies, as preflight decides.
    #[default]
    Production,
    /// A laptop: everything on loopback, nothing that needs privileges.
    Dev,
}

impl Mode {
    /// The lower-case name used in flags, config files, logs and `status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Production => "production",
            Mode::Dev => "dev",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A mode name that is neither `production` nor `dev`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown mode {value:?}: expected \"production\" or \"dev\"")]
pub struct ParseModeError {
    /// The rejected input.
    pub value: String,
}

impl FromStr for Mode {
    type Err = ParseModeError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "production" => Ok(Mode::Production),
            "dev" => Ok(Mode::Dev),
            _ => Err(ParseModeError {
                value: value.to_owned(),
            }),
        }
    }
}
