//! The outbox store: one trait, implemented for SQLite (the embedded default) and PostgreSQL.
//!
//! Every method is a short statement or transaction; none is held open while a plugin runs.
//! Times come in as parameters from the relay's [`Clock`](crate::clock::Clock), never from the
//! database's own `now()`, except for defaults of rows that applications insert themselves.

pub mod codec;
mod lanes;
mod postgres;
mod sqlite;
mod stats;
mod writer;

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use ferry_outbox::EmitError;
use sqlx::{ColumnIndex, Decode, FromRow, Row, Type};

pub use self::postgres::PostgresStore;

/// The settings ferry gives its own PostgreSQL sessions (see `postgres.rs`), for tools that should
/// plan ferry's statements the same way.
pub fn postgres_session_settings() -> &'static [(&'static str, &'static str)] {
    &postgres::SESSION_SETTINGS
}
use self::codec::{Count, DbTime, Lenient, MaybeCount};
pub use self::sqlite::SqliteStore;
pub(crate) use self::stats::{ATTEMPTS_SQL, LATENCY_SQL, ROUTE_COUNTS_SQL, stats_from};
pub use self::stats::{LATENCY_SAMPLES, Latency, Percentiles, Stats};
/// What a `/metrics` scrape runs: public so a test can check their plans read no SENT rows.
pub use self::stats::{UNFINISHED_COUNTS_SQL, WATCH_SQL};
pub use self::{postgres::CLAIM_ONE_SQL as POSTGRES_CLAIM_ONE_SQL, sqlite::CLAIM_ONE_SQL as SQLITE_CLAIM_ONE_SQL};
pub use self::{
    postgres::CLAIM_PLAIN_SQL as POSTGRES_CLAIM_PLAIN_SQL, sqlite::CLAIM_PLAIN_SQL as SQLITE_CLAIM_PLAIN_SQL,
};
/// Each backend's claim, its one-event claim and its list of due events (the fallback of a
/// refused claim): public so a test can check their plans.
pub use self::{postgres::CLAIM_SQL as POSTGRES_CLAIM_SQL, sqlite::CLAIM_SQL as SQLITE_CLAIM_SQL};
pub use self::{postgres::DUE_SQL as POSTGRES_DUE_SQL, sqlite::DUE_SQL as SQLITE_DUE_SQL};
/// Each backend's step of retention's sweep: public so a test can check their plans.
pub use self::{postgres::SWEEP_SQL as POSTGRES_SWEEP_SQL, sqlite::SWEEP_SQL as SQLITE_SWEEP_SQL};
pub use crate::breaker::Breaker;
use crate::config::DatabaseConfig;
use crate::event::{
    AttemptRecord, CLAIMED_COLUMNS, CallLog, ClaimedEvent, ClaimedRow, Completion, EventRecord, FailureReason,
    NewEvent, Status,
};
pub use crate::report::FailedGroup;

/// A store failure. Callers branch on it: a bad event is the caller's fault, the rest are not.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid event: {0}")]
    InvalidEvent(String),
    #[error("cannot open database {url}: {source}")]
    Connect { url: String, source: sqlx::Error },
    /// The database does not exist and this command does not create one.
    #[error("{0}")]
    Missing(String),
    /// The database server is a version ferry does not run on.
    #[error("{0}")]
    Unsupported(String),
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

impl StoreError {
    /// Whether the database refused what it was asked to write (a constraint or trigger, a value
    /// out of range), rather than failing to run the statement (a lost connection, a deadlock, a
    /// lock or statement timeout, a busy file, a read-only replica): the first fails again however
    /// often it is retried, the second may well not.
    pub fn is_refusal(&self) -> bool {
        let StoreError::Database(sqlx::Error::Database(e)) = self else { return false };
        if let Some(pg) = e.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
            return !PG_COULD_NOT_RUN.iter().any(|class| pg.code().starts_with(class));
        }
        if e.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() {
            // The primary result code of an extended one: SQLITE_TOOBIG, SQLITE_CONSTRAINT (a
            // trigger's RAISE among them), SQLITE_MISMATCH.
            let primary = e.code().and_then(|code| code.parse::<i32>().ok()).map(|code| code & 0xff);
            return matches!(primary, Some(18..=20));
        }
        false
    }

    /// Whether the database refused a statement for a value it met (a row it read or would write):
    /// a data exception, an integrity constraint, a program limit such as PostgreSQL's 1 GB
    /// strings, or a trigger's raised error; on SQLite too big, a constraint (a trigger's RAISE
    /// among them) or a type mismatch. Not an error in the statement itself (a missing column or
    /// function, a privilege), which every row would meet.
    pub fn refuses_a_value(&self) -> bool {
        let StoreError::Database(sqlx::Error::Database(e)) = self else { return false };
        if let Some(pg) = e.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
            return ["22", "23", "54", "P0"].iter().any(|class| pg.code().starts_with(class));
        }
        self.is_refusal()
    }

    /// Whether the same statement may well succeed if run again shortly: the connection failed
    /// (an I/O error), PostgreSQL could not run it this time ([`PG_COULD_NOT_RUN`]), or SQLite
    /// found the file busy or locked. Not a refusal, a pool that timed out or was closed, nor an
    /// error ferry made (encoding, decoding): those would fail again.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Database(sqlx::Error::Io(_)) => true,
            StoreError::Database(sqlx::Error::Database(e)) => {
                if let Some(pg) = e.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
                    return PG_COULD_NOT_RUN.iter().any(|class| pg.code().starts_with(class));
                }
                // SQLITE_BUSY and SQLITE_LOCKED, in their primary result code.
                let primary = e.code().and_then(|code| code.parse::<i32>().ok()).map(|code| code & 0xff);
                e.try_downcast_ref::<sqlx::sqlite::SqliteError>().is_some() && matches!(primary, Some(5 | 6))
            }
            _ => false,
        }
    }
}

/// The classes of PostgreSQL error codes of a statement that could not run this time: connection
/// (08), read-only transaction (25), rollback (40: deadlock, serialization), resources (53), lock
/// not available (55), operator intervention (57: timeouts, shutdown), system (58) and internal
/// (XX) errors. Every other class refuses what the statement asked.
const PG_COULD_NOT_RUN: [&str; 8] = ["08", "25", "40", "53", "55", "57", "58", "XX"];

/// How long a pooled connection may sit idle before it is checked with a round trip when taken
/// out again (every connection is checked when it is given back). Long enough to spare the
/// relay's steady use a round trip per statement; a connection dropped within it (by a server
/// restart or a failover) fails the statement that takes it, which the relay tries again.
pub(crate) const CHECK_AFTER_IDLE: std::time::Duration = std::time::Duration::from_secs(1);

impl From<EmitError> for StoreError {
    fn from(e: EmitError) -> Self {
        match e {
            EmitError::Invalid(message) => StoreError::InvalidEvent(message),
            EmitError::Database(e) => StoreError::Database(e),
        }
    }
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
    /// Payloads larger than this are not loaded: such an event comes back with a defect.
    pub max_payload: u64,
}

impl Claim {
    /// Whether a due event's route can keep it from this claim: a route is paused, chosen or
    /// ordered. When none is, the claim statement leaves out its tests of the route.
    pub fn filters_routes(&self) -> bool {
        !self.paused_routes.is_empty() || self.only_route.is_some() || !self.ordered_routes.is_empty()
    }
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
    /// Only events that failed for this reason.
    pub reason: Option<ReasonFilter>,
    /// Only events with this id or a lower one (the highest a count saw, so a bulk operation
    /// confirmed by that count leaves newer events alone).
    pub through_id: Option<i64>,
    /// Only events whose last error contains this text, letter case aside (on SQLite, only
    /// ASCII letters' case).
    pub error: Option<String>,
    /// [`Store::list_failed`] only: the highest ids first.
    pub newest_first: bool,
}

/// Which failure reason a [`FailedFilter`] selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasonFilter {
    Is(FailureReason),
    /// FAILED rows without a recorded reason (written by hand, or by another program).
    Unrecorded,
}

