//! Hot reload under load on PostgreSQL: while 1 000 events per second are committed, a new version
//! of the route's plugin is written into the watched plugins directory every 3 seconds. For each
//! version: the time from the file write until the registry has it active, and until the first
//! delivery attempt made with it (read from the delivery history, which records the plugin hash).
//! At the end every committed event must be SENT exactly once in the outbox: none lost, none failed.
//!
//! Run: `cargo bench --bench reload [-- --reloads N]` (needs PostgreSQL as for the tests and the
//! plugins from `scripts/build-plugins`). Prints a markdown table and writes
//! `target/bench/reload.json`.

use ferry_testkit as common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{Running, TestDb, install, plugin_variant, repo_root};
use ferry::NewEvent;
use ferry::event::Status;
use sha2::{Digest as _, Sha256};
use tokio_util::sync::CancellationToken;

/// `cargo bench --bench reload -- [--reloads N]`
#[derive(clap::Parser)]
struct Args {
    /// Plugin swaps under load.
    #[arg(long, default_value_t = 5)]
    reloads: usize,
    /// Passed by `cargo bench` to every benchmark binary.
    #[arg(long, hide = true)]
    bench: bool,
}

fn reloads_option() -> usize {
    <Args as clap::Parser>::parse().reloads
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let reloads = reloads_option();
    let db = TestDb::postgres().await;
    let plugins = db.dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let file = plugins.join("scripted.wasm");
    install(&file, &plugin_variant("ferry_test_scripted", "v0"));
    let config = format!(
        "[relay]\nbatch_size = 100\n[plugins]\ndir = {plugins:?}\ndebounce = \"100ms\"\n[route.bench]\nplugin = \"scripted\"\n"
    );
    let running = Running::start(&db.config(&config)).await;
    let stop_watch = CancellationToken::new();
    ferry::watch::spawn(running.registry.clone(), Duration::from_millis(100), stop_watch.clone()).expect("watch");

    // Load: 1 000 events per second, each in its own transaction.
    let pool = db.postgres.as_ref().unwrap().pool().clone();
    let emitted = Arc::new(AtomicUsize::new(0));
    let emitting = Arc::new(AtomicBool::new(true));
    let emitter = {
        let (pool, emitted, emitting) = (pool.clone(), emitted.clone(), emitting.clone());
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_millis(10));
            while emitting.load(Ordering::Relaxed) {
                ticker.tick().await;
                for _ in 0..10 {
                    let mut tx = pool.begin().await.expect("begin");
                    ferry::emit(&mut *tx, &NewEvent::new("bench", "bench.event", "{}")).await.expect("emit");
                    tx.commit().await.expect("commit");
                    emitted.fetch_add(1, Ordering::Relaxed);
                }
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;

    let mut rows = Vec::new();
    for n in 1..=reloads {
        let bytes = plugin_variant("ferry_test_scripted", &format!("v{n}"));
        let hash = hex::encode(Sha256::digest(&bytes));
        let written_at = chrono::Utc::now();
        let written = Instant::now();
        install(&file, &bytes);
        let active = loop {
            if running.registry.get("scripted").is_some_and(|p| p.hash == hash) {
                break written.elapsed();
            }
            assert!(written.elapsed() < Duration::from_secs(60), "version {n} not active after 60 s");
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        let first_use: chrono::DateTime<chrono::Utc> = loop {
            let first = sqlx::query_scalar("SELECT MIN(sent_started_at) FROM ferry_events WHERE sent_plugin_hash = $1")
                .bind(&hash)
                .fetch_one(&pool)
                .await
                .expect("history");
            if let Some(at) = first {
                break at;
            }
            assert!(written.elapsed() < Duration::from_secs(60), "version {n} never delivered");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let serving = (first_use - written_at).num_microseconds().unwrap_or(0) as f64 / 1000.0;
        let active = active.as_secs_f64() * 1000.0;
        eprintln!("version {n}: active after {active:.0} ms, first delivery after {serving:.0} ms");
        rows.push((n, active, serving));
        tokio::time::sleep(Duration::from_secs(3)).await;
    }

    emitting.store(false, Ordering::Relaxed);
    emitter.await.unwrap();
    let total = emitted.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let counts = db.store.counts().await.unwrap();
        if counts[&Status::Sent] as usize == total || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_watch.cancel();
    running.stop().await;
    let counts = db.store.counts().await.unwrap();
    let lost = total - counts[&Status::Sent] as usize;
    let failed = counts[&Status::Failed];
    let delivered_twice: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM ferry_events WHERE attempts > 1").fetch_one(&pool).await.unwrap();

    println!("| version | write → active (ms) | write → first delivery (ms) |\n| ---: | ---: | ---: |");
    for (n, active, serving) in &rows {
        println!("| {n} | {active:.0} | {serving:.0} |");
    }
    let mut actives: Vec<f64> = rows.iter().map(|r| r.1).collect();
    let mut servings: Vec<f64> = rows.iter().map(|r| r.2).collect();
    println!(
        "\nmedian: active {:.0} ms, first delivery {:.0} ms; {total} events committed, {lost} lost, {failed} failed, \
         {delivered_twice} delivered more than once",
        median(&mut actives),
        median(&mut servings)
    );
    let json = serde_json::json!({
        "events": total,
        "lost": lost,
        "failed": failed,
        "delivered_more_than_once": delivered_twice,
        "reloads": rows.iter().map(|(n, a, s)| serde_json::json!({"version": n, "active_ms": a, "first_delivery_ms": s})).collect::<Vec<_>>(),
    });
    let out = repo_root().join("target/bench");
    std::fs::create_dir_all(&out).expect("create target/bench");
    std::fs::write(out.join("reload.json"), serde_json::to_string_pretty(&json).unwrap()).expect("write report");
    assert_eq!((lost, failed), (0, 0), "events were lost or failed during reloads");
}
