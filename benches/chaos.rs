//! The full chaos run: 100 000 events through the HTTP plugin to a receiver that counts deliveries
//! per event id; two `ferry serve` processes on one PostgreSQL, one of them killed with SIGKILL
//! every 0.5 to 2 seconds and restarted; PostgreSQL restarted once half-way. Stops by itself when
//! every event is SENT (or fails at the deadline), then checks that none was lost or left behind
//! and reports the duplicates.
//!
//! Run: `cargo bench --bench chaos [-- --events N --instances N --deadline-secs N]` (needs the
//! PostgreSQL server programs for a private cluster, and the plugins from `scripts/build-plugins`).
//! Prints a markdown row and writes `target/bench/chaos.json`.

use ferry_testkit as common;

use std::time::Duration;

use common::chaos::{Options, run_chaos};

/// `cargo bench --bench chaos -- [--events N] [--instances N] [--deadline-secs N]`
#[derive(clap::Parser)]
struct Args {
    #[arg(long, default_value_t = 100_000)]
    events: usize,
    /// `ferry serve` processes sharing the outbox.
    #[arg(long, default_value_t = 2)]
    instances: usize,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 1800)]
    deadline_secs: u64,
    /// Passed by `cargo bench` to every benchmark binary.
    #[arg(long, hide = true)]
    bench: bool,
}

fn options() -> Options {
    let args: Args = clap::Parser::parse();
    Options {
        events: args.events,
        instances: args.instances,
        kill_every: (Duration::from_millis(500), Duration::from_secs(2)),
        restart_postgres: true,
        deadline: Duration::from_secs(args.deadline_secs),
    }
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
