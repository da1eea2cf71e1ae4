//! The chaos test, small enough for the suite: 30 000 events through the HTTP plugin while two
//! `ferry serve` processes are killed with SIGKILL every 0.1 to 0.3 seconds and restarted, and
//! PostgreSQL is restarted once. (5 000 events were once enough for several kills; ferry now
//! delivers them in well under a second.) Nothing may be lost or left behind; duplicates are expected (at
//! least once) and reported. `cargo bench --bench chaos` runs the full-size version.

use std::time::Duration;

use crate::common::chaos::{Options, run_chaos};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_instances_and_a_database_restart_lose_nothing() {
    let options = Options {
        events: 30_000,
        instances: 2,
        kill_every: (Duration::from_millis(100), Duration::from_millis(300)),
        restart_postgres: true,
        deadline: Duration::from_secs(240),
    };
    let report = run_chaos(&options).await;
    eprintln!("chaos report: {}", serde_json::to_string(&report).unwrap());
    assert!(report.kills >= 2, "the instances were killed: {report:?}");
    assert_eq!(report.postgres_restarts, 1, "{report:?}");
    assert_eq!(report.lost, 0, "every event reached the receiver: {report:?}");
    assert_eq!(report.distinct, report.events, "{report:?}");
    assert_eq!(report.statuses.get("SENT").copied(), Some(30_000), "{report:?}");
    assert_eq!(report.statuses.len(), 1, "nothing PENDING, PROCESSING or FAILED: {report:?}");
}
