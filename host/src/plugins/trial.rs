//! `ferry plugins try`: one plugin file run the way `serve` runs it (the same engine, instance
//! pool, sandbox and limits) on events given by hand, without a database. What the plugin says
//! through the `logging` import and what the sandbox refuses it are collected per call, so the
//! author sees them next to the outcomes they belong to.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::Context as _;
use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tracing::instrument::WithSubscriber as _;
use tracing_subscriber::layer::SubscriberExt as _;

use super::{DeliverError, Outcome, Registry, RouteTransport, Runtime};
use crate::config::{Config, ConfigValue, SandboxConfig};
use crate::event::ClaimedEvent;

/// What to run: the file, the route it pretends to serve, and that route's config.
#[derive(Debug, Clone)]
pub struct TrialSetup {
    pub file: PathBuf,
    /// The route name events carry and errors name.
    pub route: String,
    /// The route's `config` table, as `init` receives it.
    pub route_config: BTreeMap<String, String>,
    /// The plugin's `[sandbox.NAME]` table; `None` keeps what the configuration file says.
    pub sandbox: Option<SandboxConfig>,
    /// Events per `deliver-batch` call.
    pub batch_size: usize,
}

/// Everything a trial run saw.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrialReport {
    pub plugin: TrialPlugin,
    pub route: String,
    pub init: TrialInit,
    pub calls: Vec<TrialCall>,
    /// Events answered `success`.
    pub succeeded: usize,
    /// Events given.
    pub events: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrialPlugin {
    pub name: String,
    pub version: String,
    pub hash: String,
    pub file: PathBuf,
}

/// How `init` went.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrialInit {
    /// Why the route cannot use the plugin; `None` when `init` accepted the config.
    pub error: Option<String>,
    pub duration_ms: f64,
    #[serde(flatten)]
    pub heard: Heard,
}

/// One `deliver-batch` call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrialCall {
    pub duration_ms: f64,
    /// A trap, timeout, memory-limit hit or wrong outcome count: every event of the call is a
    /// transient failure, as the relay would record it.
    pub fault: Option<String>,
    pub outcomes: Vec<TrialOutcome>,
    #[serde(flatten)]
    pub heard: Heard,
}

/// What one event came to.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrialOutcome {
    pub id: i64,
    pub event_type: String,
    /// `success`, `transient` or `permanent`.
    pub outcome: String,
    pub reason: Option<String>,
    pub retry_after_ms: Option<u64>,
}

/// What the plugin logged and what the sandbox refused it during one step.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Heard {
    pub logs: Vec<LogLine>,
    /// Requests the sandbox denied (a path, an address, an HTTP origin), as ferry logs them.
    pub refused: Vec<String>,
    /// Other warnings ferry logged about the plugin (an instance replaced, a fault).
    pub warnings: Vec<String>,
    /// Lines not kept, past the first thousand of a step.
    pub left_out: u64,
}

/// Lines kept per step: a plugin that logs in a loop cannot fill the memory of `try`.
const MAX_HEARD: usize = 1000;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogLine {
    pub level: String,
    pub message: String,
}

/// One line of an events file: a JSON object. Everything but the payload has a default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EventLine {
    id: Option<i64>,
    #[serde(rename = "type")]
    event_type: Option<String>,
    key: Option<String>,
    /// Text, or any other JSON value (sent as its JSON text).
    payload: Option<serde_json::Value>,
    /// The payload as standard base64, for bytes that are not text.
    payload_base64: Option<String>,
    content_type: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    attempt: Option<u32>,
    /// RFC 3339; now when left out.
    time: Option<DateTime<Utc>>,
}

/// The event type of a line that names none.
pub const DEFAULT_EVENT_TYPE: &str = "ferry.try";

/// What is delivered when no events are given.
pub const SAMPLE_EVENT: &str = r#"{"type": "ferry.try", "payload": {"hello": "from ferry plugins try"}}"#;

