use super::*;

/// wrk's report with socket errors and non-2xx answers is read in full.
#[test]
fn parses_wrk_errors() {
    let out = "Running 3s test @ http://198.18.100.11/\n  1 threads and 25 connections\n  100 requests in 3.00s, 15.00KB read\n  Socket errors: connect 0, read 2, write 0, timeout 7\n  Non-2xx or 3xx responses: 3\nRequests/sec:     33.21\nTransfer/sec:      5.00KB\n";
    let run = parse_wrk(out).unwrap();
    assert_eq!(run.rate, 33.21);
    assert_eq!(run.errors.to_string(), "0/2/0/7 +3 non-2xx");
}
