//! Runs `nft`: one script per transaction (`nft -f -` applies a whole script
//! atomically, or nothing of it), and reads table `inet rune` back as JSON.
//!
//! nft 1.0.6 reads every set element of every table before it lists a table, a
//! chain, a counter or even `list tables` or `get element` (seconds with 100,000
//! backends); `list chains` and `list map NAME` (that map's elements only) stay
//! cheap, so those are what the agent reads.

use super::ruleset::{Existing, REJECT_CHAIN, SERVICE_MAP_V4, SERVICE_MAP_V6, TABLE, TABLE_NAME};
use std::{
    collections::HashMap,
    io::Write as _,
    net::IpAddr,
    process::{Command, Stdio},
};

/// Why `nft` failed.
#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// The binary could not be run.
    #[error("cannot run `{binary}` (install nftables, or choose another --dataplane): {source}")]
    Spawn {
        /// The binary.
        binary: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// `nft` ran and refused.
    #[error("`nft {args}` failed: {stderr}")]
    Failed {
        /// Its arguments.
        args: String,
        /// What it said (first lines).
        stderr: String,
    },
    /// Its JSON output could not be read.
    #[error("cannot read the output of `nft {args}`: {reason}")]
    Output {
        /// Its arguments.
        args: String,
        /// Why.
        reason: String,
    },
}

/// The `nft` binary to run.
#[derive(Clone, Debug)]
pub struct Nft {
    binary: String,
}

impl Default for Nft {
    fn default() -> Self {
        Self {
            binary: "nft".to_owned(),
        }
    }
}

