//! The per-route circuit breaker: its state, and the pure rules that move it. The state itself is
//! a row per route in `ferry_breakers`, shared by every instance; the store applies the changes
//! these rules ask for with single conditional statements, so instances never race.
//!
//! Closed → open after `threshold` consecutive transient failures → half-open once the cooldown
//! has passed, when exactly one instance wins the probe and delivers one event → closed on
//! success, open again on failure. An operator may open a breaker by hand; it then stays open,
//! without probes, until closed by hand.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::event::{Disposition, FailureReason};
use crate::store::codec::{Count, DbTime, MaybeTime};

/// Where a breaker stands at a given time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BreakerState {
    /// Events are claimed and delivered.
    Closed,
    /// Events wait; nothing is delivered.
    Open,
    /// Open and cooled down: one probe delivery may go through.
    HalfOpen,
}

impl BreakerState {
    /// `closed`, `open` or `half-open`.
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half-open",
        }
    }

    /// The value of the `ferry_breaker_state` gauge: 0 closed, 1 open, 2 half-open.
    pub fn gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
        }
    }
}

impl fmt::Display for BreakerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A route's circuit breaker, as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, sqlx::FromRow)]
pub struct Breaker {
    pub route: String,
    /// Transient failures since the last success.
    #[sqlx(try_from = "Count")]
    pub consecutive_failures: u32,
    /// When the breaker opened; `None` while it is closed.
    #[sqlx(try_from = "MaybeTime")]
    pub opened_at: Option<DateTime<Utc>>,
    /// Why it opened: the last failure, or the operator's words.
    pub reason: Option<String>,
    /// Opened by an operator: stays open, without probes, until closed by hand.
    pub manual: bool,
    /// While half-open: the probe delivery in flight holds the route until then.
    #[sqlx(try_from = "MaybeTime")]
    pub probe_until: Option<DateTime<Utc>>,
    #[sqlx(try_from = "DbTime")]
    pub updated_at: DateTime<Utc>,
}

impl Breaker {
    /// A closed breaker with no history, for routes without a row.
    pub fn closed(route: &str, now: DateTime<Utc>) -> Breaker {
        Breaker {
            route: route.to_string(),
            consecutive_failures: 0,
            opened_at: None,
            reason: None,
            manual: false,
            probe_until: None,
            updated_at: now,
        }
    }

    /// Whether the route's events are held back (open or half-open).
    pub fn is_open(&self) -> bool {
        self.opened_at.is_some()
    }

    /// The state at `now`: half-open once an automatically opened breaker has cooled down.
    pub fn state(&self, now: DateTime<Utc>, cooldown: Duration) -> BreakerState {
        match self.opened_at {
            None => BreakerState::Closed,
            Some(at) if !self.manual && crate::clock::later(at, cooldown) <= now => BreakerState::HalfOpen,
            Some(_) => BreakerState::Open,
        }
    }

    /// Whether a probe may be taken at `now`: half-open, and no probe holds the route.
    pub fn probe_due(&self, now: DateTime<Utc>, cooldown: Duration) -> bool {
        self.state(now, cooldown) == BreakerState::HalfOpen && self.probe_until.is_none_or(|until| until <= now)
    }
}

/// What one batch's outcomes said about a route's endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    pub successes: u32,
    /// Transient failures, and events given up on after them or after plugin faults.
    pub failures: u32,
    /// The error of the last failure counted.
    pub last_error: String,
    /// Deliveries the plugin deferred: they neither count nor reset the breaker.
    pub deferrals: u32,
}

impl Tally {
    /// Counts one outcome. Permanent failures (and events that never reached a plugin) say
    /// nothing about the endpoint and are left out; so are deferrals (the receiver is up and
    /// asked to wait), which neither count as failures nor reset the count.
    pub fn add(&mut self, disposition: &Disposition) {
        match disposition {
            Disposition::Sent => self.successes += 1,
            Disposition::Retry { error, .. }
            | Disposition::Failed { reason: FailureReason::AttemptsExhausted | FailureReason::PluginFault, error } => {
                self.failures += 1;
                self.last_error.clone_from(error);
            }
            Disposition::Deferred { .. } => self.deferrals += 1,
            Disposition::Failed { .. } => {}
        }
    }
}

/// What to do with a route's breaker after a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing to record.
    Keep,
    /// The route delivered: reset the count and close the breaker (unless opened by hand).
    Reset,
    /// Add `failures` to the count, opening the breaker with `reason` at the threshold.
    Count { failures: u32, reason: String },
    /// This instance held the probe but learned nothing (no event, or only permanent failures):
    /// give it back so the next cycle probes again.
    ReleaseProbe,
}

