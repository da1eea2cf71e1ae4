//! Monitoring figures, the same on both backends: where the events are, how late delivery runs,
//! and latency percentiles of recent deliveries, from queries whose text serves both databases.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sqlx::{FromRow, Row};

use super::codec;
use crate::event::Status;

/// What an operator watches: where the events are, and how late delivery runs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Stats {
    /// When the figures were taken.
    pub at: DateTime<Utc>,
    /// Events per route and status (statuses a route has no events in are left out).
    pub routes: BTreeMap<String, BTreeMap<Status, u64>>,
    /// Creation time of the oldest PENDING event, deferred and retrying ones included.
    pub oldest_pending_created_at: Option<DateTime<Utc>>,
    /// The earliest due time of a PENDING event that is due: how far claiming lags behind.
    pub oldest_due_at: Option<DateTime<Utc>>,
    /// PROCESSING events whose lease has expired: their relay died or hung; recovery hands
    /// them back.
    pub stuck: u64,
    /// PENDING events with one attempt left before they fail.
    pub last_attempt: u64,
    /// Delivery latency of events SENT since a point in time, if asked for.
    pub latency: Option<Latency>,
}

impl Stats {
    /// Events in `status`, over all routes.
    pub fn total(&self, status: Status) -> u64 {
        self.routes.values().filter_map(|counts| counts.get(&status)).sum()
    }
}

/// Latency percentiles of recently delivered events.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Latency {
    /// Events SENT at or after this time were measured.
    pub since: DateTime<Utc>,
    /// How many were measured (the most recent [`LATENCY_SAMPLES`] at most).
    pub samples: usize,
    /// From the event's own time to SENT.
    pub from_event_time: Percentiles,
    /// From the row's creation (the commit, near enough) to SENT.
    pub from_created: Percentiles,
}

/// Percentiles of a set of durations, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Percentiles {
    pub p50_ms: i64,
    pub p95_ms: i64,
    pub p99_ms: i64,
    pub max_ms: i64,
}

/// The most recent deliveries that latency figures are computed from.
pub const LATENCY_SAMPLES: u32 = 10_000;

impl Percentiles {
    /// Nearest-rank percentiles of `values` (sorted here); `None` when there are none.
    pub fn of(mut values: Vec<i64>) -> Option<Percentiles> {
        if values.is_empty() {
            return None;
        }
        values.sort_unstable();
        let rank = |p: f64| values[((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
        Some(Percentiles {
            p50_ms: rank(0.50),
            p95_ms: rank(0.95),
            p99_ms: rank(0.99),
            max_ms: values[values.len() - 1],
        })
    }
}

/// Builds [`Latency`] from `(event_time, created_at, processed_at)` of SENT events.
fn latency(since: DateTime<Utc>, rows: &[(DateTime<Utc>, DateTime<Utc>, DateTime<Utc>)]) -> Option<Latency> {
    let from_event_time = Percentiles::of(rows.iter().map(|(e, _, p)| (*p - *e).num_milliseconds()).collect())?;
    let from_created = Percentiles::of(rows.iter().map(|(_, c, p)| (*p - *c).num_milliseconds()).collect())?;
    Some(Latency { since, samples: rows.len(), from_event_time, from_created })
}

/// The figures of [`Stats`] besides the counts and latency. Each sub-query names one status, so
/// it reads only that status's partial index and rows, never the retained SENT ones. The same
/// text serves both backends; only the time type of the parameters differs.
pub const WATCH_SQL: &str = "SELECT
        (SELECT MIN(created_at) FROM ferry_events WHERE status = 'PENDING') AS oldest_pending,
        (SELECT MIN(next_attempt_at) FROM ferry_events WHERE status = 'PENDING' AND next_attempt_at <= $1)
            AS oldest_due,
        (SELECT COUNT(*) FROM ferry_events
         WHERE status = 'PROCESSING' AND (lease_until < $1 OR lease_until > $2 OR lease_until IS NULL)) AS stuck,
        (SELECT COUNT(*) FROM ferry_events
         WHERE status = 'PENDING' AND max_attempts > 0 AND attempts >= max_attempts - 1) AS last_attempt";

pub(crate) const ROUTE_COUNTS_SQL: &str =
    "SELECT route, status, COUNT(*) AS n FROM ferry_events GROUP BY route, status";

/// `ROUTE_COUNTS_SQL` without SENT: one arm per status, each matching its partial index's
/// predicate exactly, so none reads the retained SENT rows.
pub const UNFINISHED_COUNTS_SQL: &str =
    "SELECT route, 'PENDING' AS status, COUNT(*) AS n FROM ferry_events WHERE status = 'PENDING' GROUP BY route
     UNION ALL
     SELECT route, 'PROCESSING', COUNT(*) FROM ferry_events WHERE status = 'PROCESSING' GROUP BY route
     UNION ALL
     SELECT route, 'FAILED', COUNT(*) FROM ferry_events WHERE status = 'FAILED' GROUP BY route";

/// The latest events SENT since $1, at most $2 of them. There is no index of SENT rows (migration
/// 10), so this reads every row, as the per-status counts `ferry stats` shows beside it do. Events
/// handed on to destinations are SENT without a delivery of their own (no `sent_started_at`): their
/// deliveries are sampled instead.
pub(crate) const LATENCY_SQL: &str = "SELECT event_time, created_at, processed_at FROM ferry_events
     WHERE status = 'SENT' AND processed_at >= $1 AND sent_started_at IS NOT NULL
     ORDER BY processed_at DESC LIMIT $2";

/// An event's history: the attempts that went wrong, then the delivery that succeeded, which is
/// kept on the event row (by the instance that claimed it). SENT events delivered before the
/// success columns existed have their success among the history rows instead.
pub(crate) const ATTEMPTS_SQL: &str =
    "SELECT attempt, started_at, duration_ms, outcome, reason, error, plugin, plugin_hash, instance FROM (
         SELECT 0 AS part, id AS seq, attempt, started_at, duration_ms, outcome, reason, error, plugin,
                plugin_hash, instance
         FROM ferry_attempts WHERE event_id = $1
         UNION ALL
         SELECT 1, id, attempts, sent_started_at, sent_duration_ms, 'sent', NULL, NULL, sent_plugin,
                sent_plugin_hash, claimed_by
         FROM ferry_events WHERE id = $1 AND status = 'SENT' AND sent_started_at IS NOT NULL
     ) AS history ORDER BY part, seq";

/// The row of `WATCH_SQL`.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct WatchRow {
    #[sqlx(try_from = "codec::MaybeTime")]
    oldest_pending: Option<DateTime<Utc>>,
    #[sqlx(try_from = "codec::MaybeTime")]
    oldest_due: Option<DateTime<Utc>>,
    stuck: i64,
    last_attempt: i64,
}

/// A row of `ROUTE_COUNTS_SQL`. The status is read as text: no constraint holds a row edited by
/// hand to the four ferry writes (migration 12 on PostgreSQL), and such rows are left out of the
/// counts rather than fail them.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct RouteCount {
    route: String,
    status: String,
    n: i64,
}

