//! A transport to start from: `ferry plugins new NAME --lang rust` writes a project around this
//! file, and "Write your own transport" (`docs/writing-a-transport.md`) walks through it.
//!
//! It writes each event's id, type and text payload to ferry's log, after an optional `prefix`
//! from the route's config, and refuses payloads that are not UTF-8 text as permanent failures.
//! Replace `deliver_one` with your delivery.

use ferry_plugin_sdk::{Config, Event, Outcome, Transport, log, outcome};

struct Plugin {
    prefix: String,
}

impl Transport for Plugin {
    /// What routes put in `plugin = "…"`; the file is installed in the plugins directory under
    /// this name, as `NAME.wasm`. The version is the crate's own, from Cargo.toml.
    const NAME: &'static str = "template";

    fn init(config: &mut Config) -> Result<Self, String> {
        Ok(Plugin { prefix: config.optional("prefix").unwrap_or_default() })
    }

    fn deliver(&mut self, events: Vec<Event>) -> Vec<Outcome> {
        events.iter().map(|event| self.deliver_one(event)).collect()
    }
}

impl Plugin {
    fn deliver_one(&self, event: &Event) -> Outcome {
        match std::str::from_utf8(&event.payload) {
            Ok(text) => {
                log::info(&format!("{}{} {}: {text}", self.prefix, event.id, event.event_type));
                outcome::success()
            }
            Err(_) => outcome::permanent("payload is not UTF-8 text"),
        }
    }
}

ferry_plugin_sdk::transport!(Plugin);
