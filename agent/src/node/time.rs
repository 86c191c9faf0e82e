//! Wall-clock times of the node document, as RFC 3339 UTC strings with whole
//! seconds (`2026-12-02T04:31:23Z`), as Kubernetes writes them: readable in
//! `get node -o yaml` and comparable across nodes.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A point in time, whole seconds since the Unix epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// Now.
    pub fn now() -> Timestamp {
        Timestamp::from(SystemTime::now())
    }

    /// How long ago this was (zero when in the future: clocks differ).
    pub fn age(self) -> Duration {
        let now = Timestamp::now().0;
        Duration::from_secs(now.saturating_sub(self.0))
    }

    /// Parses `YYYY-MM-DDTHH:MM:SSZ`.
    pub fn parse(text: &str) -> Option<Timestamp> {
        let b = text.as_bytes();
        if b.len() != 20 || b[4] != b'-' || b[7] != b'-' || b[10] != b'T' || b[19] != b'Z' {
            return None;
        }
        let num = |r: std::ops::Range<usize>| text.get(r)?.parse::<u64>().ok();
        let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
        let (h, mi, s) = (num(11..13)?, num(14..16)?, num(17..19)?);
        if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
            return None;
        }
        let days = days_from_civil(y as i64, mo as i64, d as i64);
        let secs = days * 86_400 + (h * 3600 + mi * 60 + s) as i64;
        u64::try_from(secs).ok().map(Timestamp)
    }
}

impl From<SystemTime> for Timestamp {
    fn from(t: SystemTime) -> Self {
        Timestamp(t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()))
    }
}

impl std::fmt::Display for Timestamp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let days = (self.0 / 86_400) as i64;
        let rem = self.0 % 86_400;
        let (y, m, d) = civil_from_days(days);
        write!(
            f,
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        )
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Timestamp::parse(&text).ok_or_else(|| {
            serde::de::Error::custom(format!("{text:?} is not a time like 2026-01-31T23:59:59Z"))
        })
    }
}

/// An age as `kubectl` shows it: `42s`, `5m10s`, `3h4m`, `2d5h`.
pub fn format_age(age: Duration) -> String {
    let s = age.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day count since 1970-01-01 (inverse of [`days_from_civil`]).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_format_and_parse_back() {
        assert_eq!(Timestamp(0).to_string(), "1970-01-01T00:00:00Z");
        // 2024-02-29 12:34:56 UTC (a leap day).
        assert_eq!(Timestamp(1_709_210_096).to_string(), "2024-02-29T12:34:56Z");
        for t in [0, 951_782_400, 1_709_210_096, 4_102_444_799] {
            let text = Timestamp(t).to_string();
            assert_eq!(Timestamp::parse(&text), Some(Timestamp(t)), "{text}");
        }
        assert_eq!(Timestamp::parse("2024-13-01T00:00:00Z"), None);
        assert_eq!(Timestamp::parse("2024-01-01 00:00:00"), None);
    }

    #[test]
    fn ages_read_like_kubectl() {
        assert_eq!(format_age(Duration::from_secs(42)), "42s");
        assert_eq!(format_age(Duration::from_secs(310)), "5m10s");
        assert_eq!(format_age(Duration::from_secs(3 * 3600 + 240)), "3h4m");
        assert_eq!(
            format_age(Duration::from_secs(2 * 86_400 + 5 * 3600)),
            "2d5h"
        );
    }
}
