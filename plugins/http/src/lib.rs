//! The `http` transport: sends events to the route's webhook URL through wasi:http, one request
//! per event or (CloudEvents batched mode) many, signed the Standard Webhooks way, several
//! requests at once.
//!
//! Route configuration:
//! - `url` (required) — `http://` or `https://` endpoint; its origin must be in the plugin's
//!   `sandbox.http.http` allowlist;
//! - `method` — default `POST`;
//! - `secret` — signing secret (`whsec_<base64>` or raw text); without it nothing is signed;
//! - `secret_previous` — a second secret during rotation: both signatures are sent;
//! - `timeout_ms` — per request (connect, first byte, between bytes), default 10000;
//! - `concurrency` — requests in flight at once within a batch, default 8;
//! - `header.NAME` — a static header added to every request;
//! - `cloudevents` — `binary`: CloudEvents 1.0 attributes as `ce-` headers, the payload as the
//!   body; `structured`: one `application/cloudevents+json` body holding attributes and payload;
//!   `batched`: one `application/cloudevents-batch+json` body, a JSON array of structured events,
//!   carrying up to `batch_size` events; absent: plain webhooks;
//! - `batch_size` — with `batched`, most events in one request, default 100 (at most 10000);
//! - `batch_bytes` — with `batched`, most bytes in one request's body, default 1048576 (1024 to
//!   16777216); an event whose envelope alone is larger goes in a request of its own;
//! - `cloudevents_source` — the CloudEvents `source`, default `/ferry/ROUTE`;
//! - `rate_limited` — what a 429 answer does: `defer` (default) the event, and the rest of the
//!   batch without sending it, by `Retry-After` (else 5 s), no attempt counted; or `retry` it as a
//!   transient failure.
//!
//! Each request for one event carries the payload as its body, the event's content type and
//! headers, and `webhook-id` (the event id, stable across retries), `webhook-timestamp` and, when
//! a secret is set, `webhook-signature`. Headers the request sets itself ([`policy::set_by_request`]) are the
//! request's alone: an event's of the same name are left out, and `header.NAME` may not give them.
//! Answers map to outcomes as in [`policy::judge`].
//!
//! A batched request carries no event's headers: each envelope holds its event's `traceparent`
//! and `tracestate` as the CloudEvents tracing extension's attributes, and the request the
//! route's `header.NAME` values. Its `webhook-id` is made from the ids of the events it carries,
//! whatever their order ([`policy::batch_id`]), so a retry of the same events has the same one;
//! receivers deduplicate by each envelope's `id`. The one answer is every carried event's
//! outcome, but for a refusal of several events (400, 413 or 422: an answer about the body): those
//! are sent again each in an array of its own, so that an event the receiver cannot take fails
//! alone.

pub mod policy;

use ferry_plugin_sdk::cloudevents::{CloudEvents, Mode};
use ferry_plugin_sdk::outcome::{deferred, permanent, success, transient_after};
use ferry_plugin_sdk::{Config, Event, Outcome, Transport, log};
use policy::{Target, Verdict};

/// One instance's configuration.
struct Settings {
    target: Target,
    method: String,
    secrets: Vec<Vec<u8>>,
    timeout_ns: u64,
    concurrency: usize,
    headers: Vec<(String, String)>,
    cloudevents: Option<CloudEvents>,
    /// In batched mode, how many events and bytes one request may carry.
    batch: Option<policy::BatchLimits>,
    /// What a 429 answer becomes: a deferral (no attempt counted; `rate_limited = "defer"`, the
    /// default) or a transient failure (`"retry"`).
    defer_rate_limited: bool,
}

/// How long a 429 without `Retry-After` defers the event.
const RATE_LIMITED_DELAY_MS: u64 = 5_000;

impl Transport for Settings {
    const NAME: &'static str = "http";

