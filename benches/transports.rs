//! Events per second through ferry on PostgreSQL, for each bundled transport delivering to a real
//! receiver on this machine: `log` into a file, `http` into nginx (keep-alive, 204) with one
//! request per event, `http-batched` the same with many events per request (CloudEvents batched
//! mode), `kafka` into a tansu broker, and `kafka-tls` into a tansu broker behind a TLS front (stunnel), with lz4
//! compression and the idempotent producer; and, in the same rounds, the accept-all `scripted`
//! test transport, which answers success without sending anything: each transport's figure is
//! also given as a ratio to it. Where `http` and accept-all both run, a plain HTTP client into
//! nginx (no ferry, no database) runs beside them and bounds what one request per event allows.
//!
//! Run: `cargo bench --bench transports [-- --events N --batch-size N --only PLUGIN,PLUGIN --rounds N]`
//! (needs PostgreSQL as for the tests, the built plugins from `scripts/build-plugins`, tansu from
//! `scripts/ensure-tansu` and Debian's nginx, which `scripts/bench` installs). Each figure is the
//! time from the commit of N events to the moment the last of them is SENT, with ferry already
//! running and its plugins loaded. The measurements run one after the other in rounds (3 by
//! default), each round starting one place further along; every ratio is taken within a round,
//! and the report gives the median of the rounds' ratios with their range, as the throughput
//! benchmark does. Prints markdown tables and writes `target/bench/transports.json`.

use ferry_testkit as common;

use std::time::{Duration, Instant};

use common::broker::broker;
use common::spread::{Spread, rounds_note, thousandths};
use common::{Running, TestDb, plugins_dir};
use ferry::NewEvent;
use ferry::event::Status;

/// `cargo bench --bench transports -- [--events N] [--batch-size N] [--only PLUGIN,PLUGIN] [--rounds N]`
#[derive(clap::Parser)]
struct Options {
    /// Events per plugin.
    #[arg(long, default_value_t = 50_000)]
    events: usize,
    #[arg(long, default_value_t = 500)]
    batch_size: usize,
    /// Measure only these (comma-separated: accept-all, log, http, http-batched, kafka, kafka-tls).
    #[arg(long)]
    only: Option<String>,
    /// The `http` plugin's `concurrency`: requests in flight at once within a batch (and the plain
    /// client's connections).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    http_concurrency: u32,
    /// The `http-batched` route's `batch_size`: events in one request.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    http_batch_size: u32,
    /// Rounds of the measurements. Each round measures every route (and the plain client) once,
    /// so its ratios compare measurements taken minutes apart at most; the report gives their
    /// median and range.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Passed by `cargo bench` to every benchmark binary.
    #[arg(long, hide = true)]
    bench: bool,
}

fn options() -> Options {
    clap::Parser::parse()
}

/// What the receiver of a measurement needs kept alive while it runs.
type Guard = Box<dyn std::any::Any + Send>;

/// What points `plugin` at its receiver: the plugin's sandbox table, the route's `config` value,
/// and what to keep alive.
async fn plugin_setup(plugin: &str, db: &TestDb, options: &Options) -> (String, String, Guard) {
    match plugin {
        "accept-all" => (String::new(), "{}".into(), Box::new(())),
        "log" => {
            let out = db.dir.path().join("out");
            (format!("dirs = {{ \"/out\" = {out:?} }}"), "{ output = \"/out/events.jsonl\" }".into(), Box::new(()))
        }
        "http" | "http-batched" => {
            let receiver = common::nginx::Nginx::start();
            let sandbox = format!("http = [\"http://{}\"]", receiver.addr);
            let batched = match plugin {
                "http-batched" => format!(", cloudevents = \"batched\", batch_size = \"{}\"", options.http_batch_size),
                _ => String::new(),
            };
            let config = format!(
                "{{ url = \"{}\", concurrency = \"{}\"{batched} }}",
                receiver.url("/bench"),
                options.http_concurrency
            );
            (sandbox, config, Box::new(receiver))
        }
        "kafka" => {
            let broker = broker().await;
            let topic = broker.topic("bench", 3).await;
            let sandbox = format!("tcp = [\"{}\", \"localhost:{}\"]\ndns = true", broker.addr(), broker.port);
            let config = format!("{{ brokers = \"{}\", topic = \"{topic}\" }}", broker.addr());
            (sandbox, config, Box::new(()))
        }
        "kafka-tls" => {
            let pki = tempfile::tempdir().expect("pki directory");
            common::test_pki(pki.path());
            let front_port = common::broker::free_port();
            let broker = common::broker::Broker::start(Some(front_port));
            let front = common::broker::TlsFront::start(pki.path(), front_port, broker.port, false);
            let topic = broker.topic_directly("bench", 3);
            let sandbox = format!("tcp = [\"127.0.0.1:{front_port}\"]\ntls_ca = {:?}", pki.path().join("ca.pem"));
            let config = format!(
                "{{ brokers = \"127.0.0.1:{front_port}\", topic = \"{topic}\", tls = \"true\", compression = \"lz4\" }}"
            );
            (sandbox, config, Box::new((pki, broker, front)))
        }
        other => panic!("no benchmark set-up for plugin {other:?}"),
    }
}