impl Nft {
    /// Runs `nft` with `args`, `stdin` as its input; its standard output.
    fn run(&self, args: &[&str], stdin: Option<&str>) -> Result<String, NftError> {
        let spawn_err = |source| NftError::Spawn {
            binary: self.binary.clone(),
            source,
        };
        let mut child = Command::new(&self.binary)
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(spawn_err)?;
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(input.as_bytes()).map_err(spawn_err)?;
        }
        let out = child.wait_with_output().map_err(spawn_err)?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let stderr: Vec<&str> = stderr.lines().take(6).collect();
            return Err(NftError::Failed {
                args: args.join(" "),
                stderr: stderr.join(" | "),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Applies `script` as one transaction.
    pub fn apply(&self, script: &str) -> Result<(), NftError> {
        if script.is_empty() {
            return Ok(());
        }
        self.run(&["-f", "-"], Some(script)).map(drop)
    }

    /// Whether `nft` runs and may read the ruleset (root, CAP_NET_ADMIN). Lists
    /// chains only: cheap however many elements the table holds.
    pub fn check(&self) -> Result<(), NftError> {
        self.run(&["list", "chains"], None).map(drop)
    }

    /// Runs `nft -j ARGS` and parses its output.
    fn json(&self, args: &[&str]) -> Result<serde_json::Value, NftError> {
        let mut all = vec!["-j"];
        all.extend(args);
        let out = self.run(&all, None)?;
        serde_json::from_str(&out).map_err(|e| NftError::Output {
            args: all.join(" "),
            reason: e.to_string(),
        })
    }

    /// The names of our table's chains; `None` when the table has none (or does not
    /// exist).
    fn chains(&self) -> Result<Option<Vec<String>>, NftError> {
        let family = TABLE.split_once(' ').map_or("inet", |(f, _)| f);
        let json = self.json(&["list", "chains", family])?;
        let chains: Vec<String> = objects(&json)
            .filter_map(|o| o.get("chain"))
            .filter(|c| c.get("table").and_then(|t| t.as_str()) == Some(TABLE_NAME))
            .filter_map(|c| c.get("name")?.as_str().map(str::to_owned))
            .collect();
        Ok((!chains.is_empty()).then_some(chains))
    }

    /// Removes our table; whether there was one.
    pub fn delete_table(&self) -> Result<bool, NftError> {
        let (family, name) = TABLE.split_once(' ').unwrap_or(("inet", TABLE_NAME));
        match self.run(&["delete", "table", family, name], None) {
            Ok(_) => Ok(true),
            Err(NftError::Failed { stderr, .. })
                if stderr.contains("No such file or directory") =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// The names of what our table holds (for adopting it), from its chains alone
    /// (listing sets would read all their elements): each affinity set `aff…` is
    /// made and removed with its chain `ep…`, and the fixed maps are re-declared and
    /// flushed by every full sync.
    pub fn existing(&self) -> Result<Existing, NftError> {
        let Some(chains) = self.chains()? else {
            return Ok(Existing::default());
        };
        let mut existing = Existing {
            table: true,
            ..Existing::default()
        };
        for chain in chains {
            if let Some(id) = chain.strip_prefix("ep") {
                existing.sets.insert(format!("aff{id}"));
            }
            existing.chains.insert(chain);
        }
        Ok(existing)
    }

    /// New flows per service port, `(VIP, protocol, port)`: the counters of the
    /// service maps' elements (in nat chains only a connection's first packet
    /// passes).
    pub fn port_counters(&self) -> Result<HashMap<(IpAddr, String, u16), u64>, NftError> {
        if self.chains()?.is_none() {
            return Ok(HashMap::new());
        }
        let mut out = HashMap::new();
        for map in [SERVICE_MAP_V4, SERVICE_MAP_V6] {
            let family = TABLE.split_once(' ').map_or("inet", |(f, _)| f);
            let json = self.json(&["list", "map", family, TABLE_NAME, map])?;
            out.extend(element_counters(&json));
        }
        Ok(out)
    }

    /// Connections refused for lack of endpoints (the counter of `reject-service`).
    /// Listing a chain makes nft 1.0.6 read every element first: slow with large
    /// tables, so only `status` asks.
    pub fn refused(&self) -> Result<Option<u64>, NftError> {
        if self.chains()?.is_none() {
            return Ok(None);
        }
        let family = TABLE.split_once(' ').map_or("inet", |(f, _)| f);
        let json = self.json(&["list", "chain", family, TABLE_NAME, REJECT_CHAIN])?;
        Ok(counters(&json).get(REJECT_CHAIN).copied())
    }
}

impl Nft {
    /// The packets of each named counter of our table (the policy verdicts). Like
    /// any listing but `list chains`, it makes nft 1.0.6 read every element first.
    pub fn named_counters(&self) -> Result<std::collections::BTreeMap<String, u64>, NftError> {
        if self.chains()?.is_none() {
            return Ok(Default::default());
        }
        let family = TABLE.split_once(' ').map_or("inet", |(f, _)| f);
        let json = self.json(&["list", "counters", "table", family, TABLE_NAME])?;
        Ok(objects(&json)
            .filter_map(|o| o.get("counter"))
            .filter_map(|c| {
                Some((
                    c.get("name")?.as_str()?.to_owned(),
                    c.get("packets")?.as_u64()?,
                ))
            })
            .collect())
    }
}

/// `(VIP, protocol, port) → packets` of a listed service map's elements.
fn element_counters(json: &serde_json::Value) -> HashMap<(IpAddr, String, u16), u64> {
    let mut out = HashMap::new();
    for obj in objects(json) {
        let elems = obj
            .get("map")
            .and_then(|m| m.get("elem"))
            .and_then(|e| e.as_array());
        for pair in elems.into_iter().flatten() {
            let Some(elem) = pair.get(0).and_then(|p| p.get("elem")) else {
                continue;
            };
            let Some(key) = elem.get("val").and_then(|v| v.get("concat")) else {
                continue;
            };
            let vip = key
                .get(0)
                .and_then(|v| v.as_str())
                .and_then(|v| v.parse().ok());
            let proto = key.get(1).and_then(|v| v.as_str());
            let port = key
                .get(2)
                .and_then(|v| v.as_u64())
                .and_then(|p| u16::try_from(p).ok());
            let packets = elem
                .get("counter")
                .and_then(|c| c.get("packets"))
                .and_then(|p| p.as_u64());
            if let (Some(vip), Some(proto), Some(port), Some(packets)) = (vip, proto, port, packets)
            {
                out.insert((vip, proto.to_owned(), port), packets);
            }
        }
    }
    out
}

/// The objects of an `nft -j` listing.
fn objects(json: &serde_json::Value) -> impl Iterator<Item = &serde_json::Value> {
    json.get("nftables")
        .and_then(|v| v.as_array())
        .into_iter()
        .flatten()
}

/// The first counter's packets of each chain in a listing.
pub fn counters(json: &serde_json::Value) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for obj in objects(json) {
        let Some(rule) = obj.get("rule") else {
            continue;
        };
        let Some(chain) = rule.get("chain").and_then(|c| c.as_str()) else {
            continue;
        };
        if out.contains_key(chain) {
            continue;
        }
        let packets = rule
            .get("expr")
            .and_then(|e| e.as_array())
            .into_iter()
            .flatten()
            .find_map(|e| e.get("counter")?.get("packets")?.as_u64());
        if let Some(p) = packets {
            out.insert(chain.to_owned(), p);
        }
    }
    out
}