/// The verdict for one route: `before` is its breaker as read at the start of the cycle, `tally`
/// what the batch said, `probed` whether this cycle held its probe. With `threshold` 0 breakers
/// never open by themselves, but a failed probe still reopens one an operator had closed.
pub fn verdict(before: Option<&Breaker>, tally: &Tally, threshold: u32, probed: bool) -> Verdict {
    if tally.successes > 0 {
        return match before {
            Some(b) if b.consecutive_failures > 0 || b.is_open() => Verdict::Reset,
            _ => Verdict::Keep,
        };
    }
    if tally.failures > 0 && (threshold > 0 || probed) {
        return Verdict::Count { failures: tally.failures, reason: format!("last failure: {}", tally.last_error) };
    }
    // A probe that was deferred is given back too; the instance that made it leaves the route
    // alone until the deferral is due (the relay's route wait), so it does not probe again at once.
    if probed { Verdict::ReleaseProbe } else { Verdict::Keep }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + s, 0).unwrap()
    }

    fn breaker(opened: Option<i64>, manual: bool, probe_until: Option<i64>, failures: u32) -> Breaker {
        Breaker {
            opened_at: opened.map(t),
            manual,
            probe_until: probe_until.map(t),
            consecutive_failures: failures,
            ..Breaker::closed("r", t(0))
        }
    }

    #[test]
    fn state_at_a_time() {
        let cooldown = Duration::from_secs(60);
        let cases = [
            // (opened at, manual, now, state)
            (None, false, 0, BreakerState::Closed),
            (Some(0), false, 59, BreakerState::Open),
            (Some(0), false, 60, BreakerState::HalfOpen),
            (Some(0), true, 10_000, BreakerState::Open),
        ];
        for (opened, manual, now, state) in cases {
            assert_eq!(breaker(opened, manual, None, 0).state(t(now), cooldown), state, "{opened:?} {manual} {now}");
        }
        let forever = breaker(Some(0), false, None, 0);
        assert_eq!(forever.state(t(1), Duration::MAX), BreakerState::Open, "an endless cooldown does not overflow");
    }

    #[test]
    fn probe_due_only_when_half_open_and_unheld() {
        let cooldown = Duration::from_secs(60);
        let cases = [
            // (opened at, manual, probe until, now, due)
            (None, false, None, 100, false),
            (Some(0), false, None, 30, false),
            (Some(0), false, None, 60, true),
            (Some(0), false, Some(90), 80, false),
            (Some(0), false, Some(90), 90, true),
            (Some(0), true, None, 1000, false),
        ];
        for (opened, manual, until, now, due) in cases {
            assert_eq!(
                breaker(opened, manual, until, 0).probe_due(t(now), cooldown),
                due,
                "{opened:?} {until:?} {now}"
            );
        }
    }

    #[test]
    fn tally_counts_what_speaks_of_the_endpoint() {
        let mut tally = Tally::default();
        let failed = |reason| Disposition::Failed { reason, error: format!("{reason}") };
        tally.add(&Disposition::Sent);
        tally.add(&Disposition::Retry { at: t(0), error: "503".into() });
        tally.add(&failed(FailureReason::Permanent));
        tally.add(&failed(FailureReason::NoTransport));
        tally.add(&failed(FailureReason::InvalidEvent));
        tally.add(&failed(FailureReason::PluginFault));
        tally.add(&Disposition::Deferred { at: t(0), error: "429".into() });
        assert_eq!(tally, Tally { successes: 1, failures: 2, last_error: "plugin_fault".into(), deferrals: 1 });
    }

    #[test]
    fn verdicts() {
        let tally = |successes, failures| Tally { successes, failures, last_error: "boom".into(), deferrals: 0 };
        let deferred = Tally { deferrals: 1, ..tally(0, 0) };
        let closed = breaker(None, false, None, 0);
        let failing = breaker(None, false, None, 2);
        let open = breaker(Some(0), false, None, 5);
        let count = |failures| Verdict::Count { failures, reason: "last failure: boom".into() };
        let cases = [
            // (before, tally, threshold, probed, verdict)
            (None, tally(3, 0), 5, false, Verdict::Keep),
            (Some(&closed), tally(1, 1), 5, false, Verdict::Keep),
            (Some(&failing), tally(1, 0), 5, false, Verdict::Reset),
            (Some(&open), tally(1, 0), 5, true, Verdict::Reset),
            (None, tally(0, 2), 5, false, count(2)),
            (None, tally(0, 2), 0, false, Verdict::Keep),
            (Some(&open), tally(0, 1), 0, true, count(1)),
            (Some(&open), tally(0, 0), 5, true, Verdict::ReleaseProbe),
            (Some(&open), deferred.clone(), 5, true, Verdict::ReleaseProbe),
            (Some(&failing), deferred.clone(), 5, false, Verdict::Keep),
            (None, tally(0, 0), 5, false, Verdict::Keep),
        ];
        for (before, tally, threshold, probed, expected) in cases {
            assert_eq!(
                verdict(before, &tally, threshold, probed),
                expected,
                "{before:?} {tally:?} {threshold} {probed}"
            );
        }
    }
}
