//! Webhook endpoints managed at run time, delivered by the `http` plugin compiled from
//! `plugins/http` to a real HTTP receiver: the admin API's operations, what each endpoint
//! receives (its event types, headers and signatures, the previous secret while a rotation
//! lasts), disabling, deleting, its own retries and failed-event operations, and one route with
//! 1,000 endpoints.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::NewEvent;
use ferry::clock::Clock as _;
use ferry::endpoints::REFRESH;
use ferry::event::Status;
use ferry::ops::{FrontEnd, Ops};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::instrument::WithSubscriber as _;

use crate::common::{Backend, Receiver, Stepped, TestDb, eventually, fleet, plugins_dir};
use crate::http::policy;

const TOKEN: &str = "test-admin-token-0123456789";

/// Ferry on a manual clock with the admin API, the http plugin, route `hooks` (ordered) taking
/// endpoints at the receiver's origin, and route `plain` with a URL of its own.
struct Hooks {
    s: Stepped,
    base: String,
    http: reqwest::Client,
    shutdown: CancellationToken,
}

impl Drop for Hooks {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Hooks {
    /// The configuration (TOML after the database section) of ferry on `db` for `receiver`.
    fn config(db: &TestDb, receiver: &Receiver) -> String {
        let plugins = plugins_dir(db.dir.path(), &["ferry_transport_http"]);
        let origin = format!("http://{}", receiver.addr);
        format!(
            r#"
            [admin]
            listen = "127.0.0.1:0"
            token = "{TOKEN}"
            [plugins]
            dir = {plugins:?}
            [sandbox.http]
            http = ["{origin}"]
            [retry]
            max_attempts = 2
            jitter = "none"
            [route.plain]
            plugin = "http"
            config = {{ url = "{origin}/plain" }}
            [route.hooks]
            ordered = true
            [route.hooks.endpoints]
            origins = ["{origin}"]
            config = {{ timeout_ms = "5000" }}
            "#
        )
    }

    async fn start(db: TestDb, receiver: &Receiver) -> Hooks {
        let config = Hooks::config(&db, receiver);
        let s = Stepped::start(db, &config).await;
        let shutdown = CancellationToken::new();
        let (address, _task) = s.ferry.admin().expect("admin API").serve(shutdown.clone()).await.expect("binds");
        Hooks { s, base: format!("http://{address}"), http: reqwest::Client::new(), shutdown }
    }

    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let mut request = self.http.request(method, format!("{}{path}", self.base)).bearer_auth(TOKEN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("the API answers");
        let status = response.status();
        let text = response.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
    }

