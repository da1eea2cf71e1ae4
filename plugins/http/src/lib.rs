//! The `http` transport: sends each event to the route's webhook URL through wasi:http, signed the
//! Standard Webhooks way, several requests at once.
//!
//! Route configuration:
//! - `url` (required) — `http://` or `https://` endpoint; its origin must be in the plugin's
//!   `sandbox.http.http` allowlist;
//! - `method` — default `POST`;
//! - `secret` — signing secret (`whsec_<base64>` or raw text); without it nothing is signed;
//! - `secret_previous` — a second secret during rotation: both signatures are sent;
//! - `timeout_ms` — per request (connect, first byte, between bytes), default 10000;
//! - `concurrency` — requests in flight at once within a batch, default 8;
//! - `header.NAME` — a static header added to every request.
//!
//! Each request carries the payload as its body, the event's content type and headers, and
//! `webhook-id` (the event id, stable across retries), `webhook-timestamp` and, when a secret is
//! set, `webhook-signature`. Answers map to outcomes as in [`policy::judge`].

pub mod policy;

use std::sync::Mutex;

use policy::{Target, Verdict};

wit_bindgen::generate!({ path: "../../wit", world: "transport-plugin" });

use exports::ferry::transport::transport::{Event, Guest, Outcome, PluginInfo};
use ferry::transport::logging::{Level, log};
use ferry::transport::types::Failure;

/// This instance's configuration, set by `init`.
struct Settings {
    target: Target,
    method: String,
    secrets: Vec<Vec<u8>>,
    timeout_ns: u64,
    concurrency: usize,
    headers: Vec<(String, String)>,
}

static SETTINGS: Mutex<Option<Settings>> = Mutex::new(None);

struct HttpTransport;

impl Guest for HttpTransport {
    fn metadata() -> PluginInfo {
        PluginInfo { name: "http".into(), version: env!("CARGO_PKG_VERSION").into() }
    }

    fn init(config: Vec<(String, String)>) -> Result<(), String> {
        let mut url = None;
        let mut settings = Settings {
            target: Target { https: true, authority: String::new(), path_and_query: "/".into() },
            method: "POST".into(),
            secrets: Vec::new(),
            timeout_ns: 10_000_000_000,
            concurrency: 8,
            headers: Vec::new(),
        };
        let mut previous = None;
        for (key, value) in config {
            match key.as_str() {
                "url" => url = Some(policy::parse_url(&value)?),
                "method" => settings.method = value.to_ascii_uppercase(),
                "secret" => settings.secrets.insert(0, policy::secret_bytes(&value)?),
                "secret_previous" => previous = Some(policy::secret_bytes(&value)?),
                "timeout_ms" => {
                    let ms: u64 = value.parse().map_err(|_| format!("timeout_ms: not a number: {value:?}"))?;
                    settings.timeout_ns = ms.saturating_mul(1_000_000);
                }
                "concurrency" => {
                    settings.concurrency = value
                        .parse()
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or(format!("concurrency: not a positive number: {value:?}"))?;
                }
                other => match other.strip_prefix("header.") {
                    Some(name) if !name.is_empty() => settings.headers.push((name.to_ascii_lowercase(), value)),
                    _ => {
                        return Err(format!(
                            "unknown config key {other:?} (known: url, method, secret, secret_previous, timeout_ms, concurrency, header.NAME)"
                        ));
                    }
                },
            }
        }
        settings.target = url.ok_or("url: required")?;
        if previous.is_some() && settings.secrets.is_empty() {
            return Err("secret_previous: needs secret as well".into());
        }
        settings.secrets.extend(previous);
        log(Level::Info, &format!("delivering to {}{}", settings.target.authority, settings.target.path_and_query));
        *SETTINGS.lock().unwrap_or_else(|e| e.into_inner()) = Some(settings);
        Ok(())
    }

    fn deliver_batch(events: Vec<Event>) -> Vec<Outcome> {
        let guard = SETTINGS.lock().unwrap_or_else(|e| e.into_inner());
        let Some(settings) = guard.as_ref() else {
            return events.iter().map(|_| permanent("http transport: init was not called".into())).collect();
        };
        let mut outcomes: Vec<Option<Outcome>> = events.iter().map(|_| None).collect();
        for (chunk_start, chunk) in
            events.chunks(settings.concurrency).enumerate().map(|(i, c)| (i * settings.concurrency, c))
        {
            let results = send::all(settings, chunk);
            for (offset, verdict) in results.into_iter().enumerate() {
                outcomes[chunk_start + offset] = Some(match verdict {
                    Verdict::Success => Outcome::Success,
                    Verdict::Transient { reason, retry_after_ms } => {
                        Outcome::Transient(Failure { reason, retry_after_ms })
                    }
                    Verdict::Permanent { reason } => permanent(reason),
                });
            }
        }
        outcomes.into_iter().map(|o| o.unwrap_or_else(|| permanent("http transport: no answer".into()))).collect()
    }
}

fn permanent(reason: String) -> Outcome {
    Outcome::Permanent(Failure { reason, retry_after_ms: None })
}

mod send {
    //! The wasi:http side: start every request of a chunk, then wait for all answers.

    use wasi::http::outgoing_handler::{self, FutureIncomingResponse};
    use wasi::http::types::{ErrorCode, Fields, Method, OutgoingBody, OutgoingRequest, RequestOptions, Scheme};
    use wasi::io::streams::StreamError;

    use super::Settings;
    use super::exports::ferry::transport::transport::Event;
    use super::policy::{self, Verdict};