impl ReasonFilter {
    /// As the filter is bound: the reason's name, or `none`.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasonFilter::Is(reason) => reason.as_str(),
            ReasonFilter::Unrecorded => "none",
        }
    }
}

impl FailedFilter {
    /// Whether the filter narrows anything (bulk operations on every failed event need saying so).
    pub fn is_everything(&self) -> bool {
        *self == FailedFilter::default()
    }
}

/// A text column as lists select it: itself, or its size when it is longer than `$max` bytes,
/// so a page of rows written by SQL past what ferry writes is not loaded whole. (`octet_length`
/// is in the SQLite ferry links, 3.46.)
macro_rules! shown_text {
    ($column:literal, $max:literal) => {
        concat!(
            "CASE WHEN octet_length(",
            $column,
            ") <= ",
            $max,
            " THEN ",
            $column,
            " ELSE '(' || octet_length(",
            $column,
            ") || ' bytes, not loaded)' END AS ",
            $column
        )
    };
}
pub(crate) use shown_text;

/// A name column as lists and the failed summary select it, on both backends: itself, or its size
/// when it is longer than a claim loads (1024 bytes, `MAX_CLAIMED_NAME`; written by SQL past
/// `emit`'s limits).
macro_rules! shown_name {
    ($column:literal) => {
        crate::store::shown_text!($column, "1024")
    };
}
pub(crate) use shown_name;

/// The names of a list's columns, both backends': [`shown_name`] for each but the payload.
macro_rules! listed_names {
    ($payload:literal) => {
        concat!(
            "id, ",
            crate::store::shown_name!("route"),
            ", ",
            crate::store::shown_name!("event_type"),
            ", ",
            crate::store::shown_name!("ordering_key"),
            ", ",
            $payload,
            " AS payload, ",
            crate::store::shown_name!("content_type"),
            ", "
        )
    };
}
pub(crate) use listed_names;

/// The columns of a list after its headers, on both backends. The error, the claimant and the
/// token are shown as their size when longer than ferry writes them (its errors are cut to
/// `untrusted::MAX_REASON`, 2048 bytes, before a prefix of names; an instance name is at most
/// `MAX_CLAIMANT`, 1024): written so by SQL, a page of them would otherwise be loaded whole.
macro_rules! listed_tail {
    () => {
        concat!(
            "status, attempts, max_attempts, event_time, created_at, last_status_at, next_attempt_at, processed_at, ",
            crate::store::shown_text!("last_error", "16384"),
            ", failure_reason, ",
            crate::store::shown_name!("claimed_by"),
            ", ",
            crate::store::shown_name!("claim_token"),
            ", lease_until, parent_id"
        )
    };
}
pub(crate) use listed_tail;

/// The columns [`Store::failed_groups`] selects, in the order its rows decode from.
pub(crate) const FAILED_GROUP_COLUMNS: &str = concat!(
    shown_name!("route"),
    ", ",
    shown_name!("event_type"),
    ", failure_reason AS reason, COUNT(*) AS events,
     MIN(last_status_at) AS first_failed_at, MAX(last_status_at) AS last_failed_at"
);

/// The grouping and order of [`Store::failed_groups`].
pub(crate) const FAILED_GROUP_ORDER: &str =
    "GROUP BY route, event_type, failure_reason ORDER BY events DESC, route, event_type, failure_reason";

/// One group of FAILED events as stored: read leniently, so a row ferry cannot represent shows
/// up in the summary (named by its defect) instead of failing it.
#[derive(Debug, sqlx::FromRow)]
pub(crate) struct FailedGroupRow {
    route: Lenient<String>,
    event_type: Lenient<String>,
    reason: Lenient<Option<String>>,
    events: i64,
    first_failed_at: Lenient<DbTime>,
    last_failed_at: Lenient<DbTime>,
}

impl FailedGroupRow {
    pub(crate) fn into_group(self) -> FailedGroup {
        let unreadable = |why: String| format!("(unreadable: {why})");
        FailedGroup {
            route: self.route.0.unwrap_or_else(unreadable),
            event_type: self.event_type.0.unwrap_or_else(unreadable),
            reason: self.reason.0.unwrap_or_else(|why| Some(unreadable(why))),
            count: u64::try_from(self.events).unwrap_or(0),
            first_failed_at: self.first_failed_at.0.ok().map(|t| t.0),
            last_failed_at: self.last_failed_at.0.ok().map(|t| t.0),
        }
    }
}

/// How an operator ends an event that is not finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndEvent<'a> {
    /// Delete it, with its history.
    Cancel,
    /// Make it FAILED with reason `operator` and `note` as its last error, kept for inspection
    /// and resend.
    Fail { note: &'a str },
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

/// The ids a bulk statement's `RETURNING id` gave, in id order.
pub(crate) fn ids_in_order(mut ids: Vec<i64>) -> Vec<i64> {
    ids.sort_unstable();
    ids
}

/// Rows changed per statement in bulk operations, so none holds locks for long.
pub const BULK_STEP: u32 = 1000;

/// Resends or purges every FAILED event matching `filter`, [`BULK_STEP`] rows per statement in id
/// order, calling `progress` with the running total after each step. Returns how many were
/// changed. Each step starts after the last id of the one before, so an event that fails again
/// while the operation runs is not taken a second time (nor, on a route that fails at once,
/// forever).
pub async fn bulk(
    store: &dyn Store,
    filter: &FailedFilter,
    op: BulkOp,
    now: impl Fn() -> DateTime<Utc>,
    mut progress: impl FnMut(u64),
) -> Result<u64, StoreError> {
    let mut filter = filter.clone();
    let mut done = 0;
    loop {
        let ids = match op {
            BulkOp::Resend => store.resend_failed(&filter, now(), BULK_STEP).await?,
            BulkOp::Purge => store.purge_failed(&filter, BULK_STEP).await?,
        };
        let Some(last) = ids.iter().max() else { return Ok(done) };
        filter.after_id = Some(*last);
        done += ids.len() as u64;
        progress(done);
    }
}

/// Longest claim lease ferry takes: `relay.lease` may not be longer.
pub const MAX_LEASE: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// How far a lease may end past `now` and still be one a ferry took: twice [`MAX_LEASE`], so the
/// clock of the instance that took it may run up to a day ahead of this one's. One ending later
/// was written by something else (an application's INSERT, a hand edit): left alone, it would
/// hold its event, and on an ordered route every later event of its key, for as long as it says.
pub fn lease_ceiling(now: DateTime<Utc>) -> DateTime<Utc> {
    crate::clock::later(now, MAX_LEASE * 2)
}

/// An event whose lease expired and that was handed back to PENDING.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovered {
    pub id: i64,
    /// The instance that held it, as its row says: made safe to log (control characters
    /// escaped, cut to [`MAX_CLAIMANT`] bytes). A row written by SQL can hold anything there (on
    /// SQLite a blob, a number or text that is not UTF-8); what cannot be read as text is shown
    /// with its bytes' invalid sequences replaced.
    pub claimed_by: Option<String>,
}

/// The longest instance name a recovery writes into `last_error` and hands back: longer ones,
/// which no ferry writes (an instance's name is its host's, its process id and a random part),
/// are described by their size, so a row given a name of a gigabyte by SQL neither makes the
/// statement fail (the message would pass the database's largest value) nor reaches the log.
pub const MAX_CLAIMANT: i64 = 1024;

/// How many stuck claims one recovery statement hands back at most; [`Relay::recover`] runs it
/// again while it comes back full, so each statement stays short (on SQLite it holds the one
/// writing connection, which every worker's outcomes wait for) and so does what it returns.
///
/// [`Relay::recover`]: crate::relay::Relay::recover
pub const RECOVER_BATCH: u32 = 1000;

