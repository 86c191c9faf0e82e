//! Writing the CLI's answers as they arrive: `get` and `status --all` print objects
//! and services one at a time, in the same text, JSON and YAML as when the whole
//! answer was printed at once (the JSON and YAML are valid documents: the list's
//! head and tail are cut from the document serde makes of an empty list).
//!
//! Every write goes through [`Out`], whose errors say when standard output was
//! closed by its reader ([`StdoutClosed`]): `rune-agent get | head -1` then ends
//! quietly, with exit status 141 (128 + SIGPIPE), as `yes | head -1`, git or kubectl
//! do, instead of panicking in `println!`.

use super::Format;
use crate::{
    localapi::StatusPart,
    model::{API_VERSION, Object},
    status::{AgentStatus, ServiceStatus, render_orphan},
};
use std::io::{self, BufWriter, Write};

/// Standard output was closed by its reader (EPIPE): the command stops quietly;
/// `main` exits with status 141.
#[derive(Debug, thiserror::Error)]
#[error("standard output was closed")]
pub struct StdoutClosed;

/// Buffered standard output (or, in tests, memory).
pub struct Out {
    inner: Sink,
}

enum Sink {
    Stdout(BufWriter<io::Stdout>),
    #[cfg(test)]
    Memory(Vec<u8>),
}

impl Default for Out {
    fn default() -> Self {
        Self {
            inner: Sink::Stdout(BufWriter::with_capacity(64 * 1024, io::stdout())),
        }
    }
}

impl Out {
    /// Writes `text`.
    pub fn write(&mut self, text: &str) -> io::Result<()> {
        match &mut self.inner {
            Sink::Stdout(w) => w.write_all(text.as_bytes()),
            #[cfg(test)]
            Sink::Memory(v) => v.write_all(text.as_bytes()),
        }
    }

    /// Writes what is buffered.
    pub fn flush(&mut self) -> io::Result<()> {
        match &mut self.inner {
            Sink::Stdout(w) => w.flush(),
            #[cfg(test)]
            Sink::Memory(_) => Ok(()),
        }
    }

    #[cfg(test)]
    fn memory() -> Out {
        Out {
            inner: Sink::Memory(Vec::new()),
        }
    }

    #[cfg(test)]
    fn text(self) -> String {
        match self.inner {
            Sink::Memory(v) => String::from_utf8(v).unwrap_or_default(),
            Sink::Stdout(_) => String::new(),
        }
    }
}

/// A write error as the command's error: [`StdoutClosed`] for EPIPE.
pub fn output_error(e: io::Error) -> anyhow::Error {
    if e.kind() == io::ErrorKind::BrokenPipe {
        StdoutClosed.into()
    } else {
        anyhow::Error::new(e).context("writing to standard output")
    }
}

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// `text` with every line indented by `n` spaces.
fn indent(text: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    let mut out = String::with_capacity(text.len() + 16);
    for (i, line) in text.lines().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        out.push_str(&pad);
        out.push_str(line);
    }
    out
}

/// A JSON document with one top-level list written item by item: `head` up to the
/// list, then the items, then `tail`.
struct JsonList {
    head: String,
    tail: String,
    key: &'static str,
    items: usize,
}

impl JsonList {
    /// Cuts `skeleton` (serde's pretty JSON of the document with `key` an empty
    /// list, a top-level member) around that list.
    fn new(skeleton: &str, key: &'static str) -> io::Result<Self> {
        let marker = format!("\n  \"{key}\": []");
        let at = skeleton
            .find(&marker)
            .ok_or_else(|| io_err(format!("no {key} in the document")))?;
        Ok(JsonList {
            head: skeleton[..at + 1].to_owned(),
            tail: skeleton[at + marker.len()..].to_owned(),
            key,
            items: 0,
        })
    }

    fn start(&self, out: &mut Out) -> io::Result<()> {
        out.write(&self.head)?;
        out.write(&format!("  \"{}\": [", self.key))
    }

