//! The store suite, written once and run against SQLite and PostgreSQL: claim, complete, retry,
//! fail, fencing, recovery, and that concurrent claimers never share an event.

use std::collections::HashSet;
use std::sync::Arc;

use chrono::{DateTime, TimeZone, Utc};
use ferry::NewEvent;
use ferry::event::{AttemptLog, CallLog, Completion, Disposition, FailureReason, Status};
use ferry::store::{Claim, EndEvent, FailedFilter, ReasonFilter, SweepStep, SweepWindow};

use crate::common::{Backend, TestDb, emit_in_transaction};

fn t0() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 3, 1, 12, 0, 0).unwrap()
}

fn secs(n: i64) -> chrono::Duration {
    chrono::Duration::seconds(n)
}

fn claim(now: DateTime<Utc>, limit: u32, token: &str) -> Claim {
    Claim {
        now,
        limit,
        lease_until: now + secs(300),
        instance: "test-instance".into(),
        token: token.into(),
        ordered_routes: vec![],
        blocking_routes: vec![],
        paused_routes: vec![],
        only_route: None,
        max_payload: 1 << 20,
    }
}

/// A step of retention's sweep from id `from`, of `limit` events, with the cut-off `before`, at `now`.
fn sweep(from: i64, before: DateTime<Utc>, now: DateTime<Utc>, limit: u32) -> SweepWindow {
    SweepWindow { from, limit, before, now }
}

/// Three events written and SENT at `t0()`, by one claim; their ids.
async fn three_sent(s: &dyn ferry::store::Store) -> Vec<i64> {
    for _ in 0..3 {
        s.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    }
    let sent: Vec<i64> = s.claim(&claim(t0(), 10, "tok")).await.unwrap().iter().map(|e| e.id).collect();
    let items: Vec<Completion> = sent.iter().map(|id| done(*id, Disposition::Sent)).collect();
    s.complete("tok", t0(), &items).await.unwrap();
    sent
}

fn done(id: i64, disposition: Disposition) -> Completion {
    Completion { id, disposition, max_attempts: 6, attempt: Default::default(), dead_letter: None }
}

/// Ferry's clock reads whole milliseconds, while an event's due time may keep microseconds
/// (PostgreSQL's `now()`, which an emit or a plain INSERT takes, or a `not_before` given so): an
/// event due within the claim's millisecond is claimed, and one due at the next is not. Compared
/// to the millisecond alone, an event committed in the same millisecond as the claim its
/// notification set off was passed over and waited for the next wake-up (at low load, about one
/// event in twenty here, 20 ms late).
async fn an_event_due_within_the_claims_millisecond_is_claimed(db: TestDb) {
    let s = &db.store;
    let within = chrono::Duration::microseconds(999);
    let due = s.insert(&NewEvent::new("r", "t", "{}").not_before(t0() + within), t0()).await.unwrap();
    s.insert(&NewEvent::new("r", "t", "{}").not_before(t0() + chrono::Duration::milliseconds(1)), t0()).await.unwrap();
    let got: Vec<i64> = s.claim(&claim(t0(), 10, "tok")).await.unwrap().iter().map(|e| e.id).collect();
    assert_eq!(got, vec![due], "due within the claim's millisecond, and not the next one's");
}

async fn claim_returns_due_events_in_order(db: TestDb) {
    let s = &db.store;
    let a = s.insert(&NewEvent::new("r", "a", "1"), t0()).await.unwrap();
    let b = s.insert(&NewEvent::new("r", "b", "2").with_key("k").with_header("h", "v"), t0()).await.unwrap();
    let later = s.insert(&NewEvent::new("r", "c", "3").not_before(t0() + secs(60)), t0()).await.unwrap();

    let got = s.claim(&claim(t0(), 10, "tok")).await.unwrap();
    assert_eq!(got.iter().map(|e| e.id).collect::<Vec<_>>(), vec![a, b], "deferred event not claimed early");
    assert_eq!(got[0].attempt, 1);
    assert_eq!(got[1].ordering_key.as_deref(), Some("k"));
    assert_eq!(got[1].headers, vec![("h".to_string(), "v".to_string())]);
    assert_eq!(got[1].payload, b"2");
    assert_eq!(got[1].content_type, "application/json");
    assert_eq!(got[1].event_time, t0(), "event time defaults to the emit time");

    let row = s.get(a).await.unwrap().unwrap();
    assert_eq!(row.status, Status::Processing);
    assert_eq!(row.claimed_by.as_deref(), Some("test-instance"));
    assert_eq!(row.claim_token.as_deref(), Some("tok"));
    assert_eq!(row.lease_until, Some(t0() + secs(300)));
    assert_eq!(row.attempts, 1);

    assert!(s.claim(&claim(t0() + secs(59), 10, "t2")).await.unwrap().is_empty(), "nothing else is due");
    let deferred = s.claim(&claim(t0() + secs(60), 10, "t3")).await.unwrap();
    assert_eq!(deferred.len(), 1);
    assert_eq!((deferred[0].id, deferred[0].attempt), (later, 1), "deferral is not an attempt");
}

async fn complete_records_each_outcome(db: TestDb) {
    let s = &db.store;
    for kind in ["sent", "retry", "failed"] {
        s.insert(&NewEvent::new("r", kind, "{}"), t0()).await.unwrap();
    }
    let ids: Vec<i64> = s.claim(&claim(t0(), 10, "tok")).await.unwrap().iter().map(|e| e.id).collect();
    let now = t0() + secs(2);
    let items = vec![
        done(ids[0], Disposition::Sent),
        done(ids[1], Disposition::Retry { at: now + secs(30), error: "busy".into() }),
        done(ids[2], Disposition::Failed { reason: FailureReason::Permanent, error: "rejected".into() }),
    ];
    assert_eq!(s.complete("tok", now, &items).await.unwrap(), 3);

    let sent = s.get(ids[0]).await.unwrap().unwrap();
    assert_eq!((sent.status, sent.processed_at, sent.last_status_at), (Status::Sent, Some(now), now));
    assert_eq!((sent.claim_token, sent.lease_until, sent.max_attempts), (None, None, Some(6)));

    let retry = s.get(ids[1]).await.unwrap().unwrap();
    assert_eq!((retry.status, retry.next_attempt_at), (Status::Pending, now + secs(30)));
    assert_eq!((retry.last_error.as_deref(), retry.processed_at, retry.attempts), (Some("busy"), None, 1));

    let failed = s.get(ids[2]).await.unwrap().unwrap();
    assert_eq!(failed.status, Status::Failed);
    assert_eq!(failed.failure_reason.map(|r| r.as_str()), Some("permanent"));
    assert_eq!((failed.last_error.as_deref(), failed.processed_at), (Some("rejected"), Some(now)));

    // The retried event comes back when due, as attempt 2; the event time never changes.
    assert!(s.claim(&claim(now + secs(29), 10, "t2")).await.unwrap().is_empty());
    let again = s.claim(&claim(now + secs(30), 10, "t3")).await.unwrap();
    assert_eq!((again[0].id, again[0].attempt, again[0].event_time), (ids[1], 2, t0()));

    let counts = s.counts().await.unwrap();
    assert_eq!(counts[&Status::Sent], 1);
    assert_eq!(counts[&Status::Processing], 1);
    assert_eq!(counts[&Status::Failed], 1);
    assert_eq!(counts[&Status::Pending], 0);
}

async fn stored_attempt_limit_is_kept(db: TestDb) {
    let s = &db.store;
    let mut pinned = NewEvent::new("r", "t", "{}");
    pinned.max_attempts = Some(3);
    let id = s.insert(&pinned, t0()).await.unwrap();
    let got = s.claim(&claim(t0(), 1, "tok")).await.unwrap();
    assert_eq!(got[0].max_attempts, Some(3));
    // A completion carrying today's route limit does not overwrite the limit fixed at emit.
    s.complete("tok", t0(), &[done(id, Disposition::Sent)]).await.unwrap();
    assert_eq!(s.get(id).await.unwrap().unwrap().max_attempts, Some(3));
}

async fn writes_of_a_recovered_claim_are_fenced_off(db: TestDb) {
    let s = &db.store;
    let id = s.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    let mut first = claim(t0(), 1, "old");
    first.lease_until = t0() + secs(5);
    assert_eq!(s.claim(&first).await.unwrap().len(), 1);

    assert!(s.recover_expired(t0() + secs(5), 10).await.unwrap().is_empty(), "lease not yet expired");
    let recovered = s.recover_expired(t0() + secs(6), 10).await.unwrap();
    assert_eq!(recovered.len(), 1);
    assert_eq!((recovered[0].id, recovered[0].claimed_by.as_deref()), (id, Some("test-instance")));
    let row = s.get(id).await.unwrap().unwrap();
    assert_eq!(row.status, Status::Pending);
    assert!(row.last_error.unwrap().contains("lease expired"));

    let second = s.claim(&claim(t0() + secs(6), 1, "new")).await.unwrap();
    assert_eq!((second[0].id, second[0].attempt), (id, 2), "the interrupted attempt counts");
    // The first worker wakes up and reports: nothing changes.
    assert_eq!(s.complete("old", t0() + secs(7), &[done(id, Disposition::Sent)]).await.unwrap(), 0);
    let row = s.get(id).await.unwrap().unwrap();
    assert_eq!((row.status, row.claim_token.as_deref()), (Status::Processing, Some("new")));
    assert_eq!(s.complete("new", t0() + secs(8), &[done(id, Disposition::Sent)]).await.unwrap(), 1);
}

async fn release_hands_back_without_counting_the_attempt(db: TestDb) {
    let s = &db.store;
    let id = s.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    s.claim(&claim(t0(), 1, "tok")).await.unwrap();
    assert_eq!(s.release("other", &[id], t0()).await.unwrap(), 0, "another claim's token releases nothing");
    assert_eq!(s.release("tok", &[id], t0()).await.unwrap(), 1);
    let row = s.get(id).await.unwrap().unwrap();
    assert_eq!((row.status, row.attempts, row.claim_token), (Status::Pending, 0, None));
}

