//! The one error type of the model.

use thiserror::Error;

/// Why a document or object was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ModelError {
    /// The text is not YAML/JSON, or a document is not a mapping.
    #[error("document {index}: {message}")]
    Syntax {
        /// 1-based position of the document in its file.
        index: usize,
        /// What the parser said.
        message: String,
    },
    /// A field holds a value the agent cannot carry out.
    #[error("{object}: {field}: {message}")]
    Invalid {
        /// `Kind namespace/name`, or `document N` when the name is unknown.
        object: String,
        /// Path of the field, e.g. `spec.ports[0].port`.
        field: String,
        /// What is wrong, with the offending value.
        message: String,
    },
}

impl ModelError {
    /// An [`ModelError::Invalid`] from its parts.
    pub fn invalid(
        object: impl Into<String>,
        field: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        ModelError::Invalid {
            object: object.into(),
            field: field.into(),
            message: message.into(),
        }
    }
}