    fn item(&mut self, out: &mut Out, value: &impl serde::Serialize) -> io::Result<()> {
        let text = serde_json::to_string_pretty(value).map_err(io_err)?;
        out.write(if self.items == 0 { "\n" } else { ",\n" })?;
        out.write(&indent(&text, 4))?;
        self.items += 1;
        Ok(())
    }

    /// Closes the list; `extra` is written between the list and `tail`.
    fn end(&self, out: &mut Out, extra: &str) -> io::Result<()> {
        out.write(if self.items == 0 { "]" } else { "\n  ]" })?;
        out.write(extra)?;
        out.write(&self.tail)?;
        out.write("\n")
    }
}

/// Prints objects as `get` does: a table (kept until the end, for its column
/// widths), YAML documents or a JSON `List` (written as they come), or one pretty
/// JSON document when a NAME was given.
pub struct ObjectsOut {
    format: Option<Format>,
    single: bool,
    json: Option<JsonList>,
    kept: Vec<Object>,
    rows: Vec<[String; 4]>,
    count: usize,
    show_secrets: bool,
}

/// The value a Secret's entries are printed as unless `--show-secrets` is given.
pub const HIDDEN: &str = "(hidden: rune-agent get -o yaml --show-secrets)";

impl ObjectsOut {
    /// A printer for `format`; `single` when a NAME was given (nothing is printed
    /// until [`ObjectsOut::finish`], so "not found" comes before any output).
    pub fn new(format: Option<Format>, single: bool) -> io::Result<Self> {
        let json = match format {
            Some(Format::Json) if !single => {
                let skeleton =
                    serde_json::json!({"apiVersion": API_VERSION, "kind": "List", "items": []});
                Some(JsonList::new(
                    &serde_json::to_string_pretty(&skeleton).map_err(io_err)?,
                    "items",
                )?)
            }
            _ => None,
        };
        Ok(ObjectsOut {
            format,
            single,
            json,
            kept: Vec::new(),
            rows: Vec::new(),
            count: 0,
            show_secrets: false,
        })
    }

    /// Prints Secrets' values as they are (else they are replaced by [`HIDDEN`]).
    #[must_use]
    pub fn show_secrets(mut self, show: bool) -> Self {
        self.show_secrets = show;
        self
    }

    /// Prints (or keeps) one object.
    pub fn push(&mut self, out: &mut Out, mut o: Object) -> io::Result<()> {
        self.count += 1;
        if let Object::Secret(s) = &mut o
            && !self.show_secrets
        {
            s.data.values_mut().for_each(|v| *v = HIDDEN.to_owned());
        }
        if self.single {
            self.kept.push(o);
            return Ok(());
        }
        match self.format {
            Some(Format::Json) => {
                if let Some(list) = &mut self.json {
                    if list.items == 0 {
                        list.start(out)?;
                    }
                    list.item(out, &o.to_json())?;
                }
            }
            Some(Format::Yaml) => {
                if self.count > 1 {
                    out.write("---\n")?;
                }
                out.write(&serde_yaml_ng::to_string(&o.to_json()).map_err(io_err)?)?;
            }
            None => self.rows.push(row(&o)),
        }
        Ok(())
    }

    /// How many objects came.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Prints what was kept and closes the JSON list.
    pub fn finish(self, out: &mut Out) -> io::Result<()> {
        match self.format {
            Some(Format::Json) if self.single && self.kept.len() == 1 => {
                let doc = self.kept[0].to_json();
                out.write(&(serde_json::to_string_pretty(&doc).map_err(io_err)? + "\n"))?;
            }
            Some(Format::Json) => {
                if let Some(list) = self.json {
                    if list.items == 0 {
                        list.start(out)?;
                    }
                    list.end(out, "")?;
                }
            }
            Some(Format::Yaml) => {
                for (i, o) in self.kept.iter().enumerate() {
                    if i > 0 {
                        out.write("---\n")?;
                    }
                    out.write(&serde_yaml_ng::to_string(&o.to_json()).map_err(io_err)?)?;
                }
            }
            None => {
                let mut rows = self.rows;
                rows.extend(self.kept.iter().map(row));
                out.write(&table(rows))?;
            }
        }
        out.flush()
    }
}

