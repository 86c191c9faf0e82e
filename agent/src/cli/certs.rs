//! `rune-agent certs`: make the CA and the certificates of etcd's mutual TLS
//! (`init`, `issue`) and set up etcd's users and roles for them (`etcd-rbac`).
//! The logic is [`crate::certs`]; this is its command line.

use super::print_all;
use crate::{
    certs::{
        self, DEFAULT_CA_DAYS, DEFAULT_DAYS, InitOptions, Validity, Written,
        rbac::{self, RbacReport},
    },
    config::{Config, EtcdSettings},
};
use anyhow::{Context as _, Result, bail};
use clap::{Args, Subcommand};
use std::{fmt::Write as _, path::PathBuf};

/// The subcommands of `certs`.
#[derive(Debug, Subcommand)]
pub enum CertsCommand {
    /// Create a CA, the etcd members' certificate and the admin's in DIR.
    ///
    /// Files: ca.pem, ca-key.pem (the CA); server.pem, server-key.pem (every etcd
    /// member; also a client certificate, for etcd's peers); admin.pem,
    /// admin-key.pem (CN rune-admin). DIR is made 0700, keys 0600.
    Init {
        /// The directory.
        dir: PathBuf,
        /// A host name or IP address etcd members are reached by (repeat for each);
        /// localhost and 127.0.0.1 are always included.
        #[arg(long = "san", value_name = "NAME_OR_IP")]
        sans: Vec<String>,
        /// Validity of the server and admin certificates, in days.
        #[arg(long, default_value_t = DEFAULT_DAYS, value_name = "N")]
        days: u32,
        /// Validity of the CA, in days.
        #[arg(long, default_value_t = DEFAULT_CA_DAYS, value_name = "N")]
        ca_days: u32,
        /// Replace existing files (a new CA: every certificate it signed must be
        /// issued again).
        #[arg(long)]
        force: bool,
    },
    /// Issue a node's client certificate, signed by DIR's CA.
    ///
    /// CN NODE_ID (its etcd user name); files node-NODE_ID.pem and
    /// node-NODE_ID-key.pem (0600) in DIR.
    Issue {
        /// The node's id (`rune-agent status` shows it; in
        /// <state-dir>/node-identity.json).
        node_id: String,
        /// The directory of `certs init`.
        dir: PathBuf,
        /// Validity in days.
        #[arg(long, default_value_t = DEFAULT_DAYS, value_name = "N")]
        days: u32,
        /// Replace the node's existing certificate and key.
        #[arg(long)]
        force: bool,
    },
    /// Create etcd's users and roles for rune and enable authentication.
    ///
    /// rune-admin may do everything; each --node may read the prefix and write its
    /// own <prefix>nodes/<id> key. etcd must run with --client-cert-auth: the CN of
    /// a client certificate is then its user. Safe to run again (to add nodes);
    /// once authentication is on, only the admin certificate may run it.
    EtcdRbac(RbacArgs),
}

/// Flags of `certs etcd-rbac`: how to reach etcd (as the admin: the same
/// `--etcd-*` flags, variables and config-file keys as every command) and which
/// nodes.
#[derive(Debug, Args)]
pub struct RbacArgs {
    /// `--etcd-endpoints`, `--etcd-ca`, the admin's `--etcd-cert`/`--etcd-key`,
    /// `--etcd-prefix` and the rest.
    #[command(flatten)]
    pub etcd: EtcdSettings,
    /// A node id to create a user and role for (repeat for each).
    #[arg(long = "node", value_name = "ID")]
    pub nodes: Vec<String>,
}

/// Runs a `certs` subcommand (`etcd-rbac` reaches etcd as `config` says); prints
/// what it wrote or changed.
pub async fn run(command: &CertsCommand, config: &Config) -> Result<()> {
    match command {
        CertsCommand::Init {
            dir,
            sans,
            days,
            ca_days,
            force,
        } => {
            let options = InitOptions {
                sans: sans.clone(),
                validity: Validity::days(*days)?,
                ca_validity: Validity::days(*ca_days)?,
                force: *force,
            };
            let written = certs::init(dir, &options)?;
            print_all(&written_text(&written))
        }
        CertsCommand::Issue {
            node_id,
            dir,
            days,
            force,
        } => {
            let written = certs::issue_node(dir, node_id, &Validity::days(*days)?, *force)?;
            print_all(&written_text(&written))
        }
        CertsCommand::EtcdRbac(args) => {
            let Some(options) = config.etcd_options()? else {
                bail!(
                    "etcd-rbac sets up etcd: give --etcd-endpoints (or RUNE_ETCD_ENDPOINTS, or \
                     etcdEndpoints in --config) with --etcd-ca and the admin's --etcd-cert and \
                     --etcd-key"
                );
            };
            let report = rbac::apply(&options, &args.nodes)
                .await
                .context("setting up etcd's users and roles")?;
            print_all(&report_text(&report, &args.nodes))
        }
    }
}

/// One line per file: its path and whether it is a key.
fn written_text(written: &[Written]) -> String {
    let mut text = String::new();
    for w in written {
        let what = if w.private {
            "key, 0600"
        } else {
            "certificate"
        };
        let _ = writeln!(text, "wrote {} ({what})", w.path.display());
    }
    text
}

/// What `etcd-rbac` changed, then the state it left.
fn report_text(report: &RbacReport, nodes: &[String]) -> String {
    let mut text = String::new();
    for (what, items) in [
        ("added role", &report.roles_added),
        ("added user", &report.users_added),
        ("revoked permission", &report.revoked),
        ("revoked role", &report.roles_revoked),
    ] {
        for item in items {
            let _ = writeln!(text, "{what} {item}");
        }
    }
    let _ = writeln!(
        text,
        "authentication is enabled; users: root, {} and {} node(s){}",
        certs::ADMIN_CN,
        nodes.len(),
        if nodes.is_empty() {
            String::new()
        } else {
            format!(" ({})", nodes.join(", "))
        }
    );
    text
}
