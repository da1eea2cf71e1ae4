//! Relay transitions with a controlled clock and the real `scripted` test plugin: success,
//! transient with backoff until the limit, permanent, traps, timeouts, and routes with no
//! transport. Every test runs on both backends but one, which needs PostgreSQL's error classes.

use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use ferry::NewEvent;
use ferry::clock::{Clock, ManualClock};
use ferry::event::{FailureReason, Status};
use ferry::service::Ferry;
use tokio_util::sync::CancellationToken;

use crate::common::{TestDb, plugins_dir};

struct Setup {
    db: TestDb,
    clock: Arc<ManualClock>,
    ferry: Ferry,
    config: ferry::config::Config,
}

/// Ferry with the scripted plugin on route `s`, exponential backoff from 1s without jitter, at
/// most 3 attempts, and a 300ms plugin timeout.
async fn setup(db: TestDb) -> Setup {
    setup_with(db, "").await
}

/// As [`setup`], with more `[relay]` keys.
async fn setup_with(db: TestDb, relay: &str) -> Setup {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let config = db.config(&format!(
        r#"
        [relay]
        lease = "10s"
        {relay}
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
        [route.o]
        plugin = "scripted"
        ordered = true
        [route.os]
        plugin = "scripted"
        ordered = true
        ordered_after_failure = "skip"
        [route.d]
        plugin = "scripted"
        dead_letter = "dlq"
        [route.dlq]
        plugin = "scripted"
        "#
    ));
    let clock = Arc::new(ManualClock::new(Utc.with_ymd_and_hms(2026, 5, 1, 8, 0, 0).unwrap()));
    let ferry = Ferry::start(&config, clock.clone()).await.expect("ferry starts");
    Setup { db, clock, ferry, config }
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

    async fn status(&self, id: i64) -> Status {
        self.row(id).await.status
    }

    async fn emit_keyed(&self, route: &str, event_type: &str, key: &str) -> i64 {
        self.emit_event(NewEvent::new(route, event_type, "{}").with_key(key)).await
    }
}

async fn a_stopped_relay_claims_nothing(db: TestDb) {
    let s = setup(db).await;
    let id = s.emit("s", "ok").await;
    let stopped = CancellationToken::new();
    stopped.cancel();
    let stats = s.ferry.relay.cycle(&stopped).await.unwrap();
    assert_eq!(stats.claimed, 0, "nothing is claimed only to be handed back: {stats:?}");
    let row = s.row(id).await;
    assert_eq!((row.status, row.attempts), (Status::Pending, 0));
    assert_eq!(s.cycle().await.sent, 1, "the event was there to be claimed");
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
    assert_eq!(row.failure_reason.map(|r| r.as_str()), Some("attempts_exhausted"));
    assert_eq!(row.event_time, start, "event time is immutable");
}

/// Events ending FAILED are said in the log, at most once a minute per route, with how many
/// ended so since the last line and why the last one did.
async fn failed_events_are_logged_at_most_once_a_minute_per_route(db: TestDb) {
    use tracing::instrument::WithSubscriber as _;
    let s = setup(db).await;
    let log = crate::common::Captured::default();
    let line = "events ended FAILED";
    s.emit("s", "permanent").await;
    s.emit("s", "permanent").await;
    s.emit("s", "ok").await;
    assert_eq!(s.cycle().with_subscriber(log.subscriber()).await.failed, 2);
    let text = log.text();
    assert_eq!(text.matches(line).count(), 1, "{text}");
    assert!(text.contains("route=\"s\"") || text.contains("route=s"), "{text}");
    assert!(text.contains("failed=2") && text.contains("last_reason=permanent"), "{text}");
    assert!(text.contains("scripted permanent failure") && text.contains("ferry failed list --route s"), "{text}");

    s.emit("s", "permanent").await;
    s.cycle().with_subscriber(log.subscriber()).await;
    assert_eq!(log.text().matches(line).count(), 1, "within the minute: no second line");

    s.clock.advance(Duration::from_secs(61));
    s.emit("s", "permanent").await;
    s.cycle().with_subscriber(log.subscriber()).await;
    let text = log.text();
    assert_eq!(text.matches(line).count(), 2, "{text}");
    assert!(
        text.lines().filter(|l| l.contains(line)).nth(1).unwrap().contains("failed=2"),
        "the one held back counts: {text}"
    );
}

async fn retry_after_hint_is_honoured(db: TestDb) {
    let s = setup(db).await;
    let id = s.emit_event(NewEvent::new("s", "transient", "{}").with_header("retry-after-ms", "45000")).await;
    s.cycle().await;
    assert_eq!(s.row(id).await.next_attempt_at, s.clock.now() + chrono::Duration::seconds(45));
    // A hint of nothing (a 503 with `Retry-After: 0`) waits a second, not a hot loop of retries.
    let id = s.emit_event(NewEvent::new("s", "transient", "{}").with_header("retry-after-ms", "0")).await;
    s.cycle().await;
    let row = s.row(id).await;
    assert_eq!((row.attempts, row.next_attempt_at), (1, s.clock.now() + chrono::Duration::seconds(1)));
}

