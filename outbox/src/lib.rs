//! Emit events into ferry's transactional outbox from your own sqlx transaction: the event is
//! committed together with your business data, or not at all. This crate is all an application
//! needs; it depends on sqlx and nothing of ferry's runtime.
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let mut tx = pool.begin().await?;
//! sqlx::query("UPDATE orders SET state = 'paid' WHERE id = 42").execute(&mut *tx).await?;
//! ferry_outbox::emit(&mut *tx, &ferry_outbox::NewEvent::new("orders", "order.paid", r#"{"id":42}"#)).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```
//!
//! The `postgres` and `sqlite` features (both on by default) select the connections it supports.

use std::future::Future;

use chrono::{DateTime, Utc};

/// The largest payload [`emit`] accepts: ferry's default `relay.max_payload`. Use
/// [`emit_with_max_payload`] when ferry is configured with another limit.
pub const DEFAULT_MAX_PAYLOAD: usize = 1 << 20;

/// The longest route, event type, ordering key or content type ferry delivers, in bytes. Ferry
/// does not load a longer one: the event fails as `invalid_event`.
pub const MAX_NAME: usize = 1024;

/// The most bytes an event's headers may take as the JSON object stored in the `headers` column.
/// Ferry loads headers of up to twice this as the database prints them; larger ones, written by
/// SQL, fail the event as `invalid_event`.
pub const MAX_HEADERS: usize = 64 << 10;

/// The refusal of a payload of `size` bytes over the limit of `max`, saying what to do instead.
pub fn payload_too_large(size: u64, max: usize) -> String {
    format!(
        "the payload is {size} bytes, more than the {max} bytes ferry accepts (relay.max_payload); \
         store large documents elsewhere and send a reference to them"
    )
}

/// Why an event was not inserted.
#[derive(Debug, thiserror::Error)]
pub enum EmitError {
    /// The event itself is unusable; the message names the field.
    #[error("invalid event: {0}")]
    Invalid(String),
    /// The database refused or failed the INSERT.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
}

/// An event an application wants delivered. Only `route`, `event_type` and `payload` are
/// required; everything else has a default.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    /// Selects the transport plugin and its configuration (a `[route.NAME]` table).
    pub route: String,
    /// The application's name for what happened, e.g. `order.created`.
    pub event_type: String,
    /// The body, passed to the transport untouched.
    pub payload: Vec<u8>,
    /// MIME type of the payload; `application/json` when not given.
    pub content_type: Option<String>,
    /// Metadata passed on as message or HTTP headers.
    pub headers: Vec<(String, String)>,
    /// Events of one route sharing a key are delivered in order when the route asks for it.
    pub ordering_key: Option<String>,
    /// When the business event happened; the emit time when not given.
    pub event_time: Option<DateTime<Utc>>,
    /// Do not deliver before this time (deferred delivery). Deferral is not an attempt.
    pub not_before: Option<DateTime<Utc>>,
    /// Attempt limit fixed at emit time; when absent, the route's limit is pinned when the first
    /// outcome is recorded. `Some(0)` means retry transient failures without limit.
    pub max_attempts: Option<u32>,
}

impl NewEvent {
    /// An event with default content type, no headers, no key, delivered as soon as possible.
    pub fn new(route: impl Into<String>, event_type: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            route: route.into(),
            event_type: event_type.into(),
            payload: payload.into(),
            content_type: None,
            headers: Vec::new(),
            ordering_key: None,
            event_time: None,
            not_before: None,
            max_attempts: None,
        }
    }

    /// Sets the ordering key.
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Adds one header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the content type.
    pub fn with_content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// Defers delivery until `at`, to the millisecond (ferry's clock keeps no finer time).
    pub fn not_before(mut self, at: DateTime<Utc>) -> Self {
        self.not_before = Some(at);
        self
    }

    /// Checks what the database cannot: names that must not be empty or longer than
    /// [`MAX_NAME`], headers within [`MAX_HEADERS`], and an attempt limit the column can hold.
    /// Returns a message naming the offending field.
    pub fn validate(&self) -> Result<(), String> {
        if self.route.trim().is_empty() {
            return Err("event route must not be empty".into());
        }
        if self.event_type.trim().is_empty() {
            return Err("event type must not be empty".into());
        }
        let names = [
            ("route", Some(&self.route)),
            ("event type", Some(&self.event_type)),
            ("ordering key", self.ordering_key.as_ref()),
            ("content type", self.content_type.as_ref()),
        ];
        for (field, value) in names {
            if let Some(size) = value.map(String::len).filter(|size| *size > MAX_NAME) {
                return Err(format!("the event's {field} is {size} bytes; ferry delivers at most {MAX_NAME}"));
            }
        }
        if let Some((name, _)) = self.headers.iter().find(|(name, _)| name.trim().is_empty()) {
            return Err(format!("event header name {name:?} must not be empty"));
        }
        let size = self.headers_json().len();
        if size > MAX_HEADERS {
            return Err(format!(
                "the event's headers are {size} bytes as JSON; ferry delivers at most {MAX_HEADERS}: \
                 put large values in the payload"
            ));
        }
        if let Some(n) = self.max_attempts.filter(|n| i32::try_from(*n).is_err()) {
            return Err(format!("max_attempts {n} is too large"));
        }
        Ok(())
    }

    /// Refuses a payload larger than `max` bytes, saying how to fix it.
    pub fn check_payload(&self, max: usize) -> Result<(), String> {
        match self.payload.len() {
            size if size > max => Err(payload_too_large(size as u64, max)),
            _ => Ok(()),
        }
    }

    /// The headers as the JSON object stored in the `headers` column.
    pub fn headers_json(&self) -> String {
        let map: serde_json::Map<String, serde_json::Value> =
            self.headers.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
        serde_json::Value::Object(map).to_string()
    }

    fn content_type(&self) -> &str {
        self.content_type.as_deref().unwrap_or("application/json")
    }

    fn max_attempts(&self) -> Option<i32> {
        self.max_attempts.and_then(|n| i32::try_from(n).ok())
    }
}

