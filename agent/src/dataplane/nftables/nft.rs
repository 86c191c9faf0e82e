//! Runs `nft`: one script per transaction (`nft -f -` applies a whole script
//! atomically, or nothing of it), and reads table `inet rune` back as JSON.

use super::ruleset::{Existing, TABLE, TABLE_NAME};
use std::{
    collections::HashMap,
    io::Write as _,
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

    /// Whether `nft` runs and may read the ruleset (root, CAP_NET_ADMIN).
    pub fn check(&self) -> Result<(), NftError> {
        self.run(&["list", "tables"], None).map(drop)
    }

    /// Our table as `nft -j` lists it (`terse`: without set elements); `None` when
    /// there is no such table.
    pub fn list_table(&self, terse: bool) -> Result<Option<serde_json::Value>, NftError> {
        let (family, name) = TABLE.split_once(' ').unwrap_or(("inet", TABLE_NAME));
        let tables = self.run(&["-j", "list", "tables", family], None)?;
        if !tables.contains(&format!("\"name\": \"{name}\""))
            && !tables.contains(&format!("\"name\":\"{name}\""))
        {
            return Ok(None);
        }
        let mut args = vec!["-j"];
        if terse {
            args.push("-t");
        }
        args.extend(["list", "table", family, name]);
        let out = self.run(&args, None)?;
        serde_json::from_str(&out)
            .map(Some)
            .map_err(|e| NftError::Output {
                args: args.join(" "),
                reason: e.to_string(),
            })
    }

    /// The names of what our table holds (for adopting it).
    pub fn existing(&self) -> Result<Existing, NftError> {
        let Some(json) = self.list_table(true)? else {
            return Ok(Existing::default());
        };
        let mut existing = Existing {
            table: true,
            ..Existing::default()
        };
        for obj in objects(&json) {
            let name =
                |o: &serde_json::Value| o.get("name").and_then(|n| n.as_str()).map(str::to_owned);
            if let Some(c) = obj.get("chain") {
                existing.chains.extend(name(c));
            } else if let Some(s) = obj.get("set").or_else(|| obj.get("map")) {
                existing.sets.extend(name(s));
            }
        }
        Ok(existing)
    }

    /// New-flow counters per chain (the packets of the first `counter` of each
    /// chain: in nat chains only a connection's first packet passes).
    pub fn chain_counters(&self) -> Result<HashMap<String, u64>, NftError> {
        let Some(json) = self.list_table(true)? else {
            return Ok(HashMap::new());
        };
        Ok(counters(&json))
    }
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
