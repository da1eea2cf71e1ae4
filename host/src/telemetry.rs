//! OpenTelemetry traces of the relay's work, exported over OTLP/HTTP with JSON bodies when
//! `telemetry.otlp_endpoint` is set.
//!
//! Each batch the relay claims becomes one trace: a `ferry.batch` span with a `ferry.claim` child
//! (the claim statement), a `ferry.deliver` child per plugin call (its route, plugin, events and
//! outcomes, linked to the trace of each event that carries a W3C `traceparent` header) and a
//! `ferry.record` child (the transaction that writes the outcomes). Idle polls make no spans.
//!
//! The exporter never slows the relay: spans go into a bounded queue, a background task posts
//! them in batches (every second, or sooner when a batch fills), and spans that a full queue
//! turns away or whose export fails are dropped and counted (`ferry_trace_spans_dropped_total`),
//! with a warning at most once a minute for each. A collector that refuses or does not answer
//! costs that, nothing more. The protocol is
//! small enough to write here (one POST of a documented JSON shape), which keeps the OpenTelemetry
//! SDK, gRPC and protobuf out of the binary.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use prometheus_client::metrics::counter::Counter;
use rand::Rng as _;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::TelemetryConfig;

/// Spans waiting for the exporter; more are dropped.
const QUEUE: usize = 4096;
/// Spans per request at most.
const BATCH: usize = 512;
/// How long a span waits at most before its batch is sent.
const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// How long one export request may take.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// The most of a collector's answer that is read.
const MAX_ANSWER: usize = 64 << 10;
/// How often, at most, a failing export is logged.
const WARN_EVERY: Duration = Duration::from_secs(60);
/// Links to events' own traces one delivery span carries at most.
pub const MAX_LINKS: usize = 32;

/// The URL spans are posted to, from `telemetry.otlp_endpoint`: the base URL of an OTLP/HTTP
/// receiver, to which `/v1/traces` is added unless the path already ends so.
pub fn traces_uri(endpoint: &str) -> Result<http::Uri, String> {
    // Refused before anything quotes the value, so a password in it never reaches a message.
    if endpoint.contains('@') {
        return Err(
            "credentials in the URL are not supported (they would be logged); give a plain http://HOST:PORT".into()
        );
    }
    let uri: http::Uri = endpoint.parse().map_err(|e| format!("{endpoint:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!(
                "{endpoint:?}: https is not supported; send to a collector or agent beside ferry over http://"
            ));
        }
        _ => return Err(format!("{endpoint:?} must start with http://, e.g. \"http://127.0.0.1:4318\"")),
    }
    let authority = uri.authority().ok_or_else(|| format!("{endpoint:?} names no host"))?.clone();
    if authority.as_str().contains('@') {
        return Err(
            "credentials in the URL are not supported (they would be logged); give a plain http://HOST:PORT".into()
        );
    }
    let path = uri.path().trim_end_matches('/');
    let path = if path.ends_with("/v1/traces") { path.to_string() } else { format!("{path}/v1/traces") };
    http::Uri::builder()
        .scheme("http")
        .authority(authority)
        .path_and_query(path)
        .build()
        .map_err(|e| format!("{endpoint:?}: {e}"))
}

/// What a span stands for, as OTLP numbers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Client = 3,
    Producer = 4,
}

/// A span attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum Attr {
    Str(String),
    Int(i64),
}

impl From<&str> for Attr {
    fn from(value: &str) -> Attr {
        Attr::Str(value.to_string())
    }
}

impl From<String> for Attr {
    fn from(value: String) -> Attr {
        Attr::Str(value)
    }
}

impl From<usize> for Attr {
    fn from(value: usize) -> Attr {
        Attr::Int(i64::try_from(value).unwrap_or(i64::MAX))
    }
}

/// A trace (16 bytes) and span (8 bytes) id, as in W3C Trace Context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpanContext {
    pub trace_id: u128,
    pub span_id: u64,
}

impl SpanContext {
    /// A new trace's root.
    pub fn root() -> SpanContext {
        let mut rng = rand::rng();
        // All-zero ids are invalid.
        SpanContext { trace_id: rng.random::<u128>().max(1), span_id: rng.random::<u64>().max(1) }
    }

    /// A new span in this one's trace.
    pub fn child(&self) -> SpanContext {
        SpanContext { trace_id: self.trace_id, span_id: rand::rng().random::<u64>().max(1) }
    }

