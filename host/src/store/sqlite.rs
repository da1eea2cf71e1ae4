//! The SQLite store: the embedded default. One file, WAL journal, timestamps as integer
//! milliseconds; batches of ids and outcomes reach SQL as JSON arrays (`json_each`). SQLite has a
//! single writer, so a claim is one `UPDATE … RETURNING` statement that takes the write lock
//! before it reads, which makes concurrent claimers (threads or processes) see disjoint batches.
//! The relay's own writes go through one connection of their own ([`Writer`]); reads and the
//! operators' commands use the pool.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, Row, SqlitePool};

use ferry_outbox::Outbox;

use super::writer::{Writer, Writing};
use super::{
    ATTEMPTS_SQL, Breaker, Claim, Delivery, EndEvent, FAILED_GROUP_COLUMNS, FAILED_GROUP_ORDER, FailedFilter,
    FailedGroup, FailedGroupRow, LATENCY_SAMPLES, LATENCY_SQL, MAX_CLAIMANT, MAX_DELIVERIES_SHOWN, Partitioned,
    ROUTE_COUNTS_SQL, ReasonFilter, RecordOutcomes, Recovered, SentCall, Stats, Store, StoreError, StoredEndpoint,
    SweepStep, SweepWindow, UNFINISHED_COUNTS_SQL, WATCH_SQL, claimed_events, complete_batch, copies,
    copy_dead_letters, counts_by_status, dead_letters, deferrals_written, duration_ms, ids_in_order, lease_ceiling,
    refund, stats_from,
};
use crate::event::{AttemptRecord, ClaimedEvent, Completion, EventRecord, NewEvent, Status, StoredRow};

/// The outbox in a SQLite database file.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    /// Reads, and the writes of commands and applications.
    pool: SqlitePool,
    /// The relay's writes (claims, outcomes, hand-backs and hand-ons, breakers, recovery,
    /// retention), one at a time, on a connection of their own ([`Writer`]).
    writer: Arc<Writer>,
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `url` (`sqlite://PATH`).
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        Self::open(url, max_connections, true).await
    }

    /// Opens the database at `url`, which must exist: commands that only read or change events
    /// never create a database (or its directory) because of a mistyped path.
    pub async fn connect_existing(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        Self::open(url, max_connections, false).await
    }

    async fn open(url: &str, max_connections: u32, create: bool) -> Result<Self, StoreError> {
        let connect_error = |source| StoreError::Connect { url: url.to_string(), source };
        let memory = MemoryUrl::of(url);
        if let Some(why) = memory.per_connection {
            return Err(connect_error(sqlx::Error::Configuration(
                format!(
                    "{why} is a different, empty database on each connection, and ferry uses several; \
                     name a file, or use sqlite::memory: (one in-memory database the connections share)"
                )
                .into(),
            )));
        }
        if memory.in_memory && !create {
            // sqlx names a shared in-memory database `file:sqlx-in-memory-N`, so the check below
            // would report that name as a missing file.
            return Err(StoreError::Missing(format!(
                "{} is an in-memory database, which lives only in the process that opens it: this command \
                 would see none of ferry serve's events; set database.url to a file",
                super::redact_url(url)
            )));
        }
        let options = SqliteConnectOptions::from_str(url).map_err(connect_error)?;
        let path = options.get_filename().to_path_buf();
        if !create && !path.is_file() {
            return Err(StoreError::Missing(format!(
                "no SQLite database at {}: `ferry migrate` (or `ferry serve`) creates it; check database.url",
                path.display()
            )));
        }
        let options = options
            .create_if_missing(create)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            // Applications and `ferry emit` write to the same file; wait for the lock, don't fail.
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true)
            .row_buffer_size(ROW_BUFFER);
        if let Some(parent) = path.parent().filter(|p| create && !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| connect_error(sqlx::Error::Io(e)))?;
        }
        // Switching a new file to WAL needs a moment of exclusive access, which the busy timeout
        // does not cover; another process opening the same file at the same time makes it fail
        // with "database is locked". That is worth a few retries, not an error.
        let mut pause = Duration::from_millis(20);
        loop {
            let attempt = SqlitePoolOptions::new()
                .max_connections(max_connections)
                .acquire_timeout(Duration::from_secs(10))
                // A connection is a handle on a file in this process: nothing can hang up on it,
                // so taking one out of the pool needs no round trip to its thread to check it.
                .test_before_acquire(false)
                .connect_with(options.clone())
                .await;
            let opened = match attempt {
                // An in-memory database keeps no log to checkpoint.
                Ok(pool) => Writer::open(&options, !memory.in_memory).await.map(|writer| (pool, writer)),
                Err(e) => Err(e),
            };
            match opened {
                Ok((pool, writer)) => return Ok(Self { pool, writer }),
                Err(e) if is_locked(&e) && pause < Duration::from_secs(5) => {
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                }
                Err(e) => return Err(connect_error(e)),
            }
        }
    }

    /// The pool, for applications that emit through their own transactions.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Waits for the writing connection ([`Writer::writing`]).
    async fn writing(&self) -> Result<Writing<'_>, StoreError> {
        self.writer.writing().await
    }
}

