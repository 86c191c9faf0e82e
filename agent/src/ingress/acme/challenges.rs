//! HTTP-01 challenges in flight: the tokens an order published, which the plain
//! listener answers with their key authorizations (RFC 8555 §8.3) until the order
//! is done.

use crate::lock::lock;
use std::{collections::HashMap, sync::Mutex};

/// The path prefix of HTTP-01 challenges (RFC 8555 §8.3).
pub const CHALLENGE_PATH: &str = "/.well-known/acme-challenge/";

/// Pending HTTP-01 challenges: token → key authorization.
#[derive(Debug, Default)]
pub struct Challenges {
    tokens: Mutex<HashMap<String, String>>,
}

impl Challenges {
    /// The key authorization to answer a request for `path`, when it is the
    /// challenge path of a pending token.
    pub fn answer(&self, path: &str) -> Option<String> {
        let token = path.strip_prefix(CHALLENGE_PATH)?;
        lock(&self.tokens).get(token).cloned()
    }

    /// Publishes tokens until the returned guard drops.
    pub(super) fn publication(&self) -> Publication<'_> {
        Publication {
            challenges: self,
            tokens: Vec::new(),
        }
    }
}

/// Tokens published for one order; withdrawn on drop.
pub(super) struct Publication<'a> {
    challenges: &'a Challenges,
    tokens: Vec<String>,
}

impl Publication<'_> {
    /// Answers `token` with `key_authorization` until this publication drops.
    pub(super) fn add(&mut self, token: &str, key_authorization: &str) {
        lock(&self.challenges.tokens).insert(token.to_owned(), key_authorization.to_owned());
        self.tokens.push(token.to_owned());
    }
}

impl Drop for Publication<'_> {
    fn drop(&mut self) {
        let mut tokens = lock(&self.challenges.tokens);
        for t in &self.tokens {
            tokens.remove(t);
        }
    }
}