    /// The context a W3C `traceparent` header value names (`00-<trace>-<span>-<flags>`), if it
    /// is well-formed: version 00 (or a later one, read the same way), lowercase hex, ids not zero.
    pub fn from_traceparent(value: &str) -> Option<SpanContext> {
        let mut parts = value.trim().split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex =
            |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !hex(version, 2) || version == "ff" || !hex(trace, 32) || !hex(span, 16) || !hex(flags, 2) {
            return None;
        }
        if version == "00" && parts.next().is_some() {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok().filter(|id| *id != 0)?;
        let span_id = u64::from_str_radix(span, 16).ok().filter(|id| *id != 0)?;
        Some(SpanContext { trace_id, span_id })
    }
}

/// One finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub context: SpanContext,
    pub parent: Option<u64>,
    pub name: &'static str,
    pub kind: SpanKind,
    pub start: DateTime<Utc>,
    pub end: DateTime<Utc>,
    pub attributes: Vec<(&'static str, Attr)>,
    /// Other traces this span works for (the events' own).
    pub links: Vec<SpanContext>,
    /// Set when the span's work failed, with what went wrong.
    pub error: Option<String>,
}

impl Span {
    /// The span as OTLP/JSON writes it: ids in hex, times in nanoseconds as strings.
    fn to_json(&self) -> Value {
        let nanos = |t: DateTime<Utc>| t.timestamp_nanos_opt().unwrap_or_default().max(0).to_string();
        let status = match &self.error {
            None => json!({"code": 0}),
            Some(message) => json!({"code": 2, "message": message}),
        };
        json!({
            "traceId": format!("{:032x}", self.context.trace_id),
            "spanId": format!("{:016x}", self.context.span_id),
            "parentSpanId": self.parent.map_or_else(String::new, |id| format!("{id:016x}")),
            "name": self.name,
            "kind": self.kind as i32,
            "startTimeUnixNano": nanos(self.start),
            "endTimeUnixNano": nanos(self.end.max(self.start)),
            "attributes": attributes(&self.attributes),
            "links": self.links.iter().map(|link| json!({
                "traceId": format!("{:032x}", link.trace_id),
                "spanId": format!("{:016x}", link.span_id),
            })).collect::<Vec<_>>(),
            "status": status,
        })
    }
}

fn attributes(attributes: &[(&str, Attr)]) -> Vec<Value> {
    attributes
        .iter()
        .map(|(key, value)| {
            let value = match value {
                Attr::Str(s) => json!({"stringValue": s}),
                // OTLP/JSON writes 64-bit integers as strings.
                Attr::Int(n) => json!({"intValue": n.to_string()}),
            };
            json!({"key": key, "value": value})
        })
        .collect()
}

/// Where the relay hands its finished spans.
#[derive(Debug)]
pub struct Tracer {
    queue: mpsc::Sender<Span>,
    dropped: Counter,
    /// When a full queue was last said in the log.
    warned: std::sync::Mutex<Option<std::time::Instant>>,
}

impl Tracer {
    /// A tracer for `config` and the task exporting its spans, or `None` when no endpoint is set.
    /// The task runs until `stop` is cancelled, then sends what is queued and ends. `dropped`
    /// counts the spans a full queue turned away.
    pub fn start(
        config: &TelemetryConfig,
        instance: &str,
        dropped: Counter,
        stop: CancellationToken,
    ) -> anyhow::Result<Option<(Arc<Tracer>, tokio::task::JoinHandle<()>)>> {
        if config.otlp_endpoint.is_empty() {
            return Ok(None);
        }
        let uri = traces_uri(&config.otlp_endpoint).map_err(|why| anyhow::anyhow!("telemetry.otlp_endpoint: {why}"))?;
        let resource = json!({
            "attributes": attributes(&[
                ("service.name", Attr::from(config.service_name.as_str())),
                ("service.version", Attr::from(env!("CARGO_PKG_VERSION"))),
                ("service.instance.id", Attr::from(instance)),
            ]),
        });
        let (queue, spans) = mpsc::channel(QUEUE);
        let client = Client::builder(TokioExecutor::new()).build_http();
        let exporter = Exporter { uri, resource, client, dropped: dropped.clone() };
        let task = tokio::spawn(exporter.run(spans, stop));
        Ok(Some((Arc::new(Tracer { queue, dropped, warned: std::sync::Mutex::default() }), task)))
    }

    /// Queues `span` for export; a full queue drops it (counted, and said in the log at most once
    /// a minute).
    pub fn record(&self, span: Span) {
        if self.queue.try_send(span).is_ok() {
            return;
        }
        self.dropped.inc();
        let mut warned = self.warned.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
            *warned = Some(std::time::Instant::now());
            tracing::warn!(
                "trace spans dropped: the exporter's queue of {QUEUE} is full (the collector is slow or down)"
            );
        }
    }
}

struct Exporter {
    uri: http::Uri,
    resource: Value,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Counts the spans of exports that failed, as the tracer counts those a full queue refused.
    dropped: Counter,
}

impl Exporter {
    async fn run(self, mut spans: mpsc::Receiver<Span>, stop: CancellationToken) {
        let mut warned: Option<std::time::Instant> = None;
        let mut batch = Vec::with_capacity(BATCH);
        loop {
            let first = tokio::select! {
                span = spans.recv() => span,
                _ = stop.cancelled() => None,
            };
            let Some(first) = first else { break };
            batch.push(first);
            let flush = tokio::time::sleep(FLUSH_EVERY);
            tokio::pin!(flush);
            while batch.len() < BATCH {
                tokio::select! {
                    span = spans.recv() => match span {
                        Some(span) => batch.push(span),
                        None => break,
                    },
                    _ = &mut flush => break,
                    _ = stop.cancelled() => break,
                }
            }
            self.send(&mut batch, &mut warned).await;
        }
        // Stopping: what is queued goes out, as one last try.
        while let Ok(span) = spans.try_recv() {
            batch.push(span);
            if batch.len() == BATCH {
                self.send(&mut batch, &mut warned).await;
            }
        }
        self.send(&mut batch, &mut warned).await;
    }

