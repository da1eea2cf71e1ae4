//! Transactional emit: applications insert events through their own open sqlx transaction, so
//! the event is committed together with their business data, or not at all.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> anyhow::Result<()> {
//! let mut tx = pool.begin().await?;
//! sqlx::query("UPDATE orders SET state = 'paid' WHERE id = 42").execute(&mut *tx).await?;
//! ferry::emit(&mut *tx, &ferry::NewEvent::new("orders", "order.paid", r#"{"id":42}"#)).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```

use std::future::Future;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, SqliteConnection};

use crate::event::NewEvent;
use crate::store::StoreError;

/// A database connection ferry can insert events through: `PgConnection` and `SqliteConnection`
/// (and so `&mut *tx` for a transaction on either).
pub trait Outbox {
    /// Inserts `event`; `now` stamps `created_at` (the database's clock when `None`).
    fn insert_event(
        &mut self,
        event: &NewEvent,
        now: Option<DateTime<Utc>>,
    ) -> impl Future<Output = Result<i64, StoreError>> + Send;
}

/// Inserts `event` through `conn`, typically `&mut *tx` of the caller's transaction, and returns
/// its id. Nothing is delivered unless and until that transaction commits.
pub async fn emit<C: Outbox + ?Sized>(conn: &mut C, event: &NewEvent) -> Result<i64, StoreError> {
    conn.insert_event(event, None).await
}

fn content_type(event: &NewEvent) -> &str {
    event.content_type.as_deref().unwrap_or("application/json")
}

fn max_attempts(event: &NewEvent) -> Result<Option<i32>, StoreError> {
    event
        .max_attempts
        .map(|n| i32::try_from(n).map_err(|_| StoreError::InvalidEvent(format!("max_attempts {n} is too large"))))
        .transpose()
}

impl Outbox for PgConnection {
    async fn insert_event(&mut self, event: &NewEvent, now: Option<DateTime<Utc>>) -> Result<i64, StoreError> {
        event.validate().map_err(StoreError::InvalidEvent)?;
        let id = sqlx::query_scalar(
            "INSERT INTO ferry_events
                 (route, event_type, payload, content_type, headers, ordering_key, max_attempts,
                  created_at, event_time, last_status_at, next_attempt_at)
             SELECT $1, $2, $3, $4, $5::jsonb, $6, $7, t.now, COALESCE($8, t.now), t.now, COALESCE($9, t.now)
             FROM (SELECT COALESCE($10, now()) AS now) t
             RETURNING id",
        )
        .bind(&event.route)
        .bind(&event.event_type)
        .bind(&event.payload)
        .bind(content_type(event))
        .bind(event.headers_json())
        .bind(&event.ordering_key)
        .bind(max_attempts(event)?)
        .bind(event.event_time)
        .bind(event.not_before)
        .bind(now)
        .fetch_one(&mut *self)
        .await?;
        Ok(id)
    }
}

impl Outbox for SqliteConnection {
    async fn insert_event(&mut self, event: &NewEvent, now: Option<DateTime<Utc>>) -> Result<i64, StoreError> {
        event.validate().map_err(StoreError::InvalidEvent)?;
        let ms = |t: Option<DateTime<Utc>>| t.map(|t| t.timestamp_millis());
        let id = sqlx::query_scalar(
            "INSERT INTO ferry_events
                 (route, event_type, payload, content_type, headers, ordering_key, max_attempts,
                  created_at, event_time, last_status_at, next_attempt_at)
             SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, t.now, COALESCE(?8, t.now), t.now, COALESCE(?9, t.now)
             FROM (SELECT COALESCE(?10, CAST(unixepoch('subsec') * 1000 AS INTEGER)) AS now) t
             RETURNING id",
        )
        .bind(&event.route)
        .bind(&event.event_type)
        .bind(&event.payload)
        .bind(content_type(event))
        .bind(event.headers_json())
        .bind(&event.ordering_key)
        .bind(max_attempts(event)?)
        .bind(ms(event.event_time))
        .bind(ms(event.not_before))
        .bind(ms(now))
        .fetch_one(&mut *self)
        .await?;
        Ok(id)
    }
}
