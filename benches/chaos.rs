//! The full chaos run: 100 000 events through the HTTP plugin to a receiver that counts deliveries
//! per event id; two `ferry serve` processes on one PostgreSQL, one of them killed with SIGKILL
//! every 0.5 to 2 seconds and restarted; PostgreSQL restarted once half-way. Stops by itself when
//! every event is SENT (or fails at the deadline), then checks that none was lost or left behind
//! and reports the duplicates.
//!
//! Run: `cargo bench --bench chaos [-- --events N --instances N --deadline-secs N]` (needs the
//! PostgreSQL server programs for a private cluster, and the plugins from `scripts/build-plugins`).
//! Prints a markdown row and writes `target/bench/chaos.json`.

#[path = "../tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::chaos::{Options, run_chaos};

fn options() -> Options {
    let mut options = Options {
        events: 100_000,
        instances: 2,
        kill_every: (Duration::from_millis(500), Duration::from_secs(2)),
        restart_postgres: true,
        deadline: Duration::from_secs(1800),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--events" => options.events = value().parse().expect("--events: a number"),
            "--instances" => options.instances = value().parse().expect("--instances: a number"),
            "--deadline-secs" => options.deadline = Duration::from_secs(value().parse().expect("a number")),
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => panic!("unknown argument {other:?} (known: --events N, --instances N, --deadline-secs N)"),
        }
    }
    options
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let options = options();
    let report = run_chaos(&options).await;
    println!(
        "| events | instances | kills | PostgreSQL restarts | seconds | deliveries | lost | duplicates | most deliveries of one event | left unSENT |\n\
         | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let unsent: i64 = report.statuses.iter().filter(|(s, _)| s.as_str() != "SENT").map(|(_, n)| n).sum();
    println!(
        "| {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {unsent} |",
        report.events,
        report.instances,
        report.kills,
        report.postgres_restarts,
        report.seconds,
        report.deliveries,
        report.lost,
        report.duplicates,
        report.most_deliveries
    );
    let out = common::repo_root().join("target/bench");
    std::fs::create_dir_all(&out).expect("create target/bench");
    std::fs::write(out.join("chaos.json"), serde_json::to_string_pretty(&report).unwrap()).expect("write report");
    assert_eq!((report.lost, unsent), (0, 0), "events were lost or left behind: {report:?}");
}
