//! The `rune-agent` command line: `run`, `apply`, `get`, `delete`, `drain`,
//! `undrain`, `status`, `cleanup`, `preflight`, `certs`, `version`.
//!
//! `apply`, `get` and `delete` reach a running agent through its socket
//! (`<state-dir>/agent.sock`); when no agent runs they use the etcd its agent
//! last ran on (recorded in the state dir), else the embedded store directly (only
//! `apply` creates it, so a node can be prepared before its agent starts). With
//! `--etcd-endpoints` (or a config file naming it) they read and write etcd
//! itself, no agent needed. `status`
//! asks the local agent (else, in embedded mode, reads the store).
//!
//! Answers of any size stream to standard output as they arrive (`get`,
//! `status --all`; see [`output`]); a reader that closes the pipe early ends the
//! command quietly with exit status 141 ([`StdoutClosed`]).
//!
//! The commands and flags are declared in `args`; here what each command does.

mod args;
pub mod certs;
pub mod drain;
pub mod nodes;
pub mod observe;
mod output;

pub use args::{Cli, Command, Format, RunArgs, StatusArgs};
pub use output::StdoutClosed;

use crate::{
    config::{Config, recorded},
    localapi::{self, Client, LocalApiError, StatusPart, StatusQuery},
    model::{Kind, ObjectKey, parse_documents},
    orderedlog::{
        embedded::{EmbeddedLog, EmbeddedOptions, STORE_FILE},
        etcd::{EtcdLog, EtcdOptions},
        store::ObjectStore,
    },
    status::{StatusSource, StoreStatus},
};
use anyhow::{Context, Result, bail};
use output::{ObjectsOut, Out, StatusOut, StatusShape, output_error};
use std::{io::Read, ops::ControlFlow};

/// Where a command's requests go: the running agent, the embedded store itself, or
/// etcd.
enum Target {
    Agent(Client),
    Store(EmbeddedLog),
    Etcd(EtcdLog),
}

/// etcd with `--etcd-endpoints` (flags, variables or config file); else the agent
/// on the state dir's socket; else the etcd the node's agent last ran on (recorded
/// in the state dir, [`recorded`]); else the embedded store, opened only when it
/// exists unless `create` (`apply` prepares a node before its agent's first start,
/// and says so): a read never makes an empty store that would hide a cluster.
async fn target(config: &Config, create: bool) -> Result<Target> {
    if let Some(options) = config.etcd_options()? {
        return Ok(Target::Etcd(EtcdLog::connect(options).await?));
    }
    let socket = localapi::socket_path(&config.state_dir);
    if let Some(client) = Client::connect(&socket).await? {
        return Ok(Target::Agent(client));
    }
    if let Some(options) = recorded_etcd(config)? {
        return Ok(Target::Etcd(EtcdLog::connect(options).await?));
    }
    let dir = config.state_dir.display();
    if !config.state_dir.join(STORE_FILE).exists() {
        if !create {
            bail!(
                "no agent answers on {} and {dir} holds no embedded store ({STORE_FILE}) nor a \
                 record of the etcd its agent uses ({}): nothing to read. On a node of a \
                 cluster give --etcd-endpoints (and its TLS flags) or --config with the agent's \
                 config file; on a single node, start the agent (or `apply`) first",
                socket.display(),
                recorded::FILE
            );
        }
        eprintln!(
            "note: no agent answers and {dir} holds no store yet: creating the embedded store \
             there (on a node of a cluster, give --etcd-endpoints or --config instead)"
        );
    }
    let options = EmbeddedOptions {
        history: config.log_history,
    };
    let store = EmbeddedLog::open(&config.state_dir, options).with_context(|| {
        format!(
            "no agent answers on {} and the store cannot be opened",
            socket.display()
        )
    })?;
    Ok(Target::Store(store))
}

/// The etcd settings given (flags, variables, config file), else those the node's
/// agent recorded in the state dir at its last start; `None` with neither.
fn etcd_options_or_recorded(config: &Config) -> Result<Option<EtcdOptions>> {
    match config.etcd_options()? {
        Some(options) => Ok(Some(options)),
        None => recorded_etcd(config),
    }
}

/// The etcd the node's agent recorded in the state dir, when no etcd setting was
/// given (naming the record when it is refused).
fn recorded_etcd(config: &Config) -> Result<Option<EtcdOptions>> {
    let path = config.state_dir.join(recorded::FILE);
    let Some(recorded) = recorded::recorded(&config.state_dir)? else {
        return Ok(None);
    };
    let options = recorded
        .etcd_options()
        .with_context(|| format!("the etcd settings recorded in {}", path.display()))?;
    Ok(options)
}

