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
use std::sync::Mutex;

use serde_json::{Map, Value, json};

wit_bindgen::generate!({ path: "../../wit", world: "transport-plugin" });

use exports::ferry::transport::transport::{Event, Guest, Outcome, PluginInfo};
use ferry::transport::logging::{Level, log};
use ferry::transport::types::Failure;

/// Where this instance writes; set by `init`.
enum Output {
    Stdout,
    File { path: String, file: File },
}

static OUTPUT: Mutex<Option<Output>> = Mutex::new(None);

struct LogTransport;

impl Guest for LogTransport {
    fn metadata() -> PluginInfo {
        PluginInfo { name: "log".into(), version: env!("CARGO_PKG_VERSION").into() }
    }

    fn init(config: Vec<(String, String)>) -> Result<(), String> {
        let mut output = Output::Stdout;
        for (key, value) in config {
            match key.as_str() {
                "output" if value == "stdout" => output = Output::Stdout,
                "output" => {
                    let file = OpenOptions::new().create(true).append(true).open(&value).map_err(|e| {
                        format!("output: cannot open {value:?}: {e} (is its directory pre-opened for this plugin?)")
                    })?;
                    output = Output::File { path: value, file };
                }
                other => return Err(format!("unknown config key {other:?} (the log transport knows: output)")),
            }
        }
        let target = match &output {
            Output::Stdout => "stdout".to_string(),
            Output::File { path, .. } => path.clone(),
        };
        log(Level::Info, &format!("writing events to {target}"));
        *OUTPUT.lock().unwrap_or_else(|e| e.into_inner()) = Some(output);
        Ok(())
    }

    fn deliver_batch(events: Vec<Event>) -> Vec<Outcome> {
        let mut guard = OUTPUT.lock().unwrap_or_else(|e| e.into_inner());
        let output = guard.get_or_insert(Output::Stdout);
        // Build the whole batch first so one write either lands completely or not at all.
        let mut buf = Vec::with_capacity(events.len() * 128);
        for event in &events {
            buf.extend_from_slice(to_json_line(event).as_bytes());
        }
        match write_all(output, &buf) {
            Ok(()) => events.iter().map(|_| Outcome::Success).collect(),
            Err(e) => {
                let reason = format!("log transport: write failed: {e}");
                log(Level::Warn, &reason);
                events
                    .iter()
                    .map(|_| Outcome::Transient(Failure { reason: reason.clone(), retry_after_ms: None }))
                    .collect()
            }
        }
    }
}

fn write_all(output: &mut Output, buf: &[u8]) -> io::Result<()> {
    match output {
        Output::Stdout => {
            let mut out = io::stdout().lock();
            out.write_all(buf)?;
            out.flush()
        }
        Output::File { file, .. } => {
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

export!(LogTransport);
