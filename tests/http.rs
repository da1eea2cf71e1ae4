//! The `http` webhook plugin, compiled from `plugins/http`, against a real HTTP server: what is
//! sent (body, headers, Standard Webhooks signatures) and how every kind of answer maps to an
//! outcome.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ferry::NewEvent;
use ferry::clock::Clock;
use ferry::event::{FailureReason, Status};
use tracing::instrument::WithSubscriber as _;

use crate::common::{Backend, Captured, Receiver, Stepped, TestDb, eventually, plugins_dir};

/// The plugin's pure policy (signing, status mapping), compiled here too so its unit tests run
/// natively and the receiver can check signatures with it.
#[path = "../plugins/http/src/policy.rs"]
pub(crate) mod policy;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const OLD_SECRET: &str = "rotated-out";

/// Ferry with the http plugin; `routes` maps route names to `(url, extra config)`.
async fn setup(receiver: &Receiver, extra_origin: &str, routes: &[(&str, String, &str)]) -> Stepped {
    setup_with(receiver, &[extra_origin], "", routes).await
}

/// As [`setup`], with any number of origins granted besides the receiver's, and more of the
/// plugin's sandbox settings (TOML lines).
async fn setup_with(
    receiver: &Receiver,
    extra_origins: &[&str],
    sandbox: &str,
    routes: &[(&str, String, &str)],
) -> Stepped {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_http"]);
    let origins: Vec<String> = [format!("http://{}", receiver.addr)]
        .into_iter()
        .chain(extra_origins.iter().map(|origin| origin.to_string()))
        .collect();
    let mut text = format!("[plugins]\ndir = {plugins:?}\n[sandbox.http]\nhttp = {origins:?}\n{sandbox}\n");
    for (name, url, extra) in routes {
        text.push_str(&format!("[route.{name}]\nplugin = \"http\"\nconfig = {{ url = \"{url}\"{extra} }}\n"));
    }
    Stepped::start(db, &text).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_carry_the_event_and_standard_signatures() {
    let receiver = Receiver::start().await;
    let config = format!(", secret = \"{SECRET}\", secret_previous = \"{OLD_SECRET}\", \"header.x-api-key\" = \"k1\"");
    let s = setup(&receiver, "http://127.0.0.1:9", &[("hooks", receiver.url("/in?v=1"), &config)]).await;
    // Headers the request sets itself, given by the event too, go out once: the request's.
    let event = NewEvent::new("hooks", "order.paid", r#"{"order":42}"#)
        .with_header("tenant", "acme")
        .with_header("Webhook-Signature", "v1,forged")
        .with_header("webhook-id", "7")
        .with_header("Content-Type", "text/forged")
        .with_header("content-length", "1");
    let rows = s.deliver(&[event]).await;
    assert_eq!(rows[0].status, Status::Sent, "{:?}", rows[0].last_error);

    let got = receiver.requests();
    assert_eq!(got.len(), 1);
    let r = &got[0];
    assert_eq!((r.method.as_str(), r.path.as_str(), r.body.as_slice()), ("POST", "/in?v=1", &br#"{"order":42}"#[..]));
    for name in ["webhook-signature", "webhook-id", "content-type", "content-length"] {
        assert_eq!(r.headers.iter().filter(|(n, _)| n == name).count(), 1, "{name}: {:?}", r.headers);
    }
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("tenant"), Some("acme"));
    assert_eq!(r.header("x-api-key"), Some("k1"));
    assert_eq!(r.header("host"), Some(receiver.addr.to_string().as_str()));
    let id = r.header("webhook-id").unwrap();
    assert_eq!(id, rows[0].id.to_string(), "the id is stable across retries: the event id");
    let timestamp: u64 = r.header("webhook-timestamp").unwrap().parse().unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert!(now.abs_diff(timestamp) < 60);
    let signatures: Vec<&str> = r.header("webhook-signature").unwrap().split(' ').collect();
    let expected =
        [SECRET, OLD_SECRET].map(|s| policy::sign(&policy::secret_bytes(s).unwrap(), id, timestamp, &r.body));
    assert_eq!(signatures, expected, "one valid signature per secret, current first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_go_out_in_binary_or_structured_mode_with_the_trace_context() {
    let receiver = Receiver::start().await;
    let binary = ", cloudevents = \"binary\", cloudevents_source = \"https://shop.example/orders\"";
    let structured = format!(", cloudevents = \"structured\", secret = \"{SECRET}\"");
    let s = setup(
        &receiver,
        "http://127.0.0.1:9",
        &[("bin", receiver.url("/bin"), binary), ("env", receiver.url("/env"), &structured)],
    )
    .await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let time = chrono::DateTime::parse_from_rfc3339("2026-11-27T08:00:00.250Z").unwrap().with_timezone(&chrono::Utc);
    let big = r#"{"amount": 123456789012345678901234567890}"#;
    let events = ["bin", "env"].map(|route| NewEvent {
        event_time: Some(time),
        ..NewEvent::new(route, "order.paid", big).with_header("traceparent", traceparent)
    });
    let rows = s.deliver(&events).await;
    assert!(rows.iter().all(|r| r.status == Status::Sent), "{rows:?}");
    let got = receiver.requests();
    let on = |path: &str| got.iter().find(|r| r.path == path).unwrap_or_else(|| panic!("no request to {path}"));

    // Binary: the payload is the body; the attributes are ce- headers; the trace context travels.
    let r = on("/bin");
    assert_eq!(r.body, big.as_bytes());
    let id = rows[0].id.to_string();
    for (name, value) in [
        ("ce-specversion", "1.0"),
        ("ce-id", id.as_str()),
        ("ce-source", "https://shop.example/orders"),
        ("ce-type", "order.paid"),
        ("ce-time", "2026-11-27T08:00:00.250Z"),
        ("content-type", "application/json"),
        ("traceparent", traceparent),
    ] {
        assert_eq!(r.header(name), Some(value), "{name}");
    }

    // Structured: one JSON envelope, the payload in it as it was (every digit kept), signed as sent.
    let r = on("/env");
    assert_eq!(r.header("content-type"), Some("application/cloudevents+json"));
    assert_eq!(r.header("traceparent"), Some(traceparent));
    assert!(r.header("ce-id").is_none(), "attributes are in the body");
    let body = String::from_utf8(r.body.clone()).unwrap();
    assert!(body.contains(&format!(r#""data":{big}"#)), "{body}");
    let envelope: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(envelope["specversion"], "1.0");
    assert_eq!(envelope["id"], rows[1].id.to_string());
    assert_eq!(envelope["source"], "/ferry/env", "the default source names the route");
    assert_eq!(envelope["type"], "order.paid");
    assert_eq!(envelope["time"], "2026-11-27T08:00:00.250Z");
    assert_eq!(envelope["datacontenttype"], "application/json");
    let (id, timestamp) = (r.header("webhook-id").unwrap(), r.header("webhook-timestamp").unwrap().parse().unwrap());
    let expected = policy::sign(&policy::secret_bytes(SECRET).unwrap(), id, timestamp, &r.body);
    assert_eq!(r.header("webhook-signature"), Some(expected.as_str()), "the envelope, as sent, is signed");
}

/// Batched mode: a JSON array of structured envelopes per request, within the route's count and
/// byte limits, signed as sent, each event's trace context in its envelope; one answer settles
/// every event the request carried, and a retry of the same events is the same message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_cloudevents_carry_many_events_per_request_within_the_limits() {
    let receiver = Receiver::start().await;
    let many = format!(", cloudevents = \"batched\", batch_size = \"4\", secret = \"{SECRET}\"");
    let routes = [
        ("many", receiver.url("/many"), many.as_str()),
        ("large", receiver.url("/large"), ", cloudevents = \"batched\", batch_bytes = \"2048\""),
        ("failing", receiver.url("/fail"), ", cloudevents = \"batched\", \"header.x-tenant\" = \"acme\""),
    ];
    let s = setup(&receiver, "http://127.0.0.1:9", &routes).await;
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut events: Vec<NewEvent> = (0..10)
        .map(|i| NewEvent::new("many", "order.paid", format!("{{\"n\":{i}}}")).with_header("traceparent", traceparent))
        .collect();
    events.push(NewEvent::new("many", "blob", vec![0u8, 255]).with_content_type("application/octet-stream"));
    // About 700 bytes each as envelopes: two fit in 2048 bytes, three do not.
    let padding = "x".repeat(600);
    events.extend((0..5).map(|i| NewEvent::new("large", "t", format!("{{\"n\":{i},\"pad\":\"{padding}\"}}"))));
    events.extend((0..3).map(|i| NewEvent::new("failing", "t", format!("{{\"n\":{i}}}"))));
    let rows = s.deliver(&events).await;
    let got = receiver.requests();
    let on = |path: &str| got.iter().filter(|r| r.path == path).collect::<Vec<_>>();

    // 11 events in runs of at most 4: three requests, every event in exactly one, runs of
    // consecutive events. (The requests are in flight at once, so they may arrive in any order.)
    let mut sent = on("/many");
    assert_eq!(sent.len(), 3, "11 events, 4 per request");
    let many: Vec<&ferry::event::EventRecord> = rows.iter().filter(|r| r.route == "many").collect();
    let place = |id: &serde_json::Value| many.iter().position(|r| r.id.to_string() == id.as_str().unwrap()).unwrap();
    let array = |r: &&crate::common::Received| serde_json::from_slice::<Vec<serde_json::Value>>(&r.body).unwrap();
    sent.sort_by_key(|r| place(&array(r)[0]["id"]));
    let mut envelopes = Vec::new();
    for r in &sent {
        assert_eq!(r.header("content-type"), Some("application/cloudevents-batch+json"));
        assert!(r.header("traceparent").is_none(), "no one event's headers on a request for several");
        let (id, timestamp) =
            (r.header("webhook-id").unwrap(), r.header("webhook-timestamp").unwrap().parse().unwrap());
        let expected = policy::sign(&policy::secret_bytes(SECRET).unwrap(), id, timestamp, &r.body);
        assert_eq!(r.header("webhook-signature"), Some(expected.as_str()), "the array, as sent, is signed");
        let batch = array(r);
        assert!((1..=4).contains(&batch.len()), "{} in one request", batch.len());
        let carried: Vec<String> = batch.iter().map(|e| e["id"].as_str().unwrap().to_string()).collect();
        assert_eq!(id, policy::batch_id(carried), "webhook-id names the events carried");
        for envelope in &batch {
            assert_eq!((&envelope["specversion"], &envelope["source"]), (&"1.0".into(), &"/ferry/many".into()));
        }
        envelopes.extend(batch);
    }
    let order: Vec<usize> = envelopes.iter().map(|e| place(&e["id"])).collect();
    assert_eq!(order, (0..11).collect::<Vec<_>>(), "each event once, the runs consecutive");
    assert!(many.iter().all(|r| r.status == Status::Sent), "{many:?}");
    assert_eq!(envelopes[0]["data"], serde_json::json!({"n": 0}), "JSON payloads embedded as they are");
    assert_eq!(envelopes[0]["traceparent"], traceparent, "the tracing extension carries the trace context");
    assert_eq!(envelopes[10]["data_base64"], "AP8=", "bytes as base64");
    assert!(envelopes[10].get("traceparent").is_none());

    // By bytes: 5 envelopes of about 700 bytes, two per request of at most 2048.
    let large = on("/large");
    let mut sizes: Vec<usize> =
        large.iter().map(|r| serde_json::from_slice::<Vec<serde_json::Value>>(&r.body).unwrap().len()).collect();
    sizes.sort();
    assert_eq!(sizes, [1, 2, 2], "runs by size");
    assert!(large.iter().all(|r| r.body.len() <= 2048), "every body within batch_bytes");

    // One answer settles all it carried: a 500 is a transient failure of each of the three.
    let failing: Vec<_> = rows.iter().filter(|r| r.route == "failing").collect();
    assert_eq!(on("/fail").len(), 1, "three events, one request");
    assert_eq!(on("/fail")[0].header("x-tenant"), Some("acme"), "the route's headers go on the request");
    for row in &failing {
        assert_eq!((row.status, row.attempts), (Status::Pending, 1), "{row:?}");
        assert_eq!(row.last_error.as_deref(), Some("HTTP 500"));
    }
    // Retried, the same three events are the same message.
    s.clock.advance(std::time::Duration::from_secs(3600));
    s.deliver(&[]).await;
    let retried = receiver.requests().into_iter().filter(|r| r.path == "/fail").collect::<Vec<_>>();
    assert_eq!(retried.len(), 2);
    assert_eq!(retried[0].header("webhook-id"), retried[1].header("webhook-id"), "a retry keeps its webhook-id");
}

/// A batched request the receiver refuses (4xx) is sent again event by event, so the one event it
/// could not take fails alone and the others are delivered: a bad event fails only itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_batch_is_sent_again_event_by_event_and_only_the_bad_event_fails() {
    let receiver = Receiver::start().await;
    let routes = [("picky", receiver.url("/picky"), ", cloudevents = \"batched\", batch_size = \"4\"")];
    let s = setup(&receiver, "http://127.0.0.1:9", &routes).await;
    let events: Vec<NewEvent> = (0..8)
        .map(|i| NewEvent::new("picky", "t", if i == 5 { "\"poison\"".to_string() } else { format!("{{\"n\":{i}}}") }))
        .collect();
    let rows = s.deliver(&events).await;
    for (i, row) in rows.iter().enumerate() {
        if i == 5 {
            assert_eq!(row.status, Status::Failed, "{row:?}");
            assert_eq!(row.last_error.as_deref(), Some("HTTP 422: poison refused."));
        } else {
            assert_eq!(row.status, Status::Sent, "event {i} travelled with the bad one: {row:?}");
        }
    }
    // Two arrays of four; the refused one again as four arrays of one.
    let sizes: Vec<usize> = receiver
        .requests()
        .iter()
        .map(|r| serde_json::from_slice::<Vec<serde_json::Value>>(&r.body).unwrap().len())
        .collect();
    assert_eq!((sizes.len(), sizes.iter().filter(|n| **n == 4).count()), (6, 2), "{sizes:?}");
    assert_eq!(sizes.iter().sum::<usize>(), 12, "four events sent twice, four once: {sizes:?}");
}

/// A receiver that refuses an array and then, sent its events one by one, asks to wait is not sent
/// the rest: the remaining events, of the split request and of the batch, are deferred unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_asked_for_while_a_refused_batch_is_split_holds_back_the_rest() {
    let receiver = Receiver::start().await;
    let config = ", cloudevents = \"batched\", batch_size = \"4\", concurrency = \"1\"";
    let s = setup(&receiver, "http://127.0.0.1:9", &[("choosy", receiver.url("/choosy"), config)]).await;
    let events: Vec<NewEvent> = (0..8).map(|i| NewEvent::new("choosy", "t", format!("{{\"n\":{i}}}"))).collect();
    let rows = s.deliver(&events).await;
    let sizes: Vec<usize> = receiver
        .requests()
        .iter()
        .map(|r| serde_json::from_slice::<Vec<serde_json::Value>>(&r.body).unwrap().len())
        .collect();
    assert_eq!(sizes, [4, 1], "the array of four (413), its first event alone (429), then nothing");
    let now = s.clock.now();
    for (i, row) in rows.iter().enumerate() {
        assert_eq!((row.status, row.attempts), (Status::Pending, 0), "event {i}: {row:?}");
        assert_eq!(row.next_attempt_at, now + chrono::Duration::seconds(7), "event {i} waits as asked");
        let expected = if i == 0 { "HTTP 429" } else { "not sent: HTTP 429" };
        assert_eq!(row.last_error.as_deref(), Some(expected), "event {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_answer_maps_to_its_outcome() {
    let receiver = Receiver::start().await;
    // A port with nothing listening: connection refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let denied = Receiver::start().await;
    let routes = [
        ("ok", receiver.url("/ok"), ""),
        ("fail", receiver.url("/fail"), ""),
        ("busy", receiver.url("/busy"), ""),
        ("busy-retry", receiver.url("/busy"), ", rate_limited = \"retry\""),
        ("reject", receiver.url("/reject"), ""),
        ("hang", receiver.url("/hang"), ", timeout_ms = \"300\""),
        ("refused", format!("http://{closed}/"), ""),
        ("denied", denied.url("/ok"), ""),
        // Bodies larger than the host takes before the request is under way: the rest is
        // written after it has failed, which must end as that failure, not as a plugin fault.
        ("refused-large", format!("http://{closed}/"), ""),
        ("denied-large", denied.url("/ok"), ""),
    ];
    let s = setup(&receiver, &format!("http://{closed}"), &routes).await;
    let large = format!("{{\"pad\":\"{}\"}}", "x".repeat(64 << 10));
    let payload = |route: &str| if route.ends_with("-large") { large.clone() } else { "{}".to_string() };
    let events: Vec<NewEvent> = routes.iter().map(|(route, _, _)| NewEvent::new(*route, "t", payload(route))).collect();
    let rows = s.deliver(&events).await;
    let by_route = |route: &str| rows.iter().find(|r| r.route == route).unwrap();
    let now = s.clock.now();

    assert_eq!(by_route("ok").status, Status::Sent);
    let fail = by_route("fail");
    assert_eq!((fail.status, fail.last_error.as_deref()), (Status::Pending, Some("HTTP 500")));
    // 429: deferred by default (no attempt counted), retried with `rate_limited = "retry"`; both
    // wait as long as Retry-After says.
    let busy = by_route("busy");
    assert_eq!((busy.status, busy.attempts, busy.last_error.as_deref()), (Status::Pending, 0, Some("HTTP 429")));
    assert_eq!(busy.next_attempt_at, now + chrono::Duration::seconds(7), "Retry-After is honoured");
    let busy_retry = by_route("busy-retry");
    assert_eq!((busy_retry.status, busy_retry.attempts), (Status::Pending, 1));
    assert_eq!(busy_retry.next_attempt_at, now + chrono::Duration::seconds(7));
    let reject = by_route("reject");
    assert_eq!((reject.status, reject.failure_reason.map(|r| r.as_str())), (Status::Failed, Some("permanent")));
    assert_eq!(reject.last_error.as_deref(), Some("HTTP 400: missing field: total"));
    for (route, needle) in
        [("hang", "Timeout"), ("refused", "ConnectionRefused"), ("refused-large", "ConnectionRefused")]
    {
        let row = by_route(route);
        assert_eq!(row.status, Status::Pending, "{route}: transient");
        let error = row.last_error.as_deref().unwrap();
        assert!(error.starts_with("request failed: ") && error.contains(needle), "{route}: {error}");
    }
    for route in ["denied", "denied-large"] {
        let row = by_route(route);
        let why = (row.status, row.failure_reason.map(|r| r.as_str()));
        assert_eq!(
            why,
            (Status::Failed, Some("permanent")),
            "{route}: an origin off the allowlist will not start working by itself: {:?}",
            row.last_error
        );
        assert!(row.last_error.as_deref().unwrap().contains("HttpRequestDenied"), "{route}: {:?}", row.last_error);
    }
    assert!(denied.requests().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_is_sent_in_full_with_bounded_concurrency() {
    let receiver = Receiver::start().await;
    let s = setup(&receiver, "http://127.0.0.1:9", &[("hooks", receiver.url("/ok"), ", concurrency = \"4\"")]).await;
    let events: Vec<NewEvent> = (0..30).map(|i| NewEvent::new("hooks", "t", format!("{{\"n\":{i}}}"))).collect();
    let rows = s.deliver(&events).await;
    assert!(rows.iter().all(|r| r.status == Status::Sent));
    let mut bodies: Vec<String> =
        receiver.requests().iter().map(|r| String::from_utf8(r.body.clone()).unwrap()).collect();
    bodies.sort();
    let mut expected: Vec<String> = (0..30).map(|i| format!("{{\"n\":{i}}}")).collect();
    expected.sort();
    assert_eq!(bodies, expected, "each event sent once");
}

/// Requests go out on kept-alive connections, reused across requests, plugin calls and batches,
/// and never more at a time per origin than the sandbox allows, whatever the plugin asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_reused_and_capped_per_origin() {
    let receiver = Receiver::start().await;
    let capped = Receiver::start().await;
    let routes = [
        ("hooks", receiver.url("/ok"), ", concurrency = \"8\""),
        ("capped", capped.url("/ok"), ", concurrency = \"32\""),
    ];
    let origins = format!("http://{}", capped.addr);
    let s = setup_with(&receiver, &[&origins], "http_connections = 2", &routes).await;
    // One cycle claims a batch of 100 (the default): 50 events per route.
    for round in 0..6 {
        let events: Vec<NewEvent> = (0..50)
            .flat_map(|i| ["hooks", "capped"].map(|route| NewEvent::new(route, "t", format!("{{\"n\":{i}}}"))))
            .collect();
        let rows = s.deliver(&events).await;
        let unsent: Vec<_> =
            rows.iter().filter(|r| r.status != Status::Sent).map(|r| (r.status, &r.last_error)).collect();
        assert!(unsent.is_empty(), "round {round}: {} not sent, first {:?}", unsent.len(), unsent.first());
    }
    assert_eq!((receiver.requests().len(), capped.requests().len()), (300, 300));
    // Without pooling each request would open a connection: 300 each. At most 2 requests wait for
    // an answer at a time; a connection still on its way back to the pool as the next request
    // starts can make the client open another, so the bound checked is twice the cap.
    for (origin, receiver) in [("hooks", &receiver), ("capped", &capped)] {
        let opened = receiver.connections();
        assert!((1..=4).contains(&opened), "{origin}: {opened} connections for 300 requests, 2 at a time");
    }
}

/// A plugin's connections over all its origins are bounded by `http_open_connections`: here 4.
/// Route `b`'s origin keeps the one connection its event opened until route `wide` sends a batch
/// 8 requests at a time to another origin, each answered after half a second (so no connection is
/// free for the next request before all 8 have gone out, as one answered at once could be); the
/// connections that needs find no permit, so `b`'s, the origin used least recently, is closed to
/// make room, and `wide` keeps no more than 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugins_connections_over_all_origins_are_bounded() {
    let wide = Receiver::start().await;
    let narrow = Receiver::start().await;
    let routes = [("wide", wide.url("/slow"), ", concurrency = \"8\""), ("b", narrow.url("/ok"), "")];
    let s = setup_with(&wide, &[&format!("http://{}", narrow.addr)], "http_open_connections = 4", &routes).await;
    let rows = s.deliver(&[NewEvent::new("b", "t", "{}")]).await;
    assert_eq!(rows[0].status, Status::Sent, "{:?}", rows[0].last_error);
    assert_eq!((narrow.connections(), narrow.open()), (1, 1), "b's connection is kept");
    let events: Vec<NewEvent> = (0..16).map(|i| NewEvent::new("wide", "t", format!("{{\"n\":{i}}}"))).collect();
    let rows = s.deliver(&events).await;
    assert!(rows.iter().all(|r| r.status == Status::Sent), "{:?}", rows.iter().find(|r| r.status != Status::Sent));
    assert!(wide.connections() >= 4, "the batch should need 4 connections or more: it opened {}", wide.connections());
    let bounded = || async { (narrow.open() == 0 && wide.open() <= 4).then_some(()) };
    eventually(std::time::Duration::from_secs(5), "b's connection to close, and wide to keep 4 at most", bounded).await;
}

/// The bound holds while requests are in flight, on whichever client: route `hang` keeps 4
/// requests waiting for an answer that never comes, on the plugin's 4 connections, until they
/// time out (2 s to the first byte, plus the time allowed for connecting). Route `b`'s request,
/// to another origin, waits for one of them to close instead of opening a fifth, then goes out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugins_connections_stay_bounded_while_its_requests_hang() {
    let hanging = Receiver::start().await;
    let narrow = Receiver::start().await;
    let routes =
        [("hang", hanging.url("/hang"), ", concurrency = \"4\", timeout_ms = \"2000\""), ("b", narrow.url("/ok"), "")];
    let s = setup_with(&hanging, &[&format!("http://{}", narrow.addr)], "http_open_connections = 4", &routes).await;
    let hang: Vec<NewEvent> = (0..4).map(|i| NewEvent::new("hang", "t", format!("{{\"n\":{i}}}"))).collect();
    // `b` is emitted, and claimed by a cycle of its own, once the 4 requests hang; for the next
    // second its receiver is watched for a connection.
    let b = async {
        let hung = || async { (hanging.connections() == 4).then_some(()) };
        eventually(std::time::Duration::from_secs(10), "4 hanging requests", hung).await;
        let watch = async {
            let until = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
            let mut most = 0;
            while tokio::time::Instant::now() < until {
                most = most.max(narrow.connections());
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            (hanging.connections(), most)
        };
        let b = [NewEvent::new("b", "t", "{}")];
        tokio::join!(s.deliver(&b), watch)
    };
    let (rows, (b, during)) = tokio::join!(s.deliver(&hang), b);
    assert_eq!(during, (4, 0), "while 4 requests hang, b waits for one of their connections to close");
    assert_eq!(b[0].status, Status::Sent, "{:?}", b[0].last_error);
    assert!(rows.iter().filter(|r| r.route == "hang").all(|r| r.status == Status::Pending), "{rows:?}");
}

/// A connection opened for a request that another connection serves first is not waited for in
/// the background. With one connection allowed, route `a`'s second request waits for a permit to
/// connect while the first is answered, then goes out on the first's connection. hyper-util would
/// let the connect it started run on, waiting for a permit for the rest of its 10 s and holding
/// `a`'s pool, idle connection and all, meanwhile; it gives up at once instead. So when route `b`
/// needs a connection to another origin, `a`'s idle one closes and `b`'s opens right away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_no_request_waits_for_any_more_gives_up_its_place() {
    let slow = Receiver::start().await;
    let other = Receiver::start().await;
    let routes = [("a", slow.url("/slow"), ", concurrency = \"2\""), ("b", other.url("/ok"), "")];
    let s = setup_with(&slow, &[&format!("http://{}", other.addr)], "http_open_connections = 1", &routes).await;
    let a: Vec<NewEvent> = (0..2).map(|i| NewEvent::new("a", "t", format!("{{\"n\":{i}}}"))).collect();
    let rows = s.deliver(&a).await;
    assert!(rows.iter().all(|r| r.status == Status::Sent), "{rows:?}");
    assert_eq!((slow.received(), slow.connections()), (2, 1), "a's two requests, one after the other");
    let started = std::time::Instant::now();
    let rows = s.deliver(&[NewEvent::new("b", "t", "{}")]).await;
    let took = started.elapsed();
    assert_eq!(rows[0].status, Status::Sent, "{:?}", rows[0].last_error);
    assert!(took < std::time::Duration::from_secs(5), "b waited {took:?} for a's idle connection to close");
    assert_eq!(other.connections(), 1);
    let closed = || async { (slow.open() == 0).then_some(()) };
    eventually(std::time::Duration::from_secs(5), "a's idle connection to close", closed).await;
}

/// An origin unlisted while a request still holds its client is listed again with that client,
/// whose idle connections serve it. With 3 connections allowed: `hang` holds one of origin A's
/// and `a` leaves another idle; `c` opens a third, to origin C. `d`'s connection finds no permit
/// and unlists A, used least recently, whose connections stay open while `hang` holds its client;
/// after waiting a second for them it unlists C, whose connection closes. A's next request reuses
/// its idle connection: it opens none, and needs no other origin unlisted for a permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unlisted_origin_gets_its_client_back_while_a_request_holds_it() {
    let (held, c, d) = (Receiver::start().await, Receiver::start().await, Receiver::start().await);
    let routes = [
        ("hang", held.url("/hang"), ", timeout_ms = \"4000\""),
        ("a", held.url("/ok"), ""),
        ("c", c.url("/ok"), ""),
        ("d", d.url("/ok"), ""),
    ];
    let others = [format!("http://{}", c.addr), format!("http://{}", d.addr)];
    let s = setup_with(&held, &[&others[0], &others[1]], "http_open_connections = 3", &routes).await;
    let rest = async {
        eventually(std::time::Duration::from_secs(10), "the hanging request", || async {
            (held.connections() == 1).then_some(())
        })
        .await;
        let mut rows = Vec::new();
        for route in ["a", "c", "d", "a"] {
            rows.extend(s.deliver(&[NewEvent::new(route, "t", "{}")]).await);
        }
        (rows, held.connections(), held.open(), c.open(), d.open())
    };
    let hang = [NewEvent::new("hang", "t", "{}")];
    let (hung, (rows, opened, open, c_open, d_open)) = tokio::join!(s.deliver(&hang), rest);
    assert!(rows.iter().all(|r| r.status == Status::Sent), "{rows:?}");
    assert_eq!((opened, open), (2, 2), "A's second request reused the idle connection its first left");
    assert_eq!((c_open, d_open), (0, 1), "C's connection closed for D's, which A's request left open");
    assert_eq!(d.connections(), 1);
    assert_eq!(hung[0].status, Status::Pending, "{:?}", hung[0].last_error);
}

/// The plugin starts several requests, then writes the rest of their bodies in order; a body over
/// 16 KiB (what the host buffers) cannot be written in full until its request is under way. Slots are given in the order the requests
/// were made, so the ones waiting for a slot are never the ones whose bodies the others need.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_never_wait_on_their_own_requests_for_a_slot() {
    let receiver = Receiver::start().await;
    let routes = [("big", receiver.url("/ok"), ", concurrency = \"8\", timeout_ms = \"3000\"")];
    let s = setup_with(&receiver, &["http://127.0.0.1:9"], "http_connections = 2", &routes).await;
    let padding = "x".repeat(64 << 10);
    let events: Vec<NewEvent> =
        (0..24).map(|i| NewEvent::new("big", "t", format!("{{\"n\":{i},\"pad\":\"{padding}\"}}"))).collect();
    let started = std::time::Instant::now();
    let rows = s.deliver(&events).await;
    let unsent: Vec<_> = rows.iter().filter(|r| r.status != Status::Sent).map(|r| &r.last_error).collect();
    assert!(unsent.is_empty(), "{} not sent, first {:?}", unsent.len(), unsent.first());
    assert_eq!(receiver.requests().len(), 24);
    assert!(started.elapsed() < std::time::Duration::from_secs(3), "took {:?}", started.elapsed());
}

/// An HTTPS server on 127.0.0.1 ("localhost") with a certificate from a CA made for the test by
/// `openssl`; it offers HTTP/2 and HTTP/1.1 by ALPN, counts connections and records the HTTP
/// version of each request.
struct TlsReceiver {
    port: u16,
    ca: std::path::PathBuf,
    connections: Arc<AtomicUsize>,
    versions: Arc<Mutex<Vec<http::Version>>>,
}

async fn tls_receiver(dir: &std::path::Path) -> TlsReceiver {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    crate::common::test_pki(dir);
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&std::fs::read(dir.join("server.pem")).unwrap()).map(Result::unwrap).collect();
    let key = PrivateKeyDer::from_pem_slice(&std::fs::read(dir.join("server.key")).unwrap()).unwrap();
    let mut config = rustls::ServerConfig::builder().with_no_client_auth().with_single_cert(certs, key).unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let connections = Arc::new(AtomicUsize::new(0));
    let versions = Arc::new(Mutex::new(Vec::new()));
    let (accepted, seen) = (connections.clone(), versions.clone());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            accepted.fetch_add(1, Ordering::SeqCst);
            let (acceptor, seen) = (acceptor.clone(), seen.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        seen.lock().unwrap().push(request.version());
                        let _ = http_body_util::BodyExt::collect(request.into_body()).await;
                        Ok::<_, std::convert::Infallible>(http::Response::new(
                            http_body_util::Empty::<bytes::Bytes>::new(),
                        ))
                    }
                });
                let io = hyper_util::rt::TokioIo::new(tls);
                if h2 {
                    let builder = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
                    let _ = builder.serve_connection(io, service).await;
                } else {
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
                }
            });
        }
    });
    TlsReceiver { port, ca: dir.join("ca.pem"), connections, versions }
}