async fn permanent_fails_at_once(db: TestDb) {
    let s = setup(db).await;
    let ok = s.emit("s", "ok").await;
    let bad = s.emit("s", "permanent").await;
    let stats = s.cycle().await;
    assert_eq!((stats.sent, stats.failed), (1, 1));
    let row = s.row(bad).await;
    assert_eq!((row.status, row.attempts), (Status::Failed, 1));
    assert_eq!(row.failure_reason.map(|r| r.as_str()), Some("permanent"));
    assert!(row.last_error.unwrap().contains("scripted permanent failure"));
    assert_eq!(s.row(ok).await.status, Status::Sent, "one bad event does not fail its batch");
}

async fn failed_events_go_on_to_the_dead_letter_route(db: TestDb) {
    let s = setup(db).await;
    let event = NewEvent::new("d", "permanent", r#"{"n":1}"#).with_header("tenant", "acme").with_key("k1");
    let bad = s.emit_event(event).await;
    let tired = s.emit("d", "transient").await;
    let ok = s.emit("d", "ok").await;
    let on_s = s.emit("s", "permanent").await;
    let stats = s.cycle().await;
    assert_eq!((stats.sent, stats.failed, stats.retried), (1, 2, 1));
    let copies = |after: i64| {
        let store = s.db.store.clone();
        async move {
            let mut found = Vec::new();
            for id in after + 1..after + 10 {
                if let Some(row) = store.get(id).await.unwrap() {
                    found.push(row);
                }
            }
            found
        }
    };
    let first = copies(on_s).await;
    assert_eq!(first.len(), 1, "one copy, of the event that failed on the route with a dead letter: {first:?}");
    let copy = &first[0];
    assert_eq!((copy.route.as_str(), copy.event_type.as_str(), copy.status), ("dlq", "permanent", Status::Pending));
    assert_eq!((copy.payload.as_slice(), copy.ordering_key.as_deref()), (&br#"{"n":1}"#[..], Some("k1")));
    let headers: serde_json::Value = serde_json::from_str(&copy.headers).unwrap();
    let header = |name: &str| headers[name].as_str().map(str::to_string);
    assert_eq!(header("tenant").as_deref(), Some("acme"), "the event's own headers are kept");
    assert_eq!(header("ferry-failed-event-id"), Some(bad.to_string()));
    assert_eq!(header("ferry-failed-route").as_deref(), Some("d"));
    assert_eq!(header("ferry-failed-reason").as_deref(), Some("permanent"));
    assert!(header("ferry-failed-error").is_some_and(|e| e.contains("scripted permanent failure")), "{copy:?}");
    assert_eq!(header("ferry-failed-attempts").as_deref(), Some("1"));
    assert_eq!(s.row(bad).await.status, Status::Failed, "the original stays, for inspection and resend");
    assert_eq!(s.row(ok).await.status, Status::Sent);

    // The copy fails on the dead-letter route too: it stays there (dead letters do not chain).
    // The transient event goes on once its attempts are spent.
    for _ in 0..3 {
        s.clock.advance(std::time::Duration::from_secs(600));
        let _ = s.cycle().await;
    }
    assert_eq!(s.row(copy.id).await.status, Status::Failed);
    assert_eq!(s.row(tired).await.failure_reason, Some(FailureReason::AttemptsExhausted));
    let later = copies(copy.id).await;
    let kinds: Vec<(&str, &str)> = later.iter().map(|r| (r.route.as_str(), r.event_type.as_str())).collect();
    assert_eq!(kinds, [("dlq", "transient")], "{later:?}");
    let headers: serde_json::Value = serde_json::from_str(&later[0].headers).unwrap();
    assert_eq!(headers["ferry-failed-reason"], "attempts_exhausted");
}

async fn a_dead_letter_that_cannot_be_written_leaves_the_outcomes_and_the_relay_alone(db: TestDb) {
    let s = setup(db).await;
    // The database refuses one dead letter, as a constraint an operator added might.
    s.db.refuse_inserts_when("NEW.route = 'dlq' AND NEW.ordering_key = 'refuse'", "not this one").await;
    let refused = s.emit_event(NewEvent::new("d", "permanent", "{}").with_key("refuse")).await;
    let kept = s.emit_event(NewEvent::new("d", "permanent", "{}").with_key("keep")).await;
    let ok = s.emit("d", "ok").await;
    let stats = s.cycle().await;
    assert_eq!((stats.sent, stats.failed), (1, 2), "the batch is recorded");
    for id in [refused, kept] {
        assert_eq!(s.row(id).await.status, Status::Failed, "kept where it failed, for inspection and resend");
    }
    assert_eq!(s.row(ok).await.status, Status::Sent);
    let mut copies = Vec::new();
    for id in ok + 1..ok + 10 {
        if let Some(row) = s.db.store.get(id).await.unwrap() {
            copies.push(row.ordering_key);
        }
    }
    assert_eq!(copies, [Some("keep".to_string())], "only the refused copy is lost");
    let next = s.emit("s", "ok").await;
    let _ = s.cycle().await;
    assert_eq!(s.row(next).await.status, Status::Sent, "the relay goes on");
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
        assert_eq!((row.status, row.failure_reason.map(|r| r.as_str())), (Status::Failed, Some("no_transport")));
        let error = row.last_error.unwrap();
        assert!(error.contains(needle), "{error:?} should mention {needle}");
    }
    // Rows naming routes without end add no series: the unconfigured ones are counted together,
    // the configured ones under their names.
    for n in 0..40 {
        s.emit(&format!("typo-{n}"), "ok").await;
    }
    assert_eq!(s.cycle().await.failed, 40);
    let stats = s.db.store.stats(s.clock.now(), None, false).await.unwrap();
    let routes = s.ferry.settings.get().route_names();
    let metrics = s.ferry.metrics.render(&stats, &[], &routes, Duration::ZERO);
    assert!(!metrics.contains("typo-") && !metrics.contains("nowhere"), "{metrics}");
    for line in [
        r#"ferry_events_failed_total{route="(not configured)",plugin="",reason="no_transport"} 41"#,
        r#"ferry_events_failed_total{route="refused",plugin="scripted",reason="no_transport"} 1"#,
        r#"ferry_events{route="(not configured)",status="FAILED"} 41"#,
        r#"ferry_events{route="orphan",status="FAILED"} 1"#,
    ] {
        assert!(metrics.contains(line), "metrics lack {line:?}:\n{metrics}");
    }
}

async fn an_ordered_key_waits_for_its_head(db: TestDb) {
    let s = setup(db).await;
    let head = s.emit_keyed("o", "flaky", "k1").await;
    let next = s.emit_keyed("o", "ok", "k1").await;
    let other_key = s.emit_keyed("o", "ok", "k2").await;
    let unkeyed = s.emit("o", "ok").await;
    let unordered_route = s.emit_keyed("s", "ok", "k1").await;

    let first = s.cycle().await;
    assert_eq!((first.claimed, first.retried), (4, 1), "the head of k1 and everything not behind it");
    assert_eq!(s.status(next).await, Status::Pending);
    for id in [other_key, unkeyed, unordered_route] {
        assert_eq!(s.status(id).await, Status::Sent, "event {id} is not held back by k1's retry");
    }
    assert_eq!(s.cycle().await.claimed, 0, "k1 waits while its head waits for the retry");
    s.clock.advance(Duration::from_secs(1));
    assert_eq!(s.cycle().await.sent, 1);
    assert_eq!((s.status(head).await, s.status(next).await), (Status::Sent, Status::Pending), "one in flight per key");
    assert_eq!(s.cycle().await.sent, 1);
    assert_eq!(s.status(next).await, Status::Sent);
}

async fn a_failed_head_blocks_or_skips_its_key(db: TestDb) {
    let s = setup(db).await;
    let blocked_head = s.emit_keyed("o", "permanent", "k").await;
    let blocked = s.emit_keyed("o", "ok", "k").await;
    let skipped_head = s.emit_keyed("os", "permanent", "k").await;
    let skipping = s.emit_keyed("os", "ok", "k").await;
    assert_eq!(s.cycle().await.failed, 2);
    assert_eq!(s.cycle().await.sent, 1);
    assert_eq!(s.status(skipping).await, Status::Sent, "skip: the next event goes ahead");
    assert_eq!(s.status(blocked).await, Status::Pending, "block: the key waits for the failed head");
    assert_eq!(s.cycle().await.claimed, 0);

    // Resending the failed head puts it first in line again, attempts reset.
    assert_eq!(s.db.store.resend(&[blocked_head, skipped_head, blocked], s.clock.now()).await.unwrap(), 2);
    let row = s.row(blocked_head).await;
    assert_eq!((row.status, row.attempts, row.last_error, row.failure_reason), (Status::Pending, 0, None, None));
    let again = s.cycle().await;
    assert_eq!((again.claimed, again.failed), (2, 2), "both heads retried, the blocked event still waits");
    assert_eq!(s.status(blocked).await, Status::Pending);
}

async fn retention_purges_old_sent_events_in_bounded_batches(db: TestDb) {
    let s = setup_with(db, "retain_sent = \"1d\"\npurge_batch = 2").await;
    let mut sent = Vec::new();
    for _ in 0..5 {
        sent.push(s.emit("s", "ok").await);
    }
    let failed = s.emit("s", "permanent").await;
    s.cycle().await;
    s.clock.advance(Duration::from_secs(86_400));
    // Nothing is due: the sweep stops at its first window, written at the cut-off.
    let kept = s.ferry.relay.purge().await.unwrap();
    assert_eq!((kept.deleted, kept.looked_at), (0, 2), "exactly one day old is kept");
    let young = s.emit("s", "ok").await;
    s.cycle().await;
    s.clock.advance(Duration::from_millis(1));
    let purged = s.ferry.relay.purge().await.unwrap();
    assert_eq!((purged.deleted, purged.looked_at), (5, 7), "windows of two up to the end of the table");
    for id in sent {
        assert!(s.db.store.get(id).await.unwrap().is_none());
    }
    assert_eq!(s.status(failed).await, Status::Failed, "FAILED events are never purged by retention");
    assert_eq!(s.status(young).await, Status::Sent);
}

/// Events delivered long after they were written (deferred here; retried or resent alike) are
/// not due when the events after them are: the sweep goes past them, and the next sweep, which
/// starts again from the lowest id, deletes them once they are due.
async fn retention_sweeps_past_late_deliveries_and_comes_back_for_them(db: TestDb) {
    let s = setup_with(db, "retain_sent = \"1d\"\npurge_batch = 2").await;
    let start = s.clock.now();
    let mut late = Vec::new();
    for _ in 0..3 {
        late.push(s.emit_event(NewEvent::new("s", "ok", "{}").not_before(start + chrono::Duration::hours(12))).await);
    }
    let mut prompt = Vec::new();
    for _ in 0..4 {
        prompt.push(s.emit("s", "ok").await);
    }
    assert_eq!(s.cycle().await.sent, 4);
    s.clock.advance(Duration::from_secs(12 * 3600));
    assert_eq!(s.cycle().await.sent, 3);

    s.clock.advance(Duration::from_millis(12 * 3600 * 1000 + 1));
    let first = s.ferry.relay.purge().await.unwrap();
    assert_eq!(first.deleted, 4, "the events delivered late do not stop the sweep");
    for id in &prompt {
        assert!(s.db.store.get(*id).await.unwrap().is_none());
    }
    for id in &late {
        assert_eq!(s.status(*id).await, Status::Sent);
    }
    let young = s.emit("s", "ok").await;
    s.cycle().await;

    s.clock.advance(Duration::from_secs(12 * 3600));
    assert_eq!(s.ferry.relay.purge().await.unwrap().deleted, 3, "the next sweep starts from the lowest id");
    for id in &late {
        assert!(s.db.store.get(*id).await.unwrap().is_none());
    }
    assert_eq!(s.status(young).await, Status::Sent);
}

/// A call looks at ten windows at most; the next goes on where it stopped, in this process or
/// after a restart, so a long run of events retention keeps (FAILED here) costs each call the
/// same and holds up the rest only until the sweep is past it.
async fn retention_goes_on_where_the_last_call_stopped(db: TestDb) {
    let s = setup_with(db, "retain_sent = \"1d\"\npurge_batch = 2").await;
    for _ in 0..25 {
        s.emit("s", "permanent").await;
    }
    let sent = [s.emit("s", "ok").await, s.emit("s", "ok").await];
    assert_eq!(s.cycle().await.claimed, 27);
    s.clock.advance(Duration::from_secs(86_401));

    let first = s.ferry.relay.purge().await.unwrap();
    assert_eq!((first.deleted, first.looked_at), (0, 20));
    // Another ferry on the same database (a restart) goes on from where the first stopped.
    let restarted = Ferry::start(&s.config, s.clock.clone()).await.expect("ferry starts again");
    let second = restarted.relay.purge().await.unwrap();
    assert_eq!((second.deleted, second.looked_at), (2, 7));
    for id in sent {
        assert!(s.db.store.get(id).await.unwrap().is_none());
    }
    let third = s.ferry.relay.purge().await.unwrap();
    assert_eq!((third.deleted, third.looked_at), (0, 20), "a new sweep, from the lowest id");
    assert_eq!(s.db.store.counts().await.unwrap()[&Status::Failed], 25);
}

async fn stuck_claims_are_recovered_by_housekeeping(db: TestDb) {
    let s = setup(db).await;
    let id = s.emit("s", "ok").await;
    // Another instance claimed the event and died.
    let now = s.clock.now();
    let crashed = ferry::store::Claim {
        now,
        limit: 10,
        lease_until: now + chrono::Duration::seconds(10),
        instance: "crashed-instance".into(),
        token: "gone".into(),
        ordered_routes: vec![],
        blocking_routes: vec![],
        paused_routes: vec![],
        only_route: None,
        max_payload: 1 << 20,
    };
    assert_eq!(s.db.store.claim(&crashed).await.unwrap().len(), 1);
    s.ferry.relay.housekeeping().await;
    assert_eq!(s.status(id).await, Status::Processing, "lease still valid");
    s.clock.advance(Duration::from_secs(11));
    s.ferry.relay.housekeeping().await;
    assert_eq!(s.status(id).await, Status::Pending);
    assert_eq!(s.cycle().await.sent, 1);
    assert_eq!(s.row(id).await.attempts, 2);
}

/// Ferry as in [`setup`], with breakers that open after 2 consecutive failures and probe after 1m.
async fn setup_breaker(db: TestDb) -> Setup {
    setup_with(db, "[breaker]\nthreshold = 2\ncooldown = \"1m\"").await
}

async fn breaker_of(s: &Setup, route: &str) -> ferry::store::Breaker {
    s.db.store.breakers().await.unwrap().into_iter().find(|b| b.route == route).expect("a breaker row")
}

async fn an_open_breaker_pauses_its_route_until_a_probe_succeeds(db: TestDb) {
    let s = setup_breaker(db).await;
    let t0 = s.clock.now();
    let (x1, x2) = (s.emit("s", "transient").await, s.emit("s", "transient").await);
    assert_eq!(s.cycle().await.retried, 2);
    let b = breaker_of(&s, "s").await;
    assert_eq!((b.opened_at, b.consecutive_failures), (Some(t0), 2));
    assert!(b.reason.unwrap().contains("scripted transient failure"));

    // Open: the route's events wait without using attempts; other routes flow.
    let waiting = s.emit("s", "ok").await;
    let elsewhere = s.emit("o", "ok").await;
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.sent), (1, 1));
    assert_eq!(s.status(elsewhere).await, Status::Sent);
    s.clock.advance(Duration::from_secs(59));
    assert_eq!(s.cycle().await.claimed, 0, "x1 and x2 are due, but the breaker holds them");
    let row = s.row(waiting).await;
    assert_eq!((row.status, row.attempts), (Status::Pending, 0));
    assert_eq!(s.row(x1).await.attempts, 1);

    // Cooled down: one probe (the oldest due event) goes through; its success closes the breaker.
    s.clock.advance(Duration::from_secs(1));
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.sent), (1, 1), "exactly one probe");
    assert_eq!(s.status(waiting).await, Status::Sent);
    let b = breaker_of(&s, "s").await;
    assert_eq!((b.opened_at, b.consecutive_failures), (None, 0));
    // Closed again: the rest flows (and, failing twice more, trips it again).
    assert_eq!(s.cycle().await.retried, 2);
    assert_eq!((s.row(x1).await.attempts, s.row(x2).await.attempts), (2, 2));
    assert_eq!(breaker_of(&s, "s").await.opened_at, Some(s.clock.now()));
}

