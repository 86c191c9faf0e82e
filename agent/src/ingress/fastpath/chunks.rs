//! Where a chunked body ends (RFC 9112 §7.1): the fast path relays chunked bodies
//! as they came and only needs to find their last chunk and trailers.

/// A chunked body's framing, followed byte by byte.
#[derive(Debug)]
pub struct Chunks {
    state: State,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// In a chunk-size line's hex digits (so many so far).
    Size {
        value: u64,
        digits: u32,
    },
    /// After the size, in whitespace before an extension or the line's end.
    SizeSpace {
        value: u64,
    },
    /// In a chunk extension, to the end of the line.
    Extension {
        value: u64,
    },
    /// After the chunk-size line's CR.
    SizeLf {
        value: u64,
    },
    /// In a chunk's data, so many bytes left.
    Data(u64),
    /// After a chunk's data, before its CR.
    DataCr,
    /// After a chunk's data and CR.
    DataLf,
    /// At the start of a trailer line (or the final empty line).
    TrailerStart,
    /// In a trailer field's name.
    TrailerName,
    /// In a trailer field's value.
    TrailerValue,
    /// After a trailer line's CR.
    TrailerLf,
    /// After the final empty line's CR.
    FinalLf,
    Done,
}

/// A byte of a field value or extension: visible, space, tab or obs-text.
fn text(b: u8) -> bool {
    b == b'\t' || (b' '..0x7f).contains(&b) || b >= 0x80
}

/// A byte of a token (RFC 9110 §5.6.2), as field names are.
fn tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// The body is not validly chunked.
#[derive(Debug, PartialEq, Eq)]
pub struct Malformed;

impl Chunks {
    /// At the start of a chunked body.
    pub fn new() -> Chunks {
        Chunks {
            state: State::Size {
                value: 0,
                digits: 0,
            },
        }
    }

    /// Whether the body has ended (last chunk and trailers seen).
    pub fn done(&self) -> bool {
        self.state == State::Done
    }

    /// Follows `bytes`: how many of them belong to the body (all, unless it ends
    /// inside them).
    pub fn advance(&mut self, bytes: &[u8]) -> Result<usize, Malformed> {
        let mut i = 0;
        while i < bytes.len() {
            if let State::Data(left) = self.state {
                let take = left.min((bytes.len() - i) as u64);
                i += take as usize;
                self.state = match left - take {
                    0 => State::DataCr,
                    rest => State::Data(rest),
                };
                continue;
            }
            if self.state == State::Done {
                break;
            }
            self.state = self.step(bytes[i])?;
            i += 1;
        }
        Ok(i)
    }

    /// The state after `b`: strict CRLF line ends, whitespace only before an
    /// extension, field-shaped trailers (the bytes reach the client as they came).
    fn step(&self, b: u8) -> Result<State, Malformed> {
        Ok(match (self.state, b) {
            (State::Size { value, digits }, _) if b.is_ascii_hexdigit() => {
                if digits >= 15 {
                    return Err(Malformed);
                }
                let digit = u64::from(char::from(b).to_digit(16).unwrap_or(0));
                State::Size {
                    value: value * 16 + digit,
                    digits: digits + 1,
                }
            }
            (State::Size { digits: 0, .. }, _) => return Err(Malformed),
            (State::Size { value, .. } | State::SizeSpace { value }, b' ' | b'\t') => {
                State::SizeSpace { value }
            }
            (State::Size { value, .. } | State::SizeSpace { value }, b';') => {
                State::Extension { value }
            }
            (
                State::Size { value, .. } | State::SizeSpace { value } | State::Extension { value },
                b'\r',
            ) => State::SizeLf { value },
            (State::Extension { value }, _) if text(b) => State::Extension { value },
            (State::SizeLf { value: 0 }, b'\n') => State::TrailerStart,
            (State::SizeLf { value }, b'\n') => State::Data(value),
            (State::DataCr, b'\r') => State::DataLf,
            (State::DataLf, b'\n') => State::Size {
                value: 0,
                digits: 0,
            },
            (State::TrailerStart, b'\r') => State::FinalLf,
            (State::FinalLf, b'\n') => State::Done,
            (State::TrailerStart | State::TrailerName, _) if tchar(b) => State::TrailerName,
            (State::TrailerName, b':') => State::TrailerValue,
            (State::TrailerValue, b'\r') => State::TrailerLf,
            (State::TrailerValue, _) if text(b) => State::TrailerValue,
            (State::TrailerLf, b'\n') => State::TrailerStart,
            _ => return Err(Malformed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `body` in pieces of `step` bytes: the bytes taken and whether it ended.
    fn feed(body: &[u8], step: usize) -> Result<(usize, bool), Malformed> {
        let mut chunks = Chunks::new();
        let mut taken = 0;
        for piece in body.chunks(step) {
            taken += chunks.advance(piece)?;
            if chunks.done() {
                break;
            }
        }
        Ok((taken, chunks.done()))
    }

    #[test]
    fn the_end_is_found_in_any_split_and_nothing_after_it_is_taken() {
        let body =
            b"5;x=y\r\nhello\r\n10\r\n0123456789abcdef\r\n0\r\nx-trailer: 1\r\n\r\nGET /next";
        let end = body.len() - b"GET /next".len();
        for step in 1..body.len() {
            assert_eq!(feed(body, step), Ok((end, true)), "pieces of {step}");
        }
    }

    #[test]
    fn an_unfinished_body_is_not_done() {
        assert_eq!(feed(b"5\r\nhel", 2), Ok((6, false)));
        assert_eq!(feed(b"0\r\nx: 1\r\n", 3), Ok((9, false)));
    }

    #[test]
    fn malformed_framing_is_refused() {
        for bad in [
            &b"\r\n"[..],
            b"zz\r\n",
            b"2\r\nokX\r\n",
            b"1234567890123456\r\n",
            b"0\rx",
        ] {
            assert_eq!(feed(bad, 64), Err(Malformed), "{bad:?}");
        }
    }
}
