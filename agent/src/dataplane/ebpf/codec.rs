//! The map encodings that take the agent's own model types, which
//! `agent_common::codec` (where every other key and value conversion lives) cannot
//! name.

use crate::model::Protocol;
use agent_common::lb;

/// The IP protocol number of `protocol`, as the maps store it.
#[must_use]
pub fn proto_number(protocol: Protocol) -> u8 {
    match protocol {
        Protocol::Tcp => lb::PROTO_TCP,
        Protocol::Udp => lb::PROTO_UDP,
    }
}
