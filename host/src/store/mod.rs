//! The outbox store: one trait, implemented for SQLite (the embedded default) and PostgreSQL.
//!
//! Every method is a short statement or transaction; none is held open while a plugin runs.
//! Times come in as parameters from the relay's [`Clock`](crate::clock::Clock), never from the
//! database's own `now()`, except for defaults of rows that applications insert themselves.

mod postgres;
mod sqlite;

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::{ColumnIndex, Decode, Row, Type};

pub use self::postgres::PostgresStore;

/// The settings ferry gives its own PostgreSQL sessions (see `postgres.rs`), for tools that should
/// plan ferry's statements the same way.
pub fn postgres_session_settings() -> &'static [(&'static str, &'static str)] {
    &postgres::SESSION_SETTINGS
}
pub use self::sqlite::SqliteStore;
use crate::event::{AttemptRecord, ClaimedEvent, Completion, EventRecord, NewEvent, Status};

/// A store failure. Callers branch on it: a bad event is the caller's fault, the rest are not.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid event: {0}")]
    InvalidEvent(String),
    #[error("cannot open database {url}: {source}")]
    Connect { url: String, source: sqlx::Error },
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

/// A request to claim up to `limit` due events.
#[derive(Debug, Clone)]
pub struct Claim {
    /// The claimer's current time: rows due at or before it are eligible.
    pub now: DateTime<Utc>,
    pub limit: u32,
    /// When the claim expires if the claimer never records an outcome.
    pub lease_until: DateTime<Utc>,
    /// The claiming instance, stored in `claimed_by` for operators.
    pub instance: String,
    /// Fences every later write of this claim.
    pub token: String,
    /// Routes whose events are delivered one at a time per ordering key: only the oldest
    /// unfinished event of a key can be claimed.
    pub ordered_routes: Vec<String>,
    /// Of the ordered routes, those where a FAILED event still holds back the rest of its key.
    pub blocking_routes: Vec<String>,
    /// Routes whose circuit breaker is open: their events are not claimed.
    pub paused_routes: Vec<String>,
    /// Claim only events of this route (a half-open breaker's probe).
    pub only_route: Option<String>,
}

/// Which FAILED events an operation applies to. Every field narrows the selection; the default
/// selects them all.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FailedFilter {
    pub route: Option<String>,
    pub event_type: Option<String>,
    /// Created at or after this time.
    pub from: Option<DateTime<Utc>>,
    /// Created before this time.
    pub before: Option<DateTime<Utc>>,
    /// Only events with a greater id (paging through a list).
    pub after_id: Option<i64>,
}

impl FailedFilter {
    /// Whether the filter narrows anything (bulk operations on every failed event need saying so).
    pub fn is_everything(&self) -> bool {
        *self == FailedFilter::default()
    }
}

/// A route's circuit breaker, shared by every instance through the database.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Breaker {
    pub route: String,
    /// Transient failures since the last success.
    pub consecutive_failures: u32,
    /// When the breaker opened; `None` while it is closed.
    pub opened_at: Option<DateTime<Utc>>,
    /// Why it opened: the last failure, or the operator's words.
    pub reason: Option<String>,
    /// Opened by an operator: stays open, without probes, until closed by hand.
    pub manual: bool,
    /// While half-open: the probe delivery in flight holds the route until then.
    pub probe_until: Option<DateTime<Utc>>,
    pub updated_at: DateTime<Utc>,
}

impl Breaker {
    /// `closed`, `open` or `half-open` (open, cooled down, so a probe may go through).
    pub fn state(&self, now: DateTime<Utc>, cooldown: std::time::Duration) -> &'static str {
        match self.opened_at {
            None => "closed",
            Some(at)
                if !self.manual
                    && at + chrono::Duration::from_std(cooldown).unwrap_or(chrono::Duration::MAX) <= now =>
            {
                "half-open"
            }
            Some(_) => "open",
        }
    }
}

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
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
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