    fn init(config: &mut Config) -> Result<Settings, String> {
        let target = policy::parse_url(&config.required("url")?)?;
        let method = config.optional("method").unwrap_or_else(|| "POST".into()).to_ascii_uppercase();
        let mut secrets = Vec::new();
        if let Some(secret) = config.optional("secret") {
            secrets.push(policy::secret_bytes(&secret)?);
        }
        if let Some(previous) = config.optional("secret_previous") {
            if secrets.is_empty() {
                return Err("secret_previous: needs secret as well".into());
            }
            secrets.push(policy::secret_bytes(&previous)?);
        }
        let timeout_ms = config.positive_or("timeout_ms", 10_000)?;
        let concurrency = usize::try_from(config.positive_or("concurrency", 8)?).unwrap_or(usize::MAX);
        let headers: Vec<(String, String)> =
            config.prefixed("header.").into_iter().map(|(name, value)| (name.to_ascii_lowercase(), value)).collect();
        let cloudevents = CloudEvents::from_config(config, &[Mode::Binary, Mode::Structured, Mode::Batched])?;
        let batched = cloudevents.as_ref().is_some_and(|ce| ce.mode == Mode::Batched);
        let batch = match (config.optional("batch_size"), config.optional("batch_bytes")) {
            (sized, bytes) if batched => Some(policy::BatchLimits::parse(sized.as_deref(), bytes.as_deref())?),
            (Some(_), _) => return Err("batch_size: only with cloudevents = \"batched\"".into()),
            (None, Some(_)) => return Err("batch_bytes: only with cloudevents = \"batched\"".into()),
            (None, None) => None,
        };
        let binary = cloudevents.as_ref().is_some_and(|ce| ce.mode == Mode::Binary);
        if let Some((name, _)) = headers.iter().find(|(name, _)| policy::set_by_request(name, binary)) {
            return Err(format!("header.{name}: each request sets this header itself; leave it out"));
        }
        let defer_rate_limited = match config.optional("rate_limited").as_deref() {
            None | Some("defer") => true,
            Some("retry") => false,
            Some(other) => return Err(format!("rate_limited: {other:?} is neither \"defer\" nor \"retry\"")),
        };
        log::info(&format!("delivering to {}{}", target.authority, target.path_and_query));
        let timeout_ns = timeout_ms.saturating_mul(1_000_000);
        Ok(Settings {
            target,
            method,
            secrets,
            timeout_ns,
            concurrency,
            headers,
            cloudevents,
            batch,
            defer_rate_limited,
        })
    }

    fn deliver(&mut self, events: Vec<Event>) -> Vec<Outcome> {
        let mut outcomes = Vec::with_capacity(events.len());
        // Set once the receiver answered 429 and deferring is on: the rest of the batch is
        // deferred as long, unsent, rather than pressed on a receiver that asked to wait.
        let mut told_to_wait: Option<(String, u64)> = None;
        // Composed a chunk at a time, so only the bodies in flight are in memory at once.
        let mut requests = send::compose(self, &events, self.batch);
        loop {
            if let Some(wait) = &told_to_wait {
                outcomes.extend(unsent(wait, events.len() - outcomes.len()));
                break;
            }
            let chunk: Vec<send::Request<'_>> = requests.by_ref().take(self.concurrency).collect();
            if chunk.is_empty() {
                break;
            }
            let verdicts = send::all(self, &chunk);
            // A 429 anywhere in the chunk holds back what would be sent again below.
            for verdict in &verdicts {
                self.note_wait(verdict, &mut told_to_wait);
            }
            // A receiver that refuses an array may be refusing one envelope in it (or its size):
            // the events of each refused request of several are sent again each by itself, all
            // of the chunk's together, so that a bad event fails alone rather than with every
            // event it travelled with.
            let refused: Vec<&[Event]> = chunk
                .iter()
                .zip(&verdicts)
                .filter(|(request, verdict)| matches!(verdict, Verdict::Refused { .. }) && request.events.len() > 1)
                .map(|(request, _)| request.events)
                .collect();
            let mut alone = self.one_by_one(&refused, &mut told_to_wait).into_iter();
            for (request, verdict) in chunk.iter().zip(verdicts) {
                match verdict {
                    Verdict::Refused { .. } if request.events.len() > 1 => {
                        outcomes.extend(alone.by_ref().take(request.events.len()));
                    }
                    // A batched request's one answer is the outcome of every event it carried.
                    verdict => {
                        let outcome = self.outcome(verdict);
                        outcomes.extend(std::iter::repeat_n(outcome, request.events.len()));
                    }
                }
            }
        }
        outcomes
    }
}

/// The outcomes of `count` events left unsent because the receiver asked to wait.
fn unsent((reason, delay): &(String, u64), count: usize) -> impl Iterator<Item = Outcome> + '_ {
    (0..count).map(move |_| deferred(format!("not sent: {reason}"), *delay))
}

