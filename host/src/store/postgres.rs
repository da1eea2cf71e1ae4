//! The PostgreSQL store: claims with `FOR UPDATE SKIP LOCKED` so any number of ferry instances
//! share one outbox, records outcomes with one `UNNEST` statement per outcome kind, and wakes idle
//! relays through LISTEN/NOTIFY.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{PgPool, Row};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use ferry_outbox::Outbox;

use super::lanes::Lanes;
use super::{
    ATTEMPTS_SQL, Breaker, Claim, Delivery, EndEvent, FAILED_GROUP_COLUMNS, FAILED_GROUP_ORDER, FailedFilter,
    FailedGroup, FailedGroupRow, LATENCY_SAMPLES, LATENCY_SQL, MAX_CLAIMANT, MAX_DELIVERIES_SHOWN, Partitioned,
    ROUTE_COUNTS_SQL, ReasonFilter, RecordOutcomes, Recovered, SentCall, Stats, Store, StoreError, StoredEndpoint,
    SweepStep, SweepWindow, UNFINISHED_COUNTS_SQL, WATCH_SQL, calls_of, claimed_events, complete_batch, copies,
    copy_dead_letters, counts_by_status, dead_letters, deferrals_written, duration_ms, ids_in_order, lease_ceiling,
    refund, stats_from,
};
use crate::event::{AttemptRecord, ClaimedEvent, Completion, EventRecord, NewEvent, Status, StoredRow};

/// The outbox in a PostgreSQL database.
#[derive(Debug, Clone)]
pub struct PostgresStore {
    /// Everything but the relay's claims, hand-ons and outcome writes: emits, operators' commands,
    /// the admin API, LISTEN, the relay's breaker reads and housekeeping.
    pool: PgPool,
    /// The relay's claims, hand-ons and outcome writes, on connections of their own
    /// ([`Lanes`]).
    lanes: Arc<Lanes>,
}

/// The relay's connections when not configured: `database.relay_connections`' default.
pub const DEFAULT_RELAY_CONNECTIONS: u32 = 2;

impl PostgresStore {
    /// Connects to `url` with a pool of `max_connections`.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self, StoreError> {
        let redacted = super::redact_url(url);
        let options =
            PgConnectOptions::from_str(url).map_err(|source| StoreError::Connect { url: redacted.clone(), source })?;
        Self::connect_with(options, max_connections).await.map_err(|e| match e {
            StoreError::Database(source) => StoreError::Connect { url: redacted, source },
            other => other,
        })
    }

    /// Connects with explicit options (tests use them to pick a schema).
    pub async fn connect_with(options: PgConnectOptions, max_connections: u32) -> Result<Self, StoreError> {
        let options = options.options(SESSION_SETTINGS);
        let lanes = Arc::new(Lanes::new(options.clone(), DEFAULT_RELAY_CONNECTIONS));
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(std::time::Duration::from_secs(10))
            // sqlx checks a connection with a round trip when it comes back to the pool; checking
            // it again when it is taken out doubled the round trips of every statement the relay
            // runs. Only a connection idle for `CHECK_AFTER_IDLE` or longer is checked again.
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for >= super::CHECK_AFTER_IDLE {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .connect_with(options)
            .await?;
        Ok(Self { pool, lanes })
    }

    /// Runs the relay's claims, hand-ons and outcome writes on `count` connections of their
    /// own (`database.relay_connections`), opened as they are needed: at most `count` of those
    /// statements run at once. For a store no relay has used yet.
    pub fn with_relay_connections(self, count: u32) -> Self {
        let options = self.pool.connect_options().as_ref().clone();
        Self { lanes: Arc::new(Lanes::new(options, count.max(1))), ..self }
    }

    /// Wakes the relays listening on this database (every instance's), as an INSERT into the
    /// outbox does through its trigger: for events made due by an UPDATE, which no trigger reports
    /// (migration 12), such as a resend.
    /// The events are resent whether or not it works: should it fail, the relays find them at
    /// their next poll, so it is logged, not returned.
    async fn wake_relays(&self) {
        let notified = sqlx::query("SELECT pg_notify($1, '')").bind(NOTIFY_CHANNEL).execute(&self.pool).await;
        if let Err(error) = notified {
            tracing::warn!("resent events are found at the relays' next poll: waking them failed: {error}");
        }
    }

    /// The pool, for applications that emit through their own transactions. When the same store
    /// also runs a relay, the two share it: it is sized by `database.max_connections` for the
    /// relay's workers and LISTEN, and each connection the application holds is one a worker
    /// waits for, so size it for the application's connections too.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }
}

/// Records as SENT, at $2, the rows of route $3 with ids from $9 to $10 still held by claim $1,
/// delivered by one plugin call ($5 to $8). See `SentCall::statement`.
const COMPLETE_SENT_BY_TOKEN: &str = "UPDATE ferry_events
     SET status = 'SENT', processed_at = $2, last_status_at = $2, claim_token = NULL, lease_until = NULL,
         max_attempts = COALESCE(max_attempts, $4), sent_started_at = $5, sent_duration_ms = $6,
         sent_plugin = $7, sent_plugin_hash = $8
     WHERE claim_token = $1 AND status = 'PROCESSING' AND route = $3 AND id BETWEEN $9 AND $10";

