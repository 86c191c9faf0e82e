//! The gRPC status of each store error ([`log_status`]): the CLI prints the
//! message, and a client can tell a store away from a refusal by the code.

use crate::orderedlog::LogError;
use tonic::Status;

/// A store error as the gRPC status the CLI prints: the code says what kind of
/// failure (the store away, a refusal, a write too large, writers in conflict), the
/// message is the error's own, never the transport's.
pub(super) fn log_status(e: LogError) -> Status {
    let message = e.to_string();
    match e {
        LogError::Unavailable { .. } | LogError::Closed | LogError::Locked { .. } => {
            Status::unavailable(message)
        }
        LogError::Refused { .. } => Status::failed_precondition(message),
        LogError::TooLarge { .. } => Status::resource_exhausted(message),
        LogError::Conflict { .. } => Status::aborted(message),
        LogError::Compacted { .. } | LogError::FutureRevision { .. } => {
            Status::out_of_range(message)
        }
        LogError::Corrupt { .. } | LogError::Storage { .. } => Status::internal(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn each_store_error_has_its_code_and_keeps_its_message() {
        let endpoints = "http://127.0.0.1:2379".to_owned();
        for (error, code) in [
            (
                LogError::Unavailable {
                    endpoints: endpoints.clone(),
                    message: "connection refused".into(),
                },
                Code::Unavailable,
            ),
            (
                LogError::Refused {
                    endpoints: endpoints.clone(),
                    message: "permission denied".into(),
                },
                Code::FailedPrecondition,
            ),
            (
                LogError::Conflict {
                    key: "/rune/v1/service/default/web".into(),
                    attempts: 16,
                },
                Code::Aborted,
            ),
            (
                LogError::Compacted {
                    requested: 3,
                    oldest: 9,
                },
                Code::OutOfRange,
            ),
            (
                LogError::TooLarge {
                    what: "the apply of 70 objects".into(),
                    needed: 140,
                    allowed: 128,
                    unit: "operations",
                    setting: "--max-txn-ops",
                },
                Code::ResourceExhausted,
            ),
            (LogError::Closed, Code::Unavailable),
        ] {
            let message = error.to_string();
            let status = log_status(error);
            assert_eq!(status.code(), code, "{message}");
            assert_eq!(status.message(), message);
        }
    }
}
