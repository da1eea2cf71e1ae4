//! Retry policy: how long to wait after a failed attempt, and when to give up. Pure functions,
//! so the seeds' tables are reproduced exactly by the unit tests below.

use std::time::Duration;

/// How the base delay grows with the number of failed attempts.
#[derive(Debug, Clone, PartialEq)]
pub enum Backoff {
    /// `initial · 2^(n−1)` after the n-th failed attempt, never more than `max`.
    Exponential { initial: Duration, max: Duration },
    /// The same delay after every failed attempt.
    Fixed { delay: Duration },
    /// The n-th entry after the n-th failed attempt; the last entry repeats if attempts go on.
    Schedule(Vec<Duration>),
}

/// Randomisation applied to the base delay so that events failing together do not retry together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Jitter {
    /// Use the base delay as is.
    None,
    /// Uniform in `delay · (1 ± percent/100)`.
    Symmetric { percent: u32 },
    /// Uniform in `[delay/2, delay]`.
    Equal,
    /// Uniform in `[0, delay]`.
    Full,
}

/// A route's complete retry policy.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    pub backoff: Backoff,
    pub jitter: Jitter,
    /// Total attempts including the first; `0` retries transient failures without limit.
    pub max_attempts: u32,
    /// Upper bound for a transport's retry-after hint, so a receiver cannot park an event for a year.
    pub retry_after_max: Duration,
}

/// What to do after a transient failure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RetryDecision {
    /// Try again after this delay.
    RetryAfter(Duration),
    /// The attempt limit is reached.
    GiveUp,
}

impl Backoff {
    /// The delay after the `failed_attempt`-th attempt failed (1-based), before jitter.
    pub fn base_delay(&self, failed_attempt: u32) -> Duration {
        let n = failed_attempt.max(1);
        match self {
            Backoff::Exponential { initial, max } => {
                // 2^(n-1) saturates long before u32 overflow matters; checked_mul caps at `max`.
                let factor = 1u32.checked_shl(n - 1).unwrap_or(u32::MAX);
                initial.checked_mul(factor).map_or(*max, |d| d.min(*max))
            }
            Backoff::Fixed { delay } => *delay,
            Backoff::Schedule(steps) => {
                let index = (n as usize - 1).min(steps.len().saturating_sub(1));
                steps.get(index).copied().unwrap_or_default()
            }
        }
    }
}

impl Jitter {
    /// Applies the jitter to `delay`, with `unit` a uniform random number in `[0, 1)`.
    pub fn apply(self, delay: Duration, unit: f64) -> Duration {
        let unit = unit.clamp(0.0, 1.0);
        match self {
            Jitter::None => delay,
            Jitter::Symmetric { percent } => {
                let spread = f64::from(percent.min(100)) / 100.0;
                delay.mul_f64(1.0 + spread * (2.0 * unit - 1.0))
            }
            Jitter::Equal => delay / 2 + (delay / 2).mul_f64(unit),
            Jitter::Full => delay.mul_f64(unit),
        }
    }
}

/// The shortest retry a transport's hint may ask for. A receiver answering `503` with
/// `Retry-After: 0` would otherwise have its event retried at once, every attempt spent within
/// milliseconds (and, with `max_attempts = 0`, the relay retrying it in a hot loop).
pub const MIN_RETRY_AFTER: Duration = Duration::from_secs(1);