/// A database connection ferry can insert events through: `PgConnection` and `SqliteConnection`
/// (and so `&mut *tx` for a transaction on either).
pub trait Outbox {
    /// Inserts `event`; `now` stamps `created_at` (the database's clock when `None`).
    fn insert_event(
        &mut self,
        event: &NewEvent,
        now: Option<DateTime<Utc>>,
    ) -> impl Future<Output = Result<i64, EmitError>> + Send;
}

/// Inserts `event` through `conn`, typically `&mut *tx` of the caller's transaction, and returns
/// its id. Nothing is delivered unless and until that transaction commits. A payload larger than
/// [`DEFAULT_MAX_PAYLOAD`] is refused.
pub async fn emit<C: Outbox + ?Sized>(conn: &mut C, event: &NewEvent) -> Result<i64, EmitError> {
    emit_with_max_payload(conn, event, DEFAULT_MAX_PAYLOAD).await
}

/// [`emit`] for a ferry whose `relay.max_payload` is `max_payload` bytes.
pub async fn emit_with_max_payload<C: Outbox + ?Sized>(
    conn: &mut C,
    event: &NewEvent,
    max_payload: usize,
) -> Result<i64, EmitError> {
    event.check_payload(max_payload).map_err(EmitError::Invalid)?;
    conn.insert_event(event, None).await
}

#[cfg(feature = "postgres")]
impl Outbox for sqlx::PgConnection {
    async fn insert_event(&mut self, event: &NewEvent, now: Option<DateTime<Utc>>) -> Result<i64, EmitError> {
        event.validate().map_err(EmitError::Invalid)?;
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
        .bind(event.content_type())
        .bind(event.headers_json())
        .bind(&event.ordering_key)
        .bind(event.max_attempts())
        .bind(event.event_time)
        .bind(event.not_before)
        .bind(now)
        .fetch_one(&mut *self)
        .await?;
        Ok(id)
    }
}

#[cfg(feature = "sqlite")]
impl Outbox for sqlx::SqliteConnection {
    async fn insert_event(&mut self, event: &NewEvent, now: Option<DateTime<Utc>>) -> Result<i64, EmitError> {
        event.validate().map_err(EmitError::Invalid)?;
        let ms = |t: Option<DateTime<Utc>>| t.map(|t| t.timestamp_millis());
        let id = sqlx::query_scalar(
            "INSERT INTO ferry_events
                 (route, event_type, payload, content_type, headers, ordering_key, max_attempts,
                  created_at, event_time, last_status_at, next_attempt_at)
             SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, t.now, COALESCE(?8, t.now), t.now, COALESCE(?9, t.now)
             FROM (SELECT COALESCE(?10, CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)) AS now) t
             RETURNING id",
        )
        .bind(&event.route)
        .bind(&event.event_type)
        .bind(&event.payload)
        .bind(event.content_type())
        .bind(event.headers_json())
        .bind(&event.ordering_key)
        .bind(event.max_attempts())
        .bind(ms(event.event_time))
        .bind(ms(event.not_before))
        .bind(ms(now))
        .fetch_one(&mut *self)
        .await?;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_field() {
        assert!(NewEvent::new("", "t", "x").validate().unwrap_err().contains("route"));
        assert!(NewEvent::new("r", " ", "x").validate().unwrap_err().contains("type"));
        assert!(NewEvent::new("r", "t", "x").with_header("", "v").validate().unwrap_err().contains("header"));
        let mut huge = NewEvent::new("r", "t", "x");
        huge.max_attempts = Some(u32::MAX);
        assert!(huge.validate().unwrap_err().contains("max_attempts"));
        let long = "n".repeat(MAX_NAME + 1);
        assert!(NewEvent::new(long.as_str(), "t", "x").validate().unwrap_err().contains("route is 1025 bytes"));
        assert!(NewEvent::new("r", long.as_str(), "x").validate().unwrap_err().contains("event type is 1025"));
        assert!(NewEvent::new("r", "t", "x").with_key(long.as_str()).validate().unwrap_err().contains("ordering key"));
        let typed = NewEvent::new("r", "t", "x").with_content_type(long.as_str());
        assert!(typed.validate().unwrap_err().contains("content type"));
        assert!(NewEvent::new("n".repeat(MAX_NAME), "t", "x").validate().is_ok(), "the limit itself is allowed");
        let heavy = NewEvent::new("r", "t", "x").with_header("h", "v".repeat(MAX_HEADERS));
        assert!(heavy.validate().unwrap_err().contains(&format!("headers are {} bytes", MAX_HEADERS + 8)));
        let e = NewEvent::new("r", "t", "x").with_header("k", "v\"q");
        let parsed: serde_json::Value = serde_json::from_str(&e.headers_json()).unwrap();
        assert_eq!(parsed["k"], "v\"q");
    }
}
