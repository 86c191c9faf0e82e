//! Writing certificates and keys: a private directory (0700), keys 0600,
//! certificates 0644, never replacing a file unless forced, and a file either
//! complete or absent after a crash (written aside, synced, then linked or renamed).

use super::CertsError;
use std::{
    fs::{self, DirBuilder, OpenOptions},
    io::{self, Write as _},
    os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

/// A file written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    /// Its path.
    pub path: PathBuf,
    /// A private key (mode 0600), as opposed to a certificate (0644).
    pub private: bool,
}

/// Creates `dir` (and its parents) and makes it 0700 if group or others may use it:
/// it holds private keys.
pub fn private_dir(dir: &Path) -> Result<(), CertsError> {
    let err = |source: io::Error| CertsError::Write {
        path: dir.to_owned(),
        source,
    };
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(err)?;
    let mode = fs::metadata(dir).map_err(err)?.permissions().mode();
    if mode & 0o077 != 0 {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o700)).map_err(err)?;
    }
    Ok(())
}

/// Refuses when any of `paths` exists (or cannot be checked), before anything is
/// written.
pub(super) fn refuse_existing(paths: &[PathBuf]) -> Result<(), CertsError> {
    for path in paths {
        match fs::symlink_metadata(path) {
            Ok(_) => return Err(CertsError::Exists { path: path.clone() }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(CertsError::Read {
                    path: path.clone(),
                    source,
                });
            }
        }
    }
    Ok(())
}

/// Writes `contents` to `path`, 0600 when `private`, else 0644. Without `force`
/// an existing file is refused ([`CertsError::Exists`]); with it, replaced.
pub(super) fn write(
    path: &Path,
    contents: &str,
    private: bool,
    force: bool,
) -> Result<Written, CertsError> {
    let err = |path: &Path, source: io::Error| CertsError::Write {
        path: path.to_owned(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        ".{name}.tmp.{}.{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(if private { 0o600 } else { 0o644 })
            .open(&tmp)?;
        file.write_all(contents.as_bytes())?;
        file.sync_all()
    })();
    if let Err(source) = written {
        let _ = fs::remove_file(&tmp);
        return Err(err(&tmp, source));
    }
    // A link never replaces a file another process created meanwhile; a rename
    // replaces it when forced.
    let placed = if force {
        fs::rename(&tmp, path)
    } else {
        let linked = fs::hard_link(&tmp, path);
        let _ = fs::remove_file(&tmp);
        linked
    };
    match placed {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            return Err(CertsError::Exists {
                path: path.to_owned(),
            });
        }
        Err(source) => {
            let _ = fs::remove_file(&tmp);
            return Err(err(path, source));
        }
    }
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(Written {
        path: path.to_owned(),
        private,
    })
}
