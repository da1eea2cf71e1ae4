//! Memory and scaling of the `ferry serve` binary on PostgreSQL.
//!
//! - Memory: resident set size of one process with all three bundled plugins loaded and a route
//!   on each (log into a file, http into a local receiver, kafka into a tansu broker): idle after
//!   start-up, and the peak while 30 000 events (10 000 per route) are delivered.
//! - Scaling: 1, 2 and 3 processes sharing one outbox of 60 000 events, delivered through the
//!   `scripted` test transport (accepts everything) with batches of 500: events per second from
//!   the commit of the events to the last SENT.
//!
//! Run: `cargo bench --bench resources [-- --events N]` (needs PostgreSQL as for the tests, the
//! plugins from `scripts/build-plugins` and tansu from `scripts/ensure-tansu`). Prints markdown
//! tables and writes `target/bench/resources.json`.

use ferry_testkit as common;

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::broker::broker;
use common::{Receiver, TestDb, plugins_dir, repo_root, spawn_serve};
use ferry::event::Status;

/// `cargo bench --bench resources -- [--events N]`
#[derive(clap::Parser)]
struct Args {
    /// Events of the scaling runs.
    #[arg(long, default_value_t = 60_000)]
    events: usize,
    /// Passed by `cargo bench` to every benchmark binary.
    #[arg(long, hide = true)]
    bench: bool,
}

fn events_option() -> usize {
    <Args as clap::Parser>::parse().events
}

/// The process's resident set size, in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kib / 1024.0
}

fn stop(mut child: Child) {
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
}

/// Fills `route` with `n` due events of about 220 bytes.
async fn fill(db: &TestDb, route: &str, n: usize) {
    sqlx::query(
        "INSERT INTO ferry_events (route, event_type, payload)
         SELECT $1, 'bench.event', convert_to('{\"n\":' || n || ',\"padding\":\"' || repeat('x', 200) || '\"}', 'UTF8')
         FROM generate_series(1, $2) AS n",
    )
    .bind(route)
    .bind(n as i64)
    .execute(db.postgres.as_ref().unwrap().pool())
    .await
    .expect("fill");
}

async fn wait_sent(db: &TestDb, n: usize, mut sample: impl FnMut()) {
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        sample();
        let counts = db.store.counts().await.expect("counts");
        assert_eq!(counts[&Status::Failed], 0, "events failed");
        if counts[&Status::Sent] as usize == n {
            return;
        }
        assert!(Instant::now() < deadline, "not all events SENT within 15 minutes: {counts:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn memory() -> (f64, f64) {
    let db = TestDb::postgres().await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_log", "ferry_transport_http", "ferry_transport_kafka"]);
    let out = db.dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let receiver = Receiver::start().await;
    let broker = broker().await;
    let topic = broker.topic("resources", 3).await;
    let mut text = format!("[database]\nurl = {:?}\n", db.url);
    text.push_str(&format!(
        "[plugins]\ndir = {plugins:?}\ncache_dir = {cache:?}\n\
         [sandbox.log]\ndirs = {{ \"/out\" = {out:?} }}\n\
         [sandbox.http]\nhttp = [\"http://{addr}\"]\n\
         [sandbox.kafka]\ntcp = [\"{broker}\", \"localhost:{port}\"]\ndns = true\n\
         [route.log]\nplugin = \"log\"\nconfig = {{ output = \"/out/events.jsonl\" }}\n\
         [route.http]\nplugin = \"http\"\nconfig = {{ url = \"{url}\", concurrency = \"32\" }}\n\
         [route.kafka]\nplugin = \"kafka\"\nconfig = {{ brokers = \"{broker}\", topic = \"{topic}\" }}\n",
        cache = common::target_dir().join("test-plugin-cache"),
        addr = receiver.addr,
        url = receiver.url("/bench"),
        broker = broker.addr(),
        port = broker.port,
    ));
    let config = db.dir.path().join("ferry.toml");
    std::fs::write(&config, text).unwrap();
    let child = spawn_serve(&config, &db.dir.path().join("serve.log"));
    let pid = child.id();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let idle = rss_mib(pid);
    for route in ["log", "http", "kafka"] {
        fill(&db, route, 10_000).await;
    }
    let mut peak = idle;
    wait_sent(&db, 30_000, || peak = peak.max(rss_mib(pid))).await;
    stop(child);
    (idle, peak)
}

async fn scaling(instances: usize, events: usize) -> f64 {
    let db = TestDb::postgres().await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let config = db.dir.path().join("ferry.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = {:?}\n[relay]\nbatch_size = 500\n[plugins]\ndir = {plugins:?}\ncache_dir = {:?}\n\
             [route.bench]\nplugin = \"scripted\"\n",
            db.url,
            common::target_dir().join("test-plugin-cache")
        ),
    )
    .unwrap();
    let children: Vec<Child> =
        (0..instances).map(|n| spawn_serve(&config, &db.dir.path().join(format!("serve-{n}.log")))).collect();
    tokio::time::sleep(Duration::from_secs(3)).await;
    fill(&db, "bench", events).await;
    let started = Instant::now();
    wait_sent(&db, events, || {}).await;
    let rate = events as f64 / started.elapsed().as_secs_f64();
    children.into_iter().for_each(stop);
    rate
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let events = events_option();
    let (idle, peak) = memory().await;
    eprintln!("memory: idle {idle:.1} MiB, peak under load {peak:.1} MiB");
    let mut scaling_rows = Vec::new();
    for instances in 1..=3 {
        let rate = scaling(instances, events).await;
        eprintln!("{instances} instances: {rate:.0} events/s");
        scaling_rows.push((instances, rate));
    }
    println!(
        "| resident set size | MiB |\n| --- | ---: |\n| idle, three plugins loaded | {idle:.1} |\n| peak under load | {peak:.1} |\n"
    );
    println!("| instances | events/s | vs one instance |\n| ---: | ---: | ---: |");
    let one = scaling_rows[0].1;
    for (n, rate) in &scaling_rows {
        println!("| {n} | {rate:.0} | {:.2}× |", rate / one);
    }
    let json = serde_json::json!({
        "rss_mib": { "idle": idle, "peak_under_load": peak },
        "scaling": scaling_rows.iter().map(|(n, r)| serde_json::json!({"instances": n, "events_per_second": r.round()})).collect::<Vec<_>>(),
        "events": events,
    });
    let out = repo_root().join("target/bench");
    std::fs::create_dir_all(&out).expect("create target/bench");
    std::fs::write(out.join("resources.json"), serde_json::to_string_pretty(&json).unwrap()).expect("write report");
}
