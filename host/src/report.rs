//! The typed views ferry reports in: what the admin API answers, what `--json` prints and what
//! the CLI's text tables are drawn from. Each is `Serialize` and `Deserialize`, so a script can
//! move between the API and the CLI without translating, and `openapi.json` describes exactly
//! these shapes (a test checks every answer against it).

use std::collections::BTreeMap;
use std::path::PathBuf;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::breaker::{Breaker, BreakerState};
use crate::event::{AttemptRecord, EventRecord, Status};
use crate::plugins::PluginStatus;
use crate::store::{Latency, Stats};

/// One event with every field; its payload as JSON when its content type is JSON and it parses,
/// else as text when it is UTF-8, else base64; and its delivery history when asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventView {
    #[serde(flatten)]
    pub event: EventRecord,
    /// The payload, when its content type is JSON (`application/json`, `…+json`) and it is valid
    /// JSON: the stored text as it is, so numbers keep every digit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_json: Option<JsonText>,
    /// The payload, when it is UTF-8 text (and not shown as `payload_json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    /// The payload, base64-encoded, when it is not UTF-8 text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_base64: Option<String>,
    /// Every delivery attempt, oldest first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts_history: Option<Vec<AttemptRecord>>,
    /// The stored payload's size in bytes, present only when the payload fields hold less than
    /// all of it (`ferry show --payload head|none`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_bytes: Option<u64>,
    /// For a PENDING event: why it is not being delivered yet, a sentence per reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<Vec<String>>,
    /// For an event of a route with destinations: the events it was handed on as, one per
    /// destination that receives it (the first 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deliveries: Option<Vec<crate::store::Delivery>>,
}

/// A JSON value kept as its text: serialized as that JSON, not as a string holding it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JsonText(Box<serde_json::value::RawValue>);

impl JsonText {
    /// `text`, when it is one valid JSON value.
    pub fn parse(text: &str) -> Option<JsonText> {
        serde_json::from_str(text).ok().map(JsonText)
    }

    pub fn as_str(&self) -> &str {
        self.0.get()
    }
}

impl PartialEq for JsonText {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

/// Whether `content_type` says JSON: `application/json`, or a `+json` type such as
/// `application/cloudevents+json`, parameters aside.
fn is_json_type(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// How a view shows a payload whose content type is JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JsonPayload {
    /// As a JSON value (`payload_json`), when it parses.
    #[default]
    Value,
    /// As text (`payload`), for a reader that keeps the stored text as it is.
    Text,
}

impl EventView {
    pub fn new(event: EventRecord, attempts: Option<Vec<AttemptRecord>>) -> EventView {
        Self::showing(event, attempts, JsonPayload::Value)
    }

    /// A view whose JSON payload is shown as `json` says.
    pub fn showing(event: EventRecord, attempts: Option<Vec<AttemptRecord>>, json: JsonPayload) -> EventView {
        let (mut payload_json, mut payload, mut payload_base64) = (None, None, None);
        match std::str::from_utf8(&event.payload) {
            Ok(text) => match (json, is_json_type(&event.content_type)) {
                (JsonPayload::Value, true) => match JsonText::parse(text) {
                    Some(value) => payload_json = Some(value),
                    None => payload = Some(text.to_string()),
                },
                _ => payload = Some(text.to_string()),
            },
            Err(_) => payload_base64 = Some(base64::engine::general_purpose::STANDARD.encode(&event.payload)),
        }
        EventView {
            event,
            payload_json,
            payload,
            payload_base64,
            attempts_history: attempts,
            payload_bytes: None,
            waiting: None,
            deliveries: None,
        }
    }