fn parse_kind(kind: &str) -> Result<Kind> {
    Kind::parse(kind)
        .with_context(|| format!("unknown kind {kind:?} (known: service/svc, endpoints/ep)"))
}

/// The error of a call to the agent, with [`StdoutClosed`] when it stopped because
/// standard output was closed.
fn call_error(e: LocalApiError) -> anyhow::Error {
    match e {
        LocalApiError::Output(e) => output_error(e),
        other => other.into(),
    }
}

/// `rune-agent apply -f FILE|- [--wait[=TIMEOUT]]`.
pub async fn apply(config: &Config, file: &str, wait: Option<std::time::Duration>) -> Result<()> {
    let text = if file == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading standard input")?;
        s
    } else {
        std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?
    };
    let objects = parse_documents(&text).with_context(|| format!("in {file}"))?;
    drop(text);
    if objects.is_empty() {
        bail!("{file}: no objects found");
    }
    let target = target(config, true).await?;
    if wait.is_some() && !matches!(target, Target::Etcd(_)) {
        bail!(
            "--wait needs the etcd store (--etcd-endpoints): it waits for every node of a \
             cluster, and without etcd there is one node, whose agent applies as it answers"
        );
    }
    let mut waits_on = None;
    let outcome = match target {
        Target::Agent(mut c) => {
            let lines = c.apply(&objects).await.map_err(call_error)?.0;
            return print_lines(lines);
        }
        Target::Store(store) => tokio::task::spawn_blocking(move || store.apply(objects)).await??,
        Target::Etcd(etcd) => {
            let outcome = etcd.apply(objects).await?;
            waits_on = Some(etcd);
            outcome
        }
    };
    let lines = outcome
        .results
        .iter()
        .map(|(k, c)| localapi::format_change(k, *c));
    print_lines(lines)?;
    if let (Some(timeout), Some(etcd)) = (wait, &waits_on) {
        match nodes::revision_to_wait_for(&outcome) {
            Some(revision) => {
                let ready = nodes::wait_applied(etcd, revision, timeout).await?;
                print_lines([format!(
                    "revision {revision} applied on every Ready node ({ready})"
                )])?;
            }
            None => print_lines(["nothing changed: nothing to wait for".to_owned()])?,
        }
    }
    Ok(())
}

/// Prints each line of an apply's answer.
fn print_lines(lines: impl IntoIterator<Item = String>) -> Result<()> {
    let mut out = Out::default();
    for line in lines {
        out.write(&line).map_err(output_error)?;
        out.write("\n").map_err(output_error)?;
    }
    out.flush().map_err(output_error)
}

/// `rune-agent get [KIND] [NAME]`: objects are printed as they arrive (a table
/// once all have: its columns fit the widest).
pub async fn get(
    config: &Config,
    kind: Option<&str>,
    name: Option<&str>,
    namespace: Option<&str>,
    output: Option<Format>,
    show_secrets: bool,
) -> Result<()> {
    if show_secrets && output != Some(Format::Yaml) {
        bail!("--show-secrets prints Secrets only with -o yaml");
    }
    if let Some(k) = kind
        && matches!(k, "node" | "nodes" | "no")
    {
        return get_nodes(config, name, output).await;
    }
    let kind = kind.map(parse_kind).transpose()?;
    if name.is_some() && kind.is_none() {
        bail!("a name needs a kind: rune-agent get KIND NAME");
    }
    // A name is looked up in one namespace (`default` unless -n says otherwise), as
    // `delete` does; without a name, every namespace is listed.
    let namespace = match (name, namespace) {
        (Some(_), None) => Some(crate::model::DEFAULT_NAMESPACE),
        _ => namespace,
    };
    let mut out = Out::default();
    let mut printer = ObjectsOut::new(output, name.is_some())
        .map_err(output_error)?
        .show_secrets(show_secrets);
    match target(config, false).await? {
        Target::Agent(mut c) => {
            c.list(kind, namespace, name, |o| printer.push(&mut out, o))
                .await
                .map_err(call_error)?;
        }
        Target::Store(store) => {
            let mut failed = None;
            store.scan(kind, namespace, name, |_, o| {
                match printer.push(&mut out, o) {
                    Ok(()) => ControlFlow::Continue(()),
                    Err(e) => {
                        failed = Some(e);
                        ControlFlow::Break(())
                    }
                }
            })?;
            if let Some(e) = failed {
                return Err(output_error(e));
            }
        }
        Target::Etcd(etcd) => {
            let (_, objects) = ObjectStore::get(&etcd, kind, namespace, name).await?;
            for o in objects {
                printer.push(&mut out, o).map_err(output_error)?;
            }
        }
    }
    if printer.count() == 0 && name.is_some() {
        bail!(
            "{} {}/{} not found",
            kind.map(Kind::as_str).unwrap_or_default(),
            namespace.unwrap_or_default(),
            name.unwrap_or_default()
        );
    }
    printer.finish(&mut out).map_err(output_error)
}