impl RecordOutcomes for PostgresStore {
    async fn record(
        &self,
        token: &str,
        now: DateTime<Utc>,
        parts: &Partitioned<'_>,
        by_token: Option<&[SentCall<'_>]>,
    ) -> Result<Option<u64>, StoreError> {
        let mut lane = self.lanes.take().await?;
        let mut tx = sqlx::Connection::begin(&mut *lane).await?;
        let mut updated: Vec<i64> = Vec::new();
        if !parts.retry.is_empty() {
            let ids: Vec<i64> = parts.retry.iter().map(|(c, _, _)| c.id).collect();
            let at: Vec<DateTime<Utc>> = parts.retry.iter().map(|(_, at, _)| *at).collect();
            let errors: Vec<&str> = parts.retry.iter().map(|(_, _, e)| *e).collect();
            let max: Vec<i32> = parts.retry.iter().map(|(c, _, _)| pin(c.max_attempts)).collect();
            let refunds: Vec<i32> = parts.retry.iter().map(|(c, _, _)| refund(c)).collect();
            updated.extend(
                sqlx::query_scalar::<_, i64>(
                    "UPDATE ferry_events e
                     SET status = 'PENDING', next_attempt_at = u.at, last_error = u.error, last_status_at = $5,
                         claim_token = NULL, lease_until = NULL, max_attempts = COALESCE(e.max_attempts, u.max_attempts),
                         attempts = GREATEST(e.attempts - u.refund, 0)
                     FROM UNNEST($1::bigint[], $2::timestamptz[], $3::text[], $4::int[], $7::int[])
                          AS u(id, at, error, max_attempts, refund)
                     WHERE e.id = u.id AND e.claim_token = $6 AND e.status = 'PROCESSING'
                     RETURNING e.id",
                )
                .bind(&ids)
                .bind(&at)
                .bind(&errors)
                .bind(&max)
                .bind(now)
                .bind(token)
                .bind(&refunds)
                .fetch_all(&mut *tx)
                .await?,
            );
        }
        if !parts.failed.is_empty() {
            let ids: Vec<i64> = parts.failed.iter().map(|(c, _, _)| c.id).collect();
            let reasons: Vec<&str> = parts.failed.iter().map(|(_, r, _)| *r).collect();
            let errors: Vec<&str> = parts.failed.iter().map(|(_, _, e)| *e).collect();
            let max: Vec<i32> = parts.failed.iter().map(|(c, _, _)| pin(c.max_attempts)).collect();
            updated.extend(
                sqlx::query_scalar::<_, i64>(
                    "UPDATE ferry_events e
                     SET status = 'FAILED', failure_reason = u.reason, last_error = u.error, processed_at = $5,
                         last_status_at = $5, claim_token = NULL, lease_until = NULL,
                         max_attempts = COALESCE(e.max_attempts, u.max_attempts)
                     FROM UNNEST($1::bigint[], $2::text[], $3::text[], $4::int[]) AS u(id, reason, error, max_attempts)
                     WHERE e.id = u.id AND e.claim_token = $6 AND e.status = 'PROCESSING'
                     RETURNING e.id",
                )
                .bind(&ids)
                .bind(&reasons)
                .bind(&errors)
                .bind(&max)
                .bind(now)
                .bind(token)
                .fetch_all(&mut *tx)
                .await?,
            );
        }
        // The history gets the retries and failures whose outcome was written (not those fenced
        // off); a success is recorded on its event row.
        let written: std::collections::HashSet<i64> = updated.iter().copied().collect();
        let history: Vec<&Completion> =
            parts.retry.iter().map(|(c, _, _)| *c).chain(parts.failed.iter().map(|(c, _, _)| *c)).collect();
        let history: Vec<&Completion> = history.into_iter().filter(|c| written.contains(&c.id)).collect();
        copy_dead_letters(&mut tx, &dead_letters(parts, &written), |letters| {
            sqlx::query(DEAD_LETTER_SQL)
                .bind(letters.iter().map(|(id, _)| *id).collect::<Vec<i64>>())
                .bind(letters.iter().map(|(_, route)| route.to_string()).collect::<Vec<String>>())
                .bind(now)
        })
        .await?;
        match by_token {
            Some(calls) => {
                for sent in calls {
                    let statement = sent.statement(COMPLETE_SENT_BY_TOKEN);
                    if !sent.write(&mut tx, sent_by_token(&statement, token, now, sent)).await? {
                        tx.rollback().await?;
                        lane.done().await;
                        return Ok(None);
                    }
                    updated.extend(&sent.ids);
                }
            }
            None if !parts.sent.is_empty() => {
                let (calls, call_of) = calls_of(&parts.sent);
                updated.extend(
                    sqlx::query_scalar::<_, i64>(
                        "UPDATE ferry_events e
                         SET status = 'SENT', processed_at = $4, last_status_at = $4, claim_token = NULL,
                             lease_until = NULL, max_attempts = COALESCE(e.max_attempts, u.max_attempts),
                             sent_started_at = c.started_at, sent_duration_ms = c.duration_ms,
                             sent_plugin = c.plugin, sent_plugin_hash = c.plugin_hash
                         FROM UNNEST($1::bigint[], $2::int[], $3::int[]) AS u(id, max_attempts, call)
                         JOIN UNNEST($6::timestamptz[], $7::bigint[], $8::text[], $9::text[]) WITH ORDINALITY
                                  AS c(started_at, duration_ms, plugin, plugin_hash, n)
                              ON c.n = u.call
                         WHERE e.id = u.id AND e.claim_token = $5 AND e.status = 'PROCESSING'
                         RETURNING e.id",
                    )
                    .bind(parts.sent.iter().map(|c| c.id).collect::<Vec<i64>>())
                    .bind(parts.sent.iter().map(|c| pin(c.max_attempts)).collect::<Vec<i32>>())
                    .bind(call_of)
                    .bind(now)
                    .bind(token)
                    .bind(calls.iter().map(|c| c.started_at).collect::<Vec<DateTime<Utc>>>())
                    .bind(calls.iter().map(|c| duration_ms(c)).collect::<Vec<i64>>())
                    .bind(calls.iter().map(|c| c.plugin.as_deref()).collect::<Vec<Option<&str>>>())
                    .bind(calls.iter().map(|c| c.plugin_hash.as_deref()).collect::<Vec<Option<&str>>>())
                    .fetch_all(&mut *tx)
                    .await?,
                );
            }
            None => {}
        }
        let deferred = deferrals_written(parts, &written);
        if !deferred.is_empty() {
            sqlx::query(
                "DELETE FROM ferry_attempts a USING UNNEST($1::bigint[], $2::int[]) AS u(id, attempt)
                 WHERE a.event_id = u.id AND a.outcome = 'deferred' AND a.attempt = u.attempt
                   AND a.id = (SELECT MAX(m.id) FROM ferry_attempts m WHERE m.event_id = u.id)",
            )
            .bind(deferred.iter().map(|(id, _)| *id).collect::<Vec<i64>>())
            .bind(deferred.iter().map(|(_, attempt)| *attempt).collect::<Vec<i32>>())
            .execute(&mut *tx)
            .await?;
        }
        if !history.is_empty() {
            let (calls, call_of) = calls_of(&history);
            sqlx::query(
                "INSERT INTO ferry_attempts
                     (event_id, attempt, started_at, duration_ms, outcome, reason, error, plugin, plugin_hash, instance)
                 SELECT u.id, u.attempt, c.started_at, c.duration_ms, u.outcome, u.reason, u.error, c.plugin,
                        c.plugin_hash, c.instance
                 FROM UNNEST($1::bigint[], $2::int[], $3::text[], $4::text[], $5::text[], $6::int[])
                          AS u(id, attempt, outcome, reason, error, call)
                 JOIN UNNEST($7::timestamptz[], $8::bigint[], $9::text[], $10::text[], $11::text[]) WITH ORDINALITY
                          AS c(started_at, duration_ms, plugin, plugin_hash, instance, n)
                      ON c.n = u.call",
            )
            .bind(history.iter().map(|c| c.id).collect::<Vec<i64>>())
            .bind(history.iter().map(|c| pin(c.attempt.number)).collect::<Vec<i32>>())
            .bind(history.iter().map(|c| c.disposition.outcome().as_str()).collect::<Vec<&str>>())
            .bind(history.iter().map(|c| c.disposition.reason().map(|r| r.as_str())).collect::<Vec<Option<&str>>>())
            .bind(history.iter().map(|c| c.disposition.error()).collect::<Vec<Option<&str>>>())
            .bind(call_of)
            .bind(calls.iter().map(|c| c.started_at).collect::<Vec<DateTime<Utc>>>())
            .bind(calls.iter().map(|c| duration_ms(c)).collect::<Vec<i64>>())
            .bind(calls.iter().map(|c| c.plugin.as_deref()).collect::<Vec<Option<&str>>>())
            .bind(calls.iter().map(|c| c.plugin_hash.as_deref()).collect::<Vec<Option<&str>>>())
            .bind(calls.iter().map(|c| c.instance.as_str()).collect::<Vec<&str>>())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        lane.done().await;
        Ok(Some(updated.len() as u64))
    }

    async fn record_run(&self, token: &str, now: DateTime<Utc>, run: &SentCall<'_>) -> Result<u64, StoreError> {
        let mut lane = self.lanes.take().await?;
        let done = sent_by_token(COMPLETE_SENT_BY_TOKEN, token, now, run).execute(&mut *lane).await?;
        lane.done().await;
        Ok(done.rows_affected())
    }
}

/// Deletes the history of events `ids`, just deleted in `tx`: nothing cascades (migration 12). A
/// statement of its own, so it also sees history that a transaction committed while the deletion
/// waited for an event's row (a retry recorded as an operator cancels the event).
async fn delete_history(tx: &mut sqlx::PgConnection, ids: &[i64]) -> Result<(), StoreError> {
    if !ids.is_empty() {
        sqlx::query("DELETE FROM ferry_attempts WHERE event_id = ANY($1)").bind(ids).execute(tx).await?;
    }
    Ok(())
}

/// `statement` ([`COMPLETE_SENT_BY_TOKEN`], perhaps with `RETURNING id`) bound for `sent`.
fn sent_by_token<'q>(
    statement: &'q str,
    token: &'q str,
    now: DateTime<Utc>,
    sent: &'q SentCall<'_>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let call = sent.call;
    let (first, last) = sent.bounds();
    sqlx::query(statement)
        .bind(token)
        .bind(now)
        .bind(&call.route)
        .bind(pin(sent.max_attempts))
        .bind(call.started_at)
        .bind(duration_ms(call))
        .bind(&call.plugin)
        .bind(&call.plugin_hash)
        .bind(first)
        .bind(last)
}

/// Copies FAILED events ($1) to their dead-letter routes ($2) as new PENDING events at $3, the
/// failure in their headers. A time a row holds that a new row may not (written before ferry's
/// checks) becomes $3.
const DEAD_LETTER_SQL: &str = "INSERT INTO ferry_events
         (route, event_type, ordering_key, payload, content_type, headers, created_at, event_time,
          last_status_at, next_attempt_at)
     SELECT u.route, e.event_type, e.ordering_key, e.payload, e.content_type,
            e.headers || jsonb_build_object(
                'ferry-failed-event-id', e.id::text, 'ferry-failed-route', e.route,
                'ferry-failed-reason', COALESCE(e.failure_reason, ''), 'ferry-failed-error', COALESCE(e.last_error, ''),
                'ferry-failed-attempts', e.attempts::text),
            $3,
            CASE WHEN e.event_time >= '0001-01-01 00:00:00+00' AND e.event_time < '10000-01-01 00:00:00+00'
                 THEN e.event_time ELSE $3 END,
            $3, $3
     FROM UNNEST($1::bigint[], $2::text[]) AS u(id, route) JOIN ferry_events e ON e.id = u.id
     ORDER BY e.id";

/// Copies events ($1) to destination routes ($2) as new PENDING events at $3, in the order given
/// (so each destination's deliveries keep the order of the events). The original creation time
/// is kept, so latency counts from the application's commit; each copy's attempt limit is its
/// destination's; a time a new row may not hold
/// (written before ferry's checks) becomes $3.
const FAN_OUT_SQL: &str = "INSERT INTO ferry_events
         (route, event_type, ordering_key, payload, content_type, headers, created_at, event_time,
          last_status_at, next_attempt_at, parent_id)
     SELECT u.route, e.event_type, e.ordering_key, e.payload, e.content_type, e.headers,
            CASE WHEN e.created_at >= '0001-01-01 00:00:00+00' AND e.created_at < '10000-01-01 00:00:00+00'
                 THEN e.created_at ELSE $3 END,
            CASE WHEN e.event_time >= '0001-01-01 00:00:00+00' AND e.event_time < '10000-01-01 00:00:00+00'
                 THEN e.event_time ELSE $3 END,
            $3, $3, e.id
     FROM UNNEST($1::bigint[], $2::text[]) WITH ORDINALITY AS u(id, route, n) JOIN ferry_events e ON e.id = u.id
     ORDER BY u.n";

/// Settings of ferry's own connections, chosen for the claim, the statement that runs most:
/// - Its filters on ordered, blocking and paused routes are parameters that are nearly always
///   empty. A generic plan, which PostgreSQL switches prepared statements to after five runs,
///   cannot see that; a custom plan can.
/// - It must walk the pending index in claim order and stop after the batch. When statistics are
///   stale (a burst of events arrived since the last ANALYZE, the very moment there is a backlog)
///   the planner estimates a handful of due rows and prefers a bitmap scan that reads *every* due
///   row and sorts them, making each claim cost as much as the whole backlog. Without bitmap scans
///   it takes the ordered index scan. Ferry's other statements use plain index scans anyway.
pub const SESSION_SETTINGS: [(&str, &str); 2] =
    [("plan_cache_mode", "force_custom_plan"), ("enable_bitmapscan", "off")];

/// The claim's tests of a due event's route: not one of the paused routes $8, the route $9 when
/// given, and in an ordered route ($6) not queued behind an unfinished event of its key (or a
/// FAILED one, in the blocking routes $7). With no route paused, chosen or ordered, they pass every
/// event, and [`CLAIM_PLAIN_SQL`] leaves them out.
macro_rules! route_filters {
    () => {
        "
           AND NOT (e.route = ANY($8)) AND ($9::text IS NULL OR e.route = $9)
           AND (e.ordering_key IS NULL OR NOT (e.route = ANY($6)) OR NOT EXISTS (
                SELECT 1 FROM ferry_events p
                WHERE p.route = e.route AND p.ordering_key = e.ordering_key AND p.id < e.id
                  AND (p.status IN ('PENDING', 'PROCESSING')
                       OR (p.status = 'FAILED' AND p.route = ANY($7)))))"
    };
}

/// The events a claim picks, in its order (`CLAIM_SQL`, `DUE_SQL`), `$one` narrowing them to one
/// (`CLAIM_ONE_SQL`), tested by `$filters` (`route_filters!()`, or `""` for none).
///
/// Ferry's clock reads whole milliseconds ($1), while PostgreSQL's `now()`, which an emit or a
/// plain INSERT takes as the due time, keeps microseconds: an event is due for a claim in the
/// millisecond it becomes due. Compared with `<= $1`, an event committed in the same millisecond
/// as the claim its notification set off was not, and waited for the next wake-up.
macro_rules! due_sql {
    ($one:literal, $($filters:tt)*) => {
        concat!(
            "
         SELECT e.id FROM ferry_events e
         WHERE e.status = 'PENDING' AND e.next_attempt_at < $1::timestamptz + interval '1 millisecond'",
            $($filters)*,
            $one,
            "
         ORDER BY e.next_attempt_at, e.id
         LIMIT $2"
        )
    };
}

/// Claims up to $2 due events for instance $3 under token $4 until $5, at $1, as the route filters
/// (`route_filters!`) allow; payloads above $10 bytes come back as their size only, names above $11
/// and headers printing above $12 as NULL. The picked ids are handed to the
/// UPDATE as an array, so it finds its rows by primary key at any size the outbox reaches: joined
/// instead, PostgreSQL hashed the whole table for them when it held up to some tens of thousands
/// of rows.
pub const CLAIM_SQL: &str = claim_sql!("", "FOR UPDATE SKIP LOCKED", route_filters!());

/// [`CLAIM_SQL`] without the route filters, for a claim that has no route to hold back
/// ([`Claim::filters_routes`]): the common case, where testing each due event's route against
/// empty lists cost about 1% of what PostgreSQL spends per event (BENCHMARKS.md). It takes the
/// same parameters and reads $6 to $9 not at all.
pub const CLAIM_PLAIN_SQL: &str = claim_sql!("", "FOR UPDATE SKIP LOCKED", "");

/// [`CLAIM_SQL`] for event $13 alone, found by primary key, which waits for a lock on it rather
/// than skip it: a claim that PostgreSQL refused reports its error before its transaction has let
/// go of its rows.
pub const CLAIM_ONE_SQL: &str = claim_sql!(" AND e.id = $13", "FOR UPDATE", route_filters!());

/// The claim statement, of the events `$one` narrows them to and `$filters` allows, locking the
/// rows it picks with `$lock`.
macro_rules! claim_sql {
    ($one:literal, $lock:literal, $($filters:tt)*) => {
        concat!(
            "WITH picked AS (",
            due_sql!($one, $($filters)*),
            "
         ",
            $lock,
            "
     )
     UPDATE ferry_events e
     SET status = 'PROCESSING', last_status_at = $1,
         -- Saturates: a hand-edited count at the limit must not fail the whole claim.
         attempts = CASE WHEN e.attempts < 2147483647 THEN e.attempts + 1 ELSE e.attempts END,
         claimed_by = $3, claim_token = $4, lease_until = $5
     WHERE e.id = ANY(ARRAY(SELECT id FROM picked))
     RETURNING e.id,
               -- A value over its limit comes back NULL (the event fails naming it), the ordering
               -- key's with key_oversized set; so the relay never loads it.
               CASE WHEN octet_length(e.route) <= $11 THEN e.route END AS route,
               CASE WHEN octet_length(e.event_type) <= $11 THEN e.event_type END AS event_type,
               CASE WHEN octet_length(e.ordering_key) <= $11 THEN e.ordering_key END AS ordering_key,
               CASE WHEN octet_length(e.payload) <= $10 THEN e.payload END AS payload,
               octet_length(e.payload)::bigint AS payload_size,
               CASE WHEN octet_length(e.content_type) <= $11 THEN e.content_type END AS content_type,
               -- Headers stored uncompressed in at most 256 bytes print in at most a few MB (numbers
               -- print every digit of their exponent); others are measured as text first. The
               -- INSERT trigger (migration 11) holds headers to the limit where they are written;
               -- this is for rows written without triggers or edited by hand.
               CASE WHEN (pg_column_size(e.headers) <= 256 AND pg_column_compression(e.headers) IS NULL)
                         OR octet_length(e.headers::text) <= $12
                    THEN e.headers::text END AS headers,
               e.attempts, e.max_attempts, e.event_time, e.created_at, e.next_attempt_at,
               octet_length(e.ordering_key) > $11 AS key_oversized"
        )
    };
}
use claim_sql;

