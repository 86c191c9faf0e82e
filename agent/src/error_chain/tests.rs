use super::*;

#[derive(Debug, thiserror::Error)]
#[error("bind 127.0.0.1:53")]
struct Outer(#[source] std::io::Error);

#[test]
fn every_cause_follows_on_one_line() {
    let error = Outer(std::io::Error::new(std::io::ErrorKind::AddrInUse, "in use"));
    assert_eq!(error_chain(&error), "bind 127.0.0.1:53: in use");
}
