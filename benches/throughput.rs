//! Ferry's throughput against two floors, on PostgreSQL and SQLite, at batch sizes 100, 500 and
//! 1000. The plugin accepts everything (the `scripted` test transport), so what is measured is
//! ferry itself: claim, hand the batch to a wasm component, record the outcomes and history.
//!
//! - The **minimal floor** is independent of ferry: a fenced outbox at its leanest
//!   (`benches/sql/minimal.sql`: only the outbox columns, two partial indexes; one claim UPDATE
//!   of a SKIP LOCKED sub-select, one completion UPDATE by claim token). On PostgreSQL
//!   `benches/sql/minimal.pgbench` under pgbench with two clients, its best on this machine (it
//!   does better with two than with four; ferry runs its default four workers, `--workers` to
//!   change them); on SQLite
//!   the same two statements in an in-process loop on one connection. Ferry ÷ this floor is the
//!   headline: what the design costs against what any fenced outbox must pay.
//! - **Ferry's own floor** is ferry's claim and complete statements without the relay or a
//!   plugin: on PostgreSQL `benches/sql/floor.pgbench` under pgbench; on
//!   SQLite `Store::claim` and `Store::complete` in a loop. Ferry ÷ this one measures the relay's
//!   overhead over its own statements.
//!
//! Run: `cargo bench --bench throughput [-- --events N --only postgres|sqlite --batch N --workers N --rounds N]`
//! (needs PostgreSQL and pgbench as for the tests, and the plugins from `scripts/build-plugins`).
//! Every figure is N events divided by the time from the moment they are all committed to the
//! moment the last is SENT; on PostgreSQL the floors' time is pgbench's own, from the moment its
//! connections are open, as ferry's connections are open before its clock starts. The three
//! measurements run one after the other in rounds (3 by default, each round starting with the
//! next of them); each rate reported is the median of its
//! rounds, and each ratio the median of the rounds' own ratios, with their range: on a shared
//! machine the floors themselves move by more than the differences measured. Prints a markdown
//! table and writes `target/bench/throughput.json`; for each measurement through ferry it also
//! prints, and the JSON keeps, the CPU its process used per event and the mean time of its
//! cycles' claims, plugin calls and records (from ferry's own histograms).

use ferry_testkit as common;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::spread::{Spread, rounds_note, thousandths};
use common::{Backend, Running, TestDb, plugins_dir, repo_root};
use ferry::event::{AttemptLog, CallLog, Completion, Disposition, Status};
use ferry::metrics::{PluginLabels, RouteLabels};
use ferry::store::{Claim, Store};

const BATCHES: [u32; 3] = [100, 500, 1000];

/// `cargo bench --bench throughput -- [--events N] [--only postgres|sqlite] [--batch N] [--workers N] [--rounds N]`
#[derive(clap::Parser)]
struct Options {
    /// Events per measurement.
    #[arg(long, default_value_t = 50_000)]
    events: usize,
    /// Measure one backend only.
    #[arg(long, value_parser = ["postgres", "sqlite"])]
    only: Option<String>,
    /// Measure one batch size only (default: 100, 500 and 1000).
    #[arg(long)]
    batch: Option<u32>,
    /// Ferry's relay workers (default: ferry's default, 4; the floors run two clients).
    #[arg(long)]
    workers: Option<u32>,
    /// Rounds of the three measurements for each database and batch size. Each round's ratios
    /// compare measurements taken moments apart; the report gives their median and range.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Passed by `cargo bench` to every benchmark binary.
    #[arg(long, hide = true)]
    bench: bool,
}

fn options() -> Options {
    clap::Parser::parse()
}

/// Fills the outbox with `n` due events of about 220 bytes each.
async fn fill(db: &TestDb, n: usize) {
    let payload = format!("{{\"n\":0,\"padding\":\"{}\"}}", "x".repeat(200));
    match db.backend {
        Backend::Postgres => {
            sqlx::query(
                "INSERT INTO ferry_events (route, event_type, payload)
                 SELECT 'bench', 'bench.event', convert_to($2, 'UTF8') FROM generate_series(1, $1)",
            )
            .bind(n as i64)
            .bind(&payload)
            .execute(db.postgres.as_ref().unwrap().pool())
            .await
            .expect("fill");
        }
        Backend::Sqlite => {
            sqlx::query(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                 INSERT INTO ferry_events (route, event_type, payload) SELECT 'bench', 'bench.event', ?2 FROM n",
            )
            .bind(n as i64)
            .bind(payload.into_bytes())
            .execute(db.sqlite.as_ref().unwrap().pool())
            .await
            .expect("fill");
        }
    }
}