async fn a_failed_probe_opens_the_breaker_again_at_once(db: TestDb) {
    let s = setup_breaker(db).await;
    let (x1, x2) = (s.emit("s", "transient").await, s.emit("s", "transient").await);
    s.cycle().await;
    s.clock.advance(Duration::from_secs(60));
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.retried), (1, 1), "one probe, and it failed");
    assert_eq!((s.row(x1).await.attempts, s.row(x2).await.attempts), (2, 1));
    let b = breaker_of(&s, "s").await;
    assert_eq!((b.opened_at, b.consecutive_failures, b.probe_until), (Some(s.clock.now()), 3, None));
    s.clock.advance(Duration::from_secs(30));
    assert_eq!(s.cycle().await.claimed, 0, "a new cooldown started with the failed probe");
}

async fn a_probe_that_fails_permanently_is_given_back_at_once(db: TestDb) {
    let s = setup_breaker(db).await;
    let t0 = s.clock.now();
    let x1 = s.emit("s", "transient").await;
    s.emit("s", "transient").await;
    s.cycle().await;
    // Due before the retries, so it is the first probe; a bad event says nothing about the endpoint.
    let bad =
        s.emit_event(NewEvent::new("s", "permanent", "{}").not_before(t0 + chrono::Duration::milliseconds(500))).await;
    s.clock.advance(Duration::from_secs(60));
    assert_eq!(s.cycle().await.failed, 1);
    assert_eq!(s.status(bad).await, Status::Failed);
    let b = breaker_of(&s, "s").await;
    assert_eq!((b.opened_at, b.probe_until), (Some(t0), None), "still open, probe given back");
    // So the next cycle probes again at once, with the next event.
    assert_eq!(s.cycle().await.claimed, 1);
    assert_eq!(s.row(x1).await.attempts, 2);
}