    /// Keeps at most `limit` bytes of the payload (cut at a character boundary for text, and a
    /// JSON payload cut short becomes text), and records the full size when anything was left
    /// out. `None` keeps it all.
    pub fn shorten_payload(&mut self, limit: Option<usize>) {
        let Some(limit) = limit else { return };
        let size = self.event.payload.len();
        if size <= limit && limit > 0 {
            return;
        }
        self.payload_bytes = Some(size as u64);
        if let Some(json) = self.payload_json.take() {
            self.payload = Some(json.as_str().to_string());
        }
        if limit == 0 {
            (self.payload, self.payload_base64) = (None, None);
        } else if let Some(text) = &mut self.payload {
            let cut = (0..=limit).rev().find(|&i| text.is_char_boundary(i)).unwrap_or(0);
            text.truncate(cut);
        } else {
            let head = &self.event.payload[..limit];
            self.payload_base64 = Some(base64::engine::general_purpose::STANDARD.encode(head));
        }
    }
}

/// A page of FAILED events (without payloads); `next_after` is the id to continue after when the
/// page is full.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailedPage {
    pub events: Vec<EventRecord>,
    pub next_after: Option<i64>,
}

impl FailedPage {
    pub fn new(events: Vec<EventRecord>, limit: u32) -> FailedPage {
        let next_after = (events.len() == limit as usize).then(|| events.last().map(|e| e.id)).flatten();
        FailedPage { events, next_after }
    }
}

/// FAILED events of one route and type that failed for the same reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailedGroup {
    pub route: String,
    #[serde(rename = "type")]
    pub event_type: String,
    /// The failure reason (`permanent`, `attempts_exhausted`, …); null for rows that predate it.
    pub reason: Option<String>,
    pub count: u64,
    /// When the earliest of them became FAILED.
    pub first_failed_at: Option<DateTime<Utc>>,
    /// When the latest of them became FAILED.
    pub last_failed_at: Option<DateTime<Utc>>,
}

/// The FAILED events matching a filter, grouped by route, type and reason, largest group first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailedSummary {
    pub groups: Vec<FailedGroup>,
    /// FAILED events in all the groups listed.
    pub total: u64,
    /// More groups match than were listed; narrow the filter to see them.
    pub truncated: bool,
}

/// The monitoring figures, with ages in seconds worked out at `at`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatsView {
    pub at: DateTime<Utc>,
    /// Events per status, all routes.
    pub counts: BTreeMap<Status, u64>,
    /// Route → status → events.
    pub routes: BTreeMap<String, BTreeMap<Status, u64>>,
    pub oldest_pending_created_at: Option<DateTime<Utc>>,
    pub oldest_pending_age_seconds: Option<f64>,
    /// How long the longest-waiting due PENDING event has been due.
    pub claim_lag_seconds: Option<f64>,
    pub stuck: u64,
    pub last_attempt: u64,
    pub latency: Option<Latency>,
}

impl From<&Stats> for StatsView {
    fn from(stats: &Stats) -> StatsView {
        let age = |t: Option<DateTime<Utc>>| t.map(|t| (stats.at - t).num_milliseconds().max(0) as f64 / 1000.0);
        StatsView {
            at: stats.at,
            counts: Status::ALL.iter().map(|s| (*s, stats.total(*s))).collect(),
            routes: stats.routes.clone(),
            oldest_pending_created_at: stats.oldest_pending_created_at,
            oldest_pending_age_seconds: age(stats.oldest_pending_created_at),
            claim_lag_seconds: age(stats.oldest_due_at),
            stuck: stats.stuck,
            last_attempt: stats.last_attempt,
            latency: stats.latency.clone(),
        }
    }
}

/// A breaker with its state at the time it was read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BreakerView {
    #[serde(flatten)]
    pub breaker: Breaker,
    pub state: BreakerState,
}

impl BreakerView {
    pub fn new(breaker: Breaker, now: DateTime<Utc>, cooldown: std::time::Duration) -> BreakerView {
        let state = breaker.state(now, cooldown);
        BreakerView { breaker, state }
    }
}