/// Reads events as JSON lines (blank lines and lines starting with `#` skipped) for `route`.
/// Errors name the line and the field.
pub fn parse_events(
    text: &str,
    route: &str,
    max_payload: usize,
    now: DateTime<Utc>,
) -> anyhow::Result<Vec<ClaimedEvent>> {
    let mut events = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line_no = index + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if !line.starts_with('{') {
            anyhow::bail!(
                "events line {line_no}: expected a JSON object such as {{\"type\": \"t\", \"payload\": \"hi\"}}"
            );
        }
        let mut reader = serde_json::Deserializer::from_str(line);
        let event: EventLine = serde_path_to_error::deserialize(&mut reader).map_err(|e| {
            let field = e.path().to_string();
            // The position serde adds is within the line; the line number says enough.
            let inner = e.into_inner().to_string();
            let inner = inner.split(" at line ").next().unwrap_or_default();
            match field.as_str() {
                "." | "" => anyhow::anyhow!("events line {line_no}: {inner}"),
                field => anyhow::anyhow!("events line {line_no}: {field}: {inner}"),
            }
        })?;
        let payload = match (event.payload, event.payload_base64) {
            (Some(_), Some(_)) => anyhow::bail!("events line {line_no}: give payload or payload_base64, not both"),
            (Some(serde_json::Value::String(text)), None) => text.into_bytes(),
            (Some(value), None) => value.to_string().into_bytes(),
            (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
                .decode(encoded.trim())
                .with_context(|| format!("events line {line_no}: payload_base64 is not standard base64"))?,
            (None, None) => Vec::new(),
        };
        if payload.len() > max_payload {
            anyhow::bail!(
                "events line {line_no}: {}",
                ferry_outbox::payload_too_large(payload.len() as u64, max_payload)
            );
        }
        let id = event.id.unwrap_or(events.len() as i64 + 1);
        if id < 1 {
            anyhow::bail!("events line {line_no}: id {id} is not an outbox id; ids start at 1");
        }
        if events.iter().any(|e: &ClaimedEvent| e.id == id) {
            anyhow::bail!("events line {line_no}: id {id} is taken by an earlier event; give each event its own id");
        }
        events.push(ClaimedEvent {
            id,
            route: route.to_string(),
            event_type: event.event_type.unwrap_or_else(|| DEFAULT_EVENT_TYPE.into()),
            ordering_key: event.key,
            payload,
            content_type: event.content_type.unwrap_or_else(|| "application/json".into()),
            headers: event.headers.into_iter().collect(),
            attempt: event.attempt.unwrap_or(1).max(1),
            max_attempts: None,
            event_time: event.time.unwrap_or(now),
            created_at: now,
            defect: None,
        });
    }
    Ok(events)
}

/// Loads the plugin as `serve` would with `config` (its `[plugins]` limits, and its
/// `[sandbox.NAME]` unless `setup` brings one), runs `init` with the route's config, and delivers
/// `events` in calls of `setup.batch_size`.
pub async fn run(config: &Config, setup: &TrialSetup, events: &[ClaimedEvent]) -> anyhow::Result<TrialReport> {
    // The runtime is sized for the route before the plugin has said its name: the sandbox given
    // here applies to whatever name that is, so it is sized under a stand-in.
    let sizing = trial_config(config, setup, "ferry-try");
    // The checks `serve` makes at start, so the limits tried are limits `serve` would accept.
    sizing.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    let sizing = sizing.settings().context("the trial's settings")?;
    let runtime = Arc::new(Runtime::new(&sizing)?.inspecting());
    let plugin = runtime
        .load_granting(&setup.file, sizing.largest_plugin_memory(), |name| {
            trial_config(config, setup, name).settings().is_ok_and(|s| !s.plugin(name).sandbox.http.is_empty())
        })
        .await?;
    let settings = Arc::new(trial_config(config, setup, &plugin.info.name).settings()?);
    let info = TrialPlugin {
        name: plugin.info.name.clone(),
        version: plugin.info.version.clone(),
        hash: plugin.hash.clone(),
        file: setup.file.clone(),
    };
    let route = settings.route(&setup.route).context("the trial's route")?.clone();
    let registry = Arc::new(Registry::new(runtime, settings, Arc::default()));
    registry.activate(plugin);
    let transport = RouteTransport::new(registry, route);

    let (heard, started) = (Listener::default(), Instant::now());
    let warmed = transport.warm_up().with_subscriber(heard.subscriber()).await;
    let init = TrialInit { error: warmed.err(), duration_ms: millis(started), heard: heard.take() };
    let mut report = TrialReport {
        plugin: info,
        route: setup.route.clone(),
        init,
        calls: Vec::new(),
        succeeded: 0,
        events: events.len(),
    };
    if report.init.error.is_some() {
        return Ok(report);
    }
    for batch in events.chunks(setup.batch_size.max(1)) {
        let refs: Vec<&ClaimedEvent> = batch.iter().collect();
        let started = Instant::now();
        let delivery = transport.deliver(&refs, None, None).with_subscriber(heard.subscriber()).await;
        let duration_ms = millis(started);
        let (fault, outcomes) = match delivery.result {
            Ok(outcomes) => (None, batch.iter().zip(outcomes).map(|(e, o)| outcome_of(e, o)).collect()),
            Err(e) => {
                let reason = match &e {
                    DeliverError::Fault(fault) => fault.to_string(),
                    DeliverError::NoTransport(why) | DeliverError::HostShort(why) | DeliverError::LeaseShort(why) => {
                        why.clone()
                    }
                };
                let failed = batch.iter().map(|e| failure(e, "transient", reason.clone(), None)).collect();
                (Some(reason), failed)
            }
        };
        report.calls.push(TrialCall { duration_ms, fault, outcomes, heard: heard.take() });
    }
    report.succeeded = report.calls.iter().flat_map(|c| &c.outcomes).filter(|o| o.outcome == "success").count();
    Ok(report)
}

