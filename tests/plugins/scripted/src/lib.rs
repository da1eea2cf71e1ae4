//! A test transport that does what each event's type tells it to, so tests can drive every
//! relay transition with a real wasm component:
//!
//! - `transient` → transient failure (retry-after from the `retry-after-ms` header, if any);
//! - `flaky` → transient failure on the first attempt, success afterwards;
//! - `transient-then-permanent` → transient failure on the first attempt, permanent afterwards;
//! - `permanent` → permanent failure;
//! - `trap` → panics, trapping the whole batch;
//! - `spin` → loops forever (the host must time it out);
//! - `count` → permanent failure whose reason is `call N`, N counting this instance's calls (to
//!   observe instance reuse and recycling);
//! - `hog` → allocates memory without bound (the host's memory limit must stop it);
//! - `connect` → opens a TCP connection to the address in the `addr` header: success if it
//!   connects, permanent failure with the error otherwise;
//! - `hoard` → opens TCP connections to the address in the `addr` header until one fails, holds
//!   them all for the `hold-ms` header (default 1000), then closes them; permanent failure saying
//!   how many it held and why the next one failed (to use up the host's open files);
//! - `http` → sends a wasi:http GET to `http://<authority header>/`: success on a 2xx answer,
//!   permanent failure with the status or the error otherwise;
//! - `env` → permanent failure whose reason is `env NAME=VALUE` (or `env NAME unset`) for the
//!   variable named by the `name` header, to observe what environment the plugin sees;
//! - `read` → reads the file named by the `path` header: success if it can, permanent failure
//!   with the error otherwise;
//! - `long-reason` → permanent failure whose reason is as many bytes as the `bytes` header says,
//!   starting with a newline and a forged log line, to test that reasons are bounded and escaped;
//! - `log` → logs the `message` header through ferry's logging import `times` times (default 1),
//!   then succeeds, to test that plugin log lines are bounded and cannot forge lines;
//! - `symlink` → makes a symbolic link at the `link` header's path pointing to the `target`
//!   header: success if it can, permanent failure with the error otherwise;
//! - `hardlink` → makes a hard link at the `to` header's path to the file at `from`: success if
//!   it can, permanent failure with the error otherwise;
//! - `fields` → makes the host hold `count` (header) wasi:http header `fields`, each with
//!   `headers` (header) values of 8 KiB, all kept alive; permanent failure with the number kept if
//!   the host lets it finish (its limits should trap it first);
//! - `defer` → deferred by the `delay-ms` header (default 1000) the first `times` (header,
//!   default 1) calls for the event in this instance, success afterwards; a deferral counts no
//!   attempt, so the event's `attempt` cannot tell the calls apart;
//! - `resolve` → looks up the `name` header `count` times (header, default 1) through
//!   wasi:sockets, dropping each lookup as soon as it is started, then once more waiting for the
//!   answer (trying again every 10 ms while the host says its resolver is busy); permanent
//!   failure whose reason is `refused R of N; then: ANSWER`, R the lookups the host refused at
//!   once and ANSWER the addresses or the error of the last one (to flood the host's resolver and
//!   see it hold);
//! - `http-flood` → starts `count` (header) wasi:http GETs, one to each of `0.DOMAIN`,
//!   `1.DOMAIN`, … (`domain` header), 100 at a time, giving each hundred a millisecond to start
//!   connecting before dropping them, then starts a wasi:sockets lookup of `localhost`;
//!   permanent failure whose reason is `started S of N; own lookup: L`, S the requests the host
//!   took and L `started` or the lookup's error (to flood the host's resolver through wasi:http's
//!   connections, and see whether they hold the plugin's lookup slots);
//! - `random` → asks the host for `bytes` (header) random bytes: success if it gets them;
//! - anything else → success.
//!
//! Config:
//! - `reject` — any value makes `init` fail, to test routes whose plugin refuses its config;
//! - `init` — `spin` loops forever in `init`, `sleep` sleeps a minute there (the host must time
//!   both out);
//! - `record` — a file (in a pre-opened directory) to which every successful delivery appends a
//!   line `id key attempt nanos` (nanos: wall-clock time of the call), so tests can count
//!   deliveries per event and check their order across instances;
//! - `delay_ms` — sleep this long in every call (before answering), to keep batches in flight;
//! - `answer` — treat every event as if its type were this (`transient`, `flaky`, …), so one
//!   route's destinations can answer the same event differently.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::sync::Mutex;
use std::time::Duration;

