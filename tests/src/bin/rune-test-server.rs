//! A tiny TCP backend for end-to-end tests, run as a child process (a backend a
//! user would start on a laptop, one process per port):
//!
//! ```text
//! rune-test-server ADDR
//! ```
//!
//! Listens on ADDR, prints `listening ADDR` on stdout once bound, and answers each
//! line of every connection with ADDR (a line), so a client tells the processes on
//! one address apart by their ports. Exits when its stdin closes (its test went
//! away); a bind failure exits with status 1 and one line on stderr.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    process::ExitCode,
};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr] = args.as_slice() else {
        eprintln!("usage: rune-test-server ADDR");
        return ExitCode::FAILURE;
    };
    let addr: SocketAddr = match addr.parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("rune-test-server: bad address {addr:?}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let listener = match TcpListener::bind(addr) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("rune-test-server: bind {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("listening {addr}");
    // The test holds our stdin: its end is ours.
    std::thread::spawn(|| {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        std::process::exit(0);
    });
    for stream in listener.incoming().flatten() {
        std::thread::spawn(move || serve(stream, addr));
    }
    ExitCode::SUCCESS
}

/// Answers each line with `addr` until the client closes.
fn serve(stream: TcpStream, addr: SocketAddr) {
    let Ok(reader) = stream.try_clone() else {
        return;
    };
    let mut writer = stream;
    for line in BufReader::new(reader).lines() {
        if line.is_err() || writeln!(writer, "{addr}").is_err() {
            return;
        }
    }
}