impl Recovered {
    /// The instance name a recovery statement returned: at most [`MAX_CLAIMANT`] bytes of it, as
    /// text when it is UTF-8.
    pub(crate) fn new(id: i64, claimed_by: Option<Vec<u8>>) -> Recovered {
        let claimed_by =
            claimed_by.map(|name| crate::untrusted::clean(&String::from_utf8_lossy(&name), MAX_CLAIMANT as usize));
        Recovered { id, claimed_by }
    }
}

/// Where one step of retention's sweep looks: up to `limit` events in id order from id `from`
/// (inclusive), for those SENT before `before`. An event counts as young when written between
/// `before` and `now`: a creation time still to come (written by hand) does not end a sweep.
#[derive(Debug, Clone, Copy)]
pub struct SweepWindow {
    pub from: i64,
    pub limit: u32,
    pub before: DateTime<Utc>,
    pub now: DateTime<Utc>,
}

/// What one step of retention's sweep found: it looks at the events in id order from a given id
/// on, a window of them at a time, and deletes those of the window SENT before the cut-off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SweepStep {
    /// Events in the window: fewer than asked for means the sweep reached the end of the table.
    pub seen: u64,
    /// The window's highest id, where the next step goes on from (`None` when it was empty).
    pub last: Option<i64>,
    /// Whether every event of the window was written at or after the cut-off and not after now
    /// (`created_at`), so the sweep has reached the events too young to be deleted and starts
    /// again from the lowest id.
    pub young: bool,
    /// Events deleted.
    pub deleted: u64,
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
    async fn claim(&self, claim: &Claim) -> Result<Vec<ClaimedEvent>, StoreError> {
        self.claim_only(claim, None).await
    }

    /// [`Store::claim`] of event `id` alone, if the claim would take it.
    async fn claim_one(&self, claim: &Claim, id: i64) -> Result<Vec<ClaimedEvent>, StoreError> {
        self.claim_only(claim, Some(id)).await
    }

    /// [`Store::claim`], of event `only_id` alone when given (waiting briefly for its row where
    /// the backend locks rows, rather than skipping it).
    async fn claim_only(&self, claim: &Claim, only_id: Option<i64>) -> Result<Vec<ClaimedEvent>, StoreError>;

    /// The ids of the events `claim` would take, in its order, without taking them.
    async fn due(&self, claim: &Claim) -> Result<Vec<i64>, StoreError>;

    /// Sets PENDING event `id` FAILED (`invalid_event`, `error`): a claim of it alone was refused,
    /// so no claim could take it. Its history gets the failure, as by instance `by`, with no plugin
    /// and no time taken. Returns whether the row was written.
    async fn set_unclaimable(&self, id: i64, now: DateTime<Utc>, by: &str, error: &str) -> Result<bool, StoreError>;

    /// Records outcomes of the claim `token`. Rows no longer held by that claim (recovered and
    /// claimed again elsewhere) are left alone. Returns how many rows were updated.
    async fn complete(&self, token: &str, now: DateTime<Utc>, items: &[Completion]) -> Result<u64, StoreError>;

    /// Deletes the events `ids` of claim `token` (those it still holds), with their history:
    /// copies for a webhook endpoint that does not take their type, as if never made. Returns the
    /// ids deleted.
    async fn drop_copies(&self, token: &str, ids: &[i64]) -> Result<Vec<i64>, StoreError>;

    /// Hands events of claim `token` back to PENDING without counting the attempt (used at shutdown
    /// for a batch whose delivery did not finish within the grace period).
    async fn release(&self, token: &str, ids: &[i64], now: DateTime<Utc>) -> Result<u64, StoreError>;

    /// Moves PROCESSING events whose lease expired before `now` back to PENDING, and those whose
    /// lease no ferry could have taken (none, one it cannot read, one past [`lease_ceiling`]): up
    /// to `limit` of them, the oldest first. Each one's `last_error` names the instance that held
    /// it if that name is printable ASCII of at most [`MAX_CLAIMANT`] bytes (as every name a
    /// ferry writes from a host name is), and otherwise gives its size.
    async fn recover_expired(&self, now: DateTime<Utc>, limit: u32) -> Result<Vec<Recovered>, StoreError>;

    /// Makes due at `now` the PENDING events whose `next_attempt_at` was edited into a time the
    /// claim cannot compare (text or a blob on SQLite, `infinity` on PostgreSQL): never due, they
    /// would wait forever, and on an ordered route hold every later event of their key. Returns
    /// their ids.
    async fn reschedule_unreadable(&self, now: DateTime<Utc>) -> Result<Vec<i64>, StoreError>;

    /// Makes FAILED events PENDING again, due at `now`, with attempts and error reset (the
    /// operator's resend). Returns how many were FAILED and are now PENDING.
    async fn resend(&self, ids: &[i64], now: DateTime<Utc>) -> Result<u64, StoreError>;

    /// Makes PENDING event `id` due at `at` instead, its attempts untouched (the operator's
    /// reschedule; its status did not change, so neither does `last_status_at`). Returns whether
    /// it was PENDING.
    async fn reschedule(&self, id: i64, at: DateTime<Utc>) -> Result<bool, StoreError>;

    /// Ends event `id` by hand if it is PENDING or PROCESSING (see [`EndEvent`]); returns whether it
    /// was. The write is conditional on the status, so it cannot race a claim: a claim in flight
    /// loses its token, and the relay's late outcome is fenced off.
    async fn end_event(&self, id: i64, end: EndEvent<'_>, now: DateTime<Utc>) -> Result<bool, StoreError>;

    /// One step of retention's sweep: looks at the events of `window` and deletes those of them
    /// SENT before its cut-off (on PostgreSQL skipping any another transaction holds locked;
    /// SQLite locks the whole file, and waits for it up to its busy timeout). It reads the
    /// primary key, so no index of SENT rows is needed (keeping one cost every delivery a write);
    /// see `Relay::purge` for how steps make a sweep.
    async fn purge_sent(&self, window: &SweepWindow) -> Result<SweepStep, StoreError>;

    /// Where retention's sweep goes on from, kept in the database (`ferry_sweep`) so that a
    /// restarted relay goes on where the last left off and instances take turns moving it on;
    /// `i64::MIN`, a new sweep, when none is kept (or, on SQLite, when a hand edit left a value
    /// that is not an integer, which is then put back to it).
    async fn sweep_position(&self) -> Result<i64, StoreError>;

    /// Keeps `next` as where retention's sweep goes on from, if it was still `was` (another
    /// instance may have moved it on meanwhile; then its position stands) and no one holds the
    /// row locked (a hand edit in progress must not stall the relay). Returns whether it did.
    async fn set_sweep_position(&self, was: i64, next: i64) -> Result<bool, StoreError>;

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
    /// since then (the most recent [`LATENCY_SAMPLES`] of them). Without `count_sent`, SENT
    /// events are not counted (no route shows them), so only the partial indexes of the other
    /// statuses are read, however many SENT rows are retained.
    async fn stats(
        &self,
        now: DateTime<Utc>,
        latency_since: Option<DateTime<Utc>>,
        count_sent: bool,
    ) -> Result<Stats, StoreError>;

    /// The delivery history of event `id`, oldest first.
    async fn attempts(&self, id: i64) -> Result<Vec<AttemptRecord>, StoreError>;

    /// The oldest event of `route` and ordering `key` older than `id` that holds it back on an
    /// ordered route: PENDING or PROCESSING, or FAILED when `failed_blocks`. Its id and status.
    async fn ahead_in_key(
        &self,
        route: &str,
        key: &str,
        id: i64,
        failed_blocks: bool,
    ) -> Result<Option<(i64, Status)>, StoreError>;

    /// Number of events per status (statuses with no events are included as zero).
    async fn counts(&self) -> Result<BTreeMap<Status, u64>, StoreError>;

    /// One stored event, if it exists.
    async fn get(&self, id: i64) -> Result<Option<EventRecord>, StoreError>;

    /// The events event `id` was handed on as (one per destination), in id order, at most
    /// [`MAX_DELIVERIES_SHOWN`].
    async fn deliveries(&self, id: i64) -> Result<Vec<Delivery>, StoreError>;

    /// Hands on events claimed under `token` whose route has destinations: for each (event,
    /// destination routes) whose claim still holds, the event becomes SENT and each route gets a
    /// copy as a new PENDING event at `now` (its `parent_id` the event's id), in one transaction.
    /// Returns the ids of the events handed on.
    async fn fan_out(
        &self,
        token: &str,
        now: DateTime<Utc>,
        items: &[(i64, Vec<String>)],
    ) -> Result<Vec<i64>, StoreError>;

    /// How many FAILED events match `filter`.
    async fn count_failed(&self, filter: &FailedFilter) -> Result<u64, StoreError> {
        Ok(self.tally_failed(filter).await?.0)
    }

    /// How many FAILED events match `filter`, and the highest id among them.
    async fn tally_failed(&self, filter: &FailedFilter) -> Result<(u64, Option<i64>), StoreError>;

    /// Up to `limit` FAILED events matching `filter`, in id order.
    async fn list_failed(&self, filter: &FailedFilter, limit: u32) -> Result<Vec<EventRecord>, StoreError>;

    /// The FAILED events matching `filter` grouped by route, type and failure reason, largest
    /// group first, `limit` groups at most.
    async fn failed_groups(&self, filter: &FailedFilter, limit: u32) -> Result<Vec<FailedGroup>, StoreError>;

    /// Resends the first `limit` FAILED events matching `filter` in id order (as [`Store::resend`]
    /// does) and returns their ids; [`bulk`] calls it again after the last id until none is left.
    async fn resend_failed(
        &self,
        filter: &FailedFilter,
        now: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<i64>, StoreError>;

    /// Deletes the first `limit` FAILED events matching `filter` in id order; returns their ids.
    async fn purge_failed(&self, filter: &FailedFilter, limit: u32) -> Result<Vec<i64>, StoreError>;

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

    /// Gives a probe back without a verdict (there was no event to probe with, or it told
    /// nothing): the probe taken until `held_until`, so one another instance took since, once
    /// this one's lease had ended, is left alone.
    async fn release_probe(&self, route: &str, held_until: DateTime<Utc>) -> Result<(), StoreError>;

    /// Opens a route's breaker by hand, with `reason`, or closes it (resetting the count).
    async fn set_breaker(
        &self,
        route: &str,
        open: bool,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<Breaker, StoreError>;

    /// The stored webhook endpoints of `route` (of every route: `None`), ordered by id.
    async fn endpoints(&self, route: Option<&str>) -> Result<Vec<StoredEndpoint>, StoreError>;

    /// The stored endpoint `id`.
    async fn endpoint(&self, id: &str) -> Result<Option<StoredEndpoint>, StoreError>;

    /// Stores a new endpoint; false when its id is taken.
    async fn insert_endpoint(&self, endpoint: &StoredEndpoint) -> Result<bool, StoreError>;

    /// Replaces the body of endpoint `endpoint.id` if its body is still `before` (another change
    /// in between makes it false, and nothing is written), so concurrent updates cannot undo
    /// each other.
    async fn update_endpoint(&self, endpoint: &StoredEndpoint, before: &str) -> Result<bool, StoreError>;

    /// Deletes endpoint `id`; false when there is none.
    async fn delete_endpoint(&self, id: &str) -> Result<bool, StoreError>;
}

/// A webhook endpoint as stored: its id, its route and its body (JSON, read by
/// `crate::endpoints`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredEndpoint {
    pub id: String,
    pub route: String,
    pub body: String,
    /// What of the row could not be read (a column edited by hand into what is not text, such as
    /// a BLOB on SQLite), its value then empty: the endpoint cannot be used, and says why, but
    /// the other rows are read.
    pub unreadable: Option<String>,
}

impl<'r, R> FromRow<'r, R> for StoredEndpoint
where
    R: Row,
    &'static str: ColumnIndex<R>,
    Lenient<String>: Decode<'r, R::Database> + Type<R::Database>,
    Lenient<Option<String>>: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
{
    fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
        let mut defects = Vec::new();
        let mut column = |name: &'static str| -> Result<String, sqlx::Error> {
            Ok(row.try_get::<Lenient<String>, _>(name)?.or(name, String::new(), &mut defects))
        };
        let (id, route) = (column("id")?, column("route")?);
        // NULL when longer than ferry writes: not loaded.
        let body =
            match row.try_get::<Lenient<Option<String>>, _>("body")?.or("body", Some(String::new()), &mut defects) {
                Some(body) => body,
                None => {
                    let size = row.try_get::<Option<i64>, _>("body_size")?.unwrap_or_default();
                    defects.push(format!("its body is {size} bytes, more than the {MAX_STORED_BODY} ferry writes"));
                    String::new()
                }
            };
        Ok(Self { id, route, body, unreadable: (!defects.is_empty()).then(|| defects.join("; ")) })
    }
}

