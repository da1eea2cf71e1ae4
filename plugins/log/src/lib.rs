//! The `log` transport: writes each event as one JSON line to stdout or to a file.
//!
//! Route configuration:
//! - `output` — `stdout` (the default) or the path of a file inside a directory that ferry
//!   pre-opens for this plugin (for example `/out/events.jsonl` with `dirs = { "/out" = "..." }`
//!   in the plugin's sandbox settings). The file is created if missing and appended to.
//!
//! Each line holds the event's `id`, `route`, `type`, `key`, `attempt`, `event_time_ms`,
//! `content_type`, `headers` and its payload (see [`line`]).
//!
//! A write that fails (disk full, directory not granted) is reported as a transient failure so
//! ferry retries the event rather than losing it.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};

use ferry_plugin_sdk::outcome::{success, transient};
use ferry_plugin_sdk::{Config, Event, Outcome, Transport, log};

pub mod line;

/// Where this instance writes.
enum Output {
    Stdout,
    File(File),
}

impl Transport for Output {
    const NAME: &'static str = "log";

    fn init(config: &mut Config) -> Result<Output, String> {
        let output = match config.optional("output") {
            None => Output::Stdout,
            Some(value) if value == "stdout" => Output::Stdout,
            Some(path) => {
                let file = OpenOptions::new().create(true).append(true).open(&path).map_err(|e| {
                    format!("output: cannot open {path:?}: {e} (is its directory pre-opened for this plugin?)")
                })?;
                log::info(&format!("writing events to {path}"));
                return Ok(Output::File(file));
            }
        };
        log::info("writing events to stdout");
        Ok(output)
    }

    fn deliver(&mut self, events: Vec<Event>) -> Vec<Outcome> {
        // Build the whole batch first so one write either lands completely or not at all.
        let room: usize = events.iter().map(|e| 160 + e.payload.len()).sum();
        let mut buf = Vec::with_capacity(room);
        for event in &events {
            let line = line::Line {
                id: event.id,
                route: &event.route,
                event_type: &event.event_type,
                key: event.ordering_key.as_deref(),
                attempt: event.attempt,
                event_time_ms: event.event_time,
                content_type: &event.content_type,
                headers: &event.headers,
                payload: &event.payload,
            };
            line::write(&mut buf, &line);
        }
        match write_all(self, &buf) {
            Ok(()) => events.iter().map(|_| success()).collect(),
            Err(e) => {
                let reason = format!("log transport: write failed: {e}");
                log::warn(&reason);
                events.iter().map(|_| transient(reason.as_str())).collect()
            }
        }
    }
}

ferry_plugin_sdk::transport!(Output);

fn write_all(output: &mut Output, buf: &[u8]) -> io::Result<()> {
    match output {
        Output::Stdout => {
            let mut out = io::stdout().lock();
            out.write_all(buf)?;
            out.flush()
        }
        Output::File(file) => {
            file.write_all(buf)?;
            file.flush()
        }
    }
}
