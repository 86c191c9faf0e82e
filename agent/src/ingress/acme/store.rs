//! Where ACME state lives: `<state-dir>/acme/` (0700) holds the account
//! (`account.json`: the directory URL and the account's credentials with its key)
//! and one `<host>.pem` per certificate (its private key, then the chain), each
//! file 0600 and replaced whole (written aside, then renamed), so a crash leaves
//! the old file or the new one.

use instant_acme::AccountCredentials;
use serde::{Deserialize, Serialize};
use std::{
    fs::{self, OpenOptions},
    io::{self, Write},
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

const ACCOUNT_FILE: &str = "account.json";
const CERT_SUFFIX: &str = ".pem";

/// The ACME account as stored: which server it belongs to, and its credentials.
#[derive(Serialize, Deserialize)]
pub struct StoredAccount {
    /// The directory URL the account was created at.
    pub directory: String,
    /// The account's id and private key (instant-acme's form).
    pub credentials: AccountCredentials,
}

/// The ACME directory of the state dir.
#[derive(Clone, Debug)]
pub struct AcmeStore {
    dir: PathBuf,
}

impl AcmeStore {
    /// The store at `dir` (created 0700 on first write).
    pub fn new(dir: PathBuf) -> AcmeStore {
        AcmeStore { dir }
    }

    /// The directory's path.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The stored account, if any and readable. A file that does not parse is
    /// renamed aside (`account.json.corrupt`, kept for the operator) and counts as
    /// none, so a new account is registered instead of failing every order.
    pub fn account(&self) -> io::Result<Option<StoredAccount>> {
        let path = self.dir.join(ACCOUNT_FILE);
        match fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(account) => Ok(Some(account)),
                Err(error) => {
                    let aside = self.dir.join(format!("{ACCOUNT_FILE}.corrupt"));
                    tracing::warn!(%error, path = %path.display(), aside = %aside.display(), "ACME account file does not parse: set aside, a new account is registered");
                    fs::rename(&path, &aside)?;
                    Ok(None)
                }
            },
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Stores the account, replacing the previous one.
    pub fn save_account(&self, account: &StoredAccount) -> io::Result<()> {
        let json = serde_json::to_vec_pretty(account).map_err(io::Error::other)?;
        self.write(ACCOUNT_FILE, &json)
    }

    /// Forgets the account (the server no longer knows it).
    pub fn remove_account(&self) -> io::Result<()> {
        match fs::remove_file(self.dir.join(ACCOUNT_FILE)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    /// Stores `host`'s private key and certificate chain (both PEM) in one file.
    pub fn save_cert(&self, host: &str, key_pem: &str, chain_pem: &str) -> io::Result<()> {
        let name = cert_file(host)?;
        let mut text = key_pem.trim_end().to_owned();
        text.push('\n');
        text.push_str(chain_pem.trim_end());
        text.push('\n');
        self.write(&name, text.as_bytes())
    }

    /// Every stored certificate: `(host, PEM text with key and chain)`. A missing
    /// directory is an empty store; unreadable files are skipped with a warning.
    pub fn certs(&self) -> io::Result<Vec<(String, String)>> {
        let entries = match fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut found = Vec::new();
        for entry in entries {
            let path = entry?.path();
            let Some(host) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(CERT_SUFFIX))
                .filter(|h| cert_file(h).is_ok())
            else {
                continue;
            };
            match fs::read_to_string(&path) {
                Ok(text) => found.push((host.to_owned(), text)),
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "acme: certificate file unreadable");
                }
            }
        }
        found.sort();
        Ok(found)
    }

    /// Makes the directory (0700, also when it existed wider), then writes `name`
    /// aside (0600) and renames it into place.
    fn write(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        fs::create_dir_all(&self.dir)?;
        fs::set_permissions(&self.dir, fs::Permissions::from_mode(0o700))?;
        let partial = self.dir.join(format!(".{name}.partial"));
        let written = (|| {
            let mut file = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&partial)?;
            // An older partial file keeps its mode: make it private before writing.
            file.set_permissions(fs::Permissions::from_mode(0o600))?;
            file.write_all(bytes)?;
            file.sync_all()
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&partial);
            return Err(e);
        }
        fs::rename(&partial, self.dir.join(name))
    }
}

/// `<host>.pem`, for a host name that is safe as a file name (the model checked
/// it: lowercase DNS labels).
fn cert_file(host: &str) -> io::Result<String> {
    let safe = !host.is_empty()
        && !host.starts_with('.')
        && host
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
    if safe {
        Ok(format!("{host}{CERT_SUFFIX}"))
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{host:?} is not a host name"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn certificates_are_private_and_read_back() {
        let state = tempfile::tempdir().unwrap();
        let store = AcmeStore::new(state.path().join("acme"));
        assert!(store.certs().unwrap().is_empty());
        store.save_cert("a.example", "KEY\n", "CHAIN").unwrap();
        store.save_cert("a.example", "KEY2", "CHAIN2").unwrap();
        assert_eq!(
            store.certs().unwrap(),
            vec![("a.example".to_owned(), "KEY2\nCHAIN2\n".to_owned())]
        );
        assert_eq!(mode(store.dir()), 0o700);
        assert_eq!(mode(&store.dir().join("a.example.pem")), 0o600);
        assert!(store.save_cert("../x", "K", "C").is_err());
        assert!(store.account().unwrap().is_none());
        store.remove_account().unwrap();
    }

    #[test]
    fn an_account_file_that_does_not_parse_is_set_aside() {
        let state = tempfile::tempdir().unwrap();
        let store = AcmeStore::new(state.path().join("acme"));
        store.save_cert("a.example", "KEY\n", "CHAIN").unwrap();
        fs::write(store.dir().join(ACCOUNT_FILE), "{not json").unwrap();
        assert!(store.account().unwrap().is_none());
        assert!(!store.dir().join(ACCOUNT_FILE).exists());
        let aside = store.dir().join(format!("{ACCOUNT_FILE}.corrupt"));
        assert_eq!(fs::read_to_string(aside).unwrap(), "{not json");
    }
}
