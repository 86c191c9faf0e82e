//! HTTP/1.1 on raw sockets for the ingress wire tests: scripted backends on loopback
//! that record what the proxy forwarded, and a client that reads whole responses
//! (Content-Length, chunked or close-delimited) so the tests see the bytes exactly.

use std::{
    io::{ErrorKind, Read, Write},
    net::TcpStream,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

pub mod backend;

pub use backend::{Received, Reply, ScriptedBackend, Then, ok, scripted};

/// How long a client waits for any one read before the test fails.
pub const CLIENT_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Header or trailer fields: `(name, value)` pairs in order, values trimmed.
pub type Fields = Vec<(String, String)>;

/// A message head: the start line and the header fields in order.
#[derive(Clone, Debug, Default)]
pub struct Head {
    /// The request or status line.
    pub start: String,
    /// The header fields.
    pub headers: Fields,
}

impl Head {
    /// Parses `text` (without the blank line).
    fn parse(text: &str) -> Head {
        let mut lines = text.split("\r\n");
        let start = lines.next().unwrap_or_default().to_owned();
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
            .collect();
        Head { start, headers }
    }

    /// The first value of `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.all(name).into_iter().next()
    }

    /// Every value of `name` (case-insensitive), in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// Whether a comma-separated header `name` lists `token` (case-insensitive).
    fn lists(&self, name: &str, token: &str) -> bool {
        self.all(name)
            .iter()
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    }
}

/// A socket with the bytes read from it but not yet consumed.
pub struct Wire {
    stream: TcpStream,
    buf: Vec<u8>,
    /// Backends retry timed-out reads until this is set; clients fail on them.
    stop: Option<Arc<AtomicBool>>,
}

impl Wire {
    /// A client connection to the ingress on loopback `port`.
    pub fn connect(port: u16) -> Wire {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect to the ingress");
        stream.set_read_timeout(Some(CLIENT_READ_TIMEOUT)).unwrap();
        stream.set_nodelay(true).unwrap();
        Wire {
            stream,
            buf: Vec::new(),
            stop: None,
        }
    }

