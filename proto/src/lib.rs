//! Protobuf messages and gRPC services of the agent, generated from `proto/` at build
//! time by protox and tonic-prost-build (no system `protoc` needed).

/// `rune.v1`: the agent's local API (served on `<state-dir>/agent.sock`).
pub mod v1 {
    #![allow(clippy::all, unused_qualifications, missing_docs)]
    tonic::include_proto!("rune.v1");
}
