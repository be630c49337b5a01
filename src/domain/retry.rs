//! The retry policy for model requests, in one place: which failures are
//! transient, and how long to wait before the next attempt.

use std::time::Duration;

/// `agents.retry`: `max_attempts` counts the first call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub max_attempts: u32,
    pub initial_delay: Duration,
    pub max_delay: Duration,
}

/// Whether an HTTP status from a provider is worth another attempt: request
/// timeout, conflict, rate limit, server errors (529 "overloaded"
/// included). Other client errors fail at once.
pub fn retryable_status(status: u16) -> bool {
    matches!(status, 408 | 409 | 429) || (500..=599).contains(&status)
}

impl RetryPolicy {
    /// Attempts without end: waits from `initial_delay`, doubling up to
    /// `max_delay` (for what is tried again while a service is away).
    pub const fn unbounded(initial_delay: Duration, max_delay: Duration) -> RetryPolicy {
        RetryPolicy {
            max_attempts: u32::MAX,
            initial_delay,
            max_delay,
        }
    }

    /// Whether attempt number `failed` (1-based) may be followed by another.
    pub fn allows_another(&self, failed: u32) -> bool {
        failed < self.max_attempts
    }

    /// The wait after attempt `failed` (1-based): exponential backoff from
    /// `initial_delay`, capped at `max_delay`, with "equal jitter" (half the
    /// backoff fixed, half drawn by `jitter` in 0..1), and never sooner than
    /// the provider's `retry_after`.
    pub fn delay(&self, failed: u32, retry_after: Option<Duration>, jitter: f64) -> Duration {
        let exponent = failed.saturating_sub(1).min(30);
        let backoff = self
            .initial_delay
            .saturating_mul(1u32 << exponent)
            .min(self.max_delay);
        let half = backoff / 2;
        let jittered = half + half.mul_f64(jitter.clamp(0.0, 1.0));
        match retry_after {
            Some(floor) => jittered.max(floor),
            None => jittered,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 5,
            initial_delay: Duration::from_millis(500),
            max_delay: Duration::from_millis(8000),
        }
    }

    #[test]
    fn transient_statuses_are_retried_and_others_are_not() {
        for status in [408, 409, 429, 500, 502, 503, 504, 529] {
            assert!(retryable_status(status), "{status}");
        }
        for status in [200, 400, 401, 403, 404, 413, 422] {
            assert!(!retryable_status(status), "{status}");
        }
    }

    #[test]
    fn the_budget_counts_the_first_call() {
        let p = policy();
        assert!(p.allows_another(4));
        assert!(!p.allows_another(5));
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_honours_retry_after() {
        let p = policy();
        assert_eq!(p.delay(1, None, 1.0), Duration::from_millis(500));
        assert_eq!(p.delay(2, None, 1.0), Duration::from_millis(1000));
        assert_eq!(p.delay(3, None, 0.0), Duration::from_millis(1000));
        assert_eq!(p.delay(10, None, 1.0), Duration::from_millis(8000));
        assert_eq!(
            p.delay(1, Some(Duration::from_secs(3)), 1.0),
            Duration::from_secs(3)
        );
        assert_eq!(
            p.delay(4, Some(Duration::from_millis(10)), 1.0),
            Duration::from_millis(4000)
        );
    }

    #[test]
    fn jitter_spreads_delays_within_their_bounds() {
        let p = policy();
        let draws: Vec<Duration> = (0..2000)
            .map(|_| p.delay(3, None, fastrand::f64()))
            .collect();
        let (low, high) = (Duration::from_millis(1000), Duration::from_millis(2000));
        assert!(draws.iter().all(|d| *d >= low && *d <= high));
        let distinct: std::collections::HashSet<_> = draws.iter().map(|d| d.as_millis()).collect();
        assert!(
            distinct.len() > 200,
            "spread: {} distinct values",
            distinct.len()
        );
        let below = draws
            .iter()
            .filter(|d| **d < Duration::from_millis(1500))
            .count();
        assert!(
            (600..1400).contains(&below),
            "{below} of 2000 in the lower half"
        );
    }
}