wit_bindgen::generate!({ path: "../../../wit", world: "transport-plugin" });

use exports::ferry::transport::transport::{Event, Guest, Outcome, PluginInfo};
use ferry::transport::types::{Deferral, Failure};

struct Settings {
    record: Option<File>,
    delay: Duration,
    answer: Option<String>,
}

/// Calls deferred so far, by event id (`defer`).
static DEFERRED: Mutex<std::collections::BTreeMap<u64, u32>> = Mutex::new(std::collections::BTreeMap::new());

static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

static SETTINGS: Mutex<Settings> = Mutex::new(Settings { record: None, delay: Duration::ZERO, answer: None });

struct Scripted;

impl Guest for Scripted {
    fn metadata() -> PluginInfo {
        PluginInfo { name: "scripted".into(), version: "0.1.0".into() }
    }

    fn init(config: Vec<(String, String)>) -> Result<(), String> {
        let mut settings = SETTINGS.lock().unwrap();
        for (key, value) in config {
            match key.as_str() {
                "reject" => return Err(format!("reject: told to refuse ({value})")),
                "init" if value == "spin" =>
                {
                    #[allow(clippy::empty_loop)]
                    loop {}
                }
                "init" if value == "sleep" => std::thread::sleep(Duration::from_secs(60)),
                "record" => {
                    let file = OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(&value)
                        .map_err(|e| format!("record: cannot open {value}: {e}"))?;
                    settings.record = Some(file);
                }
                "delay_ms" => {
                    let ms = value.parse().map_err(|_| format!("delay_ms: not a number: {value:?}"))?;
                    settings.delay = Duration::from_millis(ms);
                }
                "answer" => settings.answer = Some(value),
                other => return Err(format!("unknown config key {other:?}")),
            }
        }
        Ok(())
    }

    fn deliver_batch(events: Vec<Event>) -> Vec<Outcome> {
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if events.iter().any(|e| e.event_type == "trap") {
            panic!("scripted trap");
        }
        if events.iter().any(|e| e.event_type == "spin") {
            #[allow(clippy::empty_loop)]
            loop {}
        }
        if events.iter().any(|e| e.event_type == "hog") {
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                hoard.push(vec![1; 1 << 20]);
                std::hint::black_box(&hoard);
            }
        }
        let mut settings = SETTINGS.lock().unwrap();
        if !settings.delay.is_zero() {
            std::thread::sleep(settings.delay);
        }
        if events.iter().any(|e| e.event_type == "count") {
            let reason = format!("call {call}");
            return events
                .iter()
                .map(|_| Outcome::Permanent(Failure { reason: reason.clone(), retry_after_ms: None }))
                .collect();
        }
        let outcomes: Vec<Outcome> =
            events.iter().map(|e| outcome(e, settings.answer.as_deref().unwrap_or(&e.event_type))).collect();
        if let Some(file) = settings.record.as_mut() {
            let nanos =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
            let mut lines = String::new();
            for (event, outcome) in events.iter().zip(&outcomes) {
                if matches!(outcome, Outcome::Success) {
                    let key = event.ordering_key.as_deref().unwrap_or("-");
                    lines.push_str(&format!("{} {key} {} {nanos}\n", event.id, event.attempt));
                }
            }
            if let Err(e) = file.write_all(lines.as_bytes()) {
                let reason = format!("record: write failed: {e}");
                return events
                    .iter()
                    .map(|_| Outcome::Transient(Failure { reason: reason.clone(), retry_after_ms: None }))
                    .collect();
            }
        }
        outcomes
    }
}

