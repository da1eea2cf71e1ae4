//! The admin HTTP API over a real socket: authentication, every operation, the error answers to
//! bad requests, readiness, metrics, and agreement with the served OpenAPI description. Ferry runs
//! on a manual clock with the `scripted` test plugin, driven one relay cycle at a time.

use std::time::Duration;

use ferry::clock::Clock as _;
use ferry::event::Status;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::common::{Stepped, TestDb, plugins_dir};

pub(crate) const TOKEN: &str = "test-admin-token-0123456789";

pub(crate) struct Api {
    pub(crate) s: Stepped,
    pub(crate) base: String,
    http: reqwest::Client,
    shutdown: CancellationToken,
}

impl Drop for Api {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Ferry with the admin API on a free port; routes `s` and `t` use the scripted plugin (two
/// attempts at most, no jitter), and so do the destinations of route `fan` (`fan/orders` for
/// `order.*`, `fan/all` for every type); `orphan` a plugin that is not installed when `orphan`
/// is set.
pub(crate) async fn start(db: TestDb, orphan: bool) -> Api {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let orphan = if orphan { "[route.orphan]\nplugin = \"not-installed\"" } else { "" };
    let config = format!(
        r#"
        [admin]
        listen = "127.0.0.1:0"
        token = "{TOKEN}"
        [relay]
        lease = "10s"
        [plugins]
        dir = {plugins:?}
        timeout = "300ms"
        [retry]
        max_attempts = 2
        jitter = "none"
        [route.s]
        plugin = "scripted"
        [route.t]
        plugin = "scripted"
        [route.fan.destinations.orders]
        plugin = "scripted"
        event_types = ["order.*"]
        [route.fan.destinations.all]
        plugin = "scripted"
        {orphan}
        "#
    );
    let s = Stepped::start(db, &config).await;
    let shutdown = CancellationToken::new();
    let (address, _task) = s.ferry.admin().expect("admin API").serve(shutdown.clone()).await.expect("binds");
    Api { s, base: format!("http://{address}"), http: reqwest::Client::new(), shutdown }
}

impl Api {
    /// Sends a request with the right token; returns the status and the JSON body.
    pub(crate) async fn call(&self, method: Method, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        let (status, text) = self.call_text(method, path, body).await;
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")))
    }

    /// As [`Api::call`], with the body as text.
    pub(crate) async fn call_text(&self, method: Method, path: &str, body: Option<Value>) -> (StatusCode, String) {
        let mut request = self.http.request(method, format!("{}{path}", self.base)).bearer_auth(TOKEN);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("the API answers");
        (response.status(), response.text().await.unwrap())
    }

    pub(crate) async fn get(&self, path: &str) -> (StatusCode, Value) {
        self.call(Method::GET, path, None).await
    }

    pub(crate) async fn post(&self, path: &str, body: Value) -> (StatusCode, Value) {
        self.call(Method::POST, path, Some(body)).await
    }

    /// Sends a request with a raw body and content type; returns the status and the error message.
    async fn raw(&self, method: Method, path: &str, content_type: &str, body: &str) -> (StatusCode, String) {
        let response = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(TOKEN)
            .header("content-type", content_type)
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        let status = response.status();
        let body: Value = response.json().await.expect("errors are JSON");
        (status, body["error"]["message"].as_str().expect("an error message").to_string())
    }

    pub(crate) async fn cycle(&self) {
        self.s.ferry.relay.cycle(&CancellationToken::new()).await.expect("relay cycle");
    }

    pub(crate) async fn enqueue(&self, route: &str, event_type: &str) -> i64 {
        let (status, body) =
            self.post("/v1/events", json!({ "route": route, "type": event_type, "payload": {} })).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        body["id"].as_i64().unwrap()
    }
}

/// Asserts an error answer: its status, its code, and that the message mentions `needle`.
fn assert_error((status, body): (StatusCode, Value), expected: StatusCode, needle: &str) {
    assert_eq!(status, expected, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(needle), "message {message:?} should mention {needle:?}");
    assert!(body["error"]["code"].is_string(), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_but_health_needs_the_bearer_token() {
    let api = start(TestDb::sqlite().await, false).await;
    let url = format!("{}/v1/stats", api.base);
    let answer = |request: reqwest::RequestBuilder| async move {
        let response = request.send().await.unwrap();
        let challenge = response.headers().get("www-authenticate").map(|v| v.to_str().unwrap().to_string());
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        (status, challenge, body["error"]["message"].as_str().unwrap_or_default().to_string())
    };
    let (status, challenge, message) = answer(api.http.get(&url)).await;
    assert_eq!((status, challenge.as_deref()), (StatusCode::UNAUTHORIZED, Some("Bearer")));
    assert!(message.contains("missing bearer token"), "{message}");
    let (status, _, message) = answer(api.http.get(&url).bearer_auth("test-admin-token-0123456780")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(message.contains("invalid bearer token"), "{message}");
    let (status, _, message) = answer(api.http.get(&url).basic_auth("admin", Some(TOKEN))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(message.contains("Bearer"), "{message}");
    for path in ["/metrics", "/v1/openapi.json", "/v1/failed", "/v1/plugins"] {
        let status = api.http.get(format!("{}{path}", api.base)).send().await.unwrap().status();
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path} without a token");
    }
    let posted = api.http.post(format!("{}/v1/events", api.base)).json(&json!({})).send().await.unwrap();
    assert_eq!(posted.status(), StatusCode::UNAUTHORIZED, "authentication comes before the body is read");

    for path in ["/health/live", "/health/ready"] {
        let response = api.http.get(format!("{}{path}", api.base)).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path} needs no token");
    }
    let (status, ready) = api.get("/health/ready").await;
    assert_eq!(
        (status, ready["status"].as_str(), ready["database"].as_str()),
        (StatusCode::OK, Some("ready"), Some("ok"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_while_a_route_has_no_plugin() {
    let api = start(TestDb::sqlite().await, true).await;
    let response = api.http.get(format!("{}/health/ready", api.base)).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["status"], "not_ready");
    assert_eq!(body["routes_without_plugin"], json!({ "orphan": "not-installed" }));
    assert_eq!(body["database"], "ok");
}

/// Enqueue, deliver, inspect with history, fail, count, list, resend, purge, breakers, stats and
/// metrics: the operations an operator uses, on both backends.
async fn operations_through_the_api(db: TestDb) {
    let api = start(db, false).await;

    // Enqueue outside a transaction; the relay delivers it; its history names the plugin version.
    let (status, body) = api
        .post(
            "/v1/events",
            json!({ "route": "s", "type": "order.created", "payload": { "n": 1 }, "key": "k1",
                    "headers": { "trace": "abc" }, "event_time": "2026-06-30T23:59:00Z" }),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let sent = body["id"].as_i64().unwrap();
    api.s.clock.advance(Duration::from_millis(40));
    api.cycle().await;
    let (status, event) = api.get(&format!("/v1/events/{sent}")).await;
    assert_eq!(status, StatusCode::OK);
    // A JSON payload comes back as JSON; as the stored text when asked (the dashboard does, so
    // JavaScript does not round its large numbers).
    assert_eq!((event["status"].as_str(), &event["payload_json"]), (Some("SENT"), &json!({ "n": 1 })));
    assert!(event.get("payload").is_none(), "{event}");
    let (status, text) = api.get(&format!("/v1/events/{sent}?payload=text")).await;
    assert_eq!((status, text["payload"].as_str()), (StatusCode::OK, Some(r#"{"n":1}"#)), "{text}");
    assert!(text.get("payload_json").is_none(), "{text}");
    assert_error(api.get(&format!("/v1/events/{sent}?payload=yaml")).await, StatusCode::BAD_REQUEST, "json or text");
    assert_eq!(event["ordering_key"], "k1");
    assert_eq!(event["event_time"], "2026-06-30T23:59:00Z");
    let history = event["attempts_history"].as_array().unwrap();
    assert_eq!(history.len(), 1, "{event}");
    let hash = api.s.ferry.registry.get("scripted").unwrap().hash.clone();
    assert_eq!(history[0]["outcome"], "sent");
    assert_eq!(history[0]["attempt"], 1);
    assert_eq!(history[0]["plugin"], "scripted");
    assert_eq!(history[0]["plugin_hash"].as_str(), Some(hash.as_str()));
    assert!(history[0]["instance"].as_str().is_some_and(|i| !i.is_empty()));

    // A binary payload, deferred by a delay, is not delivered before its time.
    let (status, body) = api
        .post("/v1/events", json!({ "route": "s", "type": "blob", "payload_base64": "AAEC/w==", "delay": "1m" }))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    let blob = body["id"].as_i64().unwrap();
    api.cycle().await;
    let (_, event) = api.get(&format!("/v1/events/{blob}")).await;
    assert_eq!((event["status"].as_str(), event["payload_base64"].as_str()), (Some("PENDING"), Some("AAEC/w==")));
    assert_eq!(event["content_type"], "application/octet-stream");

    // A permanent failure and an exhausted transient one; the history keeps both attempts.
    let permanent = api.enqueue("s", "permanent").await;
    let transient = api.enqueue("t", "transient").await;
    api.cycle().await;
    let (_, stats) = api.get("/v1/stats").await;
    assert_eq!(stats["last_attempt"], 1, "the transient event has one attempt left: {stats}");
    api.s.clock.advance(Duration::from_secs(5));
    api.cycle().await;
    let (_, event) = api.get(&format!("/v1/events/{transient}")).await;
    let outcomes: Vec<&str> =
        event["attempts_history"].as_array().unwrap().iter().map(|a| a["outcome"].as_str().unwrap()).collect();
    assert_eq!(outcomes, ["retry", "failed"], "{event}");
    assert_eq!(event["attempts_history"][1]["reason"], "attempts_exhausted");
    assert!(event["attempts_history"][1]["error"].as_str().unwrap().contains("scripted transient failure"));

    let (_, count) = api.get("/v1/failed/count").await;
    assert_eq!(count["failed"], 2);
    // Grouped by route, type and reason, with when each group failed; filtered by reason.
    let (status, summary) = api.get("/v1/failed/summary").await;
    assert_eq!((status, &summary["total"], &summary["truncated"]), (StatusCode::OK, &json!(2), &json!(false)));
    let groups: Vec<(&str, &str, &str, u64)> = summary["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            let text = |key: &str| g[key].as_str().unwrap();
            (text("route"), text("type"), text("reason"), g["count"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(groups, [("s", "permanent", "permanent", 1), ("t", "transient", "attempts_exhausted", 1)]);
    let first = &summary["groups"][0];
    assert_eq!(first["first_failed_at"], first["last_failed_at"], "{summary}");
    assert!(first["first_failed_at"].as_str().unwrap().starts_with("2026-"), "{summary}");
    let (_, summary) = api.get("/v1/failed/summary?reason=attempts_exhausted").await;
    assert_eq!((summary["total"].as_u64(), summary["groups"][0]["route"].as_str()), (Some(1), Some("t")));
    let (_, count) = api.get("/v1/failed/count?reason=permanent").await;
    assert_eq!(count["failed"], 1);
    let (_, page) = api.get("/v1/failed?reason=permanent").await;
    assert_eq!(page["events"][0]["id"].as_i64(), Some(permanent));
    assert_error(
        api.get("/v1/failed/summary?reason=gone").await,
        StatusCode::BAD_REQUEST,
        "reason must be one of permanent,",
    );
    let (_, count) = api.get("/v1/failed/count?route=t&type=transient").await;
    assert_eq!(count["failed"], 1);
    let (_, page) = api.get("/v1/failed?limit=1").await;
    assert_eq!(page["events"].as_array().unwrap().len(), 1);
    assert_eq!(page["events"][0]["id"].as_i64(), Some(permanent));
    assert_eq!(page["next_after"].as_i64(), Some(permanent));
    let (_, page) = api.get(&format!("/v1/failed?limit=1&after={permanent}")).await;
    assert_eq!(page["events"][0]["id"].as_i64(), Some(transient));
    // Newest first, a page at a time; and by the text of the last error.
    let (_, page) = api.get("/v1/failed?limit=1&order=newest").await;
    assert_eq!((page["events"][0]["id"].as_i64(), page["next_after"].as_i64()), (Some(transient), Some(transient)));
    let (_, page) = api.get(&format!("/v1/failed?limit=1&order=newest&after={transient}")).await;
    assert_eq!(page["events"][0]["id"].as_i64(), Some(permanent));
    let (_, page) = api.get(&format!("/v1/failed?limit=5&order=newest&after={permanent}")).await;
    assert_eq!(page["events"].as_array().map(Vec::len), Some(0), "{page}");
    assert_error(api.get("/v1/failed?order=random").await, StatusCode::BAD_REQUEST, "oldest or newest");
    assert_error(api.get("/v1/failed/count?order=newest").await, StatusCode::BAD_REQUEST, "order is not accepted");
    let (_, count) = api.get("/v1/failed/count?error=SCRIPTED%20TRANSIENT").await;
    assert_eq!(count["failed"], 1, "letter case aside");
    let (_, page) = api.get("/v1/failed?error=transient%20failure").await;
    assert_eq!(page["events"][0]["id"].as_i64(), Some(transient));
    let (_, count) = api.get("/v1/failed/count?error=no%20such%20words").await;
    assert_eq!(count["failed"], 0);
    let (_, summary) = api.get("/v1/failed/summary?error=transient").await;
    assert_eq!(summary["total"], 1, "{summary}");
    assert_error(api.get("/v1/failed?error=").await, StatusCode::BAD_REQUEST, "error must not be empty");

    // Resend one: it is delivered again, and its history grows rather than being replaced.
    let (status, _) = api.post(&format!("/v1/events/{permanent}/resend"), json!(null)).await;
    assert_eq!(status, StatusCode::OK);
    assert_error(
        api.post(&format!("/v1/events/{permanent}/resend"), json!(null)).await,
        StatusCode::CONFLICT,
        "PENDING",
    );
    assert_error(api.post("/v1/events/999999/resend", json!(null)).await, StatusCode::NOT_FOUND, "999999");
    api.cycle().await;
    let (_, event) = api.get(&format!("/v1/events/{permanent}")).await;
    assert_eq!(event["status"], "FAILED");
    assert_eq!(event["attempts"], 1, "attempts start again after a resend");
    assert_eq!(event["attempts_history"].as_array().unwrap().len(), 2, "the history is kept");

    // Bulk: resend by route, then purge by type.
    // (The resent transient event fails once more, later: a second retry of route t.)
    let (status, body) = api.post("/v1/failed/resend", json!({ "route": "t" })).await;
    assert_eq!((status, body["resent"].as_u64()), (StatusCode::OK, Some(1)));
    assert_eq!(api.s.db.store.get(transient).await.unwrap().unwrap().status, Status::Pending);
    let (status, body) = api.post("/v1/failed/purge", json!({ "type": "permanent" })).await;
    assert_eq!((status, body["purged"].as_u64()), (StatusCode::OK, Some(1)));
    assert_error(api.get(&format!("/v1/events/{permanent}")).await, StatusCode::NOT_FOUND, "no event");

    // Breakers: opened by hand, the route's events wait; closed, they flow.
    let (status, breaker) = api.post("/v1/breakers/s/open", json!({ "reason": "maintenance" })).await;
    assert_eq!(
        (status, breaker["state"].as_str(), breaker["reason"].as_str()),
        (StatusCode::OK, Some("open"), Some("maintenance"))
    );
    let waiting = api.enqueue("s", "order.created").await;
    api.cycle().await;
    assert_eq!(api.s.db.store.get(waiting).await.unwrap().unwrap().status, Status::Pending);
    let (_, routes) = api.get("/v1/routes").await;
    let s = routes.as_array().unwrap().iter().find(|r| r["route"] == "s").unwrap();
    let retry = &s["retry"];
    assert_eq!((retry["max_attempts"].as_u64(), retry["jitter"].as_str()), (Some(2), Some("none")), "{retry}");
    assert!(retry["backoff"].as_str().unwrap().starts_with("exponential from "), "{retry}");
    assert_eq!((s["breaker"]["state"].as_str(), s["plugin_loaded"].as_bool()), (Some("open"), Some(true)));
    assert_eq!(s["plugin_hash"].as_str(), Some(hash.as_str()));
    let (_, breakers) = api.get("/v1/breakers").await;
    assert_eq!(breakers[0]["route"], "s");
    let (status, breaker) = api.post("/v1/breakers/s/close", json!(null)).await;
    assert_eq!((status, breaker["state"].as_str()), (StatusCode::OK, Some("closed")));
    api.cycle().await;
    assert_eq!(api.s.db.store.get(waiting).await.unwrap().unwrap().status, Status::Sent);

    // Monitoring figures and metrics.
    let (status, stats) = api.get("/v1/stats?window=1d").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(stats["routes"]["s"]["SENT"], 2, "{stats}");
    assert_eq!(stats["counts"]["PENDING"], 2, "{stats}");
    assert_eq!(stats["stuck"], 0);
    let latency = &stats["latency"];
    assert_eq!(latency["samples"], 2, "{stats}");
    assert_eq!(latency["from_created"]["max_ms"], 40, "the first event waited 40ms: {stats}");
    assert_eq!(
        latency["from_event_time"]["max_ms"], 60_040,
        "the first event's own time was a minute before it was enqueued: {stats}"
    );
    assert_eq!(stats["oldest_pending_age_seconds"], 5.0, "the deferred blob was enqueued 5s ago: {stats}");

    let response = api.http.get(format!("{}/metrics", api.base)).bearer_auth(TOKEN).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(response.headers()["content-type"].to_str().unwrap().starts_with("application/openmetrics-text"));
    let metrics = response.text().await.unwrap();
    for line in [
        r#"ferry_events_delivered_total{route="s",plugin="scripted"} 2"#,
        r#"ferry_events_retried_total{route="t",plugin="scripted"} 2"#,
        r#"ferry_events_failed_total{route="t",plugin="scripted",reason="attempts_exhausted"} 1"#,
        r#"ferry_events_failed_total{route="s",plugin="scripted",reason="permanent"} 2"#,
        r#"ferry_events{route="s",status="PENDING"} 1"#,
        r#"ferry_events{route="t",status="PENDING"} 1"#,
        r#"ferry_breaker_state{route="s"} 0"#,
        r#"ferry_breaker_state{route="t"} 0"#,
        "ferry_events_stuck 0",
        "ferry_relay_idle_workers 0",
        r#"ferry_delivery_latency_seconds_count{route="s"} 2"#,
        "ferry_batch_size_count",
        "ferry_claim_duration_seconds_count",
        "ferry_record_duration_seconds_count",
        "# EOF",
    ] {
        assert!(metrics.contains(line), "metrics lack {line:?}:\n{metrics}");
    }
    // Each route started its instance at start-up (s, t and fan's two destinations), and served
    // every call with it; every call, and its wait, was timed.
    let count = |series: &str| -> u64 {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(&format!("{series} ")))
            .unwrap_or_else(|| panic!("no {series}:\n{metrics}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let plugin_series = |name: &str| count(&format!(r#"ferry_plugin_{name}_seconds_count{{plugin="scripted"}}"#));
    assert_eq!(plugin_series("instance_start"), 4, "{metrics}");
    assert_eq!(plugin_series("call_duration"), 7, "four batches of s, three of t:\n{metrics}");
    assert_eq!(plugin_series("instance_wait"), 7, "every call waited for its instance, if only for nothing");
    // Every delivered batch's outcomes were written, and timed.
    assert!(!metrics.contains("ferry_record_duration_seconds_count 0\n"), "no batch recorded:\n{metrics}");
    assert!(metrics.contains("ferry_oldest_pending_age_seconds 5.0"), "the deferred blob is 5s old:\n{metrics}");

    // The dashboard's per-minute figures agree with the counters.
    let (status, activity) = api.get("/v1/activity").await;
    assert_eq!(status, StatusCode::OK);
    let minutes = activity["minutes"].as_array().unwrap();
    assert_eq!(minutes.len(), 60, "an hour of minutes");
    let sum = |key: &str| minutes.iter().map(|m| m[key].as_u64().unwrap()).sum::<u64>();
    assert_eq!((sum("delivered"), sum("retried"), sum("failed")), (2, 2, 3), "{activity}");
    assert!(minutes.iter().any(|m| m["p99_ms"].as_f64().is_some_and(|ms| ms > 30.0)), "the 40 ms wait: {activity}");

    // Plugins: listed with their routes; a reload of unchanged files changes nothing.
    let (_, plugins) = api.get("/v1/plugins").await;
    assert_eq!(plugins["plugins"][0]["name"], "scripted");
    assert_eq!(plugins["plugins"][0]["routes"], json!(["fan/all", "fan/orders", "s", "t"]));
    let (status, reload) = api.post("/v1/plugins/reload", json!(null)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(reload["files"][0]["result"], "unchanged", "{reload}");
}

async fn destinations_through_the_api(db: TestDb) {
    let api = start(db, false).await;
    let order = api.enqueue("fan", "order.created").await;
    let other = api.enqueue("fan", "user.created").await;
    api.cycle().await;
    let (status, event) = api.get(&format!("/v1/events/{order}")).await;
    assert_eq!((status, event["status"].as_str()), (StatusCode::OK, Some("SENT")));
    let deliveries = event["deliveries"].as_array().expect("deliveries listed");
    let routes: Vec<&str> = deliveries.iter().map(|d| d["route"].as_str().unwrap()).collect();
    assert_eq!(routes, ["fan/all", "fan/orders"], "{event}");
    assert!(deliveries.iter().all(|d| d["status"] == "PENDING" && d["attempts"] == 0), "{event}");
    let (_, copy) = api.get(&format!("/v1/events/{}", deliveries[1]["id"])).await;
    assert_eq!(copy["parent_id"].as_i64(), Some(order));
    let (_, event) = api.get(&format!("/v1/events/{other}")).await;
    assert_eq!(event["deliveries"].as_array().map(Vec::len), Some(1), "user.created only goes to fan/all");

    // A destination's breaker, through the route's name with its slash encoded.
    let (status, breaker) = api.post("/v1/breakers/fan%2Forders/open", json!({ "reason": "crm down" })).await;
    assert_eq!(
        (status, breaker["route"].as_str(), breaker["state"].as_str()),
        (StatusCode::OK, Some("fan/orders"), Some("open"))
    );
    api.cycle().await;
    let (_, event) = api.get(&format!("/v1/events/{order}")).await;
    let statuses: Vec<&str> =
        event["deliveries"].as_array().unwrap().iter().map(|d| d["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, ["SENT", "PENDING"], "only the open destination waits: {event}");
    let (_, routes) = api.get("/v1/routes").await;
    let orders = routes.as_array().unwrap().iter().find(|r| r["route"] == "fan/orders").expect("listed");
    assert_eq!((orders["destination_of"].as_str(), orders["event_types"][0].as_str()), (Some("fan"), Some("order.*")));
    assert_eq!(orders["breaker"]["state"], "open");
    let fan = routes.as_array().unwrap().iter().find(|r| r["route"] == "fan").expect("the route itself is listed");
    assert_eq!((fan["plugin"].as_str(), fan["plugin_loaded"].as_bool()), (Some(""), Some(true)), "{fan}");
    assert_eq!(fan["destinations"], json!(["fan/all", "fan/orders"]));
    let (_, count) = api.get("/v1/failed/count?route=fan/orders").await;
    assert_eq!(count["failed"], 0);

    // The route's own breaker, opened by hand, holds its events back before they are handed on.
    let (status, _) = api.post("/v1/breakers/fan/open", json!({ "reason": "pause every destination" })).await;
    assert_eq!(status, StatusCode::OK);
    let held = api.enqueue("fan", "order.updated").await;
    api.cycle().await;
    let (_, event) = api.get(&format!("/v1/events/{held}")).await;
    assert_eq!((event["status"].as_str(), event.get("deliveries")), (Some("PENDING"), None), "{event}");
    api.post("/v1/breakers/fan/close", json!(null)).await;
    api.cycle().await;
    let (_, event) = api.get(&format!("/v1/events/{held}")).await;
    assert_eq!(event["deliveries"].as_array().map(Vec::len), Some(2), "{event}");
}

crate::both_backends!(operations_through_the_api, destinations_through_the_api);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_errors_that_name_the_input() {
    use StatusCode as S;
    let api = start(TestDb::sqlite().await, false).await;
    let json = "application/json";
    let post = |body: &'static str| api.raw(Method::POST, "/v1/events", json, body);
    let expect = |(status, message): (StatusCode, String), want: StatusCode, needle: &str| {
        assert_eq!(status, want, "{message}");
        assert!(message.contains(needle), "message {message:?} should mention {needle:?}");
    };
    expect(post(r#"{"route": "s", "type": "#).await, S::BAD_REQUEST, "EOF");
    expect(post(r#"[1, 2]"#).await, S::BAD_REQUEST, "invalid type");
    expect(post(r#"{"type": "x", "payload": 1}"#).await, S::BAD_REQUEST, "missing field `route`");
    expect(
        post(r#"{"route": "s", "type": "x", "payload": 1, "colour": "red"}"#).await,
        S::BAD_REQUEST,
        "unknown field `colour`",
    );
    expect(post(r#"{"route": 7, "type": "x", "payload": 1}"#).await, S::BAD_REQUEST, "route: invalid type");
    expect(post(r#"{"route": "s", "type": "x"}"#).await, S::BAD_REQUEST, "missing payload");
    expect(
        post(r#"{"route": "s", "type": "x", "payload": 1, "payload_base64": "AA=="}"#).await,
        S::BAD_REQUEST,
        "not both",
    );
    expect(post(r#"{"route": "s", "type": "x", "payload_base64": "%%%"}"#).await, S::BAD_REQUEST, "payload_base64");
    expect(
        post(r#"{"route": "nowhere", "type": "x", "payload": 1}"#).await,
        S::BAD_REQUEST,
        "\"nowhere\" is not configured",
    );
    expect(post(r#"{"route": "s", "type": " ", "payload": 1}"#).await, S::BAD_REQUEST, "type must not be empty");
    expect(post(r#"{"route": "s", "type": "x", "payload": 1, "headers": {"": "v"}}"#).await, S::BAD_REQUEST, "header");
    expect(
        post(r#"{"route": "s", "type": "x", "payload": 1, "deliver_at": "tomorrow"}"#).await,
        S::BAD_REQUEST,
        "deliver_at",
    );
    expect(post(r#"{"route": "s", "type": "x", "payload": 1, "delay": "soon"}"#).await, S::BAD_REQUEST, "delay");
    // Due past the year 9999, which the database refuses: the request's fault, not the database's.
    expect(post(r#"{"route": "s", "type": "x", "payload": 1, "delay": "3000000d"}"#).await, S::BAD_REQUEST, "delay");
    expect(
        post(r#"{"route": "s", "type": "x", "payload": 1, "deliver_at": "0000-06-01T00:00:00Z"}"#).await,
        S::BAD_REQUEST,
        "deliver_at 0000-06-01 00:00:00 UTC is not a time ferry can store",
    );
    expect(
        post(r#"{"route": "s", "type": "x", "payload": 1, "event_time": "0000-06-01T00:00:00Z"}"#).await,
        S::BAD_REQUEST,
        "event_time",
    );
    expect(
        post(r#"{"route": "s", "type": "x", "payload": 1, "max_attempts": -1}"#).await,
        S::BAD_REQUEST,
        "max_attempts",
    );
    expect(
        api.raw(Method::POST, "/v1/events", "text/plain", "route=s").await,
        S::UNSUPPORTED_MEDIA_TYPE,
        "application/json",
    );
    assert_eq!(api.s.db.store.counts().await.unwrap().values().sum::<u64>(), 0, "nothing was stored");

    assert_error(api.get("/v1/events/abc").await, S::BAD_REQUEST, "positive integer, got \"abc\"");
    assert_error(api.get("/v1/events/0").await, S::BAD_REQUEST, "positive integer");
    assert_error(api.get("/v1/events/424242").await, S::NOT_FOUND, "no event with id 424242");
    assert_error(api.get("/v1/failed?limit=0").await, S::BAD_REQUEST, "limit must be between 1 and 10000, got 0");
    assert_error(api.get("/v1/failed?limit=10001").await, S::BAD_REQUEST, "got 10001");
    assert_error(api.get("/v1/failed?limit=ten").await, S::BAD_REQUEST, "limit");
    assert_error(api.get("/v1/failed?after=-").await, S::BAD_REQUEST, "after");
    assert_error(api.get("/v1/failed?from=yesterday").await, S::BAD_REQUEST, "from must be an RFC 3339 time");
    assert_error(
        api.get("/v1/failed/count?from=2026-07-02T00:00:00Z&before=2026-07-01T00:00:00Z").await,
        S::BAD_REQUEST,
        "must be earlier than before",
    );
    assert_error(api.get("/v1/failed/count?limit=5").await, S::BAD_REQUEST, "limit is not accepted here");
    assert_error(api.get("/v1/failed?colour=red").await, S::BAD_REQUEST, "unknown field `colour`");
    assert_error(api.get("/v1/failed?route=").await, S::BAD_REQUEST, "route must not be empty");
    assert_error(api.get("/v1/stats?window=0s").await, S::BAD_REQUEST, "window");
    assert_error(api.get("/v1/stats?window=90d").await, S::BAD_REQUEST, "at most 30d");
    assert_error(api.get("/v1/stats?window=abc").await, S::BAD_REQUEST, "window");
    assert_error(api.post("/v1/failed/resend", json!({})).await, S::BAD_REQUEST, "\"all\": true");
    assert_error(
        api.post("/v1/failed/purge", json!({ "through_id": 1_000_000 })).await,
        S::BAD_REQUEST,
        "\"all\": true",
    );
    assert_error(
        api.get("/v1/failed/count?through_id=0").await,
        S::BAD_REQUEST,
        "through_id must be a positive event id",
    );
    assert_error(api.call(Method::POST, "/v1/failed/purge", None).await, S::BAD_REQUEST, "all");
    let (status, body) = api.post("/v1/failed/purge", json!({ "all": true })).await;
    assert_eq!((status, body["purged"].as_u64()), (S::OK, Some(0)));
    assert_error(api.post("/v1/failed/resend", json!({ "all": "yes" })).await, S::BAD_REQUEST, "invalid type");
    assert_error(api.post("/v1/breakers/nowhere/open", json!({})).await, S::NOT_FOUND, "\"nowhere\" is not configured");
    assert_error(api.post("/v1/breakers/s/open", json!({ "why": "x" })).await, S::BAD_REQUEST, "unknown field `why`");
    assert_error(api.post("/v1/breakers/%FF/close", json!(null)).await, S::BAD_REQUEST, "route in the path");
    let long = "why ".repeat(600);
    assert_error(
        api.post("/v1/breakers/s/open", json!({ "reason": long })).await,
        S::BAD_REQUEST,
        "reason is 2400 bytes long; give at most 2048",
    );
    assert_error(api.post("/v1/events/1/fail", json!({ "reason": long })).await, S::BAD_REQUEST, "reason is 2400");
    assert_error(api.get("/v1/nothing-here").await, S::NOT_FOUND, "no endpoint GET /v1/nothing-here");
    assert_error(api.call(Method::DELETE, "/v1/events", None).await, S::METHOD_NOT_ALLOWED, "DELETE is not allowed");
    // A JSON payload is stored as sent: a number past 64 bits, the keys' order and spacing, a
    // repeated key (read back through a JSON parser, it would have come back as none of these).
    let exact = r#"{"n": 12345678901234567890123, "b": 1, "a": 2, "a": 3}"#;
    let response = api
        .http
        .post(format!("{}/v1/events", api.base))
        .bearer_auth(TOKEN)
        .header("content-type", json)
        .body(format!(r#"{{"route": "s", "type": "x", "payload": {exact} }}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), S::CREATED);
    let id = response.json::<Value>().await.unwrap()["id"].as_i64().unwrap();
    let (_, text) = api.get(&format!("/v1/events/{id}?payload=text")).await;
    assert_eq!(text["payload"].as_str(), Some(exact), "{text}");

    // Last: the server closes the connection after refusing a body this large, and a request
    // after it could be sent on that connection as it closes.
    let big = format!(r#"{{"route": "s", "type": "x", "payload": "{}"}}"#, "x".repeat(3 << 20));
    let (status, message) = api.raw(Method::POST, "/v1/events", json, &big).await;
    assert_eq!(status, S::PAYLOAD_TOO_LARGE, "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_description_matches_the_endpoints() {
    let api = start(TestDb::sqlite().await, false).await;
    let (status, doc) = api.get("/v1/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().unwrap();
    let mut operations = 0;
    for (path, methods) in paths {
        for (method, operation) in methods.as_object().unwrap() {
            operations += 1;
            assert!(operation["summary"].is_string(), "{method} {path} has a summary");
            let concrete = path.replace("{id}", "1").replace("{route}", "s");
            let method: Method = method.to_uppercase().parse().unwrap();
            let body = (method == Method::POST).then(|| json!({}));
            let (status, answer) = api.call_text(method.clone(), &concrete, body).await;
            let fallback = answer.contains("no endpoint") || status == StatusCode::METHOD_NOT_ALLOWED;
            assert!(!fallback, "{method} {path} is described but not served: {status} {answer}");
            let documented = operation["responses"].as_object().unwrap();
            assert!(
                documented.contains_key(status.as_str()),
                "{method} {path} answered {status}, not documented: {answer}"
            );
        }
    }
    // Every served API route is described: 30 protected operations and the two health checks (the
    // dashboard's pages under /ui are not API).
    assert_eq!(operations, 32, "update openapi.json when adding or removing an endpoint");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_is_recorded_for_events_no_plugin_could_take() {
    let api = start(TestDb::sqlite().await, true).await;
    let id = api.s.db.store.insert(&ferry::NewEvent::new("orphan", "x", "{}"), api.s.clock.now()).await.unwrap();
    api.cycle().await;
    let (_, event) = api.get(&format!("/v1/events/{id}")).await;
    assert_eq!(event["status"], "FAILED");
    let attempt = &event["attempts_history"][0];
    assert_eq!((attempt["outcome"].as_str(), attempt["reason"].as_str()), (Some("failed"), Some("no_transport")));
    assert_eq!(attempt["plugin"], "not-installed");
    assert!(attempt["plugin_hash"].is_null(), "no version ran: {attempt}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_session_is_a_cookie_and_a_key_and_neither_works_alone() {
    let api = start(TestDb::sqlite().await, false).await;
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let url = |path: &str| format!("{}{path}", api.base);

    // Signed out, /ui is the sign-in form, with a policy that only lets ferry's own files run.
    let page = http.get(url("/ui")).send().await.unwrap();
    let policy = page.headers()["content-security-policy"].to_str().unwrap().to_string();
    assert!(policy.contains("script-src 'self'") && policy.contains("frame-ancestors 'none'"), "{policy}");
    assert!(page.text().await.unwrap().contains("Admin token"));
    let script = http.get(url("/ui/app.js")).send().await.unwrap();
    assert!(script.headers()["content-type"].to_str().unwrap().starts_with("text/javascript"));

    // A wrong token: refused without a cookie. A post from another site: refused.
    let sign_in = |token: &str, origin: Option<&str>| {
        let mut request = http
            .post(url("/ui/session"))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={token}"));
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        request.send()
    };
    let wrong = sign_in("not-the-token-0123456789", None).await.unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert!(wrong.headers().get("set-cookie").is_none());
    assert!(wrong.text().await.unwrap().contains("Wrong token"));
    let elsewhere = sign_in(TOKEN, Some("http://evil.example")).await.unwrap();
    assert_eq!(elsewhere.status(), StatusCode::FORBIDDEN);
    assert!(elsewhere.headers().get("set-cookie").is_none());

    // The right token: a cookie scripts cannot read, and a page holding the key once.
    let origin = api.base.clone();
    let signed_in = sign_in(TOKEN, Some(&origin)).await.unwrap();
    assert_eq!(signed_in.status(), StatusCode::OK);
    let set = signed_in.headers()["set-cookie"].to_str().unwrap().to_string();
    for part in ["ferry_session=", "HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(set.contains(part), "{set} has {part}");
    }
    let cookie = set.split(';').next().unwrap().to_string();
    assert!(!cookie.contains(TOKEN));
    let handed = signed_in.text().await.unwrap();
    let key = handed.split("name=\"ferry-key\" content=\"").nth(1).unwrap().split('"').next().unwrap().to_string();
    assert_eq!(key.len(), 64, "{key}");
    assert!(!handed.contains(TOKEN));
    // The page served for the cookie alone holds neither the key nor the token.
    let page = http.get(url("/ui")).header("cookie", &cookie).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("/ui/app.js") && !page.contains(&key) && !page.contains(TOKEN), "{page}");

    // The cookie alone, or with a wrong key, opens nothing, reading included; with its key, all.
    let call = |method: reqwest::Method, path: &str, key: Option<&str>| {
        let mut request = http.request(method, url(path)).header("cookie", &cookie);
        if let Some(key) = key {
            request = request.header("x-ferry-session", key);
        }
        request.header("content-type", "application/json").body("{}").send()
    };
    let wrong_key = "0".repeat(64);
    for key in [None, Some(wrong_key.as_str())] {
        let read = call(reqwest::Method::GET, "/v1/stats", key).await.unwrap();
        assert_eq!(read.status(), StatusCode::UNAUTHORIZED);
        let error: Value = read.json().await.unwrap();
        assert!(error["error"]["message"].as_str().unwrap().contains("X-Ferry-Session"), "{error}");
        assert_eq!(
            call(reqwest::Method::POST, "/v1/breakers/s/open", key).await.unwrap().status(),
            StatusCode::UNAUTHORIZED
        );
    }
    let (_, routes) = api.get("/v1/routes").await;
    assert!(routes.as_array().unwrap().iter().all(|r| r["breaker"]["state"] == "closed"), "nothing was opened");
    let read = call(reqwest::Method::GET, "/v1/stats", Some(&key)).await.unwrap();
    assert_eq!((read.status(), read.headers()["cache-control"].to_str().unwrap()), (StatusCode::OK, "no-store"));
    assert_eq!(call(reqwest::Method::POST, "/v1/breakers/s/open", Some(&key)).await.unwrap().status(), StatusCode::OK);

    // Another browser's made-up cookie is nobody's session.
    let stranger = http.get(url("/v1/stats")).header("cookie", format!("ferry_session={}", "a".repeat(64))).send();
    assert_eq!(stranger.await.unwrap().status(), StatusCode::UNAUTHORIZED);

    // Signing out ends the session for every copy of the cookie and key.
    let out = call(reqwest::Method::POST, "/ui/session/end", Some(&key)).await.unwrap();
    assert_eq!(out.status(), StatusCode::NO_CONTENT);
    assert!(out.headers()["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
    let after = call(reqwest::Method::GET, "/v1/stats", Some(&key)).await.unwrap();
    assert_eq!(after.status(), StatusCode::UNAUTHORIZED);
    let error: Value = after.json().await.unwrap();
    assert!(error["error"]["message"].as_str().unwrap().contains("sign in again"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sign_ins_from_an_address_that_guesses_are_refused_for_a_while_and_cannot_hold_a_connection() {
    let api = start(TestDb::sqlite().await, false).await;
    let http = reqwest::Client::new();
    // A sign-in whose body never finishes is answered 408 after admin.header_timeout (10s by
    // default) instead of holding its connection.
    let mut slow = tokio::net::TcpStream::connect(api.base.trim_start_matches("http://")).await.unwrap();
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    slow.write_all(b"POST /ui/session HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\ntoken=").await.unwrap();
    let mut answer = vec![0u8; 4096];
    let read =
        tokio::time::timeout(Duration::from_secs(15), slow.read(&mut answer)).await.expect("answered in time").unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]).to_string();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");

    // Ten wrong sign-ins: each answered at once.
    let sign_in = |token: &str| {
        http.post(format!("{}/ui/session", api.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("token={token}"))
            .send()
    };
    let started = std::time::Instant::now();
    for i in 0..10 {
        assert_eq!(sign_in("wrong-token-0123456789").await.unwrap().status(), StatusCode::UNAUTHORIZED, "attempt {i}");
    }
    assert!(started.elapsed() < Duration::from_secs(3), "wrong tokens are not answered slowly (nobody waits in line)");
    // Then the address's sign-ins are refused, the right token's too, saying for how long.
    let refused = sign_in(TOKEN).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let wait: u64 = refused.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=61).contains(&wait), "{wait}");
    assert!(refused.headers().get("set-cookie").is_none());
    assert!(refused.text().await.unwrap().contains("Too many sign-ins from this address"));
    // Bearer clients behind the same address are not locked out by a guesser.
    let (status, _) = api.get("/v1/stats").await;
    assert_eq!(status, StatusCode::OK);
    let wrong = http.get(format!("{}/v1/stats", api.base)).bearer_auth("wrong-token-0123456789").send().await.unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(http.get(format!("{}/health/live", api.base)).send().await.unwrap().status(), StatusCode::OK);
}