impl RecordOutcomes for SqliteStore {
    async fn record(
        &self,
        token: &str,
        now: DateTime<Utc>,
        parts: &Partitioned<'_>,
        by_token: Option<&[SentCall<'_>]>,
    ) -> Result<Option<u64>, StoreError> {
        let now = ms(now);
        let retry: Vec<Value> = parts
            .retry
            .iter()
            .map(|(c, at, error)| {
                json!({"id": c.id, "at": ms(*at), "error": error, "max": c.max_attempts, "refund": refund(c)})
            })
            .collect();
        let failed: Vec<Value> = parts
            .failed
            .iter()
            .map(|(c, reason, error)| json!({"id": c.id, "reason": reason, "error": error, "max": c.max_attempts}))
            .collect();
        // Without calls to record by token, the successes are written by id like the rest.
        let sent: Vec<Value> = match by_token {
            Some(_) => Vec::new(),
            None => parts
                .sent
                .iter()
                .map(|c| {
                    let call = &c.attempt.call;
                    json!({
                        "id": c.id,
                        "max": c.max_attempts,
                        "started_at": ms(call.started_at),
                        "duration_ms": duration_ms(call),
                        "plugin": call.plugin,
                        "plugin_hash": call.plugin_hash,
                    })
                })
                .collect(),
        };
        let mut writing = self.writing().await?;
        let mut tx = writing.begin().await?;
        let mut updated: Vec<i64> = Vec::new();
        for (rows, statement) in [(retry, COMPLETE_RETRY), (failed, COMPLETE_FAILED), (sent, COMPLETE_SENT)] {
            if rows.is_empty() {
                continue;
            }
            let ids = sqlx::query_scalar::<_, i64>(statement)
                .bind(Value::Array(rows).to_string())
                .bind(now)
                .bind(token)
                .fetch_all(&mut *tx)
                .await?;
            updated.extend(ids);
        }
        // The history gets the retries and failures whose outcome was written (not those fenced
        // off); a success is recorded on its event row.
        let written: std::collections::HashSet<i64> = updated.iter().copied().collect();
        copy_dead_letters(&mut tx, &dead_letters(parts, &written), |letters| {
            let rows: Vec<Value> = letters.iter().map(|(id, route)| json!({"id": id, "route": route})).collect();
            sqlx::query(DEAD_LETTER_SQL).bind(Value::Array(rows).to_string()).bind(now)
        })
        .await?;
        let history: Vec<Value> = parts
            .retry
            .iter()
            .map(|(c, _, _)| *c)
            .chain(parts.failed.iter().map(|(c, _, _)| *c))
            .filter(|c| written.contains(&c.id))
            .map(|c| {
                let call = &c.attempt.call;
                json!({
                    "id": c.id,
                    "attempt": c.attempt.number,
                    "started_at": ms(call.started_at),
                    "duration_ms": duration_ms(call),
                    "outcome": c.disposition.outcome().as_str(),
                    "reason": c.disposition.reason().map(|r| r.as_str()),
                    "error": c.disposition.error(),
                    "plugin": call.plugin,
                    "plugin_hash": call.plugin_hash,
                    "instance": call.instance,
                })
            })
            .collect();
        for sent in by_token.unwrap_or_default() {
            let statement = sent.statement(COMPLETE_SENT_BY_TOKEN);
            if !sent.write(&mut tx, sent_by_token(&statement, token, now, sent)).await? {
                tx.rollback().await?;
                writing.finish().await;
                return Ok(None);
            }
            updated.extend(&sent.ids);
        }
        let deferred = deferrals_written(parts, &written);
        if !deferred.is_empty() {
            sqlx::query(
                "DELETE FROM ferry_attempts WHERE id IN (
                     SELECT a.id FROM json_each(?1) AS u
                     JOIN ferry_attempts a
                       ON a.id = (SELECT MAX(m.id) FROM ferry_attempts m WHERE m.event_id = u.value->>0)
                     WHERE a.outcome = 'deferred' AND a.attempt = u.value->>1)",
            )
            .bind(serde_json::to_string(&deferred).expect("ids serialize"))
            .execute(&mut *tx)
            .await?;
        }
        if !history.is_empty() {
            sqlx::query(
                "INSERT INTO ferry_attempts
                     (event_id, attempt, started_at, duration_ms, outcome, reason, error, plugin, plugin_hash, instance)
                 SELECT value->>'id', value->>'attempt', value->>'started_at', value->>'duration_ms',
                        value->>'outcome', value->>'reason', value->>'error', value->>'plugin', value->>'plugin_hash',
                        value->>'instance'
                 FROM json_each(?1)",
            )
            .bind(Value::Array(history).to_string())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        writing.finish().await;
        Ok(Some(updated.len() as u64))
    }

    async fn record_run(&self, token: &str, now: DateTime<Utc>, run: &SentCall<'_>) -> Result<u64, StoreError> {
        let mut writing = self.writing().await?;
        let done = sent_by_token(COMPLETE_SENT_BY_TOKEN, token, ms(now), run).execute(&mut *writing).await?;
        writing.finish().await;
        Ok(done.rows_affected())
    }
}

/// `statement` ([`COMPLETE_SENT_BY_TOKEN`], perhaps with `RETURNING id`) bound for `sent`; `now`
/// in milliseconds.
fn sent_by_token<'q>(
    statement: &'q str,
    token: &'q str,
    now: i64,
    sent: &'q SentCall<'_>,
) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>> {
    let call = sent.call;
    let (first, last) = sent.bounds();
    sqlx::query(statement)
        .bind(token)
        .bind(now)
        .bind(&call.route)
        .bind(sent.max_attempts)
        .bind(ms(call.started_at))
        .bind(duration_ms(call))
        .bind(&call.plugin)
        .bind(&call.plugin_hash)
        .bind(first)
        .bind(last)
}

/// What a `sqlite:` URL says about where its database lives, read from the URL as sqlx reads it:
/// sqlx renames a shared in-memory database, so the file name it parses to says nothing.
struct MemoryUrl {
    /// An in-memory database (`:memory:` or `mode=memory`): it lives in the opening process only.
    in_memory: bool,
    /// Why each connection would get a database of its own, which the relay's writing connection
    /// and the pooled ones would not share: in memory with `cache=private`, or no file name at
    /// all (SQLite then makes a temporary database per connection).
    per_connection: Option<&'static str>,
}

impl MemoryUrl {
    /// Reads `url` (`sqlite://…` or `sqlite:…`, then the file name and `?` parameters).
    fn of(url: &str) -> Self {
        let rest = url.trim_start_matches("sqlite://").trim_start_matches("sqlite:");
        let (database, query) = rest.split_once('?').unwrap_or((rest, ""));
        let params: Vec<&str> = query.split('&').collect();
        let in_memory = database == ":memory:" || params.contains(&"mode=memory");
        let per_connection = if in_memory && params.contains(&"cache=private") {
            Some("an in-memory database with cache=private")
        } else if database.is_empty() && !in_memory {
            Some("a database URL without a file name")
        } else {
            None
        };
        Self { in_memory, per_connection }
    }
}

/// SQLITE_BUSY or SQLITE_LOCKED: another connection holds the lock.
fn is_locked(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|d| d.code()).is_some_and(|code| code == "5" || code == "6")
}

/// Rows a statement may run ahead of the task reading them. sqlx hands rows from its SQLite thread
/// to the task one by one; a claim returns up to a batch of rows, and with sqlx's default (50) the
/// thread stalls and is woken again every 50 of them.
const ROW_BUFFER: usize = 1024;

fn ms(t: DateTime<Utc>) -> i64 {
    t.timestamp_millis()
}