/// The longest endpoint body ferry writes is well under this (a unit test of `endpoints` builds
/// the largest one its checks accept); a row's body written longer by SQL is not loaded, and the
/// endpoint is held as unreadable.
pub const MAX_STORED_BODY: usize = 1 << 20;

/// The endpoint statements, written once with `$n` parameters (SQLite reads them too).
pub(crate) mod endpoint_sql {
    /// What each read selects: a body longer than [`MAX_STORED_BODY`](super::MAX_STORED_BODY)
    /// (1 MiB) comes as NULL beside its size, not loaded.
    macro_rules! columns {
        () => {
            "f.id, f.route, CASE WHEN octet_length(f.body) <= 1048576 THEN f.body END AS body,
             CAST(octet_length(f.body) AS BIGINT) AS body_size"
        };
    }
    /// Every route's first [`MAX_PER_ROUTE`](crate::endpoints::MAX_PER_ROUTE) endpoints by id, and
    /// one more, which tells that a route has more than ferry creates (rows written by SQL): the
    /// table a relay reads every second stays bounded however many rows there are.
    pub const LIST_ALL: &str = concat!(
        "SELECT ",
        columns!(),
        " FROM ferry_endpoints f
         JOIN (SELECT id, ROW_NUMBER() OVER (PARTITION BY route ORDER BY id) AS nth FROM ferry_endpoints) r
           ON r.id = f.id
         WHERE r.nth <= 1001
         ORDER BY f.id"
    );
    pub const LIST_ROUTE: &str =
        concat!("SELECT ", columns!(), " FROM ferry_endpoints f WHERE f.route = $1 ORDER BY f.id LIMIT 1001");
    pub const ONE: &str = concat!("SELECT ", columns!(), " FROM ferry_endpoints f WHERE f.id = $1");
    /// Binds id, route, body.
    pub const INSERT: &str =
        "INSERT INTO ferry_endpoints (id, route, body) VALUES ($1, $2, $3) ON CONFLICT (id) DO NOTHING";
    /// Binds id, the body before, the new body.
    pub const UPDATE: &str = "UPDATE ferry_endpoints SET body = $3 WHERE id = $1 AND body = $2";
    pub const DELETE: &str = "DELETE FROM ferry_endpoints WHERE id = $1";
}

/// The endpoint statements of a backend whose pool is `self.pool`, as inherent methods its
/// [`Store`] methods call.
macro_rules! endpoint_queries {
    ($store:ty) => {
        impl $store {
            async fn select_endpoints(&self, route: Option<&str>) -> Result<Vec<StoredEndpoint>, StoreError> {
                use crate::store::endpoint_sql::{LIST_ALL, LIST_ROUTE};
                Ok(match route {
                    None => sqlx::query_as(LIST_ALL).fetch_all(&self.pool).await?,
                    Some(route) => sqlx::query_as(LIST_ROUTE).bind(route).fetch_all(&self.pool).await?,
                })
            }

            async fn select_endpoint(&self, id: &str) -> Result<Option<StoredEndpoint>, StoreError> {
                Ok(sqlx::query_as(crate::store::endpoint_sql::ONE).bind(id).fetch_optional(&self.pool).await?)
            }

            async fn write_endpoint(&self, sql: &str, e: &StoredEndpoint, third: &str) -> Result<bool, StoreError> {
                let done = sqlx::query(sql).bind(&e.id).bind(third).bind(&e.body).execute(&self.pool).await?;
                Ok(done.rows_affected() == 1)
            }

            async fn remove_endpoint(&self, id: &str) -> Result<bool, StoreError> {
                let done = sqlx::query(crate::store::endpoint_sql::DELETE).bind(id).execute(&self.pool).await?;
                Ok(done.rows_affected() == 1)
            }
        }
    };
}
pub(crate) use endpoint_queries;