/// HTTPS through the pool: the server's certificate is verified (against `http_ca`; without it
/// the request fails as a TLS error), HTTP/2 is spoken when the server offers it, and later
/// requests reuse the connections the first ones opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_is_verified_and_speaks_http2_on_shared_connections() {
    let dir = tempfile::tempdir().unwrap();
    let server = tls_receiver(dir.path()).await;
    let origin = format!("https://localhost:{}", server.port);
    let url = format!("{origin}/in");
    let plain = Receiver::start().await;
    let routes = [("tls", url.clone(), ", concurrency = \"8\"")];
    // localhost is a loopback address: allowed by http_private.
    let trusted = format!("http_ca = {:?}\nhttp_private = true", server.ca);
    let s = setup_with(&plain, &[&origin], &trusted, &routes).await;
    let mut after_first = 0;
    for round in 0..3 {
        let events: Vec<NewEvent> = (0..40).map(|i| NewEvent::new("tls", "t", format!("{{\"n\":{i}}}"))).collect();
        let rows = s.deliver(&events).await;
        let unsent: Vec<_> = rows.iter().filter(|r| r.status != Status::Sent).map(|r| &r.last_error).collect();
        assert!(unsent.is_empty(), "round {round}: {} not sent, first {:?}", unsent.len(), unsent.first());
        if round == 0 {
            after_first = server.connections.load(Ordering::SeqCst);
        }
    }
    let versions = server.versions.lock().unwrap().clone();
    assert_eq!(versions.len(), 120);
    assert!(versions.iter().all(|v| *v == http::Version::HTTP_2), "{versions:?}");
    // The first requests race to open connections before any has said it speaks HTTP/2 (at most
    // the plugin's 8 at a time); after that every request rides on the connections there are.
    let opened = server.connections.load(Ordering::SeqCst);
    assert!((1..=8).contains(&after_first), "{after_first} connections for the first 40 requests, 8 at a time");
    assert_eq!(opened, after_first, "the next 80 requests opened no connection");

    // The same server without its CA: the certificate does not verify.
    let s = setup_with(&plain, &[&origin], "http_private = true", &routes).await;
    let rows = s.deliver(&[NewEvent::new("tls", "t", "{}")]).await;
    assert_eq!(rows[0].status, Status::Pending, "a TLS failure is transient");
    let error = rows[0].last_error.as_deref().unwrap_or_default();
    assert!(error.contains("Tls") || error.contains("certificate"), "{error}");
    assert_eq!(server.versions.lock().unwrap().len(), 120, "nothing reached the server");

    // A CA file that is not one fails the route's events, naming the file.
    std::fs::write(dir.path().join("not-a-ca.pem"), "hello").unwrap();
    let broken = format!("http_ca = {:?}", dir.path().join("not-a-ca.pem"));
    let s = setup_with(&plain, &[&origin], &broken, &routes).await;
    let rows = s.deliver(&[NewEvent::new("tls", "t", "{}")]).await;
    let error = rows[0].last_error.as_deref().unwrap_or_default();
    assert!(error.contains("http_ca") && error.contains("not-a-ca.pem"), "{error}");
    // Neither the start-up's attempt nor the call's started anything: no start is timed, while
    // the call's wait for an instance is.
    let labels = ferry::metrics::PluginLabels { plugin: "http".into() };
    let metrics = s.ferry.registry.metrics();
    assert_eq!(metrics.plugin_instance_start.get_or_create(&labels).count(), 0);
    assert_eq!(metrics.plugin_instance_wait.get_or_create(&labels).count(), 1);
}