fn row(o: &Object) -> [String; 4] {
    let m = o.metadata();
    let details = match o {
        Object::Service(s) => {
            let ports: Vec<String> = s
                .spec
                .ports
                .iter()
                .map(|p| format!("{}/{}->{}", p.port, p.protocol, p.target()))
                .collect();
            let vips: Vec<String> = s
                .spec
                .discovery
                .vips
                .iter()
                .map(|v| v.to_string())
                .collect();
            let vips = if s.spec.discovery.headless {
                "headless".to_owned()
            } else if vips.is_empty() {
                "no VIP".to_owned()
            } else {
                vips.join(",")
            };
            format!("{vips} {}", ports.join(","))
        }
        Object::Endpoints(e) => {
            let total = e.spec.endpoints.len();
            let ready = e.spec.endpoints.iter().filter(|x| x.accepts_new()).count();
            format!("{total} endpoints, {ready} accepting")
        }
        Object::Secret(s) => {
            let keys: Vec<&str> = s.data.keys().map(String::as_str).collect();
            format!("keys: {}", keys.join(","))
        }
    };
    [
        o.kind().to_string(),
        m.namespace.clone(),
        m.name.clone(),
        details,
    ]
}

fn table(objects: Vec<[String; 4]>) -> String {
    let header = ["KIND", "NAMESPACE", "NAME", "DETAILS"].map(str::to_owned);
    let rows: Vec<[String; 4]> = std::iter::once(header).chain(objects).collect();
    let widths: Vec<usize> = (0..4)
        .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let line = format!(
            "{:w0$}  {:w1$}  {:w2$}  {}",
            r[0],
            r[1],
            r[2],
            r[3],
            w0 = widths[0],
            w1 = widths[1],
            w2 = widths[2]
        );
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// Prints a status answer part by part: the summary (text, JSON or YAML as
/// before), one service, or the summary followed by every service and orphan
/// endpoints object of `status --all`, which are written as they come.
pub struct StatusOut {
    format: Option<Format>,
    shape: StatusShape,
    /// The summary of `--all` came (and its head was printed).
    started: bool,
    json: Option<JsonList>,
    yaml_tail: String,
    orphans: Vec<String>,
    services: usize,
}

/// Which status answer a [`StatusOut`] prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusShape {
    /// `status`: the summary.
    Summary,
    /// `status NAME`: the one service, without the summary.
    One,
    /// `status --all`: the summary, then every service and orphan.
    All,
}

impl StatusOut {
    /// A printer of `shape` in `format`.
    pub fn new(format: Option<Format>, shape: StatusShape) -> Self {
        StatusOut {
            format,
            shape,
            started: false,
            json: None,
            yaml_tail: String::new(),
            orphans: Vec::new(),
            services: 0,
        }
    }

    /// Prints one part.
    pub fn push(&mut self, out: &mut Out, part: StatusPart) -> io::Result<()> {
        match part {
            StatusPart::Summary(st) => match self.shape {
                StatusShape::Summary => out.write(&render_summary(&st, self.format)?)?,
                StatusShape::One => {}
                StatusShape::All => {
                    self.start_all(out, &st)?;
                    self.started = true;
                }
            },
            StatusPart::Service(s) if self.shape == StatusShape::All => {
                self.services += 1;
                match self.format {
                    None => out.write(&s.render())?,
                    Some(Format::Json) => {
                        if let Some(list) = &mut self.json {
                            list.item(out, &s)?;
                        }
                    }
                    Some(Format::Yaml) => {
                        if self.services == 1 {
                            out.write("services:\n")?;
                        }
                        out.write(&serde_yaml_ng::to_string(&[&s]).map_err(io_err)?)?;
                    }
                }
            }
            StatusPart::Service(s) => out.write(&render_service(&s, self.format)?)?,
            StatusPart::Orphan(o) => self.orphans.push(o),
        }
        Ok(())
    }

