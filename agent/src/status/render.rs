//! The text form of `status`: the summary's head, the services and the orphan
//! endpoints, as the CLI prints them.

use super::{AgentStatus, SUMMARY_SERVICES, ServiceStatus};
use std::fmt::Write as _;

impl AgentStatus {
    /// The human-readable form.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ = self.render_into(&mut o);
        o
    }

    fn render_into(&self, o: &mut String) -> std::fmt::Result {
        self.render_head_into(o)?;
        if self.services_omitted > 0 {
            writeln!(
                o,
                "  {} services, not listed (more than {SUMMARY_SERVICES}): `rune-agent status --all` lists them, `rune-agent status NAME` shows one",
                self.services_omitted
            )?;
        } else if self.services.is_empty() {
            writeln!(o, "  (none)")?;
        }
        for s in &self.services {
            o.push_str(&s.render());
        }
        o.push_str(&self.render_orphans());
        Ok(())
    }

    fn render_head_into(&self, o: &mut String) -> std::fmt::Result {
        if self.running {
            writeln!(o, "agent:      running")?;
        } else {
            writeln!(o, "agent:      not running (read from the store)")?;
        }
        writeln!(o, "state dir:  {}", self.state_dir)?;
        if let Some(m) = &self.mode {
            writeln!(o, "mode:       {m}")?;
        }
        if let Some(d) = &self.dataplane {
            match &self.dataplane_reason {
                Some(why) => writeln!(o, "data plane: {d} ({why})")?,
                None => writeln!(o, "data plane: {d}")?,
            }
        }
        if !self.preflight.is_empty() {
            let failed: Vec<&crate::preflight::Check> =
                self.preflight.iter().filter(|c| !c.passed).collect();
            writeln!(
                o,
                "preflight:  {} of {} checks passed",
                self.preflight.len() - failed.len(),
                self.preflight.len()
            )?;
            for c in failed {
                writeln!(o, "  failed {}: {}", c.name, c.detail)?;
            }
        }
        for (i, p) in self.programs.iter().enumerate() {
            let label = if i == 0 { "programs:" } else { "" };
            writeln!(o, "{label:12}{p}")?;
        }
        for (i, p) in self.policies.iter().enumerate() {
            let label = if i == 0 { "policies:" } else { "" };
            writeln!(o, "{label:12}{p}")?;
        }
        if let Some(d) = &self.dns {
            writeln!(o, "dns:        {d}")?;
        }
        for (i, c) in self.certificates.iter().enumerate() {
            let label = if i == 0 { "certs:" } else { "" };
            writeln!(o, "{label:12}{c}")?;
        }
        self.write_routes(o)?;
        if let Some(s) = &self.store {
            writeln!(o, "store:      {s}")?;
        }
        if let Some(down) = &self.store_disconnected {
            writeln!(o, "            StoreDisconnected {down}")?;
        }
        if let Some(skipped) = &self.store_skipped {
            writeln!(o, "            {skipped}")?;
        }
        if let Some(n) = &self.node {
            writeln!(o, "node:       {} ({})", n.node_id, n.hostname)?;
        }
        if let Some(r) = self.ready {
            match &self.ready_error {
                Some(e) if !r => writeln!(o, "ready:      no ({e})")?,
                _ => writeln!(o, "ready:      {}", if r { "yes" } else { "no" })?,
            }
        }
        writeln!(o, "revision:   {}", self.revision)?;
        let objects: Vec<String> = self
            .objects
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(o, "objects:    {}", objects.join(", "))?;
        if !self.subsystems.is_empty() {
            writeln!(o, "subsystems:")?;
            let w = self
                .subsystems
                .iter()
                .map(|s| s.name.len())
                .max()
                .unwrap_or(0);
            for s in &self.subsystems {
                writeln!(o, "  {:w$}  {}", s.name, s.state)?;
            }
        }
        writeln!(o, "services:")
    }

    /// The ingress routes, those with problems first, at most
    /// [`SUMMARY_SERVICES`] of them (then a count of the rest).
    fn write_routes(&self, o: &mut String) -> std::fmt::Result {
        let mut routes: Vec<_> = self.routes.iter().collect();
        routes.sort_by_key(|r| r.problems.is_empty());
        for (i, r) in routes.iter().take(SUMMARY_SERVICES).enumerate() {
            let label = if i == 0 { "routes:" } else { "" };
            writeln!(o, "{label:12}{r}")?;
        }
        if routes.len() > SUMMARY_SERVICES {
            let healthy = routes.iter().filter(|r| r.problems.is_empty()).count();
            writeln!(
                o,
                "            … {} more routes ({healthy} of all {} without problems)",
                routes.len() - SUMMARY_SERVICES,
                routes.len()
            )?;
        }
        Ok(())
    }

    /// The text form's lines up to and including `services:`: what `status --all`
    /// prints before it streams the services.
    pub fn render_head(&self) -> String {
        let mut o = String::new();
        let _ = self.render_head_into(&mut o);
        o
    }

    /// The text form's orphan endpoint lines (after the services).
    pub fn render_orphans(&self) -> String {
        let mut o = String::new();
        for e in &self.orphan_endpoints {
            o.push_str(&render_orphan(e));
        }
        if self.orphans_omitted > 0 {
            let _ = writeln!(
                o,
                "  {} endpoints objects without a service, not listed (more than {SUMMARY_SERVICES}): `rune-agent status --all` lists them",
                self.orphans_omitted
            );
        }
        o
    }
}

/// The text line of an orphan endpoints object (`Endpoints namespace/name`).
pub fn render_orphan(e: &str) -> String {
    format!("  {e}: no such service\n")
}

impl ServiceStatus {
    /// The text form of one service: its line, then one line per port and backend.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ = self.render_into(&mut o);
        o
    }

    fn render_into(&self, o: &mut String) -> std::fmt::Result {
        let s = self;
        let vips = if s.headless {
            "headless".to_owned()
        } else if s.vips.is_empty() {
            "no VIP".to_owned()
        } else {
            s.vips.join(", ")
        };
        writeln!(o, "  {}  [{vips}]  endpoints: {}", s.service, s.endpoints)?;
        for p in &s.ports {
            write!(o, "    {}/{} -> {}", p.port, p.protocol, p.target_port)?;
            if let Some(l) = &p.listen {
                write!(o, "  on {l}")?;
            }
            if let Some(st) = &p.state {
                write!(o, "  {st}")?;
            }
            if let Some(c) = &p.counters {
                write!(o, "  ({c})")?;
            }
            writeln!(o)?;
        }
        for b in &s.backends {
            write!(o, "    backend {}  {}", b.endpoint(), b.state)?;
            if !b.node.is_empty() {
                write!(o, "  (node {})", b.node)?;
            }
            if let Some(c) = &b.counters {
                write!(o, "  ({c})")?;
            }
            writeln!(o)?;
        }
        Ok(())
    }
}
