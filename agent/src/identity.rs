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
mod tests {
    use super::*;

    fn dir_names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn identity_is_stable_across_loads() {
        let dir = tempfile::tempdir().unwrap();
        let first = Identity::load_or_create(dir.path()).unwrap();
        let second = Identity::load_or_create(dir.path()).unwrap();
        assert_eq!(first, second);
        assert_eq!(first.node_id.len(), 32);
        assert!(first.node_id.chars().all(|c| c.is_ascii_hexdigit()));
        assert!(!first.hostname.is_empty());
    }

    #[test]
    fn two_state_dirs_get_different_node_ids() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let a = Identity::load_or_create(a.path()).unwrap();
        let b = Identity::load_or_create(b.path()).unwrap();
        assert_ne!(a.node_id, b.node_id);
    }

    #[test]
    fn an_identity_created_concurrently_is_never_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(IDENTITY_FILE);
        let first = Identity {
            node_id: "aaaa".into(),
            hostname: "h".into(),
            labels: BTreeMap::new(),
        };
        assert!(persist(dir.path(), &path, &first).unwrap());
        // A second writer that raced the first loses and adopts the stored identity.
        let second = Identity {
            node_id: "bbbb".into(),
            ..first.clone()
        };
        assert!(!persist(dir.path(), &path, &second).unwrap());
        assert_eq!(Identity::load_or_create(dir.path()).unwrap(), first);
        assert_eq!(dir_names(dir.path()), [IDENTITY_FILE]);
    }

    #[test]
    fn creates_missing_state_dir_and_leaves_no_temp_file() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("var/lib/rune");
        Identity::load_or_create(&dir).unwrap();
        assert_eq!(dir_names(&dir), vec![IDENTITY_FILE.to_owned()]);
    }

    #[test]
    fn persisted_file_uses_documented_field_names() {
        let dir = tempfile::tempdir().unwrap();
        let identity = Identity::load_or_create(dir.path()).unwrap();
        let text = fs::read_to_string(dir.path().join(IDENTITY_FILE)).unwrap();
        let value: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["node_id"], identity.node_id.as_str());
        assert_eq!(value["hostname"], identity.hostname.as_str());
        let mode = fs::metadata(dir.path().join(IDENTITY_FILE))
            .map(|m| m.permissions().mode() & 0o777)
            .unwrap();
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn the_state_dir_is_made_private() {
        let root = tempfile::tempdir().unwrap();
        let mode = |p: &Path| fs::symlink_metadata(p).unwrap().mode() & 0o7777;
        // A new one is created 0700.
        let fresh = root.path().join("new/rune");
        Identity::load_or_create(&fresh).unwrap();
        assert_eq!(mode(&fresh), 0o700);
        // An existing one loses group and other permissions, its files too.
        let dir = root.path().join("old");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        let store = dir.join("store.redb");
        fs::write(&store, b"").unwrap();
        fs::set_permissions(&store, fs::Permissions::from_mode(0o644)).unwrap();
        let outside = root.path().join("outside");
        fs::write(&outside, b"").unwrap();
        fs::set_permissions(&outside, fs::Permissions::from_mode(0o644)).unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
        Identity::load_or_create(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&store), 0o600);
        assert_eq!(mode(&dir.join(IDENTITY_FILE)), 0o600);
        assert_eq!(mode(&outside), 0o644, "a link's target is not touched");
        // Nothing left to change.
        assert_eq!(secure_state_dir(&dir).unwrap(), vec![]);
        // A dir everybody may write to is refused, and left as it is.
        let shared = root.path().join("shared");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
        let err = Identity::load_or_create(&shared).unwrap_err();
        assert!(matches!(err, IdentityError::SharedDir { .. }), "{err}");
        assert_eq!(mode(&shared), 0o1777);
    }

    #[test]
    fn operator_labels_are_loaded() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join(IDENTITY_FILE),
            r#"{"node_id":"abc","hostname":"h","labels":{"zone":"a"}}"#,
        )
        .unwrap();
        let identity = Identity::load_or_create(dir.path()).unwrap();
        assert_eq!(identity.node_id, "abc");
        assert_eq!(identity.labels.get("zone").map(String::as_str), Some("a"));
    }

    #[test]
    fn malformed_file_is_an_error_naming_the_path_and_is_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(IDENTITY_FILE);
        let garbage = b"{\"node_id\": \"abc\", oops".to_vec();
        fs::write(&path, &garbage).unwrap();

        let error = Identity::load_or_create(dir.path()).unwrap_err();
        assert!(
            matches!(error, IdentityError::Malformed { .. }),
            "{error:?}"
        );
        assert!(
            error.to_string().contains(&path.display().to_string()),
            "{error}"
        );
        assert_eq!(fs::read(&path).unwrap(), garbage);
        assert_eq!(dir_names(dir.path()), vec![IDENTITY_FILE.to_owned()]);
    }

    #[test]
    fn bad_node_ids_are_rejected_and_not_overwritten() {
        for id in ["", "  ", "node one", "a\u{7}b"] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join(IDENTITY_FILE);
            let content =
                serde_json::to_vec(&serde_json::json!({"node_id": id, "hostname": "h"})).unwrap();
            fs::write(&path, &content).unwrap();

            let error = Identity::load_or_create(dir.path()).unwrap_err();
            assert!(
                matches!(
                    error,
                    IdentityError::Invalid {
                        field: "node_id",
                        ..
                    }
                ),
                "{id:?}: {error:?}"
            );
            assert!(error.to_string().contains(&path.display().to_string()));
            assert_eq!(fs::read(&path).unwrap(), content);
        }
    }
}
