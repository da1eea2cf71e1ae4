//! Transports written in other languages, built from `plugins/webhook-js` (JavaScript,
//! componentize-js) and `plugins/spool-py` (Python, componentize-py) against the same `wit/`
//! package, delivering through ferry with every kind of outcome.

use chrono::Duration;
use ferry::NewEvent;
use ferry::event::Status;
use tracing::instrument::WithSubscriber as _;

use crate::common::{Backend, Captured, Receiver, Stepped, TestDb, plugins_dir};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_javascript_transport_delivers_retries_and_fails() {
    let receiver = Receiver::start().await;
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_webhook_js"]);
    let mut text = format!(
        "[plugins]\ndir = {plugins:?}\ntimeout = \"20s\"\n[sandbox.webhook-js]\nhttp = [\"http://{}\"]\n",
        receiver.addr
    );
    for (route, path) in [("ok", "/in"), ("down", "/fail"), ("busy", "/busy"), ("bad", "/reject")] {
        let url = receiver.url(path);
        text.push_str(&format!(
            "[route.{route}]\nplugin = \"webhook-js\"\nconfig = {{ url = \"{url}\", \"header.x-team\" = \"core\" }}\n"
        ));
    }
    text.push_str("[route.nourl]\nplugin = \"webhook-js\"\n");
    let s = Stepped::start(db, &text).await;
    let event = |route: &str| NewEvent::new(route, "order.paid", r#"{"total":3}"#).with_header("tenant", "acme");
    let rows = s.deliver(&[event("ok"), event("down"), event("busy"), event("bad"), event("nourl")]).await;

    assert_eq!(rows[0].status, Status::Sent, "{:?}", rows[0].last_error);
    let delivered: Vec<_> = receiver.requests().into_iter().filter(|r| r.path == "/in").collect();
    assert_eq!(delivered.len(), 1);
    let request = &delivered[0];
    assert_eq!((request.method.as_str(), request.body.as_slice()), ("POST", &br#"{"total":3}"#[..]));
    assert_eq!(request.header("webhook-id"), Some(rows[0].id.to_string().as_str()));
    assert_eq!(request.header("tenant"), Some("acme"));
    assert_eq!(request.header("x-team"), Some("core"));
    assert_eq!(request.header("content-type"), Some("application/json"));

    let (down, busy, bad, nourl) = (&rows[1], &rows[2], &rows[3], &rows[4]);
    assert_eq!(down.status, Status::Pending, "5xx is transient");
    assert!(down.last_error.as_deref().unwrap().starts_with("HTTP 500"), "{:?}", down.last_error);
    assert_eq!(busy.status, Status::Pending, "429 is transient");
    assert_eq!(busy.next_attempt_at, Stepped::epoch() + Duration::seconds(7), "Retry-After: 7 is honoured");
    assert_eq!(bad.status, Status::Failed, "400 is permanent");
    assert_eq!(bad.last_error.as_deref(), Some("HTTP 400: missing field: total"));
    assert_ne!(nourl.status, Status::Sent);
    assert!(nourl.last_error.as_deref().unwrap().contains("url: required"), "{:?}", nourl.last_error);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_transport_delivers_retries_and_fails() {
    let db = TestDb::new(Backend::Sqlite).await;
    let spool = db.dir.path().join("spool");
    std::fs::create_dir_all(spool.join("orders")).unwrap();
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_spool_py"]);
    let text = format!(
        "[plugins]\ndir = {plugins:?}\ntimeout = \"20s\"\n[sandbox.spool-py]\ndirs = {{ \"/spool\" = {spool:?} }}\n\
         [route.orders]\nplugin = \"spool-py\"\nconfig = {{ dir = \"/spool/orders\", pause_retry_ms = \"1500\" }}\n\
         [route.nowhere]\nplugin = \"spool-py\"\nconfig = {{ dir = \"/spool/missing\" }}\n"
    );
    let s = Stepped::start(db, &text).await;

    let rows = s
        .deliver(&[
            NewEvent::new("orders", "order.created", r#"{"n":1}"#).with_key("c-1"),
            NewEvent::new("orders", "order.created", "{not json"),
            NewEvent::new("nowhere", "order.created", "{}"),
        ])
        .await;
    assert_eq!(rows[0].status, Status::Sent, "{:?}", rows[0].last_error);
    let file = spool.join("orders").join(format!("{}.json", rows[0].id));
    let spooled: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(spooled["payload"], serde_json::json!({"n": 1}));
    assert_eq!((spooled["type"].as_str(), spooled["key"].as_str()), (Some("order.created"), Some("c-1")));
    assert_eq!(rows[1].status, Status::Failed, "a payload that is not JSON is permanent");
    assert!(
        rows[1].last_error.as_deref().unwrap().starts_with("payload is not valid JSON"),
        "{:?}",
        rows[1].last_error
    );
    assert_ne!(rows[2].status, Status::Sent);
    assert!(
        rows[2].last_error.as_deref().unwrap().contains("dir: '/spool/missing' is not a directory"),
        "{:?}",
        rows[2]
    );

    // The consumer pauses the spool: transient, retried after the configured pause.
    std::fs::write(spool.join("orders/PAUSE"), "").unwrap();
    let paused = s.deliver(&[NewEvent::new("orders", "order.created", "{}")]).await;
    assert_eq!(paused[0].status, Status::Pending);
    assert_eq!(paused[0].last_error.as_deref(), Some("the consumer paused the spool"));
    assert_eq!(paused[0].next_attempt_at, Stepped::epoch() + Duration::milliseconds(1500));
    assert!(!spool.join(format!("orders/{}.json", paused[0].id)).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_javascript_instance_holding_on_to_host_objects_is_replaced_in_time() {
    // The JavaScript engine gives a request's handles back only when it collects garbage, which
    // may be never: about four per request. An instance may hold 4 096 (64 MiB / 16 KiB), so one
    // instance would run out after about a thousand requests, in the middle of a batch.
    let receiver = Receiver::start().await;
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_webhook_js"]);
    let text = format!(
        "[plugins]\ndir = {plugins:?}\ntimeout = \"20s\"\n[sandbox.webhook-js]\nhttp = [\"http://{}\"]\n\
         [route.ok]\nplugin = \"webhook-js\"\nconfig = {{ url = \"{}\" }}\n",
        receiver.addr,
        receiver.url("/in")
    );
    let s = Stepped::start(db, &text).await;
    let log = Captured::default();
    for round in 0..30 {
        let events: Vec<NewEvent> = (0..50).map(|i| NewEvent::new("ok", "t", format!("{{\"n\":{i}}}"))).collect();
        let rows = s.deliver(&events).with_subscriber(log.subscriber()).await;
        let unsent: Vec<_> = rows.iter().filter(|r| r.status != Status::Sent).map(|r| r.last_error.clone()).collect();
        assert!(unsent.is_empty(), "round {round}: {:?}", unsent.first());
    }
    let log = log.text();
    assert!(log.contains("instance replaced: it holds") && log.contains("plugin=webhook-js"), "{log}");
}