async fn all_sent(db: &TestDb, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let counts = db.store.counts().await.expect("counts");
        assert_eq!(counts[&Status::Failed], 0, "events failed");
        if counts[&Status::Sent] as usize == n {
            return;
        }
        assert!(Instant::now() < deadline, "not all events SENT within 15 minutes: {counts:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What a measurement through ferry found: its rate, the CPU its process used, and where its
/// workers' cycles went, from ferry's own metrics (the means of its claim, plugin-call and record
/// histograms).
#[derive(Clone, Copy, Default)]
struct FerryRun {
    rate: f64,
    cpu_us_per_event: f64,
    /// Claims made in the window, the empty ones at the end included.
    claims: u64,
    claim_ms: f64,
    plugin_call_ms: f64,
    record_ms: f64,
}

type Histogram = prometheus_client::metrics::histogram::Histogram;

/// A histogram's sum and count, to take the observations made since from a later reading.
fn reading(h: &Histogram) -> (f64, u64) {
    (h.sum(), h.count())
}

/// The number and mean (in milliseconds) of the observations made since `before`.
fn since(h: &Histogram, before: (f64, u64)) -> (u64, f64) {
    let n = h.count() - before.1;
    (n, if n == 0 { 0.0 } else { (h.sum() - before.0) * 1e3 / n as f64 })
}

/// One measurement through ferry: its default workers (four) unless `workers` says otherwise,
/// and the route's default two plugin instances (the plugin's calls are short next to a cycle,
/// so a worker rarely waits for one).
async fn through_ferry(backend: Backend, batch: u32, events: usize, workers: Option<u32>) -> FerryRun {
    let db = TestDb::new(backend).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    // A pool with a connection per worker, one for LISTEN and one spare, as ferry advises.
    let pool = workers.map(|w| format!("max_connections = {}\n", (w + 2).max(8))).unwrap_or_default();
    let workers = workers.map(|w| format!("workers = {w}\n")).unwrap_or_default();
    let config = format!(
        "{pool}[relay]\nbatch_size = {batch}\n{workers}[plugins]\ndir = {plugins:?}\nwatch = false\n[route.bench]\nplugin = \"scripted\"\n"
    );
    let running = Running::start(&db.config(&config)).await;
    fill(&db, events).await;
    // The floors start claiming the moment the events are committed; so does the relay, woken
    // as an emit in its process wakes it (on PostgreSQL the commit's notification does too)
    // rather than at the end of an idle wait. Its first claim wakes the other worker.
    running.wake();
    let cpu_before = cpu_seconds();
    let started = Instant::now();
    // Watch ferry's own delivered counter rather than poll the table, which would take database
    // time from the run being measured.
    let metrics = running.registry.metrics();
    let delivered =
        metrics.delivered.get_or_create(&RouteLabels { route: "bench".into(), plugin: "scripted".into() }).clone();
    let calls = metrics.plugin_call_duration.get_or_create(&PluginLabels { plugin: "scripted".into() }).clone();
    let before = [&metrics.claim_duration, &calls, &metrics.record_duration].map(reading);
    let deadline = started + Duration::from_secs(900);
    while (delivered.get() as usize) < events {
        assert!(Instant::now() < deadline, "not all events delivered within 15 minutes");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu_before;
    let (claims, claim_ms) = since(&metrics.claim_duration, before[0]);
    let (timed_calls, plugin_call_ms) = since(&calls, before[1]);
    assert!(timed_calls > 0, "no plugin call timed under the label plugin=\"scripted\"");
    let (_, record_ms) = since(&metrics.record_duration, before[2]);
    let run = FerryRun {
        rate: events as f64 / elapsed,
        cpu_us_per_event: cpu * 1e6 / events as f64,
        claims,
        claim_ms,
        plugin_call_ms,
        record_ms,
    };
    eprintln!(
        "  ferry process CPU: {:.1} µs per event ({:.2} cores); means: claim {:.2} ms, plugin call {:.2} ms, \
         record {:.2} ms ({} claims)",
        run.cpu_us_per_event,
        cpu / elapsed,
        run.claim_ms,
        run.plugin_call_ms,
        run.record_ms,
        run.claims,
    );
    running.stop().await;
    all_sent(&db, events).await;
    run
}

/// CPU time (user and system) this process has used so far, in seconds.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // After the command name: state is field 0, utime 11 and stime 12 (clock ticks of 1/100 s).
    (ticks(11) + ticks(12)) / 100.0
}

/// Events per second for the same statements without ferry.
async fn floor(backend: Backend, batch: u32, events: usize) -> f64 {
    let db = TestDb::new(backend).await;
    fill(&db, events).await;
    let rate = match backend {
        Backend::Postgres => {
            // The session settings of ferry's own connections, so the statements are planned alike.
            let settings: Vec<String> =
                ferry::store::postgres_session_settings().iter().map(|(k, v)| format!("-c {k}={v}")).collect();
            pgbench("floor.pgbench", batch, events, &db.url, &settings.join(" "))
        }
        Backend::Sqlite => {
            let started = Instant::now();
            let claimers = (0..2).map(|worker| {
                let store = db.store.clone();
                tokio::spawn(async move { claim_and_complete(store, batch, worker).await })
            });
            futures::future::join_all(claimers).await;
            events as f64 / started.elapsed().as_secs_f64()
        }
    };
    // Timed before the check, as the other two measurements are.
    all_sent(&db, events).await;
    rate
}

/// Runs `benches/sql/SCRIPT` under pgbench, two clients, until `events` are through in batches of
/// `batch`, and returns their rate in events per second; `settings` are PostgreSQL session
/// settings (`-c name=value …`). They go into the URL's `options`, which already holds the test's
/// search_path: libpq ignores PGOPTIONS when the URL has options of its own.
///
/// The floor is timed as ferry is: from the moment its connections are open to its last
/// completion, by pgbench's own clock (its rate "without initial connection time"), so neither
/// pgbench's start (on Debian a Perl wrapper picks the binary) nor its connecting counts against
/// it. And it talks to PostgreSQL as ferry does, without TLS: libpq's default (`sslmode=prefer`)
/// would encrypt every row the floor claims where ferry's driver, built without TLS, sends them
/// in the clear.
fn pgbench(script: &str, batch: u32, events: usize, url: &str, settings: &str) -> f64 {
    let per_client = events.div_ceil(batch as usize).div_ceil(2);
    let settings = settings.replace(' ', "%20").replace('=', "%3D");
    let with = |url: &str, parameter: &str| format!("{url}{}{parameter}", if url.contains('?') { '&' } else { '?' });
    let url = match url.split_once("options=") {
        _ if settings.is_empty() => url.to_string(),
        Some((head, options)) => format!("{head}options={settings}%20{options}"),
        None => with(url, &format!("options={settings}")),
    };
    let url = with(&url, "sslmode=disable");
    let out = Command::new("pgbench")
        .args(["-n", "-c", "2", "-j", "2", "-t", &per_client.to_string(), "-D", &format!("batch={batch}"), "-f"])
        .arg(repo_root().join("benches/sql").join(script))
        .arg(&url)
        .output()
        .expect("pgbench runs (install PostgreSQL's client programs)");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "pgbench failed: {}{report}", String::from_utf8_lossy(&out.stderr));
    // "tps = 195.276648 (without initial connection time)": transactions, each one claim and one
    // completion, per second of the clients' run.
    let tps: f64 = report
        .lines()
        .find_map(|line| line.strip_prefix("tps = ")?.split_once(' ')?.0.parse().ok())
        .unwrap_or_else(|| panic!("pgbench printed no rate:\n{report}"));
    let transactions = (per_client * 2) as f64;
    events as f64 * tps / transactions
}

/// Events per second through the minimal outbox floor (see the module's documentation).
async fn minimal_floor(backend: Backend, batch: u32, events: usize) -> f64 {
    let db = TestDb::new(backend).await;
    let schema = std::fs::read_to_string(repo_root().join("benches/sql/minimal.sql")).expect("minimal.sql");
    let payload = format!("{{\"n\":0,\"padding\":\"{}\"}}", "x".repeat(200));
    match backend {
        Backend::Postgres => {
            let pool = db.postgres.as_ref().unwrap().pool();
            sqlx::raw_sql(&schema).execute(pool).await.expect("minimal schema");
            sqlx::query(
                "INSERT INTO floor_events (route, event_type, payload)
                 SELECT 'bench', 'bench.event', convert_to($2, 'UTF8') FROM generate_series(1, $1)",
            )
            .bind(events as i64)
            .bind(&payload)
            .execute(pool)
            .await
            .expect("fill");
            sqlx::query("ANALYZE floor_events").execute(pool).await.expect("analyze");
            let rate = pgbench("minimal.pgbench", batch, events, &db.url, "");
            let sent: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM floor_events WHERE status = 'SENT'")
                .fetch_one(pool)
                .await
                .expect("count");
            assert_eq!(sent as usize, events, "the minimal floor delivered every event");
            rate
        }
        Backend::Sqlite => {
            // SQLite's dialect: integer milliseconds, no BIGSERIAL, BLOB for BYTEA.
            let schema = schema
                .replace("BIGSERIAL PRIMARY KEY", "INTEGER PRIMARY KEY")
                .replace("BYTEA", "BLOB")
                .replace("JSONB", "TEXT")
                .replace("TIMESTAMPTZ NOT NULL DEFAULT now()", "INTEGER NOT NULL DEFAULT 0")
                .replace("TIMESTAMPTZ", "INTEGER");
            let pool = db.sqlite.as_ref().unwrap().pool();
            sqlx::raw_sql(&schema).execute(pool).await.expect("minimal schema");
            sqlx::query(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
                 INSERT INTO floor_events (route, event_type, payload) SELECT 'bench', 'bench.event', ?2 FROM n",
            )
            .bind(events as i64)
            .bind(payload.into_bytes())
            .execute(pool)
            .await
            .expect("fill");
            let started = Instant::now();
            let mut conn = pool.acquire().await.expect("a connection");
            for round in 0u64.. {
                let now = chrono::Utc::now().timestamp_millis();
                let token = format!("min-{round}");
                let claimed = sqlx::query(
                    "UPDATE floor_events SET status = 'PROCESSING', attempts = attempts + 1, claim_token = ?1,
                         lease_until = ?2
                     WHERE id IN (SELECT id FROM floor_events WHERE status = 'PENDING' AND next_attempt_at <= ?3
                                  ORDER BY next_attempt_at, id LIMIT ?4)
                     RETURNING id, route, event_type, payload, headers, attempts",
                )
                .bind(&token)
                .bind(now + 300_000)
                .bind(now)
                .bind(i64::from(batch))
                .fetch_all(&mut *conn)
                .await
                .expect("claim");
                if claimed.is_empty() {
                    break;
                }
                sqlx::query(
                    "UPDATE floor_events SET status = 'SENT', claim_token = NULL, lease_until = NULL
                     WHERE claim_token = ?1 AND status = 'PROCESSING'",
                )
                .bind(&token)
                .execute(&mut *conn)
                .await
                .expect("complete");
            }
            events as f64 / started.elapsed().as_secs_f64()
        }
    }
}

/// Claims and completes batches until none is left: ferry's statements without the relay.
async fn claim_and_complete(store: Arc<dyn Store>, batch: u32, worker: u32) {
    for round in 0.. {
        let now = chrono::Utc::now();
        let token = format!("floor-{worker}-{round}");
        let claim = Claim {
            now,
            limit: batch,
            lease_until: now + chrono::Duration::minutes(5),
            instance: "floor".into(),
            token: token.clone(),
            ordered_routes: Vec::new(),
            blocking_routes: Vec::new(),
            paused_routes: Vec::new(),
            only_route: None,
            max_payload: 1 << 20,
        };
        let claimed = store.claim(&claim).await.expect("claim");
        if claimed.is_empty() {
            return;
        }
        let call = Arc::new(CallLog {
            route: "bench".into(),
            started_at: now,
            instance: "floor".into(),
            plugin: Some("floor".into()),
            plugin_hash: Some("0".repeat(64)),
            ..CallLog::default()
        });
        let done: Vec<Completion> = claimed
            .iter()
            .map(|e| Completion {
                id: e.id,
                disposition: Disposition::Sent,
                max_attempts: 6,
                attempt: AttemptLog { number: e.attempt, call: call.clone() },
                dead_letter: None,
            })
            .collect();
        store.complete(&token, chrono::Utc::now(), &done).await.expect("complete");
    }
}

/// One round: the three rates, in events per second, measured one after the other.
struct Round {
    minimal: f64,
    own: f64,
    /// Ferry's measurement: its rate, and where its time went.
    ferry: FerryRun,
}

/// The rounds of one database and batch size.
struct Measured {
    database: &'static str,
    batch: u32,
    rounds: Vec<Round>,
}

impl Measured {
    /// The spread of one rate over the rounds.
    fn rate(&self, rate: impl Fn(&Round) -> f64) -> Spread {
        Spread::of(self.rounds.iter().map(rate))
    }

    /// The spread of ferry's rate over the floor `of`, each round's ratio taken within the round.
    fn ratio(&self, of: impl Fn(&Round) -> f64) -> Spread {
        Spread::of(self.rounds.iter().map(|r| r.ferry.rate / of(r)))
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let options = options();
    let backends: Vec<(Backend, &str)> = [(Backend::Postgres, "postgres"), (Backend::Sqlite, "sqlite")]
        .into_iter()
        .filter(|(_, name)| options.only.as_deref().is_none_or(|o| o == *name))
        .collect();
    let batches: Vec<u32> = options.batch.map_or(BATCHES.to_vec(), |b| vec![b]);
    let mut results = Vec::new();
    for (backend, name) in backends {
        for &batch in &batches {
            let mut rounds = Vec::new();
            for round in 1..=options.rounds {
                // The floors and ferry run one after the other in each round, so the three see
                // the machine at nearly the same moment; each round starts with the next of them,
                // so each takes the first, second and third place in turn.
                let (mut minimal, mut own, mut run) = (0.0, 0.0, FerryRun::default());
                for turn in 0..3 {
                    match (round + turn) % 3 {
                        1 => minimal = minimal_floor(backend, batch, options.events).await,
                        2 => own = floor(backend, batch, options.events).await,
                        _ => run = through_ferry(backend, batch, options.events, options.workers).await,
                    }
                }
                eprintln!(
                    "{name} batch {batch} round {round}: minimal floor {minimal:.0}/s, own floor {own:.0}/s, ferry {:.0}/s",
                    run.rate
                );
                rounds.push(Round { minimal, own, ferry: run });
            }
            results.push(Measured { database: name, batch, rounds });
        }
    }
    println!(
        "| database | batch size | minimal floor events/s | ferry's own floor events/s | ferry events/s | ferry / minimal floor (range) | ferry / own floor (range) |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &results {
        let (to_minimal, to_own) = (r.ratio(|x| x.minimal), r.ratio(|x| x.own));
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | **{:.2}×** ({:.2}–{:.2}) | {:.2}× ({:.2}–{:.2}) |",
            r.database,
            r.batch,
            r.rate(|x| x.minimal).median,
            r.rate(|x| x.own).median,
            r.rate(|x| x.ferry.rate).median,
            to_minimal.median,
            to_minimal.low,
            to_minimal.high,
            to_own.median,
            to_own.low,
            to_own.high,
        );
    }
    println!();
    println!("{}", rounds_note(options.rounds));
    // Milliseconds, to the microsecond.
    let round_ms = thousandths;
    let json = serde_json::json!({
        "events": options.events,
        "workers": options.workers.unwrap_or(ferry::config::Config::defaults().relay.workers),
        "rounds_run": options.rounds,
        "results": results.iter().map(|r| {
            let (to_minimal, to_own) = (r.ratio(|x| x.minimal), r.ratio(|x| x.own));
            serde_json::json!({
                "database": r.database,
                "batch_size": r.batch,
                "minimal_floor_events_per_second": r.rate(|x| x.minimal).median.round(),
                "floor_events_per_second": r.rate(|x| x.own).median.round(),
                "ferry_events_per_second": r.rate(|x| x.ferry.rate).median.round(),
                "ratio_to_minimal_floor": thousandths(to_minimal.median),
                "ratio_to_minimal_floor_range": to_minimal.range_json(),
                "ratio": thousandths(to_own.median),
                "ratio_range": to_own.range_json(),
                "rounds": r.rounds.iter().map(|x| serde_json::json!({
                    "minimal_floor_events_per_second": x.minimal.round(),
                    "floor_events_per_second": x.own.round(),
                    "ferry_events_per_second": x.ferry.rate.round(),
                    "ferry_cpu_us_per_event": (x.ferry.cpu_us_per_event * 10.0).round() / 10.0,
                    "ferry_claims": x.ferry.claims,
                    "ferry_claim_ms": round_ms(x.ferry.claim_ms),
                    "ferry_plugin_call_ms": round_ms(x.ferry.plugin_call_ms),
                    "ferry_record_ms": round_ms(x.ferry.record_ms),
                })).collect::<Vec<_>>(),
            })
        }).collect::<Vec<_>>(),
    });
    let out = repo_root().join("target/bench");
    std::fs::create_dir_all(&out).expect("create target/bench");
    std::fs::write(out.join("throughput.json"), serde_json::to_string_pretty(&json).unwrap()).expect("write report");
}