/// A webhook URL whose host name leads to a loopback address is refused where the connection is
/// made, permanently: retrying would not change the sandbox. The receiver sees nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_host_that_resolves_to_loopback_is_refused_permanently() {
    let receiver = Receiver::start().await;
    let origin = format!("http://localhost:{}", receiver.addr.port());
    let routes = [("inside", format!("{origin}/in"), "")];
    let s = setup(&receiver, &origin, &routes).await;
    let rows = s.deliver(&[NewEvent::new("inside", "t", "{}")]).await;
    assert_eq!((rows[0].status, rows[0].failure_reason), (Status::Failed, Some(FailureReason::Permanent)));
    let error = rows[0].last_error.as_deref().unwrap_or_default();
    assert!(error.contains("DestinationIpProhibited"), "{error}");
    assert!(receiver.requests().is_empty(), "nothing reached the receiver");
}

/// After a 429 the rest of the batch is deferred unsent, and the route waits: a receiver that
/// asked to wait is not sent the rest of a backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_receiver_is_not_sent_the_rest_of_a_backlog() {
    let receiver = Receiver::start().await;
    let routes = [("busy", receiver.url("/busy"), ", concurrency = \"2\"")];
    let s = setup(&receiver, "http://127.0.0.1:9", &routes).await;
    let events: Vec<NewEvent> = (0..6).map(|_| NewEvent::new("busy", "t", "{}")).collect();
    let rows = s.deliver(&events).await;
    let now = s.clock.now();
    for row in &rows {
        assert_eq!((row.status, row.attempts), (Status::Pending, 0), "{row:?}");
        assert_eq!(row.next_attempt_at, now + chrono::Duration::seconds(7), "Retry-After, for all of them");
    }
    let unsent = rows.iter().filter(|r| r.last_error.as_deref() == Some("not sent: HTTP 429")).count();
    assert_eq!((receiver.requests().len(), unsent), (2, 4), "one round of two requests, the rest deferred unsent");
    // Due again after the wait (not before): the route is not claimed from meanwhile.
    let late = s.deliver(&[NewEvent::new("busy", "t", "{}")]).await;
    assert_eq!((late[0].status, late[0].attempts), (Status::Pending, 0));
    assert_eq!(receiver.requests().len(), 2, "an event emitted meanwhile waits with its route");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_route_config_is_refused_by_init() {
    let receiver = Receiver::start().await;
    let routes = [
        ("nourl", String::new(), ""),
        ("badurl", "ftp://x".to_string(), ""),
        ("typo", receiver.url("/ok"), ", secrett = \"x\""),
        ("limits", receiver.url("/ok"), ", rate_limited = \"wait\""),
        ("twice", receiver.url("/ok"), ", \"header.Webhook-Signature\" = \"v1,forged\""),
        ("unbatched", receiver.url("/ok"), ", batch_size = \"10\""),
        ("huge", receiver.url("/ok"), ", cloudevents = \"batched\", batch_size = \"100000\""),
        ("mode", receiver.url("/ok"), ", cloudevents = \"bulk\""),
    ];
    let text_routes: Vec<(&str, String, &str)> = routes.to_vec();
    let s = setup(&receiver, "http://127.0.0.1:9", &text_routes).await;
    let events: Vec<NewEvent> = routes.iter().map(|(r, _, _)| NewEvent::new(*r, "t", "{}")).collect();
    let rows = s.deliver(&events).await;
    let needles = [
        "url:",
        "url:",
        "unknown config key \"secrett\"",
        "rate_limited: \"wait\" is neither",
        "header.webhook-signature: each request sets this header itself",
        "batch_size: only with cloudevents = \"batched\"",
        "batch_size: \"100000\" is not a whole number from 1 to 10000",
        "cloudevents: \"bulk\" is not a mode; use binary, structured or batched",
    ];
    assert_eq!(rows.len(), needles.len());
    for (row, needle) in rows.iter().zip(needles) {
        assert_eq!(row.failure_reason.map(|r| r.as_str()), Some("no_transport"));
        assert!(row.last_error.as_deref().unwrap().contains(needle), "{:?}", row.last_error);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_leave_nothing_behind_in_the_host() {
    // Each request hands the host its options. An instance that still held host objects for half
    // of its 4 096 resource-table entries (64 MiB / 16 KiB) after a call would be replaced, and
    // say so: 2 500 requests on one instance show that nothing is left behind per request.
    let receiver = Receiver::start().await;
    let s = setup(&receiver, "http://127.0.0.1:9", &[("hooks", receiver.url("/ok"), ", concurrency = \"32\"")]).await;
    let log = Captured::default();
    for round in 0..25 {
        let events: Vec<NewEvent> = (0..100).map(|i| NewEvent::new("hooks", "t", format!("{{\"n\":{i}}}"))).collect();
        let rows = s.deliver(&events).with_subscriber(log.subscriber()).await;
        let unsent: Vec<_> = rows.iter().filter(|r| r.status != Status::Sent).map(|r| r.last_error.clone()).collect();
        assert!(unsent.is_empty(), "round {round}: {:?}", unsent.first());
    }
    assert_eq!(receiver.requests().len(), 2500);
    let log = log.text();
    assert!(!log.contains("instance replaced"), "{log}");
}

/// A small body goes out with its request's head, in one write, so the receiver reads each
/// request at once: the plugin writes the body before handing the request over. Written after
/// it (as before), the body followed in a write of its own, read separately, costing the
/// receiver a second read per request. The receiver here is a plain TCP listener that answers
/// 204 once a request's head and body are in, and counts the reads each request took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_body_goes_out_with_its_head() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let reads_per_request = Arc::new(Mutex::new(Vec::<usize>::new()));
    let seen = reads_per_request.clone();
    let server = tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let (mut buffer, mut reads) = (Vec::new(), 0);
                let mut chunk = vec![0; 64 << 10];
                loop {
                    let Ok(n) = socket.read(&mut chunk).await else { return };
                    if n == 0 {
                        return;
                    }
                    buffer.extend_from_slice(&chunk[..n]);
                    reads += 1;
                    // Every complete request in the buffer is answered; a partial one waits.
                    while let Some(end) = complete_request(&buffer) {
                        seen.lock().unwrap().push(reads);
                        buffer.drain(..end);
                        reads = 0;
                        if socket.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_http"]);
    let config = format!(
        "[plugins]\ndir = {plugins:?}\n[sandbox.http]\nhttp = [\"http://{addr}\"]\n\
         [route.hooks]\nplugin = \"http\"\nconfig = {{ url = \"http://{addr}/in\", concurrency = \"8\" }}\n"
    );
    let s = Stepped::start(db, &config).await;
    let events: Vec<NewEvent> = (0..64).map(|i| NewEvent::new("hooks", "t", format!("{{\"n\":{i}}}"))).collect();
    let rows = s.deliver(&events).await;
    assert!(rows.iter().all(|r| r.status == Status::Sent), "{:?}", rows.iter().find(|r| r.status != Status::Sent));
    let reads = reads_per_request.lock().unwrap().clone();
    assert_eq!(reads.len(), 64, "{reads:?}");
    // Requests queued on one connection can arrive in one read (0 after the first).
    let split = reads.iter().filter(|&&n| n > 1).count();
    assert_eq!(split, 0, "{split} of 64 requests took more than one read: {reads:?}");
    server.abort();
}

/// The length of the first complete HTTP/1.1 request (head and `content-length` body) in
/// `buffer`, if it holds one.
fn complete_request(buffer: &[u8]) -> Option<usize> {
    let head = buffer.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let text = std::str::from_utf8(&buffer[..head]).ok()?;
    let length = text
        .lines()
        .find_map(|line| line.split_once(':').filter(|(name, _)| name.eq_ignore_ascii_case("content-length")))
        .map_or(0, |(_, value)| value.trim().parse().unwrap_or(0));
    (buffer.len() >= head + length).then_some(head + length)
}