impl RetryPolicy {
    /// Decides what follows a transient failure of attempt `failed_attempt` (1-based) for an event
    /// whose limit is `max_attempts` (0 = unlimited). A `hint` from the transport replaces the
    /// backoff delay: at least [`MIN_RETRY_AFTER`], at most `retry_after_max`; `unit` is a uniform
    /// random number in `[0, 1)`.
    pub fn decide(&self, failed_attempt: u32, max_attempts: u32, hint: Option<Duration>, unit: f64) -> RetryDecision {
        if max_attempts != 0 && failed_attempt >= max_attempts {
            return RetryDecision::GiveUp;
        }
        let delay = match hint {
            Some(hint) => hint.min(self.retry_after_max).max(MIN_RETRY_AFTER),
            None => self.jitter.apply(self.backoff.base_delay(failed_attempt), unit),
        };
        RetryDecision::RetryAfter(delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1;
    const M: u64 = 60;
    const H: u64 = 3600;

    fn policy(backoff: Backoff, max_attempts: u32) -> RetryPolicy {
        RetryPolicy { backoff, jitter: Jitter::None, max_attempts, retry_after_max: Duration::from_secs(H) }
    }

    /// The delays a policy produces, attempt after attempt, until it gives up (or `limit` steps).
    fn table(policy: &RetryPolicy, limit: u32) -> Vec<Option<u64>> {
        (1..=limit)
            .map(|attempt| match policy.decide(attempt, policy.max_attempts, None, 0.5) {
                RetryDecision::RetryAfter(d) => Some(d.as_secs()),
                RetryDecision::GiveUp => None,
            })
            .collect()
    }

    #[test]
    fn exponential_reproduces_the_prisma_outbox_table() {
        // initialDelay 1s: 1s, 2s, 4s, 8s, 16s, then FAILED.
        let p = policy(Backoff::Exponential { initial: Duration::from_secs(1), max: Duration::from_secs(H) }, 6);
        assert_eq!(table(&p, 6), vec![Some(1), Some(2), Some(4), Some(8), Some(16), None]);
    }

    #[test]
    fn schedule_reproduces_the_webhook_table() {
        // 30s, 5m, 30m, 2h, 24h, then FAILED.
        let steps = [30 * S, 5 * M, 30 * M, 2 * H, 24 * H].map(Duration::from_secs).to_vec();
        let p = policy(Backoff::Schedule(steps), 6);
        assert_eq!(table(&p, 6), vec![Some(30), Some(300), Some(1800), Some(7200), Some(86400), None]);
    }

    #[test]
    fn fixed_delay_is_constant() {
        let p = policy(Backoff::Fixed { delay: Duration::from_secs(1) }, 4);
        assert_eq!(table(&p, 4), vec![Some(1), Some(1), Some(1), None]);
    }

    #[test]
    fn exponential_is_capped_and_never_overflows() {
        let b = Backoff::Exponential { initial: Duration::from_secs(1), max: Duration::from_secs(60) };
        let cases = [(1, 1), (6, 32), (7, 60), (40, 60), (u32::MAX, 60)];
        for (attempt, expected) in cases {
            assert_eq!(b.base_delay(attempt), Duration::from_secs(expected), "attempt {attempt}");
        }
    }

    #[test]
    fn schedule_repeats_its_last_step_when_unlimited() {
        let p = policy(Backoff::Schedule(vec![Duration::from_secs(1), Duration::from_secs(9)]), 0);
        assert_eq!(table(&p, 5), vec![Some(1), Some(9), Some(9), Some(9), Some(9)]);
    }

    #[test]
    fn unlimited_attempts_never_give_up() {
        let p = policy(Backoff::Fixed { delay: Duration::from_secs(1) }, 0);
        assert_eq!(p.decide(1_000_000, 0, None, 0.0), RetryDecision::RetryAfter(Duration::from_secs(1)));
    }

    #[test]
    fn retry_after_hint_replaces_backoff_within_bounds() {
        let p = policy(Backoff::Fixed { delay: Duration::from_secs(1) }, 5);
        let hinted = |secs| p.decide(1, 5, Some(Duration::from_secs(secs)), 0.5);
        assert_eq!(hinted(120), RetryDecision::RetryAfter(Duration::from_secs(120)));
        assert_eq!(hinted(10 * H), RetryDecision::RetryAfter(Duration::from_secs(H)), "clamped to retry_after_max");
        assert_eq!(hinted(0), RetryDecision::RetryAfter(MIN_RETRY_AFTER), "an immediate retry is not granted");
        let tight = RetryPolicy { retry_after_max: Duration::ZERO, ..p.clone() };
        assert_eq!(
            tight.decide(1, 5, Some(Duration::ZERO), 0.5),
            RetryDecision::RetryAfter(MIN_RETRY_AFTER),
            "nor by a zero maximum"
        );
        assert_eq!(
            p.decide(5, 5, Some(Duration::from_secs(1)), 0.5),
            RetryDecision::GiveUp,
            "a hint grants no extra attempt"
        );
    }

    #[test]
    fn jitter_stays_in_its_range() {
        let d = Duration::from_secs(100);
        let cases = [
            (Jitter::None, 0.0, 100.0),
            (Jitter::None, 1.0, 100.0),
            (Jitter::Symmetric { percent: 10 }, 0.0, 90.0),
            (Jitter::Symmetric { percent: 10 }, 0.5, 100.0),
            (Jitter::Symmetric { percent: 10 }, 1.0, 110.0),
            (Jitter::Equal, 0.0, 50.0),
            (Jitter::Equal, 1.0, 100.0),
            (Jitter::Full, 0.0, 0.0),
            (Jitter::Full, 0.25, 25.0),
        ];
        for (jitter, unit, expected) in cases {
            let got = jitter.apply(d, unit).as_secs_f64();
            assert!((got - expected).abs() < 1e-6, "{jitter:?} at {unit}: {got} != {expected}");
        }
    }
}