    /// Posts `batch` (emptying it). A failure is logged at most once a minute; the spans are lost.
    async fn send(&self, batch: &mut Vec<Span>, warned: &mut Option<std::time::Instant>) {
        if batch.is_empty() {
            return;
        }
        let count = batch.len();
        let body = json!({
            "resourceSpans": [{
                "resource": self.resource,
                "scopeSpans": [{
                    "scope": {"name": "ferry", "version": env!("CARGO_PKG_VERSION")},
                    "spans": batch.drain(..).map(|span| span.to_json()).collect::<Vec<_>>(),
                }],
            }],
        });
        let request = http::Request::post(self.uri.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())));
        let outcome = match request {
            Ok(request) => match tokio::time::timeout(SEND_TIMEOUT, self.client.request(request)).await {
                Ok(Ok(response)) if response.status().is_success() => {
                    // Read to the end (a collector's answer is small; more is not read), so the
                    // connection serves the next export.
                    let body = http_body_util::Limited::new(response.into_body(), MAX_ANSWER);
                    let _ = tokio::time::timeout(SEND_TIMEOUT, body.collect()).await;
                    Ok(())
                }
                Ok(Ok(response)) => Err(format!("the collector answered {}", response.status())),
                Ok(Err(e)) => Err(format!("{e}")),
                Err(_) => Err(format!("no answer within {SEND_TIMEOUT:?}")),
            },
            Err(e) => Err(e.to_string()),
        };
        if let Err(why) = outcome {
            self.dropped.inc_by(u64::try_from(count).unwrap_or(u64::MAX));
            if warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
                *warned = Some(std::time::Instant::now());
                tracing::warn!(endpoint = %self.uri, spans = count, "traces not exported (dropped): {why}");
            }
        }
    }
}

/// The traces a batch's events belong to, from their `traceparent` headers: distinct, at most
/// [`MAX_LINKS`].
pub fn event_links<'a>(headers: impl IntoIterator<Item = &'a [(String, String)]>) -> Vec<SpanContext> {
    let mut links: Vec<SpanContext> = Vec::new();
    for event in headers {
        let parent = event.iter().find(|(name, _)| name.eq_ignore_ascii_case("traceparent"));
        if let Some(context) = parent.and_then(|(_, value)| SpanContext::from_traceparent(value))
            && !links.contains(&context)
        {
            links.push(context);
            if links.len() == MAX_LINKS {
                break;
            }
        }
    }
    links
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_become_the_traces_url() {
        let uri = |e: &str| traces_uri(e).map(|u| u.to_string());
        assert_eq!(uri("http://127.0.0.1:4318").unwrap(), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(uri("http://collector:4318/").unwrap(), "http://collector:4318/v1/traces");
        assert_eq!(uri("http://c:4318/otel/v1/traces").unwrap(), "http://c:4318/otel/v1/traces");
        assert!(uri("https://c:4318").unwrap_err().contains("https is not supported"));
        assert!(uri("c:4318").is_err());
        for with_password in ["http://user:secret@c:4318", "https://user:secret@c:4318", "user:secret@c"] {
            let err = uri(with_password).unwrap_err();
            assert!(err.contains("credentials") && !err.contains("secret"), "{err}");
        }
        assert!(uri("not a url").is_err());
    }

    #[test]
    fn traceparents_are_read_strictly() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = SpanContext::from_traceparent(good).unwrap();
        assert_eq!(context.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(context.span_id, 0x00f067aa0ba902b7);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e47-00f067aa0ba902b7-01",
        ] {
            assert_eq!(SpanContext::from_traceparent(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn spans_are_written_as_otlp_json() {
        let context = SpanContext { trace_id: 1, span_id: 2 };
        let at = DateTime::from_timestamp(1_800_000_000, 5).unwrap();
        let span = Span {
            context,
            parent: Some(3),
            name: "ferry.deliver",
            kind: SpanKind::Producer,
            start: at,
            end: at,
            attributes: vec![("ferry.route", "r".into()), ("messaging.batch.message_count", 7usize.into())],
            links: vec![SpanContext { trace_id: 4, span_id: 5 }],
            error: Some("boom".into()),
        };
        let json = span.to_json();
        assert_eq!(json["traceId"], "00000000000000000000000000000001");
        assert_eq!(json["spanId"], "0000000000000002");
        assert_eq!(json["parentSpanId"], "0000000000000003");
        assert_eq!(json["kind"], 4);
        assert_eq!(json["startTimeUnixNano"], "1800000000000000005");
        assert_eq!(json["attributes"][1], json!({"key": "messaging.batch.message_count", "value": {"intValue": "7"}}));
        assert_eq!(json["links"][0]["traceId"], "00000000000000000000000000000004");
        assert_eq!(json["status"], json!({"code": 2, "message": "boom"}));
    }
}
