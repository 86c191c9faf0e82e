//! An error and its causes as one line of text, the way the agent logs and reports
//! every error it does not return.

use std::error::Error;

/// `error` followed by each of its sources, `outer: inner: innermost`.
pub fn error_chain(error: &dyn Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests;
