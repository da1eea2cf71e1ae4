//! The outbox event as ferry sees it: what applications emit, what the relay claims, and what it
//! records afterwards.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use serde::Serialize;

/// Where an event is in its life. Stored as the upper-case names below.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Status {
    /// Waiting for delivery: new, deferred, or waiting for a retry.
    Pending,
    /// Claimed by a relay instance, which holds a lease on it.
    Processing,
    /// Delivered; terminal until purged by retention.
    Sent,
    /// Given up on; kept for inspection until resent or purged.
    Failed,
}

impl Status {
    /// Every status, in life-cycle order.
    pub const ALL: [Status; 4] = [Status::Pending, Status::Processing, Status::Sent, Status::Failed];

    /// The name stored in the `status` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "PENDING",
            Status::Processing => "PROCESSING",
            Status::Sent => "SENT",
            Status::Failed => "FAILED",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Status {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Status::ALL
            .into_iter()
            .find(|status| status.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown status {s:?} (expected PENDING, PROCESSING, SENT or FAILED)"))
    }
}

/// Why an event ended up FAILED; stored in `failure_reason` so operators can select by cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureReason {
    /// The transport said the event can never be delivered as it stands.
    Permanent,
    /// Transient failures continued until the event's attempt limit.
    AttemptsExhausted,
    /// No route or no loaded plugin for the event's route; resend once one exists.
    NoTransport,
    /// The plugin misbehaved on this event's last allowed attempt (trap, timeout, wrong answer).
    PluginFault,
    /// The stored row cannot be turned into an event (for example malformed headers).
    InvalidEvent,
}

impl FailureReason {
    /// The name stored in the `failure_reason` column.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::Permanent => "permanent",
            FailureReason::AttemptsExhausted => "attempts_exhausted",
            FailureReason::NoTransport => "no_transport",
            FailureReason::PluginFault => "plugin_fault",
            FailureReason::InvalidEvent => "invalid_event",
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
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
    /// Attempt limit fixed at emit time; when absent, the route's limit is pinned when the first outcome is recorded.
    /// `Some(0)` means retry transient failures without limit.
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

    /// Defers delivery until `at`.
    pub fn not_before(mut self, at: DateTime<Utc>) -> Self {
        self.not_before = Some(at);
        self
    }

    /// Checks what the database cannot: names that must not be empty. Returns a message naming the
    /// offending field.
    pub fn validate(&self) -> Result<(), String> {
        if self.route.trim().is_empty() {
            return Err("event route must not be empty".into());
        }
        if self.event_type.trim().is_empty() {
            return Err("event type must not be empty".into());
        }
        if let Some((name, _)) = self.headers.iter().find(|(name, _)| name.trim().is_empty()) {
            return Err(format!("event header name {name:?} must not be empty"));
        }
        Ok(())
    }

    /// The headers as the JSON object stored in the `headers` column.
    pub fn headers_json(&self) -> String {
        let map: serde_json::Map<String, serde_json::Value> =
            self.headers.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect();
        serde_json::Value::Object(map).to_string()
    }
}

/// An event claimed for delivery. `attempt` already counts this delivery.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedEvent {
    pub id: i64,
    pub route: String,
    pub event_type: String,
    pub ordering_key: Option<String>,
    pub payload: Vec<u8>,
    pub content_type: String,
    pub headers: Vec<(String, String)>,
    /// 1 on the first delivery, 2 on the first retry, and so on.
    pub attempt: u32,
    /// The limit pinned on the row, if any (0 = unlimited).
    pub max_attempts: Option<u32>,
    pub event_time: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    /// Set when the stored row could not be decoded; the relay fails such an event at once
    /// instead of handing a guess to a transport.
    pub defect: Option<String>,
}

/// Parses the stored `headers` JSON object. Non-string values are kept as their JSON text.
pub fn parse_headers(json: &str) -> Result<Vec<(String, String)>, String> {
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::Object(map)) => Ok(map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => (k, s),
                other => (k, other.to_string()),
            })
            .collect()),
        Ok(other) => Err(format!("headers must be a JSON object, found {other}")),
        Err(e) => Err(format!("headers are not valid JSON: {e}")),
    }
}