/// What the plugin answers for `event`, told to behave as type `kind` says.
fn outcome(event: &Event, kind: &str) -> Outcome {
    let failure = |kind: &str| Failure {
        reason: format!("scripted {kind} failure of event {} (attempt {})", event.id, event.attempt),
        retry_after_ms: event.headers.iter().find(|(k, _)| k == "retry-after-ms").and_then(|(_, v)| v.parse().ok()),
    };
    let header = |name: &str| event.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()).unwrap_or_default();
    let refused = |what: String| Outcome::Permanent(Failure { reason: what, retry_after_ms: None });
    match kind {
        "connect" => match std::net::TcpStream::connect(header("addr")) {
            Ok(_) => Outcome::Success,
            Err(e) => refused(format!("connect {}: {e}", header("addr"))),
        },
        "hoard" => {
            let mut held = Vec::new();
            let error = loop {
                match std::net::TcpStream::connect(header("addr")) {
                    Ok(stream) => held.push(stream),
                    Err(e) => break e,
                }
            };
            std::thread::sleep(Duration::from_millis(header("hold-ms").parse().unwrap_or(1000)));
            refused(format!("held {} connections, then: {error}", held.len()))
        }
        "http" => match http_get(&header("authority")) {
            Ok(status) if (200..300).contains(&status) => Outcome::Success,
            Ok(status) => refused(format!("http {}: status {status}", header("authority"))),
            Err(e) => refused(format!("http {}: {e}", header("authority"))),
        },
        "resolve" => {
            let count: usize = header("count").parse().unwrap_or(1);
            let name = header("name");
            let refused_at_once = (0..count).filter(|_| resolve(&name, false).is_err()).count();
            let answer = loop {
                match resolve(&name, true) {
                    Ok(addrs) => break addrs,
                    Err(e) if e.contains("temporary-resolver-failure") => std::thread::sleep(Duration::from_millis(10)),
                    Err(e) => break format!("error {e}"),
                }
            };
            refused(format!("refused {refused_at_once} of {count}; then: {answer}"))
        }
        "http-flood" => {
            let count: usize = header("count").parse().unwrap_or(1);
            let domain = header("domain");
            let mut started = 0;
            for wave in (0..count).collect::<Vec<_>>().chunks(100) {
                let pending: Vec<_> = wave.iter().filter_map(|n| http_start(&format!("{n}.{domain}")).ok()).collect();
                started += pending.len();
                wasi::clocks::monotonic_clock::subscribe_duration(1_000_000).block();
            }
            let own = resolve("localhost", false).map_or_else(|e| e, |_| "started".to_string());
            refused(format!("started {started} of {count}; own lookup: {own}"))
        }
        "random" => {
            let bytes: u64 = header("bytes").parse().unwrap_or(1);
            let got = wasi::random::random::get_random_bytes(bytes);
            if got.len() as u64 == bytes {
                Outcome::Success
            } else {
                refused(format!("got {} random bytes", got.len()))
            }
        }
        "env" => match std::env::var(header("name")) {
            Ok(value) => refused(format!("env {}={value}", header("name"))),
            Err(_) => refused(format!("env {} unset", header("name"))),
        },
        "read" => match std::fs::read(header("path")) {
            Ok(_) => Outcome::Success,
            Err(e) => refused(format!("read {}: {e}", header("path"))),
        },
        "long-reason" => {
            let bytes: usize = header("bytes").parse().unwrap_or(1024);
            let forged = "\n2026-01-01T00:00:00Z ERROR ferry: forged line \u{1b}[31m";
            Outcome::Permanent(Failure { reason: format!("{forged}{}", "x".repeat(bytes)), retry_after_ms: None })
        }
        "log" => {
            for _ in 0..header("times").parse::<usize>().unwrap_or(1) {
                ferry::transport::logging::log(ferry::transport::logging::Level::Warn, &header("message"));
            }
            Outcome::Success
        }
        "symlink" => match symlink(&header("target"), &header("link")) {
            Ok(()) => Outcome::Success,
            Err(e) => refused(format!("symlink {} -> {}: {e}", header("link"), header("target"))),
        },
        "hardlink" => match std::fs::hard_link(header("from"), header("to")) {
            Ok(()) => Outcome::Success,
            Err(e) => refused(format!("hardlink {} -> {}: {e}", header("to"), header("from"))),
        },
        "fields" => {
            let kept = hoard_fields(header("headers").parse().unwrap_or(0), header("count").parse().unwrap_or(0));
            refused(format!("fields: kept {kept}"))
        }
        "defer" => {
            let mut deferred = DEFERRED.lock().unwrap();
            let count = deferred.entry(event.id).or_default();
            let times: u32 = header("times").parse().unwrap_or(1);
            if *count < times {
                *count += 1;
                Outcome::Deferred(Deferral {
                    reason: format!("defer {count}"),
                    delay_ms: header("delay-ms").parse().unwrap_or(1000),
                })
            } else {
                Outcome::Success
            }
        }
        "transient" => Outcome::Transient(failure("transient")),
        "flaky" if event.attempt == 1 => Outcome::Transient(failure("flaky")),
        "transient-then-permanent" if event.attempt == 1 => Outcome::Transient(failure("transient")),
        "transient-then-permanent" => Outcome::Permanent(failure("permanent")),
        "permanent" => Outcome::Permanent(failure("permanent")),
        _ => Outcome::Success,
    }
}