    /// Writes `bytes` in one write.
    pub fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("write to the socket");
    }

    /// Reads more bytes into the buffer; false at the end of the stream.
    fn fill(&mut self) -> std::io::Result<bool> {
        let mut chunk = [0u8; 65536];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(true);
                }
                Err(e)
                    if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
                        && self
                            .stop
                            .as_ref()
                            .is_some_and(|s| !s.load(Ordering::SeqCst)) =>
                {
                    continue;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The next head; `None` when the stream ends before its first byte.
    pub fn head(&mut self) -> std::io::Result<Option<Head>> {
        loop {
            if let Some(end) = self.buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let text = String::from_utf8_lossy(&self.buf[..end]).into_owned();
                self.buf.drain(..end + 4);
                return Ok(Some(Head::parse(&text)));
            }
            if !self.fill()? {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(eof(&format!("in a head after {:?}", self.text())));
            }
        }
    }

    /// The buffered bytes as text (for messages).
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.buf).into_owned()
    }

    /// Exactly `n` bytes.
    fn take(&mut self, n: usize) -> std::io::Result<Vec<u8>> {
        while self.buf.len() < n {
            if !self.fill()? {
                return Err(eof(&format!("{} of {n} bytes", self.buf.len())));
            }
        }
        Ok(self.buf.drain(..n).collect())
    }

    /// One CRLF-terminated line, without the CRLF.
    fn line(&mut self) -> std::io::Result<String> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.buf[..end]).into_owned();
                self.buf.drain(..end + 2);
                return Ok(line);
            }
            if !self.fill()? {
                return Err(eof("in a line"));
            }
        }
    }

    /// A chunked body, decoded, and its trailer fields.
    fn chunked(&mut self) -> std::io::Result<(Vec<u8>, Fields)> {
        let mut body = Vec::new();
        loop {
            let line = self.line()?;
            let size = line.split(';').next().unwrap_or_default().trim();
            let size = usize::from_str_radix(size, 16)
                .map_err(|_| std::io::Error::other(format!("bad chunk size line {line:?}")))?;
            if size == 0 {
                break;
            }
            body.extend(self.take(size)?);
            if !self.take(2)?.eq(b"\r\n") {
                return Err(std::io::Error::other("no CRLF after a chunk"));
            }
        }
        let mut trailers = Vec::new();
        loop {
            let line = self.line()?;
            if line.is_empty() {
                return Ok((body, trailers));
            }
            if let Some((k, v)) = line.split_once(':') {
                trailers.push((k.trim().to_owned(), v.trim().to_owned()));
            }
        }
    }

    /// Everything until the peer closes.
    fn until_close(&mut self) -> std::io::Result<Vec<u8>> {
        while self.fill()? {}
        Ok(std::mem::take(&mut self.buf))
    }

    /// One whole response to a request (`head_request`: to a HEAD, so without a
    /// body); 1xx interim responses before it are skipped and listed.
    pub fn response(&mut self, head_request: bool) -> std::io::Result<Response> {
        let mut interim = Vec::new();
        loop {
            let head = self.head()?.ok_or_else(|| eof("before a response"))?;
            let status = status(&head.start)
                .ok_or_else(|| std::io::Error::other(format!("bad status {:?}", head.start)))?;
            if (100..200).contains(&status) && status != 101 {
                interim.push(status);
                continue;
            }
            let mut response = Response {
                status,
                head,
                body: Vec::new(),
                trailers: Vec::new(),
                interim,
            };
            let head = &response.head;
            if head_request || matches!(status, 101 | 204 | 304) {
            } else if head.lists("transfer-encoding", "chunked") {
                (response.body, response.trailers) = self.chunked()?;
            } else if let Some(length) = head.header("content-length") {
                let length = length
                    .parse()
                    .map_err(|_| std::io::Error::other(format!("bad length {length:?}")))?;
                response.body = self.take(length)?;
            } else {
                response.body = self.until_close()?;
            }
            return Ok(response);
        }
    }

    /// Sends `GET path` for `host` and reads the response; panics on a failure.
    pub fn get(&mut self, host: &str, path: &str) -> Response {
        self.send(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes());
        self.response(false)
            .unwrap_or_else(|e| panic!("GET {host}{path}: {e}"))
    }

    /// How many bytes (those already read included) come before the peer closes
    /// (end of stream or reset) or `wait` passes.
    pub fn bytes_within(&mut self, wait: Duration) -> usize {
        let deadline = std::time::Instant::now() + wait;
        let mut total = std::mem::take(&mut self.buf).len();
        let mut chunk = [0u8; 65536];
        while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
            self.stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            match self.stream.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => total += n,
            }
        }
        self.stream
            .set_read_timeout(Some(CLIENT_READ_TIMEOUT))
            .unwrap();
        total
    }

    /// Whether the peer closes (end of stream or reset) within `wait`, with no
    /// byte before; panics on a byte.
    pub fn closes_within(&mut self, wait: Duration) -> bool {
        assert!(self.buf.is_empty(), "unread bytes: {:?}", self.text());
        self.stream.set_read_timeout(Some(wait)).unwrap();
        let mut byte = [0u8; 1];
        let closed = match self.stream.read(&mut byte) {
            Ok(0) => true,
            Ok(_) => panic!("a byte where the end was expected: {byte:?}"),
            Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        };
        self.stream
            .set_read_timeout(Some(CLIENT_READ_TIMEOUT))
            .unwrap();
        closed
    }
}

/// The code of a status line `HTTP/1.x NNN reason` (stray bytes before it, such
/// as a body that should not have been sent, make it invalid).
fn status(line: &str) -> Option<u16> {
    let mut parts = line.splitn(3, ' ');
    let version = parts.next()?;
    let code = parts.next()?;
    let valid = matches!(version, "HTTP/1.1" | "HTTP/1.0")
        && code.len() == 3
        && code.bytes().all(|b| b.is_ascii_digit());
    valid.then(|| code.parse().ok()).flatten()
}

/// An unexpected end of stream, with `what` was being read.
fn eof(what: &str) -> std::io::Error {
    std::io::Error::new(ErrorKind::UnexpectedEof, format!("end of stream {what}"))
}

/// A response as the client read it.
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The status line and headers.
    pub head: Head,
    /// The body, decoded when chunked.
    pub body: Vec<u8>,
    /// The trailer fields of a chunked body.
    pub trailers: Fields,
    /// The 1xx statuses read before this response.
    pub interim: Vec<u16>,
}

impl Response {
    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}