    async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(Method::POST, path, Some(body)).await
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::GET, path, None).await
    }

    /// Creates an endpoint of `hooks`, expecting success.
    async fn create(&self, body: Value) -> Value {
        let (status, endpoint) = self.post("/v1/routes/hooks/endpoints", body).await;
        assert_eq!(status, StatusCode::CREATED, "{endpoint}");
        endpoint
    }

    /// Emits events to `hooks`, waits for endpoint changes to be read, and runs relay cycles
    /// until nothing is due; returns the ids.
    async fn emit_and_deliver(&self, types: &[&str]) -> Vec<i64> {
        tokio::time::sleep(REFRESH + Duration::from_millis(100)).await;
        let mut ids = Vec::new();
        for event_type in types {
            let event = NewEvent::new("hooks", *event_type, format!(r#"{{"type":"{event_type}"}}"#));
            ids.push(self.s.db.store.insert(&event, self.s.clock.now()).await.unwrap());
        }
        self.cycles().await;
        ids
    }

    async fn cycles(&self) {
        for _ in 0..4 {
            self.s.ferry.relay.cycle(&CancellationToken::new()).await.expect("relay cycle");
        }
    }
}

/// The requests the receiver got at `path`, by event type.
fn received(receiver: &Receiver, path: &str) -> Vec<String> {
    let requests = receiver.requests();
    let at = requests.iter().filter(|r| r.path == path);
    at.map(|r| serde_json::from_slice::<Value>(&r.body).unwrap()["type"].as_str().unwrap().to_string()).collect()
}

/// Whether the last request at `path` carries a valid signature by each of `secrets`, in order.
fn signed_by(receiver: &Receiver, path: &str, secrets: &[&str]) -> bool {
    let requests = receiver.requests();
    let r = requests.iter().rev().find(|r| r.path == path).expect("a request");
    let id = r.header("webhook-id").unwrap();
    let timestamp: u64 = r.header("webhook-timestamp").unwrap().parse().unwrap();
    let expected: Vec<String> =
        secrets.iter().map(|s| policy::sign(&policy::secret_bytes(s).unwrap(), id, timestamp, &r.body)).collect();
    r.header("webhook-signature").unwrap().split(' ').collect::<Vec<_>>() == expected
}

async fn endpoints_are_managed_at_run_time(db: TestDb) {
    let receiver = Receiver::start().await;
    let hooks = Hooks::start(db, &receiver).await;

    // Created while ferry runs: the secret is shown this once, whole.
    let a = hooks
        .create(json!({
            "url": receiver.url("/a"),
            "event_types": ["order.*"],
            "headers": { "X-Tenant": "acme", "Authorization": "Bearer s3cr3t" }
        }))
        .await;
    let a_id = a["id"].as_str().unwrap().to_string();
    let a_secret = a["secret"].as_str().unwrap().to_string();
    assert!(a_id.starts_with("ep_") && a_secret.starts_with("whsec_") && a_secret.len() > 40, "{a}");
    assert_eq!(a["delivery_route"].as_str(), Some(format!("hooks/{a_id}").as_str()));
    assert_eq!(a["headers"], json!({ "x-tenant": "acme", "authorization": "***" }), "secret-looking values masked");
    let b = hooks.create(json!({ "url": receiver.url("/b"), "description": "everything" })).await;
    let b_id = b["id"].as_str().unwrap().to_string();

    // Shown afterwards, the secret is masked; listed too.
    let (status, shown) = hooks.get(&format!("/v1/endpoints/{a_id}")).await;
    assert_eq!(status, StatusCode::OK);
    let masked = shown["secret"].as_str().unwrap();
    assert!(
        masked != a_secret
            && masked.starts_with("whsec_…")
            && a_secret.ends_with(masked.strip_prefix("whsec_…").unwrap()),
        "{masked}"
    );
    let (_, listed) = hooks.get("/v1/routes/hooks/endpoints").await;
    let ids: Vec<&str> = listed.as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&a_id.as_str()) && ids.contains(&b_id.as_str()));
    assert!(!listed.to_string().contains(&a_secret), "no secret in a listing");
    // An endpoint's own deliveries are enqueued only for one that exists.
    let route = "hooks/ep_0123456789abcdef0123";
    let (status, body) = hooks.post("/v1/events", json!({ "route": route, "type": "t", "payload": 1 })).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(body.to_string().contains("names no endpoint of route"), "{body}");
    // Nor past the endpoint's own filter.
    let direct = json!({ "route": format!("hooks/{a_id}"), "type": "invoice.paid", "payload": 1 });
    let (status, body) = hooks.post("/v1/events", direct).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("does not take events of type \"invoice.paid\" (its event_types: order.*)"), "{body}");

    // What cannot be an endpoint is refused, naming why.
    let (status, error) = hooks.post("/v1/routes/hooks/endpoints", json!({ "url": "http://evil.example.com/" })).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
    assert!(error.to_string().contains("route.hooks.endpoints.origins"), "{error}");
    let (status, error) = hooks.post("/v1/routes/plain/endpoints", json!({ "url": receiver.url("/x") })).await;
    assert!(status == StatusCode::BAD_REQUEST && error.to_string().contains("does not take endpoints"), "{error}");
    let (status, _) = hooks.post("/v1/routes/nowhere/endpoints", json!({ "url": receiver.url("/x") })).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    for header in ["webhook-signature", "Host", "keep-alive", "Transfer-Encoding"] {
        let bad_header = json!({ "url": receiver.url("/x"), "headers": { header: "forged" } });
        let (status, _) = hooks.post("/v1/routes/hooks/endpoints", bad_header).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{header}");
    }
    let upper = format!("HTTP://{}/x", receiver.addr);
    for url in [upper.as_str(), &receiver.url("/x#frag"), &receiver.url("/x y")] {
        let (status, error) = hooks.post("/v1/routes/hooks/endpoints", json!({ "url": url })).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{url}: {error}");
    }

    // A row edited by hand into something ferry cannot use costs that endpoint only: what it
    // is handed waits for it, it is shown as a conflict naming why, and it can be deleted, which
    // ends what waited FAILED, kept, like any deleted endpoint's.
    let garbage = ferry::store::StoredEndpoint {
        id: "ep_00000000000000000bad".into(),
        route: "hooks".into(),
        body: r#"{"url": "http://evil.example.com/", "secret": 7}"#.into(),
        unreadable: None,
    };
    assert!(hooks.s.db.store.insert_endpoint(&garbage).await.unwrap());
    let (status, error) = hooks.get(&format!("/v1/endpoints/{}", garbage.id)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{error}");

    // Each endpoint receives the event types it subscribes to, with its headers, signed with
    // its own secret.
    let first = hooks.emit_and_deliver(&["order.created", "user.created"]).await;
    assert_eq!(received(&receiver, "/a"), ["order.created"]);
    let mut at_b = received(&receiver, "/b");
    at_b.sort();
    assert_eq!(at_b, ["order.created", "user.created"]);
    let to_a = receiver.requests().into_iter().find(|r| r.path == "/a").unwrap();
    assert_eq!((to_a.header("x-tenant"), to_a.header("authorization")), (Some("acme"), Some("Bearer s3cr3t")));
    assert!(signed_by(&receiver, "/a", &[&a_secret]));
    let (_, event) = hooks.get(&format!("/v1/events/{}", first[0])).await;
    let garbage_route = format!("hooks/{}", garbage.id);
    let statuses = |event: &Value| -> Vec<(String, String)> {
        let deliveries = event["deliveries"].as_array().unwrap().iter();
        let mut statuses: Vec<_> = deliveries
            .map(|d| (d["route"].as_str().unwrap().to_string(), d["status"].as_str().unwrap().to_string()))
            .collect();
        statuses.sort();
        statuses
    };
    let mut expected = vec![
        (format!("hooks/{a_id}"), "SENT".to_string()),
        (format!("hooks/{b_id}"), "SENT".to_string()),
        (garbage_route.clone(), "PENDING".to_string()),
    ];
    expected.sort();
    assert_eq!((event["status"].as_str(), statuses(&event)), (Some("SENT"), expected.clone()), "{event}");
    let (status, _) = hooks.call(Method::DELETE, &format!("/v1/endpoints/{}", garbage.id), None).await;
    assert_eq!(status, StatusCode::OK, "an unusable row can be deleted");
    hooks.emit_and_deliver(&[]).await;
    let (_, event) = hooks.get(&format!("/v1/events/{}", first[0])).await;
    expected.iter_mut().filter(|(route, _)| *route == garbage_route).for_each(|(_, status)| *status = "FAILED".into());
    assert_eq!(statuses(&event), expected, "{event}");

    // Disabled, an endpoint is handed no new events, and what was handed to it before waits;
    // enabled again, it gets what waited.
    let now = hooks.s.clock.now();
    let held = hooks.s.db.store.insert(&NewEvent::new("hooks", "order.held", r#"{"type":"order.held"}"#), now).await;
    hooks.s.ferry.relay.cycle(&CancellationToken::new()).await.expect("handed on");
    let (status, disabled) = hooks.post(&format!("/v1/endpoints/{a_id}/disable"), json!({})).await;
    assert_eq!((status, disabled["enabled"].as_bool()), (StatusCode::OK, Some(false)));
    let paid = hooks.emit_and_deliver(&["order.paid"]).await;
    assert_eq!(received(&receiver, "/a"), ["order.created"], "a disabled endpoint receives nothing");
    assert_eq!(received(&receiver, "/b").len(), 4);
    let (_, event) = hooks.get(&format!("/v1/events/{}", paid[0])).await;
    assert_eq!(event["deliveries"].as_array().map(Vec::len), Some(1), "{event}");
    let (_, event) = hooks.get(&format!("/v1/events/{}", held.unwrap())).await;
    let a_route = format!("hooks/{a_id}");
    let waiting = event["deliveries"].as_array().unwrap().iter().find(|d| d["route"] == a_route.as_str()).unwrap();
    assert_eq!(waiting["status"], "PENDING", "{event}");
    let (_, copy) = hooks.get(&format!("/v1/events/{}", waiting["id"])).await;
    assert!(copy["waiting"].to_string().contains("is disabled"), "{copy}");
    hooks.post(&format!("/v1/endpoints/{a_id}/enable"), json!({})).await;
    hooks.emit_and_deliver(&[]).await;
    assert_eq!(received(&receiver, "/a"), ["order.created", "order.held"]);

    // A rotated secret signs at once; the previous one too until its time is up.
    let (status, rotated) =
        hooks.post(&format!("/v1/endpoints/{a_id}/rotate-secret"), json!({ "keep_previous": "1h" })).await;
    assert_eq!(status, StatusCode::OK, "{rotated}");
    let new_secret = rotated["secret"].as_str().unwrap().to_string();
    assert!(new_secret != a_secret && new_secret.starts_with("whsec_"));
    assert!(rotated["previous_secret_until"].is_string(), "{rotated}");
    hooks.emit_and_deliver(&["order.shipped"]).await;
    assert_eq!(received(&receiver, "/a"), ["order.created", "order.held", "order.shipped"]);
    assert!(signed_by(&receiver, "/a", &[&new_secret, &a_secret]), "both secrets sign, the new one first");
    let (status, error) =
        hooks.post(&format!("/v1/endpoints/{a_id}/rotate-secret"), json!({ "keep_previous": "31d" })).await;
    assert!(status == StatusCode::BAD_REQUEST && error.to_string().contains("at most"), "{error}");
    hooks.post(&format!("/v1/endpoints/{a_id}/rotate-secret"), json!({ "keep_previous": "0s" })).await;

    // Two changes made from the same reading: the second is refused, not lost over the first.
    let before = hooks.s.db.store.endpoint(&a_id).await.unwrap().unwrap();
    hooks.call(Method::PATCH, &format!("/v1/endpoints/{a_id}"), Some(json!({ "description": "first" }))).await;
    let second = ferry::store::StoredEndpoint {
        body: before.body.replace("\"description\":\"\"", "\"description\":\"second\""),
        ..before.clone()
    };
    assert!(!hooks.s.db.store.update_endpoint(&second, &before.body).await.unwrap(), "compared and set");

    // Changes are checked like creations; the secret changes only by rotation.
    let a_path = format!("/v1/endpoints/{a_id}");
    let patch = |body: Value| hooks.call(Method::PATCH, &a_path, Some(body));
    let (status, _) = patch(json!({ "url": "http://evil.example.com/" })).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = patch(json!({ "secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw" })).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, changed) = patch(json!({ "event_types": ["user.*"] })).await;
    assert_eq!((status, changed["event_types"].clone()), (StatusCode::OK, json!(["user.*"])));

    // An endpoint that fails is retried and failed on its own; the other is not sent it again.
    let (status, _) = hooks
        .call(Method::PATCH, &format!("/v1/endpoints/{b_id}"), Some(json!({ "url": receiver.url("/fail") })))
        .await;
    assert_eq!(status, StatusCode::OK);
    hooks.emit_and_deliver(&["user.deleted"]).await;
    hooks.s.clock.advance(Duration::from_secs(600));
    hooks.cycles().await;
    assert_eq!(received(&receiver, "/fail").len(), 2, "two attempts at the failing endpoint");
    assert_eq!(received(&receiver, "/a").iter().filter(|t| *t == "user.deleted").count(), 1, "once, not re-sent");
    let b_route = format!("hooks/{b_id}");
    let (_, count) = hooks.get(&format!("/v1/failed/count?route={}", b_route.replace('/', "%2F"))).await;
    assert_eq!(count["failed"], 1, "{count}");
    let (_, breakers) = hooks.get("/v1/breakers").await;
    let breaker = breakers.as_array().unwrap().iter().find(|b| b["route"] == b_route.as_str()).expect("its breaker");
    assert_eq!(breaker["consecutive_failures"], 2, "{breaker}");
    assert!(breakers.as_array().unwrap().iter().all(|b| b["route"] != format!("hooks/{a_id}").as_str()));
    // Fixed and resent, it is delivered.
    hooks.call(Method::PATCH, &format!("/v1/endpoints/{b_id}"), Some(json!({ "url": receiver.url("/b") }))).await;
    let (status, _) = hooks.post("/v1/failed/resend", json!({ "route": b_route })).await;
    assert_eq!(status, StatusCode::OK);
    hooks.emit_and_deliver(&[]).await;
    assert_eq!(received(&receiver, "/b").last().map(String::as_str), Some("user.deleted"));

    // Deleted, an endpoint is gone; a delivery made for it before ends FAILED, kept.
    hooks.s.ferry.relay.cycle(&CancellationToken::new()).await.unwrap();
    let held = hooks.s.db.store.insert(&NewEvent::new("hooks", "user.x", "{}"), hooks.s.clock.now()).await.unwrap();
    hooks.s.ferry.relay.cycle(&CancellationToken::new()).await.unwrap();
    let (status, _) = hooks.call(Method::DELETE, &format!("/v1/endpoints/{b_id}"), None).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = hooks.get(&format!("/v1/endpoints/{b_id}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    hooks.emit_and_deliver(&[]).await;
    let (_, event) = hooks.get(&format!("/v1/events/{held}")).await;
    let to_b = event["deliveries"].as_array().unwrap().iter().find(|d| d["route"] == b_route.as_str()).unwrap();
    assert_eq!(to_b["status"], "FAILED", "{event}");
    let copy = hooks.s.db.store.get(to_b["id"].as_i64().unwrap()).await.unwrap().unwrap();
    assert!(copy.last_error.as_deref().unwrap_or_default().contains("deleted"), "{:?}", copy.last_error);
}

/// On an ordered route, each endpoint delivers a key's events in order, and a delivery that ends
/// FAILED holds back that endpoint's later events of the key, not the other endpoints'.
async fn each_endpoint_keeps_the_order_of_a_key(db: TestDb) {
    let receiver = Receiver::start().await;
    let hooks = Hooks::start(db, &receiver).await;
    hooks.create(json!({ "url": receiver.url("/fail") })).await;
    let ok = hooks.create(json!({ "url": receiver.url("/ok") })).await;
    tokio::time::sleep(REFRESH + Duration::from_millis(100)).await;
    for event_type in ["first", "second"] {
        let event = NewEvent::new("hooks", event_type, format!(r#"{{"type":"{event_type}"}}"#)).with_key("k");
        hooks.s.db.store.insert(&event, hooks.s.clock.now()).await.unwrap();
    }
    for _ in 0..3 {
        hooks.cycles().await;
        hooks.s.clock.advance(Duration::from_secs(600));
    }
    assert_eq!(received(&receiver, "/ok"), ["first", "second"]);
    assert_eq!(received(&receiver, "/fail"), ["first", "first"], "the key waits behind its first event");
    let ok_route = ok["delivery_route"].as_str().unwrap();
    let (_, failed) = hooks.get("/v1/failed").await;
    let failed = failed["events"].as_array().cloned().unwrap_or_default();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0]["route"] != ok_route && failed[0]["event_type"] == "first", "{failed:?}");
}

/// An endpoint whose row cannot be read (a BLOB body, as SQLite lets a hand edit store; on
/// PostgreSQL a body that is not an endpoint) costs that endpoint only, and loses it nothing: from
/// a fresh start, with the row already broken, the other endpoint and the plain route are
/// delivered, the broken one is shown as a conflict, and since which types it takes is not known
/// it is handed a copy of every event, held. Once the row is fixed, it gets the copies of the types
/// it takes, in their key's order; the other copy is dropped, so it neither holds back the key
/// (the route is ordered) nor fails.
async fn an_endpoint_row_that_cannot_be_read_costs_that_endpoint_only_and_loses_it_nothing(db: TestDb) {
    let receiver = Receiver::start().await;
    let row = |id: &str, path: &str| ferry::store::StoredEndpoint {
        id: id.into(),
        route: "hooks".into(),
        body: format!(
            r#"{{"url":"{}","secret":"whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=","enabled":true,"event_types":["order.*"],
                "created_at":"2026-01-01T00:00:00Z","updated_at":"2026-01-01T00:00:00Z"}}"#,
            receiver.url(path)
        ),
        unreadable: None,
    };
    let (good, broken) = ("ep_0000000000000000000a", "ep_0000000000000000000b");
    for endpoint in [row(good, "/good"), row(broken, "/broken")] {
        assert!(db.store.insert_endpoint(&endpoint).await.unwrap());
    }
    let edit = match db.backend {
        Backend::Sqlite => format!("UPDATE ferry_endpoints SET body = CAST(body AS BLOB) WHERE id = '{broken}'"),
        Backend::Postgres => format!(r#"UPDATE ferry_endpoints SET body = '{{"url": 1}}' WHERE id = '{broken}'"#),
    };
    assert_eq!(crate::rows::sql(&db, &edit).await.unwrap(), 1);

    let hooks = Hooks::start(db, &receiver).await;
    tokio::time::sleep(REFRESH + Duration::from_millis(100)).await;
    let mut ids = Vec::new();
    for event_type in ["invoice.paid", "order.created", "order.paid"] {
        let event = NewEvent::new("hooks", event_type, format!(r#"{{"type":"{event_type}"}}"#)).with_key("k");
        ids.push(hooks.s.db.store.insert(&event, hooks.s.clock.now()).await.unwrap());
    }
    let plain = hooks.s.db.store.insert(&NewEvent::new("plain", "t", "{}"), hooks.s.clock.now()).await.unwrap();
    hooks.cycles().await;
    assert_eq!(received(&receiver, "/good"), ["order.created", "order.paid"], "the other endpoint is delivered");
    assert!(received(&receiver, "/broken").is_empty());
    assert_eq!(hooks.s.db.store.get(plain).await.unwrap().unwrap().status, Status::Sent, "the plain route too");
    let (status, error) = hooks.get(&format!("/v1/endpoints/{broken}")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{error}");
    assert!(error.to_string().contains(&format!("endpoint {broken} cannot be used as stored")), "{error}");
    let copy_for_broken = |event: &Value| {
        let deliveries = event["deliveries"].as_array().cloned().unwrap_or_default();
        deliveries.into_iter().find(|d| d["route"] == format!("hooks/{broken}").as_str())
    };
    for id in &ids {
        let (_, event) = hooks.get(&format!("/v1/events/{id}")).await;
        let copy =
            copy_for_broken(&event).unwrap_or_else(|| panic!("event {id} has a copy held for {broken}: {event}"));
        assert_eq!(copy["status"], "PENDING", "{event}");
    }

    let fix = format!("UPDATE ferry_endpoints SET body = '{}' WHERE id = '{broken}'", row(broken, "/broken").body);
    assert_eq!(crate::rows::sql(&hooks.s.db, &fix).await.unwrap(), 1);
    hooks.emit_and_deliver(&[]).await;
    assert_eq!(received(&receiver, "/broken"), ["order.created", "order.paid"], "what it takes, in order");
    let (_, event) = hooks.get(&format!("/v1/events/{}", ids[0])).await;
    assert_eq!(copy_for_broken(&event), None, "the copy it does not take is gone: {event}");
    let (_, count) = hooks.get("/v1/failed/count").await;
    assert_eq!(count["failed"], 0, "{count}");
    assert_eq!(received(&receiver, "/good"), ["order.created", "order.paid"], "the other endpoint got nothing twice");
}

/// Rows written by SQL past what ferry writes cost only themselves. A body over
/// `MAX_STORED_BODY` is not loaded: its endpoint is held as unreadable and says the body's size.
/// A route's endpoints past `MAX_PER_ROUTE` by id are not read into the table the relay reads
/// every second, and one log line says so. The route's other endpoints and the plain route are
/// delivered as before.
async fn endpoint_rows_past_what_ferry_writes_cost_only_themselves(db: TestDb) {
    let receiver = Receiver::start().await;
    let row = |n: usize, path: &str, types: &str| ferry::store::StoredEndpoint {
        id: format!("ep_{n:020x}"),
        route: "hooks".into(),
        body: format!(
            r#"{{"url":"{}","secret":"whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=","enabled":true,"event_types":["{types}"],
                "created_at":"2026-01-01T00:00:00Z","updated_at":"2026-01-01T00:00:00Z"}}"#,
            receiver.url(path)
        ),
        unreadable: None,
    };
    let limit = ferry::endpoints::MAX_PER_ROUTE;
    // The first by id, one whose body is made too long, those that fill the route up to its
    // limit (subscribed to nothing sent here), and two past it.
    let mut rows = vec![row(0, "/good", "order.*"), row(1, "/huge", "order.*")];
    rows.extend((2..limit).map(|n| row(n, "/quiet", "none.*")));
    rows.extend((limit..limit + 2).map(|n| row(n, "/over", "order.*")));
    for endpoint in &rows {
        assert!(db.store.insert_endpoint(endpoint).await.unwrap());
    }
    let spaces = match db.backend {
        Backend::Sqlite => "printf('%.*c', 2000000, ' ')",
        Backend::Postgres => "repeat(' ', 2000000)",
    };
    let huge = &rows[1].id;
    let edit = format!("UPDATE ferry_endpoints SET body = body || {spaces} WHERE id = '{huge}'");
    assert_eq!(crate::rows::sql(&db, &edit).await.unwrap(), 1);
    let size = rows[1].body.len() + 2_000_000;

    let hooks = Hooks::start(db, &receiver).await;
    tokio::time::sleep(REFRESH + Duration::from_millis(100)).await;
    let event = NewEvent::new("hooks", "order.created", r#"{"type":"order.created"}"#);
    hooks.s.db.store.insert(&event, hooks.s.clock.now()).await.unwrap();
    let plain = hooks.s.db.store.insert(&NewEvent::new("plain", "t", "{}"), hooks.s.clock.now()).await.unwrap();
    let log = crate::common::Captured::default();
    hooks.cycles().with_subscriber(log.subscriber()).await;
    assert_eq!(received(&receiver, "/good"), ["order.created"]);
    assert!(received(&receiver, "/over").is_empty() && received(&receiver, "/huge").is_empty());
    assert_eq!(hooks.s.db.store.get(plain).await.unwrap().unwrap().status, Status::Sent, "the plain route too");
    let log = log.text();
    assert!(log.contains(&format!("route hooks has more than {limit} endpoints")), "{log}");
    assert!(log.contains(&format!("its body is {size} bytes, more than the 1048576 ferry writes")), "{log}");
    let (status, error) = hooks.get(&format!("/v1/endpoints/{huge}")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{error}");
    assert!(error.to_string().contains(&format!("its body is {size} bytes")), "{error}");
}

crate::both_backends!(
    endpoints_are_managed_at_run_time,
    each_endpoint_keeps_the_order_of_a_key,
    an_endpoint_row_that_cannot_be_read_costs_that_endpoint_only_and_loses_it_nothing,
    endpoint_rows_past_what_ferry_writes_cost_only_themselves
);

/// Two instances share the outbox. One hands events on to an endpoint created a moment ago; the
/// other, whose endpoint table was read before that, claims the deliveries: it reads the
/// endpoints again and delivers, rather than failing them as if the endpoint were gone, except a
/// keyed event of the ordered route, claimed without its order, which it hands back to claim
/// again in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_made_a_moment_ago_is_delivered_by_every_instance() {
    let receiver = Receiver::start().await;
    let hooks = Hooks::start(TestDb::new(Backend::Postgres).await, &receiver).await;
    let config = hooks.s.db.config(&Hooks::config(&hooks.s.db, &receiver));
    let other = ferry::service::Ferry::start(&config, hooks.s.clock.clone()).await.expect("second instance");
    let never = CancellationToken::new();
    other.relay.cycle(&never).await.expect("the other instance reads the endpoints: none yet");

    let endpoint = hooks.create(json!({ "url": receiver.url("/new") })).await;
    let now = hooks.s.clock.now();
    let id = hooks.s.db.store.insert(&NewEvent::new("hooks", "a.b", r#"{"type":"a.b"}"#), now).await.unwrap();
    let keyed = NewEvent::new("hooks", "k.b", r#"{"type":"k.b"}"#).with_key("k");
    hooks.s.db.store.insert(&keyed, now).await.unwrap();
    hooks.s.ferry.relay.cycle(&never).await.expect("this instance hands the events on");
    let stats = other.relay.cycle(&never).await.expect("the other delivers");
    assert_eq!((stats.claimed, stats.sent, stats.failed), (1, 1, 0), "{stats:?}");
    assert_eq!(received(&receiver, "/new"), ["a.b"], "the keyed event, claimed without its order, was handed back");
    let stats = other.relay.cycle(&never).await.expect("the other delivers the keyed event in order");
    assert_eq!((stats.claimed, stats.sent, stats.failed), (1, 1, 0), "{stats:?}");
    assert_eq!(received(&receiver, "/new"), ["a.b", "k.b"]);
    let (_, event) = hooks.get(&format!("/v1/events/{id}")).await;
    assert_eq!(event["deliveries"][0]["route"].as_str(), endpoint["delivery_route"].as_str());
    assert_eq!(event["deliveries"][0]["status"], "SENT", "{event}");
}

/// An endpoint whose receiver never answers holds up no other endpoint of its route: its calls
/// take at most half of the template's instances (one of two here), its further deliveries wait
/// for those, and once it has that many carried on past their cycle it is left out of the claims
/// while the other endpoint goes on. Batches of two (a copy for each endpoint) make the four
/// workers' deliveries to the hung endpoint run at once, before any is carried on: unbounded,
/// they would take both instances in turn, and the other endpoint's events wait out the hung
/// calls (50 s each).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_never_answers_holds_up_no_other_endpoint() {
    let receiver = Receiver::start().await;
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_http"]);
    let origin = format!("http://{}", receiver.addr);
    let config = db.config(&format!(
        r#"
        [relay]
        batch_size = 2
        workers = 4
        poll_interval = "10ms"
        idle_poll_max = "50ms"
        shutdown_grace = "500ms"
        [plugins]
        dir = {plugins:?}
        timeout = "60s"
        [sandbox.http]
        http = ["{origin}"]
        instances = 2
        [route.hooks.endpoints]
        origins = ["{origin}"]
        config = {{ timeout_ms = "50000", concurrency = "1" }}
        "#
    ));
    let ferry = ferry::service::Ferry::start(&config, Arc::new(ferry::clock::SystemClock)).await.expect("starts");
    let ops = Ops::new(ferry.settings.get(), ferry.store.clone(), ferry.clock.clone(), FrontEnd::Api);
    for path in ["/hang", "/ok"] {
        let input = ferry::endpoints::EndpointInput { url: Some(receiver.url(path)), ..Default::default() };
        ops.create_endpoint("hooks", input).await.expect("endpoint created");
    }
    let waker = ferry.relay.waker();
    let shutdown = CancellationToken::new();
    let relay = {
        let token = shutdown.clone();
        tokio::spawn(async move { ferry.relay.run(token).await })
    };
    for round in 1..=4 {
        for _ in 0..5 {
            let event = NewEvent::new("hooks", "a.b", r#"{"type":"a.b"}"#);
            db.store.insert(&event, ferry::clock::SystemClock.now()).await.unwrap();
        }
        waker.notify_one();
        eventually(
            Duration::from_secs(10),
            &format!("round {round}: the answering endpoint has its events"),
            || async { (received(&receiver, "/ok").len() == 5 * round).then_some(()) },
        )
        .await;
        // Long enough for this round's deliveries to the hung endpoint to be carried on.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    assert_eq!(received(&receiver, "/hang"), ["a.b"], "one call at a time to the endpoint that hangs");
    shutdown.cancel();
    relay.await.unwrap();
    // The hung endpoint's deliveries are handed back at the stop, kept for later.
    assert_eq!(crate::common::count(&db.store, Status::Failed).await, 0);
    assert_eq!(crate::common::count(&db.store, Status::Processing).await, 0);
}

/// One route with 1,000 endpoints, each with its own filter, and 10,000 events: every endpoint
/// receives exactly the events it subscribes to, none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_endpoints_each_receive_what_they_subscribe_to() {
    let receiver = Receiver::start().await;
    let db = TestDb::new(Backend::Postgres).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_http"]);
    let origin = format!("http://{}", receiver.addr);
    let config = db.config(&format!(
        r#"
        [relay]
        batch_size = 500
        [plugins]
        dir = {plugins:?}
        [sandbox.http]
        http = ["{origin}"]
        instances = 8
        [route.hooks.endpoints]
        origins = ["{origin}"]
        "#
    ));
    let ferry = ferry::service::Ferry::start(&config, Arc::new(ferry::clock::SystemClock)).await.expect("starts");
    let ops = Ops::new(ferry.settings.get(), ferry.store.clone(), ferry.clock.clone(), FrontEnd::Api);
    let expected = fleet::populate(&ops, &db.store, &origin, ferry.clock.now()).await;
    let total: usize = expected.iter().sum();

    let started = Instant::now();
    let shutdown = CancellationToken::new();
    let relay = {
        let token = shutdown.clone();
        tokio::spawn(async move { ferry.relay.run(token).await })
    };
    eventually(Duration::from_secs(600), "every delivery made", || async {
        (receiver.received() >= total).then_some(())
    })
    .await;
    let took = started.elapsed();
    shutdown.cancel();
    relay.await.unwrap();
    println!("{} endpoints, {} events, {total} deliveries in {took:.1?}", fleet::ENDPOINTS, fleet::EVENTS);

    let mut got: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in receiver.requests() {
        got.entry(r.path.clone()).or_default().push(r.header("webhook-id").unwrap().to_string());
    }
    for (i, want) in expected.iter().enumerate() {
        let ids = got.get(&format!("/ep/{i}")).cloned().unwrap_or_default();
        assert_eq!(ids.len(), *want, "endpoint {i} receives exactly what it subscribes to");
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len(), "endpoint {i}: none twice");
    }
    assert_eq!(got.values().map(Vec::len).sum::<usize>(), total, "nothing anywhere else");
    assert_eq!(crate::common::count(&db.store, Status::Pending).await, 0);
    assert_eq!(crate::common::count(&db.store, Status::Failed).await, 0);
}

/// `ferry endpoints` through the binary: the same operations, the secret printed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_through_the_command_line() {
    let db = TestDb::new(Backend::Sqlite).await;
    let config = db.dir.path().join("ferry.toml");
    let routes = "[route.hooks.endpoints]\norigins = [\"https://*.example.com\"]\n[route.plain]\nplugin = \"log\"\n";
    std::fs::write(&config, format!("[database]\nurl = {:?}\n{routes}", db.url)).unwrap();
    let ferry = |args: &[&str]| crate::e2e::run_ferry(&config, args);
    let json = |text: &str| -> Value { serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}")) };

    let (code, out, err) = ferry(&[
        "endpoints",
        "create",
        "hooks",
        "--url",
        "https://a.example.com/in",
        "--event-type",
        "order.*",
        "--header",
        "X-Tenant=acme",
    ]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("created; its signing secret is shown this once"), "{out}");
    let secret_line = out.lines().find(|l| l.starts_with("secret:")).unwrap();
    let a_secret = secret_line.split_whitespace().nth(1).unwrap().to_string();
    assert!(a_secret.starts_with("whsec_") && a_secret.len() > 40, "{out}");

    let (code, out, err) =
        ferry(&["--json", "endpoints", "create", "hooks", "--url", "https://b.example.com/in", "--disabled"]);
    assert_eq!(code, Some(0), "{err}");
    let b = json(&out);
    let b_id = b["id"].as_str().unwrap().to_string();
    assert_eq!((b["enabled"].as_bool(), b["event_types"].clone()), (Some(false), json!([])));

    // Listed and shown, secrets are masked.
    let (_, out, _) = ferry(&["endpoints", "list", "hooks"]);
    assert!(out.contains(&b_id) && out.contains("disabled") && out.contains("order.*"), "{out}");
    assert!(!out.contains(&a_secret));
    let (_, out, _) = ferry(&["--json", "endpoints", "show", &b_id]);
    assert!(json(&out)["secret"].as_str().unwrap().starts_with("whsec_…"), "{out}");

    // Changed: only what is given; a filter can be dropped again.
    let (_, out, _) = ferry(&["--json", "endpoints", "update", &b_id, "--event-type", "user.*"]);
    assert_eq!(
        (json(&out)["event_types"].clone(), json(&out)["url"].clone()),
        (json!(["user.*"]), json!("https://b.example.com/in"))
    );
    let (_, out, _) = ferry(&["--json", "endpoints", "update", &b_id, "--all-event-types"]);
    assert_eq!(json(&out)["event_types"], json!([]));
    let (_, out, _) = ferry(&["--json", "endpoints", "enable", &b_id]);
    assert_eq!(json(&out)["enabled"], true);

    // Errors name the input; codes as for every command.
    let (code, out, _) = ferry(&["--json", "endpoints", "update", &b_id, "--url", "https://evil.com/"]);
    assert_eq!(code, Some(1));
    assert_eq!(json(&out)["error"]["code"], "bad_request");
    assert!(out.contains("route.hooks.endpoints.origins"), "{out}");
    let (code, out, _) = ferry(&["--json", "endpoints", "create", "plain", "--url", "https://a.example.com/"]);
    assert!(code == Some(1) && out.contains("does not take endpoints"), "{out}");
    let (code, out, _) =
        ferry(&["--json", "endpoints", "create", "hooks", "--url", "https://a.example.com/", "--header", "novalue"]);
    assert!(code == Some(1) && out.contains("NAME=VALUE"), "{out}");

    // Rotated: a new secret, printed this once, the previous one signing for a while.
    let (code, out, err) = ferry(&["--json", "endpoints", "rotate-secret", &b_id, "--keep-previous", "2h"]);
    assert_eq!(code, Some(0), "{err}");
    let rotated = json(&out);
    assert!(rotated["secret"].as_str().unwrap().len() > 40 && rotated["previous_secret_until"].is_string(), "{out}");
    assert_ne!(rotated["secret"], b["secret"]);

    // Deleted: gone.
    let (code, _, err) = ferry(&["endpoints", "delete", &b_id]);
    assert_eq!(code, Some(0), "{err}");
    let (code, out, _) = ferry(&["--json", "endpoints", "show", &b_id]);
    assert_eq!((code, json(&out)["error"]["code"].clone()), (Some(1), json!("not_found")));
}

/// `ferry config check` starts the endpoint template (its plugin and `init`) and warns about
/// endpoint origins the plugin's sandbox does not grant, a wildcard grant covering its subdomains.
#[test]
fn config_check_covers_the_endpoint_template() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = plugins_dir(dir.path(), &["ferry_transport_http"]);
    let config = dir.path().join("ferry.toml");
    let write = |origins: &str, template: &str| {
        let text = format!(
            "[database]\nurl = \"sqlite://{}\"\n[plugins]\ndir = {plugins:?}\n[sandbox.http]\nhttp = [\"https://*.example.com\"]\n\
             [route.hooks.endpoints]\norigins = [{origins}]\nconfig = {{ {template} }}\n",
            dir.path().join("never-created.db").display()
        );
        std::fs::write(&config, text).unwrap();
    };
    write("\"https://a.example.com\", \"https://*.example.com\"", "timeout_ms = \"500\"");
    let (code, text, stderr) = crate::e2e::run_ferry(&config, &["config", "check"]);
    assert_eq!(code, Some(0), "{text}{stderr}");
    assert!(text.contains("hooks/*") && !text.contains("warning"), "{text}");

    write("\"https://hooks.other.org\"", "timeout_ms = \"500\"");
    let (_, text, _) = crate::e2e::run_ferry(&config, &["config", "check"]);
    assert!(
        text.contains("route.hooks.endpoints.origins: https://hooks.other.org:443 is not among sandbox.http.http"),
        "{text}"
    );

    write("\"https://a.example.com\"", "timeout_ms = \"not a number\"");
    let (code, text, _) = crate::e2e::run_ferry(&config, &["config", "check"]);
    assert_eq!(code, Some(1), "the template's config is checked by the plugin's init: {text}");
    assert!(text.contains("timeout_ms"), "{text}");
}