/// What the relay decided for one claimed event.
#[derive(Debug, Clone, PartialEq)]
pub enum Disposition {
    /// Delivered.
    Sent,
    /// Try again at `at`.
    Retry { at: DateTime<Utc>, error: String },
    /// Give up.
    Failed { reason: FailureReason, error: String },
}

/// One outcome to record, fenced by the claim that produced it.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub id: i64,
    pub disposition: Disposition,
    /// The attempt limit to pin on the row when it had none yet.
    pub max_attempts: u32,
    /// The attempt that led here, for the event's history.
    pub attempt: AttemptLog,
}

/// How one delivery attempt was made, written to the history with its outcome.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttemptLog {
    /// The event's attempt number (1 = first delivery).
    pub number: u32,
    /// The plugin call the attempt was part of, shared by the events of that call.
    pub call: std::sync::Arc<CallLog>,
}

/// One plugin call: what every attempt it made has in common.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallLog {
    pub started_at: DateTime<Utc>,
    /// How long the plugin call took (zero when none was made).
    pub duration: std::time::Duration,
    /// The plugin that was called and the SHA-256 of its file; `None` when no plugin ran.
    pub plugin: Option<String>,
    pub plugin_hash: Option<String>,
    /// The ferry instance that made the call.
    pub instance: String,
}

impl Disposition {
    /// The history's name for it: `sent`, `retry` or `failed`.
    pub fn outcome(&self) -> &'static str {
        match self {
            Disposition::Sent => "sent",
            Disposition::Retry { .. } => "retry",
            Disposition::Failed { .. } => "failed",
        }
    }

    /// The failure reason, for `failed`.
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            Disposition::Failed { reason, .. } => Some(reason.as_str()),
            _ => None,
        }
    }

    /// The error text, for `retry` and `failed`.
    pub fn error(&self) -> Option<&str> {
        match self {
            Disposition::Sent => None,
            Disposition::Retry { error, .. } | Disposition::Failed { error, .. } => Some(error),
        }
    }
}

/// One row of an event's delivery history.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AttemptRecord {
    pub attempt: u32,
    pub started_at: DateTime<Utc>,
    pub duration_ms: u64,
    /// `sent`, `retry` or `failed`.
    pub outcome: String,
    pub reason: Option<String>,
    pub error: Option<String>,
    pub plugin: Option<String>,
    pub plugin_hash: Option<String>,
    pub instance: Option<String>,
}

/// A full stored row, for inspection (`ferry show`, tests).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventRecord {
    pub id: i64,
    pub route: String,
    pub event_type: String,
    pub ordering_key: Option<String>,
    #[serde(skip)]
    pub payload: Vec<u8>,
    pub content_type: String,
    pub headers: String,
    pub status: Status,
    pub attempts: u32,
    pub max_attempts: Option<u32>,
    pub event_time: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub last_status_at: DateTime<Utc>,
    pub next_attempt_at: DateTime<Utc>,
    pub processed_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub failure_reason: Option<String>,
    pub claimed_by: Option<String>,
    pub claim_token: Option<String>,
    pub lease_until: Option<DateTime<Utc>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_names_round_trip() {
        for status in Status::ALL {
            assert_eq!(status.as_str().parse::<Status>(), Ok(status));
        }
        assert!("sent".parse::<Status>().is_ok());
        assert!("DONE".parse::<Status>().unwrap_err().contains("DONE"));
    }

    #[test]
    fn headers_parse_objects_only() {
        assert_eq!(
            parse_headers(r#"{"a":"1","n":2}"#).unwrap(),
            vec![("a".into(), "1".into()), ("n".into(), "2".into())]
        );
        assert!(parse_headers("[1]").unwrap_err().contains("JSON object"));
        assert!(parse_headers("{").unwrap_err().contains("not valid JSON"));
    }

    #[test]
    fn validation_names_the_field() {
        assert!(NewEvent::new("", "t", "x").validate().unwrap_err().contains("route"));
        assert!(NewEvent::new("r", " ", "x").validate().unwrap_err().contains("type"));
        assert!(NewEvent::new("r", "t", "x").with_header("", "v").validate().unwrap_err().contains("header"));
        let e = NewEvent::new("r", "t", "x").with_header("k", "v\"q");
        assert_eq!(parse_headers(&e.headers_json()).unwrap(), e.headers);
    }
}
