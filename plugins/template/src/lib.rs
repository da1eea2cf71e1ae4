//! The smallest useful transport, and the one "Write your own transport"
//! (`docs/writing-a-transport.md`) walks through: it prints each event's id and text payload to
//! stdout, after an optional `prefix` from the route's config, and refuses payloads that are not
//! UTF-8 text as permanent failures.

use ferry_plugin_sdk::{Config, Event, Outcome, Transport, outcome};

struct Stdout {
    prefix: String,
}

impl Transport for Stdout {
    const NAME: &'static str = "template";

    fn init(config: &mut Config) -> Result<Self, String> {
        Ok(Stdout { prefix: config.optional("prefix").unwrap_or_default() })
    }

    fn deliver(&mut self, events: Vec<Event>) -> Vec<Outcome> {
        events
            .iter()
            .map(|event| match std::str::from_utf8(&event.payload) {
                Ok(text) => {
                    println!("{}{} {text}", self.prefix, event.id);
                    outcome::success()
                }
                Err(_) => outcome::permanent("payload is not UTF-8 text"),
            })
            .collect()
    }
}

ferry_plugin_sdk::transport!(Stdout);
