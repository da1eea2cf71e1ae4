//! A test transport that does what each event's type tells it to, so tests can drive every
//! relay transition with a real wasm component:
//!
//! - `transient` → transient failure (retry-after from the `retry-after-ms` header, if any);
//! - `permanent` → permanent failure;
//! - `trap` → panics, trapping the whole batch;
//! - `spin` → loops forever (the host must time it out);
//! - anything else → success.
//!
//! Config: `reject = "yes"` makes `init` fail, to test routes whose plugin refuses its config.

wit_bindgen::generate!({ path: "../../../wit", world: "transport-plugin" });

use exports::ferry::transport::transport::{Event, Guest, Outcome, PluginInfo};
use ferry::transport::types::Failure;

struct Scripted;

impl Guest for Scripted {
    fn metadata() -> PluginInfo {
        PluginInfo { name: "scripted".into(), version: "0.1.0".into() }
    }

    fn init(config: Vec<(String, String)>) -> Result<(), String> {
        match config.iter().find(|(k, _)| k == "reject") {
            Some((_, why)) => Err(format!("reject: told to refuse ({why})")),
            None => Ok(()),
        }
    }

    fn deliver_batch(events: Vec<Event>) -> Vec<Outcome> {
        if events.iter().any(|e| e.event_type == "trap") {
            panic!("scripted trap");
        }
        if events.iter().any(|e| e.event_type == "spin") {
            #[allow(clippy::empty_loop)]
            loop {}
        }
        events.iter().map(outcome).collect()
    }
}

fn outcome(event: &Event) -> Outcome {
    let failure = |kind: &str| Failure {
        reason: format!("scripted {kind} failure of event {} (attempt {})", event.id, event.attempt),
        retry_after_ms: event.headers.iter().find(|(k, _)| k == "retry-after-ms").and_then(|(_, v)| v.parse().ok()),
    };
    match event.event_type.as_str() {
        "transient" => Outcome::Transient(failure("transient")),
        "permanent" => Outcome::Permanent(failure("permanent")),
        _ => Outcome::Success,
    }
}

export!(Scripted);