/// The ids of the events a claim would take, in its order, without taking them: the claim's
/// parameters, of which it reads $1, $2 and $6 to $9.
pub const DUE_SQL: &str = due_sql!("", route_filters!());

/// One step of retention's sweep (`Store::purge_sent`): the window is the next $2 events from id
/// $1 on, read along the primary key; of them, the SENT rows processed before $3 are locked (those
/// another transaction holds are skipped) and deleted with their history, found by primary key as
/// the claim finds its rows. History rows in the window's range whose event is gone (deleted by
/// SQL: nothing cascades) go too. Returns the window's size, its last id, whether all of it was
/// written between $3 and $4 (now), and how many events went.
pub const SWEEP_SQL: &str = "WITH seen AS (
         SELECT id, status, processed_at, created_at FROM ferry_events WHERE id >= $1 ORDER BY id LIMIT $2
     ), due AS (
         SELECT e.id FROM ferry_events e
         WHERE e.id = ANY(ARRAY(SELECT id FROM seen WHERE status = 'SENT' AND processed_at < $3))
           AND e.status = 'SENT' AND e.processed_at < $3
         FOR UPDATE SKIP LOCKED
     ), gone AS (
         DELETE FROM ferry_events WHERE id = ANY(ARRAY(SELECT id FROM due)) RETURNING 1
     ), history AS (
         DELETE FROM ferry_attempts a
         WHERE a.event_id >= $1 AND a.event_id <= (SELECT MAX(id) FROM seen)
           AND (a.event_id = ANY(ARRAY(SELECT id FROM due))
                OR NOT EXISTS (SELECT 1 FROM ferry_events e WHERE e.id = a.event_id))
     )
     SELECT (SELECT COUNT(*) FROM seen) AS seen, (SELECT MAX(id) FROM seen) AS last,
            (SELECT bool_and(created_at >= $3 AND created_at <= $4) FROM seen) AS young, (SELECT COUNT(*) FROM gone) AS deleted";