impl Settings {
    /// Keeps the first 429's reason and wait in `told_to_wait`, when 429s defer.
    fn note_wait(&self, verdict: &Verdict, told_to_wait: &mut Option<(String, u64)>) {
        if let Verdict::RateLimited { reason, retry_after_ms } = verdict
            && self.defer_rate_limited
        {
            told_to_wait.get_or_insert_with(|| (reason.clone(), retry_after_ms.unwrap_or(RATE_LIMITED_DELAY_MS)));
        }
    }

    /// The outcome `verdict` makes for each event it answers.
    fn outcome(&self, verdict: Verdict) -> Outcome {
        match verdict {
            Verdict::Success => success(),
            Verdict::Transient { reason, retry_after_ms } => transient_after(reason, retry_after_ms),
            Verdict::Permanent { reason } | Verdict::Refused { reason } => permanent(reason),
            Verdict::RateLimited { reason, retry_after_ms } if self.defer_rate_limited => {
                deferred(reason, retry_after_ms.unwrap_or(RATE_LIMITED_DELAY_MS))
            }
            Verdict::RateLimited { reason, retry_after_ms } => transient_after(reason, retry_after_ms),
        }
    }

    /// The events of `refused` requests sent again, each in an array of its own, `concurrency`
    /// at a time: one outcome each, in order. Once the receiver asks to wait (`told_to_wait`,
    /// perhaps already set), the rest are deferred unsent.
    fn one_by_one(&self, refused: &[&[Event]], told_to_wait: &mut Option<(String, u64)>) -> Vec<Outcome> {
        let total: usize = refused.iter().map(|events| events.len()).sum();
        let alone = policy::BatchLimits { events: 1, bytes: policy::BatchLimits::MAX_BYTES };
        let mut singles = refused.iter().flat_map(|events| send::compose(self, events, Some(alone)));
        let mut outcomes = Vec::with_capacity(total);
        loop {
            if let Some(wait) = told_to_wait.as_ref() {
                outcomes.extend(unsent(wait, total - outcomes.len()));
                break;
            }
            let chunk: Vec<send::Request<'_>> = singles.by_ref().take(self.concurrency).collect();
            if chunk.is_empty() {
                break;
            }
            for verdict in send::all(self, &chunk) {
                self.note_wait(&verdict, told_to_wait);
                outcomes.push(self.outcome(verdict));
            }
        }
        outcomes
    }
}

ferry_plugin_sdk::transport!(Settings);

mod send {
    //! The wasi:http side: start every request of a chunk, then wait for all answers.

    use std::borrow::Cow;

    use ferry_plugin_sdk::cloudevents::{CloudEvents, Mode};
    use wasi::http::outgoing_handler::{self, FutureIncomingResponse};
    use wasi::http::types::{ErrorCode, Fields, Method, OutgoingBody, OutgoingRequest, RequestOptions, Scheme};
    use wasi::io::streams::{OutputStream, StreamError};

    use super::Settings;
    use super::policy::{self, Verdict};
    use ferry_plugin_sdk::Event;

