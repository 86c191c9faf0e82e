//! The node's persisted identity: a random node ID created once, kept in
//! `<state_dir>/node-identity.json` so that restarts and upgrades never change it.
//!
//! A file that exists but cannot be read as an identity is an error for the operator
//! to resolve; it is never regenerated or overwritten.
//!
//! Loading the identity is the agent's first step at start, so it also makes the
//! state dir private ([`secure_state_dir`]): secrets will be stored there, next to
//! the store and the socket.

use std::{
    collections::BTreeMap,
    fs::{self, DirBuilder, File, OpenOptions},
    io::{self, Write},
    os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use rand::Rng;
use serde::{Deserialize, Serialize};

/// The file name of the identity inside the state directory.
pub const IDENTITY_FILE: &str = "node-identity.json";

/// The agent's stable node identity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Random, created on first start, never changed: 32 lower-case hex digits.
    pub node_id: String,
    /// The host name when the identity was created.
    pub hostname: String,
    /// Operator-set labels (edit the file while the agent is stopped).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
}

impl Identity {
    /// Whether the operator labelled this node `key=value`.
    pub fn has_label(&self, key: &str, value: &str) -> bool {
        self.labels.get(key).is_some_and(|v| v == value)
    }
}

/// Why the identity could not be loaded or created.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The state directory could not be created.
    #[error("cannot create state directory {}", .path.display())]
    CreateDir {
        /// The state directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The identity file exists but could not be read.
    #[error("cannot read identity file {}", .path.display())]
    Read {
        /// The identity file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The identity file is not valid identity JSON; it was left as it is.
    #[error("malformed identity file {} (left untouched; fix or remove it)", .path.display())]
    Malformed {
        /// The identity file.
        path: PathBuf,
        /// The parse error, with line and column.
        #[source]
        source: serde_json::Error,
    },
    /// The identity file parses but a field is unusable; it was left as it is.
    #[error("invalid identity file {}: {field} {reason} (left untouched; fix or remove it)", .path.display())]
    Invalid {
        /// The identity file.
        path: PathBuf,
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The host name could not be determined for a new identity.
    #[error("cannot determine the host name")]
    Hostname {
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A new identity could not be written.
    #[error("cannot write identity file {}", .path.display())]
    Write {
        /// The file being written (the temporary file or the identity file).
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The permissions of the state dir or of a file in it could not be read or
    /// tightened.
    #[error("cannot make {} private to the agent's user", .path.display())]
    Permissions {
        /// The state dir or the file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The state dir is writable by everybody (e.g. `/tmp`): not a directory the
    /// agent may make private, nor one to keep secrets in.
    #[error(
        "state dir {} is writable by every user (mode {mode:o}): use a directory of its own (--state-dir)",
        .path.display()
    )]
    SharedDir {
        /// The state dir.
        path: PathBuf,
        /// Its mode.
        mode: u32,
    },
}

/// A permission change [`secure_state_dir`] made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tightened {
    /// The state dir, or an entry directly in it.
    pub path: PathBuf,
    /// Its permission bits before.
    pub from: u32,
    /// And after.
    pub to: u32,
}

/// Makes the state dir private to the agent's user: creates it 0700 when missing;
/// for an existing one, removes every group and other permission from the dir
/// (0755 becomes 0700) and from each entry directly in it (a 0644 store becomes
/// 0600), and logs each change. Symbolic links are left alone (a chmod would
/// follow them out of the dir). Refuses a dir every user may write to ([`IdentityError::SharedDir`]):
/// making `/tmp` 0700 would break the host.
pub fn secure_state_dir(state_dir: &Path) -> Result<Vec<Tightened>, IdentityError> {
    let perm_err = |path: &Path| {
        let path = path.to_owned();
        move |source| IdentityError::Permissions { path, source }
    };
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(state_dir)
        .map_err(|source| IdentityError::CreateDir {
            path: state_dir.to_owned(),
            source,
        })?;
    let mode = fs::metadata(state_dir).map_err(perm_err(state_dir))?.mode();
    if mode & 0o002 != 0 {
        return Err(IdentityError::SharedDir {
            path: state_dir.to_owned(),
            mode: mode & 0o7777,
        });
    }
    let mut changed = Vec::new();
    let mut tighten = |path: &Path, mode: u32| -> Result<(), IdentityError> {
        let bits = mode & 0o7777;
        let private = bits & !0o077;
        if private != bits {
            fs::set_permissions(path, fs::Permissions::from_mode(private))
                .map_err(perm_err(path))?;
            tracing::warn!(
                path = %path.display(),
                from = %format!("{bits:04o}"),
                to = %format!("{private:04o}"),
                "tightened permissions in the state dir (it will hold secrets)"
            );
            changed.push(Tightened {
                path: path.to_owned(),
                from: bits,
                to: private,
            });
        }
        Ok(())
    };
    tighten(state_dir, mode)?;
    for entry in fs::read_dir(state_dir).map_err(perm_err(state_dir))? {
        let entry = entry.map_err(perm_err(state_dir))?;
        let path = entry.path();
        let meta = fs::symlink_metadata(&path).map_err(perm_err(&path))?;
        if meta.file_type().is_symlink() {
            continue;
        }
        tighten(&path, meta.mode())?;
    }
    Ok(changed)
}

impl Identity {
    /// Reads the identity from `<state_dir>/node-identity.json`, or creates a new one
    /// (random node ID, this host's name, no labels) and persists it atomically.
    /// First makes `state_dir` private ([`secure_state_dir`]: created 0700 when
    /// missing, group and other permissions removed from it and its files).
    pub fn load_or_create(state_dir: &Path) -> Result<Identity, IdentityError> {
        secure_state_dir(state_dir)?;
        let path = state_dir.join(IDENTITY_FILE);
        match fs::read(&path) {
            Ok(bytes) => Self::parse(&path, &bytes),
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                let identity = Identity {
                    node_id: new_node_id(),
                    hostname: hostname().map_err(|source| IdentityError::Hostname { source })?,
                    labels: BTreeMap::new(),
                };
                if persist(state_dir, &path, &identity)? {
                    Ok(identity)
                } else {
                    // Another process created it first: its identity is the node's.
                    let bytes = fs::read(&path).map_err(|source| IdentityError::Read {
                        path: path.clone(),
                        source,
                    })?;
                    Self::parse(&path, &bytes)
                }
            }
            Err(source) => Err(IdentityError::Read { path, source }),
        }
    }

    fn parse(path: &Path, bytes: &[u8]) -> Result<Identity, IdentityError> {
        let identity: Identity =
            serde_json::from_slice(bytes).map_err(|source| IdentityError::Malformed {
                path: path.to_owned(),
                source,
            })?;
        let id = &identity.node_id;
        let reason = if id.trim().is_empty() {
            Some("is empty".to_owned())
        } else if id.len() > 253 {
            Some(format!("is {} characters long (at most 253)", id.len()))
        } else {
            id.chars()
                .find(|c| c.is_whitespace() || c.is_control())
                .map(|c| format!("contains {c:?} (node ids end up in labels and logs)"))
        };
        if let Some(reason) = reason {
            return Err(IdentityError::Invalid {
                path: path.to_owned(),
                field: "node_id",
                reason,
            });
        }
        Ok(identity)
    }
}

/// 16 random bytes as hex.
fn new_node_id() -> String {
    let mut bytes = [0u8; 16];
    rand::rng().fill(&mut bytes);
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// This host's name: gethostname(2), or /proc/sys/kernel/hostname.
fn hostname() -> io::Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the pointer and length describe `buf`, which outlives the call.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc == 0 {
        let len = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        let name = String::from_utf8_lossy(&buf[..len]).trim().to_owned();
        if !name.is_empty() {
            return Ok(name);
        }
    }
    let name = fs::read_to_string("/proc/sys/kernel/hostname")?
        .trim()
        .to_owned();
    if name.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "the kernel reports an empty host name",
        ));
    }
    Ok(name)
}

/// Writes a temporary file in the same directory, syncs it, links it to `path` and
/// syncs the directory, so a crash leaves either no file or a complete one. Never
/// replaces an existing file (a link, not a rename): returns `false` when another
/// process created `path` first.
fn persist(dir: &Path, path: &Path, identity: &Identity) -> Result<bool, IdentityError> {
    let tmp = dir.join(format!(
        ".{IDENTITY_FILE}.tmp.{}.{:08x}",
        std::process::id(),
        rand::rng().random::<u32>()
    ));
    let mut json = serde_json::to_vec_pretty(identity).map_err(|error| IdentityError::Write {
        path: tmp.clone(),
        source: io::Error::other(error),
    })?;
    json.push(b'\n');

    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(&json)?;
        file.sync_all()
    })();
    if let Err(source) = written {
        let _ = fs::remove_file(&tmp);
        return Err(IdentityError::Write { path: tmp, source });
    }
    let linked = fs::hard_link(&tmp, path);
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
        Err(source) => {
            return Err(IdentityError::Write {
                path: path.to_owned(),
                source,
            });
        }
    }
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| IdentityError::Write {
            path: dir.to_owned(),
            source,
        })?;
    Ok(true)
}

#[cfg(test)]
mod tests;