/// `config` with one route, `setup.route`, served by `plugin`, and `setup.sandbox` (if given) as
/// that plugin's sandbox. Other routes are dropped: only this one runs.
fn trial_config(config: &Config, setup: &TrialSetup, plugin: &str) -> Config {
    let mut config = config.clone();
    let mut route = config.route.remove(&setup.route).unwrap_or_default();
    route.plugin = plugin.to_string();
    // Nothing is recorded in a trial, so nothing goes on to a dead letter (whose route is dropped).
    route.dead_letter = None;
    route.config.extend(setup.route_config.iter().map(|(k, v)| (k.clone(), ConfigValue(v.clone()))));
    config.route = BTreeMap::from([(setup.route.clone(), route)]);
    if let Some(sandbox) = &setup.sandbox {
        config.sandbox.insert(plugin.to_string(), sandbox.clone());
    }
    config
}

fn outcome_of(event: &ClaimedEvent, outcome: Outcome) -> TrialOutcome {
    match outcome {
        Outcome::Success => TrialOutcome {
            id: event.id,
            event_type: event.event_type.clone(),
            outcome: "success".into(),
            reason: None,
            retry_after_ms: None,
        },
        Outcome::Transient(f) => failure(event, "transient", clean(&f.reason), f.retry_after_ms),
        Outcome::Permanent(f) => failure(event, "permanent", clean(&f.reason), None),
        // The delay is what `retry_after_ms` reports for a deferral.
        Outcome::Deferred(d) => failure(event, "deferred", clean(&d.reason), Some(d.delay_ms)),
    }
}

fn failure(event: &ClaimedEvent, outcome: &str, reason: String, retry_after_ms: Option<u64>) -> TrialOutcome {
    TrialOutcome {
        id: event.id,
        event_type: event.event_type.clone(),
        outcome: outcome.into(),
        reason: Some(reason),
        retry_after_ms,
    }
}

/// A plugin's reason as the relay would store it.
fn clean(reason: &str) -> String {
    crate::untrusted::clean(reason, crate::untrusted::MAX_REASON)
}

fn millis(since: Instant) -> f64 {
    (since.elapsed().as_secs_f64() * 1e6).round() / 1e3
}

/// Collects what is logged while a step runs: the plugin's own lines (target `ferry::plugin`),
/// the sandbox's refusals, and other warnings.
#[derive(Clone, Default)]
struct Listener(Arc<Mutex<Heard>>);

impl Listener {
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        tracing_subscriber::registry().with(self.clone())
    }

    fn take(&self) -> Heard {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Listener {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let meta = event.metadata();
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut heard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let full = heard.logs.len() + heard.refused.len() + heard.warnings.len() >= MAX_HEARD;
        if full {
            heard.left_out += 1;
        } else if meta.target() == "ferry::plugin" {
            heard.logs.push(LogLine { level: meta.level().as_str().to_ascii_lowercase(), message: fields.message });
        } else if fields.message.starts_with("plugin denied") {
            heard.refused.push(fields.with_details());
        } else if *meta.level() <= tracing::Level::WARN {
            heard.warnings.push(fields.with_details());
        }
    }
}

/// An event's message and its other fields (but the plugin's name, which is known).
#[derive(Default)]
struct Fields {
    message: String,
    details: Vec<String>,
}

impl Fields {
    fn with_details(self) -> String {
        if self.details.is_empty() { self.message } else { format!("{} ({})", self.message, self.details.join(", ")) }
    }
}

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        match field.name() {
            "message" => self.message = value.to_string(),
            "plugin" | "route" => {}
            name => self.details.push(format!("{name}={value}")),
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        match field.name() {
            "message" => self.message = format!("{value:?}"),
            "plugin" | "route" => {}
            name => self.details.push(format!("{name}={value:?}")),
        }
    }
}