    /// One request: the events it carries (one, or in batched mode up to the route's limits) and
    /// its body.
    pub struct Request<'a> {
        pub events: &'a [Event],
        body: Cow<'a, [u8]>,
    }

    /// The requests that deliver `events`, in order, made as they are asked for: one per event,
    /// or in batched mode (`batch` set: the route's limits, or others to split a refused request)
    /// as few as those limits allow, each carrying a run of consecutive events.
    pub fn compose<'s, 'a>(
        settings: &'s Settings,
        events: &'a [Event],
        batch: Option<policy::BatchLimits>,
    ) -> Compose<'s, 'a> {
        let batcher = settings.cloudevents.as_ref().filter(|ce| ce.mode == Mode::Batched).and(batch);
        Compose { settings, events, added: 0, taken: 0, batcher: batcher.map(policy::Batcher::new) }
    }

    /// The requests of [`compose`], made one at a time.
    pub struct Compose<'s, 'a> {
        settings: &'s Settings,
        events: &'a [Event],
        /// Events whose envelope the batcher has.
        added: usize,
        /// Events in the requests made so far.
        taken: usize,
        batcher: Option<policy::Batcher>,
    }

    impl<'a> Iterator for Compose<'_, 'a> {
        type Item = Request<'a>;

        fn next(&mut self) -> Option<Request<'a>> {
            let events: &'a [Event] = self.events;
            let Some(batcher) = self.batcher.as_mut() else {
                let event = events.get(self.taken)?;
                self.taken += 1;
                return Some(Request { events: std::slice::from_ref(event), body: body_of(self.settings, event) });
            };
            let ce = self.settings.cloudevents.as_ref()?;
            // Each envelope goes into its request's body as it is made, so the bodies being sent
            // are the only copy of the events besides the events themselves.
            let done = loop {
                let Some(event) = events.get(self.added) else { break batcher.finish() };
                self.added += 1;
                if let Some(done) = batcher.add(&envelope(ce, event)) {
                    break Some(done);
                }
            };
            let (body, count) = done?;
            let carried = events.get(self.taken..self.taken + count)?;
            self.taken += count;
            Some(Request { events: carried, body: Cow::Owned(body) })
        }
    }

    /// `event` as a structured CloudEvent for a batch, with the CloudEvents tracing extension's
    /// attributes: the trace context a request for several events cannot carry as headers.
    fn envelope(ce: &CloudEvents, event: &Event) -> Vec<u8> {
        let mut attributes = ce.attributes(event);
        for (name, value) in &event.headers {
            for traced in ["traceparent", "tracestate"] {
                if name.eq_ignore_ascii_case(traced) && !attributes.iter().any(|(n, _)| *n == traced) {
                    attributes.push((traced, value.clone()));
                }
            }
        }
        policy::structured(&attributes, &event.content_type, &event.payload)
    }

    /// Sends `requests` concurrently and returns one verdict each, in order: every request is
    /// started first (connections open in parallel), then the bodies not written yet are written,
    /// then the answers collected.
    pub fn all(settings: &Settings, requests: &[Request<'_>]) -> Vec<Verdict> {
        let started: Vec<Result<(FutureIncomingResponse, Option<Unwritten>), Verdict>> =
            requests.iter().map(|request| start(settings, request)).collect();
        let sent: Vec<Result<FutureIncomingResponse, Verdict>> = started
            .into_iter()
            .zip(requests)
            .map(|(pending, request)| {
                let (response, rest) = pending?;
                let Some(rest) = rest else { return Ok(response) };
                match write_body(rest, &request.body) {
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

    /// What a request for one event carries: the payload, or in CloudEvents structured mode the
    /// envelope.
    fn body_of<'a>(settings: &Settings, event: &'a Event) -> Cow<'a, [u8]> {
        match &settings.cloudevents {
            Some(ce) if ce.mode == Mode::Structured => {
                Cow::Owned(policy::structured(&ce.attributes(event), &event.content_type, &event.payload))
            }
            _ => Cow::Borrowed(&event.payload),
        }
    }

    /// Hands `request` to the host with as much of its body as the body stream takes at once;
    /// what is left is returned, to be written once every request is started.
    fn start(
        settings: &Settings,
        request: &Request<'_>,
    ) -> Result<(FutureIncomingResponse, Option<Unwritten>), Verdict> {
        let body: &[u8] = &request.body;
        let timestamp = now_seconds();
        let headers = Fields::new();
        let add = |name: &str, value: &str| {
            headers
                .append(name, value.as_bytes())
                .map_err(|e| Verdict::Permanent { reason: format!("header {name:?} cannot be sent: {e:?}") })
        };
        let batched = settings.cloudevents.as_ref().is_some_and(|ce| ce.mode == Mode::Batched);
        let (id, event_headers) = match request.events {
            events if batched => {
                add("content-type", "application/cloudevents-batch+json")?;
                (policy::batch_id(events.iter().map(|e| e.id.to_string())), &[][..])
            }
            [event] => {
                match &settings.cloudevents {
                    Some(ce) if ce.mode == Mode::Structured => add("content-type", "application/cloudevents+json")?,
                    Some(ce) => {
                        add("content-type", &event.content_type)?;
                        for (name, value) in ce.attributes(event) {
                            add(&format!("ce-{name}"), &policy::header_value(&value))?;
                        }
                    }
                    None => add("content-type", &event.content_type)?,
                }
                (event.id.to_string(), event.headers.as_slice())
            }
            _ => return Err(Verdict::Permanent { reason: "a request carries one event unless batched".into() }),
        };
        // A known length lets the body go out in one piece rather than chunked.
        add("content-length", &body.len().to_string())?;
        // The event's headers of the names the request sets itself are left out.
        let binary = settings.cloudevents.as_ref().is_some_and(|ce| ce.mode == Mode::Binary);
        let own = |(name, _): &&(String, String)| policy::set_by_request(name, binary);
        for (name, value) in event_headers.iter().filter(|h| !own(h)).chain(&settings.headers) {
            add(name, value)?;
        }
        add("webhook-id", &id)?;
        add("webhook-timestamp", &timestamp.to_string())?;
        if !settings.secrets.is_empty() {
            add("webhook-signature", &policy::signature_header(&settings.secrets, &id, timestamp, body))?;
        }
        let outgoing_request = OutgoingRequest::new(headers);
        let method = match settings.method.as_str() {
            "POST" => Method::Post,
            "PUT" => Method::Put,
            "PATCH" => Method::Patch,
            other => Method::Other(other.to_string()),
        };
        let bad = |what: &str| Verdict::Permanent { reason: format!("invalid request: {what}") };
        outgoing_request.set_method(&method).map_err(|()| bad("method"))?;
        let scheme = if settings.target.https { Scheme::Https } else { Scheme::Http };
        outgoing_request.set_scheme(Some(&scheme)).map_err(|()| bad("scheme"))?;
        outgoing_request.set_authority(Some(&settings.target.authority)).map_err(|()| bad("authority"))?;
        outgoing_request.set_path_with_query(Some(&settings.target.path_and_query)).map_err(|()| bad("path"))?;
        let options = RequestOptions::new();
        let _ = options.set_connect_timeout(Some(settings.timeout_ns));
        let _ = options.set_first_byte_timeout(Some(settings.timeout_ns));
        let _ = options.set_between_bytes_timeout(Some(settings.timeout_ns));
        let outgoing = outgoing_request.body().map_err(|()| bad("body"))?;
        let stream = outgoing.write().map_err(|()| bad("body stream"))?;
        // As much of the body as the stream takes without waiting (the host's buffer: 16 KiB in
        // ferry) is written before the request is handed over, so that it goes out with the head
        // in one write (one packet, for a small body) rather than in a write of its own after it,
        // which the receiver would read separately.
        let room = stream.check_write().map_or(0, |room| usize::try_from(room).unwrap_or(usize::MAX));
        let written = room.min(body.len());
        if written > 0 {
            stream.write(&body[..written]).map_err(|e| Verdict::Transient {
                reason: format!("writing request body: {}", stream_error(&e)),
                retry_after_ms: None,
            })?;
        }
        let rest = if written == body.len() {
            let _ = stream.flush();
            drop(stream);
            // A failure here shows in the answer (the request is aborted).
            let _ = OutgoingBody::finish(outgoing, None);
            None
        } else {
            Some(Unwritten { stream, body: outgoing, written })
        };
        let response = outgoing_handler::handle(outgoing_request, Some(options)).map_err(|e| network(&e))?;
        Ok((response, rest))
    }

    /// A request body not written in full when its request was handed over: its stream, and how
    /// much of the payload went into it. The stream is a child of the body and must go first
    /// (dropping a body whose stream is still open traps), hence the order of the fields, which
    /// is the order they are dropped in.
    struct Unwritten {
        stream: OutputStream,
        body: OutgoingBody,
        written: usize,
    }

    /// Writes the rest of `payload` into its request body, and finishes the body.
    fn write_body(unwritten: Unwritten, payload: &[u8]) -> Result<(), String> {
        let Unwritten { stream, body, written } = unwritten;
        let wrote = payload[written..].chunks(4096).try_for_each(|chunk| {
            stream.blocking_write_and_flush(chunk).map_err(|e| format!("writing request body: {}", stream_error(&e)))
        });
        // The stream goes before its body, whether or not the writes failed.
        drop(stream);
        wrote?;
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
    /// change until the configuration does), and so is an answer whose headers are larger than
    /// the host reads (the receiver's answer will not shrink by itself); everything else (refused,
    /// timed out, DNS) transient.
    fn network(error: &ErrorCode) -> Verdict {
        let reason = format!("request failed: {error:?}");
        match error {
            ErrorCode::HttpRequestDenied
            | ErrorCode::HttpRequestUriInvalid
            | ErrorCode::DestinationIpProhibited
            | ErrorCode::HttpResponseHeaderSectionSize(_) => Verdict::Permanent { reason },
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