/// A row of `LATENCY_SQL`.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct LatencyRow {
    #[sqlx(try_from = "codec::DbTime")]
    event_time: DateTime<Utc>,
    #[sqlx(try_from = "codec::DbTime")]
    created_at: DateTime<Utc>,
    #[sqlx(try_from = "codec::DbTime")]
    processed_at: DateTime<Utc>,
}

/// Assembles [`Stats`] from the rows of the queries above, on either backend.
pub(crate) fn stats_from<R>(
    at: DateTime<Utc>,
    counts: &[R],
    watch: &R,
    latency_rows: Option<(DateTime<Utc>, Vec<R>)>,
) -> Result<Stats, sqlx::Error>
where
    R: Row,
    for<'r> RouteCount: FromRow<'r, R>,
    for<'r> WatchRow: FromRow<'r, R>,
    for<'r> LatencyRow: FromRow<'r, R>,
{
    let mut routes: BTreeMap<String, BTreeMap<Status, u64>> = BTreeMap::new();
    for row in counts {
        let RouteCount { route, status, n } = RouteCount::from_row(row)?;
        if let Ok(status) = status.parse::<Status>() {
            routes.entry(route).or_default().insert(status, u64::try_from(n).unwrap_or(0));
        }
    }
    let latency = match latency_rows {
        None => None,
        Some((since, rows)) => {
            let times = rows
                .iter()
                .map(|row| LatencyRow::from_row(row).map(|r| (r.event_time, r.created_at, r.processed_at)))
                .collect::<Result<Vec<_>, sqlx::Error>>()?;
            latency(since, &times)
        }
    };
    let watch = WatchRow::from_row(watch)?;
    Ok(Stats {
        at,
        routes,
        oldest_pending_created_at: watch.oldest_pending,
        oldest_due_at: watch.oldest_due,
        stuck: u64::try_from(watch.stuck).unwrap_or(0),
        last_attempt: u64::try_from(watch.last_attempt).unwrap_or(0),
        latency,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let p = Percentiles::of((1..=100).rev().collect()).unwrap();
        assert_eq!((p.p50_ms, p.p95_ms, p.p99_ms, p.max_ms), (50, 95, 99, 100));
        let one = Percentiles::of(vec![7]).unwrap();
        assert_eq!((one.p50_ms, one.p99_ms, one.max_ms), (7, 7, 7));
        assert_eq!(Percentiles::of(Vec::new()), None);
    }
}