/// One plugin's run: events per second and, where the receiver is nginx, the CPU its worker spent
/// per event.
struct Measured {
    rate: f64,
    receiver_cpu: Option<Duration>,
}

/// nginx's CPU per request from its worker's CPU time before and after `requests` requests.
fn per_request(receiver: &common::nginx::Nginx, before: Duration, requests: usize) -> Duration {
    (receiver.worker_cpu() - before) / requests as u32
}

async fn measure(plugin: &str, options: &Options) -> Measured {
    let db = TestDb::postgres().await;
    let crate_name = match plugin {
        "accept-all" => "ferry_test_scripted".to_string(),
        "kafka-tls" => "ferry_transport_kafka".to_string(),
        "http-batched" => "ferry_transport_http".to_string(),
        other => format!("ferry_transport_{other}"),
    };
    let plugins = plugins_dir(db.dir.path(), &[crate_name.as_str()]);
    let name = common::plugin_name(&crate_name);
    let (sandbox, config, receiver) = plugin_setup(plugin, &db, options).await;
    let text = format!(
        "[relay]\nbatch_size = {}\n[plugins]\ndir = {plugins:?}\n[sandbox.{name}]\n{sandbox}\n\
         [route.bench]\nplugin = \"{name}\"\nconfig = {config}\n",
        options.batch_size
    );
    let running = Running::start(&db.config(&text)).await;

    let pool = db.postgres.as_ref().expect("postgres").pool().clone();
    let mut tx = pool.begin().await.expect("begin");
    for n in 0..options.events {
        let event = NewEvent::new("bench", "bench.event", format!("{{\"n\":{n},\"padding\":\"{}\"}}", "x".repeat(200)))
            .with_key(format!("key-{}", n % 64));
        ferry::emit(&mut *tx, &event).await.expect("emit");
    }
    let nginx = receiver.downcast_ref::<common::nginx::Nginx>();
    let receiver_before = nginx.map(|n| n.worker_cpu());
    tx.commit().await.expect("commit");
    let started = Instant::now();
    let deadline = started + Duration::from_secs(600);
    loop {
        let counts = db.store.counts().await.expect("counts");
        assert_eq!(counts[&Status::Failed], 0, "{plugin}: events failed; see the table");
        if counts[&Status::Sent] as usize == options.events {
            break;
        }
        assert!(Instant::now() < deadline, "{plugin}: not all events delivered within 10 minutes: {counts:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    let receiver_cpu = nginx.zip(receiver_before).map(|(n, before)| per_request(n, before, options.events));
    running.stop().await;
    Measured { rate: options.events as f64 / elapsed.as_secs_f64(), receiver_cpu }
}

/// Requests per second a plain HTTP client (reqwest, no ferry, no database) gets through to the
/// same kind of receiver the `http` figure uses: `events` POSTs of the same bodies, on as many
/// keep-alive connections as the plugin's `concurrency`, each a task of its own so both runtime
/// threads send. Independent of ferry, it bounds what any route that makes one request per event
/// can reach on this machine. Also returns nginx's CPU per request in this run.
async fn plain_client(options: &Options) -> Measured {
    let receiver = common::nginx::Nginx::start();
    let receiver_before = receiver.worker_cpu();
    let client = reqwest::Client::new();
    let (connections, events) = (options.http_concurrency as usize, options.events);
    let started = Instant::now();
    let workers = (0..connections).map(|w| {
        let (client, url) = (client.clone(), receiver.url("/bench"));
        tokio::spawn(async move {
            for n in (w..events).step_by(connections) {
                let body = format!("{{\"n\":{n},\"padding\":\"{}\"}}", "x".repeat(200));
                let response = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                    .expect("answered");
                assert!(response.status().is_success(), "{}", response.status());
            }
        })
    });
    for worker in futures::future::join_all(workers).await {
        worker.expect("a plain client worker");
    }
    let rate = options.events as f64 / started.elapsed().as_secs_f64();
    Measured { rate, receiver_cpu: Some(per_request(&receiver, receiver_before, events)) }
}

/// What one round measures in turn: a plugin's route, or the plain client.
#[derive(Clone, Copy, PartialEq)]
enum Subject {
    Plugin(&'static str),
    PlainClient,
}

/// The rounds' measurements: `rounds[r][s]` is subject `s` of `subjects` in round `r`.
struct Rounds {
    subjects: Vec<Subject>,
    rounds: Vec<Vec<Measured>>,
}

impl Rounds {
    /// Each round measures every subject once, one after the other, and starts one place further
    /// along the list than the round before, so each subject takes every place in turn and no
    /// route always meets the machine's first (or last) moment.
    async fn run(subjects: Vec<Subject>, options: &Options) -> Rounds {
        let mut rounds = Vec::new();
        for round in 0..options.rounds as usize {
            let mut measured: Vec<Option<Measured>> = subjects.iter().map(|_| None).collect();
            for turn in 0..subjects.len() {
                let at = (round + turn) % subjects.len();
                let (name, m) = match subjects[at] {
                    Subject::Plugin(plugin) => (plugin, measure(plugin, options).await),
                    Subject::PlainClient => ("plain client", plain_client(options).await),
                };
                eprintln!("round {}: {name}: {:.0}/s", round + 1, m.rate);
                measured[at] = Some(m);
            }
            rounds.push(measured.into_iter().map(|m| m.expect("every subject is measured in each round")).collect());
        }
        Rounds { subjects, rounds }
    }

    fn index(&self, subject: Subject) -> Option<usize> {
        self.subjects.iter().position(|s| *s == subject)
    }

    /// One figure of each round, computed from that round's measurements, and their spread.
    fn spread(&self, figure: impl Fn(&[Measured]) -> f64) -> Spread {
        Spread::of(self.rounds.iter().map(|round| figure(round)))
    }
}

/// `median× (low–high)`.
fn shown(ratio: &Spread) -> String {
    format!("{:.2}× ({:.2}–{:.2})", ratio.median, ratio.low, ratio.high)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let options = options();
    let mut subjects: Vec<Subject> = ["accept-all", "log", "http", "http-batched", "kafka", "kafka-tls"]
        .into_iter()
        .filter(|p| options.only.as_deref().is_none_or(|o| o.split(',').any(|o| o.trim() == *p)))
        .map(Subject::Plugin)
        .collect();
    // The plain client bounds the `http` route against accept-all, so it runs where both do.
    let http = Subject::Plugin("http");
    let accept_all = Subject::Plugin("accept-all");
    if subjects.contains(&http) && subjects.contains(&accept_all) {
        subjects.push(Subject::PlainClient);
    }
    let rounds = Rounds::run(subjects, &options).await;
    let accept_all = rounds.index(accept_all);
    // Each ratio is taken within a round, between measurements minutes apart at most, and the
    // report gives the median of the rounds' ratios, not the ratio of the medians.
    let ratio = |at: usize| accept_all.map(|a| rounds.spread(|r| r[at].rate / r[a].rate));
    println!(
        "| plugin | receiver | events | batch size | events/s | ÷ accept-all (range) |\n| --- | --- | ---: | ---: | ---: | ---: |"
    );
    let mut results = Vec::new();
    for (at, subject) in rounds.subjects.iter().enumerate() {
        let Subject::Plugin(plugin) = *subject else { continue };
        let batched = format!("nginx, keep-alive, 204; CloudEvents batched, {} per request", options.http_batch_size);
        let receiver = match plugin {
            "accept-all" => "none (answers success)",
            "log" => "JSON lines file",
            "http" => "nginx, keep-alive, 204; a request per event",
            "http-batched" => &batched,
            "kafka-tls" => "tansu behind stunnel (TLS), 3 partitions, lz4",
            _ => "tansu broker, 3 partitions",
        };
        let rate = rounds.spread(|r| r[at].rate);
        let to_accept_all = ratio(at);
        println!(
            "| {plugin} | {receiver} | {} | {} | {:.0} | {} |",
            options.events,
            options.batch_size,
            rate.median,
            to_accept_all.as_ref().map_or("–".to_string(), shown)
        );
        results.push(serde_json::json!({
            "plugin": plugin,
            "events_per_second": rate.median.round(),
            "ratio_to_accept_all": to_accept_all.map(|r| thousandths(r.median)),
            "ratio_to_accept_all_range": to_accept_all.map(|r| r.range_json()),
            "rounds_events_per_second": rounds.rounds.iter().map(|r| r[at].rate.round()).collect::<Vec<_>>(),
        }));
    }
    // With accept-all and http measured: how close http comes to what the machine allows. When the
    // cores are the limit (as on the two-core machine of BENCHMARKS.md, where PostgreSQL, ferry
    // and the receiver share them), a route making one request per event pays at least
    // accept-all's cost per event plus the plain client's per request, so its rate is at most
    // 1 / (1/accept-all + 1/plain): an estimate, not a bound where other limits dominate.
    // The receiver's own share, measured as its worker's CPU time in the `http` run, bounds any
    // sender, however cheap: with accept-all's cost per event taken as the cores ÷ its rate, a
    // route of one request per event reaches at most 1 / (1 + receiver CPU per request × rate ÷
    // cores) of it.
    let bound = match (accept_all, rounds.index(http), rounds.index(Subject::PlainClient)) {
        (Some(a), Some(h), Some(p)) => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
            let micros = |cpu: Option<Duration>| cpu.map_or(f64::NAN, |cpu| cpu.as_secs_f64() * 1e6);
            let bound_of = |r: &[Measured]| r[p].rate / (r[a].rate + r[p].rate);
            let plain = rounds.spread(|r| r[p].rate);
            let bound = rounds.spread(bound_of);
            let to_bound = rounds.spread(|r| r[h].rate / r[a].rate / bound_of(r));
            let receiver_http = rounds.spread(|r| micros(r[h].receiver_cpu));
            let receiver_plain = rounds.spread(|r| micros(r[p].receiver_cpu));
            let receiver_bound = rounds.spread(|r| 1.0 / (1.0 + micros(r[h].receiver_cpu) * 1e-6 * r[a].rate / cores));
            println!();
            println!("| http against what the machine allows | median (range) |\n| --- | ---: |");
            println!(
                "| plain client into nginx, {} connections, requests/s | {:.0} ({:.0}–{:.0}) |",
                options.http_concurrency, plain.median, plain.low, plain.high
            );
            println!(
                "| most an `http` route can reach, ÷ accept-all: plain ÷ (accept-all + plain) | {} |",
                shown(&bound)
            );
            println!("| `http` ÷ that bound | {:.2} ({:.2}–{:.2}) |", to_bound.median, to_bound.low, to_bound.high);
            println!(
                "| nginx's CPU per request, µs: from `http` / from the plain client | {:.1} / {:.1} |",
                receiver_http.median, receiver_plain.median
            );
            println!(
                "| most any sender can reach into this receiver on {cores} cores, ÷ accept-all | {} |",
                shown(&receiver_bound)
            );
            Some(serde_json::json!({
                "connections": options.http_concurrency,
                "plain_client_requests_per_second": plain.median.round(),
                "http_bound_ratio_to_accept_all": thousandths(bound.median),
                "http_bound_ratio_to_accept_all_range": bound.range_json(),
                "http_ratio_to_bound": thousandths(to_bound.median),
                "http_ratio_to_bound_range": to_bound.range_json(),
                "receiver_cpu_us_per_request_http": thousandths(receiver_http.median),
                "receiver_cpu_us_per_request_plain_client": thousandths(receiver_plain.median),
                "receiver_bound_ratio_to_accept_all": thousandths(receiver_bound.median),
                "cores": cores,
            }))
        }
        _ => None,
    };
    println!();
    println!("{}", rounds_note(options.rounds));
    let json = serde_json::json!({
        "events": options.events,
        "batch_size": options.batch_size,
        "http_batched_events_per_request": options.http_batch_size,
        "rounds_run": options.rounds,
        "results": results,
        "http_bound": bound,
    });
    let out = common::repo_root().join("target/bench");
    std::fs::create_dir_all(&out).expect("create target/bench");
    std::fs::write(out.join("transports.json"), serde_json::to_string_pretty(&json).unwrap()).expect("write report");
}
