//! How long one route with 1,000 webhook endpoints (each with its own filter) takes to deliver
//! 10,000 events — about 21,000 deliveries — into a local HTTP receiver, on PostgreSQL; in the
//! same run, the same number of requests made by a plain HTTP client with as many connections
//! as the http plugin may use (the floor, independent of ferry), and by ferry through one route
//! with one URL (what a delivery costs without endpoints).
//!
//! Run: `cargo bench --bench endpoints` (needs PostgreSQL as for the tests and the built plugins
//! from `scripts/build-plugins`). Prints a markdown table and writes `target/bench/endpoints.json`.

use ferry_testkit as common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Receiver, TestDb, fleet, plugins_dir};
use ferry::NewEvent;
use ferry::event::Status;
use ferry::ops::{FrontEnd, Ops};
use tokio_util::sync::CancellationToken;

/// Instances of the http plugin, and so connections the plain client gets too.
const INSTANCES: usize = 8;

/// Ferry on `db` with the http plugin allowed to reach `receiver`, and `routes` (TOML).
async fn start(db: &TestDb, receiver: &Receiver, routes: &str) -> ferry::service::Ferry {
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_http"]);
    let text = format!(
        "[relay]\nbatch_size = 500\n[plugins]\ndir = {plugins:?}\n[sandbox.http]\nhttp = [\"http://{}\"]\ninstances = {INSTANCES}\n{routes}",
        receiver.addr
    );
    ferry::service::Ferry::start(&db.config(&text), Arc::new(ferry::clock::SystemClock)).await.expect("ferry starts")
}

/// Runs `ferry`'s relay until `done` says so; returns how long it took.
async fn run_until(ferry: ferry::service::Ferry, done: impl AsyncFn() -> bool) -> Duration {
    let started = Instant::now();
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let relay = tokio::spawn(async move { ferry.relay.run(token).await });
    let deadline = started + Duration::from_secs(900);
    while !done().await {
        assert!(Instant::now() < deadline, "not done within 15 minutes");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = started.elapsed();
    shutdown.cancel();
    relay.await.expect("relay stops");
    took
}

/// 1,000 endpoints, 10,000 events: returns the deliveries made and how long they took.
async fn endpoints() -> (usize, Duration) {
    let receiver = Receiver::start().await;
    let db = TestDb::postgres().await;
    let origin = format!("http://{}", receiver.addr);
    let ferry = start(&db, &receiver, &format!("[route.hooks.endpoints]\norigins = [\"{origin}\"]\n")).await;
    let ops = Ops::new(ferry.settings.get(), ferry.store.clone(), ferry.clock.clone(), FrontEnd::Api);
    let expected = fleet::populate(&ops, &db.store, &origin, ferry.clock.now()).await;
    let total: usize = expected.iter().sum();
    let took = run_until(ferry, async || receiver.received() >= total).await;
    assert_eq!(receiver.received(), total, "no delivery twice");
    (total, took)
}

/// `deliveries` events through one route with one URL.
async fn one_url(deliveries: usize) -> Duration {
    let receiver = Receiver::start().await;
    let db = TestDb::postgres().await;
    let route = format!("[route.one]\nplugin = \"http\"\nconfig = {{ url = \"{}\" }}\n", receiver.url("/one"));
    let ferry = start(&db, &receiver, &route).await;
    for n in 0..deliveries {
        let event = NewEvent::new("one", "t.1", format!(r#"{{"n":{n}}}"#));
        db.store.insert(&event, ferry.clock.now()).await.expect("insert");
    }
    let store = db.store.clone();
    run_until(ferry, async || store.counts().await.expect("counts")[&Status::Sent] as usize == deliveries).await
}

/// `requests` POSTs by a plain HTTP client over `INSTANCES` keep-alive connections.
async fn plain_client(requests: usize) -> Duration {
    let receiver = Receiver::start().await;
    let client = reqwest::Client::new();
    let started = Instant::now();
    let workers = (0..INSTANCES).map(|w| {
        let (client, url) = (client.clone(), receiver.url(&format!("/plain/{w}")));
        async move {
            for n in (w..requests).step_by(INSTANCES) {
                let response = client.post(&url).body(format!(r#"{{"n":{n}}}"#)).send().await.expect("answered");
                assert!(response.status().is_success());
            }
        }
    });
    futures::future::join_all(workers).await;
    let took = started.elapsed();
    assert_eq!(receiver.received(), requests);
    took
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (deliveries, with_endpoints) = endpoints().await;
    let with_one_url = one_url(deliveries).await;
    let floor = plain_client(deliveries).await;
    let rate = |took: Duration| deliveries as f64 / took.as_secs_f64();
    let rows = [
        ("plain HTTP client, 8 connections (floor)", floor),
        ("ferry, one route with one URL", with_one_url),
        ("ferry, one route with 1,000 endpoints", with_endpoints),
    ];
    println!("| what | deliveries | seconds | deliveries/s | ÷ plain client |\n| --- | ---: | ---: | ---: | ---: |");
    for (what, took) in rows {
        println!(
            "| {what} | {deliveries} | {:.1} | {:.0} | {:.2}× |",
            took.as_secs_f64(),
            rate(took),
            rate(took) / rate(floor)
        );
    }
    let json = serde_json::json!({
        "endpoints": fleet::ENDPOINTS,
        "events": fleet::EVENTS,
        "deliveries": deliveries,
        "results": rows.iter().map(|(what, took)| serde_json::json!({
            "what": what,
            "seconds": (took.as_secs_f64() * 10.0).round() / 10.0,
            "deliveries_per_second": rate(*took).round(),
            "ratio_to_plain_client": ((rate(*took) / rate(floor)) * 100.0).round() / 100.0,
        })).collect::<Vec<_>>(),
    });
    let out = common::repo_root().join("target/bench");
    std::fs::create_dir_all(&out).expect("create target/bench");
    std::fs::write(out.join("endpoints.json"), serde_json::to_string_pretty(&json).unwrap()).expect("write report");
}