/// The figures of [`Stats`] besides the counts and latency, in one pass over the unfinished rows.
/// The same text serves both backends; only the time type of the parameter differs.
const WATCH_SQL: &str = "SELECT MIN(created_at) FILTER (WHERE status = 'PENDING') AS oldest_pending,
            MIN(next_attempt_at) FILTER (WHERE status = 'PENDING' AND next_attempt_at <= $1) AS oldest_due,
            COUNT(*) FILTER (WHERE status = 'PROCESSING' AND lease_until < $1) AS stuck,
            COUNT(*) FILTER (WHERE status = 'PENDING' AND max_attempts > 0 AND attempts >= max_attempts - 1)
                AS last_attempt
     FROM ferry_events WHERE status IN ('PENDING', 'PROCESSING')";

const ROUTE_COUNTS_SQL: &str = "SELECT route, status, COUNT(*) AS n FROM ferry_events GROUP BY route, status";

const LATENCY_SQL: &str = "SELECT event_time, created_at, processed_at FROM ferry_events
     WHERE status = 'SENT' AND processed_at >= $1 ORDER BY processed_at DESC LIMIT $2";

const ATTEMPTS_SQL: &str =
    "SELECT attempt, started_at, duration_ms, outcome, reason, error, plugin, plugin_hash, instance
     FROM ferry_attempts WHERE event_id = $1 ORDER BY id";

/// Assembles [`Stats`] from the rows of the queries above, on either backend.
fn stats_from<R>(
    at: DateTime<Utc>,
    counts: &[R],
    watch: &R,
    latency_rows: Option<(DateTime<Utc>, Vec<R>)>,
    time: &TimeReader<R>,
) -> Result<Stats, sqlx::Error>
where
    R: Row,
    for<'c> &'c str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let mut routes: BTreeMap<String, BTreeMap<Status, u64>> = BTreeMap::new();
    for row in counts {
        let status: String = row.try_get("status")?;
        let status: Status = status.parse().map_err(|e: String| sqlx::Error::Decode(e.into()))?;
        let n: i64 = row.try_get("n")?;
        routes.entry(row.try_get("route")?).or_default().insert(status, u64::try_from(n).unwrap_or(0));
    }
    let latency = match latency_rows {
        None => None,
        Some((since, rows)) => {
            let times = rows
                .iter()
                .map(|row| {
                    Ok((
                        required(time(row, "event_time")?, "event_time")?,
                        required(time(row, "created_at")?, "created_at")?,
                        required(time(row, "processed_at")?, "processed_at")?,
                    ))
                })
                .collect::<Result<Vec<_>, sqlx::Error>>()?;
            latency(since, &times)
        }
    };
    Ok(Stats {
        at,
        routes,
        oldest_pending_created_at: time(watch, "oldest_pending")?,
        oldest_due_at: time(watch, "oldest_due")?,
        stuck: u64::try_from(watch.try_get::<i64, _>("stuck")?).unwrap_or(0),
        last_attempt: u64::try_from(watch.try_get::<i64, _>("last_attempt")?).unwrap_or(0),
        latency,
    })
}

/// Decodes a `ferry_attempts` row (`ATTEMPTS_SQL`), on either backend.
fn attempt_record<R>(row: &R, time: &TimeReader<R>) -> Result<AttemptRecord, sqlx::Error>
where
    R: Row,
    for<'c> &'c str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(AttemptRecord {
        attempt: count(row.try_get("attempt")?),
        started_at: required(time(row, "started_at")?, "started_at")?,
        duration_ms: u64::try_from(row.try_get::<i64, _>("duration_ms")?).unwrap_or(0),
        outcome: row.try_get("outcome")?,
        reason: row.try_get("reason")?,
        error: row.try_get("error")?,
        plugin: row.try_get("plugin")?,
        plugin_hash: row.try_get("plugin_hash")?,
        instance: row.try_get("instance")?,
    })
}

/// A bulk operation on FAILED events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BulkOp {
    Resend,
    Purge,
}

impl BulkOp {
    /// `resent` or `purged`.
    pub fn past_tense(self) -> &'static str {
        match self {
            BulkOp::Resend => "resent",
            BulkOp::Purge => "purged",
        }
    }
}

