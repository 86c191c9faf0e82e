//! The etcd settings a node's agent last ran with, recorded in its state dir
//! (`<state-dir>/etcd.yaml`, the config file's shape, etcd keys only), so that the
//! CLI on that node (`apply`, `get`, `delete`, `get nodes`, `drain`) reaches the
//! same etcd without being told again, while no agent answers on the socket. A
//! start on the embedded store removes the record.

use super::{Config, ConfigError, FileConfig};
use std::{
    io::Write as _,
    os::unix::fs::OpenOptionsExt as _,
    path::{Path, PathBuf},
};

/// The record's file name in the state dir.
pub const FILE: &str = "etcd.yaml";

/// Records `config`'s etcd settings in its state dir (TLS file paths made
/// absolute: the CLI may run elsewhere), or removes the record when `config` names
/// no etcd endpoints.
pub fn record(config: &Config) -> std::io::Result<()> {
    let path = config.state_dir.join(FILE);
    if config.etcd_endpoints.is_empty() {
        return match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        };
    }
    let absolute = |p: &Option<PathBuf>| {
        p.as_ref()
            .map(|p| std::path::absolute(p).unwrap_or(p.clone()))
    };
    let layer = FileConfig {
        etcd_endpoints: Some(config.etcd_endpoints.clone()),
        etcd_ca: absolute(&config.etcd_ca),
        etcd_cert: absolute(&config.etcd_cert),
        etcd_key: absolute(&config.etcd_key),
        etcd_insecure: Some(config.etcd_insecure),
        etcd_prefix: Some(config.etcd_prefix.clone()),
        etcd_max_txn_ops: Some(config.etcd_max_txn_ops),
        etcd_max_request_bytes: Some(config.etcd_max_request_bytes),
        ..FileConfig::default()
    };
    let text = serde_yaml_ng::to_string(&layer).map_err(std::io::Error::other)?;
    let text = format!(
        "# Written by `rune-agent run` at each start: the etcd this node's agent uses.\n\
         # The CLI reads it when no agent answers and no etcd setting is given.\n{text}"
    );
    // Written aside and renamed: a reader never sees half a file.
    let partial = config.state_dir.join(format!("{FILE}.partial"));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&partial)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    std::fs::rename(&partial, &path)
}

/// The settings recorded in `state_dir`, resolved (defaults for everything but
/// etcd's), when there is a record.
pub fn recorded(state_dir: &Path) -> Result<Option<Config>, ConfigError> {
    let path = state_dir.join(FILE);
    if !path.exists() {
        return Ok(None);
    }
    let layer = FileConfig::load(&path)?;
    let state = FileConfig {
        state_dir: Some(state_dir.to_owned()),
        ..FileConfig::default()
    };
    layer.overridden_by(state).resolve().map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_as_the_same_etcd_settings_and_goes_with_the_embedded_store() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let config = FileConfig {
            state_dir: Some(dir.path().to_owned()),
            etcd_endpoints: Some(vec!["https://127.0.0.1:2379".into()]),
            etcd_ca: Some(ca.clone()),
            etcd_prefix: Some("/other/v1/".into()),
            etcd_max_txn_ops: Some(64),
            ..FileConfig::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(recorded(dir.path()).unwrap(), None);
        record(&config).unwrap();
        let back = recorded(dir.path()).unwrap().expect("a record");
        assert_eq!(back.etcd_endpoints, config.etcd_endpoints);
        assert_eq!(back.etcd_ca, Some(ca));
        assert_eq!(back.etcd_prefix, "/other/v1/");
        assert_eq!(back.etcd_max_txn_ops, 64);
        assert_eq!(back.state_dir, dir.path());
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join(FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);

        let embedded = Config {
            etcd_endpoints: Vec::new(),
            ..config
        };
        record(&embedded).unwrap();
        assert_eq!(recorded(dir.path()).unwrap(), None);
    }
}
