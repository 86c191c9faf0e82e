use super::Tally;

#[test]
fn tally_sums_libtest_summaries() {
    let mut t = Tally::default();
    t.add_line("test result: ok. 83 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1.61s");
    t.add_line("test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out");
    t.add_line("running 3 tests");
    assert_eq!((t.passed, t.failed), (84, 2));
}
