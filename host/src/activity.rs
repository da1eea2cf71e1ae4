//! What this instance's relay did minute by minute over the last hour: events delivered, retried
//! and failed, and the percentiles of their commit-to-delivery latency. Kept in memory for the
//! dashboard's charts, so drawing them never reads the outbox table; each instance reports its own
//! deliveries (the outbox's shared state is in `/v1/stats`).

use std::collections::VecDeque;
use std::sync::Mutex;

use chrono::{DateTime, TimeZone, Utc};
use serde::{Deserialize, Serialize};

/// Minutes kept.
pub const MINUTES: usize = 60;

/// Latency buckets: bucket `i` holds latencies up to `FIRST_BOUND_MS · GROWTH^i`; the last one
/// everything longer. From a quarter of a millisecond to about 30 hours in 91 buckets of 25% each,
/// so a percentile read from them is within 12% of the true value (one beyond 30 hours reads as 30
/// hours).
const BUCKETS: usize = 91;
const FIRST_BOUND_MS: f64 = 0.25;
const GROWTH: f64 = 1.25;

#[derive(Debug, Clone)]
struct Minute {
    /// Minutes since the Unix epoch.
    index: i64,
    delivered: u64,
    retried: u64,
    failed: u64,
    latency: [u32; BUCKETS],
}

impl Minute {
    fn new(index: i64) -> Minute {
        Minute { index, delivered: 0, retried: 0, failed: 0, latency: [0; BUCKETS] }
    }

    /// The latency (ms) under which `q` of this minute's deliveries fell, as the geometric middle
    /// of the bucket it lands in.
    fn percentile(&self, q: f64) -> Option<f64> {
        let total: u64 = self.latency.iter().map(|n| u64::from(*n)).sum();
        if total == 0 {
            return None;
        }
        let rank = (q * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.latency.iter().enumerate() {
            seen += u64::from(*n);
            if seen >= rank {
                let upper = FIRST_BOUND_MS * GROWTH.powi(i as i32);
                let lower = upper / GROWTH;
                return Some(match i {
                    0 => upper,
                    i if i == BUCKETS - 1 => lower,
                    _ => (lower * upper).sqrt(),
                });
            }
        }
        None
    }
}

fn bucket(latency_ms: f64) -> usize {
    if latency_ms.is_nan() || latency_ms <= FIRST_BOUND_MS {
        return 0;
    }
    let i = (latency_ms / FIRST_BOUND_MS).ln() / GROWTH.ln();
    (i.ceil() as usize).min(BUCKETS - 1)
}

/// One minute as the dashboard draws it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MinuteView {
    /// The minute's start.
    pub at: DateTime<Utc>,
    pub delivered: u64,
    pub retried: u64,
    pub failed: u64,
    /// Commit-to-delivery latency percentiles of the minute's deliveries, in milliseconds
    /// (within 12%); null when nothing was delivered.
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// The last hour of this instance's deliveries, oldest minute first, every minute present.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ActivityView {
    pub at: DateTime<Utc>,
    pub minutes: Vec<MinuteView>,
}

/// The per-minute tallies, updated by the relay after every batch.
#[derive(Debug, Default)]
pub struct Activity {
    minutes: Mutex<VecDeque<Minute>>,
}

fn minute_of(at: DateTime<Utc>) -> i64 {
    at.timestamp().div_euclid(60)
}

impl Activity {
    /// Counts one batch's outcomes in the minute of `at`; `latencies_ms` are its deliveries'.
    pub fn record(&self, at: DateTime<Utc>, delivered: u64, retried: u64, failed: u64, latencies_ms: &[f64]) {
        let index = minute_of(at);
        let mut minutes = self.minutes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // A batch finishing a little after a later one (several workers) counts in its own
        // minute. One more than an hour before the newest minute means the clock was set back:
        // start again from it rather than drop everything until the clock catches up.
        if minutes.back().is_some_and(|newest| index <= newest.index - MINUTES as i64) {
            minutes.clear();
        }
        let position = match minutes.iter().rposition(|m| m.index <= index) {
            Some(p) if minutes[p].index == index => p,
            Some(p) => {
                minutes.insert(p + 1, Minute::new(index));
                p + 1
            }
            None => {
                minutes.push_front(Minute::new(index));
                0
            }
        };
        let newest = minutes.back().map_or(index, |m| m.index);
        let minute = &mut minutes[position];
        minute.delivered += delivered;
        minute.retried += retried;
        minute.failed += failed;
        for latency in latencies_ms {
            let slot = &mut minute.latency[bucket(*latency)];
            *slot = slot.saturating_add(1);
        }
        while minutes.front().is_some_and(|m| m.index <= newest - MINUTES as i64) {
            minutes.pop_front();
        }
    }