/// `rune-agent get nodes` (a table, or every document with `-o`) and `get node
/// NAME` (its document, YAML unless `-o json`): the nodes registered in etcd.
async fn get_nodes(config: &Config, name: Option<&str>, output: Option<Format>) -> Result<()> {
    let Some(options) = etcd_options_or_recorded(config)? else {
        bail!("nodes are registered in etcd: give --etcd-endpoints (and its TLS flags)");
    };
    let etcd = EtcdLog::connect(options).await?;
    let format = |f: Format| match f {
        Format::Yaml => nodes::DocumentFormat::Yaml,
        Format::Json => nodes::DocumentFormat::Json,
    };
    let mut out = Vec::new();
    match (name, output) {
        (Some(name), output) => {
            nodes::get_node(
                &etcd,
                name,
                format(output.unwrap_or(Format::Yaml)),
                &mut out,
            )
            .await?
        }
        (None, None) => nodes::write_table(&nodes::list_nodes(&etcd).await?, &mut out)?,
        (None, Some(f)) => {
            nodes::write_documents(&nodes::list_nodes(&etcd).await?, format(f), &mut out)?
        }
    }
    let mut stdout = Out::default();
    stdout
        .write(&String::from_utf8_lossy(&out))
        .map_err(output_error)?;
    stdout.flush().map_err(output_error)
}

/// `rune-agent delete KIND NAME`.
pub async fn delete(config: &Config, kind: &str, name: &str, namespace: &str) -> Result<()> {
    let key = ObjectKey::new(parse_kind(kind)?, namespace, name);
    let deleted = match target(config, false).await? {
        Target::Agent(mut c) => c.delete(&key).await?,
        Target::Store(store) => store.delete(&key)?,
        Target::Etcd(etcd) => ObjectStore::delete(&etcd, &key).await?,
    };
    let shown = localapi::object_path(&key);
    match deleted {
        Some(_) => {
            let mut out = Out::default();
            out.write(&format!("{shown} deleted\n"))
                .and_then(|()| out.flush())
                .map_err(output_error)
        }
        None => bail!("{shown} not found"),
    }
}

/// `rune-agent drain NODE` (`undo`: `undrain NODE`): writes or deletes the node's
/// drain record in etcd.
pub async fn drain(config: &Config, node: &str, undo: bool) -> Result<()> {
    let command = if undo { "undrain" } else { "drain" };
    let Some(options) = etcd_options_or_recorded(config)? else {
        bail!("drains are kept in etcd: {command} needs --etcd-endpoints (and its TLS flags)");
    };
    let etcd = EtcdLog::connect(options).await?;
    let line = if undo {
        drain::undrain(&etcd, node).await?
    } else {
        drain::drain(&etcd, node).await?
    };
    print_all(&(line + "\n"))
}

/// `rune-agent status [SERVICE | --all]`: the summary, one service, or every
/// service as they arrive.
pub async fn status(config: &Config, args: &StatusArgs) -> Result<()> {
    let query = match (&args.service, args.all) {
        (Some(s), _) => StatusQuery::Service(match (&args.namespace, s.split_once('/')) {
            (Some(ns), _) => crate::model::ServiceKey::new(ns, s),
            (None, Some(_)) => localapi::service_key(s),
            (None, None) => crate::model::ServiceKey::new(crate::model::DEFAULT_NAMESPACE, s),
        }),
        (None, true) => StatusQuery::All,
        (None, false) => StatusQuery::Summary,
    };
    let shape = match query {
        StatusQuery::Summary => StatusShape::Summary,
        StatusQuery::Service(_) => StatusShape::One,
        StatusQuery::All => StatusShape::All,
    };
    let mut out = Out::default();
    let mut printer = StatusOut::new(args.output, shape);
    match status_target(config).await? {
        Target::Agent(mut c) => {
            c.status(&query, |part| printer.push(&mut out, part))
                .await
                .map_err(call_error)?;
        }
        Target::Store(store) => {
            let source = StoreStatus {
                state_dir: &config.state_dir,
                store: &store,
            };
            store_status(&source, &query, |part| printer.push(&mut out, part))?;
        }
        Target::Etcd(etcd) => bail!(
            "no agent answers on {} (status is the local agent's; its objects are in etcd at {}: \
             `rune-agent get --etcd-endpoints …` reads them there)",
            localapi::socket_path(&config.state_dir).display(),
            etcd.endpoints()
        ),
    }
    printer.finish(&mut out).map_err(output_error)
}

