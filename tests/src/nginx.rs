//! Debian's nginx as a test backend: a WebDAV file server on loopback (`PUT` stores
//! a file, `GET` returns it), for transfers of tens of MB through the ingress.

use rune_harness::agent::{eventually, free_port};
use std::{
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Command},
    time::Duration,
};
use tempfile::TempDir;

/// nginx serving and storing files under its own temporary directory; stopped
/// when dropped.
pub struct FileServer {
    /// Where it listens (127.0.0.1).
    pub addr: SocketAddr,
    child: Child,
    dir: TempDir,
}

impl FileServer {
    /// Starts nginx (one process, in the foreground) and waits until it accepts
    /// connections. Bodies up to `max_body_mib` MiB are stored.
    pub fn start(max_body_mib: u32) -> FileServer {
        let dir = tempfile::Builder::new()
            .prefix("rune-test-nginx-")
            .tempdir()
            .unwrap();
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()).into();
        let files = dir.path().join("files");
        std::fs::create_dir(&files).unwrap();
        let http = format!(
            "server {{ listen {addr}; root {}; client_max_body_size {max_body_mib}m;\n\
             dav_methods PUT DELETE; create_full_put_path on; }}",
            files.display()
        );
        let mut cmd = Command::new("nginx");
        rune_harness::nginx::configure(&mut cmd, dir.path(), &http).unwrap();
        let child = cmd
            .spawn()
            .expect("start nginx (cargo xtask setup installs it)");
        let server = FileServer { addr, child, dir };
        eventually(Duration::from_secs(10), "nginx accepting", || {
            TcpStream::connect(addr).ok()
        });
        server
    }

    /// The path of a stored file (`name` as in the request path, without `/`).
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join("files").join(name)
    }
}

impl Drop for FileServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