/// The claim's tests of a due event's route (JSON arrays of routes): not one of the paused routes
/// ?8, the route ?9 when given, and in an ordered route (?6) not queued behind an unfinished event
/// of its key (or a FAILED one, in the blocking routes ?7). With no route paused, chosen or
/// ordered, they pass every event, and [`CLAIM_PLAIN_SQL`] leaves them out.
macro_rules! route_filters {
    () => {
        "
           AND e.route NOT IN (SELECT value FROM json_each(?8)) AND (?9 IS NULL OR e.route = ?9)
           AND (e.ordering_key IS NULL OR e.route NOT IN (SELECT value FROM json_each(?6)) OR NOT EXISTS (
                SELECT 1 FROM ferry_events p
                WHERE p.route = e.route AND p.ordering_key = e.ordering_key AND p.id < e.id AND p.status <> 'SENT'
                  AND (p.status IN ('PENDING', 'PROCESSING')
                       OR (p.status = 'FAILED' AND p.route IN (SELECT value FROM json_each(?7))))))"
    };
}

/// The events a claim picks, in its order (`CLAIM_SQL`, `DUE_SQL`), `$one` narrowing them to one
/// (`CLAIM_ONE_SQL`), tested by `$filters` (`route_filters!()`, or `""` for none).
macro_rules! due_sql {
    ($one:literal, $($filters:tt)*) => {
        concat!(
            "
         SELECT e.id FROM ferry_events e
         WHERE e.status = 'PENDING' AND e.next_attempt_at <= ?1",
            $($filters)*,
            $one,
            "
         ORDER BY e.next_attempt_at, e.id
         LIMIT ?2"
        )
    };
}

/// Claims up to ?2 due events for instance ?3 under token ?4 until ?5, at ?1, as the route filters
/// (`route_filters!`) allow; payloads above ?10 bytes come back as their size only, names above
/// ?11 and headers above ?12 as NULL (the ordering key's with `key_oversized` set). `octet_length`
/// (SQLite 3.43, in the 3.46 ferry links) reads a text's size from the row without loading it,
/// where `length(CAST(… AS BLOB))` loads it.
///
/// The look for an unfinished predecessor states the key index's own condition (`p.status <>
/// 'SENT'`): SQLite uses a partial index only where the query states its condition, and does not
/// derive it from the status tests beside it. Without it, SQLite walked the older rows by id, up
/// to all of them, for each keyed event of an ordered route: with 200 000 rows, 199 000 of them SENT,
/// one claim took 59 seconds instead of 5 milliseconds (a test build).
pub const CLAIM_SQL: &str = claim_sql!("", route_filters!());

/// [`CLAIM_SQL`] without the route filters, for a claim that has no route to hold back
/// ([`Claim::filters_routes`]): the common case, where testing each due event's route against
/// empty lists cost about 3% of what SQLite spends per event (BENCHMARKS.md). It takes the same
/// parameters and reads ?6 to ?9 not at all.
pub const CLAIM_PLAIN_SQL: &str = claim_sql!("", "");

/// [`CLAIM_SQL`] for event ?13 alone, found by primary key.
pub const CLAIM_ONE_SQL: &str = claim_sql!(" AND e.id = ?13", route_filters!());

/// The claim statement, of the events `$one` narrows them to.
macro_rules! claim_sql {
    ($one:literal, $($filters:tt)*) => {
        concat!(
            "UPDATE ferry_events
     SET status = 'PROCESSING', attempts = attempts + 1, last_status_at = ?1,
         claimed_by = ?3, claim_token = ?4, lease_until = ?5
     WHERE id IN (",
            due_sql!($one, $($filters)*),
            "
     )
     RETURNING id,
               CASE WHEN octet_length(route) <= ?11 THEN route END AS route,
               CASE WHEN octet_length(event_type) <= ?11 THEN event_type END AS event_type,
               CASE WHEN octet_length(ordering_key) <= ?11 THEN ordering_key END AS ordering_key,
               CASE WHEN length(CAST(payload AS BLOB)) <= ?10 THEN CAST(payload AS BLOB) END AS payload,
               length(CAST(payload AS BLOB)) AS payload_size,
               CASE WHEN octet_length(content_type) <= ?11 THEN content_type END AS content_type,
               CASE WHEN octet_length(headers) <= ?12 THEN headers END AS headers,
               attempts, max_attempts, event_time, created_at, next_attempt_at,
               octet_length(ordering_key) > ?11 AS key_oversized"
        )
    };
}
use claim_sql;

/// The ids of the events a claim would take, in its order, without taking them: the claim's
/// parameters, of which it reads ?1, ?2 and ?6 to ?9.
pub const DUE_SQL: &str = due_sql!("", route_filters!());

/// Binds a claim's parameters, ?1 to ?12, to a query on `CLAIM_SQL`, `CLAIM_ONE_SQL` (which binds
/// the event, ?13, after them) or `DUE_SQL`.
macro_rules! bind_claim {
    ($query:expr, $claim:expr) => {{
        let claim: &Claim = $claim;
        $query
            .bind(ms(claim.now))
            .bind(i64::from(claim.limit))
            .bind(&claim.instance)
            .bind(&claim.token)
            .bind(ms(claim.lease_until))
            .bind(serde_json::to_string(&claim.ordered_routes).expect("strings serialize"))
            .bind(serde_json::to_string(&claim.blocking_routes).expect("strings serialize"))
            .bind(serde_json::to_string(&claim.paused_routes).expect("strings serialize"))
            .bind(&claim.only_route)
            .bind(i64::try_from(claim.max_payload).unwrap_or(i64::MAX))
            .bind(crate::event::MAX_CLAIMED_NAME)
            .bind(crate::event::MAX_CLAIMED_HEADERS)
    }};
}

const EVENT_COLUMNS: &str = "id, route, event_type, ordering_key, CAST(payload AS BLOB) AS payload, content_type, \
     headers, status, attempts, max_attempts, event_time, created_at, last_status_at, next_attempt_at, \
     processed_at, last_error, failure_reason, claimed_by, claim_token, lease_until, parent_id";

/// The columns of a list: every one but the payload, which lists do not show. A name or headers
/// longer than a claim loads (written by SQL past `emit`'s limits) is shown as its size: a page
/// of such rows would otherwise be loaded whole.
pub(super) const LIST_COLUMNS: &str = concat!(
    super::listed_names!("x''"),
    "CASE WHEN octet_length(headers) <= 131072 THEN headers
          ELSE '(' || octet_length(headers) || ' bytes, not loaded)' END AS headers, ",
    super::listed_tail!()
);