/// A half-open breaker whose probe cannot be taken (the database fails the write) costs its route
/// this cycle's probe, not the batch claimed with it: the other routes' events are delivered.
async fn a_probe_that_cannot_be_taken_leaves_the_batch_alone(db: TestDb) {
    let s = setup_breaker(db).await;
    let (x1, x2) = (s.emit("s", "transient").await, s.emit("s", "transient").await);
    s.cycle().await;
    s.clock.advance(Duration::from_secs(60));
    s.db.refuse("ferry_breakers", "UPDATE OF probe_until", "no probe now").await;
    let elsewhere = s.emit("o", "ok").await;
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.sent), (1, 1));
    assert_eq!(s.status(elsewhere).await, Status::Sent);
    assert_eq!((s.row(x1).await.attempts, s.row(x2).await.attempts), (1, 1), "no probe went out");
    let b = breaker_of(&s, "s").await;
    assert_eq!((b.opened_at.is_some(), b.probe_until), (true, None), "still open, no probe held");
}

/// A half-open route whose probe event the database refuses to claim: the route's next event is
/// the probe, and the refused one is set FAILED, as that claim shows the refusal is the row's.
/// Otherwise the route would stay half-open for good. A refusal of every claim fails no event,
/// though the route's only due events are claimed as probes, one at a time.
async fn a_probe_the_database_refuses_to_claim_fails_alone(db: TestDb) {
    let s = setup_breaker(db).await;
    let (x1, x2) = (s.emit("s", "transient").await, s.emit("s", "transient").await);
    s.cycle().await;
    s.clock.advance(Duration::from_secs(60));
    crate::rows::refuse_claims(&s.db, "everything", "NEW.status = 'PROCESSING'", "no claims today").await;
    assert_eq!(s.cycle().await.claimed, 0);
    for id in [x1, x2] {
        let row = s.row(id).await;
        assert_eq!((row.status, row.attempts), (Status::Pending, 1), "event {id}: {:?}", row.last_error);
    }
    let lifted = match s.db.backend {
        crate::common::Backend::Sqlite => "DROP TRIGGER refuse_everything",
        crate::common::Backend::Postgres => "DROP TRIGGER refuse_everything ON ferry_events",
    };
    crate::rows::sql(&s.db, lifted).await.unwrap();
    let when = format!("NEW.id = {x1} AND NEW.status = 'PROCESSING'");
    crate::rows::refuse_claims(&s.db, "probe", &when, "not this one").await;
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.retried), (1, 1), "the next event is the probe: {stats:?}");
    assert_eq!(s.row(x2).await.attempts, 2);
    let row = s.row(x1).await;
    let error = row.last_error.unwrap_or_default();
    assert_eq!((row.status, row.failure_reason), (Status::Failed, Some(FailureReason::InvalidEvent)), "{error}");
    assert!(error.contains("refuses to claim it") && error.contains("not this one"), "{error}");
}

