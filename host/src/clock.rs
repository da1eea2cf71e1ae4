//! The source of "now": every timestamp ferry writes comes from an injected [`Clock`], so tests
//! can freeze and advance time instead of sleeping.

use std::fmt::Debug;
use std::sync::Mutex;

use chrono::{DateTime, Duration, DurationRound, Utc};

/// Where ferry reads the current time. SQL never calls `now()` for values ferry compares later;
/// it receives this clock's reading as a parameter.
pub trait Clock: Debug + Send + Sync {
    /// The current time, truncated to whole milliseconds (the precision both stores keep).
    fn now(&self) -> DateTime<Utc>;
}

/// The real wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        truncate_ms(Utc::now())
    }
}

/// A clock that only moves when told to; for tests.
#[derive(Debug)]
pub struct ManualClock {
    now: Mutex<DateTime<Utc>>,
}

impl ManualClock {
    /// A clock stopped at `start` (truncated to milliseconds).
    pub fn new(start: DateTime<Utc>) -> Self {
        Self { now: Mutex::new(truncate_ms(start)) }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: std::time::Duration) {
        let by = Duration::from_std(by).expect("advance fits in a chrono duration");
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        *now += by;
    }

    /// Sets the clock to `at`.
    pub fn set(&self, at: DateTime<Utc>) {
        *self.now.lock().unwrap_or_else(|e| e.into_inner()) = truncate_ms(at);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `at + d`, saturating at the latest representable time instead of overflowing (a configured
/// duration of years must not panic the relay).
pub fn later(at: DateTime<Utc>, d: std::time::Duration) -> DateTime<Utc> {
    Duration::from_std(d).ok().and_then(|d| at.checked_add_signed(d)).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `at - d`, saturating at the earliest representable time.
pub fn earlier(at: DateTime<Utc>, d: std::time::Duration) -> DateTime<Utc> {
    Duration::from_std(d).ok().and_then(|d| at.checked_sub_signed(d)).unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// Drops sub-millisecond precision so values round-trip through SQLite (integer milliseconds) and
/// PostgreSQL (microseconds) unchanged.
pub fn truncate_ms(t: DateTime<Utc>) -> DateTime<Utc> {
    t.duration_trunc(Duration::milliseconds(1)).unwrap_or(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let start = DateTime::parse_from_rfc3339("2026-01-01T00:00:00.123456Z").unwrap().to_utc();
        let clock = ManualClock::new(start);
        assert_eq!(clock.now().timestamp_micros() % 1000, 0, "truncated to milliseconds");
        let before = clock.now();
        clock.advance(std::time::Duration::from_secs(90));
        assert_eq!(clock.now() - before, Duration::seconds(90));
    }

    #[test]
    fn arithmetic_saturates() {
        let now = Utc::now();
        assert_eq!(later(now, std::time::Duration::MAX), DateTime::<Utc>::MAX_UTC);
        assert_eq!(earlier(now, std::time::Duration::MAX), DateTime::<Utc>::MIN_UTC);
        assert_eq!(later(now, std::time::Duration::from_secs(1)) - now, Duration::seconds(1));
    }
}