/// The headers as `ferry show` and lists show them: their text, or a note of its size past 128 KiB
/// (`ferry_headers_text`, migration 11). Those stored uncompressed in at most 256 bytes are printed
/// as they are, sparing the function's call.
macro_rules! shown_headers {
    () => {
        "CASE WHEN pg_column_size(headers) <= 256 AND pg_column_compression(headers) IS NULL THEN headers::text
          ELSE ferry_headers_text(headers, 131072) END AS headers"
    };
}

pub(super) const EVENT_COLUMNS: &str = concat!(
    "id, route, event_type, ordering_key, payload, content_type, ",
    shown_headers!(),
    ",
     status, attempts, max_attempts, event_time, created_at, last_status_at, next_attempt_at, processed_at, \
     last_error, failure_reason, claimed_by, claim_token, lease_until, parent_id"
);

/// The columns of a list: every one but the payload, which lists do not show. A name or headers
/// longer than a claim loads (written by SQL past `emit`'s limits) is shown as its size: a page
/// of such rows would otherwise be loaded whole.
pub(super) const LIST_COLUMNS: &str =
    concat!(super::listed_names!("'\\x'::bytea"), shown_headers!(), ", ", super::listed_tail!());

/// Binds a claim's parameters, $1 to $12, to a query on `CLAIM_SQL`, `CLAIM_ONE_SQL` (which binds
/// the event, $13, after them) or `DUE_SQL`.
macro_rules! bind_claim {
    ($query:expr, $claim:expr) => {{
        let claim: &Claim = $claim;
        $query
            .bind(claim.now)
            .bind(i64::from(claim.limit))
            .bind(&claim.instance)
            .bind(&claim.token)
            .bind(claim.lease_until)
            .bind(&claim.ordered_routes)
            .bind(&claim.blocking_routes)
            .bind(&claim.paused_routes)
            .bind(&claim.only_route)
            .bind(i64::try_from(claim.max_payload).unwrap_or(i64::MAX))
            .bind(crate::event::MAX_CLAIMED_NAME)
            .bind(crate::event::MAX_CLAIMED_HEADERS)
    }};
}