/// A database URL with any password replaced, for error messages and logs: the one in the
/// authority (which may itself contain `@`) and a `password=` query parameter.
pub fn redact_url(url: &str) -> String {
    mask_url(url, false, "***", |name| name.eq_ignore_ascii_case("password"))
}

/// `url` with `***` in place of its password (or, with `whole_user`, of all its user
/// information), and `mask` in place of the value of every query parameter `secret` names. Text
/// that is not a URL comes back as it is.
pub fn mask_url(url: &str, whole_user: bool, mask: &str, secret: impl Fn(&str) -> bool) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let (authority, tail) = rest.find(['/', '?']).map_or((rest, ""), |i| rest.split_at(i));
    let authority = match authority.rsplit_once('@') {
        Some((_, host)) if whole_user => format!("***@{host}"),
        Some((auth, host)) => match auth.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{host}"),
            None => format!("{auth}@{host}"),
        },
        None => authority.to_string(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if secret(key) => format!("{key}={mask}"),
                    _ => pair.to_string(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_string(),
    };
    format!("{scheme}://{authority}{tail}")
}

/// Called by a worker that just gave back one of the relay's connections (a PostgreSQL lane, the
/// SQLite writer): lets the worker that was waiting for it take it now. Woken by the release,
/// that worker is queued in the slot the runtime keeps for the next task of this thread, which
/// other threads cannot take, so it would wait for as long as this one runs on without waiting
/// (decoding a batch, calling its plugin), a few hundred microseconds in which the connection did
/// nothing: 7% of each PostgreSQL lane's time, and SQLite's writer 5% slower (BENCHMARKS.md).
async fn handed_on() {
    tokio::task::yield_now().await;
}

/// Opens the store named by `url` (`sqlite://…` or `postgres://…`) with a pool of
/// `max_connections` and, on PostgreSQL, the default relay connections. See [`open`].
pub async fn connect(url: &str, max_connections: u32, create: bool) -> Result<Arc<dyn Store>, StoreError> {
    let relay_connections = postgres::DEFAULT_RELAY_CONNECTIONS;
    open(&DatabaseConfig { url: url.to_string(), max_connections, relay_connections }, create).await
}

/// Opens the store of `database` (`sqlite://…` or `postgres://…`). A missing SQLite file is
/// created when `create` is set, and an error naming the path otherwise. Does not migrate.
pub async fn open(database: &DatabaseConfig, create: bool) -> Result<Arc<dyn Store>, StoreError> {
    let (url, pool) = (database.url.as_str(), database.max_connections);
    match (url.starts_with("sqlite:"), create) {
        (true, true) => Ok(Arc::new(SqliteStore::connect(url, pool).await?)),
        (true, false) => Ok(Arc::new(SqliteStore::connect_existing(url, pool).await?)),
        (false, _) => {
            let store = PostgresStore::connect(url, pool).await?;
            Ok(Arc::new(store.with_relay_connections(database.relay_connections)))
        }
    }
}

/// The statement of [`Store::ahead_in_key`], on either backend (public so a test can check its
/// plan); it reads the `ferry_events_key` index (route, key, id over unfinished events). It states
/// the index's condition (`status <> 'SENT'`) although the status list implies it: SQLite does not
/// derive it, and would walk every older row by id instead.
pub fn ahead_in_key_sql(failed_blocks: bool) -> &'static str {
    if failed_blocks {
        "SELECT id, status FROM ferry_events WHERE route = $1 AND ordering_key = $2 AND id < $3
         AND status <> 'SENT' AND status IN ('PENDING', 'PROCESSING', 'FAILED') ORDER BY id LIMIT 1"
    } else {
        "SELECT id, status FROM ferry_events WHERE route = $1 AND ordering_key = $2 AND id < $3
         AND status <> 'SENT' AND status IN ('PENDING', 'PROCESSING') ORDER BY id LIMIT 1"
    }
}

/// Reads the breakers' rows one by one. A row that cannot be read (a value edited by hand that
/// ferry cannot represent: text in a time column, an infinite time, a count past 2^32) holds its
/// route as if opened by hand, its reason saying what is wrong and how to mend it, rather than
/// failing every cycle of every route and every listing. A row whose route itself cannot be read
/// names no configured route, and is left out.
fn breakers_from<R>(rows: &[R]) -> Vec<Breaker>
where
    R: Row,
    for<'r> Breaker: FromRow<'r, R>,
    &'static str: ColumnIndex<R>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
{
    rows.iter()
        .filter_map(|row| match Breaker::from_row(row) {
            Ok(breaker) => Some(breaker),
            Err(e) => {
                let route: String = row.try_get("route").ok()?;
                let reason = format!(
                    "this route's row in ferry_breakers cannot be read ({e}); the route is held until \
                     `ferry breaker close {route}` rewrites it (for a route no longer configured, delete the row)"
                );
                // When it opened is unknown: the epoch says so rather than invent a time.
                let unknown = DateTime::<Utc>::UNIX_EPOCH;
                Some(Breaker {
                    opened_at: Some(unknown),
                    reason: Some(reason),
                    manual: true,
                    ..Breaker::closed(&route, unknown)
                })
            }
        })
        .collect()
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

/// Decodes the rows a claim returned, in claim order. They are read by position, so the columns'
/// names are checked first, once: a claim statement that returned others is a defect of ferry's,
/// which fails the cycle rather than read one column as another (the claimed events come back
/// when their lease expires).
///
/// A row that cannot be decoded (a column holding what ferry cannot represent) still comes back,
/// as an event whose defect names the column, so the relay fails it alone instead of losing the
/// whole batch.
///
/// With `types_per_value` (SQLite, whose values carry types of their own) every value is checked
/// against the type it is read as; otherwise (PostgreSQL, where every row has the types the
/// statement declares) the declared types are, once.
fn claimed_events<R>(rows: &[R], max_payload: u64, types_per_value: bool) -> Result<Vec<ClaimedEvent>, StoreError>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> String: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> Count: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> MaybeCount: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> DbTime: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> bool: Decode<'r, R::Database> + Type<R::Database>,
{
    if let Some(first) = rows.first() {
        let names = || first.columns().iter().map(sqlx::Column::name);
        if !names().eq(CLAIMED_COLUMNS) {
            return Err(StoreError::Database(sqlx::Error::Protocol(format!(
                "the claim returned the columns {:?}, not {CLAIMED_COLUMNS:?}",
                names().collect::<Vec<_>>()
            ))));
        }
        if !types_per_value {
            ClaimedRow::check_declared_types(first).map_err(|why| {
                StoreError::Database(sqlx::Error::Protocol(format!("the claim {why}, which ferry does not read it as")))
            })?;
        }
    }
    let decode = |row: &R| match ClaimedRow::decode(row, types_per_value) {
        Ok(decoded) => (decoded.next_attempt_at, decoded.into_event(max_payload)),
        Err(e) => {
            // The columns are the claim's (checked above): the id and the route come first.
            let id: i64 = row.try_get(0).unwrap_or(0);
            let route: String = row.try_get(1).unwrap_or_default();
            let defect = match e {
                sqlx::Error::ColumnDecode { index, source } => {
                    format!("event {id}: column {} cannot be read: {source}", index.trim_matches('"'))
                }
                other => format!("event {id}: {other}"),
            };
            (DateTime::<Utc>::MIN_UTC, ClaimedEvent::defective(id, route, defect))
        }
    };
    Ok(in_claim_order(rows.iter().map(decode).collect()))
}

/// Sorts claimed rows into claim order (due time, then id): RETURNING does not keep the
/// sub-select's order.
fn in_claim_order(mut claimed: Vec<(DateTime<Utc>, ClaimedEvent)>) -> Vec<ClaimedEvent> {
    claimed.sort_by_key(|(due, event)| (*due, event.id));
    claimed.into_iter().map(|(_, event)| event).collect()
}

/// Splits completions by kind so each kind is written with one statement.
#[derive(Debug, Default)]
struct Partitioned<'a> {
    sent: Vec<&'a Completion>,
    /// Retries and deferrals (see [`refund`]): PENDING again at a time.
    retry: Vec<(&'a Completion, DateTime<Utc>, &'a str)>,
    failed: Vec<(&'a Completion, &'static str, &'a str)>,
}

/// The successes of one plugin call, recorded with one statement that finds their rows by claim
/// token, route and the call's lowest and highest id instead of by id.
#[derive(Debug)]
struct SentCall<'a> {
    call: &'a CallLog,
    /// The attempt limit pinned on rows that have none yet.
    max_attempts: u32,
    /// The events the call delivered, sorted.
    ids: Vec<i64>,
    /// Whether `ids` are every id from the lowest to the highest (the common case: one route's
    /// events, claimed in order). Ids are unique (the primary key), so the rows the statement can
    /// write are then a subset of the call's events, and their number alone proves they are
    /// exactly them: no id needs to come back.
    one_run: bool,
}