async fn operators_open_and_close_breakers_by_hand(db: TestDb) {
    let s = setup_breaker(db).await;
    s.db.store.set_breaker("s", true, "receiver maintenance", s.clock.now()).await.unwrap();
    let id = s.emit("s", "ok").await;
    assert_eq!(s.cycle().await.claimed, 0);
    s.clock.advance(Duration::from_secs(3 * 3600));
    assert_eq!(s.cycle().await.claimed, 0, "no probes for a breaker opened by hand");
    s.db.store.set_breaker("s", false, "", s.clock.now()).await.unwrap();
    assert_eq!(s.cycle().await.sent, 1);
    assert_eq!(s.status(id).await, Status::Sent);
}

async fn permanent_failures_do_not_trip_the_breaker(db: TestDb) {
    let s = setup_breaker(db).await;
    for _ in 0..3 {
        s.emit("s", "permanent").await;
    }
    assert_eq!(s.cycle().await.failed, 3);
    assert!(s.db.store.breakers().await.unwrap().is_empty(), "the endpoint answered; the events were bad");
}

/// A deferral (contract 0.2) puts the event back at the plugin's delay, at least a second, without
/// counting an attempt; the route waits as long (on this instance); the history keeps a
/// `deferred` row (one per run of deferrals) and `ferry show` says until when and why; the next
/// answer is recorded as usual.
async fn a_deferral_waits_without_counting_an_attempt(db: TestDb) {
    use ferry::event::AttemptOutcome;
    let s = setup(db).await;
    let t0 = s.clock.now();
    let defer = |delay: &str, times: &str| {
        NewEvent::new("s", "defer", "{}").with_header("delay-ms", delay).with_header("times", times)
    };
    let twice = s.emit_event(defer("3000", "2")).await;
    let short = s.emit_event(defer("10", "1")).await;
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.deferred, stats.retried, stats.sent), (2, 2, 0, 0));
    let row = s.row(twice).await;
    assert_eq!((row.status, row.attempts), (Status::Pending, 0), "no attempt counted");
    assert_eq!(row.next_attempt_at, t0 + chrono::Duration::seconds(3));
    assert_eq!(row.last_error.as_deref(), Some("defer 1"));
    assert_eq!(s.row(short).await.next_attempt_at, t0 + chrono::Duration::seconds(1), "10 ms is raised to 1 s");
    let history = s.db.store.attempts(twice).await.unwrap();
    assert_eq!(history.len(), 1);
    assert_eq!((history[0].outcome, history[0].attempt), (AttemptOutcome::Deferred, 1));
    assert_eq!((history[0].plugin.as_deref(), history[0].error.as_deref()), (Some("scripted"), Some("defer 1")));
    let ops =
        ferry::ops::Ops::new(s.ferry.settings.get(), s.db.store.clone(), s.clock.clone(), ferry::ops::FrontEnd::Cli);
    let waiting = ops.show(twice).await.unwrap().waiting.unwrap();
    assert!(
        waiting[0].starts_with("deferred by plugin scripted until ")
            && waiting[0].contains("(defer 1); no attempt was counted"),
        "{waiting:?}"
    );

    s.clock.advance(Duration::from_secs(1));
    assert_eq!(s.cycle().await.sent, 1, "the short deferral is over");
    let row = s.row(short).await;
    assert_eq!((row.status, row.attempts), (Status::Sent, 1));
    s.clock.advance(Duration::from_secs(2));
    assert_eq!(s.cycle().await.deferred, 1, "deferred a second time");
    assert_eq!(s.row(twice).await.attempts, 0);
    s.clock.advance(Duration::from_secs(3));
    assert_eq!(s.cycle().await.sent, 1);
    let row = s.row(twice).await;
    assert_eq!((row.status, row.attempts), (Status::Sent, 1), "delivered on its first counted attempt");
    // A run of deferrals keeps one history row, the last: a plugin that defers again and again
    // cannot grow the history without end.
    let history: Vec<_> =
        s.db.store.attempts(twice).await.unwrap().into_iter().map(|a| (a.outcome, a.attempt, a.error)).collect();
    assert_eq!(history[0], (AttemptOutcome::Deferred, 1, Some("defer 2".to_string())), "{history:?}");
    assert_eq!(history.iter().filter(|(o, _, _)| *o == AttemptOutcome::Deferred).count(), 1, "{history:?}");
}