async fn concurrent_claimers_never_share_an_event(db: TestDb) {
    const EVENTS: usize = 400;
    for i in 0..EVENTS {
        db.store.insert(&NewEvent::new("r", "t", format!("{i}")), t0()).await.unwrap();
    }
    let mut workers = Vec::new();
    for w in 0..4 {
        let store = db.store.clone();
        workers.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            for round in 0.. {
                let got = store.claim(&claim(t0(), 7, &format!("w{w}-{round}"))).await.unwrap();
                if got.is_empty() {
                    break;
                }
                mine.extend(got.into_iter().map(|e| e.id));
                tokio::task::yield_now().await;
            }
            mine
        }));
    }
    let mut seen = HashSet::new();
    let mut total = 0;
    for worker in workers {
        for id in worker.await.unwrap() {
            total += 1;
            assert!(seen.insert(id), "event {id} was claimed twice");
        }
    }
    assert_eq!((total, seen.len()), (EVENTS, EVENTS));
    assert_eq!(db.store.counts().await.unwrap()[&Status::Processing], EVENTS as u64);
}

async fn transactional_emit_commits_with_the_caller(db: TestDb) {
    let committed = NewEvent::new("orders", "order.paid", r#"{"id":1}"#);
    let rolled_back = NewEvent::new("orders", "order.paid", r#"{"id":2}"#);
    emit_in_transaction(&db, &rolled_back, false).await;
    emit_in_transaction(&db, &committed, true).await;
    let got = db.store.claim(&claim(Utc::now() + secs(1), 10, "tok")).await.unwrap();
    assert_eq!(got.len(), 1, "only the committed event exists");
    assert_eq!(got[0].payload, br#"{"id":1}"#);
}

async fn plain_sql_insert_gets_every_default(db: TestDb) {
    // The INSERT documented in README for applications in other languages.
    let sql = match db.backend {
        Backend::Sqlite => {
            "INSERT INTO ferry_events (route, event_type, payload) VALUES ('orders', 'order.created', '{\"id\":7}')"
        }
        Backend::Postgres => {
            "INSERT INTO ferry_events (route, event_type, payload) VALUES ('orders', 'order.created', convert_to('{\"id\":7}', 'UTF8'))"
        }
    };
    execute(&db, sql).await.unwrap();
    let got = db.store.claim(&claim(Utc::now() + secs(1), 10, "tok")).await.unwrap();
    assert_eq!(got.len(), 1);
    let e = &got[0];
    assert_eq!(
        (e.payload.as_slice(), e.content_type.as_str(), e.attempt),
        (&br#"{"id":7}"#[..], "application/json", 1)
    );
    assert!(e.headers.is_empty() && e.ordering_key.is_none() && e.max_attempts.is_none());
    assert!((Utc::now() - e.created_at).num_seconds().abs() < 60, "created_at defaults to now");
}

async fn bad_rows_are_rejected_at_insert(db: TestDb) {
    let bad = [
        "INSERT INTO ferry_events (route, event_type, payload, headers) VALUES ('r', 't', 'x', 'not json')",
        "INSERT INTO ferry_events (route, event_type, payload, headers) VALUES ('r', 't', 'x', '[1, 2]')",
        "INSERT INTO ferry_events (route, event_type, payload) VALUES ('', 't', 'x')",
        "INSERT INTO ferry_events (route, event_type, payload, status) VALUES ('r', 't', 'x', 'DONE')",
    ];
    for sql in bad {
        assert!(execute(&db, sql).await.is_err(), "accepted: {sql}");
    }
    let err = db.store.insert(&NewEvent::new("r", "", "x"), t0()).await.unwrap_err();
    assert!(err.to_string().contains("event type"), "{err}");
    assert_eq!(db.store.counts().await.unwrap().values().sum::<u64>(), 0);
}

async fn execute(db: &TestDb, sql: &str) -> Result<(), sqlx::Error> {
    match db.backend {
        Backend::Sqlite => sqlx::query(sql).execute(db.sqlite.as_ref().unwrap().pool()).await.map(drop),
        Backend::Postgres => sqlx::query(sql).execute(db.postgres.as_ref().unwrap().pool()).await.map(drop),
    }
}

async fn resend_makes_failed_events_pending_again(db: TestDb) {
    let s = &db.store;
    let failed = s.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    let pending = s.insert(&NewEvent::new("r", "t", "{}").not_before(t0() + secs(3600)), t0()).await.unwrap();
    s.claim(&claim(t0(), 10, "tok")).await.unwrap();
    let reason = FailureReason::NoTransport;
    s.complete("tok", t0(), &[done(failed, Disposition::Failed { reason, error: "none".into() })]).await.unwrap();

    let later = t0() + secs(60);
    assert_eq!(s.resend(&[failed, pending, 999_999], later).await.unwrap(), 1, "only FAILED events are resent");
    let row = s.get(failed).await.unwrap().unwrap();
    assert_eq!((row.status, row.attempts, row.next_attempt_at, row.last_status_at), (Status::Pending, 0, later, later));
    assert_eq!((row.last_error, row.failure_reason, row.processed_at), (None, None, None));
    let again = s.claim(&claim(later, 10, "t2")).await.unwrap();
    assert_eq!((again[0].id, again[0].attempt), (failed, 1));
}

/// Six FAILED events — routes a/b, types x/y, created a minute apart — and one PENDING event.
pub(crate) async fn failed_fixture(db: &TestDb) -> Vec<i64> {
    let s = &db.store;
    let mut ids = Vec::new();
    for (i, (route, kind)) in
        [("a", "x"), ("a", "y"), ("b", "x"), ("b", "y"), ("a", "x"), ("b", "x")].iter().enumerate()
    {
        ids.push(s.insert(&NewEvent::new(*route, *kind, "{}"), t0() + secs(60 * i as i64)).await.unwrap());
    }
    s.insert(&NewEvent::new("a", "x", "{}").not_before(t0() + secs(86_400)), t0()).await.unwrap();
    let claimed = s.claim(&claim(t0() + secs(3600), 10, "tok")).await.unwrap();
    let reason = FailureReason::Permanent;
    let items: Vec<Completion> =
        claimed.iter().map(|e| done(e.id, Disposition::Failed { reason, error: "rejected".into() })).collect();
    s.complete("tok", t0() + secs(3600), &items).await.unwrap();
    ids
}

async fn failed_events_are_counted_listed_resent_and_purged_by_filter(db: TestDb) {
    let s = &db.store;
    let ids = failed_fixture(&db).await;
    let all = FailedFilter::default();
    let route_a = FailedFilter { route: Some("a".into()), ..all.clone() };
    let type_x = FailedFilter { event_type: Some("x".into()), ..all.clone() };
    // Created in [t0+1m, t0+4m): events 1, 2, 3.
    let window = FailedFilter { from: Some(t0() + secs(60)), before: Some(t0() + secs(240)), ..all.clone() };
    assert_eq!(s.count_failed(&all).await.unwrap(), 6, "the PENDING event is not counted");
    assert_eq!(s.count_failed(&route_a).await.unwrap(), 3);
    assert_eq!(s.count_failed(&FailedFilter { event_type: Some("x".into()), ..route_a.clone() }).await.unwrap(), 2);
    assert_eq!(s.count_failed(&window).await.unwrap(), 3);
    // Grouped by route, type and reason: the largest groups first, then by name.
    let groups = s.failed_groups(&all, 10).await.unwrap();
    let shape: Vec<(&str, &str, Option<&str>, u64)> =
        groups.iter().map(|g| (g.route.as_str(), g.event_type.as_str(), g.reason.as_deref(), g.count)).collect();
    let permanent = Some("permanent");
    assert_eq!(
        shape,
        [("a", "x", permanent, 2), ("b", "x", permanent, 2), ("a", "y", permanent, 1), ("b", "y", permanent, 1)]
    );
    assert_eq!(
        (groups[0].first_failed_at, groups[0].last_failed_at),
        (Some(t0() + secs(3600)), Some(t0() + secs(3600)))
    );
    assert_eq!(s.failed_groups(&all, 1).await.unwrap().len(), 1, "the limit holds");
    assert_eq!(s.failed_groups(&route_a, 10).await.unwrap().len(), 2);
    let exhausted = FailedFilter { reason: Some(ReasonFilter::Is(FailureReason::AttemptsExhausted)), ..all.clone() };
    assert_eq!(s.count_failed(&exhausted).await.unwrap(), 0);
    assert!(s.failed_groups(&exhausted, 10).await.unwrap().is_empty());
    let by_reason = FailedFilter { reason: Some(ReasonFilter::Is(FailureReason::Permanent)), ..all.clone() };
    assert_eq!(s.tally_failed(&by_reason).await.unwrap(), (6, Some(ids[5])));
    let through = FailedFilter { through_id: Some(ids[2]), ..all.clone() };
    assert_eq!(s.tally_failed(&through).await.unwrap(), (3, Some(ids[2])), "through_id bounds the selection");
    let unrecorded = FailedFilter { reason: Some(ReasonFilter::Unrecorded), ..all.clone() };
    assert_eq!(s.count_failed(&unrecorded).await.unwrap(), 0, "every fixture event has its reason");
    let listed = |events: Vec<ferry::event::EventRecord>| events.iter().map(|e| e.id).collect::<Vec<_>>();
    assert_eq!(listed(s.list_failed(&window, 10).await.unwrap()), ids[1..4].to_vec());

    // Paging through type x: 2 per page.
    let page1 = listed(s.list_failed(&type_x, 2).await.unwrap());
    assert_eq!(page1, vec![ids[0], ids[2]]);
    let next = FailedFilter { after_id: Some(page1[1]), ..type_x.clone() };
    assert_eq!(listed(s.list_failed(&next, 2).await.unwrap()), vec![ids[4], ids[5]]);
    let newest = FailedFilter { newest_first: true, ..type_x.clone() };
    assert_eq!(listed(s.list_failed(&newest, 3).await.unwrap()), vec![ids[5], ids[4], ids[2]]);

    // By the text of the last error, letter case aside; the text is data, not a pattern.
    let error = |text: &str| FailedFilter { error: Some(text.into()), ..all.clone() };
    assert_eq!(s.count_failed(&error("JECT")).await.unwrap(), 6);
    for nothing in ["%", "_", "rejected!", "'"] {
        assert_eq!(s.count_failed(&error(nothing)).await.unwrap(), 0, "{nothing:?}");
    }
    assert_eq!(s.failed_groups(&error("rejected"), 10).await.unwrap().len(), 4);

    // Resend route a in steps of 2: 2, then 1, then nothing left.
    let later = t0() + secs(7200);
    assert_eq!(s.resend_failed(&route_a, later, 2).await.unwrap().len(), 2);
    assert_eq!(s.resend_failed(&route_a, later, 2).await.unwrap().len(), 1);
    assert_eq!(s.resend_failed(&route_a, later, 2).await.unwrap().len(), 0);
    let row = s.get(ids[0]).await.unwrap().unwrap();
    assert_eq!((row.status, row.attempts, row.last_error, row.next_attempt_at), (Status::Pending, 0, None, later));

    // Purge type y (only b's is still FAILED), then everything else.
    assert_eq!(
        s.purge_failed(&FailedFilter { event_type: Some("y".into()), ..all.clone() }, 100).await.unwrap().len(),
        1
    );
    assert!(s.get(ids[3]).await.unwrap().is_none());
    assert_eq!(s.purge_failed(&all, 100).await.unwrap().len(), 2);
    assert_eq!(s.count_failed(&all).await.unwrap(), 0);
    assert_eq!(s.counts().await.unwrap()[&Status::Pending], 4, "resent and never-failed events stay");
}

async fn purge_deletes_only_old_sent_events(db: TestDb) {
    let s = &db.store;
    let sent = three_sent(s.as_ref()).await;
    let pending = s.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    let step = |seen, last, young, deleted| SweepStep { seen, last, young, deleted };

    // Written at the cut-off: young, and not deleted.
    let later = t0() + secs(1);
    assert_eq!(s.purge_sent(&sweep(i64::MIN, t0(), later, 10)).await.unwrap(), step(4, Some(pending), true, 0));
    // A window of two, then the rest from where it ended; the PENDING event is looked at, kept.
    assert_eq!(s.purge_sent(&sweep(i64::MIN, later, later, 2)).await.unwrap(), step(2, Some(sent[1]), false, 2));
    assert_eq!(s.purge_sent(&sweep(sent[1] + 1, later, later, 2)).await.unwrap(), step(2, Some(pending), false, 1));
    assert_eq!(s.purge_sent(&sweep(pending + 1, later, later, 2)).await.unwrap(), step(0, None, false, 0));
    assert_eq!(s.counts().await.unwrap()[&Status::Sent], 0);
    assert_eq!(s.get(pending).await.unwrap().unwrap().status, Status::Pending);
    // An event written (by hand) with a creation time still to come is not young: a run of them
    // does not end a sweep.
    let future = s.insert(&NewEvent::new("r", "t", "{}"), t0() + secs(86_400)).await.unwrap();
    assert_eq!(s.purge_sent(&sweep(future, later, later, 2)).await.unwrap(), step(1, Some(future), false, 0));
    assert_eq!(
        s.purge_sent(&sweep(future, later, t0() + secs(86_400), 2)).await.unwrap(),
        step(1, Some(future), true, 0)
    );

    // Where the sweep goes on from is kept in the database, moved on only from where it was.
    assert_eq!(s.sweep_position().await.unwrap(), i64::MIN);
    assert!(s.set_sweep_position(i64::MIN, pending).await.unwrap());
    assert!(!s.set_sweep_position(i64::MIN, future).await.unwrap(), "another instance moved it on");
    assert_eq!(s.sweep_position().await.unwrap(), pending);
    // Its row deleted by hand: a new sweep, and the row made again.
    execute(&db, "DELETE FROM ferry_sweep").await.unwrap();
    assert_eq!(s.sweep_position().await.unwrap(), i64::MIN);
    assert!(s.set_sweep_position(i64::MIN, future).await.unwrap());
    assert_eq!(s.sweep_position().await.unwrap(), future);
    // SQLite keeps any value a hand edit writes: one that is not an integer reads as a new
    // sweep and is put back to one, so a run that does not move the position (a short table)
    // does not meet it again. (PostgreSQL's column takes only integers.)
    if db.backend == Backend::Sqlite {
        for bad in ["'somewhere'", "2.5", "x'00'"] {
            execute(&db, &format!("UPDATE ferry_sweep SET next_id = {bad}")).await.unwrap();
            assert_eq!(s.sweep_position().await.unwrap(), i64::MIN, "{bad}");
            let pool = db.sqlite.as_ref().unwrap().pool();
            let kept: (String, i64) =
                sqlx::query_as("SELECT typeof(next_id), next_id FROM ferry_sweep").fetch_one(pool).await.unwrap();
            assert_eq!(kept, ("integer".to_string(), i64::MIN), "{bad}");
            assert!(!s.set_sweep_position(pending, future).await.unwrap(), "{bad} is not where another run left it");
            assert!(s.set_sweep_position(i64::MIN, pending).await.unwrap(), "{bad}");
            assert_eq!(s.sweep_position().await.unwrap(), pending);
        }
    }
}

/// Retention's sweep skips a due row another transaction holds locked, without waiting for it,
/// and deletes it once free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_retention_skips_rows_held_by_others() {
    let db = TestDb::new(Backend::Postgres).await;
    let s = &db.store;
    let sent = three_sent(s.as_ref()).await;
    let pool = db.postgres.as_ref().unwrap().pool();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM ferry_events WHERE id = $1 FOR UPDATE")
        .bind(sent[1])
        .execute(&mut *holder)
        .await
        .unwrap();

    let later = t0() + secs(1);
    let step =
        tokio::time::timeout(std::time::Duration::from_secs(10), s.purge_sent(&sweep(i64::MIN, later, later, 10)))
            .await
            .expect("the sweep does not wait for the lock")
            .unwrap();
    assert_eq!((step.seen, step.deleted), (3, 2));
    assert!(s.get(sent[1]).await.unwrap().is_some(), "the held row is kept");
    holder.rollback().await.unwrap();
    assert_eq!(s.purge_sent(&sweep(i64::MIN, later, later, 10)).await.unwrap().deleted, 1);
}

/// A pooled connection the server dropped while it sat idle is checked before it is used again
/// and replaced, so the next statement does not fail for it. (Connections in steady use are
/// checked only when given back to the pool: a round trip fewer per statement.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_connection_dropped_while_idle_is_replaced() {
    use ferry::store::Store as _;
    let db = TestDb::new(Backend::Postgres).await;
    let name = format!("ferry-idle-{}-{}", std::process::id(), Utc::now().timestamp_nanos_opt().unwrap_or_default());
    let store = ferry::store::PostgresStore::connect(&format!("{}&application_name={name}", db.url), 2).await.unwrap();
    let id = store.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    // Dropped once back in the pool (sqlx checks a connection as it comes back): dropped during
    // that check, it would be replaced there and never reach the check on taking it out.
    for _ in 0..100 {
        if store.pool().num_idle() as u32 == store.pool().size() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(store.pool().num_idle() as u32, store.pool().size(), "every connection back in the pool");
    let admin = db.postgres.as_ref().unwrap().pool();
    let dropped: Vec<bool> =
        sqlx::query_scalar("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1")
            .bind(&name)
            .fetch_all(admin)
            .await
            .unwrap();
    assert!(!dropped.is_empty() && dropped.iter().all(|d| *d), "the store's connections were dropped: {dropped:?}");
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    let row = store.get(id).await.expect("a dropped idle connection is replaced, not used");
    assert_eq!(row.map(|r| r.id), Some(id));
}

/// The events of a backlog of `n`, inserted in one statement on the store's own pool.
async fn backlog(db: &TestDb, n: i64) {
    let payload = format!("{{\"padding\":\"{}\"}}", "x".repeat(200));
    match (&db.postgres, &db.sqlite) {
        (Some(pg), _) => sqlx::query(
            "INSERT INTO ferry_events (route, event_type, payload)
             SELECT 'r', 't', convert_to($2, 'UTF8') FROM generate_series(1, $1)",
        )
        .bind(n)
        .bind(&payload)
        .execute(pg.pool())
        .await
        .map(drop),
        (_, Some(lite)) => sqlx::query(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO ferry_events (route, event_type, payload) SELECT 'r', 't', ?2 FROM n",
        )
        .bind(n)
        .bind(payload.into_bytes())
        .execute(lite.pool())
        .await
        .map(drop),
        _ => unreachable!("a test database has a backend"),
    }
    .expect("insert the backlog");
}

/// Claims and records as SENT batches of `batch` from `store` until none is left, on `claimers`
/// tasks at once, as relay workers do; their first claims start together.
async fn drain(store: Arc<dyn ferry::store::Store>, claimers: usize, batch: u32) {
    let start = Arc::new(tokio::sync::Barrier::new(claimers));
    let tasks: Vec<_> = (0..claimers)
        .map(|worker| {
            let (store, start) = (store.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                for round in 0.. {
                    let token = format!("w{worker}-{round}");
                    let claimed = store.claim(&claim(Utc::now(), batch, &token)).await.expect("claim");
                    if claimed.is_empty() {
                        return;
                    }
                    let items: Vec<Completion> = claimed.iter().map(|e| done(e.id, Disposition::Sent)).collect();
                    store.complete(&token, Utc::now(), &items).await.expect("record");
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("a claimer ran to its end");
    }
}

/// The backends of the connections named `name` but those of `pool`, with when each was opened.
async fn backends_beside(db: &TestDb, name: &str, pool: &[i32]) -> Vec<(i32, DateTime<Utc>)> {
    sqlx::query_as(
        "SELECT pid, backend_start FROM pg_stat_activity
         WHERE application_name = $1 AND NOT (pid = ANY($2)) ORDER BY pid",
    )
    .bind(name)
    .bind(pool)
    .fetch_all(db.postgres.as_ref().unwrap().pool())
    .await
    .unwrap()
}

/// The relay's claims and outcome writes run on `relay_connections` connections of their own: at
/// most that many, however many claim at once; kept from one statement to the next rather than
/// opened again; and never waiting for the pool, which an application's transactions may hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_the_relays_statements_run_on_its_own_few_connections() {
    let db = TestDb::new(Backend::Postgres).await;
    let name = format!("ferry-lanes-{}-{}", std::process::id(), Utc::now().timestamp_nanos_opt().unwrap_or_default());
    let store = ferry::store::PostgresStore::connect(&format!("{}&application_name={name}", db.url), 2).await.unwrap();
    // The whole pool, held as an application's transactions might hold it.
    let mut held = [store.pool().acquire().await.unwrap(), store.pool().acquire().await.unwrap()];
    let mut pool = Vec::new();
    for conn in &mut held {
        pool.push(sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(&mut **conn).await.unwrap());
    }
    let store: Arc<dyn ferry::store::Store> = Arc::new(store.with_relay_connections(2));
    let within = std::time::Duration::from_secs(60);
    backlog(&db, 3000).await;
    tokio::time::timeout(within, drain(store.clone(), 6, 50)).await.expect("claimed and recorded beside a full pool");
    let first = backends_beside(&db, &name, &pool).await;
    assert!(
        (1..=2).contains(&first.len()),
        "six claimers starting at once: the store opened {} connections beside its pool, not at most the relay's two: \
         {first:?}",
        first.len()
    );
    backlog(&db, 1000).await;
    tokio::time::timeout(within, drain(store.clone(), 6, 50)).await.expect("claimed and recorded again");
    let again = backends_beside(&db, &name, &pool).await;
    assert!(
        first.iter().all(|kept| again.contains(kept)),
        "the relay's connections were kept: {first:?}, then {again:?}"
    );
    drop(held);
    assert_eq!(db.store.counts().await.unwrap()[&Status::Sent], 4000);
}

/// A relay connection the server dropped between statements fails at most the one statement that
/// meets it, which the relay tries again (a claim at its next cycle, outcomes at once): the next
/// opens a new connection. One that sat idle for a second is checked first, so nothing fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_relay_connection_dropped_between_statements_is_replaced() {
    use ferry::store::Store as _;
    let db = TestDb::new(Backend::Postgres).await;
    let name =
        format!("ferry-lane-drop-{}-{}", std::process::id(), Utc::now().timestamp_nanos_opt().unwrap_or_default());
    let store = ferry::store::PostgresStore::connect(&format!("{}&application_name={name}", db.url), 2).await.unwrap();
    let store = store.with_relay_connections(1);
    let admin = db.postgres.as_ref().unwrap().pool();
    let drop_relay_connection = || async {
        let dropped: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE application_name = $1 AND query LIKE 'WITH picked AS%'",
        )
        .bind(&name)
        .fetch_all(admin)
        .await
        .unwrap();
        assert_eq!(dropped, vec![true], "the relay's one connection was dropped");
    };
    for _ in 0..3 {
        store.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    }
    assert_eq!(store.claim(&claim(t0(), 1, "a")).await.unwrap().len(), 1);
    drop_relay_connection().await;
    // Taken again at once, the dropped connection fails its statement, and is closed for it.
    let failed = store.claim(&claim(t0(), 1, "b")).await;
    assert!(failed.is_err(), "a statement on the dropped connection fails: {failed:?}");
    assert_eq!(store.claim(&claim(t0(), 1, "c")).await.unwrap().len(), 1, "the next opens a new connection");
    drop_relay_connection().await;
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    assert_eq!(store.claim(&claim(t0(), 1, "d")).await.unwrap().len(), 1, "an idle one is checked before use");
}

async fn breakers_count_open_probe_and_close(db: TestDb) {
    let s = &db.store;
    let t0 = t0();
    assert!(s.breakers().await.unwrap().is_empty());

    // Below the threshold failures are counted; a success resets the count.
    let b = s.record_breaker("r", 2, "last failure: a", 3, t0).await.unwrap();
    assert_eq!((b.consecutive_failures, b.opened_at, b.reason), (2, None, None));
    let b = s.record_breaker("r", 0, "", 3, t0).await.unwrap();
    assert_eq!(b.consecutive_failures, 0);

    // Reaching it opens the breaker with the reason.
    s.record_breaker("r", 2, "last failure: a", 3, t0).await.unwrap();
    let b = s.record_breaker("r", 1, "last failure: boom", 3, t0 + secs(1)).await.unwrap();
    assert_eq!((b.consecutive_failures, b.opened_at), (3, Some(t0 + secs(1))));
    assert_eq!(b.reason.as_deref(), Some("last failure: boom"));
    assert_eq!(s.breakers().await.unwrap(), vec![b.clone()]);

    // Paused routes are not claimed; a probe claim takes only its route.
    let paused = s.insert(&NewEvent::new("r", "t", "{}"), t0).await.unwrap();
    let other = s.insert(&NewEvent::new("other", "t", "{}"), t0).await.unwrap();
    let mut c = claim(t0 + secs(2), 10, "a");
    c.paused_routes = vec!["r".into()];
    assert_eq!(s.claim(&c).await.unwrap().iter().map(|e| e.id).collect::<Vec<_>>(), vec![other]);

    // Half-open: not before the cooldown; then exactly one claimer wins the probe until it expires.
    let (now, until) = (t0 + secs(60), t0 + secs(360));
    assert!(!s.take_probe("r", t0, now, until).await.unwrap(), "opened after `cooled`: still cooling down");
    assert!(s.take_probe("r", t0 + secs(1), now, until).await.unwrap());
    assert!(!s.take_probe("r", t0 + secs(1), now, until).await.unwrap(), "a second instance loses");
    assert!(s.take_probe("r", t0 + secs(1), until, until + secs(300)).await.unwrap(), "an expired probe is free");
    // Given back by the instance whose probe it no longer is: kept by the one that took it since.
    s.release_probe("r", until).await.unwrap();
    assert!(!s.take_probe("r", t0 + secs(1), now, until).await.unwrap(), "still held until {:?}", until + secs(300));
    s.release_probe("r", until + secs(300)).await.unwrap();
    assert!(s.take_probe("r", t0 + secs(1), now, until).await.unwrap(), "a released probe is free");
    let mut probe = claim(now, 10, "p");
    probe.only_route = Some("r".into());
    assert_eq!(s.claim(&probe).await.unwrap().iter().map(|e| e.id).collect::<Vec<_>>(), vec![paused]);

    // A failed probe opens it again at once; a success closes it and resets the count.
    let b = s.record_breaker("r", 1, "last failure: still down", 3, now).await.unwrap();
    assert_eq!((b.opened_at, b.probe_until, b.consecutive_failures), (Some(now), None, 4));
    let b = s.record_breaker("r", 0, "", 3, now + secs(1)).await.unwrap();
    assert_eq!((b.opened_at, b.reason, b.consecutive_failures), (None, None, 0));

    // By hand: stays open whatever deliveries report, with no probes, until closed by hand.
    let b = s.set_breaker("r", true, "maintenance window", now).await.unwrap();
    assert_eq!((b.opened_at, b.manual, b.reason.as_deref()), (Some(now), true, Some("maintenance window")));
    let b = s.record_breaker("r", 0, "", 3, now + secs(1)).await.unwrap();
    assert_eq!((b.opened_at, b.manual), (Some(now), true), "a late success does not close a manual breaker");
    assert!(!s.take_probe("r", now + secs(3600), now + secs(3600), now + secs(4000)).await.unwrap());
    let b = s.set_breaker("r", false, "", now + secs(2)).await.unwrap();
    assert_eq!((b.opened_at, b.manual, b.consecutive_failures), (None, false, 0));
    let b = s.set_breaker("fresh", true, "never failed", now).await.unwrap();
    assert_eq!(b.consecutive_failures, 0, "a route without history can be opened too");
}

/// A completion carrying the history fields the relay fills in.
fn logged(id: i64, number: u32, disposition: Disposition) -> Completion {
    let call = CallLog {
        route: "r".into(),
        started_at: t0() + secs(1),
        duration: std::time::Duration::from_millis(250),
        plugin: Some("p".into()),
        plugin_hash: Some("ab".repeat(32)),
        instance: "relay-1".into(),
        held: None,
    };
    Completion {
        id,
        disposition,
        max_attempts: 2,
        attempt: AttemptLog { number, call: call.into() },
        dead_letter: None,
    }
}

async fn history_is_written_with_outcomes_and_kept_across_resends(db: TestDb) {
    let s = &db.store;
    let id = s.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    let fenced = s.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    s.claim(&claim(t0(), 10, "tok")).await.unwrap();
    let retry = Disposition::Retry { at: t0() + secs(5), error: "busy".into() };
    let written = s.complete("tok", t0() + secs(2), &[logged(id, 1, retry.clone())]).await.unwrap();
    assert_eq!(written, 1);
    assert_eq!(s.complete("other-token", t0() + secs(2), &[logged(fenced, 1, retry)]).await.unwrap(), 0);
    assert!(s.attempts(fenced).await.unwrap().is_empty(), "an outcome fenced off leaves no history");

    s.claim(&claim(t0() + secs(5), 10, "tok2")).await.unwrap();
    let failed = Disposition::Failed { reason: FailureReason::AttemptsExhausted, error: "still busy".into() };
    s.complete("tok2", t0() + secs(6), &[logged(id, 2, failed)]).await.unwrap();
    s.resend(&[id], t0() + secs(7)).await.unwrap();
    s.claim(&claim(t0() + secs(7), 10, "tok3")).await.unwrap();
    s.complete("tok3", t0() + secs(8), &[logged(id, 1, Disposition::Sent)]).await.unwrap();

    let history = s.attempts(id).await.unwrap();
    let summary: Vec<(u32, &str, Option<&str>)> =
        history.iter().map(|a| (a.attempt, a.outcome.as_str(), a.reason.map(|r| r.as_str()))).collect();
    assert_eq!(summary, [(1, "retry", None), (2, "failed", Some("attempts_exhausted")), (1, "sent", None)]);
    let first = &history[0];
    assert_eq!(first.started_at, t0() + secs(1));
    assert_eq!(first.duration_ms, 250);
    assert_eq!(first.error.as_deref(), Some("busy"));
    assert_eq!((first.plugin.as_deref(), first.instance.as_deref()), (Some("p"), Some("relay-1")));
    assert_eq!(first.plugin_hash.as_deref().map(str::len), Some(64));
    assert_eq!(history[2].error, None);

    // Purging an event takes its history with it.
    let gone = s.insert(&NewEvent::new("r", "gone", "{}"), t0()).await.unwrap();
    s.claim(&claim(t0() + secs(8), 10, "tok4")).await.unwrap();
    let permanent = Disposition::Failed { reason: FailureReason::Permanent, error: "no".into() };
    s.complete("tok4", t0() + secs(9), &[logged(gone, 1, permanent)]).await.unwrap();
    assert_eq!(s.attempts(gone).await.unwrap().len(), 1);
    let filter = FailedFilter { event_type: Some("gone".into()), ..FailedFilter::default() };
    assert_eq!(s.purge_failed(&filter, 10).await.unwrap().len(), 1);
    assert!(s.attempts(gone).await.unwrap().is_empty());
}

/// An event's history goes with it however it goes: deleted by retention, cancelled by an
/// operator, or deleted by SQL (nothing cascades on PostgreSQL, so retention's sweep deletes
/// history rows whose event is gone as it passes their ids). Other events keep theirs.
async fn history_goes_with_its_event(db: TestDb) {
    let s = &db.store;
    let ids: Vec<i64> = {
        let mut ids = Vec::new();
        for _ in 0..4 {
            ids.push(s.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap());
        }
        ids
    };
    let (swept, cancelled, by_sql, kept) = (ids[0], ids[1], ids[2], ids[3]);
    assert_eq!(s.claim(&claim(t0(), 10, "tok")).await.unwrap().len(), 4);
    let retry = Disposition::Retry { at: t0() + secs(5), error: "busy".into() };
    let retries: Vec<Completion> = ids.iter().map(|id| logged(*id, 1, retry.clone())).collect();
    assert_eq!(s.complete("tok", t0() + secs(2), &retries).await.unwrap(), 4);
    assert_eq!(history_rows(&db).await, 4);
    // `swept` is delivered on its second attempt; the others stay PENDING.
    let claimed = s.claim(&claim(t0() + secs(5), 1, "tok2")).await.unwrap();
    assert_eq!(claimed.iter().map(|e| e.id).collect::<Vec<_>>(), vec![swept]);
    s.complete("tok2", t0() + secs(6), &[done(swept, Disposition::Sent)]).await.unwrap();

    assert!(s.end_event(cancelled, EndEvent::Cancel, t0() + secs(7)).await.unwrap());
    assert!(s.attempts(cancelled).await.unwrap().is_empty(), "a cancelled event's history goes with it");
    // As an application would: on SQLite, on a connection without foreign keys (SQLite's default).
    let delete = format!("DELETE FROM ferry_events WHERE id = {by_sql}");
    match db.backend {
        Backend::Sqlite => {
            let pool = db.sqlite.as_ref().unwrap().pool();
            let mut conn = pool.acquire().await.unwrap();
            sqlx::query("PRAGMA foreign_keys = OFF").execute(&mut *conn).await.unwrap();
            sqlx::query(&delete).execute(&mut *conn).await.unwrap();
            sqlx::query("PRAGMA foreign_keys = ON").execute(&mut *conn).await.unwrap();
        }
        Backend::Postgres => execute(&db, &delete).await.unwrap(),
    }
    assert_eq!(history_rows(&db).await, 3, "the event deleted by SQL left its history");

    let later = t0() + secs(60);
    let step = s.purge_sent(&sweep(i64::MIN, later, later, 10)).await.unwrap();
    assert_eq!((step.seen, step.deleted), (2, 1), "{step:?}");
    assert!(s.get(swept).await.unwrap().is_none());
    for gone in [swept, by_sql] {
        assert!(s.attempts(gone).await.unwrap().is_empty(), "event {gone}'s history is deleted");
    }
    assert_eq!(s.attempts(kept).await.unwrap().len(), 1, "a kept event keeps its history");
    assert_eq!(history_rows(&db).await, 1);
}

/// Rows in `ferry_attempts`, over all events.
async fn history_rows(db: &TestDb) -> i64 {
    let sql = "SELECT COUNT(*) FROM ferry_attempts";
    match db.backend {
        Backend::Sqlite => sqlx::query_scalar(sql).fetch_one(db.sqlite.as_ref().unwrap().pool()).await.unwrap(),
        Backend::Postgres => sqlx::query_scalar(sql).fetch_one(db.postgres.as_ref().unwrap().pool()).await.unwrap(),
    }
}

/// One plugin call of `route`, for the completions of the events it delivered.
fn call(route: &str, plugin: &str, millis: u64) -> Arc<CallLog> {
    Arc::new(CallLog {
        route: route.into(),
        started_at: t0() + secs(1),
        duration: std::time::Duration::from_millis(millis),
        plugin: Some(plugin.into()),
        plugin_hash: Some(plugin.repeat(64 / plugin.len())),
        instance: "relay-1".into(),
        held: None,
    })
}

fn by(call: &Arc<CallLog>, id: i64, disposition: Disposition) -> Completion {
    Completion {
        id,
        disposition,
        max_attempts: 4,
        attempt: AttemptLog { number: 1, call: call.clone() },
        dead_letter: None,
    }
}

/// A success is recorded on its event row, not as a history row; `attempts` still lists it, after
/// what went wrong. Each call's successes are found by claim token and route, which must never
/// mark SENT a row of the claim that has no outcome: then they are recorded by id instead.
async fn successes_are_recorded_on_the_event_row(db: TestDb) {
    let s = &db.store;
    let mut ids = Vec::new();
    for route in ["a", "a", "a", "b", "b"] {
        ids.push(s.insert(&NewEvent::new(route, "t", "{}"), t0()).await.unwrap());
    }
    let (a1, a2, a3, b1, b2) = (ids[0], ids[1], ids[2], ids[3], ids[4]);
    assert_eq!(s.claim(&claim(t0(), 10, "tok")).await.unwrap().len(), 5);
    let (call_a, call_b) = (call("a", "pa", 120), call("b", "pb", 30));
    let retry = Disposition::Retry { at: t0() + secs(60), error: "busy".into() };
    // b2 has no outcome (as after a bug): it must stay PROCESSING, held by the claim.
    let outcomes = [
        by(&call_a, a1, Disposition::Sent),
        by(&call_a, a2, Disposition::Sent),
        by(&call_a, a3, retry),
        by(&call_b, b1, Disposition::Sent),
    ];
    assert_eq!(s.complete("tok", t0() + secs(2), &outcomes).await.unwrap(), 4);
    let status = |id| async move { s.get(id).await.unwrap().unwrap().status };
    for (id, expected) in [(a1, Status::Sent), (a2, Status::Sent), (a3, Status::Pending), (b1, Status::Sent)] {
        assert_eq!(status(id).await, expected, "event {id}");
    }
    assert_eq!(status(b2).await, Status::Processing, "a row without an outcome is not marked SENT");
    assert_eq!(history_rows(&db).await, 1, "only the retry is a history row");
    let sent = s.attempts(a1).await.unwrap();
    assert_eq!(sent.len(), 1);
    let a = &sent[0];
    assert_eq!((a.attempt, a.outcome.as_str(), a.duration_ms), (1, "sent", 120));
    assert_eq!(
        (a.started_at, a.plugin.as_deref(), a.instance.as_deref()),
        (t0() + secs(1), Some("pa"), Some("test-instance"))
    );
    assert_eq!(a.plugin_hash.as_deref(), Some("pa".repeat(32).as_str()));
    assert_eq!(s.attempts(b1).await.unwrap()[0].plugin.as_deref(), Some("pb"));
    assert_eq!(s.get(a1).await.unwrap().unwrap().max_attempts, Some(4), "the attempt limit is pinned");

    // Two calls of one route (a batch split to find a faulting event) are recorded by id.
    s.complete("tok", t0() + secs(3), &[by(&call("b", "pc", 7), b2, Disposition::Sent)]).await.unwrap();
    s.insert(&NewEvent::new("c", "t", "{}"), t0()).await.unwrap();
    s.insert(&NewEvent::new("c", "t", "{}"), t0()).await.unwrap();
    let claimed = s.claim(&claim(t0() + secs(3), 10, "tok2")).await.unwrap();
    let (first, second) = (call("c", "p1", 5), call("c", "p2", 6));
    let outcomes = [by(&first, claimed[0].id, Disposition::Sent), by(&second, claimed[1].id, Disposition::Sent)];
    assert_eq!(s.complete("tok2", t0() + secs(4), &outcomes).await.unwrap(), 2);
    let retried = s.claim(&claim(t0() + secs(60), 10, "tok3")).await.unwrap();
    assert_eq!(retried.iter().map(|e| e.id).collect::<Vec<_>>(), [a3], "only the retry is due again");
    s.complete("tok3", t0() + secs(61), &[by(&call_a, a3, Disposition::Sent)]).await.unwrap();
    for (id, plugin, duration) in [(claimed[0].id, "p1", 5), (claimed[1].id, "p2", 6), (b2, "pc", 7)] {
        let history = s.attempts(id).await.unwrap();
        assert_eq!((history[0].plugin.as_deref(), history[0].duration_ms), (Some(plugin), duration), "event {id}");
    }
    let history = s.attempts(a3).await.unwrap();
    let summary: Vec<(u32, &str)> = history.iter().map(|a| (a.attempt, a.outcome.as_str())).collect();
    assert_eq!(summary, [(1, "retry"), (2, "sent")], "the success follows what went wrong");
    assert_eq!(history_rows(&db).await, 1);

    // A clean batch, recorded by token alone: every detail of the call reaches the rows.
    let d1 = s.insert(&NewEvent::new("d", "t", "{}"), t0()).await.unwrap();
    let d2 = s.insert(&NewEvent::new("d", "t", "{}"), t0()).await.unwrap();
    assert_eq!(s.claim(&claim(t0() + secs(70), 10, "tok4")).await.unwrap().len(), 2);
    let call_d = call("d", "pd", 42);
    let outcomes = [by(&call_d, d1, Disposition::Sent), by(&call_d, d2, Disposition::Sent)];
    assert_eq!(s.complete("tok4", t0() + secs(71), &outcomes).await.unwrap(), 2);
    for id in [d1, d2] {
        let row = s.get(id).await.unwrap().unwrap();
        assert_eq!((row.status, row.max_attempts, row.processed_at), (Status::Sent, Some(4), Some(t0() + secs(71))));
        let history = s.attempts(id).await.unwrap();
        let a = &history[..];
        assert_eq!(a.len(), 1);
        assert_eq!((a[0].started_at, a[0].duration_ms, a[0].plugin.as_deref()), (t0() + secs(1), 42, Some("pd")));
        assert_eq!(
            (a[0].plugin_hash.as_deref(), a[0].instance.as_deref()),
            (Some("pd".repeat(32).as_str()), Some("test-instance"))
        );
    }
    assert_eq!(history_rows(&db).await, 1);
}

/// A call's successes recorded by token mark SENT only the call's own events when a row of the
/// batch was fenced off and another of the same route has no outcome (so a statement by token
/// and route alone would write as many rows, but not the same ones). Whether the call's ids are
/// one run (counted) or not (the ids compared), the row without an outcome stays PROCESSING.
async fn a_fenced_off_row_never_lets_another_be_marked_sent(db: TestDb) {
    let s = &db.store;
    let call_a = call("a", "pa", 10);
    for (token, delivered) in [("one-run", [0, 1]), ("gap", [0, 2])] {
        let mut ids = Vec::new();
        for _ in 0..3 {
            ids.push(s.insert(&NewEvent::new("a", "t", "{}"), t0()).await.unwrap());
        }
        assert_eq!(ids[2], ids[0] + 2, "consecutive ids, so [0, 1] is one run and [0, 2] is not");
        assert_eq!(s.claim(&claim(t0(), 10, token)).await.unwrap().len(), 3);
        // The first is handed back (as a lease recovery would): the claim no longer holds it.
        assert_eq!(s.release(token, &ids[..1], t0()).await.unwrap(), 1);
        let outcomes = delivered.map(|i| by(&call_a, ids[i], Disposition::Sent));
        assert_eq!(s.complete(token, t0() + secs(1), &outcomes).await.unwrap(), 1, "{token}");
        let [fenced, other] = delivered.map(|i| ids[i]);
        let without_outcome = ids.iter().copied().find(|id| !delivered.map(|i| ids[i]).contains(id)).unwrap();
        let status = |id| async move { s.get(id).await.unwrap().unwrap().status };
        assert_eq!(status(fenced).await, Status::Pending, "{token}: the fenced-off row is not written");
        assert_eq!(status(other).await, Status::Sent, "{token}");
        assert_eq!(status(without_outcome).await, Status::Processing, "{token}: a row without an outcome");
        // Leave nothing for the next round to claim.
        for id in [fenced, without_outcome] {
            assert!(s.end_event(id, EndEvent::Cancel, t0()).await.unwrap(), "{token}: event {id} cancelled");
        }
    }
}

async fn stats_describe_the_outbox(db: TestDb) {
    let s = &db.store;
    let now = t0() + secs(400);
    let empty = s.stats(now, Some(t0()), true).await.unwrap();
    assert!(empty.routes.is_empty());
    assert_eq!((empty.oldest_pending_created_at, empty.oldest_due_at, empty.latency), (None, None, None));

    // Two SENT on route a: 2s and 4s after creation; the event times 10s earlier still.
    for (n, after) in [(0, 2), (1, 4)] {
        let mut event = NewEvent::new("a", "sent", "{}");
        event.event_time = Some(t0() - secs(10));
        let id = s.insert(&event, t0() + secs(n)).await.unwrap();
        s.claim(&claim(t0() + secs(n), 1, "t")).await.unwrap();
        s.complete("t", t0() + secs(n + after), &[done(id, Disposition::Sent)]).await.unwrap();
    }
    // Stuck: claimed with a 300s lease that ran out at t0+300.
    s.insert(&NewEvent::new("b", "stuck", "{}"), t0() + secs(10)).await.unwrap();
    s.claim(&claim(t0() + secs(10), 1, "stuck")).await.unwrap();
    // On its last attempt: limit 2, one used, retrying at t0+30 (due, so it is the claim lag).
    let mut last = NewEvent::new("b", "last", "{}");
    last.max_attempts = Some(2);
    let last = s.insert(&last, t0() + secs(20)).await.unwrap();
    s.claim(&claim(t0() + secs(20), 1, "l")).await.unwrap();
    let retry = Disposition::Retry { at: t0() + secs(30), error: "busy".into() };
    s.complete("l", t0() + secs(21), &[done(last, retry)]).await.unwrap();
    // Deferred past `now`: PENDING, the oldest by creation, but not due.
    s.insert(&NewEvent::new("b", "later", "{}").not_before(t0() + secs(1000)), t0() - secs(50)).await.unwrap();

    let stats = s.stats(now, Some(t0()), true).await.unwrap();
    assert_eq!(stats.at, now);
    assert_eq!(stats.routes["a"][&Status::Sent], 2);
    assert_eq!(stats.routes["b"][&Status::Processing], 1);
    assert_eq!(stats.routes["b"][&Status::Pending], 2);
    assert_eq!(stats.total(Status::Pending), 2);
    assert_eq!(stats.oldest_pending_created_at, Some(t0() - secs(50)));
    assert_eq!(stats.oldest_due_at, Some(t0() + secs(30)));
    assert_eq!((stats.stuck, stats.last_attempt), (1, 1));
    let latency = stats.latency.expect("two events were SENT in the window");
    assert_eq!(latency.samples, 2);
    assert_eq!((latency.from_created.p50_ms, latency.from_created.p95_ms), (2000, 4000));
    assert_eq!((latency.from_event_time.p50_ms, latency.from_event_time.max_ms), (12_000, 15_000));
    let later = s.stats(now, Some(t0() + secs(5)), true).await.unwrap();
    assert_eq!(later.latency.map(|l| l.samples), Some(1), "only SENT at or after the window start");
    assert_eq!(s.stats(now, None, true).await.unwrap().latency, None);
}

/// A summary's group says when its first and its last event failed.
async fn failed_groups_span_their_first_and_last_failure(db: TestDb) {
    let s = &db.store;
    let fail_at = |at: DateTime<Utc>, token: &'static str| async move {
        let claimed = s.claim(&claim(at, 10, token)).await.unwrap();
        let reason = FailureReason::Permanent;
        let items: Vec<Completion> =
            claimed.iter().map(|e| done(e.id, Disposition::Failed { reason, error: "no".into() })).collect();
        s.complete(token, at, &items).await.unwrap();
    };
    let first = s.insert(&NewEvent::new("a", "x", "{}"), t0()).await.unwrap();
    fail_at(t0() + secs(60), "first").await;
    s.insert(&NewEvent::new("a", "x", "{}"), t0()).await.unwrap();
    fail_at(t0() + secs(120), "second").await;
    let groups = s.failed_groups(&FailedFilter::default(), 10).await.unwrap();
    assert_eq!(groups.len(), 1);
    assert_eq!(
        (groups[0].count, groups[0].first_failed_at, groups[0].last_failed_at),
        (2, Some(t0() + secs(60)), Some(t0() + secs(120)))
    );

    // A FAILED row without a recorded reason (written by another program) is its own group, and
    // the filter `none` selects it alone.
    let unset = format!("UPDATE ferry_events SET failure_reason = NULL WHERE id = {first}");
    match db.backend {
        Backend::Sqlite => assert_eq!(
            sqlx::query(&unset).execute(db.sqlite.as_ref().unwrap().pool()).await.unwrap().rows_affected(),
            1
        ),
        Backend::Postgres => assert_eq!(
            sqlx::query(&unset).execute(db.postgres.as_ref().unwrap().pool()).await.unwrap().rows_affected(),
            1
        ),
    }
    let groups = s.failed_groups(&FailedFilter::default(), 10).await.unwrap();
    let reasons: Vec<(Option<&str>, u64)> = groups.iter().map(|g| (g.reason.as_deref(), g.count)).collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(reasons.contains(&(None, 1)) && reasons.contains(&(Some("permanent"), 1)), "{reasons:?}");
    let unrecorded = FailedFilter { reason: Some(ReasonFilter::Unrecorded), ..FailedFilter::default() };
    assert_eq!(s.tally_failed(&unrecorded).await.unwrap(), (1, Some(first)));
}

/// The claim, the look for an event's predecessors and retention's sweep read indexes at the
/// sizes an outbox holds. PostgreSQL planned the claim's former join of the picked ids with the table as a hash
/// join over every row (up to some tens of thousands of them: 41 ms instead of 9 for a batch of
/// 500 among 20 000 events); SQLite walked every older row by id for each keyed event of an
/// ordered route, as it does not derive the key index's condition (one claim among 200 000 rows
/// took 59 s instead of 5 ms). The plans are read for 20 000 keyed events of an ordered route.
/// So are those of the fallback of a refused claim: the list of due events picks as the claim
/// does, and the claim of one event finds it by primary key, not by walking the pending index.
/// (That PostgreSQL chose the hash at 20 000 rows follows from its default cost settings; with
/// the array there is no join left to choose.)
async fn the_claim_the_look_at_a_key_and_retention_read_indexes(db: TestDb) {
    let fill = match db.backend {
        Backend::Postgres => {
            "INSERT INTO ferry_events (route, event_type, payload, ordering_key)
             SELECT 'r', 't', convert_to(repeat('x', 200), 'UTF8'), 'k' || (i % 100) FROM generate_series(1, 20000) i"
        }
        Backend::Sqlite => {
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 20000)
             INSERT INTO ferry_events (route, event_type, payload, ordering_key)
             SELECT 'r', 't', zeroblob(200), 'k' || (i % 100) FROM n"
        }
    };
    execute(&db, fill).await.unwrap();
    // History for one event in ten, so the sweep's look for history rows has some to find.
    let started = if db.backend == Backend::Postgres { "now()" } else { "0" };
    let history = format!(
        "INSERT INTO ferry_attempts (event_id, attempt, started_at, duration_ms, outcome)
         SELECT id, 1, {started}, 0, 'retry' FROM ferry_events WHERE id % 10 = 0"
    );
    execute(&db, &history).await.unwrap();
    execute(&db, "ANALYZE").await.unwrap();
    let (claim, plain, one, due, ahead, sweep) = match db.backend {
        Backend::Postgres => {
            use sqlx::Connection as _;
            let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
            for (name, value) in ferry::store::postgres_session_settings() {
                sqlx::query(&format!("SET {name} = {value}")).execute(&mut conn).await.unwrap();
            }
            let claim_args =
                "now(), 500, 'i', 't', now() + interval '5 minutes', '{r}', '{}', '{}', NULL, 1048576, 1024, 131072";
            // The list of due events reads only some of the claim's parameters, so their types
            // are given.
            let claim_types =
                "(timestamptz, bigint, text, text, timestamptz, text[], text[], text[], text, bigint, bigint, bigint)";
            let mut plans = Vec::new();
            for (name, sql, types, args) in [
                ("claim", ferry::store::POSTGRES_CLAIM_SQL, "", format!("({claim_args})")),
                ("plain", ferry::store::POSTGRES_CLAIM_PLAIN_SQL, claim_types, format!("({claim_args})")),
                ("one", ferry::store::POSTGRES_CLAIM_ONE_SQL, "", format!("({claim_args}, 10000)")),
                ("due", ferry::store::POSTGRES_DUE_SQL, claim_types, format!("({claim_args})")),
                ("ahead", ferry::store::ahead_in_key_sql(true), "", "('r', 'k1', 20000)".into()),
                ("ahead_open", ferry::store::ahead_in_key_sql(false), "", "('r', 'k1', 20000)".into()),
                ("sweep", ferry::store::POSTGRES_SWEEP_SQL, "", "(-9223372036854775808, 1000, now(), now())".into()),
            ] {
                sqlx::raw_sql(&format!("PREPARE {name}{types} AS {sql}")).execute(&mut conn).await.unwrap();
                let rows: Vec<(String,)> =
                    sqlx::query_as(&format!("EXPLAIN EXECUTE {name}{args}")).fetch_all(&mut conn).await.unwrap();
                plans.push(rows.into_iter().map(|(line,)| line).collect::<Vec<_>>().join("\n"));
            }
            let sweep = vec![plans.pop().unwrap()];
            let [claim, plain, one, due, ahead @ ..] = &plans[..] else { unreachable!("seven statements") };
            (claim.clone(), plain.clone(), one.clone(), due.clone(), ahead.join("\n"), sweep)
        }
        Backend::Sqlite => {
            let pool = db.sqlite.as_ref().unwrap().pool();
            let explain = |sql: &str| format!("EXPLAIN QUERY PLAN {sql}");
            let plan =
                |rows: Vec<(i64, i64, i64, String)>| rows.into_iter().map(|r| r.3).collect::<Vec<_>>().join("\n");
            // Bound as the relay binds them: SQLite weighs the values against ANALYZE's samples.
            let now = chrono::Utc::now().timestamp_millis();
            let mut claims = Vec::new();
            for sql in [
                ferry::store::SQLITE_CLAIM_SQL,
                ferry::store::SQLITE_CLAIM_PLAIN_SQL,
                ferry::store::SQLITE_CLAIM_ONE_SQL,
                ferry::store::SQLITE_DUE_SQL,
            ] {
                let rows = sqlx::query_as(&explain(sql))
                    .bind(now)
                    .bind(500)
                    .bind("i")
                    .bind("t")
                    .bind(now + 300_000)
                    .bind(r#"["r"]"#)
                    .bind("[]")
                    .bind("[]")
                    .bind(None::<String>)
                    .bind(1 << 20)
                    .bind(1024)
                    .bind(128 << 10)
                    .bind(10_000)
                    .fetch_all(pool)
                    .await
                    .unwrap();
                claims.push(plan(rows));
            }
            let [claim, plain, one, due] = <[String; 4]>::try_from(claims).expect("four statements");
            let mut ahead = Vec::new();
            for failed_blocks in [true, false] {
                let rows = sqlx::query_as(&explain(ferry::store::ahead_in_key_sql(failed_blocks)))
                    .bind("r")
                    .bind("k1")
                    .bind(20000)
                    .fetch_all(pool)
                    .await
                    .unwrap();
                ahead.push(plan(rows));
            }
            let mut sweep = Vec::new();
            // As the relay binds them: a new sweep starts from the lowest id.
            let [window, delete, orphans] = ferry::store::SQLITE_SWEEP_SQL.map(explain);
            let window = sqlx::query_as(&window).bind(i64::MIN).bind(1000).bind(now).bind(now);
            let delete = sqlx::query_as(&delete).bind(i64::MIN).bind(i64::MAX).bind(now);
            let orphans = sqlx::query_as(&orphans).bind(i64::MIN).bind(i64::MAX);
            for query in [window, delete, orphans] {
                sweep.push(plan(query.fetch_all(pool).await.unwrap()));
            }
            (claim, plain, one, due, ahead.join("\n"), sweep)
        }
    };
    // The claim writes its rows by primary key, picks them through the pending index and looks
    // for their predecessors through the key index; so does the look at one event's key.
    assert!(claim.contains("ferry_events_pkey") || claim.contains("INTEGER PRIMARY KEY (rowid=?)"), "{claim}");
    assert!(claim.contains("ferry_events_pending") && claim.contains("ferry_events_key"), "{claim}");
    // The claim without route filters walks the pending index alone.
    assert!(plain.contains("ferry_events_pkey") || plain.contains("INTEGER PRIMARY KEY (rowid=?)"), "{plain}");
    assert!(plain.contains("ferry_events_pending") && !plain.contains("ferry_events_key"), "{plain}");
    assert!(ahead.contains("ferry_events_key"), "{ahead}");
    assert!(due.contains("ferry_events_pending") && due.contains("ferry_events_key"), "{due}");
    // The claim of one event picks its row by primary key (its UPDATE finds the row by primary
    // key as the claim's does, so the pick's own lookup is what is checked), and reads the
    // pending index not at all.
    let picked_by_key = match db.backend {
        Backend::Postgres => one.matches("ferry_events_pkey").count() >= 2,
        Backend::Sqlite => one.contains("SEARCH e USING INTEGER PRIMARY KEY (rowid=?)"),
    };
    assert!(picked_by_key, "{one}");
    assert!(!one.contains("ferry_events_pending"), "{one}");
    for line in [&claim, &plain, &one, &due, &ahead].into_iter().flat_map(|plan| plan.lines()) {
        let walks_the_table = ["Seq Scan", "Hash Join", "rowid<", "rowid>"].iter().any(|w| line.contains(w))
            || (line.trim_start().starts_with("SCAN") && !line.contains("json_each"));
        assert!(!walks_the_table, "{line}\n{claim}\n{plain}\n{one}\n{due}\n{ahead}");
    }
    // Retention's sweep reads a window along the primary key and deletes by it, and finds the
    // window's history through its index (on SQLite, each of its three statements).
    for sweep in &sweep {
        let by_key = ["ferry_events_pkey", "INTEGER PRIMARY KEY (rowid>?", "ferry_attempts_event (event_id>?"];
        assert!(by_key.iter().any(|k| sweep.contains(k)), "{sweep}");
        for line in sweep.lines() {
            let walks_the_table =
                ["Seq Scan", "Hash", "Sort"].iter().any(|w| line.contains(w)) || line.contains("SCAN ferry_events");
            assert!(!walks_the_table, "{line}\n{sweep}");
        }
    }
}

crate::both_backends!(
    the_claim_the_look_at_a_key_and_retention_read_indexes,
    failed_groups_span_their_first_and_last_failure,
    history_is_written_with_outcomes_and_kept_across_resends,
    history_goes_with_its_event,
    successes_are_recorded_on_the_event_row,
    a_fenced_off_row_never_lets_another_be_marked_sent,
    stats_describe_the_outbox,
    breakers_count_open_probe_and_close,
    failed_events_are_counted_listed_resent_and_purged_by_filter,
    resend_makes_failed_events_pending_again,
    purge_deletes_only_old_sent_events,
    claim_returns_due_events_in_order,
    an_event_due_within_the_claims_millisecond_is_claimed,
    complete_records_each_outcome,
    stored_attempt_limit_is_kept,
    writes_of_a_recovered_claim_are_fenced_off,
    release_hands_back_without_counting_the_attempt,
    concurrent_claimers_never_share_an_event,
    transactional_emit_commits_with_the_caller,
    plain_sql_insert_gets_every_default,
    bad_rows_are_rejected_at_insert,
);

/// `benches/callgrind-sqlite` reads ferry's claim and completion from the store's source and runs
/// them on its own: it must still find them, and they must still deliver every event, or its
/// counts would describe statements ferry no longer runs. (Run here without callgrind.)
#[test]
fn the_sqlite_cost_model_still_runs_ferrys_statements() {
    for case in ["ferry", "minimal", "table"] {
        let out = std::process::Command::new("python3")
            .arg(crate::common::repo_root().join("benches/callgrind-sqlite"))
            .args(["--run", case, "1200"])
            .output()
            .expect("python3 runs");
        assert!(out.status.success(), "{case}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// The relay's writes leave the write-ahead log's checkpoints to a connection of their own, and
/// the log still starts again from its beginning under a steady stream of writes: the `-wal`
/// file, as large as the log has ever been, stays within a few times SQLite's own checkpoint size
/// (1 000 pages) after some fifty times that was written through it. Without the restarts it
/// grows with every write (a passive checkpoint alone leaves the log to grow while writes keep
/// coming), and the writing connection's own checkpoint is past this bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_log_stays_small_under_a_stream_of_relay_writes() {
    let db = TestDb::new(Backend::Sqlite).await;
    backlog(&db, 40_000).await;
    // The backlog's one transaction grew the log; it starts again from an empty file.
    let pool = db.sqlite.as_ref().unwrap().pool();
    sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)").execute(pool).await.unwrap();
    let wal = db.dir.path().join("ferry.db-wal");
    assert_eq!(std::fs::metadata(&wal).expect("the -wal file").len(), 0);
    // About 55 MB of log: some 170 pages per batch of 500, 80 batches.
    drain(db.store.clone(), 2, 500).await;
    assert_eq!(db.store.counts().await.unwrap()[&Status::Sent], 40_000);
    let largest = std::fs::metadata(&wal).expect("the -wal file").len();
    // Room for the pages written while a checkpoint runs, on a slow disk beside other tests.
    let bound = 8 * 1000 * 4096;
    assert!(largest <= bound, "the log reached {largest} bytes, over {bound}");
}

/// SQLite is compiled without memory statistics (`.cargo/config.toml`), so its allocations take
/// no global mutex; a build that lost the setting would be slower without failing anything else.
#[tokio::test]
async fn sqlite_is_compiled_without_memory_statistics() {
    let db = TestDb::new(Backend::Sqlite).await;
    let options: Vec<String> = sqlx::query_scalar("SELECT compile_options FROM pragma_compile_options")
        .fetch_all(db.sqlite.as_ref().unwrap().pool())
        .await
        .unwrap();
    assert!(options.iter().any(|o| o == "DEFAULT_MEMSTATUS=0"), "compile options: {options:?}");
}

/// The relay writes to SQLite through one connection of its own. A write given up half-way (its
/// task cancelled while another connection held the file's write lock) leaves that connection fit
/// for the next one: the cancelled transaction is rolled back, not left open and not committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_write_given_up_half_way_leaves_the_writing_connection_usable() {
    use std::time::Duration;
    let db = TestDb::new(Backend::Sqlite).await;
    let s = &db.store;
    for kind in ["sent", "failed"] {
        s.insert(&NewEvent::new("r", kind, "{}"), t0()).await.unwrap();
    }
    let ids: Vec<i64> = s.claim(&claim(t0(), 10, "tok")).await.unwrap().iter().map(|e| e.id).collect();
    // Two kinds of outcome: written in one transaction rather than by one statement.
    let items = vec![
        done(ids[0], Disposition::Sent),
        done(ids[1], Disposition::Failed { reason: FailureReason::Permanent, error: "rejected".into() }),
    ];
    let mut other = db.sqlite.as_ref().unwrap().pool().acquire().await.unwrap();
    sqlx::query("BEGIN IMMEDIATE").execute(&mut *other).await.unwrap();
    // Two seconds: long enough for the write to reach the locked file on a loaded machine, well
    // short of the busy timeout (ten).
    let waited = tokio::time::timeout(Duration::from_secs(2), s.complete("tok", t0(), &items)).await;
    assert!(waited.is_err(), "the write waited for the lock held by the other connection");
    sqlx::query("ROLLBACK").execute(&mut *other).await.unwrap();
    drop(other);

    let written = tokio::time::timeout(Duration::from_secs(20), s.complete("tok", t0(), &items)).await;
    assert_eq!(written.expect("the next write is not stuck").unwrap(), 2, "the given-up write committed nothing");
    assert_eq!(s.get(ids[0]).await.unwrap().unwrap().status, Status::Sent);
    assert_eq!(s.get(ids[1]).await.unwrap().unwrap().status, Status::Failed);
    // And the connection goes on writing.
    s.insert(&NewEvent::new("r", "next", "{}"), t0()).await.unwrap();
    assert_eq!(s.claim(&claim(t0(), 10, "tok2")).await.unwrap().len(), 1);
}

/// When SQLite ends a transaction itself (here a trigger's `RAISE(ROLLBACK)`; a full disk does the
/// same), sqlx's rollback of it fails and sqlx goes on counting it open, so on that connection the
/// next transaction would be a savepoint, and rolling that back would leave every later write of
/// the relay uncommitted and the file locked. The writing connection is replaced instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_transaction_sqlite_ended_itself_does_not_stay_open_on_the_writing_connection() {
    let db = TestDb::new(Backend::Sqlite).await;
    let s = &db.store;
    let id = s.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    assert_eq!(s.claim(&claim(t0(), 10, "tok")).await.unwrap().len(), 1);
    // A retry writes a history row in the outcome's transaction.
    let retry = [done(id, Disposition::Retry { at: t0() + secs(30), error: "busy".into() })];
    let history_refused = |how: &str| {
        format!(
            "CREATE TRIGGER refuse_history BEFORE INSERT ON ferry_attempts
             BEGIN SELECT RAISE({how}, 'history refused'); END"
        )
    };
    // One connection changes the schema: another one may still hold the schema as it was and
    // refuse the next change for it.
    let mut ddl = db.sqlite.as_ref().unwrap().pool().acquire().await.unwrap();
    let mut change = async |sql: &str| sqlx::query(sql).execute(&mut *ddl).await.map(drop);
    change(&history_refused("ROLLBACK")).await.unwrap();
    let err = s.complete("tok", t0(), &retry).await.unwrap_err();
    assert!(err.to_string().contains("history refused"), "{err}");
    // A failed statement inside the next transaction: its rollback must end the transaction.
    change("DROP TRIGGER refuse_history").await.unwrap();
    change(&history_refused("ABORT")).await.unwrap();
    let err = s.complete("tok", t0(), &retry).await.unwrap_err();
    assert!(err.to_string().contains("history refused"), "{err}");
    // Other connections can write (the file is not left locked), and the relay's writes commit.
    let dropped = tokio::time::timeout(std::time::Duration::from_secs(5), change("DROP TRIGGER refuse_history"));
    dropped.await.expect("the file is not left locked by the writing connection").unwrap();
    assert_eq!(s.complete("tok", t0(), &retry).await.unwrap(), 1);
    let row = s.get(id).await.unwrap().unwrap();
    assert_eq!((row.status, row.last_error.as_deref()), (Status::Pending, Some("busy")));
}

/// An in-memory SQLite database private to each connection (or, with no file name, a temporary
/// one) would be a different, empty database for the relay's writing connection and for each
/// pooled one: refused at open, naming the setting.
#[tokio::test]
async fn sqlite_a_private_in_memory_database_is_refused() {
    for (url, named) in [
        ("sqlite://?mode=memory&cache=private", "cache=private"),
        ("sqlite::memory:?cache=private", "cache=private"),
        ("sqlite://", "without a file name"),
    ] {
        let err = ferry::store::SqliteStore::connect(url, 2).await.expect_err(url);
        assert!(err.to_string().contains(named) && err.to_string().contains("sqlite::memory:"), "{url}: {err}");
    }
    // A shared one works: what the pool writes, the relay's writing connection claims.
    let store = ferry::store::SqliteStore::connect("sqlite::memory:", 2).await.unwrap();
    use ferry::store::Store as _;
    store.migrate().await.unwrap();
    store.insert(&NewEvent::new("r", "t", "{}"), t0()).await.unwrap();
    assert_eq!(store.claim(&claim(t0(), 10, "tok")).await.unwrap().len(), 1);
}

/// A command that must not create a database (`ferry::store::connect` with `create` off) refuses
/// an in-memory one, which would be a fresh, empty database in the command's own process: the
/// message says so and what to set, rather than naming the file sqlx made up for it.
#[tokio::test]
async fn sqlite_a_command_refuses_an_in_memory_database() {
    for url in ["sqlite::memory:", "sqlite://:memory:", "sqlite://events.db?mode=memory", "sqlite:file:x?mode=memory"] {
        let Err(err) = ferry::store::connect(url, 1, false).await else { panic!("{url} was opened") };
        let message = err.to_string();
        assert!(message.contains("in-memory") && message.contains("database.url"), "{url}: {message}");
        assert!(!message.contains("sqlx-in-memory"), "{url}: {message}");
    }
    // Opening it to serve (create on) still works.
    ferry::store::connect("sqlite::memory:", 1, true).await.unwrap();
}
