//! OpenTelemetry traces over OTLP/HTTP: `ferry serve` sends a trace per batch (claim → deliver →
//! record under one batch span) to a collector, here a local HTTP server that keeps what it is
//! posted; and a collector that is down costs the relay nothing.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry::NewEvent;
use ferry::clock::{Clock, SystemClock};
use ferry::event::Status;
use serde_json::Value;

use crate::common::{Backend, Reaped, TestDb, eventually, plugins_dir, spawn_serve};

/// A stand-in collector: an HTTP server on a free port that keeps the JSON body of every POST to
/// `/v1/traces`.
async fn collector() -> (u16, Arc<Mutex<Vec<Value>>>) {
    let posts: Arc<Mutex<Vec<Value>>> = Arc::default();
    let kept = posts.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let kept = kept.clone();
            async move {
                assert_eq!(headers["content-type"], "application/json");
                kept.lock().unwrap().push(serde_json::from_slice(&body).expect("an OTLP/JSON body"));
                "{}"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, posts)
}

fn config(db: &TestDb, endpoint: &str) -> std::path::PathBuf {
    config_with(db, endpoint, "")
}

/// [`config`] with `routes` (TOML) besides route `s`.
fn config_with(db: &TestDb, endpoint: &str, routes: &str) -> std::path::PathBuf {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let path = db.dir.path().join("ferry.toml");
    let text = format!(
        r#"
        [database]
        url = {:?}
        [relay]
        poll_interval = "20ms"
        [telemetry]
        otlp_endpoint = {endpoint:?}
        service_name = "billing-relay"
        [plugins]
        dir = {plugins:?}
        [route.s]
        plugin = "scripted"
        {routes}
        "#,
        db.url
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Every span the collector was sent, with the resource attributes of its request.
fn spans(posts: &Mutex<Vec<Value>>) -> Vec<(Value, Value)> {
    let mut spans = Vec::new();
    for post in posts.lock().unwrap().iter() {
        for resource in post["resourceSpans"].as_array().unwrap() {
            for scope in resource["scopeSpans"].as_array().unwrap() {
                for span in scope["spans"].as_array().unwrap() {
                    spans.push((resource["resource"].clone(), span.clone()));
                }
            }
        }
    }
    spans
}

fn attribute<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    let attribute = span["attributes"].as_array()?.iter().find(|a| a["key"] == key)?;
    attribute["value"].get("stringValue").or_else(|| attribute["value"].get("intValue"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_exports_a_trace_per_batch_over_otlp() {
    let db = TestDb::new(Backend::Sqlite).await;
    let (port, posts) = collector().await;
    let config = config(&db, &format!("http://127.0.0.1:{port}"));
    // Written before ferry starts, so one batch holds them all.
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let now = SystemClock.now();
    let traced =
        db.store.insert(&NewEvent::new("s", "ok", "{}").with_header("traceparent", parent), now).await.unwrap();
    let plain = db.store.insert(&NewEvent::new("s", "ok", "{}"), now).await.unwrap();
    let failing = db.store.insert(&NewEvent::new("s", "permanent", "{}"), now).await.unwrap();
    let log = db.dir.path().join("serve.log");
    let mut serve = Reaped(spawn_serve(&config, &log));
    eventually(Duration::from_secs(60), "the events delivered", || async {
        let done = [traced, plain, failing];
        let mut statuses = Vec::new();
        for id in done {
            statuses.push(db.store.get(id).await.unwrap().unwrap().status);
        }
        (statuses == [Status::Sent, Status::Sent, Status::Failed]).then_some(())
    })
    .await;
    // Stopping flushes the spans still queued.
    assert!(std::process::Command::new("kill").args(["-TERM", &serve.0.id().to_string()]).status().unwrap().success());
    let exit = serve.0.wait().unwrap();
    assert!(exit.success(), "{}", std::fs::read_to_string(&log).unwrap());

    let spans = spans(&posts);
    let named = |name: &str| spans.iter().filter(|(_, s)| s["name"] == name).map(|(_, s)| s).collect::<Vec<_>>();
    let batches = named("ferry.batch");
    assert_eq!(batches.len(), 1, "one batch claimed the three events: {spans:#?}");
    let batch = batches[0];
    let (resource, _) = &spans[0];
    let service = resource["attributes"].as_array().unwrap().iter().find(|a| a["key"] == "service.name").unwrap();
    assert_eq!(service["value"]["stringValue"], "billing-relay");
    assert_eq!(batch["parentSpanId"], "", "the batch span is the trace's root");
    assert_eq!(attribute(batch, "ferry.claimed"), Some(&Value::from("3")));
    assert_eq!(attribute(batch, "ferry.sent"), Some(&Value::from("2")));
    assert_eq!(attribute(batch, "ferry.failed"), Some(&Value::from("1")));
    let trace = batch["traceId"].as_str().unwrap();
    assert_eq!(trace.len(), 32);
    for name in ["ferry.claim", "ferry.deliver", "ferry.record"] {
        let children = named(name);
        assert_eq!(children.len(), 1, "{name}: {spans:#?}");
        assert_eq!(children[0]["traceId"], trace, "{name} is in the batch's trace");
        assert_eq!(children[0]["parentSpanId"], batch["spanId"], "{name} is a child of the batch");
        let (start, end) = (&children[0]["startTimeUnixNano"], &children[0]["endTimeUnixNano"]);
        let nanos = |v: &Value| v.as_str().unwrap().parse::<u128>().unwrap();
        assert!(nanos(start) <= nanos(end), "{name}: {start} .. {end}");
        assert!(nanos(&batch["startTimeUnixNano"]) <= nanos(start), "{name} starts within the batch");
    }
    assert_eq!(attribute(named("ferry.claim")[0], "db.system"), Some(&Value::from("sqlite")));
    assert_eq!(attribute(named("ferry.record")[0], "ferry.written"), Some(&Value::from("3")));
    let deliver = named("ferry.deliver")[0];
    assert_eq!(attribute(deliver, "ferry.route"), Some(&Value::from("s")));
    assert_eq!(attribute(deliver, "ferry.plugin"), Some(&Value::from("scripted")));
    assert_eq!(attribute(deliver, "messaging.batch.message_count"), Some(&Value::from("3")));
    assert_eq!(deliver["kind"], 4, "a producer span");
    assert_eq!(deliver["status"]["code"], 2, "an event failed");
    assert!(deliver["status"]["message"].as_str().unwrap().contains("permanent"), "{deliver}");
    // The event that carried a traceparent: the delivery links to its trace.
    let links = deliver["links"].as_array().unwrap();
    assert_eq!(links.len(), 1, "{links:?}");
    assert_eq!(links[0]["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(links[0]["spanId"], "00f067aa0ba902b7");
}

/// A batch whose slow route's delivery goes on past its cycle (see the relay's step-aside) is
/// still one trace: one claim, each part's call and write of outcomes, and the root, sent last,
/// counting both parts and ending with the later write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_recorded_in_two_parts_is_one_trace() {
    let db = TestDb::new(Backend::Sqlite).await;
    let (port, posts) = collector().await;
    let slow = "[route.slow]\nplugin = \"scripted\"\nconfig = { delay_ms = \"2000\" }";
    let config = config_with(&db, &format!("http://127.0.0.1:{port}"), slow);
    // Written before ferry starts, so one batch holds both.
    let now = SystemClock.now();
    let ids = [
        db.store.insert(&NewEvent::new("s", "ok", "{}"), now).await.unwrap(),
        db.store.insert(&NewEvent::new("slow", "ok", "{}"), now).await.unwrap(),
    ];
    let log = db.dir.path().join("serve.log");
    let mut serve = Reaped(spawn_serve(&config, &log));
    eventually(Duration::from_secs(60), "both events delivered", || async {
        for id in ids {
            if db.store.get(id).await.unwrap().unwrap().status != Status::Sent {
                return None;
            }
        }
        Some(())
    })
    .await;
    assert!(std::process::Command::new("kill").args(["-TERM", &serve.0.id().to_string()]).status().unwrap().success());
    assert!(serve.0.wait().unwrap().success(), "{}", std::fs::read_to_string(&log).unwrap());

    let spans = spans(&posts);
    let named = |name: &str| spans.iter().filter(|(_, s)| s["name"] == name).map(|(_, s)| s).collect::<Vec<_>>();
    let batches = named("ferry.batch");
    assert_eq!(batches.len(), 1, "one batch, one trace: {spans:#?}");
    let batch = batches[0];
    assert_eq!(
        (attribute(batch, "ferry.claimed"), attribute(batch, "ferry.sent")),
        (Some(&"2".into()), Some(&"2".into()))
    );
    let nanos = |v: &Value| v.as_str().unwrap().parse::<u128>().unwrap();
    for (name, parts) in [("ferry.claim", 1), ("ferry.deliver", 2), ("ferry.record", 2)] {
        let children = named(name);
        assert_eq!(children.len(), parts, "{name}: {spans:#?}");
        for child in children {
            assert_eq!((&child["traceId"], &child["parentSpanId"]), (&batch["traceId"], &batch["spanId"]), "{name}");
            assert!(
                nanos(&child["endTimeUnixNano"]) <= nanos(&batch["endTimeUnixNano"]),
                "{name} ends within the batch"
            );
        }
    }
    let written: Vec<_> = named("ferry.record").iter().map(|r| attribute(r, "ferry.written").cloned()).collect();
    assert_eq!(written, [Some("1".into()), Some("1".into())], "the fast route's part, then the slow one's");
    let span = *spans.iter().map(|(_, s)| s).collect::<Vec<_>>().last().unwrap();
    assert_eq!(span["name"], "ferry.batch", "the root goes last, once both parts are written");
}

/// Runs `ferry serve` exporting to `endpoint`, emits 20 events over a second and waits for them
/// all to be SENT.
async fn delivers_while_exporting_to(endpoint: &str) {
    let db = TestDb::new(Backend::Sqlite).await;
    let config = config(&db, endpoint);
    let _serve = Reaped(spawn_serve(&config, &db.dir.path().join("serve.log")));
    let mut ids = Vec::new();
    for _ in 0..20 {
        ids.push(db.store.insert(&NewEvent::new("s", "ok", "{}"), SystemClock.now()).await.unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eventually(Duration::from_secs(60), "every event delivered", || async {
        for id in &ids {
            if db.store.get(*id).await.unwrap().unwrap().status != Status::Sent {
                return None;
            }
        }
        Some(())
    })
    .await;
}

/// A collector that refuses connections: events are delivered as without one, and the log says
/// so at most once a minute, though every second's export fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_does_not_hold_up_delivery() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let db = TestDb::new(Backend::Sqlite).await;
    let config = config(&db, &format!("http://127.0.0.1:{port}"));
    let log = db.dir.path().join("serve.log");
    let _serve = Reaped(spawn_serve(&config, &log));
    let delivered = |id: i64| {
        let db = &db;
        async move { (db.store.get(id).await.unwrap().unwrap().status == Status::Sent).then_some(()) }
    };
    let warning = "traces not exported (dropped)";
    for n in 0..4 {
        let id = db.store.insert(&NewEvent::new("s", "ok", "{}"), SystemClock.now()).await.unwrap();
        eventually(Duration::from_secs(30), "the event delivered", || delivered(id)).await;
        if n == 0 {
            eventually(Duration::from_secs(30), "the first failed export said", || async {
                std::fs::read_to_string(&log).unwrap().contains(warning).then_some(())
            })
            .await;
        }
        // More than a flush interval apart: each batch's spans are an export of their own.
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.matches(warning).count(), 1, "once, though four exports failed: {text}");
}

/// A collector that takes connections and never answers: the exporter waits for it, the relay
/// does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_never_answers_does_not_hold_up_delivery() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            open.push(stream);
        }
    });
    let started = std::time::Instant::now();
    delivers_while_exporting_to(&format!("http://127.0.0.1:{port}")).await;
    assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
    held.abort();
}