/// Rows changed per statement in bulk operations, so none holds locks for long.
pub const BULK_STEP: u32 = 1000;

/// Resends or purges every FAILED event matching `filter`, [`BULK_STEP`] rows per statement,
/// calling `progress` with the running total after each step. Returns how many were changed.
pub async fn bulk(
    store: &dyn Store,
    filter: &FailedFilter,
    op: BulkOp,
    now: impl Fn() -> DateTime<Utc>,
    mut progress: impl FnMut(u64),
) -> Result<u64, StoreError> {
    let mut done = 0;
    loop {
        let step = match op {
            BulkOp::Resend => store.resend_failed(filter, now(), BULK_STEP).await?,
            BulkOp::Purge => store.purge_failed(filter, BULK_STEP).await?,
        };
        if step == 0 {
            return Ok(done);
        }
        done += step;
        progress(done);
    }
}

/// An event whose lease expired and that was handed back to PENDING.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovered {
    pub id: i64,
    pub claimed_by: Option<String>,
}

/// The outbox, whatever database holds it.
#[async_trait]
pub trait Store: std::fmt::Debug + Send + Sync {
    /// `"sqlite"` or `"postgres"`.
    fn backend(&self) -> &'static str;

    /// Applies the schema migrations that have not run yet.
    async fn migrate(&self) -> Result<(), StoreError>;

    /// Inserts one event outside any application transaction, stamped with `now`.
    async fn insert(&self, event: &NewEvent, now: DateTime<Utc>) -> Result<i64, StoreError>;

    /// Atomically moves up to `claim.limit` due PENDING events to PROCESSING under `claim.token`
    /// and returns them in claim order (next attempt time, then id). Concurrent claimers never
    /// receive the same event.
    async fn claim(&self, claim: &Claim) -> Result<Vec<ClaimedEvent>, StoreError>;

    /// Records outcomes of the claim `token`. Rows no longer held by that claim (recovered and
    /// claimed again elsewhere) are left alone. Returns how many rows were updated.
    async fn complete(&self, token: &str, now: DateTime<Utc>, items: &[Completion]) -> Result<u64, StoreError>;

    /// Hands events of claim `token` back to PENDING without counting the attempt (used at shutdown
    /// for a batch whose delivery did not finish within the grace period).
    async fn release(&self, token: &str, ids: &[i64], now: DateTime<Utc>) -> Result<u64, StoreError>;

    /// Moves PROCESSING events whose lease expired before `now` back to PENDING.
    async fn recover_expired(&self, now: DateTime<Utc>) -> Result<Vec<Recovered>, StoreError>;

    /// Makes FAILED events PENDING again, due at `now`, with attempts and error reset (the
    /// operator's resend). Returns how many were FAILED and are now PENDING.
    async fn resend(&self, ids: &[i64], now: DateTime<Utc>) -> Result<u64, StoreError>;

    /// Deletes up to `limit` SENT events processed before `before`. Returns how many went.
    async fn purge_sent(&self, before: DateTime<Utc>, limit: u32) -> Result<u64, StoreError>;

    /// Starts a background task that calls `wake.notify_one()` whenever another process commits a
    /// new or resent event, until `stop`. Returns false if the backend cannot do that (SQLite),
    /// leaving the relay to polling.
    fn spawn_waker(&self, wake: Arc<tokio::sync::Notify>, stop: tokio_util::sync::CancellationToken) -> bool {
        let _ = (wake, stop);
        false
    }

    /// Checks that the database answers (readiness).
    async fn ping(&self) -> Result<(), StoreError>;

    /// The monitoring figures at `now`; with `latency_since`, also the latency of events SENT
    /// since then (the most recent [`LATENCY_SAMPLES`] of them).
    async fn stats(&self, now: DateTime<Utc>, latency_since: Option<DateTime<Utc>>) -> Result<Stats, StoreError>;

    /// The delivery history of event `id`, oldest first.
    async fn attempts(&self, id: i64) -> Result<Vec<AttemptRecord>, StoreError>;

    /// Number of events per status (statuses with no events are included as zero).
    async fn counts(&self) -> Result<BTreeMap<Status, u64>, StoreError>;

