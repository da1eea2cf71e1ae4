//! The JSON shapes ferry reports in, shared by the admin API and the CLI's `--json`, so a script
//! can move between the two without translating.

use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::event::{AttemptRecord, EventRecord, Status};
use crate::plugins::PluginStatus;
use crate::store::{Breaker, Stats};

/// One event with every field; the payload as text when it is UTF-8, else as `payload_base64`;
/// and its delivery history when given.
pub fn event(event: &EventRecord, attempts: Option<&[AttemptRecord]>) -> Value {
    let mut value = serde_json::to_value(event).expect("events serialize");
    match std::str::from_utf8(&event.payload) {
        Ok(text) => value["payload"] = text.into(),
        Err(_) => value["payload_base64"] = base64::engine::general_purpose::STANDARD.encode(&event.payload).into(),
    }
    if let Some(attempts) = attempts {
        value["attempts_history"] = serde_json::to_value(attempts).expect("attempts serialize");
    }
    value
}

/// A page of FAILED events (without payloads); `next_after` is the id to continue after when the
/// page is full.
pub fn failed_page(events: &[EventRecord], limit: u32) -> Value {
    let next = (events.len() == limit as usize).then(|| events.last().map(|e| e.id)).flatten();
    json!({ "events": events, "next_after": next })
}

/// The monitoring figures, with ages in seconds worked out at `stats.at`.
pub fn stats(stats: &Stats) -> Value {
    let age = |t: Option<DateTime<Utc>>| t.map(|t| (stats.at - t).num_milliseconds().max(0) as f64 / 1000.0);
    let totals: serde_json::Map<String, Value> =
        Status::ALL.iter().map(|s| (s.to_string(), stats.total(*s).into())).collect();
    json!({
        "at": stats.at,
        "counts": totals,
        "routes": stats.routes,
        "oldest_pending_created_at": stats.oldest_pending_created_at,
        "oldest_pending_age_seconds": age(stats.oldest_pending_created_at),
        "claim_lag_seconds": age(stats.oldest_due_at),
        "stuck": stats.stuck,
        "last_attempt": stats.last_attempt,
        "latency": stats.latency,
    })
}

/// A breaker with its state at `now` (`closed`, `open` or `half-open`).
pub fn breaker(breaker: &Breaker, now: DateTime<Utc>, cooldown: Duration) -> Value {
    let mut row = serde_json::to_value(breaker).expect("breakers serialize");
    row["state"] = breaker.state(now, cooldown).into();
    row
}

/// The plugins loaded, and the files that failed to load with why.
pub fn plugins(plugins: &[PluginStatus], errors: &std::collections::BTreeMap<std::path::PathBuf, String>) -> Value {
    let errors: serde_json::Map<String, Value> =
        errors.iter().map(|(path, e)| (path.display().to_string(), e.clone().into())).collect();
    json!({ "plugins": plugins, "errors": errors })
}