/// The receiver that defers is healthy: a deferral neither counts towards opening the route's
/// breaker nor resets the failures counted so far.
async fn a_deferral_neither_counts_nor_resets_the_breaker(db: TestDb) {
    let s = setup_breaker(db).await;
    s.emit("s", "transient").await;
    assert_eq!(s.cycle().await.retried, 1);
    assert_eq!(breaker_of(&s, "s").await.consecutive_failures, 1);
    s.emit_event(NewEvent::new("s", "defer", "{}").with_header("delay-ms", "10").with_header("times", "9")).await;
    assert_eq!(s.cycle().await.deferred, 1);
    let b = breaker_of(&s, "s").await;
    assert_eq!((b.consecutive_failures, b.opened_at), (1, None), "not reset by the deferral");
    // Both due: the retry fails again and the event is deferred again. Counting the deferral
    // would make 3.
    s.clock.advance(Duration::from_secs(1));
    let stats = s.cycle().await;
    assert_eq!((stats.retried, stats.deferred), (1, 1));
    let b = breaker_of(&s, "s").await;
    assert_eq!((b.consecutive_failures, b.opened_at), (2, Some(s.clock.now())));
}

/// A plugin built for ferry:transport@0.1 (`tests/plugins/legacy`, built against `wit/v0.1`)
/// loads with that version's bindings beside a current one and runs as it did: its answers, its
/// retry-after hint and its log lines arrive as a current plugin's would.
async fn a_plugin_built_for_contract_0_1_still_delivers(db: TestDb) {
    use tracing::instrument::WithSubscriber as _;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted", "ferry_test_legacy"]);
    let config = db.config(&format!(
        r#"
        [plugins]
        dir = {plugins:?}
        [retry]
        jitter = "none"
        [route.old]
        plugin = "legacy"
        [route.new]
        plugin = "scripted"
        "#
    ));
    let clock = Arc::new(ManualClock::new(Utc.with_ymd_and_hms(2026, 5, 1, 8, 0, 0).unwrap()));
    let ferry = Ferry::start(&config, clock.clone()).await.expect("ferry starts");
    let (plugins, errors) = ferry.registry.status();
    assert!(errors.is_empty(), "{errors:?}");
    let wit: Vec<(&str, &str)> = plugins.iter().map(|p| (p.name.as_str(), p.wit.as_str())).collect();
    assert_eq!(wit, [("legacy", "0.1.0"), ("scripted", ferry::plugins::WIT_VERSION)]);

    let mut ids = Vec::new();
    for event in [
        NewEvent::new("old", "ok", "{}"),
        NewEvent::new("old", "transient", "{}").with_header("retry-after-ms", "7000"),
        NewEvent::new("old", "permanent", "{}"),
        NewEvent::new("new", "ok", "{}"),
    ] {
        ids.push(db.store.insert(&event, clock.now()).await.unwrap());
    }
    let log = crate::common::Captured::default();
    let stats = ferry.relay.cycle(&CancellationToken::new()).with_subscriber(log.subscriber()).await.unwrap();
    assert_eq!((stats.sent, stats.retried, stats.failed), (2, 1, 1));
    let mut rows = Vec::new();
    for id in ids {
        rows.push(db.store.get(id).await.unwrap().unwrap());
    }
    assert_eq!((rows[0].status, rows[3].status), (Status::Sent, Status::Sent));
    let retry = &rows[1];
    assert_eq!((retry.status, retry.next_attempt_at), (Status::Pending, clock.now() + chrono::Duration::seconds(7)));
    assert_eq!(retry.last_error.as_deref(), Some("legacy transient"));
    assert_eq!((rows[2].status, rows[2].last_error.as_deref()), (Status::Failed, Some("legacy permanent")));
    let text = log.text();
    assert!(text.contains("legacy: 3 events"), "the 0.1 logging import works: {text}");
}

