//! Timestamps are milliseconds since the Unix epoch, in UTC, everywhere below
//! the API; the API renders them as RFC 3339 with exactly milliseconds.

use std::sync::{Mutex, OnceLock, PoisonError};

use chrono::{DateTime, SecondsFormat, Utc};
use uuid::{ContextV7, Timestamp, Uuid};

/// Milliseconds since the Unix epoch.
pub type Millis = i64;

/// What this process adds to its clock, in milliseconds:
/// `TETHER_CLOCK_SKEW_MS` (negative for a clock behind), 0 unless set. Tests
/// start processes whose clocks disagree, as several machines' do, to show
/// that nothing depends on them agreeing.
fn skew_ms() -> i64 {
    static SKEW: OnceLock<i64> = OnceLock::new();
    *SKEW.get_or_init(|| {
        std::env::var("TETHER_CLOCK_SKEW_MS")
            .ok()
            .and_then(|ms| ms.trim().parse().ok())
            .unwrap_or(0)
    })
}

/// This process's clock, in milliseconds since the Unix epoch.
pub fn now_millis() -> Millis {
    Utc::now().timestamp_millis() + skew_ms()
}

/// A new id: a UUID v7 from this process's clock, each later than the one
/// before within the process. Across processes ids are unique, but their
/// order is only that of the clocks that made them: order by them only what
/// one process makes.
pub fn new_id() -> Uuid {
    let skew = skew_ms();
    if skew == 0 {
        return Uuid::now_v7();
    }
    static CONTEXT: Mutex<ContextV7> = Mutex::new(ContextV7::new());
    let nanos = Utc::now()
        .timestamp_nanos_opt()
        .unwrap_or_default()
        .saturating_add(skew.saturating_mul(1_000_000))
        .max(0) as u128;
    let context = CONTEXT.lock().unwrap_or_else(PoisonError::into_inner);
    Uuid::new_v7(Timestamp::from_unix(
        &*context,
        (nanos / 1_000_000_000) as u64,
        (nanos % 1_000_000_000) as u32,
    ))
}

/// A duration in seconds (from configuration or input) as milliseconds,
/// saturating instead of overflowing.
pub fn secs_to_millis(secs: u64) -> Millis {
    Millis::try_from(secs)
        .unwrap_or(Millis::MAX)
        .saturating_mul(1000)
}

/// `2026-11-29T13:48:34.123Z`; `None` for a value outside chrono's range.
pub fn to_rfc3339(millis: Millis) -> Option<String> {
    DateTime::<Utc>::from_timestamp_millis(millis)
        .map(|t| t.to_rfc3339_opts(SecondsFormat::Millis, true))
}

/// Parses RFC 3339 with any offset and precision, truncating to milliseconds.
pub fn from_rfc3339(text: &str) -> Option<Millis> {
    DateTime::parse_from_rfc3339(text)
        .ok()
        .map(|t| t.with_timezone(&Utc).timestamp_millis())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_become_milliseconds_without_overflow() {
        assert_eq!(secs_to_millis(86_400), 86_400_000);
        assert_eq!(secs_to_millis(u64::MAX), Millis::MAX);
        assert_eq!(secs_to_millis(i64::MAX as u64 / 1000 + 1), Millis::MAX);
    }

    #[test]
    fn renders_utc_with_exactly_milliseconds() {
        assert_eq!(
            to_rfc3339(1_795_960_114_123).as_deref(),
            Some("2026-11-29T13:48:34.123Z")
        );
        assert_eq!(
            to_rfc3339(1_795_960_114_000).as_deref(),
            Some("2026-11-29T13:48:34.000Z")
        );
    }

    #[test]
    fn parses_offsets_into_utc() {
        assert_eq!(
            from_rfc3339("2026-11-29T14:48:34.123+01:00"),
            Some(1_795_960_114_123)
        );
        assert_eq!(from_rfc3339("yesterday"), None);
    }
}