    /// One stored event, if it exists.
    async fn get(&self, id: i64) -> Result<Option<EventRecord>, StoreError>;

    /// How many FAILED events match `filter`.
    async fn count_failed(&self, filter: &FailedFilter) -> Result<u64, StoreError>;

    /// Up to `limit` FAILED events matching `filter`, in id order.
    async fn list_failed(&self, filter: &FailedFilter, limit: u32) -> Result<Vec<EventRecord>, StoreError>;

    /// Resends up to `limit` FAILED events matching `filter` (as [`Store::resend`] does) and
    /// returns how many; call again until it returns 0 to resend them all in bounded steps.
    async fn resend_failed(&self, filter: &FailedFilter, now: DateTime<Utc>, limit: u32) -> Result<u64, StoreError>;

    /// Deletes up to `limit` FAILED events matching `filter`; returns how many went.
    async fn purge_failed(&self, filter: &FailedFilter, limit: u32) -> Result<u64, StoreError>;

    /// Every stored circuit breaker, ordered by route.
    async fn breakers(&self) -> Result<Vec<Breaker>, StoreError>;

    /// Records how one delivery call of `route` went: `failures` transient failures, or none (it
    /// succeeded). Success resets the count and closes the breaker unless an operator opened it.
    /// Failures add to the count and open the breaker, with `reason`, when the count reaches
    /// `threshold`, or at once when it was open already (a failed probe). Returns the new state.
    async fn record_breaker(
        &self,
        route: &str,
        failures: u32,
        reason: &str,
        threshold: u32,
        now: DateTime<Utc>,
    ) -> Result<Breaker, StoreError>;

    /// Takes the half-open probe of `route`: succeeds for exactly one caller when the breaker was
    /// opened automatically at or before `cooled` and no probe holds it; the probe holds it until
    /// `until`.
    async fn take_probe(
        &self,
        route: &str,
        cooled: DateTime<Utc>,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Result<bool, StoreError>;

    /// Gives a probe back without a verdict (there was no event to probe with).
    async fn release_probe(&self, route: &str) -> Result<(), StoreError>;

    /// Opens a route's breaker by hand, with `reason`, or closes it (resetting the count).
    async fn set_breaker(
        &self,
        route: &str,
        open: bool,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<Breaker, StoreError>;
}

/// Opens the store named by `url` (`sqlite://…` or `postgres://…`). SQLite files are created when
/// missing. Does not migrate.
pub async fn connect(url: &str, max_connections: u32) -> Result<Arc<dyn Store>, StoreError> {
    if url.starts_with("sqlite:") {
        Ok(Arc::new(SqliteStore::connect(url, max_connections).await?))
    } else {
        Ok(Arc::new(PostgresStore::connect(url, max_connections).await?))
    }
}

/// Counts per status from `SELECT status, COUNT(*) … GROUP BY status`, with zero for the rest.
fn counts_by_status(rows: Vec<(String, i64)>) -> BTreeMap<Status, u64> {
    let mut counts: BTreeMap<Status, u64> = Status::ALL.into_iter().map(|s| (s, 0)).collect();
    for (status, n) in rows {
        if let Ok(status) = status.parse() {
            counts.insert(status, u64::try_from(n).unwrap_or(0));
        }
    }
    counts
}

/// How a backend reads one (nullable) timestamp column: the only column type the two schemas
/// store differently (TIMESTAMPTZ vs integer milliseconds).
type TimeReader<R> = dyn Fn(&R, &str) -> Result<Option<DateTime<Utc>>, sqlx::Error>;

fn required(row_time: Option<DateTime<Utc>>, column: &str) -> Result<DateTime<Utc>, sqlx::Error> {
    row_time.ok_or_else(|| sqlx::Error::Decode(format!("{column} is NULL").into()))
}

/// Decodes a row of the claim's RETURNING list, on either backend.
fn claimed_event<R>(row: &R, time: &TimeReader<R>) -> Result<ClaimedEvent, sqlx::Error>
where
    R: Row,
    for<'c> &'c str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    let id: i64 = row.try_get("id")?;
    let (headers, defect) = decode_headers(id, &row.try_get::<String, _>("headers")?);
    Ok(ClaimedEvent {
        id,
        route: row.try_get("route")?,
        event_type: row.try_get("event_type")?,
        ordering_key: row.try_get("ordering_key")?,
        payload: row.try_get("payload")?,
        content_type: row.try_get("content_type")?,
        headers,
        attempt: count(row.try_get("attempts")?),
        max_attempts: row.try_get::<Option<i32>, _>("max_attempts")?.map(count),
        event_time: required(time(row, "event_time")?, "event_time")?,
        created_at: required(time(row, "created_at")?, "created_at")?,
        defect,
    })
}

/// Decodes a `ferry_breakers` row, on either backend (`manual` read by the caller's `flag`).
fn breaker<R>(row: &R, time: &TimeReader<R>, manual: bool) -> Result<Breaker, sqlx::Error>
where
    R: Row,
    for<'c> &'c str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(Breaker {
        route: row.try_get("route")?,
        consecutive_failures: count(row.try_get("consecutive_failures")?),
        opened_at: time(row, "opened_at")?,
        reason: row.try_get("reason")?,
        manual,
        probe_until: time(row, "probe_until")?,
        updated_at: required(time(row, "updated_at")?, "updated_at")?,
    })
}

