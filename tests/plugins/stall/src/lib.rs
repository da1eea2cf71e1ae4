//! A transport whose `metadata` sleeps for an hour: parked in the host (a WASI clock wait), where
//! epoch interruption cannot reach it. Loading it must fail after the deadline instead of holding
//! start-up, a reload, or shutdown.

use std::time::Duration;

wit_bindgen::generate!({ path: "../../../wit", world: "transport-plugin" });

use exports::ferry::transport::transport::{Event, Guest, Outcome, PluginInfo};

struct Stall;

impl Guest for Stall {
    fn metadata() -> PluginInfo {
        std::thread::sleep(Duration::from_secs(3600));
        PluginInfo { name: "stall".into(), version: "0.1.0".into() }
    }

    fn init(_config: Vec<(String, String)>) -> Result<(), String> {
        Ok(())
    }

    fn deliver_batch(events: Vec<Event>) -> Vec<Outcome> {
        events.iter().map(|_| Outcome::Success).collect()
    }
}

export!(Stall);