    /// Sends `events` concurrently and returns one verdict each, in order: every request is
    /// started first (connections open in parallel), then the bodies are written, then the
    /// answers collected.
    pub fn all(settings: &Settings, events: &[Event]) -> Vec<Verdict> {
        let started: Vec<Result<(FutureIncomingResponse, OutgoingBody), Verdict>> =
            events.iter().map(|e| start(settings, e)).collect();
        let sent: Vec<Result<FutureIncomingResponse, Verdict>> = started
            .into_iter()
            .zip(events)
            .map(|(pending, event)| {
                let (response, body) = pending?;
                match write_body(body, &event.payload) {
                    Ok(()) => Ok(response),
                    // The request already failed (refused, denied): its answer says why.
                    Err(_) => Err(finish(&response)),
                }
            })
            .collect();
        sent.into_iter()
            .map(|pending| match pending {
                Ok(response) => finish(&response),
                Err(verdict) => verdict,
            })
            .collect()
    }

    fn start(settings: &Settings, event: &Event) -> Result<(FutureIncomingResponse, OutgoingBody), Verdict> {
        let id = event.id.to_string();
        let timestamp = now_seconds();
        let headers = Fields::new();
        let add = |name: &str, value: &str| {
            headers
                .append(name, value.as_bytes())
                .map_err(|e| Verdict::Permanent { reason: format!("header {name:?} cannot be sent: {e:?}") })
        };
        add("content-type", &event.content_type)?;
        // A known length lets the body go out in one piece rather than chunked.
        add("content-length", &event.payload.len().to_string())?;
        for (name, value) in event.headers.iter().chain(&settings.headers) {
            add(name, value)?;
        }
        add("webhook-id", &id)?;
        add("webhook-timestamp", &timestamp.to_string())?;
        if !settings.secrets.is_empty() {
            add("webhook-signature", &policy::signature_header(&settings.secrets, &id, timestamp, &event.payload))?;
        }
        let request = OutgoingRequest::new(headers);
        let method = match settings.method.as_str() {
            "POST" => Method::Post,
            "PUT" => Method::Put,
            "PATCH" => Method::Patch,
            other => Method::Other(other.to_string()),
        };
        let bad = |what: &str| Verdict::Permanent { reason: format!("invalid request: {what}") };
        request.set_method(&method).map_err(|()| bad("method"))?;
        let scheme = if settings.target.https { Scheme::Https } else { Scheme::Http };
        request.set_scheme(Some(&scheme)).map_err(|()| bad("scheme"))?;
        request.set_authority(Some(&settings.target.authority)).map_err(|()| bad("authority"))?;
        request.set_path_with_query(Some(&settings.target.path_and_query)).map_err(|()| bad("path"))?;
        let options = RequestOptions::new();
        let _ = options.set_connect_timeout(Some(settings.timeout_ns));
        let _ = options.set_first_byte_timeout(Some(settings.timeout_ns));
        let _ = options.set_between_bytes_timeout(Some(settings.timeout_ns));
        let body = request.body().map_err(|()| bad("body"))?;
        let response = outgoing_handler::handle(request, Some(options)).map_err(|e| network(&e))?;
        Ok((response, body))
    }

    fn write_body(body: OutgoingBody, payload: &[u8]) -> Result<(), String> {
        {
            let stream = body.write().map_err(|()| "request body stream unavailable".to_string())?;
            for chunk in payload.chunks(4096) {
                stream
                    .blocking_write_and_flush(chunk)
                    .map_err(|e| format!("writing request body: {}", stream_error(&e)))?;
            }
        }
        OutgoingBody::finish(body, None).map_err(|e| format!("finishing request body: {e:?}"))
    }

    fn finish(pending: &FutureIncomingResponse) -> Verdict {
        pending.subscribe().block();
        let response = match pending.get() {
            Some(Ok(Ok(response))) => response,
            Some(Ok(Err(e))) => return network(&e),
            Some(Err(())) | None => return Verdict::Transient { reason: "no response".into(), retry_after_ms: None },
        };
        let status = response.status();
        let retry_after =
            response.headers().get("retry-after").first().map(|v| String::from_utf8_lossy(v).into_owned());
        let body = if (200..300).contains(&status) { Vec::new() } else { read_excerpt(&response) };
        policy::judge(status, retry_after.as_deref(), &body)
    }

    /// Up to a little more than the excerpt length of a failed answer's body.
    fn read_excerpt(response: &wasi::http::types::IncomingResponse) -> Vec<u8> {
        let Ok(body) = response.consume() else { return Vec::new() };
        let Ok(stream) = body.stream() else { return Vec::new() };
        let mut bytes = Vec::new();
        while bytes.len() < policy::BODY_EXCERPT * 4 {
            match stream.blocking_read(1024) {
                Ok(chunk) => bytes.extend(chunk),
                Err(_) => break,
            }
        }
        bytes
    }

    /// A request that did not get an HTTP answer: denied by the sandbox is permanent (it will not
    /// change until the configuration does), everything else (refused, timed out, DNS) transient.
    fn network(error: &ErrorCode) -> Verdict {
        let reason = format!("request failed: {error:?}");
        match error {
            ErrorCode::HttpRequestDenied | ErrorCode::HttpRequestUriInvalid => Verdict::Permanent { reason },
            _ => Verdict::Transient { reason, retry_after_ms: None },
        }
    }

    fn stream_error(error: &StreamError) -> String {
        match error {
            StreamError::LastOperationFailed(e) => e.to_debug_string(),
            StreamError::Closed => "stream closed".into(),
        }
    }

    fn now_seconds() -> u64 {
        wasi::clocks::wall_clock::now().seconds
    }
}

export!(HttpTransport);