/// Reads a `--sandbox-toml` file: the keys of one plugin's `[sandbox.NAME]` table, or a whole
/// ferry.toml-like file with a single `[sandbox.NAME]` table. Relative paths in it are relative to
/// the file's directory, as in ferry.toml.
pub fn read_sandbox(path: &Path) -> anyhow::Result<SandboxConfig> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let table: toml::Table = text.parse().with_context(|| format!("{} is not TOML", path.display()))?;
    let mut sandbox: SandboxConfig = match table.get("sandbox") {
        // Parsed again from the text, so an error names the line.
        None => toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
        Some(toml::Value::Table(plugins)) if plugins.len() == 1 => {
            let (name, one) = plugins.iter().next().unzip();
            let name = name.map_or("", String::as_str);
            let one = one.cloned().unwrap_or_else(|| toml::Value::Table(toml::Table::new()));
            one.try_into().map_err(|e| anyhow::anyhow!("{}: sandbox.{name}: {e}", path.display()))?
        }
        Some(_) => anyhow::bail!(
            "{}: give the keys of one plugin's sandbox (http, dirs, tcp, …), or a single [sandbox.NAME] table",
            path.display()
        ),
    };
    sandbox.resolve_paths(path.parent().unwrap_or(Path::new("")));
    Ok(sandbox)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> anyhow::Result<Vec<ClaimedEvent>> {
        parse_events(text, "r", 16, Utc::now())
    }

    #[test]
    fn event_lines_take_text_json_or_base64_payloads_with_defaults() {
        let events = parse(
            "# a comment\n{\"payload\": \"hi\"}\n\n{\"type\": \"t\", \"payload\": {\"n\": 1}, \"key\": \"k\", \"attempt\": 3}\n\
             {\"id\": 40, \"payload_base64\": \"//79\", \"headers\": {\"a\": \"b\"}, \"time\": \"2026-11-26T08:00:00Z\"}\n",
        )
        .unwrap();
        assert_eq!(events.len(), 3);
        let (a, b, c) = (&events[0], &events[1], &events[2]);
        assert_eq!(
            (a.id, a.event_type.as_str(), a.payload.as_slice(), a.attempt),
            (1, DEFAULT_EVENT_TYPE, &b"hi"[..], 1)
        );
        assert_eq!(
            (b.id, b.payload.as_slice(), b.ordering_key.as_deref(), b.attempt),
            (2, &br#"{"n":1}"#[..], Some("k"), 3)
        );
        assert_eq!(
            (c.id, c.payload.as_slice(), c.headers.clone()),
            (40, &[0xff, 0xfe, 0xfd][..], vec![("a".into(), "b".into())])
        );
        assert_eq!(c.event_time.to_rfc3339(), "2026-11-26T08:00:00+00:00");
        assert!(events.iter().all(|e| e.route == "r" && e.content_type == "application/json"));
    }

    #[test]
    fn a_bad_event_line_is_named_with_what_is_wrong() {
        let message = |text: &str| format!("{:#}", parse(text).unwrap_err());
        let typo = message("{\"payload\": \"ok\"}\n{\"paylod\": \"x\"}");
        assert!(typo.starts_with("events line 2: paylod: unknown field `paylod`, expected one of"), "{typo}");
        assert!(!typo.contains("column"), "{typo}");
        let both = message("{\"payload\": \"x\", \"payload_base64\": \"eA==\"}");
        assert_eq!(both, "events line 1: give payload or payload_base64, not both");
        let base64 = message("{\"payload_base64\": \"not base64!\"}");
        assert!(base64.starts_with("events line 1: payload_base64 is not standard base64"), "{base64}");
        let large = message("{\"payload\": \"seventeen bytes!!\"}");
        assert!(large.starts_with("events line 1: ") && large.contains("17"), "{large}");
        assert!(message("not json").starts_with("events line 1: expected a JSON object"));
        assert!(message("[5, \"t\"]").starts_with("events line 1: expected a JSON object"));
        let field = message("{\"headers\": {\"a\": 1}}");
        assert!(field.starts_with("events line 1: headers.a: invalid type"), "{field}");
        let time = message("{\"time\": \"yesterday\"}");
        assert!(time.starts_with("events line 1: time: "), "{time}");
        let twice = message("{\"id\": 2}\n{}");
        assert_eq!(twice, "events line 2: id 2 is taken by an earlier event; give each event its own id");
        assert_eq!(message("{\"id\": 0}"), "events line 1: id 0 is not an outbox id; ids start at 1");
    }

    #[test]
    fn a_sandbox_file_is_a_table_body_or_one_sandbox_table_with_paths_relative_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let write = |text: &str| {
            let path = dir.path().join("sandbox.toml");
            std::fs::write(&path, text).unwrap();
            read_sandbox(&path)
        };
        let body = write("dirs = { \"/data\" = \"data\" }\nhttp = [\"http://127.0.0.1:9\"]\n").unwrap();
        assert_eq!(body.dirs["/data"], dir.path().join("data"));
        assert_eq!(body.http, ["http://127.0.0.1:9"]);
        let table = write("[sandbox.hook]\ntcp = [\"127.0.0.1:9092\"]\n").unwrap();
        assert_eq!(table.tcp, ["127.0.0.1:9092"]);
        let typo = format!("{:#}", write("htp = []\n").unwrap_err());
        assert!(typo.contains("unknown field `htp`") && typo.contains("line 1"), "{typo}");
        let two = format!("{:#}", write("[sandbox.a]\n[sandbox.b]\n").unwrap_err());
        assert!(two.contains("a single [sandbox.NAME] table"), "{two}");
    }
}