/// A half-open probe that the plugin defers is given back, and this instance leaves the route
/// alone until the deferral is due: no second probe follows at once, though other events of the
/// route are due.
async fn a_deferred_probe_waits_before_the_next(db: TestDb) {
    let s = setup_breaker(db).await;
    s.emit("s", "transient").await;
    s.emit("s", "transient").await;
    assert_eq!(s.cycle().await.retried, 2);
    assert!(breaker_of(&s, "s").await.opened_at.is_some());
    // Due before the retries, so it is the probe.
    let probe =
        s.emit_event(NewEvent::new("s", "defer", "{}").with_header("delay-ms", "5000").with_header("times", "9")).await;
    s.clock.advance(Duration::from_secs(60));
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.deferred), (1, 1), "one probe, deferred");
    assert_eq!(s.row(probe).await.attempts, 0);
    let b = breaker_of(&s, "s").await;
    assert!(b.is_open() && b.probe_until.is_none(), "the probe is given back: {b:?}");
    assert_eq!(b.consecutive_failures, 2, "neither counted nor reset");
    s.clock.advance(Duration::from_millis(4999));
    assert_eq!(s.cycle().await.claimed, 0, "no probe while the receiver asked to wait");
    s.clock.advance(Duration::from_millis(1));
    assert_eq!(s.cycle().await.claimed, 1, "the next probe once the wait is over");
}