    /// The [`MINUTES`] minutes up to and including `now`'s.
    pub fn last_hour(&self, now: DateTime<Utc>) -> ActivityView {
        let last = minute_of(now);
        let minutes = self.minutes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let views = (last - MINUTES as i64 + 1..=last)
            .map(|index| {
                let minute = minutes.iter().find(|m| m.index == index).cloned().unwrap_or_else(|| Minute::new(index));
                MinuteView {
                    at: Utc.timestamp_opt(index * 60, 0).single().unwrap_or(DateTime::<Utc>::UNIX_EPOCH),
                    delivered: minute.delivered,
                    retried: minute.retried,
                    failed: minute.failed,
                    p50_ms: minute.percentile(0.50),
                    p95_ms: minute.percentile(0.95),
                    p99_ms: minute.percentile(0.99),
                }
            })
            .collect();
        ActivityView { at: now, minutes: views }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(minute: i64, second: u32) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 / 60 * 60 + minute * 60 + i64::from(second), 0).unwrap()
    }

    #[test]
    fn outcomes_land_in_their_minute_and_an_hour_is_kept() {
        let activity = Activity::default();
        activity.record(at(0, 5), 3, 1, 0, &[2.0, 4.0, 8.0]);
        activity.record(at(0, 59), 1, 0, 2, &[8.0]);
        activity.record(at(2, 0), 5, 0, 0, &[1.0; 5]);
        // Late: its minute (1) is older than the newest but within the hour.
        activity.record(at(1, 30), 1, 0, 0, &[]);
        let view = activity.last_hour(at(2, 10));
        assert_eq!(view.minutes.len(), MINUTES);
        let tail: Vec<(u64, u64, u64)> =
            view.minutes[MINUTES - 3..].iter().map(|m| (m.delivered, m.retried, m.failed)).collect();
        assert_eq!(tail, [(4, 1, 2), (1, 0, 0), (5, 0, 0)]);
        assert_eq!(view.minutes[MINUTES - 1].at, at(2, 0));
        assert!(view.minutes[..MINUTES - 3].iter().all(|m| m.delivered == 0 && m.p50_ms.is_none()));

        // At minute 61 the hour is minutes 2 to 61: minutes 0 and 1 are gone.
        activity.record(at(61, 0), 1, 0, 0, &[1.0]);
        let view = activity.last_hour(at(61, 0));
        assert_eq!(view.minutes.iter().map(|m| m.delivered).sum::<u64>(), 5 + 1);
        assert_eq!(view.minutes[0].at, at(2, 0));

        // The clock set back by two hours: the tallies start again from the new time, instead of
        // ignoring every batch until the clock catches up.
        activity.record(at(-60, 0), 7, 0, 0, &[]);
        let view = activity.last_hour(at(-60, 0));
        assert_eq!(view.minutes.iter().map(|m| m.delivered).sum::<u64>(), 7);
        assert_eq!(activity.minutes.lock().unwrap().len(), 1);
        assert!(activity.minutes.lock().unwrap().len() <= MINUTES);
    }

    #[test]
    fn percentiles_are_within_the_bucket_width() {
        let activity = Activity::default();
        let latencies: Vec<f64> = (1..=1000).map(f64::from).collect();
        activity.record(at(0, 0), 1000, 0, 0, &latencies);
        let minute = activity.last_hour(at(0, 1)).minutes.pop().unwrap();
        for (got, want) in [(minute.p50_ms, 500.0), (minute.p95_ms, 950.0), (minute.p99_ms, 990.0)] {
            let got = got.unwrap();
            assert!((got / want - 1.0).abs() < 0.12, "{got} against {want}");
        }
        assert_eq!(bucket(f64::NAN), 0);
        assert_eq!(bucket(1e12), BUCKETS - 1);
        // Past the last bound, the last bound: about 30 hours.
        let activity = Activity::default();
        activity.record(at(0, 0), 1, 0, 0, &[1e12]);
        let p50 = activity.last_hour(at(0, 0)).minutes.pop().unwrap().p50_ms.unwrap();
        assert!((29.0..31.0).contains(&(p50 / 3_600_000.0)), "{p50}");
    }
}
