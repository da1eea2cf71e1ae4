//! Relay transitions with a controlled clock and the real `scripted` test plugin: success,
//! transient with backoff until the limit, permanent, traps, timeouts, and routes with no
//! transport. Every test runs on both backends.

use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use ferry::NewEvent;
use ferry::clock::{Clock, ManualClock};
use ferry::event::Status;
use ferry::service::Ferry;
use tokio_util::sync::CancellationToken;

use crate::common::{TestDb, plugins_dir};

struct Setup {
    db: TestDb,
    clock: Arc<ManualClock>,
    ferry: Ferry,
}

/// Ferry with the scripted plugin on route `s`, exponential backoff from 1s without jitter, at
/// most 3 attempts, and a 300ms plugin timeout.
async fn setup(db: TestDb) -> Setup {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let config = db.config(&format!(
        r#"
        [relay]
        lease = "10s"
        [plugins]
        dir = {plugins:?}
        timeout = "300ms"
        [retry]
        max_attempts = 3
        jitter = "none"
        [route.s]
        plugin = "scripted"
        [route.refused]
        plugin = "scripted"
        config = {{ reject = "bad value" }}
        [route.orphan]
        plugin = "not-installed"
        "#
    ));
    let clock = Arc::new(ManualClock::new(Utc.with_ymd_and_hms(2026, 5, 1, 8, 0, 0).unwrap()));
    let ferry = Ferry::start(&config, clock.clone()).await.expect("ferry starts");
    Setup { db, clock, ferry }
}

impl Setup {
    async fn emit(&self, route: &str, event_type: &str) -> i64 {
        self.emit_event(NewEvent::new(route, event_type, "{}")).await
    }

    async fn emit_event(&self, event: NewEvent) -> i64 {
        self.db.store.insert(&event, self.clock.now()).await.unwrap()
    }

    async fn cycle(&self) -> ferry::relay::CycleStats {
        self.ferry.relay.cycle(&CancellationToken::new()).await.unwrap()
    }

    async fn row(&self, id: i64) -> ferry::event::EventRecord {
        self.db.store.get(id).await.unwrap().unwrap()
    }
}

async fn success_is_sent(db: TestDb) {
    let s = setup(db).await;
    let id = s.emit("s", "ok").await;
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.sent), (1, 1));
    let row = s.row(id).await;
    assert_eq!((row.status, row.attempts, row.processed_at), (Status::Sent, 1, Some(s.clock.now())));
}

async fn transient_retries_with_backoff_then_fails(db: TestDb) {
    let s = setup(db).await;
    let id = s.emit("s", "transient").await;
    let start = s.clock.now();
    // Attempt 1 fails: retry after 1s. Attempt 2 fails: retry after 2s. Attempt 3 fails: FAILED.
    for (attempt, delay) in [(1u32, 1i64), (2, 2)] {
        assert_eq!(s.cycle().await.retried, 1, "attempt {attempt}");
        let row = s.row(id).await;
        assert_eq!((row.status, row.attempts), (Status::Pending, attempt));
        assert_eq!(row.next_attempt_at, s.clock.now() + chrono::Duration::seconds(delay));
        assert!(row.last_error.unwrap().contains("scripted transient failure"));
        s.clock.advance(Duration::from_millis(delay as u64 * 1000 - 1));
        assert_eq!(s.cycle().await.claimed, 0, "not due before its backoff");
        s.clock.advance(Duration::from_millis(1));
    }
    assert_eq!(s.cycle().await.failed, 1);
    let row = s.row(id).await;
    assert_eq!((row.status, row.attempts, row.max_attempts), (Status::Failed, 3, Some(3)));
    assert_eq!(row.failure_reason.as_deref(), Some("attempts_exhausted"));
    assert_eq!(row.event_time, start, "event time is immutable");
}

async fn retry_after_hint_is_honoured(db: TestDb) {
    let s = setup(db).await;
    let id = s.emit_event(NewEvent::new("s", "transient", "{}").with_header("retry-after-ms", "45000")).await;
    s.cycle().await;
    assert_eq!(s.row(id).await.next_attempt_at, s.clock.now() + chrono::Duration::seconds(45));
}

async fn permanent_fails_at_once(db: TestDb) {
    let s = setup(db).await;
    let ok = s.emit("s", "ok").await;
    let bad = s.emit("s", "permanent").await;
    let stats = s.cycle().await;
    assert_eq!((stats.sent, stats.failed), (1, 1));
    let row = s.row(bad).await;
    assert_eq!((row.status, row.attempts), (Status::Failed, 1));
    assert_eq!(row.failure_reason.as_deref(), Some("permanent"));
    assert!(row.last_error.unwrap().contains("scripted permanent failure"));
    assert_eq!(s.row(ok).await.status, Status::Sent, "one bad event does not fail its batch");
}

async fn a_trap_is_transient_and_the_plugin_recovers(db: TestDb) {
    let s = setup(db).await;
    let trapped = s.emit("s", "trap").await;
    assert_eq!(s.cycle().await.retried, 1);
    let row = s.row(trapped).await;
    assert_eq!(row.status, Status::Pending);
    assert!(row.last_error.as_deref().unwrap().starts_with("plugin trapped"), "{:?}", row.last_error);
    // A fresh instance serves the next batch.
    let ok = s.emit("s", "ok").await;
    let _ = s.cycle().await;
    assert_eq!(s.row(ok).await.status, Status::Sent);
}

async fn a_runaway_plugin_is_timed_out(db: TestDb) {
    let s = setup(db).await;
    let spin = s.emit("s", "spin").await;
    assert_eq!(s.cycle().await.retried, 1);
    let row = s.row(spin).await;
    assert_eq!(row.last_error.as_deref(), Some("plugin timed out after 300ms"));
}

async fn routes_without_a_transport_fail_with_no_transport(db: TestDb) {
    let s = setup(db).await;
    let unknown = s.emit("nowhere", "ok").await;
    let refused = s.emit("refused", "ok").await;
    let orphan = s.emit("orphan", "ok").await;
    assert_eq!(s.cycle().await.failed, 3);
    for (id, needle) in [(unknown, "no route \"nowhere\""), (refused, "told to refuse"), (orphan, "\"not-installed\"")]
    {
        let row = s.row(id).await;
        assert_eq!((row.status, row.failure_reason.as_deref()), (Status::Failed, Some("no_transport")));
        let error = row.last_error.unwrap();
        assert!(error.contains(needle), "{error:?} should mention {needle}");
    }
}

crate::both_backends!(
    success_is_sent,
    transient_retries_with_backoff_then_fails,
    retry_after_hint_is_honoured,
    permanent_fails_at_once,
    a_trap_is_transient_and_the_plugin_recovers,
    a_runaway_plugin_is_timed_out,
    routes_without_a_transport_fail_with_no_transport,
);