/// Where `status` reads: the local agent, with or without `--etcd-endpoints`;
/// without one, the embedded store (or etcd, which holds no agent's status).
async fn status_target(config: &Config) -> Result<Target> {
    let Some(options) = config.etcd_options()? else {
        return target(config, false).await;
    };
    let socket = localapi::socket_path(&config.state_dir);
    match Client::connect(&socket).await? {
        Some(client) => Ok(Target::Agent(client)),
        None => Ok(Target::Etcd(EtcdLog::connect(options).await?)),
    }
}

/// [`Client::status`]'s parts, read from the store (no agent running).
fn store_status(
    source: &StoreStatus<'_>,
    query: &StatusQuery,
    mut each: impl FnMut(StatusPart) -> std::io::Result<()>,
) -> Result<()> {
    let only = match query {
        StatusQuery::Summary => {
            let summary = crate::status::summarize(source)?;
            return each(StatusPart::Summary(Box::new(summary))).map_err(output_error);
        }
        StatusQuery::Service(key) => Some(key),
        StatusQuery::All => {
            each(StatusPart::Summary(Box::new(source.summary()?))).map_err(output_error)?;
            None
        }
    };
    let (mut found, mut failed) = (false, None);
    source.services(only, &mut |s| {
        found = true;
        match each(StatusPart::Service(s)) {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                failed = Some(e);
                ControlFlow::Break(())
            }
        }
    })?;
    if let Some(e) = failed {
        return Err(output_error(e));
    }
    match only {
        Some(key) if !found => bail!("service {key} not found"),
        Some(_) => Ok(()),
        None => {
            for o in source.orphans()? {
                each(StatusPart::Orphan(o)).map_err(output_error)?;
            }
            Ok(())
        }
    }
}

/// `rune-agent cleanup`: refuses while an agent runs on this state dir (it would
/// re-create what is removed), then removes every pin.
pub async fn cleanup(config: &Config) -> Result<()> {
    let socket = localapi::socket_path(&config.state_dir);
    if Client::connect(&socket).await?.is_some() {
        bail!(
            "an agent is running on {} (stop it first: cleanup removes what it uses)",
            socket.display()
        );
    }
    let dir = &config.bpf_pin_dir;
    let removed =
        crate::dataplane::leftovers::remove(&crate::config::DataplaneMode::ALL, dir).await?;
    let mut text = format!(
        "removed {} eBPF pins under {}\n",
        removed.pins,
        dir.display()
    );
    for ip in &removed.vips {
        text.push_str(&format!("removed VIP address {ip} from lo\n"));
    }
    if removed.nft_table {
        text.push_str("removed the nftables table inet rune\n");
    }
    print_all(&text)
}

/// `rune-agent preflight [--json]`: every check, then the data plane the settings
/// ask for would get. Fails (after printing) when no data plane can run.
pub fn preflight(config: &Config, json: bool) -> Result<()> {
    use crate::preflight::{self, Options, Outcome};
    let report = preflight::run(&Options::with_cgroup(config.cgroup.clone()))?;
    let outcome = Outcome::new(&report, config.dataplane);
    if json {
        print_all(&(serde_json::to_string_pretty(&outcome)? + "\n"))?;
    } else {
        print_all(&outcome.render())?;
    }
    if outcome.mode.is_none() {
        bail!("{}", outcome.reason);
    }
    Ok(())
}

/// Writes `text` to standard output ([`StdoutClosed`] when its reader is gone).
pub fn print_all(text: &str) -> Result<()> {
    let mut out = Out::default();
    out.write(text)
        .and_then(|()| out.flush())
        .map_err(output_error)
}
