//! `rune-agent observe`: the running agent's network policy verdicts, live.

use super::{Format, call_error};
use crate::{config::Config, localapi};
use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use rune_proto::v1 as pb;
use std::io::Write as _;

/// Flags of `observe`.
#[derive(Clone, Debug, Default, Args)]
pub struct ObserveArgs {
    /// Only the verdicts of services in this namespace.
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,
    /// Only those of this service (name).
    #[arg(short = 's', long)]
    pub service: Option<String>,
    /// Which verdicts: refused flows, audit-mode would-refuse flows, or both.
    #[arg(long, value_enum, default_value = "all")]
    pub verdict: VerdictFilter,
    /// Output format; one line per flow when omitted (`json`: one JSON document
    /// per line).
    #[arg(short = 'o', long, value_enum)]
    pub output: Option<Format>,
}

/// `--verdict`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum VerdictFilter {
    /// Flows a policy refused.
    Denied,
    /// Flows an audit-mode policy would have refused.
    Audit,
    /// Both.
    #[default]
    All,
}

/// Streams the verdicts until interrupted or the agent goes away.
pub async fn observe(config: &Config, args: &ObserveArgs) -> Result<()> {
    if args.output == Some(Format::Yaml) {
        bail!("observe -o yaml: not supported; verdicts stream as text lines or -o json");
    }
    let socket = localapi::socket_path(&config.state_dir);
    let Some(mut client) = localapi::Client::connect(&socket).await? else {
        bail!(
            "no agent answers on {}: observe shows a running agent's verdicts",
            socket.display()
        );
    };
    let filter = pb::ObserveRequest {
        namespace: args.namespace.clone().unwrap_or_default(),
        service: args.service.clone().unwrap_or_default(),
        verdict: match args.verdict {
            VerdictFilter::Denied => "denied",
            VerdictFilter::Audit => "audit",
            VerdictFilter::All => "all",
        }
        .to_owned(),
    };
    let json = args.output == Some(Format::Json);
    client
        .observe(filter, |doc, missed| {
            let mut out = std::io::stdout().lock();
            if missed > 0 && !json {
                writeln!(
                    out,
                    "... {missed} verdicts missed (this stream fell behind)"
                )?;
            }
            if json {
                writeln!(out, "{doc}")?;
            } else {
                let v: serde_json::Value = serde_json::from_str(doc).unwrap_or_default();
                let s = |k: &str| v[k].as_str().unwrap_or("").to_owned();
                writeln!(
                    out,
                    "{:<7} {} {} -> {} {} {}/{} {}",
                    s("verdict"),
                    s("protocol"),
                    s("source"),
                    s("destination"),
                    s("direction"),
                    s("namespace"),
                    s("service"),
                    s("reason"),
                )?;
            }
            out.flush()
        })
        .await
        .map_err(call_error)
}