/// A configured route: its plugin, ordering and breaker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteView {
    pub route: String,
    pub plugin: String,
    pub plugin_loaded: bool,
    pub plugin_hash: Option<String>,
    pub ordered: bool,
    pub failed_blocks_key: bool,
    /// The route that gets a copy of each event that ends FAILED here.
    pub dead_letter: Option<String>,
    /// For a destination (`route/destination`), the route it is a destination of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_of: Option<String>,
    /// For a destination, the event types it receives (none: all of its route's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub event_types: Vec<String>,
    /// For a route with destinations (which has no plugin of its own), their routes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destinations: Vec<String>,
    pub breaker: BreakerView,
    /// The retry policy in effect for the route.
    pub retry: RetryView,
}

/// A retry policy as an operator reads it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetryView {
    /// e.g. `exponential from 1s to 5m`, `fixed 30s`, `schedule 1s, 10s, 1m`.
    pub backoff: String,
    /// `none`, `full`, `equal` or `±N%`.
    pub jitter: String,
    /// Attempts in all, the first included; 0 means no limit.
    pub max_attempts: u32,
    /// The longest wait a plugin's retry-after can ask for.
    pub retry_after_max_seconds: f64,
}

impl From<&crate::backoff::RetryPolicy> for RetryView {
    fn from(policy: &crate::backoff::RetryPolicy) -> RetryView {
        use crate::backoff::{Backoff, Jitter};
        let d = |d: &std::time::Duration| crate::config::format_duration(*d);
        RetryView {
            backoff: match &policy.backoff {
                Backoff::Exponential { initial, max } => format!("exponential from {} to {}", d(initial), d(max)),
                Backoff::Fixed { delay } => format!("fixed {}", d(delay)),
                Backoff::Schedule(steps) => {
                    format!("schedule {}", steps.iter().map(d).collect::<Vec<_>>().join(", "))
                }
            },
            jitter: match policy.jitter {
                Jitter::None => "none".into(),
                Jitter::Symmetric { percent } => format!("±{percent}%"),
                Jitter::Equal => "equal".into(),
                Jitter::Full => "full".into(),
            },
            max_attempts: policy.max_attempts,
            retry_after_max_seconds: policy.retry_after_max.as_secs_f64(),
        }
    }
}

/// What `ferry config check` found: what `serve` would start with, without the database.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigCheck {
    /// Whether `serve` would start and every route has a working transport.
    pub ok: bool,
    /// The database `serve` would use (credentials masked; not connected to).
    pub database: String,
    pub plugins: PluginsView,
    pub routes: Vec<RouteCheck>,
    /// What stops `serve`, or leaves a route without a transport.
    pub errors: Vec<String>,
    /// What is probably a mistake but does not stop `serve`.
    pub warnings: Vec<String>,
}

/// One route's transport at start-up: its plugin loaded and its `init` run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteCheck {
    pub route: String,
    pub plugin: String,
    pub ready: bool,
    /// Why the route has no transport.
    pub error: Option<String>,
}

/// The plugins loaded, and the files that failed to load with why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PluginsView {
    pub plugins: Vec<PluginStatus>,
    /// File → why it did not load.
    pub errors: BTreeMap<PathBuf, String>,
}

/// How one plugin file's reload ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReloadResult {
    Loaded,
    Unchanged,
    Removed,
    Ignored,
    Failed,
}

/// One plugin file of a reload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReloadedFile {
    pub file: PathBuf,
    pub result: ReloadResult,
    pub plugin: Option<String>,
    /// The new version's SHA-256, when `loaded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    /// Why the file did not load, when `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What a reload of every plugin file did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReloadView {
    pub files: Vec<ReloadedFile>,
}

/// The id of an event just created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Created {
    pub id: i64,
}

/// How many FAILED events match a filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedCount {
    pub failed: u64,
    /// The highest id among them: give it as `through_id` to a bulk operation so that it leaves
    /// alone events newer than those counted.
    pub last_id: Option<i64>,
}

/// How many events a resend made PENDING again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resent {
    pub resent: u64,
}

/// How many events an operator cancelled (deleted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancelled {
    pub cancelled: u64,
}

/// How many events a purge deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Purged {
    pub purged: u64,
}

/// Events per status, every status included.
pub type StatusCounts = BTreeMap<Status, u64>;