/// The number of rows a statement wrote, from either backend's result.
trait RowsWritten {
    fn rows_written(&self) -> u64;
}

impl RowsWritten for sqlx::sqlite::SqliteQueryResult {
    fn rows_written(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsWritten for sqlx::postgres::PgQueryResult {
    fn rows_written(&self) -> u64 {
        self.rows_affected()
    }
}

impl SentCall<'_> {
    /// The lowest and highest id of the call's events, which bound the rows the statement may
    /// write. A call has at least one event; (0, -1) would bound none.
    fn bounds(&self) -> (i64, i64) {
        (self.ids.first().copied().unwrap_or(0), self.ids.last().copied().unwrap_or(-1))
    }

    /// The statement that records the call by token, from `base` (which bounds the ids by
    /// [`SentCall::bounds`]): as it is when the call is one run, with `RETURNING id` otherwise.
    fn statement(&self, base: &'static str) -> std::borrow::Cow<'static, str> {
        if self.one_run { base.into() } else { format!("{base} RETURNING id").into() }
    }

    /// Runs `query` (made from [`SentCall::statement`]) in `tx`: whether it wrote exactly the
    /// call's events.
    async fn write<'q, DB>(
        &self,
        tx: &mut sqlx::Transaction<'_, DB>,
        query: sqlx::query::Query<'q, DB, <DB as sqlx::Database>::Arguments<'q>>,
    ) -> Result<bool, StoreError>
    where
        DB: sqlx::Database,
        DB::QueryResult: RowsWritten,
        for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
        <DB as sqlx::Database>::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
        i64: Type<DB> + for<'r> Decode<'r, DB>,
        usize: ColumnIndex<DB::Row>,
    {
        if self.one_run {
            let rows = query.execute(&mut **tx).await?.rows_written();
            return Ok(rows == self.ids.len() as u64);
        }
        let rows = query.fetch_all(&mut **tx).await?;
        let found: Vec<i64> = rows.iter().map(|row| row.try_get(0)).collect::<Result<_, _>>()?;
        Ok(found.len() == self.ids.len() && found.iter().all(|id| self.ids.binary_search(id).is_ok()))
    }
}

/// Most plugin calls whose successes are recorded by claim token, one statement each; a batch of
/// more (events of many routes, such as a route's webhook endpoints) is recorded by id, in one.
const MAX_CALLS_BY_TOKEN: usize = 8;

/// Groups a batch's successes by plugin call, when each group can be recorded by claim token and
/// route: no two calls of the same route (as when a faulting batch was split), one attempt limit
/// per call, and at most [`MAX_CALLS_BY_TOKEN`] calls. `None` when that does not hold; the
/// successes are then recorded by id.
///
/// Recording by token relies on every other row of the claim having left PROCESSING first (the
/// retries and failures are written before the successes). Each statement must have written
/// exactly the call's events (by count when they are one run of ids, by the ids it returns
/// otherwise): if not (a row the batch has no outcome for, a row fenced off) the transaction is
/// rolled back and written again by id, so the shortcut never decides an outcome. A batch whose
/// only outcomes are one call's run needs no transaction ([`RecordOutcomes::record_run`]).
fn sent_by_call<'a>(sent: &[&'a Completion]) -> Option<Vec<SentCall<'a>>> {
    let mut calls: Vec<SentCall<'a>> = Vec::new();
    for completion in sent {
        let call: &'a CallLog = &completion.attempt.call;
        match calls.iter().position(|c| std::ptr::eq(c.call, call)) {
            Some(i) if calls[i].max_attempts == completion.max_attempts => calls[i].ids.push(completion.id),
            Some(_) => return None,
            None if calls.iter().any(|c| c.call.route == call.route) => return None,
            None if calls.len() == MAX_CALLS_BY_TOKEN => return None,
            None => calls.push(SentCall {
                call,
                max_attempts: completion.max_attempts,
                ids: vec![completion.id],
                one_run: false,
            }),
        }
    }
    for c in &mut calls {
        c.ids.sort_unstable();
        c.one_run = c.ids.windows(2).all(|pair| pair[0].checked_add(1) == Some(pair[1]));
    }
    Some(calls)
}

/// How many of an event's deliveries `ferry show` lists.
pub const MAX_DELIVERIES_SHOWN: u32 = 100;

/// One event an event was handed on as, for a destination.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct Delivery {
    pub id: i64,
    pub route: String,
    pub status: String,
    pub attempts: i64,
}

/// The (event, route) pairs of `items` whose event is in `handed`, in order: the copies to insert.
fn copies<'a>(items: &'a [(i64, Vec<String>)], handed: &[i64]) -> Vec<(i64, &'a str)> {
    let handed: std::collections::HashSet<i64> = handed.iter().copied().collect();
    items
        .iter()
        .filter(|(id, _)| handed.contains(id))
        .flat_map(|(id, routes)| routes.iter().map(move |route| (*id, route.as_str())))
        .collect()
}

