//! Debian's nginx as a child of a test or bench: one process in the foreground,
//! its configuration, pid file, logs and temporary files under one directory.

use std::{
    ffi::OsString,
    fs::File,
    path::Path,
    process::{Command, Stdio},
};

/// Writes `dir/nginx.conf` with `http` (directives and server blocks) inside the
/// `http` block, and returns the arguments that run nginx on it. No access log.
pub fn prepare(dir: &Path, http: &str) -> std::io::Result<Vec<OsString>> {
    std::fs::create_dir_all(dir)?;
    let d = dir.display();
    let config = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\n\
         error_log {d}/error.log warn;\nevents {{ worker_connections 4096; }}\nhttp {{\n\
         access_log off;\nclient_body_temp_path {d}/body;\nproxy_temp_path {d}/proxy;\n\
         fastcgi_temp_path {d}/fastcgi;\nuwsgi_temp_path {d}/uwsgi;\nscgi_temp_path {d}/scgi;\n\
         {http}\n}}\n"
    );
    let conf = dir.join("nginx.conf");
    std::fs::write(&conf, config)?;
    // `-e`: the log before the configuration is read, not the packaged default.
    Ok(vec![
        "-p".into(),
        dir.into(),
        "-c".into(),
        conf.into(),
        "-e".into(),
        dir.join("error.log").into(),
    ])
}

/// `cmd` (an `nginx` command, possibly wrapped to run in a namespace) set up by
/// [`prepare`], stdin and stdout closed, stderr into `dir/stderr.log`.
pub fn configure(cmd: &mut Command, dir: &Path, http: &str) -> std::io::Result<()> {
    let args = prepare(dir, http)?;
    let stderr = File::create(dir.join("stderr.log"))?;
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr);
    Ok(())
}
