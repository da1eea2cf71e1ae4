//! A transport built for `ferry:transport@0.1` (`wit/v0.1`), the contract before `deferred`
//! existed, to prove that ferry still loads and runs plugins built for it: its answers and its
//! log lines must reach ferry as a current plugin's would.
//!
//! - `transient` → transient failure, with the retry-after from the `retry-after-ms` header;
//! - `permanent` → permanent failure;
//! - anything else → success.
//!
//! Every call logs `legacy: N events` at info level through the 0.1 `logging` import.

wit_bindgen::generate!({ path: "../../../wit/v0.1", world: "transport-plugin" });

use exports::ferry::transport::transport::{Event, Guest, Outcome, PluginInfo};
use ferry::transport::logging::{Level, log};
use ferry::transport::types::Failure;

struct Legacy;

impl Guest for Legacy {
    fn metadata() -> PluginInfo {
        PluginInfo { name: "legacy".into(), version: "0.1.0".into() }
    }

    fn init(_config: Vec<(String, String)>) -> Result<(), String> {
        Ok(())
    }

    fn deliver_batch(events: Vec<Event>) -> Vec<Outcome> {
        log(Level::Info, &format!("legacy: {} events", events.len()));
        events.iter().map(answer).collect()
    }
}

fn answer(event: &Event) -> Outcome {
    let retry_after_ms =
        event.headers.iter().find(|(name, _)| name == "retry-after-ms").and_then(|(_, value)| value.parse().ok());
    match event.event_type.as_str() {
        "transient" => Outcome::Transient(Failure { reason: "legacy transient".into(), retry_after_ms }),
        "permanent" => Outcome::Permanent(Failure { reason: "legacy permanent".into(), retry_after_ms: None }),
        _ => Outcome::Success,
    }
}

export!(Legacy);