/// How a backend writes a batch's outcomes in one transaction: retries and failures by id, then
/// the successes — by claim token and route for each of `by_token`'s calls, or by id — then the
/// history rows of the retries and failures. `None` (nothing written) when a statement by token
/// did not find exactly the rows its call delivered.
trait RecordOutcomes {
    async fn record(
        &self,
        token: &str,
        now: DateTime<Utc>,
        parts: &Partitioned<'_>,
        by_token: Option<&[SentCall<'_>]>,
    ) -> Result<Option<u64>, StoreError>;

    /// Records `run`, the successes of a batch's only plugin call and its only outcomes, one run
    /// of ids, with its statement by token alone, committed on its own: no transaction to open
    /// and close, two round trips fewer for the common case. Returns how many rows it wrote:
    /// those of the call's events the claim still holds.
    async fn record_run(&self, token: &str, now: DateTime<Utc>, run: &SentCall<'_>) -> Result<u64, StoreError>;
}

/// [`Store::complete`] for both backends: successes by token where [`sent_by_call`] allows, and
/// by id when it does not or when the shortcut found other rows than the batch's.
async fn complete_batch(
    store: &impl RecordOutcomes,
    token: &str,
    now: DateTime<Utc>,
    items: &[Completion],
) -> Result<u64, StoreError> {
    let parts = partition(items);
    if let Some(calls) = sent_by_call(&parts.sent) {
        if let [run] = calls.as_slice()
            && run.one_run
            && parts.retry.is_empty()
            && parts.failed.is_empty()
        {
            // The statement can write only the call's own events (the run is every id between
            // its bounds), so what it wrote stands on its own. Rows it did not find are written
            // by id, which finds any still held (one whose route was changed by hand); those
            // fenced off are found by neither.
            let written = store.record_run(token, now, run).await?;
            if written == run.ids.len() as u64 {
                return Ok(written);
            }
            tracing::debug!(
                token,
                "the claim's rows differ from its batch (some fenced off); recording the rest by id"
            );
            return Ok(written + store.record(token, now, &parts, None).await?.unwrap_or_default());
        }
        if let Some(written) = store.record(token, now, &parts, Some(&calls)).await? {
            return Ok(written);
        }
        tracing::debug!(token, "the claim's rows differ from its batch (some fenced off); recording successes by id");
    }
    Ok(store.record(token, now, &parts, None).await?.unwrap_or_default())
}

/// The distinct plugin calls of `items`, and for each item the 1-based index of its call: what
/// describes a call (start, duration, plugin, instance) is sent once per call, not once per event.
fn calls_of<'a>(items: &[&'a Completion]) -> (Vec<&'a CallLog>, Vec<i32>) {
    let mut calls: Vec<&'a CallLog> = Vec::new();
    let index = items
        .iter()
        .map(|item| {
            let call: &'a CallLog = &item.attempt.call;
            let n = calls.iter().position(|c| std::ptr::eq(*c, call)).unwrap_or_else(|| {
                calls.push(call);
                calls.len() - 1
            });
            i32::try_from(n + 1).unwrap_or(i32::MAX)
        })
        .collect();
    (calls, index)
}

/// A call's duration in whole milliseconds, as stored.
fn duration_ms(call: &CallLog) -> i64 {
    i64::try_from(call.duration.as_millis()).unwrap_or(i64::MAX)
}

/// The FAILED outcomes that were written (`written`: not fenced off) and go on to a dead-letter
/// route: (event id, route).
fn dead_letters<'a>(parts: &Partitioned<'a>, written: &std::collections::HashSet<i64>) -> Vec<(i64, &'a str)> {
    parts
        .failed
        .iter()
        .filter(|(c, _, _)| written.contains(&c.id))
        .filter_map(|(c, _, _)| Some((c.id, c.dead_letter.as_deref()?)))
        .collect()
}

/// The events whose deferral was written (`written`: not fenced off), with the attempt number it
/// was made in. Before its new history row is inserted, each loses a `deferred` row that is its
/// latest and was made in the same attempt: a run of deferrals keeps one row, the last, so a
/// plugin that defers again and again cannot grow the history without end.
fn deferrals_written(parts: &Partitioned<'_>, written: &std::collections::HashSet<i64>) -> Vec<(i64, i32)> {
    parts
        .retry
        .iter()
        .filter(|(c, _, _)| refund(c) == 1 && written.contains(&c.id))
        .map(|(c, _, _)| (c.id, i32::try_from(c.attempt.number).unwrap_or(i32::MAX)))
        .collect()
}

/// Writes `letters` (FAILED event, dead-letter route) in the outcomes' transaction with the
/// statement `copy` makes: all at once or, should the database refuse one, one at a time behind
/// savepoints, so only the refused ones are lost (logged), and the outcomes are written either way.
async fn copy_dead_letters<DB, F>(
    tx: &mut sqlx::Transaction<'_, DB>,
    letters: &[(i64, &str)],
    copy: F,
) -> Result<(), StoreError>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as sqlx::Database>::Arguments<'static>: sqlx::IntoArguments<'static, DB>,
    F: Fn(&[(i64, &str)]) -> sqlx::query::Query<'static, DB, <DB as sqlx::Database>::Arguments<'static>>,
{
    if letters.is_empty() {
        return Ok(());
    }
    let batches: Vec<&[(i64, &str)]> = std::iter::once(letters).chain(letters.chunks(1)).collect();
    for (n, batch) in batches.into_iter().enumerate() {
        let mut savepoint = sqlx::Connection::begin(&mut **tx).await?;
        let written = copy(batch).execute(&mut *savepoint).await;
        match written {
            Ok(_) => {
                savepoint.commit().await?;
                if n == 0 {
                    return Ok(());
                }
            }
            Err(error) => {
                savepoint.rollback().await?;
                if n > 0 {
                    dead_letter_lost(batch[0], &error);
                }
            }
        }
    }
    Ok(())
}

/// Logs a dead letter the database refused: the outcomes are still written, and the event stays
/// FAILED where it is, kept for inspection and resend.
fn dead_letter_lost((id, route): (i64, &str), error: &sqlx::Error) {
    tracing::error!(
        event = id,
        dead_letter = route,
        "dead letter not written, the event stays FAILED on its own route (`ferry show {id}`): {error}"
    );
}

/// How many attempts writing `completion` gives back: the claim counted one, and a deferral is
/// not an attempt.
fn refund(completion: &Completion) -> i32 {
    i32::from(matches!(completion.disposition, crate::event::Disposition::Deferred { .. }))
}