/// Decodes a full row (`EVENT_COLUMNS` of either backend).
fn event_record<R>(row: &R, time: &TimeReader<R>) -> Result<EventRecord, sqlx::Error>
where
    R: Row,
    for<'c> &'c str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i32: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
{
    let status: String = row.try_get("status")?;
    Ok(EventRecord {
        id: row.try_get("id")?,
        route: row.try_get("route")?,
        event_type: row.try_get("event_type")?,
        ordering_key: row.try_get("ordering_key")?,
        payload: row.try_get("payload")?,
        content_type: row.try_get("content_type")?,
        headers: row.try_get("headers")?,
        status: status.parse().map_err(|e: String| sqlx::Error::Decode(e.into()))?,
        attempts: count(row.try_get("attempts")?),
        max_attempts: row.try_get::<Option<i32>, _>("max_attempts")?.map(count),
        event_time: required(time(row, "event_time")?, "event_time")?,
        created_at: required(time(row, "created_at")?, "created_at")?,
        last_status_at: required(time(row, "last_status_at")?, "last_status_at")?,
        next_attempt_at: required(time(row, "next_attempt_at")?, "next_attempt_at")?,
        processed_at: time(row, "processed_at")?,
        last_error: row.try_get("last_error")?,
        failure_reason: row.try_get("failure_reason")?,
        claimed_by: row.try_get("claimed_by")?,
        claim_token: row.try_get("claim_token")?,
        lease_until: time(row, "lease_until")?,
    })
}

/// Splits completions by kind so each kind is written with one statement.
#[derive(Debug, Default)]
struct Partitioned<'a> {
    sent: Vec<&'a Completion>,
    retry: Vec<(&'a Completion, DateTime<Utc>, &'a str)>,
    failed: Vec<(&'a Completion, &'static str, &'a str)>,
}

fn partition(items: &[Completion]) -> Partitioned<'_> {
    use crate::event::Disposition;
    let mut p = Partitioned::default();
    for item in items {
        match &item.disposition {
            Disposition::Sent => p.sent.push(item),
            Disposition::Retry { at, error } => p.retry.push((item, *at, error)),
            Disposition::Failed { reason, error } => p.failed.push((item, reason.as_str(), error)),
        }
    }
    p
}

/// Converts a stored attempt count, which the schema keeps non-negative.
fn count(n: i32) -> u32 {
    u32::try_from(n).unwrap_or(0)
}

/// Decodes the stored headers of row `id`; a defect is reported on the event, not raised.
fn decode_headers(id: i64, json: &str) -> (Vec<(String, String)>, Option<String>) {
    match crate::event::parse_headers(json) {
        Ok(headers) => (headers, None),
        Err(e) => (Vec::new(), Some(format!("event {id}: {e}"))),
    }
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