/// Records one outcome kind for the rows of the JSON array ?1 still held by claim ?3, at ?2;
/// returns the ids written.
const COMPLETE_SENT: &str = "UPDATE ferry_events
     SET status = 'SENT', processed_at = ?2, last_status_at = ?2, claim_token = NULL,
         lease_until = NULL, max_attempts = COALESCE(ferry_events.max_attempts, u.max),
         sent_started_at = u.started_at, sent_duration_ms = u.duration_ms, sent_plugin = u.plugin,
         sent_plugin_hash = u.plugin_hash
     FROM (SELECT value->>'id' AS id, value->>'max' AS max, value->>'started_at' AS started_at,
                  value->>'duration_ms' AS duration_ms, value->>'plugin' AS plugin,
                  value->>'plugin_hash' AS plugin_hash FROM json_each(?1)) AS u
     WHERE ferry_events.id = u.id AND claim_token = ?3 AND status = 'PROCESSING'
     RETURNING ferry_events.id";

/// Records as SENT, at ?2, the rows of route ?3 with ids from ?9 to ?10 still held by claim ?1,
/// delivered by one plugin call (?5 to ?8). See `SentCall::statement`.
const COMPLETE_SENT_BY_TOKEN: &str = "UPDATE ferry_events
     SET status = 'SENT', processed_at = ?2, last_status_at = ?2, claim_token = NULL, lease_until = NULL,
         max_attempts = COALESCE(max_attempts, ?4), sent_started_at = ?5, sent_duration_ms = ?6,
         sent_plugin = ?7, sent_plugin_hash = ?8
     WHERE claim_token = ?1 AND status = 'PROCESSING' AND route = ?3 AND id BETWEEN ?9 AND ?10";

const COMPLETE_RETRY: &str = "UPDATE ferry_events
     SET status = 'PENDING', next_attempt_at = u.at, last_error = u.error, last_status_at = ?2,
         claim_token = NULL, lease_until = NULL, max_attempts = COALESCE(ferry_events.max_attempts, u.max),
         attempts = MAX(attempts - u.refund, 0)
     FROM (SELECT value->>'id' AS id, value->>'at' AS at, value->>'error' AS error,
                  value->>'max' AS max, value->>'refund' AS refund FROM json_each(?1)) AS u
     WHERE ferry_events.id = u.id AND claim_token = ?3 AND status = 'PROCESSING'
     RETURNING ferry_events.id";

/// Copies FAILED events (?1: `[{"id", "route"}]`) to their dead-letter routes as new PENDING
/// events at ?2, the failure in their headers. Values a new row may not hold (a time or headers
/// written before ferry's checks) are replaced: the time by ?2, the headers by none.
const DEAD_LETTER_SQL: &str = "INSERT INTO ferry_events
         (route, event_type, ordering_key, payload, content_type, headers, created_at, event_time,
          last_status_at, next_attempt_at)
     SELECT json_extract(u.value, '$.route'), e.event_type, e.ordering_key, e.payload, e.content_type,
            json_set(CASE WHEN json_valid(e.headers) AND json_type(e.headers) = 'object' THEN e.headers ELSE '{}' END,
                '$.\"ferry-failed-event-id\"', CAST(e.id AS TEXT),
                '$.\"ferry-failed-route\"', CAST(e.route AS TEXT),
                '$.\"ferry-failed-reason\"', COALESCE(CAST(e.failure_reason AS TEXT), ''),
                '$.\"ferry-failed-error\"', COALESCE(CAST(e.last_error AS TEXT), ''),
                '$.\"ferry-failed-attempts\"', CAST(e.attempts AS TEXT)),
            ?2,
            CASE WHEN typeof(e.event_time) = 'integer' AND e.event_time BETWEEN -62135596800000 AND 253402300799999
                 THEN e.event_time ELSE ?2 END,
            ?2, ?2
     FROM json_each(?1) AS u JOIN ferry_events e ON e.id = json_extract(u.value, '$.id')
     ORDER BY e.id";

/// Copies events to destination routes (?1: `[[id, route], …]`) as new PENDING events at ?2, in
/// the order given (so each destination's deliveries keep the order of the events). The original
/// creation time is kept, so latency counts from the application's commit; each copy's attempt
/// limit is its destination's; a time a new row may
/// not hold (written before ferry's checks) becomes ?2.
const FAN_OUT_SQL: &str = "INSERT INTO ferry_events
         (route, event_type, ordering_key, payload, content_type, headers, created_at, event_time,
          last_status_at, next_attempt_at, parent_id)
     SELECT json_extract(u.value, '$[1]'), e.event_type, e.ordering_key, e.payload, e.content_type, e.headers,
            CASE WHEN typeof(e.created_at) = 'integer' AND e.created_at BETWEEN -62135596800000 AND 253402300799999
                 THEN e.created_at ELSE ?2 END,
            CASE WHEN typeof(e.event_time) = 'integer' AND e.event_time BETWEEN -62135596800000 AND 253402300799999
                 THEN e.event_time ELSE ?2 END,
            ?2, ?2, e.id
     FROM json_each(?1) AS u JOIN ferry_events e ON e.id = json_extract(u.value, '$[0]')
     ORDER BY u.key";

const COMPLETE_FAILED: &str = "UPDATE ferry_events
     SET status = 'FAILED', failure_reason = u.reason, last_error = u.error, processed_at = ?2,
         last_status_at = ?2, claim_token = NULL, lease_until = NULL,
         max_attempts = COALESCE(ferry_events.max_attempts, u.max)
     FROM (SELECT value->>'id' AS id, value->>'reason' AS reason, value->>'error' AS error,
                  value->>'max' AS max FROM json_each(?1)) AS u
     WHERE ferry_events.id = u.id AND claim_token = ?3 AND status = 'PROCESSING'
     RETURNING ferry_events.id";