fn partition(items: &[Completion]) -> Partitioned<'_> {
    use crate::event::Disposition;
    let mut p = Partitioned::default();
    for item in items {
        match &item.disposition {
            Disposition::Sent => p.sent.push(item),
            // A deferral is written like a retry, with the claim's attempt given back.
            Disposition::Retry { at, error } | Disposition::Deferred { at, error } => p.retry.push((item, *at, error)),
            Disposition::Failed { reason, error } => p.failed.push((item, reason.as_str(), error)),
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn a_store_opened_without_settings_has_the_default_relay_connections() {
        let defaults = crate::config::Config::defaults();
        assert_eq!(defaults.database.relay_connections, super::postgres::DEFAULT_RELAY_CONNECTIONS);
    }

    #[test]
    fn passwords_never_reach_a_message() {
        let cases = [
            ("postgres://u:secret@h:5432/db", "postgres://u:***@h:5432/db"),
            ("postgres://u:p@ss@word@h/db", "postgres://u:***@h/db"),
            ("postgres://u@h/db?password=secret&sslmode=require", "postgres://u@h/db?password=***&sslmode=require"),
            ("sqlite://ferry.db", "sqlite://ferry.db"),
            ("not a url", "not a url"),
        ];
        for (url, shown) in cases {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }

    /// The claim binds its size limits; lists, the failed summary, `ferry show` and migration 11
    /// write them into their SQL: they are the same numbers.
    #[test]
    fn statements_limit_names_and_headers_as_the_claim_does() {
        let (name, headers) = (crate::event::MAX_CLAIMED_NAME, crate::event::MAX_CLAIMED_HEADERS);
        let names = ["route", "event_type", "ordering_key", "content_type"];
        for sql in [super::postgres::LIST_COLUMNS, super::sqlite::LIST_COLUMNS] {
            for column in names {
                assert!(sql.contains(&format!("octet_length({column}) <= {name} THEN {column}")), "{column}: {sql}");
            }
        }
        for column in ["route", "event_type"] {
            assert!(super::FAILED_GROUP_COLUMNS.contains(&format!("octet_length({column}) <= {name} THEN {column}")));
        }
        for sql in [super::postgres::LIST_COLUMNS, super::postgres::EVENT_COLUMNS] {
            assert!(sql.contains(&format!("ferry_headers_text(headers, {headers})")), "{sql}");
        }
        assert!(super::sqlite::LIST_COLUMNS.contains(&format!("octet_length(headers) <= {headers} THEN headers")));
        // What ferry writes into the tail's columns is listed whole.
        assert!(super::MAX_CLAIMANT <= name && crate::untrusted::MAX_REASON + 2 * name as usize <= 16384);
        for sql in [super::postgres::LIST_COLUMNS, super::sqlite::LIST_COLUMNS] {
            for column in ["claimed_by", "claim_token"] {
                assert!(sql.contains(&format!("octet_length({column}) <= {name} THEN {column}")), "{column}: {sql}");
            }
            assert!(sql.contains("octet_length(last_error) <= 16384 THEN last_error"), "{sql}");
        }
        let migration = include_str!("../../../migrations/postgres/0011_header_size.sql");
        assert_eq!(migration.matches(&format!("> {headers}")).count(), 4, "the trigger's checks and message");
    }

    /// Claimed rows are read by position: rows whose columns are not the claim's, in its order,
    /// are refused before any is read, rather than decoded one column as another.
    #[tokio::test]
    async fn claimed_rows_are_read_only_with_the_claims_columns() {
        use sqlx::Connection as _;
        let mut db = sqlx::SqliteConnection::connect("sqlite::memory:").await.unwrap();
        let in_order = "7 AS id, 'r' AS route, 't' AS event_type, NULL AS ordering_key, x'7b7d' AS payload, \
             2 AS payload_size, 'application/json' AS content_type, '{}' AS headers, 1 AS attempts, \
             NULL AS max_attempts, 1000 AS event_time, 2000 AS created_at, 3000 AS next_attempt_at, \
             NULL AS key_oversized";
        let rows = sqlx::query(&format!("SELECT {in_order}")).fetch_all(&mut db).await.unwrap();
        let events = super::claimed_events(&rows, 1024, true).unwrap();
        assert_eq!(events.len(), 1);
        let event = &events[0];
        assert_eq!((event.id, event.route.as_str(), event.event_type.as_str()), (7, "r", "t"));
        assert_eq!((event.payload.as_slice(), event.attempt, event.max_attempts), (&b"{}"[..], 1, None));
        assert_eq!((event.event_time.timestamp_millis(), event.created_at.timestamp_millis()), (1000, 2000));
        assert!(event.defect.is_none(), "{:?}", event.defect);
        // Two columns of the same type swapped: by position, each would read as the other.
        let swapped = in_order.replace("'r' AS route, 't' AS event_type", "'t' AS event_type, 'r' AS route");
        let rows = sqlx::query(&format!("SELECT {swapped}")).fetch_all(&mut db).await.unwrap();
        let unchecked = super::ClaimedRow::decode(&rows[0], true).unwrap().into_event(1024);
        assert_eq!((unchecked.route.as_str(), unchecked.event_type.as_str()), ("t", "r"), "read by position");
        let error = super::claimed_events(&rows, 1024, true).unwrap_err().to_string();
        assert!(error.contains("\"event_type\", \"route\"") && error.contains("not [\"id\", \"route\""), "{error}");
        // A value that does not decode is named by its column, as when columns were read by name.
        let unreadable = in_order.replace("1000 AS event_time", "'yesterday' AS event_time");
        let rows = sqlx::query(&format!("SELECT {unreadable}")).fetch_all(&mut db).await.unwrap();
        let events = super::claimed_events(&rows, 1024, true).unwrap();
        let defect = events[0].defect.as_deref().unwrap_or_default();
        assert!(defect.starts_with("event 7: column event_time cannot be read"), "{defect}");
        // SQLite's values carry their own types: a later row's is checked as the first's is.
        let second = unreadable.replace("7 AS id", "8 AS id");
        let rows =
            sqlx::query(&format!("SELECT {in_order} UNION ALL SELECT {second}")).fetch_all(&mut db).await.unwrap();
        let events = super::claimed_events(&rows, 1024, true).unwrap();
        let defects: Vec<(i64, Option<&str>)> = events.iter().map(|e| (e.id, e.defect.as_deref())).collect();
        assert!(
            matches!(defects[..], [(8, Some(d)), (7, None)] if d.starts_with("event 8: column event_time")),
            "{defects:?}"
        );
        // A value the claim did not load for its size is named, with the limit.
        for (unloaded, named) in [
            (in_order.replace("'{}' AS headers", "NULL AS headers"), "its headers print in more than the 131072 bytes"),
            (
                in_order.replace("'t' AS event_type", "NULL AS event_type"),
                "its event_type is longer than the 1024 bytes",
            ),
            (
                in_order.replace("NULL AS key_oversized", "1 AS key_oversized"),
                "its ordering_key is longer than the 1024",
            ),
        ] {
            let rows = sqlx::query(&format!("SELECT {unloaded}")).fetch_all(&mut db).await.unwrap();
            let events = super::claimed_events(&rows, 1024, true).unwrap();
            let defect = events[0].defect.as_deref().unwrap_or_default();
            assert!(defect.starts_with(&format!("event 7: {named}")) && defect.contains("not loaded"), "{defect}");
        }
        // Of several findings the last in this order is named: headers that do not parse, an empty
        // name, a value not loaded (the first of the claim's columns), a payload over the limit.
        let several =
            |edits: &[(&str, &str)]| edits.iter().fold(in_order.to_string(), |row, (from, to)| row.replace(from, to));
        for (edits, named) in [
            (
                vec![("'{}' AS headers", "'[' AS headers"), ("'t' AS event_type", "'' AS event_type")],
                "event_type is empty",
            ),
            (
                vec![("'t' AS event_type", "'' AS event_type"), ("'{}' AS headers", "NULL AS headers")],
                "its headers print",
            ),
            (vec![("'r' AS route", "NULL AS route"), ("'application/json'", "NULL")], "its route is longer"),
            (
                vec![("NULL AS key_oversized", "1 AS key_oversized"), ("x'7b7d' AS payload", "NULL AS payload")],
                "the payload is 2",
            ),
        ] {
            let rows = sqlx::query(&format!("SELECT {}", several(&edits))).fetch_all(&mut db).await.unwrap();
            let events = super::claimed_events(&rows, 1024, true).unwrap();
            let defect = events[0].defect.as_deref().unwrap_or_default();
            assert!(defect.starts_with(&format!("event 7: {named}")), "{edits:?}: {defect}");
        }
        // An id the outbox never assigns would reach plugins as 0, the same for every such row.
        for id in ["0", "-3"] {
            let row = several(&[("7 AS id", &format!("{id} AS id")), ("x'7b7d' AS payload", "NULL AS payload")]);
            let rows = sqlx::query(&format!("SELECT {row}")).fetch_all(&mut db).await.unwrap();
            let events = super::claimed_events(&rows, 1024, true).unwrap();
            let defect = events[0].defect.as_deref().unwrap_or_default();
            assert!(defect.starts_with(&format!("event {id}: its id is not positive")), "{defect}");
        }
    }

    /// Only what may well not happen again is tried again: a busy SQLite file and a failed
    /// connection, not a constraint, a pool that timed out or was closed.
    #[tokio::test]
    async fn only_errors_that_may_pass_are_transient() {
        use sqlx::Connection as _;
        use std::str::FromStr as _;
        let dir = tempfile::tempdir().unwrap();
        let options =
            sqlx::sqlite::SqliteConnectOptions::from_str(&format!("sqlite://{}", dir.path().join("t.db").display()))
                .unwrap()
                .create_if_missing(true)
                .busy_timeout(std::time::Duration::ZERO);
        let mut holder = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
        let mut other = sqlx::SqliteConnection::connect_with(&options).await.unwrap();
        sqlx::query("CREATE TABLE t (x INTEGER CHECK (x > 0))").execute(&mut holder).await.unwrap();
        let refused =
            super::StoreError::from(sqlx::query("INSERT INTO t VALUES (-1)").execute(&mut holder).await.unwrap_err());
        assert!(refused.is_refusal() && !refused.is_transient(), "{refused}");
        sqlx::query("BEGIN EXCLUSIVE").execute(&mut holder).await.unwrap();
        let busy =
            super::StoreError::from(sqlx::query("INSERT INTO t VALUES (1)").execute(&mut other).await.unwrap_err());
        assert!(busy.is_transient() && !busy.is_refusal(), "{busy}");
        let dropped = super::StoreError::from(sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into()));
        assert!(dropped.is_transient());
        for lasting in [sqlx::Error::PoolTimedOut, sqlx::Error::PoolClosed] {
            assert!(!super::StoreError::from(lasting).is_transient());
        }
    }
}