/// On an ordered route a deferred head holds its key: the next event of the key waits for it.
async fn a_deferred_head_holds_its_key(db: TestDb) {
    let s = setup(db).await;
    let head = s
        .emit_event(
            NewEvent::new("o", "defer", "{}").with_key("k").with_header("delay-ms", "2000").with_header("times", "1"),
        )
        .await;
    let next = s.emit_keyed("o", "ok", "k").await;
    let other = s.emit_keyed("o", "ok", "other").await;
    let stats = s.cycle().await;
    assert_eq!((stats.deferred, stats.sent), (1, 1), "the head deferred, the other key delivered");
    assert_eq!((s.status(next).await, s.status(other).await), (Status::Pending, Status::Sent));
    s.clock.advance(Duration::from_secs(2));
    assert_eq!(s.cycle().await.sent, 1);
    assert_eq!(s.status(head).await, Status::Sent);
    assert_eq!(s.cycle().await.sent, 1);
    assert_eq!(s.status(next).await, Status::Sent, "then the next of the key");
}

crate::both_backends!(
    a_stopped_relay_claims_nothing,
    a_deferred_probe_waits_before_the_next,
    a_deferred_head_holds_its_key,
    a_plugin_built_for_contract_0_1_still_delivers,
    a_deferral_waits_without_counting_an_attempt,
    a_deferral_neither_counts_nor_resets_the_breaker,
    failed_events_go_on_to_the_dead_letter_route,
    a_dead_letter_that_cannot_be_written_leaves_the_outcomes_and_the_relay_alone,
    failed_events_are_logged_at_most_once_a_minute_per_route,
    an_open_breaker_pauses_its_route_until_a_probe_succeeds,
    a_failed_probe_opens_the_breaker_again_at_once,
    a_probe_that_fails_permanently_is_given_back_at_once,
    a_probe_that_cannot_be_taken_leaves_the_batch_alone,
    a_probe_the_database_refuses_to_claim_fails_alone,
    operators_open_and_close_breakers_by_hand,
    permanent_failures_do_not_trip_the_breaker,
    an_ordered_key_waits_for_its_head,
    a_failed_head_blocks_or_skips_its_key,
    retention_purges_old_sent_events_in_bounded_batches,
    retention_sweeps_past_late_deliveries_and_comes_back_for_them,
    retention_goes_on_where_the_last_call_stopped,
    stuck_claims_are_recovered_by_housekeeping,
    success_is_sent,
    transient_retries_with_backoff_then_fails,
    retry_after_hint_is_honoured,
    permanent_fails_at_once,
    a_trap_is_transient_and_the_plugin_recovers,
    a_runaway_plugin_is_timed_out,
    routes_without_a_transport_fail_with_no_transport,
);

/// Outcomes the database could not write this time (a serialization failure, raised once by a
/// trigger) are written by trying again, not left PROCESSING for the claim's lease to hand back
/// for a second delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outcomes_are_written_by_trying_again_after_a_transient_failure() {
    let db = TestDb::new(crate::common::Backend::Postgres).await;
    let pool = db.postgres.as_ref().unwrap().pool().clone();
    for statement in [
        "CREATE SEQUENCE sent_updates",
        "CREATE FUNCTION fail_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
             IF nextval('sent_updates') = 1 THEN
                 RAISE EXCEPTION 'could not serialize access' USING ERRCODE = '40001';
             END IF;
             RETURN NEW;
         END $$",
        "CREATE TRIGGER fail_once BEFORE UPDATE ON ferry_events
         FOR EACH ROW WHEN (NEW.status = 'SENT') EXECUTE FUNCTION fail_once()",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    let s = setup(db).await;
    let ids = [s.emit("s", "ok").await, s.emit("s", "ok").await];
    let stats = s.cycle().await;
    assert_eq!((stats.sent, stats.fenced_off), (2, 0));
    for id in ids {
        assert_eq!(s.status(id).await, Status::Sent);
    }
    let updates: i64 = sqlx::query_scalar("SELECT last_value FROM sent_updates").fetch_one(&pool).await.unwrap();
    assert_eq!(updates, 3, "the first try failed on its first row, the second wrote both");
}