/// The oldest PostgreSQL ferry runs on (`server_version_num`): 14 has `pg_column_compression`.
const MIN_SERVER_VERSION: i32 = 140_000;

/// Sets FAILED (`invalid_event`, error $3, at $2) PENDING event $1, which no claim can take, and
/// writes the failure into its history as by instance $4. Affects one row when the event was set.
const UNCLAIMABLE_SQL: &str = "WITH failed AS (
         UPDATE ferry_events
         SET status = 'FAILED', failure_reason = 'invalid_event', last_error = $3, processed_at = $2,
             last_status_at = $2
         WHERE id = $1 AND status = 'PENDING'
         -- A count edited by hand below zero must not stop the event failing.
         RETURNING id, GREATEST(attempts, 0) AS attempts
     )
     INSERT INTO ferry_attempts (event_id, attempt, started_at, duration_ms, outcome, reason, error, instance)
     SELECT id, attempts, $2, 0, 'failed', 'invalid_event', $3, $4 FROM failed";

#[async_trait]
impl Store for PostgresStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        let (number, version): (i32, String) =
            sqlx::query_as("SELECT current_setting('server_version_num')::int, current_setting('server_version')")
                .fetch_one(&self.pool)
                .await?;
        if number < MIN_SERVER_VERSION {
            return Err(StoreError::Unsupported(format!(
                "PostgreSQL {version} is too old: ferry needs 14 or later (its claim reads how values are compressed)"
            )));
        }
        sqlx::migrate!("../migrations/postgres").run(&self.pool).await?;
        Ok(())
    }

    async fn insert(&self, event: &NewEvent, now: DateTime<Utc>) -> Result<i64, StoreError> {
        let mut conn = self.pool.acquire().await?;
        Ok(conn.insert_event(event, Some(now)).await?)
    }

    async fn claim_only(&self, claim: &Claim, only_id: Option<i64>) -> Result<Vec<ClaimedEvent>, StoreError> {
        let rows = if let Some(id) = only_id {
            // Waits for its row at most a second: a refused claim lets go of its rows within
            // milliseconds, a transaction left open may hold one for good.
            let mut tx = self.pool.begin().await?;
            sqlx::query("SET LOCAL lock_timeout = '1s'").execute(&mut *tx).await?;
            let rows = bind_claim!(sqlx::query(CLAIM_ONE_SQL), claim).bind(id).fetch_all(&mut *tx).await?;
            tx.commit().await?;
            rows
        } else {
            let sql = if claim.filters_routes() { CLAIM_SQL } else { CLAIM_PLAIN_SQL };
            let mut lane = self.lanes.take().await?;
            let rows = bind_claim!(sqlx::query(sql), claim).fetch_all(&mut *lane).await?;
            lane.done().await;
            rows
        };
        claimed_events(&rows, claim.max_payload, false)
    }

    async fn due(&self, claim: &Claim) -> Result<Vec<i64>, StoreError> {
        Ok(bind_claim!(sqlx::query_scalar(DUE_SQL), claim).fetch_all(&self.pool).await?)
    }

    async fn set_unclaimable(&self, id: i64, now: DateTime<Utc>, by: &str, error: &str) -> Result<bool, StoreError> {
        let query = sqlx::query(UNCLAIMABLE_SQL).bind(id).bind(now).bind(error).bind(by);
        Ok(query.execute(&self.pool).await?.rows_affected() == 1)
    }

    async fn complete(&self, token: &str, now: DateTime<Utc>, items: &[Completion]) -> Result<u64, StoreError> {
        complete_batch(self, token, now, items).await
    }

    async fn release(&self, token: &str, ids: &[i64], now: DateTime<Utc>) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "UPDATE ferry_events
             SET status = 'PENDING', attempts = GREATEST(attempts - 1, 0), last_status_at = $3,
                 claim_token = NULL, lease_until = NULL
             WHERE id = ANY($1) AND claim_token = $2 AND status = 'PROCESSING'",
        )
        .bind(ids)
        .bind(token)
        .bind(now)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn drop_copies(&self, token: &str, ids: &[i64]) -> Result<Vec<i64>, StoreError> {
        let mut tx = self.pool.begin().await?;
        let done: Vec<i64> = sqlx::query_scalar(
            "DELETE FROM ferry_events WHERE id = ANY($1) AND claim_token = $2 AND status = 'PROCESSING' RETURNING id",
        )
        .bind(ids)
        .bind(token)
        .fetch_all(&mut *tx)
        .await?;
        delete_history(&mut tx, &done).await?;
        tx.commit().await?;
        Ok(ids_in_order(done))
    }

    async fn recover_expired(&self, now: DateTime<Utc>, limit: u32) -> Result<Vec<Recovered>, StoreError> {
        let rows = sqlx::query(
            "WITH expired AS (
                 SELECT id, CASE WHEN octet_length(claimed_by) <= $4 THEN claimed_by END AS claimed_by,
                        octet_length(claimed_by) AS claimed_by_size,
                        -- What the message names: printable ASCII, as every name ferry writes.
                        CASE WHEN octet_length(claimed_by) <= $4 AND claimed_by ~ '^[ -~]*$' THEN claimed_by END AS shown
                 FROM ferry_events
                 -- A row left PROCESSING without a lease a ferry took (none, an infinite time,
                 -- one past the ceiling) would otherwise be held for as long as it says.
                 WHERE status = 'PROCESSING'
                   AND (lease_until < $1 OR lease_until > $2 OR lease_until IS NULL OR NOT isfinite(lease_until))
                 ORDER BY id
                 LIMIT $3
                 FOR UPDATE SKIP LOCKED
             )
             UPDATE ferry_events e
             SET status = 'PENDING', last_status_at = $1, next_attempt_at = $1, claim_token = NULL,
                 lease_until = NULL,
                 last_error = 'claim lease expired while PROCESSING (claimed by '
                     || COALESCE(expired.shown, 'an instance name of ' || expired.claimed_by_size || ' bytes', '?')
                     || ')'
             FROM expired WHERE e.id = expired.id
             RETURNING e.id, convert_to(expired.claimed_by, 'UTF8') AS claimed_by",
        )
        .bind(now)
        .bind(lease_ceiling(now))
        .bind(i64::from(limit))
        .bind(MAX_CLAIMANT)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| Ok(Recovered::new(row.try_get("id")?, row.try_get("claimed_by")?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(Into::into)
    }

    async fn reschedule_unreadable(&self, now: DateTime<Utc>) -> Result<Vec<i64>, StoreError> {
        // `-infinity` is due already; `infinity` is the one time no clock reaches. Found through
        // the pending index.
        let ids = sqlx::query_scalar(
            "UPDATE ferry_events SET next_attempt_at = $1
             WHERE status = 'PENDING' AND next_attempt_at = 'infinity'
             RETURNING id",
        )
        .bind(now)
        .fetch_all(&self.pool)
        .await?;
        Ok(ids)
    }

    async fn resend(&self, ids: &[i64], now: DateTime<Utc>) -> Result<u64, StoreError> {
        let done = sqlx::query(
            "UPDATE ferry_events
             SET status = 'PENDING', attempts = 0, last_error = NULL, failure_reason = NULL,
                 processed_at = NULL, next_attempt_at = $2, last_status_at = $2
             WHERE id = ANY($1) AND status = 'FAILED'",
        )
        .bind(ids)
        .bind(now)
        .execute(&self.pool)
        .await?;
        if done.rows_affected() > 0 {
            self.wake_relays().await;
        }
        Ok(done.rows_affected())
    }

    async fn reschedule(&self, id: i64, at: DateTime<Utc>) -> Result<bool, StoreError> {
        let done = sqlx::query("UPDATE ferry_events SET next_attempt_at = $2 WHERE id = $1 AND status = 'PENDING'")
            .bind(id)
            .bind(at)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn end_event(&self, id: i64, end: EndEvent<'_>, now: DateTime<Utc>) -> Result<bool, StoreError> {
        let ended: i64 = match end {
            EndEvent::Cancel => {
                let mut tx = self.pool.begin().await?;
                let gone: Vec<i64> = sqlx::query_scalar(
                    "DELETE FROM ferry_events WHERE id = $1 AND status IN ('PENDING', 'PROCESSING') RETURNING id",
                )
                .bind(id)
                .fetch_all(&mut *tx)
                .await?;
                delete_history(&mut tx, &gone).await?;
                tx.commit().await?;
                i64::try_from(gone.len()).unwrap_or(i64::MAX)
            }
            EndEvent::Fail { note } => {
                let done = sqlx::query(
                    "UPDATE ferry_events
                     SET status = 'FAILED', failure_reason = 'operator', last_error = $2, processed_at = $3,
                         last_status_at = $3, claim_token = NULL, lease_until = NULL
                     WHERE id = $1 AND status IN ('PENDING', 'PROCESSING')",
                )
                .bind(id)
                .bind(note)
                .bind(now)
                .execute(&self.pool)
                .await?;
                i64::try_from(done.rows_affected()).unwrap_or(i64::MAX)
            }
        };
        Ok(ended == 1)
    }

    async fn purge_sent(&self, window: &SweepWindow) -> Result<SweepStep, StoreError> {
        let SweepWindow { from, limit, before, now } = *window;
        let row = sqlx::query(SWEEP_SQL)
            .bind(from)
            .bind(i64::from(limit))
            .bind(before)
            .bind(now)
            .fetch_one(&self.pool)
            .await?;
        // COUNT(*) is a bigint, never negative.
        let count = |column: &str| row.try_get::<i64, _>(column).map(|n| u64::try_from(n).unwrap_or_default());
        Ok(SweepStep {
            seen: count("seen")?,
            last: row.try_get("last")?,
            young: row.try_get::<Option<bool>, _>("young")?.unwrap_or(false),
            deleted: count("deleted")?,
        })
    }

    async fn sweep_position(&self) -> Result<i64, StoreError> {
        let next = sqlx::query_scalar("SELECT next_id FROM ferry_sweep").fetch_optional(&self.pool).await?;
        Ok(next.unwrap_or(i64::MIN))
    }

    async fn set_sweep_position(&self, was: i64, next: i64) -> Result<bool, StoreError> {
        let moved = sqlx::query(
            "UPDATE ferry_sweep SET next_id = $2
             WHERE one IN (SELECT one FROM ferry_sweep WHERE next_id = $1 FOR UPDATE SKIP LOCKED)",
        )
        .bind(was)
        .bind(next)
        .execute(&self.pool)
        .await?;
        if moved.rows_affected() == 1 {
            return Ok(true);
        }
        // The row is gone only if deleted by hand: made again (DO NOTHING neither waits for a
        // lock on a row that is there nor changes it).
        let made = sqlx::query("INSERT INTO ferry_sweep (one, next_id) VALUES (true, $1) ON CONFLICT DO NOTHING")
            .bind(next)
            .execute(&self.pool)
            .await?;
        Ok(made.rows_affected() == 1)
    }

    fn spawn_waker(&self, wake: Arc<Notify>, stop: CancellationToken) -> bool {
        let pool = self.pool.clone();
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(100);
            while !stop.is_cancelled() {
                match listen(&pool, &wake, &stop).await {
                    Ok(()) => return,
                    Err(e) => {
                        tracing::warn!("LISTEN {NOTIFY_CHANNEL} interrupted, polling until it is back: {e}");
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = tokio::time::sleep(pause) => {}
                        }
                        pause = (pause * 2).min(Duration::from_secs(5));
                    }
                }
            }
        });
        true
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
        let watch = sqlx::query(WATCH_SQL).bind(now).bind(lease_ceiling(now)).fetch_one(&self.pool).await?;
        let latency = match latency_since {
            Some(since) => Some((
                since,
                sqlx::query(LATENCY_SQL).bind(since).bind(i64::from(LATENCY_SAMPLES)).fetch_all(&self.pool).await?,
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
        let row: Option<StoredRow> = sqlx::query_as(&format!("SELECT {EVENT_COLUMNS} FROM ferry_events WHERE id = $1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(StoredRow::into_record))
    }

    async fn deliveries(&self, id: i64) -> Result<Vec<Delivery>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, route, status, attempts::bigint AS attempts FROM ferry_events
             WHERE parent_id = $1 ORDER BY id LIMIT $2",
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
        let mut lane = self.lanes.take().await?;
        let mut tx = sqlx::Connection::begin(&mut *lane).await?;
        let ids: Vec<i64> = items.iter().map(|(id, _)| *id).collect();
        let handed: Vec<i64> = sqlx::query_scalar(
            "UPDATE ferry_events
             SET status = 'SENT', processed_at = $3, last_status_at = $3, claim_token = NULL, lease_until = NULL
             WHERE id = ANY($1) AND claim_token = $2 AND status = 'PROCESSING'
             RETURNING id",
        )
        .bind(&ids)
        .bind(token)
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        let copies = copies(items, &handed);
        if !copies.is_empty() {
            sqlx::query(FAN_OUT_SQL)
                .bind(copies.iter().map(|(id, _)| *id).collect::<Vec<i64>>())
                .bind(copies.iter().map(|(_, route)| route.to_string()).collect::<Vec<String>>())
                .bind(now)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        lane.done().await;
        Ok(handed)
    }

    async fn tally_failed(&self, filter: &FailedFilter) -> Result<(u64, Option<i64>), StoreError> {
        let sql = format!("SELECT COUNT(*), MAX(id) FROM ferry_events WHERE {FAILED_WHERE}");
        let row = bind_filter!(sqlx::query(&sql), filter).fetch_one(&self.pool).await?;
        Ok((u64::try_from(row.try_get::<i64, _>(0)?).unwrap_or(0), row.try_get::<Option<i64>, _>(1)?))
    }

    async fn list_failed(&self, filter: &FailedFilter, limit: u32) -> Result<Vec<EventRecord>, StoreError> {
        let order = if filter.newest_first { "DESC" } else { "ASC" };
        let sql = format!("SELECT {LIST_COLUMNS} FROM ferry_events WHERE {FAILED_WHERE} ORDER BY id {order} LIMIT $9");
        let rows: Vec<StoredRow> =
            bind_filter!(sqlx::query_as(&sql), filter).bind(i64::from(limit)).fetch_all(&self.pool).await?;
        Ok(rows.into_iter().map(StoredRow::into_record).collect())
    }

    async fn failed_groups(&self, filter: &FailedFilter, limit: u32) -> Result<Vec<FailedGroup>, StoreError> {
        let sql = format!(
            "SELECT {FAILED_GROUP_COLUMNS} FROM ferry_events WHERE {FAILED_WHERE} {FAILED_GROUP_ORDER} LIMIT $9"
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
                 processed_at = NULL, next_attempt_at = $10, last_status_at = $10
             WHERE id IN (SELECT id FROM ferry_events WHERE {FAILED_WHERE} ORDER BY id LIMIT $9)
               AND status = 'FAILED'
             RETURNING id"
        );
        let done = bind_filter!(sqlx::query_scalar(&sql), filter)
            .bind(i64::from(limit))
            .bind(now)
            .fetch_all(&self.pool)
            .await?;
        if !done.is_empty() {
            self.wake_relays().await;
        }
        Ok(ids_in_order(done))
    }

    async fn purge_failed(&self, filter: &FailedFilter, limit: u32) -> Result<Vec<i64>, StoreError> {
        let sql = format!(
            "DELETE FROM ferry_events WHERE id IN (SELECT id FROM ferry_events WHERE {FAILED_WHERE} ORDER BY id LIMIT $9)
               AND status = 'FAILED'
             RETURNING id"
        );
        let mut tx = self.pool.begin().await?;
        let done = bind_filter!(sqlx::query_scalar(&sql), filter).bind(i64::from(limit)).fetch_all(&mut *tx).await?;
        delete_history(&mut tx, &done).await?;
        tx.commit().await?;
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
        // The count is summed as a bigint and kept at the column's largest: a count edited to
        // the top of `integer` must not make every later failure of its route an error.
        let row = sqlx::query_as(
            "INSERT INTO ferry_breakers AS b (route, consecutive_failures, opened_at, reason, updated_at)
             VALUES ($1, $2, CASE WHEN $2 > 0 AND $2 >= $4 THEN $5 END, CASE WHEN $2 > 0 AND $2 >= $4 THEN $3 END, $5)
             ON CONFLICT (route) DO UPDATE SET
                 consecutive_failures = CASE WHEN $2 = 0 THEN 0 ELSE LEAST(b.consecutive_failures::bigint + $2, 2147483647) END,
                 opened_at = CASE WHEN b.manual THEN b.opened_at
                                  WHEN $2 = 0 THEN NULL
                                  WHEN b.opened_at IS NOT NULL OR b.consecutive_failures::bigint + $2 >= $4 THEN $5
                             END,
                 reason = CASE WHEN b.manual THEN b.reason
                               WHEN $2 = 0 THEN NULL
                               WHEN b.opened_at IS NOT NULL OR b.consecutive_failures::bigint + $2 >= $4 THEN $3
                          END,
                 probe_until = CASE WHEN b.manual THEN b.probe_until END,
                 updated_at = $5
             RETURNING *",
        )
        .bind(route)
        .bind(i32::try_from(failures).unwrap_or(i32::MAX))
        .bind(reason)
        .bind(i32::try_from(threshold).unwrap_or(i32::MAX))
        .bind(now)
        .fetch_one(&self.pool)
        .await?;
        Ok(row)
    }

    async fn take_probe(
        &self,
        route: &str,
        cooled: DateTime<Utc>,
        now: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(
            "UPDATE ferry_breakers SET probe_until = $4, updated_at = $3
             WHERE route = $1 AND opened_at <= $2 AND NOT manual AND (probe_until IS NULL OR probe_until <= $3)",
        )
        .bind(route)
        .bind(cooled)
        .bind(now)
        .bind(until)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn release_probe(&self, route: &str, held_until: DateTime<Utc>) -> Result<(), StoreError> {
        sqlx::query("UPDATE ferry_breakers SET probe_until = NULL WHERE route = $1 AND probe_until = $2")
            .bind(route)
            .bind(held_until)
            .execute(&self.pool)
            .await?;
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
            "INSERT INTO ferry_breakers (route, opened_at, reason, manual, updated_at) VALUES ($1, $2, $3, true, $2)
             ON CONFLICT (route) DO UPDATE
             SET opened_at = $2, reason = $3, manual = true, probe_until = NULL, updated_at = $2
             RETURNING *"
        } else {
            "INSERT INTO ferry_breakers (route, updated_at) VALUES ($1, $2)
             ON CONFLICT (route) DO UPDATE
             SET consecutive_failures = 0, opened_at = NULL, reason = NULL, manual = false, probe_until = NULL,
                 updated_at = $2
             RETURNING *"
        };
        let query = sqlx::query_as(sql).bind(route).bind(now);
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

super::endpoint_queries!(PostgresStore);

/// The FAILED rows a [`FailedFilter`] selects; its values are bound as $1..$8 by [`bind_filter`].
const FAILED_WHERE: &str = "status = 'FAILED' AND ($1::text IS NULL OR route = $1)
     AND ($2::text IS NULL OR event_type = $2) AND ($3::timestamptz IS NULL OR created_at >= $3)
     AND ($4::timestamptz IS NULL OR created_at < $4) AND ($5::bigint IS NULL OR id > $5)
     AND ($6::text IS NULL OR failure_reason = $6 OR ($6 = 'none' AND failure_reason IS NULL))
     AND ($7::bigint IS NULL OR id <= $7)
     AND ($8::text IS NULL OR strpos(lower(last_error), lower($8)) > 0)";

/// Binds a [`FailedFilter`] as $1..$8 to a query (or `query_as`) built on [`FAILED_WHERE`].
macro_rules! bind_filter {
    ($query:expr, $filter:expr) => {{
        let filter: &FailedFilter = $filter;
        $query
            .bind(&filter.route)
            .bind(&filter.event_type)
            .bind(filter.from)
            .bind(filter.before)
            .bind(filter.after_id)
            .bind(filter.reason.map(ReasonFilter::as_str))
            .bind(filter.through_id)
            .bind(&filter.error)
    }};
}
use bind_filter;

/// The channel the `ferry_events_notify` trigger signals.
const NOTIFY_CHANNEL: &str = "ferry_events";

/// Forwards notifications to `wake` until `stop` (Ok) or the connection fails (Err).
async fn listen(pool: &PgPool, wake: &Notify, stop: &CancellationToken) -> Result<(), sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(NOTIFY_CHANNEL).await?;
    // Events committed while we were not listening would otherwise wait for the next poll.
    wake.notify_one();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            received = listener.try_recv() => match received? {
                Some(_) => wake.notify_one(),
                None => return Err(sqlx::Error::PoolClosed),
            },
        }
    }
}

/// The attempt limit as stored (0 = unlimited).
fn pin(max_attempts: u32) -> i32 {
    i32::try_from(max_attempts).unwrap_or(i32::MAX)
}
