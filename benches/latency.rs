//! Latency from commit to delivery on PostgreSQL, p50 / p95 / p99, at low load (one event every
//! 20 ms) and high load (2 000 events per second), with LISTEN/NOTIFY on and off
//! (`relay.listen`); every other setting is the default, so with NOTIFY off the relay polls every
//! 250 ms, backing off to 1 s while idle.
//!
//! Each event is committed in its own transaction and timed when the commit returns; the
//! `scripted` test transport records the wall-clock time of the call that delivers it. At most
//! as many events are being committed at once as the pool has connections; where the machine
//! commits fewer than the load offers, the table's committed/s says so. Ferry runs
//! in this process and starts idle, as on a quiet system.
//!
//! Run: `cargo bench --bench latency [-- --seconds N]` (needs PostgreSQL as for the tests and the
//! plugins from `scripts/build-plugins`). Prints a markdown table and writes
//! `target/bench/latency.json`.

use ferry_testkit as common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{Running, TestDb, deliveries, plugins_dir, repo_root};
use ferry::NewEvent;
use ferry::event::Status;

#[derive(Debug, Clone, Copy)]
struct Load {
    name: &'static str,
    /// Events committed per tick, and ticks per second.
    per_tick: usize,
    tick: Duration,
}

const LOADS: [Load; 2] = [
    Load { name: "low (50/s)", per_tick: 1, tick: Duration::from_millis(20) },
    Load { name: "high (2000/s)", per_tick: 20, tick: Duration::from_millis(10) },
];

/// `cargo bench --bench latency -- [--seconds N]`
#[derive(clap::Parser)]
struct Args {
    /// Seconds per load.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Passed by `cargo bench` to every benchmark binary.
    #[arg(long, hide = true)]
    bench: bool,
}

fn seconds_option() -> u64 {
    <Args as clap::Parser>::parse().seconds
}

fn nanos_now() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

/// Percentile `p` (0..1) of sorted `values`, nearest rank.
fn percentile(values: &[f64], p: f64) -> f64 {
    values[((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1]
}

/// Milliseconds from commit to delivery of every event, one run, and the events committed per
/// second (below the load's nominal rate when the machine cannot commit that fast).
async fn measure(load: Load, listen: bool, seconds: u64) -> (Vec<f64>, f64) {
    let db = TestDb::postgres().await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let out = db.dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let config = format!(
        "[relay]\nlisten = {listen}\n[plugins]\ndir = {plugins:?}\nwatch = false\n\
         [sandbox.scripted]\ndirs = {{ \"/out\" = {out:?} }}\n\
         [route.bench]\nplugin = \"scripted\"\nconfig = {{ record = \"/out/deliveries.log\" }}\n"
    );
    let running = Running::start(&db.config(&config)).await;
    // Let the relay go idle (its poll interval backs off to the maximum).
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let pool = db.postgres.as_ref().unwrap().pool().clone();
    let committed: Arc<Mutex<HashMap<i64, u128>>> = Arc::default();
    // Emitters take turns at the pool's connections, about in the order they were started.
    // Unbounded, a load the machine cannot commit as fast as it is offered left emitters waiting
    // past the pool's acquire timeout, and their events silently out of the figure.
    let turns = Arc::new(tokio::sync::Semaphore::new(pool.options().get_max_connections() as usize));
    let mut ticker = tokio::time::interval(load.tick);
    let started = Instant::now();
    let end = started + Duration::from_secs(seconds);
    let mut emitters = Vec::new();
    while Instant::now() < end {
        ticker.tick().await;
        for _ in 0..load.per_tick {
            let (pool, committed, turns) = (pool.clone(), committed.clone(), turns.clone());
            emitters.push(tokio::spawn(async move {
                let _turn = turns.acquire_owned().await.expect("the semaphore is never closed");
                let mut tx = pool.begin().await?;
                let id = ferry::emit(&mut *tx, &NewEvent::new("bench", "bench.event", "{}")).await?;
                tx.commit().await?;
                committed.lock().unwrap().insert(id, nanos_now());
                anyhow::Ok(())
            }));
        }
    }
    let offered = emitters.len();
    for emitter in futures::future::join_all(emitters).await {
        emitter.expect("an emitter panicked").expect("an event could not be committed");
    }
    let committing = started.elapsed();
    let total = committed.lock().unwrap().len();
    assert_eq!(total, offered, "every event offered is committed");
    let deadline = Instant::now() + Duration::from_secs(120);
    while (db.store.counts().await.unwrap()[&Status::Sent] as usize) < total {
        assert!(Instant::now() < deadline, "not all {total} events delivered within 2 minutes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.stop().await;

    let committed = committed.lock().unwrap();
    let mut first: HashMap<i64, u128> = HashMap::new();
    for d in deliveries(&out) {
        first.entry(d.id).or_insert(d.nanos);
    }
    let mut latencies: Vec<f64> = committed
        .iter()
        .map(|(id, at)| {
            let delivered = first.get(id).unwrap_or_else(|| panic!("event {id} was not recorded as delivered"));
            delivered.saturating_sub(*at) as f64 / 1e6
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
    (latencies, total as f64 / committing.as_secs_f64())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let seconds = seconds_option();
    let mut rows = Vec::new();
    for listen in [true, false] {
        for load in LOADS {
            let (latencies, rate) = measure(load, listen, seconds).await;
            let (p50, p95, p99) =
                (percentile(&latencies, 0.50), percentile(&latencies, 0.95), percentile(&latencies, 0.99));
            eprintln!(
                "{} NOTIFY {}: {rate:.0} committed/s, p50 {p50:.1} ms p95 {p95:.1} ms p99 {p99:.1} ms",
                load.name,
                if listen { "on" } else { "off" }
            );
            rows.push((load.name, listen, latencies.len(), rate, p50, p95, p99));
        }
    }
    println!(
        "| load | LISTEN/NOTIFY | events | committed/s | p50 ms | p95 ms | p99 ms |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: |"
    );
    for (load, listen, n, rate, p50, p95, p99) in &rows {
        println!(
            "| {load} | {} | {n} | {rate:.0} | {p50:.1} | {p95:.1} | {p99:.1} |",
            if *listen { "on" } else { "off" }
        );
    }
    let json = serde_json::json!({
        "seconds": seconds,
        "results": rows.iter().map(|(load, listen, n, rate, p50, p95, p99)| serde_json::json!({
            "load": load, "listen": listen, "events": n, "committed_per_second": rate,
            "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
        })).collect::<Vec<_>>(),
    });
    let out = repo_root().join("target/bench");
    std::fs::create_dir_all(&out).expect("create target/bench");
    std::fs::write(out.join("latency.json"), serde_json::to_string_pretty(&json).unwrap()).expect("write report");
}
