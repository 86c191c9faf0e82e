use super::*;

#[test]
fn the_store_time_is_read_from_its_debug_line() {
    let colored = "\u{1b}[2m2026\u{1b}[0m DEBUG store apply \u{1b}[3mobjects\u{1b}[0m\u{1b}[2m=\u{1b}[0m1 \u{1b}[3melapsed_us\u{1b}[0m\u{1b}[2m=\u{1b}[0m2775\n";
    assert_eq!(store_time(colored), Some(Duration::from_micros(2775)));
    let plain = "DEBUG rune_agent::orderedlog::embedded: store apply objects=1 elapsed_us=12";
    assert_eq!(store_time(plain), Some(Duration::from_micros(12)));
    assert_eq!(store_time("nothing"), None);
}
