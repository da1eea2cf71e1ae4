//! The `log` transport: writes each event as one JSON line to stdout or to a file.
//!
//! Route configuration:
//! - `output` — `stdout` (the default) or the path of a file inside a directory that ferry
//!   pre-opens for this plugin (for example `/out/events.jsonl` with `dirs = { "/out" = "..." }`
//!   in the plugin's sandbox settings). The file is created if missing and appended to.
//!
//! A write that fails (disk full, directory not granted) is reported as a transient failure so
//! ferry retries the event rather than losing it.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};

use ferry_plugin_sdk::outcome::{success, transient};
use ferry_plugin_sdk::{Config, Event, Outcome, Transport, log};
use serde_json::{Map, Value, json};

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
        let mut buf = Vec::with_capacity(events.len() * 128);
        for event in &events {
            buf.extend_from_slice(to_json_line(event).as_bytes());
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

/// One event as a JSON object on a single line. A JSON payload is embedded as JSON, other UTF-8
/// text as a string, and anything else as base64 under `payload_base64`.
fn to_json_line(event: &Event) -> String {
    let headers: Map<String, Value> =
        event.headers.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
    let mut line = json!({
        "id": event.id,
        "route": event.route,
        "type": event.event_type,
        "key": event.ordering_key,
        "attempt": event.attempt,
        "event_time_ms": event.event_time,
        "content_type": event.content_type,
        "headers": headers,
    });
    let body = match std::str::from_utf8(&event.payload) {
        Ok(text) => match serde_json::from_str::<Value>(text) {
            Ok(value) => ("payload", value),
            Err(_) => ("payload", Value::String(text.to_string())),
        },
        Err(_) => ("payload_base64", Value::String(base64(&event.payload))),
    };
    line[body.0] = body.1;
    let mut text = line.to_string();
    text.push('\n');
    text
}

/// Standard base64 with padding; small enough not to warrant a dependency.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}