    fn start_all(&mut self, out: &mut Out, st: &AgentStatus) -> io::Result<()> {
        let mut head = st.clone();
        head.services.clear();
        head.orphan_endpoints.clear();
        match self.format {
            None => out.write(&head.render_head()),
            Some(Format::Json) => {
                let skeleton = serde_json::to_string_pretty(&head).map_err(io_err)?;
                let list = JsonList::new(&skeleton, "services")?;
                list.start(out)?;
                self.json = Some(list);
                Ok(())
            }
            Some(Format::Yaml) => {
                let skeleton = serde_yaml_ng::to_string(&head).map_err(io_err)?;
                let (before, after) = split_yaml(&skeleton, "services")?;
                self.yaml_tail = after.to_owned();
                out.write(before)
            }
        }
    }

    /// Prints what comes after the services of `--all`: the orphan endpoints and
    /// the document's end.
    pub fn finish(self, out: &mut Out) -> io::Result<()> {
        if !self.started {
            return out.flush();
        }
        match self.format {
            None => {
                if self.services == 0 {
                    out.write("  (none)\n")?;
                }
                for o in &self.orphans {
                    out.write(&render_orphan(o))?;
                }
            }
            Some(Format::Json) => {
                let mut extra = String::new();
                if !self.orphans.is_empty() {
                    let pretty = serde_json::to_string_pretty(&self.orphans).map_err(io_err)?;
                    extra = format!(
                        ",\n  \"orphanEndpoints\": {}",
                        indent(&pretty, 2).trim_start()
                    );
                }
                if let Some(list) = &self.json {
                    list.end(out, &extra)?;
                }
            }
            Some(Format::Yaml) => {
                if self.services == 0 {
                    out.write("services: []\n")?;
                }
                if !self.orphans.is_empty() {
                    let mut o = serde_yaml_ng::Mapping::new();
                    o.insert(
                        "orphanEndpoints".into(),
                        serde_yaml_ng::to_value(&self.orphans).map_err(io_err)?,
                    );
                    out.write(&serde_yaml_ng::to_string(&o).map_err(io_err)?)?;
                }
                out.write(&self.yaml_tail)?;
            }
        }
        out.flush()
    }
}

/// `text` cut around the top-level YAML key `key` holding an empty list.
fn split_yaml<'a>(text: &'a str, key: &str) -> io::Result<(&'a str, &'a str)> {
    let marker = format!("{key}: []\n");
    let at = if text.starts_with(&marker) {
        0
    } else {
        text.find(&format!("\n{marker}"))
            .map(|i| i + 1)
            .ok_or_else(|| io_err(format!("no {key} in the document")))?
    };
    Ok((&text[..at], &text[at + marker.len()..]))
}

/// The summary in `format`.
pub fn render_summary(st: &AgentStatus, format: Option<Format>) -> io::Result<String> {
    Ok(match format {
        Some(Format::Json) => serde_json::to_string_pretty(st).map_err(io_err)? + "\n",
        Some(Format::Yaml) => serde_yaml_ng::to_string(st).map_err(io_err)?,
        None => st.render(),
    })
}

/// One service in `format` (`status NAME`).
pub fn render_service(s: &ServiceStatus, format: Option<Format>) -> io::Result<String> {
    Ok(match format {
        Some(Format::Json) => serde_json::to_string_pretty(s).map_err(io_err)? + "\n",
        Some(Format::Yaml) => serde_yaml_ng::to_string(s).map_err(io_err)?,
        None => s.render(),
    })
}

#[cfg(test)]
mod tests;
