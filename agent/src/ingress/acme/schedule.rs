//! When to ask the ACME server next: a certificate is renewed `renew_before` ahead
//! of its expiry (at most half its lifetime ahead, so a short-lived certificate is
//! not renewed the moment it arrives), and failures wait exponentially longer.

use std::time::Duration;

/// The longest wait between attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(3600);

/// The Unix second at which a certificate valid from `not_before` to `not_after`
/// is due for renewal.
pub fn renew_at(not_before: i64, not_after: i64, renew_before: Duration) -> i64 {
    let lifetime = not_after.saturating_sub(not_before).max(0);
    let ahead = i64::try_from(renew_before.as_secs())
        .unwrap_or(i64::MAX)
        .min(lifetime / 2);
    not_after.saturating_sub(ahead)
}

/// The wait after the `failures`-th failure in a row (1 for the first): `first`,
/// doubling with each further failure.
pub fn backoff(first: Duration, failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    first.saturating_mul(1 << doublings).min(MAX_BACKOFF)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: i64 = 86_400;

    #[test]
    fn renewal_is_due_ahead_of_expiry_at_most_half_the_lifetime() {
        let thirty_days = Duration::from_secs(30 * 86_400);
        // A 90-day certificate: 30 days ahead.
        assert_eq!(renew_at(0, 90 * DAY, thirty_days), 60 * DAY);
        // A 6-day certificate: half its lifetime ahead, not at once.
        assert_eq!(renew_at(0, 6 * DAY, thirty_days), 3 * DAY);
        // Dates the wrong way round: due at expiry.
        assert_eq!(renew_at(10, 5, thirty_days), 5);
    }

    #[test]
    fn failures_back_off_exponentially_up_to_a_bound() {
        let first = Duration::from_secs(60);
        assert_eq!(backoff(first, 1), first);
        assert_eq!(backoff(first, 2), first * 2);
        assert_eq!(backoff(first, 3), first * 4);
        assert_eq!(backoff(first, 40), MAX_BACKOFF);
        assert!((1..40).all(|n| backoff(first, n) <= backoff(first, n + 1)));
    }
}