/// One step of retention's sweep (`Store::purge_sent`), in three statements: the size, last id and
/// youth (all written between ?3 and ?4, now, as integers) of the window of the next ?2 (the
/// limit) events from id ?1 on, read along the primary key; then the deletion of the SENT rows
/// processed before ?3 with ids from ?1 to ?2 (here the window's last id), whose history the
/// foreign key deletes with them; then the history rows with event ids from ?1 to ?2 whose event is
/// gone, which a connection without foreign keys (SQLite's default) leaves when it deletes events.
pub const SWEEP_SQL: [&str; 3] = [
    "SELECT COUNT(*) AS seen, MAX(id) AS last,
            MIN(typeof(created_at) = 'integer' AND created_at >= ?3 AND created_at <= ?4) AS young
     FROM (SELECT id, created_at FROM ferry_events WHERE id >= ?1 ORDER BY id LIMIT ?2)",
    "DELETE FROM ferry_events WHERE id BETWEEN ?1 AND ?2 AND status = 'SENT' AND processed_at < ?3",
    "DELETE FROM ferry_attempts
     WHERE event_id BETWEEN ?1 AND ?2 AND NOT EXISTS (SELECT 1 FROM ferry_events e WHERE e.id = event_id)",
];

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        // sqlx takes no lock for SQLite migrations: when two processes migrate a new file at once,
        // the loser fails on a table the winner just created. Trying again sees the migration as
        // applied and succeeds.
        let mut tries = 0;
        loop {
            match sqlx::migrate!("../migrations/sqlite").run(&self.pool).await {
                Ok(()) => return Ok(()),
                Err(_) if tries < 5 => {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(50 * tries)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    async fn insert(&self, event: &NewEvent, now: DateTime<Utc>) -> Result<i64, StoreError> {
        let mut conn = self.pool.acquire().await?;
        Ok(conn.insert_event(event, Some(now)).await?)
    }

    async fn claim_only(&self, claim: &Claim, only_id: Option<i64>) -> Result<Vec<ClaimedEvent>, StoreError> {
        let mut writing = self.writing().await?;
        let query = match only_id {
            Some(id) => bind_claim!(sqlx::query(CLAIM_ONE_SQL), claim).bind(id),
            None => bind_claim!(sqlx::query(if claim.filters_routes() { CLAIM_SQL } else { CLAIM_PLAIN_SQL }), claim),
        };
        let rows = query.fetch_all(&mut *writing).await?;
        writing.finish().await;
        claimed_events(&rows, claim.max_payload, true)
    }

    async fn due(&self, claim: &Claim) -> Result<Vec<i64>, StoreError> {
        Ok(bind_claim!(sqlx::query_scalar(DUE_SQL), claim).fetch_all(&self.pool).await?)
    }

    async fn set_unclaimable(&self, id: i64, now: DateTime<Utc>, by: &str, error: &str) -> Result<bool, StoreError> {
        let mut writing = self.writing().await?;
        let mut tx = writing.begin().await?;
        let attempts: Option<i64> = sqlx::query_scalar(
            "UPDATE ferry_events
             SET status = 'FAILED', failure_reason = 'invalid_event', last_error = ?3, processed_at = ?2,
                 last_status_at = ?2
             WHERE id = ?1 AND status = 'PENDING'
             -- A count edited by hand into text or out of range must not stop the event failing.
             RETURNING CASE WHEN typeof(attempts) = 'integer' AND attempts BETWEEN 0 AND 2147483647
                            THEN attempts ELSE 0 END",
        )
        .bind(id)
        .bind(ms(now))
        .bind(error)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(attempts) = attempts {
            sqlx::query(
                "INSERT INTO ferry_attempts (event_id, attempt, started_at, duration_ms, outcome, reason, error, instance)
                 VALUES (?1, ?2, ?3, 0, 'failed', 'invalid_event', ?4, ?5)",
            )
            .bind(id)
            .bind(attempts)
            .bind(ms(now))
            .bind(error)
            .bind(by)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        writing.finish().await;
        Ok(attempts.is_some())
    }

    async fn complete(&self, token: &str, now: DateTime<Utc>, items: &[Completion]) -> Result<u64, StoreError> {
        complete_batch(self, token, now, items).await
    }

    async fn release(&self, token: &str, ids: &[i64], now: DateTime<Utc>) -> Result<u64, StoreError> {
        let mut writing = self.writing().await?;
        let done = sqlx::query(
            "UPDATE ferry_events
             SET status = 'PENDING', attempts = MAX(attempts - 1, 0), last_status_at = ?1,
                 claim_token = NULL, lease_until = NULL
             WHERE claim_token = ?2 AND status = 'PROCESSING' AND id IN (SELECT value FROM json_each(?3))",
        )
        .bind(ms(now))
        .bind(token)
        .bind(json!(ids).to_string())
        .execute(&mut *writing)
        .await?;
        writing.finish().await;
        Ok(done.rows_affected())
    }

    async fn drop_copies(&self, token: &str, ids: &[i64]) -> Result<Vec<i64>, StoreError> {
        let mut writing = self.writing().await?;
        // The history goes with them: the writing connection keeps foreign keys on.
        let done = sqlx::query_scalar(
            "DELETE FROM ferry_events
             WHERE claim_token = ?1 AND status = 'PROCESSING' AND id IN (SELECT value FROM json_each(?2))
             RETURNING id",
        )
        .bind(token)
        .bind(json!(ids).to_string())
        .fetch_all(&mut *writing)
        .await?;
        writing.finish().await;
        Ok(ids_in_order(done))
    }

    async fn recover_expired(&self, now: DateTime<Utc>, limit: u32) -> Result<Vec<Recovered>, StoreError> {
        let mut writing = self.writing().await?;
        // `claimed_by` can hold any value here: text (not always UTF-8), a number or a blob. It
        // is returned as bytes, and written into the message only as printable ASCII text of at
        // most ?4 bytes (`[^ -~]` is any other character, or a byte that is not UTF-8).
        let rows = sqlx::query(
            "UPDATE ferry_events
             SET status = 'PENDING', last_status_at = ?1, next_attempt_at = ?1, claim_token = NULL,
                 lease_until = NULL,
                 last_error = 'claim lease expired while PROCESSING (claimed by '
                     || CASE WHEN claimed_by IS NULL THEN '?'
                             WHEN typeof(claimed_by) = 'text' AND octet_length(claimed_by) <= ?4
                                  AND claimed_by NOT GLOB '*[^ -~]*' THEN claimed_by
                             ELSE 'an instance name of ' || octet_length(claimed_by) || ' bytes' END
                     || ')'
             WHERE id IN (
                 SELECT id FROM ferry_events
                 WHERE status = 'PROCESSING'
                   -- A row left PROCESSING without a lease a ferry took (NULL, text, one past the
                   -- ceiling) would otherwise be held for as long as it says.
                   AND (lease_until < ?1 OR lease_until > ?2 OR typeof(lease_until) NOT IN ('integer', 'real'))
                 ORDER BY id
                 LIMIT ?3
             )
             RETURNING id, CASE WHEN octet_length(claimed_by) <= ?4 THEN CAST(claimed_by AS BLOB) END AS claimed_by",
        )
        .bind(ms(now))
        .bind(ms(lease_ceiling(now)))
        .bind(i64::from(limit))
        .bind(MAX_CLAIMANT)
        .fetch_all(&mut *writing)
        .await?;
        writing.finish().await;
        rows.iter()
            .map(|row| Ok(Recovered::new(row.try_get("id")?, row.try_get("claimed_by")?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    async fn reschedule_unreadable(&self, now: DateTime<Utc>) -> Result<Vec<i64>, StoreError> {
        let mut writing = self.writing().await?;
        // SQLite orders every number before every text and every text before every blob: the
        // times ferry cannot compare are those from '' on, a range of the pending index.
        let ids = sqlx::query_scalar(
            "UPDATE ferry_events SET next_attempt_at = ?1
             WHERE status = 'PENDING' AND next_attempt_at >= ''
             RETURNING id",
        )
        .bind(ms(now))
        .fetch_all(&mut *writing)
        .await?;
        writing.finish().await;
        Ok(ids)
    }

    async fn resend(&self, ids: &[i64], now: DateTime<Utc>) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "UPDATE ferry_events
             SET status = 'PENDING', attempts = 0, last_error = NULL, failure_reason = NULL,
                 processed_at = NULL, next_attempt_at = ?1, last_status_at = ?1
             WHERE status = 'FAILED' AND id IN (SELECT value FROM json_each(?2))",
        )
        .bind(ms(now))
        .bind(json!(ids).to_string())
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn reschedule(&self, id: i64, at: DateTime<Utc>) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE ferry_events SET next_attempt_at = ?2 WHERE id = ?1 AND status = 'PENDING'")
            .bind(id)
            .bind(ms(at))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn end_event(&self, id: i64, end: EndEvent<'_>, now: DateTime<Utc>) -> Result<bool, StoreError> {
        let done = match end {
            EndEvent::Cancel => {
                sqlx::query("DELETE FROM ferry_events WHERE id = ?1 AND status IN ('PENDING', 'PROCESSING')")
                    .bind(id)
                    .execute(&self.pool)
                    .await?
            }
            EndEvent::Fail { note } => {
                sqlx::query(
                    "UPDATE ferry_events
                     SET status = 'FAILED', failure_reason = 'operator', last_error = ?2, processed_at = ?3,
                         last_status_at = ?3, claim_token = NULL, lease_until = NULL
                     WHERE id = ?1 AND status IN ('PENDING', 'PROCESSING')",
                )
                .bind(id)
                .bind(note)
                .bind(ms(now))
                .execute(&self.pool)
                .await?
            }
        };
        Ok(done.rows_affected() == 1)
    }

    async fn purge_sent(&self, window: &SweepWindow) -> Result<SweepStep, StoreError> {
        let SweepWindow { from, limit, before, now } = *window;
        let mut writing = self.writing().await?;
        let found = sqlx::query(SWEEP_SQL[0])
            .bind(from)
            .bind(i64::from(limit))
            .bind(ms(before))
            .bind(ms(now))
            .fetch_one(&mut *writing)
            .await?;
        let last: Option<i64> = found.try_get("last")?;
        let deleted = match last {
            // The deletion checks status and time itself: a row that came into the window's range
            // since (SQLite hands out ids above the highest ever used, so only one written with
            // its id by hand) is deleted only if it is due too.
            Some(last) => {
                let deleted =
                    sqlx::query(SWEEP_SQL[1]).bind(from).bind(last).bind(ms(before)).execute(&mut *writing).await?;
                sqlx::query(SWEEP_SQL[2]).bind(from).bind(last).execute(&mut *writing).await?;
                deleted.rows_affected()
            }
            None => 0,
        };
        writing.finish().await;
        Ok(SweepStep {
            seen: u64::try_from(found.try_get::<i64, _>("seen")?).unwrap_or_default(),
            last,
            young: found.try_get::<Option<i64>, _>("young")? == Some(1),
            deleted,
        })
    }

    async fn sweep_position(&self) -> Result<i64, StoreError> {
        // SQLite keeps whatever a hand edit writes in an INTEGER column; a position that is not
        // an integer is put back to a new sweep's instead of failing every run's read.
        let kept: Option<(Option<i64>, String)> = sqlx::query_as(
            "SELECT CASE WHEN typeof(next_id) = 'integer' THEN next_id END, typeof(next_id) FROM ferry_sweep",
        )
        .fetch_optional(&self.pool)
        .await?;
        Ok(match kept {
            Some((Some(next), _)) => next,
            Some((None, kind)) => {
                let mut writing = self.writing().await?;
                sqlx::query("UPDATE ferry_sweep SET next_id = ?1 WHERE typeof(next_id) <> 'integer'")
                    .bind(i64::MIN)
                    .execute(&mut *writing)
                    .await?;
                writing.finish().await;
                tracing::warn!(
                    kind,
                    "ferry_sweep.next_id was not an integer (edited by hand?); retention starts a new sweep"
                );
                i64::MIN
            }
            None => i64::MIN,
        })
    }

    async fn set_sweep_position(&self, was: i64, next: i64) -> Result<bool, StoreError> {
        let mut writing = self.writing().await?;
        // One statement: moved on from `was`, or the row made again if deleted by hand.
        let done = sqlx::query(
            "INSERT INTO ferry_sweep (one, next_id) VALUES (1, ?2)
             ON CONFLICT (one) DO UPDATE SET next_id = excluded.next_id WHERE next_id = ?1",
        )
        .bind(was)
        .bind(next)
        .execute(&mut *writing)
        .await?;
        writing.finish().await;
        Ok(done.rows_affected() == 1)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn stats(
        &self,
        now: DateTime<Utc>,
        latency_since: Option<DateTime<Utc>>,
        count_sent: bool,
    ) -> Result<Stats, StoreError> {
        let counts_sql = if count_sent { ROUTE_COUNTS_SQL } else { UNFINISHED_COUNTS_SQL };
        let counts = sqlx::query(counts_sql).fetch_all(&self.pool).await?;
        let watch = sqlx::query(WATCH_SQL).bind(ms(now)).bind(ms(lease_ceiling(now))).fetch_one(&self.pool).await?;
        let latency = match latency_since {
            Some(since) => Some((
                since,
                sqlx::query(LATENCY_SQL).bind(ms(since)).bind(i64::from(LATENCY_SAMPLES)).fetch_all(&self.pool).await?,
            )),
            None => None,
        };
        Ok(stats_from(now, &counts, &watch, latency)?)
    }

    async fn attempts(&self, id: i64) -> Result<Vec<AttemptRecord>, StoreError> {
        Ok(sqlx::query_as(ATTEMPTS_SQL).bind(id).fetch_all(&self.pool).await?)
    }

    async fn ahead_in_key(
        &self,
        route: &str,
        key: &str,
        id: i64,
        failed_blocks: bool,
    ) -> Result<Option<(i64, Status)>, StoreError> {
        let sql = super::ahead_in_key_sql(failed_blocks);
        Ok(sqlx::query_as(sql).bind(route).bind(key).bind(id).fetch_optional(&self.pool).await?)
    }

    async fn counts(&self) -> Result<BTreeMap<Status, u64>, StoreError> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT status, COUNT(*) FROM ferry_events GROUP BY status").fetch_all(&self.pool).await?;
        Ok(counts_by_status(rows))
    }

    async fn get(&self, id: i64) -> Result<Option<EventRecord>, StoreError> {
        let row: Option<StoredRow> = sqlx::query_as(&format!("SELECT {EVENT_COLUMNS} FROM ferry_events WHERE id = ?1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(StoredRow::into_record))
    }

    async fn tally_failed(&self, filter: &FailedFilter) -> Result<(u64, Option<i64>), StoreError> {
        let sql = format!("SELECT COUNT(*), MAX(id) FROM ferry_events WHERE {FAILED_WHERE}");
        let row = bind_filter!(sqlx::query(&sql), filter).fetch_one(&self.pool).await?;
        Ok((u64::try_from(row.try_get::<i64, _>(0)?).unwrap_or(0), row.try_get::<Option<i64>, _>(1)?))
    }

    async fn deliveries(&self, id: i64) -> Result<Vec<Delivery>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, CAST(route AS TEXT) AS route, CAST(status AS TEXT) AS status,
                    CAST(attempts AS INTEGER) AS attempts
             FROM ferry_events WHERE parent_id = ?1 ORDER BY id LIMIT ?2",
        )
        .bind(id)
        .bind(i64::from(MAX_DELIVERIES_SHOWN))
        .fetch_all(&self.pool)
        .await?)
    }

    async fn fan_out(
        &self,
        token: &str,
        now: DateTime<Utc>,
        items: &[(i64, Vec<String>)],
    ) -> Result<Vec<i64>, StoreError> {
        let mut writing = self.writing().await?;
        let mut tx = writing.begin().await?;
        let ids: Vec<i64> = items.iter().map(|(id, _)| *id).collect();
        let handed: Vec<i64> = sqlx::query_scalar(
            "UPDATE ferry_events
             SET status = 'SENT', processed_at = ?1, last_status_at = ?1, claim_token = NULL, lease_until = NULL
             WHERE claim_token = ?2 AND status = 'PROCESSING' AND id IN (SELECT value FROM json_each(?3))
             RETURNING id",
        )
        .bind(ms(now))
        .bind(token)
        .bind(json!(ids).to_string())
        .fetch_all(&mut *tx)
        .await?;
        let copies = copies(items, &handed);
        if !copies.is_empty() {
            let rows: Vec<Value> = copies.iter().map(|(id, route)| json!([id, route])).collect();
            sqlx::query(FAN_OUT_SQL).bind(Value::Array(rows).to_string()).bind(ms(now)).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        writing.finish().await;
        Ok(handed)
    }

    async fn list_failed(&self, filter: &FailedFilter, limit: u32) -> Result<Vec<EventRecord>, StoreError> {
        let order = if filter.newest_first { "DESC" } else { "ASC" };
        let sql = format!("SELECT {LIST_COLUMNS} FROM ferry_events WHERE {FAILED_WHERE} ORDER BY id {order} LIMIT ?9");
        let rows: Vec<StoredRow> =
            bind_filter!(sqlx::query_as(&sql), filter).bind(i64::from(limit)).fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(StoredRow::into_record).collect())
    }

    async fn failed_groups(&self, filter: &FailedFilter, limit: u32) -> Result<Vec<FailedGroup>, StoreError> {
        let sql = format!(
            "SELECT {FAILED_GROUP_COLUMNS} FROM ferry_events WHERE {FAILED_WHERE} {FAILED_GROUP_ORDER} LIMIT ?9"
        );
        let rows: Vec<FailedGroupRow> =
            bind_filter!(sqlx::query_as(&sql), filter).bind(i64::from(limit)).fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(FailedGroupRow::into_group).collect())
    }

    async fn resend_failed(
        &self,
        filter: &FailedFilter,
        now: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<i64>, StoreError> {
        let sql = format!(
            "UPDATE ferry_events
             SET status = 'PENDING', attempts = 0, last_error = NULL, failure_reason = NULL,
                 processed_at = NULL, next_attempt_at = ?10, last_status_at = ?10
             WHERE id IN (SELECT id FROM ferry_events WHERE {FAILED_WHERE} ORDER BY id LIMIT ?9)
               AND status = 'FAILED'
             RETURNING id"
        );
        let done = bind_filter!(sqlx::query_scalar(&sql), filter)
            .bind(i64::from(limit))
            .bind(ms(now))
            .fetch_all(&self.pool)
            .await?;
        Ok(ids_in_order(done))
    }

    async fn purge_failed(&self, filter: &FailedFilter, limit: u32) -> Result<Vec<i64>, StoreError> {
        let sql = format!(
            "DELETE FROM ferry_events WHERE id IN (SELECT id FROM ferry_events WHERE {FAILED_WHERE} ORDER BY id LIMIT ?9)
               AND status = 'FAILED'
             RETURNING id"
        );
        let done = bind_filter!(sqlx::query_scalar(&sql), filter).bind(i64::from(limit)).fetch_all(&self.pool).await?;
        Ok(ids_in_order(done))
    }

    async fn breakers(&self) -> Result<Vec<Breaker>, StoreError> {
        let rows = sqlx::query("SELECT * FROM ferry_breakers ORDER BY route").fetch_all(&self.pool).await?;
        Ok(super::breakers_from(&rows))
    }

    async fn record_breaker(
        &self,
        route: &str,
        failures: u32,
        reason: &str,
        threshold: u32,
        now: DateTime<Utc>,
    ) -> Result<Breaker, StoreError> {
        let mut writing = self.writing().await?;
        let row = sqlx::query_as(
            "INSERT INTO ferry_breakers AS b (route, consecutive_failures, opened_at, reason, updated_at)
             VALUES (?1, ?2, CASE WHEN ?2 > 0 AND ?2 >= ?4 THEN ?5 END, CASE WHEN ?2 > 0 AND ?2 >= ?4 THEN ?3 END, ?5)
             ON CONFLICT (route) DO UPDATE SET
                 consecutive_failures = CASE WHEN ?2 = 0 THEN 0 ELSE MIN(b.consecutive_failures + ?2, 2147483647) END,
                 opened_at = CASE WHEN b.manual = 1 THEN b.opened_at
                                  WHEN ?2 = 0 THEN NULL
                                  WHEN b.opened_at IS NOT NULL OR b.consecutive_failures + ?2 >= ?4 THEN ?5
                             END,
                 reason = CASE WHEN b.manual = 1 THEN b.reason
                               WHEN ?2 = 0 THEN NULL
                               WHEN b.opened_at IS NOT NULL OR b.consecutive_failures + ?2 >= ?4 THEN ?3
                          END,
                 probe_until = CASE WHEN b.manual = 1 THEN b.probe_until END,
                 updated_at = ?5
             RETURNING *",
        )
        .bind(route)
        .bind(i64::from(failures))
        .bind(reason)
        .bind(i64::from(threshold))
        .bind(ms(now))
        .fetch_one(&mut *writing)
        .await?;
        writing.finish().await;
        Ok(row)
    }

    async fn take_probe(
        &self,
        route: &str,
        cooled: DateTime<Utc>,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let mut writing = self.writing().await?;
        let done = sqlx::query(
            "UPDATE ferry_breakers SET probe_until = ?4, updated_at = ?3
             WHERE route = ?1 AND opened_at <= ?2 AND manual = 0 AND (probe_until IS NULL OR probe_until <= ?3)",
        )
        .bind(route)
        .bind(ms(cooled))
        .bind(ms(now))
        .bind(ms(until))
        .execute(&mut *writing)
        .await?;
        writing.finish().await;
        Ok(done.rows_affected() == 1)
    }

    async fn release_probe(&self, route: &str, held_until: DateTime<Utc>) -> Result<(), StoreError> {
        let mut writing = self.writing().await?;
        sqlx::query("UPDATE ferry_breakers SET probe_until = NULL WHERE route = ?1 AND probe_until = ?2")
            .bind(route)
            .bind(ms(held_until))
            .execute(&mut *writing)
            .await?;
        writing.finish().await;
        Ok(())
    }

    async fn set_breaker(
        &self,
        route: &str,
        open: bool,
        reason: &str,
        now: DateTime<Utc>,
    ) -> Result<Breaker, StoreError> {
        let sql = if open {
            "INSERT INTO ferry_breakers (route, opened_at, reason, manual, updated_at) VALUES (?1, ?2, ?3, 1, ?2)
             ON CONFLICT (route) DO UPDATE
             SET opened_at = ?2, reason = ?3, manual = 1, probe_until = NULL, updated_at = ?2
             RETURNING *"
        } else {
            "INSERT INTO ferry_breakers (route, updated_at) VALUES (?1, ?2)
             ON CONFLICT (route) DO UPDATE
             SET consecutive_failures = 0, opened_at = NULL, reason = NULL, manual = 0, probe_until = NULL,
                 updated_at = ?2
             RETURNING *"
        };
        let query = sqlx::query_as(sql).bind(route).bind(ms(now));
        let query = if open { query.bind(reason) } else { query };
        let row = query.fetch_one(&self.pool).await?;
        Ok(row)
    }

    async fn endpoints(&self, route: Option<&str>) -> Result<Vec<StoredEndpoint>, StoreError> {
        self.select_endpoints(route).await
    }

    async fn endpoint(&self, id: &str) -> Result<Option<StoredEndpoint>, StoreError> {
        self.select_endpoint(id).await
    }

    async fn insert_endpoint(&self, e: &StoredEndpoint) -> Result<bool, StoreError> {
        self.write_endpoint(super::endpoint_sql::INSERT, e, &e.route).await
    }

    async fn update_endpoint(&self, e: &StoredEndpoint, before: &str) -> Result<bool, StoreError> {
        self.write_endpoint(super::endpoint_sql::UPDATE, e, before).await
    }

    async fn delete_endpoint(&self, id: &str) -> Result<bool, StoreError> {
        self.remove_endpoint(id).await
    }
}

super::endpoint_queries!(SqliteStore);

/// The FAILED rows a [`FailedFilter`] selects; its values are bound as ?1..?8 by [`bind_filter`].
const FAILED_WHERE: &str = "status = 'FAILED' AND (?1 IS NULL OR route = ?1) AND (?2 IS NULL OR event_type = ?2)
     AND (?3 IS NULL OR created_at >= ?3) AND (?4 IS NULL OR created_at < ?4) AND (?5 IS NULL OR id > ?5)
     AND (?6 IS NULL OR failure_reason = ?6 OR (?6 = 'none' AND failure_reason IS NULL))
     AND (?7 IS NULL OR id <= ?7) AND (?8 IS NULL OR instr(lower(last_error), lower(?8)) > 0)";

/// Binds a [`FailedFilter`] as ?1..?8 to a query (or `query_as`) built on [`FAILED_WHERE`].
macro_rules! bind_filter {
    ($query:expr, $filter:expr) => {{
        let filter: &FailedFilter = $filter;
        $query
            .bind(&filter.route)
            .bind(&filter.event_type)
            .bind(filter.from.map(ms))
            .bind(filter.before.map(ms))
            .bind(filter.after_id)
            .bind(filter.reason.map(ReasonFilter::as_str))
            .bind(filter.through_id)
            .bind(&filter.error)
    }};
}
use bind_filter;