/// Makes a symbolic link at `link` (a path inside a pre-opened directory) pointing to `target`,
/// through wasi:filesystem itself: std has no stable way to make one on WASI.
fn symlink(target: &str, link: &str) -> Result<(), String> {
    for (dir, guest) in wasi::filesystem::preopens::get_directories() {
        if let Some(inside) = link.strip_prefix(guest.as_str()).and_then(|rest| rest.strip_prefix('/')) {
            return dir.symlink_at(target, inside).map_err(|e| e.name().to_string());
        }
    }
    Err(format!("{link} is in no pre-opened directory"))
}

/// Makes the host hold `count` `fields` resources with `headers` values of 8 KiB each, copied
/// from one buffer: it costs the plugin 8 KiB and a handle per `fields`, and the host the whole
/// size. Returns how many it kept.
fn hoard_fields(headers: usize, count: usize) -> usize {
    use wasi::http::types::Fields;
    let value = vec![b'x'; 8 << 10];
    let mut kept = Vec::with_capacity(count);
    for _ in 0..count {
        let fields = Fields::new();
        for i in 0..headers {
            let _ = fields.append(&format!("x-pad-{i}"), &value);
        }
        kept.push(fields);
    }
    kept.len()
}

/// Looks `name` up through wasi:sockets: without `wait`, only starts the lookup (an error is a
/// refusal at once) and drops it; with it, waits for the addresses, listed with commas.
fn resolve(name: &str, wait: bool) -> Result<String, String> {
    use wasi::sockets::{instance_network, ip_name_lookup};
    let network = instance_network::instance_network();
    let lookup = ip_name_lookup::resolve_addresses(&network, name).map_err(|e| format!("{e:?}"))?;
    if !wait {
        return Ok(String::new());
    }
    let mut addrs = Vec::new();
    loop {
        match lookup.resolve_next_address() {
            Ok(Some(addr)) => addrs.push(format!("{addr:?}")),
            Ok(None) => return Ok(addrs.join(",")),
            Err(ip_name_lookup::ErrorCode::WouldBlock) => lookup.subscribe().block(),
            Err(e) => return Err(format!("{e:?}")),
        }
    }
}

/// A plain wasi:http GET of `http://{authority}/`, returning the status code.
fn http_get(authority: &str) -> Result<u16, String> {
    let pending = http_start(authority)?;
    pending.subscribe().block();
    let response =
        pending.get().ok_or("no response")?.map_err(|()| "response taken twice")?.map_err(|e| format!("{e:?}"))?;
    Ok(response.status())
}

/// Hands a wasi:http GET of `http://{authority}/` to the host.
fn http_start(authority: &str) -> Result<wasi::http::types::FutureIncomingResponse, String> {
    use wasi::http::outgoing_handler;
    use wasi::http::types::{Fields, Method, OutgoingRequest, Scheme};
    let request = OutgoingRequest::new(Fields::new());
    request.set_method(&Method::Get).map_err(|()| "bad method")?;
    request.set_scheme(Some(&Scheme::Http)).map_err(|()| "bad scheme")?;
    request.set_authority(Some(authority)).map_err(|()| format!("bad authority {authority:?}"))?;
    request.set_path_with_query(Some("/")).map_err(|()| "bad path")?;
    outgoing_handler::handle(request, None).map_err(|e| format!("{e:?}"))
}

export!(Scripted);
