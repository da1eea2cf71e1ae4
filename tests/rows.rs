//! Rows are untrusted data: applications and operators write them by hand. A row ferry cannot
//! decode fails alone, with reason `invalid_event` naming the column, while the rest of its batch
//! is delivered; nothing reachable from a row panics; the schema refuses at INSERT what it cheaply
//! can; the README's plain INSERT works with the SQLite applications link; and operators can end
//! an event that is not FAILED.

use ferry::NewEvent;
use ferry::clock::Clock as _;
use ferry::event::{AttemptOutcome, FailureReason, Status};
use ferry::store::{Claim, EndEvent};
use rand::{Rng as _, SeedableRng as _};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::common::{Backend, Stepped, TestDb, plugins_dir};
use crate::e2e::run_ferry;

/// Ferry on a manual clock with the scripted plugin on route `s`.
async fn stepped(db: TestDb) -> Stepped {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    Stepped::start(db, &format!("[plugins]\ndir = {plugins:?}\n[route.s]\nplugin = \"scripted\"\n")).await
}

/// Runs `sql` on the test database as an operator at a SQL prompt would.
pub(crate) async fn sql(db: &TestDb, sql: &str) -> Result<u64, sqlx::Error> {
    match db.backend {
        Backend::Sqlite => {
            sqlx::query(sql).execute(db.sqlite.as_ref().unwrap().pool()).await.map(|r| r.rows_affected())
        }
        Backend::Postgres => {
            sqlx::query(sql).execute(db.postgres.as_ref().unwrap().pool()).await.map(|r| r.rows_affected())
        }
    }
}

async fn insert(s: &Stepped, event_type: &str) -> i64 {
    s.db.store.insert(&NewEvent::new("s", event_type, "{}"), s.clock.now()).await.unwrap()
}

/// Inserts an `ok` event on route `s`, then edits its row by hand with `set` (an `UPDATE`'s
/// assignments); returns its id.
async fn insert_edited(s: &Stepped, set: &str) -> i64 {
    let id = insert(s, "ok").await;
    let edit = format!("UPDATE ferry_events SET {set} WHERE id = {id}");
    assert_eq!(sql(&s.db, &edit).await.unwrap(), 1, "{edit}");
    id
}

async fn malformed_rows_fail_alone_and_the_rest_is_delivered(db: TestDb) {
    let s = stepped(db).await;
    let good: Vec<i64> = [insert(&s, "ok").await, insert(&s, "ok").await, insert(&s, "ok").await].into();
    let (a, b, c) = (insert(&s, "ok").await, insert(&s, "ok").await, insert(&s, "ok").await);
    // What a hand-edited row can hold that ferry cannot represent. The checks added for this
    // refuse such values at INSERT; rows edited by hand (or stored before) still reach the relay.
    let edits = match s.db.backend {
        Backend::Sqlite => vec![
            (a, "event_time", format!("UPDATE ferry_events SET event_time = 'yesterday' WHERE id = {a}")),
            (b, "max_attempts", format!("UPDATE ferry_events SET max_attempts = 9223372036854775807 WHERE id = {b}")),
            (c, "created_at", format!("UPDATE ferry_events SET created_at = 1e300 WHERE id = {c}")),
        ],
        Backend::Postgres => {
            vec![
                (a, "event_time", format!("UPDATE ferry_events SET event_time = 'infinity' WHERE id = {a}")),
                (b, "created_at", format!("UPDATE ferry_events SET created_at = '-infinity' WHERE id = {b}")),
                (c, "event_time", format!("UPDATE ferry_events SET event_time = '294276-12-31' WHERE id = {c}")),
            ]
        }
    };
    for (_, _, edit) in &edits {
        assert_eq!(sql(&s.db, edit).await.unwrap(), 1, "{edit}");
    }
    let stats = s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    assert_eq!(stats.claimed, 6, "the whole batch is claimed: {stats:?}");
    for id in &good {
        assert_eq!(s.db.store.get(*id).await.unwrap().unwrap().status, Status::Sent, "good event {id}");
    }
    for (id, column, _) in &edits {
        let (status, reason, error): (String, Option<String>, Option<String>) = match s.db.backend {
            Backend::Sqlite => {
                sqlx::query_as("SELECT status, failure_reason, last_error FROM ferry_events WHERE id = ?")
                    .bind(id)
                    .fetch_one(s.db.sqlite.as_ref().unwrap().pool())
                    .await
                    .unwrap()
            }
            Backend::Postgres => {
                sqlx::query_as("SELECT status, failure_reason, last_error FROM ferry_events WHERE id = $1")
                    .bind(id)
                    .fetch_one(s.db.postgres.as_ref().unwrap().pool())
                    .await
                    .unwrap()
            }
        };
        let error = error.unwrap_or_default();
        assert_eq!((status.as_str(), reason.as_deref()), ("FAILED", Some("invalid_event")), "event {id}: {error}");
        assert!(error.contains(column) && error.contains(&format!("event {id}")), "names {column}: {error}");
    }
    // Nothing is re-claimed: the malformed rows ended.
    assert_eq!(s.ferry.relay.cycle(&CancellationToken::new()).await.unwrap().claimed, 0);

    // The binary shows such a row, naming what cannot be read, and lists them all.
    let config = s.db.dir.path().join("show.toml");
    std::fs::write(&config, format!("[database]\nurl = {:?}\n", s.db.url)).unwrap();
    let (code, stdout, stderr) = run_ferry(&config, &["show", &a.to_string()]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("unreadable") && stdout.contains("event_time cannot be read"), "{stdout}");
    let (code, stdout, stderr) = run_ferry(&config, &["failed", "list", "--json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let page: Value = serde_json::from_str(&stdout).unwrap();
    let listed: Vec<i64> = page["events"].as_array().unwrap().iter().map(|e| e["id"].as_i64().unwrap()).collect();
    assert_eq!(listed, vec![a, b, c], "every malformed row is listed");
    assert!(page["events"][0]["defect"].as_str().unwrap().contains("event_time"), "{page}");
    let (code, stdout, stderr) = run_ferry(&config, &["failed", "summary", "--json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let summary: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!((summary["total"].as_u64(), summary["groups"][0]["reason"].as_str()), (Some(3), Some("invalid_event")));
}

async fn the_schema_refuses_what_ferry_cannot_represent(db: TestDb) {
    let attempts = match db.backend {
        Backend::Sqlite => [
            "INSERT INTO ferry_events (route, event_type, payload, event_time) VALUES ('s', 't', x'00', 'soon')",
            "INSERT INTO ferry_events (route, event_type, payload, max_attempts) VALUES ('s', 't', x'00', 9223372036854775807)",
            "INSERT INTO ferry_events (route, event_type, payload, next_attempt_at) VALUES ('s', 't', x'00', 1.5)",
            "INSERT INTO ferry_events (route, event_type, payload, status, sent_started_at) VALUES ('s', 't', x'00', 'SENT', 'soon')",
            "INSERT INTO ferry_events (route, event_type, payload, status, sent_duration_ms) VALUES ('s', 't', x'00', 'SENT', -1)",
        ],
        Backend::Postgres => [
            "INSERT INTO ferry_events (route, event_type, payload, event_time) VALUES ('s', 't', '\\x00', 'infinity')",
            "INSERT INTO ferry_events (route, event_type, payload, next_attempt_at) VALUES ('s', 't', '\\x00', '-infinity')",
            "INSERT INTO ferry_events (route, event_type, payload, created_at) VALUES ('s', 't', '\\x00', '294276-12-31')",
            "INSERT INTO ferry_events (route, event_type, payload, status, sent_started_at) VALUES ('s', 't', '\\x00', 'SENT', 'infinity')",
            "INSERT INTO ferry_events (route, event_type, payload, status, sent_duration_ms) VALUES ('s', 't', '\\x00', 'SENT', -1)",
        ],
    };
    for statement in attempts {
        let refused = sql(&db, statement).await.expect_err(statement).to_string();
        assert!(refused.contains("ferry_events"), "{statement}: {refused}");
    }
    let plain = "INSERT INTO ferry_events (route, event_type, payload) VALUES ('orders', 'order.paid', '{\"id\":42}')";
    assert_eq!(sql(&db, plain).await.unwrap(), 1, "the README's INSERT");
}

async fn operators_cancel_or_fail_an_event_fenced_against_its_claim(db: TestDb) {
    let s = stepped(db).await;
    let (pending, claimed, sent) = (insert(&s, "ok").await, insert(&s, "ok").await, insert(&s, "ok").await);
    let now = s.clock.now();
    let claim = |limit, token: &str| Claim {
        now,
        limit,
        lease_until: now + chrono::Duration::minutes(5),
        instance: "elsewhere".into(),
        token: token.into(),
        ordered_routes: vec![],
        blocking_routes: vec![],
        paused_routes: vec![],
        only_route: None,
        max_payload: 1 << 20,
    };
    // `sent` is delivered; `claimed` is held by a relay elsewhere.
    sql(&s.db, &format!("UPDATE ferry_events SET status = 'SENT' WHERE id = {sent}")).await.unwrap();
    let held = s.db.store.claim(&claim(2, "theirs")).await.unwrap();
    assert_eq!(held.iter().map(|e| e.id).collect::<Vec<_>>(), vec![pending, claimed]);
    s.db.store.release("theirs", &[pending], now).await.unwrap();

    let config = s.db.dir.path().join("ops.toml");
    std::fs::write(&config, format!("[database]\nurl = {:?}\n[route.s]\nplugin = \"scripted\"\n", s.db.url)).unwrap();
    let ferry = |args: &[&str]| run_ferry(&config, args);

    let (code, out, err) = ferry(&["event", "fail", &claimed.to_string(), "--reason", "receiver retired", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let view: Value = serde_json::from_str(&out).unwrap();
    assert_eq!((view["status"].as_str(), view["failure_reason"].as_str()), (Some("FAILED"), Some("operator")));
    assert_eq!(view["last_error"], "receiver retired");
    // The relay that held the claim finishes late: its outcome is fenced off.
    let late = ferry::event::Completion {
        id: claimed,
        disposition: ferry::event::Disposition::Sent,
        max_attempts: 3,
        attempt: Default::default(),
        dead_letter: None,
    };
    assert_eq!(s.db.store.complete("theirs", now, &[late]).await.unwrap(), 0, "the late outcome is not written");
    let row = s.db.store.get(claimed).await.unwrap().unwrap();
    assert_eq!((row.status, row.failure_reason), (Status::Failed, Some(FailureReason::Operator)));

    let (code, out, err) = ferry(&["event", "cancel", &pending.to_string()]);
    assert_eq!((code, out.trim()), (Some(0), format!("event {pending} cancelled").as_str()), "{err}");
    assert!(s.db.store.get(pending).await.unwrap().is_none(), "cancelled events are deleted");

    for (id, status) in [(sent, "SENT"), (claimed, "FAILED")] {
        let (code, _, err) = ferry(&["event", "cancel", &id.to_string()]);
        assert_eq!(code, Some(1));
        assert!(
            err.contains(&format!("event {id} is {status}")) && err.contains("only PENDING or PROCESSING"),
            "{err}"
        );
    }
    let (code, _, err) = ferry(&["event", "fail", "999999"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no event with id 999999"), "{err}");
    // Only the two store-level statuses count: EndEvent is what both front-ends call.
    assert!(!s.db.store.end_event(sent, EndEvent::Cancel, now).await.unwrap());
}

/// A random value of a random kind for a column, as someone at a SQL prompt might store.
fn garbage(rng: &mut rand::rngs::StdRng, backend: Backend, column: &str) -> String {
    let time = column.ends_with("_at") || column == "event_time";
    match backend {
        Backend::Sqlite => match rng.random_range(0..7) {
            0 => "'not a time'".into(),
            1 => "x'00ff'".into(),
            2 => format!("{}", rng.random::<f64>() * 1e18),
            3 => format!("{}", rng.random::<i64>()),
            4 => "-1".into(),
            5 if time => "0".into(),
            _ => "NULL".into(),
        },
        Backend::Postgres if time => ["'infinity'", "'-infinity'", "'294276-12-31'", "'4713-01-01 BC'", "'2026-07-01'"]
            [rng.random_range(0..5)]
        .into(),
        Backend::Postgres => ["0", "2147483647", "-5", "NULL", "7"][rng.random_range(0..5)].into(),
    }
}

async fn random_column_values_never_stop_the_relay(db: TestDb) {
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let s = stepped(db).await;
    match s.db.backend {
        Backend::Sqlite => {
            sql(&s.db, "DROP TRIGGER ferry_events_representable").await.unwrap();
        }
        // No constraint holds an UPDATE on PostgreSQL (migration 12); its INSERT trigger fires
        // only for new rows.
        Backend::Postgres => {}
    }
    let columns = ["event_time", "created_at", "attempts", "max_attempts", "next_attempt_at", "last_status_at"];
    let mut good = Vec::new();
    for round in 0..40 {
        let id = insert(&s, "ok").await;
        if round % 2 == 0 {
            good.push(id);
            continue;
        }
        for _ in 0..rng.random_range(1..3) {
            let column = columns[rng.random_range(0..columns.len())];
            let value = garbage(&mut rng, s.db.backend, column);
            // NOT NULL columns refuse NULL: that is the schema holding, not ferry.
            let _ = sql(&s.db, &format!("UPDATE ferry_events SET {column} = {value} WHERE id = {id}")).await;
        }
    }
    for _ in 0..3 {
        s.ferry.relay.cycle(&CancellationToken::new()).await.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        s.clock.advance(std::time::Duration::from_secs(3600));
    }
    for id in good {
        let row = s.db.store.get(id).await.unwrap().unwrap();
        assert_eq!(row.status, Status::Sent, "seed {seed}: good event {id}");
    }
    let processing: i64 = match s.db.backend {
        Backend::Sqlite => sqlx::query_scalar("SELECT COUNT(*) FROM ferry_events WHERE status = 'PROCESSING'")
            .fetch_one(s.db.sqlite.as_ref().unwrap().pool())
            .await
            .unwrap(),
        Backend::Postgres => sqlx::query_scalar("SELECT COUNT(*) FROM ferry_events WHERE status = 'PROCESSING'")
            .fetch_one(s.db.postgres.as_ref().unwrap().pool())
            .await
            .unwrap(),
    };
    assert_eq!(processing, 0, "seed {seed}: every claimed row ended");
}

/// A breaker's row edited by hand into what ferry cannot read holds only its own route, as if
/// opened by hand, and says so in `ferry breaker list`; the other routes keep flowing, and
/// `ferry breaker close` mends it.
async fn a_malformed_breaker_row_holds_only_its_route(db: TestDb) {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let routes = "[route.s]\nplugin = \"scripted\"\n[route.u]\nplugin = \"scripted\"\n";
    let s = Stepped::start(db, &format!("[plugins]\ndir = {plugins:?}\n{routes}")).await;
    // What an operator might type: a time as text (SQLite) or one ferry cannot represent.
    let bad_time = match s.db.backend {
        Backend::Sqlite => "datetime('now')",
        Backend::Postgres => "'infinity'",
    };
    for route in ["u", "gone"] {
        let edit =
            format!("INSERT INTO ferry_breakers (route, opened_at, reason) VALUES ('{route}', {bad_time}, 'by hand')");
        assert_eq!(sql(&s.db, &edit).await.unwrap(), 1, "{edit}");
    }
    let on_s = insert(&s, "ok").await;
    let on_u = s.db.store.insert(&NewEvent::new("u", "ok", "{}"), s.clock.now()).await.unwrap();
    s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    assert_eq!(s.db.store.get(on_s).await.unwrap().unwrap().status, Status::Sent, "route s flows");
    assert_eq!(s.db.store.get(on_u).await.unwrap().unwrap().status, Status::Pending, "route u is held");

    let config = s.db.dir.path().join("breakers.toml");
    std::fs::write(&config, format!("[database]\nurl = {:?}\n{routes}", s.db.url)).unwrap();
    let (code, stdout, stderr) = run_ferry(&config, &["breaker", "list", "--json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let listed: Value = serde_json::from_str(&stdout).unwrap();
    let u = listed.as_array().unwrap().iter().find(|b| b["route"] == "u").expect("u is listed");
    assert_eq!((u["state"].as_str(), u["manual"].as_bool()), (Some("open"), Some(true)), "{u}");
    let reason = u["reason"].as_str().unwrap();
    assert!(reason.contains("opened_at") && reason.contains("ferry breaker close u"), "{reason}");

    let (code, _, stderr) = run_ferry(&config, &["breaker", "close", "u"]);
    assert_eq!(code, Some(0), "{stderr}");
    s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    assert_eq!(s.db.store.get(on_u).await.unwrap().unwrap().status, Status::Sent, "route u flows once mended");
}

/// A breaker's failure count edited to the top of PostgreSQL's `integer`: the next failures
/// neither overflow it (which would fail every cycle with a failure on that route) nor lose it;
/// the breaker opens, at the top.
async fn a_breaker_count_edited_to_its_top_still_counts(db: TestDb) {
    let s = stepped(db).await;
    let edit = "INSERT INTO ferry_breakers (route, consecutive_failures) VALUES ('s', 2147483647)";
    assert_eq!(sql(&s.db, edit).await.unwrap(), 1);
    insert(&s, "transient").await;
    s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    let breakers = s.db.store.breakers().await.unwrap();
    let b = breakers.iter().find(|b| b.route == "s").unwrap();
    assert_eq!((b.consecutive_failures, b.opened_at.is_some()), (i32::MAX as u32, true), "{b:?}");
}

/// A row left PROCESSING by hand, or inserted so by an application, without a lease a ferry took
/// (none; text on SQLite, an infinite time on PostgreSQL; one ending past the longest lease ferry
/// takes, such as the year 9999) is counted as stuck, recovered by housekeeping like an expired
/// claim and then delivered, rather than held for as long as it says (and on an ordered route,
/// every later event of its key with it). A lease a ferry could have taken is left to run.
async fn a_processing_row_without_a_lease_is_recovered(db: TestDb) {
    let s = stepped(db).await;
    let now = s.clock.now();
    let at = |t: chrono::DateTime<chrono::Utc>| match s.db.backend {
        Backend::Sqlite => t.timestamp_millis().to_string(),
        Backend::Postgres => format!("'{}'", t.to_rfc3339()),
    };
    let far = at(ferry::store::lease_ceiling(now) + chrono::Duration::minutes(1));
    let leases = match s.db.backend {
        Backend::Sqlite => vec!["NULL".to_string(), "'tomorrow'".into(), "253402300800000".into(), "1e300".into(), far],
        Backend::Postgres => vec!["NULL".to_string(), "'infinity'".into(), "'9999-01-01'".into(), far],
    };
    let mut stuck = Vec::new();
    for lease in &leases {
        stuck.push(insert_edited(&s, &format!("status = 'PROCESSING', lease_until = {lease}")).await);
    }
    let taken = at(now + chrono::Duration::from_std(ferry::store::MAX_LEASE).unwrap());
    let held = insert_edited(&s, &format!("status = 'PROCESSING', lease_until = {taken}")).await;
    assert_eq!(s.db.store.stats(now, None, false).await.unwrap().stuck, stuck.len() as u64, "{leases:?}");
    s.ferry.relay.housekeeping().await;
    s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    for (id, lease) in stuck.into_iter().zip(&leases) {
        let row = s.db.store.get(id).await.unwrap().unwrap();
        assert_eq!(row.status, Status::Sent, "event {id}, lease {lease}: {:?}", row.last_error);
    }
    let row = s.db.store.get(held).await.unwrap().unwrap();
    assert_eq!(row.status, Status::Processing, "a lease as long as ferry takes runs on");
}

/// Whatever `claimed_by` a stuck row holds (on SQLite a blob, or text that is not UTF-8; on
/// either a name of megabytes or one with a line break) it is recovered with the
/// rest: the name comes back as text safe to log and at most `MAX_CLAIMANT` bytes, and the
/// message written names it when it is printable ASCII of that size, and otherwise gives its size. Before, one such row
/// failed the recovery statement, and with it every stuck claim of every route stayed held.
async fn stuck_rows_are_recovered_whatever_their_claimant(db: TestDb) {
    let s = stepped(db).await;
    let mut claimants = vec![
        ("NULL", None, "(claimed by ?)"),
        ("'inst-a'", Some("inst-a".to_string()), "(claimed by inst-a)"),
        ("'a' || chr(10) || 'b'", Some("a\\nb".into()), "(claimed by an instance name of 3 bytes)"),
    ];
    let long = match s.db.backend {
        Backend::Sqlite => "printf('%.*c', 3000000, 'x')",
        Backend::Postgres => "repeat('x', 3000000)",
    };
    claimants.push((long, None, "(claimed by an instance name of 3000000 bytes)"));
    if s.db.backend == Backend::Sqlite {
        claimants[2].0 = "'a' || char(10) || 'b'";
        // SQLite keeps a blob as a blob in any column (a number given to this TEXT column is
        // stored as text), and does not check that text is UTF-8.
        claimants.push((
            "x'ff00fe'",
            Some("\u{fffd}\\u{0}\u{fffd}".into()),
            "(claimed by an instance name of 3 bytes)",
        ));
        claimants.push(("CAST(x'ff41' AS TEXT)", Some("\u{fffd}A".into()), "(claimed by an instance name of 2 bytes)"));
    }
    let mut stuck = Vec::new();
    for (value, _, _) in &claimants {
        stuck
            .push(insert_edited(&s, &format!("status = 'PROCESSING', lease_until = NULL, claimed_by = {value}")).await);
    }
    // Two at a time, oldest first, as the relay's passes of RECOVER_BATCH go.
    let mut recovered = Vec::new();
    loop {
        let pass = s.db.store.recover_expired(s.clock.now(), 2).await.expect("recovery reads every row");
        assert!(pass.len() <= 2, "{pass:?}");
        if pass.is_empty() {
            break;
        }
        recovered.extend(pass);
    }
    assert_eq!(recovered.iter().map(|r| r.id).collect::<Vec<_>>(), stuck);
    for ((value, name, message), (r, id)) in claimants.iter().zip(recovered.iter().zip(&stuck)) {
        assert_eq!(r.claimed_by.as_ref(), name.as_ref(), "claimed_by = {value}");
        let row = s.db.store.get(*id).await.unwrap().unwrap();
        assert_eq!(row.status, Status::Pending, "claimed_by = {value}");
        let error = row.last_error.unwrap_or_default();
        assert!(
            error.starts_with("claim lease expired while PROCESSING ") && error.contains(message),
            "{value}: {error}"
        );
        assert!(error.len() < 200, "claimed_by = {value}: {} bytes", error.len());
    }
    s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    for id in stuck {
        assert_eq!(s.db.store.get(id).await.unwrap().unwrap().status, Status::Sent, "event {id}");
    }
}

/// A crash can leave more stuck claims than one recovery statement takes (`RECOVER_BATCH`): the
/// relay's recovery goes on until none is left, each statement bounded.
async fn more_stuck_claims_than_one_pass_takes_are_all_recovered(db: TestDb) {
    let s = stepped(db).await;
    let n = ferry::store::RECOVER_BATCH as usize * 2 + 500;
    let fill = match s.db.backend {
        Backend::Sqlite => format!(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {n})
             INSERT INTO ferry_events (route, event_type, payload, status, claimed_by) SELECT 's', 'ok', '{{}}', 'PROCESSING', 'gone' FROM n"
        ),
        Backend::Postgres => format!(
            "INSERT INTO ferry_events (route, event_type, payload, status, claimed_by)
             SELECT 's', 'ok', '{{}}'::bytea, 'PROCESSING', 'gone' FROM generate_series(1, {n})"
        ),
    };
    assert_eq!(sql(&s.db, &fill).await.unwrap(), n as u64);
    assert_eq!(s.ferry.relay.recover().await.unwrap(), n);
    let stats = s.db.store.stats(s.clock.now(), None, false).await.unwrap();
    assert_eq!((stats.stuck, s.db.store.recover_expired(s.clock.now(), 10).await.unwrap().len()), (0, 0));
}

/// A PENDING row whose `next_attempt_at` was edited into something the claim cannot compare with
/// a time (text or a blob on SQLite, `infinity` on PostgreSQL) is never due: housekeeping makes it
/// due now, and it is delivered, rather than waiting forever.
async fn a_pending_row_whose_retry_time_cannot_be_compared_is_made_due(db: TestDb) {
    let s = stepped(db).await;
    let times: &[&str] = match s.db.backend {
        Backend::Sqlite => &["'2025-01-01T00:00:00Z'", "x'00'"],
        Backend::Postgres => &["'infinity'"],
    };
    let mut never_due = Vec::new();
    for time in times {
        never_due.push(insert_edited(&s, &format!("next_attempt_at = {time}")).await);
    }
    let fine = insert(&s, "ok").await;
    // As edited, the claim passes them over.
    let stats = s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    assert_eq!(stats.claimed, 1);
    assert_eq!(s.db.store.get(fine).await.unwrap().unwrap().status, Status::Sent);
    s.ferry.relay.housekeeping().await;
    s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    for id in never_due {
        let row = s.db.store.get(id).await.unwrap().unwrap();
        assert_eq!(row.status, Status::Sent, "event {id}: {:?}", row.last_error);
    }
}

/// Names and headers are limited where events are emitted (`ferry_outbox::MAX_NAME`,
/// `MAX_HEADERS`); a row written past that, by SQL, is not loaded whole by the claim, whatever its
/// size: it fails alone, as `invalid_event` naming the column and its size. On PostgreSQL the
/// INSERT trigger refuses such headers too (their printed size cannot be told from the stored
/// one), so the rows here are written as logical replication writes them, without triggers.
async fn names_and_headers_too_long_to_load_fail_alone(db: TestDb) {
    let s = stepped(db).await;
    // `n` copies of the letter `c`, in the backend's SQL.
    let repeat = |c: char, n: usize| match s.db.backend {
        Backend::Sqlite => format!("replace(hex(zeroblob({n})), '00', '{c}')"),
        Backend::Postgres => format!("repeat('{c}', {n})"),
    };
    let good = [insert(&s, "ok").await, insert(&s, "ok").await];
    // Headers under the limit, though large enough for PostgreSQL to measure them as text.
    let roomy = insert(&s, "ok").await;
    let headers = |n: usize| format!("'{{\"h\": \"' || {} || '\"}}'", repeat('v', n));
    let roomy_headers = match s.db.backend {
        Backend::Sqlite => headers(60_000),
        Backend::Postgres => format!("({})::jsonb", headers(60_000)),
    };
    sql(&s.db, &format!("UPDATE ferry_events SET headers = {roomy_headers} WHERE id = {roomy}")).await.unwrap();
    let mut edits = Vec::new();
    let mut long = vec![
        ("route", format!("'s' || {}", repeat('r', 1024))),
        ("event_type", repeat('t', 1025)),
        ("ordering_key", repeat('k', 5000)),
        ("content_type", repeat('c', 1025)),
        ("headers", headers(300_000)),
    ];
    if s.db.backend == Backend::Postgres {
        // 300 numbers that print 131 072 digits each, stored compressed in a few dozen bytes:
        // the claim measures compressed headers as text, however small they are stored.
        long.push(("headers", "'{\"h\": [' || repeat('1e131071,', 300) || '1]}'".into()));
    }
    let kinds = long.len();
    for (column, value) in long {
        let id = insert(&s, "ok").await;
        let edit = match s.db.backend {
            Backend::Sqlite => format!("UPDATE ferry_events SET {column} = {value} WHERE id = {id}"),
            // No trigger checks an UPDATE on PostgreSQL (migration 12): the edit is written as typed.
            Backend::Postgres => {
                let value = if column == "headers" { format!("({value})::jsonb") } else { value };
                format!("UPDATE ferry_events SET {column} = {value} WHERE id = {id}")
            }
        };
        let written = match s.db.backend {
            Backend::Sqlite => sql(&s.db, &edit).await.unwrap(),
            Backend::Postgres => {
                sqlx::raw_sql(&edit).execute(s.db.postgres.as_ref().unwrap().pool()).await.unwrap().rows_affected()
            }
        };
        assert_eq!(written, 1, "{column}");
        edits.push((id, column));
    }
    if s.db.backend == Backend::Postgres {
        // Written with triggers, such headers are refused: long strings, and numbers that print
        // far longer than they are stored.
        let numbers = "('{\"h\": [' || repeat('1e131071,', 20) || '1]}')::jsonb".to_string();
        for headers in [format!("({})::jsonb", headers(300_000)), numbers] {
            let insert = format!(
                "INSERT INTO ferry_events (route, event_type, payload, headers) VALUES ('s', 't', '\\x00', {headers})"
            );
            let refused = sql(&s.db, &insert).await.expect_err("refused").to_string();
            assert!(refused.contains("headers must print in at most 131072 bytes"), "{refused}");
        }
    }
    let stats = s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    assert_eq!(stats.claimed, 3 + kinds, "the whole batch is claimed: {stats:?}");
    for id in good.into_iter().chain([roomy]) {
        let row = s.db.store.get(id).await.unwrap().unwrap();
        assert_eq!(row.status, Status::Sent, "event {id}: {:?}", row.last_error);
    }
    // An error, a claimant and a token written by SQL past what ferry writes, on the first.
    let edit = format!(
        "UPDATE ferry_events SET last_error = {}, claimed_by = {}, claim_token = {} WHERE id = {}",
        repeat('e', 100_000),
        repeat('b', 5000),
        repeat('t', 1025),
        edits[0].0
    );
    for (id, column) in &edits {
        let row = s.db.store.get(*id).await.unwrap().unwrap();
        let error = row.last_error.unwrap_or_default();
        assert_eq!((row.status, row.failure_reason), (Status::Failed, Some(FailureReason::InvalidEvent)), "{error}");
        assert_eq!(row.attempts, 1, "event {id}");
        assert!(
            error.starts_with(&format!("event {id}: its {column} ")) && error.contains("ferry loads, so"),
            "{column}: {error}"
        );
    }
    assert_eq!(sql(&s.db, &edit).await.unwrap(), 1, "{edit}");
    // Listed, the long values are shown as their size: a page of such rows is not loaded whole.
    let config = s.db.dir.path().join("list.toml");
    std::fs::write(&config, format!("[database]\nurl = {:?}\n", s.db.url)).unwrap();
    let (code, stdout, stderr) = run_ferry(&config, &["failed", "list", "--json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let page: Value = serde_json::from_str(&stdout).unwrap();
    let events = page["events"].as_array().unwrap();
    assert_eq!(events.len(), kinds, "{page}");
    assert_eq!(events[0]["route"], "(1025 bytes, not loaded)");
    assert_eq!(events[0]["last_error"], "(100000 bytes, not loaded)");
    assert_eq!(events[0]["claimed_by"], "(5000 bytes, not loaded)");
    assert_eq!(events[0]["claim_token"], "(1025 bytes, not loaded)");
    assert_eq!(events[2]["ordering_key"], "(5000 bytes, not loaded)", "{}", events[2]);
    let headers = events[4]["headers"].as_str().unwrap_or_default();
    assert!(headers.ends_with(" bytes, not loaded)") && headers.starts_with("(3000"), "{headers}");
    let (code, stdout, stderr) = run_ferry(&config, &["failed", "summary", "--json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let summary: Value = serde_json::from_str(&stdout).unwrap();
    let groups = summary["groups"].as_array().unwrap();
    let shown = |field: &str| groups.iter().filter(|g| g[field] == "(1025 bytes, not loaded)").count();
    assert_eq!((shown("route"), shown("type")), (1, 1), "{summary}");
}

/// Makes the database refuse, with `message`, every update of a `ferry_events` row for which
/// `when` (a condition on `NEW` in both dialects) holds: a trigger named `refuse_{name}`.
pub(crate) async fn refuse_claims(db: &TestDb, name: &str, when: &str, message: &str) {
    let statements = match db.backend {
        Backend::Sqlite => vec![format!(
            "CREATE TRIGGER refuse_{name} BEFORE UPDATE OF status ON ferry_events WHEN {when}
             BEGIN SELECT RAISE(ABORT, '{message}'); END"
        )],
        Backend::Postgres => vec![
            format!(
                "CREATE FUNCTION refuse_{name}() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN IF {when} THEN RAISE EXCEPTION '{message}'; END IF; RETURN NEW; END $$"
            ),
            format!(
                "CREATE TRIGGER refuse_{name} BEFORE UPDATE ON ferry_events FOR EACH ROW EXECUTE FUNCTION refuse_{name}()"
            ),
        ],
    };
    for statement in statements {
        sql(db, &statement).await.unwrap();
    }
}

/// A row the database refuses to claim (here a trigger refuses its update; on PostgreSQL, headers
/// that print past 1 GB do too) would fail every claim that includes it, and so stop every route.
/// The relay then claims the due events one at a time: that row is set FAILED, `invalid_event`,
/// with the database's error, and the others are delivered in the same cycle.
async fn a_row_the_database_refuses_to_claim_fails_alone(db: TestDb) {
    let s = stepped(db).await;
    // A refusal every row meets is not a row's: nothing is set FAILED, the cycle fails.
    refuse_claims(&s.db, "everything", "NEW.status = 'PROCESSING'", "no claims today").await;
    let waiting = [insert(&s, "ok").await, insert(&s, "ok").await];
    let error = s.ferry.relay.cycle(&CancellationToken::new()).await.expect_err("every claim is refused");
    assert!(error.to_string().contains("no claims today"), "{error}");
    for id in waiting {
        let row = s.db.store.get(id).await.unwrap().unwrap();
        assert_eq!((row.status, row.last_error), (Status::Pending, None), "event {id}");
    }
    let lifted = match s.db.backend {
        Backend::Sqlite => "DROP TRIGGER refuse_everything",
        Backend::Postgres => "DROP TRIGGER refuse_everything ON ferry_events",
    };
    sql(&s.db, lifted).await.unwrap();
    assert_eq!(s.ferry.relay.cycle(&CancellationToken::new()).await.unwrap().claimed, 2);

    let (before, poison, after) = (insert(&s, "ok").await, insert(&s, "poison").await, insert(&s, "ok").await);
    let message = "this row is not to be claimed";
    if s.db.backend == Backend::Sqlite {
        // SQLite's CHECK lets a count edited into text through; it must not stop the event failing.
        sql(&s.db, &format!("UPDATE ferry_events SET attempts = 'x' WHERE id = {poison}")).await.unwrap();
    }
    refuse_claims(&s.db, "poison", "NEW.event_type = 'poison' AND NEW.status = 'PROCESSING'", message).await;
    let stats = s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    assert_eq!(stats.claimed, 2, "{stats:?}");
    for id in [before, after] {
        let row = s.db.store.get(id).await.unwrap().unwrap();
        assert_eq!(row.status, Status::Sent, "event {id}: {:?}", row.last_error);
    }
    let row = s.db.store.get(poison).await.unwrap().unwrap();
    let error = row.last_error.unwrap_or_default();
    assert_eq!((row.status, row.failure_reason), (Status::Failed, Some(FailureReason::InvalidEvent)), "{error}");
    assert!(
        error.starts_with(&format!("event {poison}: the database refuses to claim it")) && error.contains(message),
        "{error}"
    );
    // Its history says so too: one failure, by this instance, with no plugin.
    let history = s.db.store.attempts(poison).await.unwrap();
    let seen: Vec<_> =
        history.iter().map(|a| (a.attempt, a.outcome, a.reason, a.error.as_deref(), a.plugin.as_deref())).collect();
    assert_eq!(seen, [(0, AttemptOutcome::Failed, Some(FailureReason::InvalidEvent), Some(&*error), None)]);
    assert!(history[0].instance.as_deref().is_some_and(|i| !i.is_empty()), "{history:?}");
    let labels = ferry::metrics::FailedLabels {
        route: ferry::metrics::UNCLAIMED.into(),
        plugin: "".into(),
        reason: "invalid_event".into(),
    };
    assert_eq!(s.ferry.registry.metrics().failed.get_or_create(&labels).get(), 1, "counted as FAILED");
    let next = insert(&s, "ok").await;
    assert_eq!(s.ferry.relay.cycle(&CancellationToken::new()).await.unwrap().claimed, 1, "claims are whole again");
    assert_eq!(s.db.store.get(next).await.unwrap().unwrap().status, Status::Sent);
}

crate::both_backends!(
    malformed_rows_fail_alone_and_the_rest_is_delivered,
    the_schema_refuses_what_ferry_cannot_represent,
    operators_cancel_or_fail_an_event_fenced_against_its_claim,
    random_column_values_never_stop_the_relay,
    a_malformed_breaker_row_holds_only_its_route,
    a_processing_row_without_a_lease_is_recovered,
    stuck_rows_are_recovered_whatever_their_claimant,
    more_stuck_claims_than_one_pass_takes_are_all_recovered,
    names_and_headers_too_long_to_load_fail_alone,
    a_row_the_database_refuses_to_claim_fails_alone,
    a_breaker_count_edited_to_its_top_still_counts,
    a_pending_row_whose_retry_time_cannot_be_compared_is_made_due,
);

/// The attack the claim's fallback answers, on PostgreSQL: headers of 8 700 numbers that print
/// 131 072 digits each, stored in a few hundred bytes, edited into a row by hand (no trigger checks
/// an UPDATE: migration 12). PostgreSQL
/// cannot print them (its strings end at 1 GB), so every claim that includes the row fails. The
/// row is set FAILED and the event beside it is delivered; its attempts, edited below zero too,
/// do not stop its history recording why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_that_print_past_a_gigabyte_fail_alone() {
    let s = stepped(TestDb::new(Backend::Postgres).await).await;
    let (good, bomb) = (insert(&s, "ok").await, insert(&s, "ok").await);
    let edit = format!(
        "UPDATE ferry_events SET headers = ('{{\"h\": [' || repeat('1e131071,', 8700) || '1]}}')::jsonb, attempts = -1 WHERE id = {bomb}"
    );
    sqlx::raw_sql(&edit).execute(s.db.postgres.as_ref().unwrap().pool()).await.unwrap();
    let stats = s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    assert_eq!(stats.claimed, 1, "{stats:?}");
    assert_eq!(s.db.store.get(good).await.unwrap().unwrap().status, Status::Sent);
    // Shown and listed, its headers are a note: the row does not fail what reads it.
    let row = s.db.store.get(bomb).await.unwrap().unwrap();
    let error = row.last_error.unwrap_or_default();
    assert_eq!((row.status, row.failure_reason), (Status::Failed, Some(FailureReason::InvalidEvent)), "{error}");
    assert!(error.contains("the database refuses to claim it") && error.contains("out of memory"), "{error}");
    assert_eq!(row.headers, "(over 1 GB as text, not loaded)");
    let config = s.db.dir.path().join("list.toml");
    std::fs::write(&config, format!("[database]\nurl = {:?}\n", s.db.url)).unwrap();
    let (code, stdout, stderr) = run_ferry(&config, &["failed", "list", "--json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let page: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(page["events"][0]["headers"], "(over 1 GB as text, not loaded)", "{page}");
}

/// On PostgreSQL what applications write is checked by the INSERT trigger, not by CHECK
/// constraints or UPDATE triggers, which PostgreSQL runs on every row ferry's claim and completion
/// write (migrations 9 and 12); only the status keeps its CHECK. The values are refused where
/// applications write them; a row edited by UPDATE, or written past the triggers (as logical
/// replication or `pg_restore --disable-triggers` writes it), fails alone as `invalid_event`
/// naming the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_checks_what_applications_write_where_they_write_it() {
    let s = stepped(TestDb::new(Backend::Postgres).await).await;
    let ok = insert(&s, "ok").await;
    let insert_with = |columns: &str, values: &str| {
        format!("INSERT INTO ferry_events (route, event_type, payload{columns}) VALUES ('s', 't', '\\x00'{values})")
    };
    let refused = [
        ("INSERT INTO ferry_events (route, event_type, payload) VALUES ('', 't', '\\x00')".to_string(), "route"),
        ("INSERT INTO ferry_events (route, event_type, payload) VALUES ('s', '', '\\x00')".to_string(), "event_type"),
        (insert_with(", headers", ", '[]'"), "headers"),
        (insert_with(", status", ", 'DONE'"), "ferry_events_status_check"),
        (insert_with(", attempts", ", -1"), "attempts"),
        (insert_with(", max_attempts", ", -2"), "attempts"),
        (insert_with(", status, failure_reason", ", 'FAILED', 'gone'"), "failure_reason"),
    ];
    for (statement, column) in refused {
        let error = sql(&s.db, &statement).await.expect_err(&statement).to_string();
        assert!(error.contains("ferry_events") && error.contains(column), "{statement}: {error}");
    }
    // An UPDATE by hand is checked for its status only: the relay meets the rest as written.
    let status = format!("UPDATE ferry_events SET status = 'pending' WHERE id = {ok}");
    let refused = sql(&s.db, &status).await.expect_err(&status).to_string();
    assert!(refused.contains("ferry_events_status_check"), "{refused}");
    let (unnamed, uncounted) = (insert(&s, "ok").await, insert(&s, "ok").await);
    for edit in [
        format!("UPDATE ferry_events SET route = '' WHERE id = {unnamed}"),
        format!("UPDATE ferry_events SET attempts = -5 WHERE id = {uncounted}"),
    ] {
        assert_eq!(sql(&s.db, &edit).await.unwrap(), 1, "{edit}");
    }

    let pool = s.db.postgres.as_ref().unwrap().pool();
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET session_replication_role = replica").execute(&mut *conn).await.unwrap();
    let mut replicated = Vec::new();
    for (route, event_type, headers, column) in
        [("s", "ok", "[1]", "headers"), ("", "ok", "{}", "route"), ("s", "", "{}", "event_type")]
    {
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO ferry_events (route, event_type, payload, headers, next_attempt_at)
             VALUES ($1, $2, '\\x7b7d', $3::jsonb, $4) RETURNING id",
        )
        .bind(route)
        .bind(event_type)
        .bind(headers)
        .bind(s.clock.now())
        .fetch_one(&mut *conn)
        .await
        .expect("with triggers off nothing but NOT NULL and the status checks refuse a row");
        replicated.push((id, column));
    }
    sqlx::query("RESET session_replication_role").execute(&mut *conn).await.unwrap();
    drop(conn);

    let stats = s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
    assert_eq!(stats.claimed, 6, "{stats:?}");
    assert_eq!(s.db.store.get(ok).await.unwrap().unwrap().status, Status::Sent);
    replicated.extend([(unnamed, "route"), (uncounted, "attempts")]);
    for (id, column) in replicated {
        let (status, reason, error): (String, Option<String>, Option<String>) =
            sqlx::query_as("SELECT status, failure_reason, last_error FROM ferry_events WHERE id = $1")
                .bind(id)
                .fetch_one(pool)
                .await
                .unwrap();
        let error = error.unwrap_or_default();
        assert_eq!((status.as_str(), reason.as_deref()), ("FAILED", Some("invalid_event")), "event {id}: {error}");
        assert!(error.contains(column) && error.contains(&format!("event {id}")), "names {column}: {error}");
    }
}

/// What PostgreSQL runs for each row ferry's claim and completion write, beyond the write itself:
/// the status CHECK alone (migration 12). No other CHECK, no UPDATE trigger, and no foreign key
/// pointing at the table, whose trigger would make PostgreSQL fetch every updated row's old
/// version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_updates_of_events_meet_only_the_status_check() {
    let db = TestDb::new(Backend::Postgres).await;
    let pool = db.postgres.as_ref().unwrap().pool();
    let checks: Vec<String> = sqlx::query_scalar(
        "SELECT conname::text FROM pg_constraint WHERE conrelid = 'ferry_events'::regclass AND contype = 'c'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(checks, ["ferry_events_status_check"]);
    let referencing: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM pg_constraint WHERE contype = 'f' AND confrelid = 'ferry_events'::regclass",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(referencing, 0, "no foreign key points at ferry_events");
    // Bit 4 of tgtype marks an UPDATE trigger; internal ones are a foreign key's.
    let on_update: Vec<String> = sqlx::query_scalar(
        "SELECT tgname::text FROM pg_trigger WHERE tgrelid = 'ferry_events'::regclass AND (tgtype & 16) <> 0",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(on_update.is_empty(), "{on_update:?}");
}

/// The README's INSERT, through the `sqlite3` program Debian ships (3.40, older than the
/// `unixepoch('subsec')` the first schema's defaults needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_insert_works_with_the_system_sqlite3() {
    let db = TestDb::new(Backend::Sqlite).await;
    let path = db.url.strip_prefix("sqlite://").unwrap();
    let readme = std::fs::read_to_string(crate::common::repo_root().join("README.md")).unwrap();
    let insert = readme
        .lines()
        .skip_while(|l| *l != "-- SQLite")
        .nth(1)
        .expect("the README shows a SQLite INSERT after `-- SQLite`")
        .to_string();
    let out = std::process::Command::new("sqlite3")
        .arg(path)
        .arg(&insert)
        .output()
        .expect("the sqlite3 program (Debian: apt-get install sqlite3; scripts/test installs it)");
    assert!(out.status.success(), "{insert}: {}", String::from_utf8_lossy(&out.stderr));
    let version = std::process::Command::new("sqlite3").arg("--version").output().unwrap();
    // The defaults of the first schema yield NULL on this sqlite3: the bug is reproducible here.
    let old_default = std::process::Command::new("sqlite3")
        .args([":memory:", "SELECT COALESCE(CAST(unixepoch('subsec') * 1000 AS INTEGER), 'NULL')"])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&old_default.stdout).trim() == "NULL" || !old_default.status.success(),
        "this test needs a sqlite3 older than 3.42 (Debian 12's 3.40), on which unixepoch('subsec') is NULL; got {}",
        String::from_utf8_lossy(&version.stdout)
    );
    let counts = db.store.counts().await.unwrap();
    assert_eq!(counts[&Status::Pending], 1, "sqlite3 {}", String::from_utf8_lossy(&version.stdout));
    let stored: (i64, i64) = sqlx::query_as("SELECT created_at, next_attempt_at FROM ferry_events")
        .fetch_one(db.sqlite.as_ref().unwrap().pool())
        .await
        .unwrap();
    let now = chrono::Utc::now().timestamp_millis();
    assert!((now - stored.0).abs() < 60_000 && stored.0 == stored.1, "defaults are now, in milliseconds: {stored:?}");
}

/// A SQLite file migrated only up to `version`, as an older ferry left it.
struct OldSqlite {
    _dir: tempfile::TempDir,
    url: String,
}

impl OldSqlite {
    async fn at(version: i64) -> OldSqlite {
        let dir = tempfile::tempdir().unwrap();
        let old = OldSqlite { url: format!("sqlite://{}", dir.path().join("old.db").display()), _dir: dir };
        let pool = old.open().await.unwrap();
        let mut before = sqlx::migrate!("../migrations/sqlite");
        before.migrations =
            std::borrow::Cow::Owned(before.migrations.iter().filter(|m| m.version <= version).cloned().collect());
        before.run(&pool).await.unwrap();
        pool.close().await;
        old
    }

    /// A pool on it with foreign keys on (ferry's own connections have them on too).
    async fn open(&self) -> Result<sqlx::SqlitePool, sqlx::Error> {
        let options: sqlx::sqlite::SqliteConnectOptions = self.url.parse()?;
        sqlx::SqlitePool::connect_with(options.create_if_missing(true).foreign_keys(true)).await
    }
}

/// Upgrading a SQLite database that has history: migration 0006 rebuilds `ferry_attempts` so it
/// admits outcome `deferred`, keeping every row, its id, and the id sequence (ids are never
/// reused).
#[tokio::test]
async fn the_deferred_migration_keeps_the_history_on_sqlite() {
    let file = OldSqlite::at(5).await;
    let pool = file.open().await.unwrap();
    let event: i64 = sqlx::query_scalar(
        "INSERT INTO ferry_events (route, event_type, payload) VALUES ('s', 't', x'7b7d') RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let history = "INSERT INTO ferry_attempts (event_id, attempt, started_at, duration_ms, outcome, error, plugin)
                   VALUES (?1, ?2, 1800000000000, 5, ?3, ?4, 'p') RETURNING id";
    let insert = |attempt: i64, outcome: &'static str, error: &'static str| {
        sqlx::query_scalar::<_, i64>(history).bind(event).bind(attempt).bind(outcome).bind(error)
    };
    assert_eq!(insert(1, "retry", "HTTP 503").fetch_one(&pool).await.unwrap(), 1);
    assert_eq!(insert(2, "retry", "HTTP 503").fetch_one(&pool).await.unwrap(), 2);
    // Id 2 was handed out: after the rebuild it must not be handed out again.
    sqlx::query("DELETE FROM ferry_attempts WHERE id = 2").execute(&pool).await.unwrap();
    assert!(insert(2, "deferred", "later").fetch_one(&pool).await.is_err(), "0005's CHECK refuses 'deferred'");
    pool.close().await;

    let store = ferry::store::connect(&file.url, 1, false).await.unwrap();
    store.migrate().await.unwrap();
    let rows = store.attempts(event).await.unwrap();
    let kept: Vec<(u32, &str, Option<&str>)> =
        rows.iter().map(|a| (a.attempt, a.outcome.as_str(), a.error.as_deref())).collect();
    assert_eq!(kept, [(1, "retry", Some("HTTP 503"))]);
    let pool = file.open().await.unwrap();
    assert_eq!(
        insert(2, "deferred", "later").fetch_one(&pool).await.unwrap(),
        3,
        "'deferred' admitted, ids not reused"
    );
    let index: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM sqlite_master WHERE name = 'ferry_attempts_event'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(index, 1, "the history's index is back");
    // Deleting the event still takes its history with it (the foreign key names the new table).
    sqlx::query("DELETE FROM ferry_events WHERE id = ?1").bind(event).execute(&pool).await.unwrap();
    let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM ferry_attempts").fetch_one(&pool).await.unwrap();
    assert_eq!(left, 0);
}

/// Upgrading a SQLite database through migration 0009, which rebuilds `ferry_events` and
/// `ferry_attempts` with their CHECK constraints written without IN lists (cheaper for SQLite to
/// evaluate): every row and every column is kept as it was, the id sequences carry on, the
/// indexes and the trigger are the same, the constraints still refuse what they refused, and
/// deleting an event still takes its history with it.
#[tokio::test]
async fn the_checks_migration_keeps_every_row_and_constraint_on_sqlite() {
    let file = OldSqlite::at(8).await;
    let pool = file.open().await.unwrap();
    // One row in each status, with every optional column set somewhere, history, and the highest
    // ids of both tables deleted (they were handed out and must not be handed out again).
    sqlx::raw_sql(
        "INSERT INTO ferry_events (route, event_type, ordering_key, payload, headers, status, attempts, max_attempts,
                                   processed_at, sent_started_at, sent_duration_ms, sent_plugin, sent_plugin_hash)
         VALUES ('r', 'sent', 'k1', x'7b7d', '{\"a\":\"b\"}', 'SENT', 1, 6, 1800000000000, 1800000000000, 3, 'http',
                 'abc');
         INSERT INTO ferry_events (route, event_type, payload, status, attempts, processed_at, last_error,
                                   failure_reason)
         VALUES ('r', 'failed', x'00ff', 'FAILED', 2, 1800000000001, 'HTTP 400', 'operator');
         INSERT INTO ferry_events (route, event_type, payload, status, attempts, claimed_by, claim_token, lease_until)
         VALUES ('r', 'held', x'01', 'PROCESSING', 1, 'host-1', 'token-1', 1800000000002);
         INSERT INTO ferry_events (route, event_type, payload, parent_id) VALUES ('r/d', 'copy', x'02', 1);
         INSERT INTO ferry_events (route, event_type, payload) VALUES ('r', 'purged', x'03');
         DELETE FROM ferry_events WHERE event_type = 'purged';
         INSERT INTO ferry_attempts (event_id, attempt, started_at, duration_ms, outcome, reason, error, plugin,
                                     plugin_hash, instance)
         VALUES (2, 1, 1800000000000, 5, 'failed', 'operator', 'HTTP 400', 'http', 'abc', 'host-1'),
                (2, 1, 1800000000000, 5, 'deferred', NULL, 'later', 'http', 'abc', 'host-1');
         DELETE FROM ferry_attempts WHERE outcome = 'deferred';",
    )
    .execute(&pool)
    .await
    .unwrap();
    // Each table's columns (name, type, NOT NULL, default, key) and foreign keys, every column of
    // every row, quoted, and every index and trigger as SQLite keeps them.
    let snapshot = |pool: sqlx::SqlitePool| async move {
        let mut rows = Vec::new();
        for table in ["ferry_events", "ferry_attempts"] {
            let columns: Vec<(String, String)> = sqlx::query_as(
                "SELECT name, quote(cid) || ',' || quote(type) || ',' || quote(\"notnull\") || ',' || quote(dflt_value)
                        || ',' || quote(pk) FROM pragma_table_info(?1) ORDER BY cid",
            )
            .bind(table)
            .fetch_all(&pool)
            .await
            .unwrap();
            let foreign: Vec<String> = sqlx::query_scalar(
                "SELECT quote(\"table\") || ',' || quote(\"from\") || ',' || quote(\"to\") || ',' || quote(on_update)
                        || ',' || quote(on_delete) FROM pragma_foreign_key_list(?1)",
            )
            .bind(table)
            .fetch_all(&pool)
            .await
            .unwrap();
            let quoted: Vec<String> = columns.iter().map(|(c, _)| format!("quote({c})")).collect();
            let query = format!("SELECT {} FROM {table} ORDER BY id", quoted.join(" || ',' || "));
            let stored = sqlx::query_scalar::<_, String>(&query).fetch_all(&pool).await.unwrap();
            rows.push((table, columns, foreign, stored));
        }
        let objects: Vec<(String, String)> = sqlx::query_as(
            "SELECT name, sql FROM sqlite_master WHERE type IN ('index', 'trigger') AND sql IS NOT NULL ORDER BY name",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        (rows, objects)
    };
    let old = snapshot(pool.clone()).await;
    assert_eq!(old.0[0].3.len(), 4, "{:?}", old.0);
    assert_eq!(old.0[1].2.len(), 1, "the history's foreign key: {:?}", old.0);
    // History whose event was deleted on a connection without foreign keys (SQLite's default):
    // the rebuild leaves it behind, as the cascade would have, rather than fail on it.
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("PRAGMA foreign_keys = OFF").execute(&mut *conn).await.unwrap();
    sqlx::query(
        "INSERT INTO ferry_attempts (event_id, attempt, started_at, duration_ms, outcome) VALUES (99, 1, 0, 0, 'retry')",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    drop(conn);
    pool.close().await;

    let store = ferry::store::connect(&file.url, 1, false).await.unwrap();
    store.migrate().await.unwrap();
    let pool = file.open().await.unwrap();
    let new = snapshot(pool.clone()).await;
    assert_eq!(new.0, old.0, "the same columns, foreign keys and rows (without the orphaned history row)");
    let normalize = |objects: &[(String, String)]| -> Vec<(String, String)> {
        objects.iter().map(|(n, s)| (n.clone(), s.split_whitespace().collect())).collect()
    };
    // Migration 10 drops retention's index of SENT rows; the rest are as they were.
    let kept: Vec<(String, String)> =
        normalize(&old.1).into_iter().filter(|(name, _)| name != "ferry_events_sent").collect();
    assert_eq!(kept.len() + 1, old.1.len(), "{:?}", old.1);
    assert_eq!(normalize(&new.1), kept, "the same indexes and trigger");
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name IN ('ferry_events', 'ferry_attempts')",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(tables.len(), 2);
    assert!(tables.iter().all(|sql| !sql.contains(" IN (")), "no CHECK is written with an IN list: {tables:?}");
    let left: Vec<String> =
        sqlx::query_scalar("SELECT name FROM sqlite_master WHERE name LIKE '%0008' UNION ALL SELECT name FROM sqlite_sequence WHERE name LIKE '%0008'")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(left.is_empty(), "the old tables and their sequences are gone: {left:?}");

    // Ids carry on after the highest ever handed out.
    let event: i64 = sqlx::query_scalar(
        "INSERT INTO ferry_events (route, event_type, payload) VALUES ('r', 't', x'7b7d') RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(event, 6, "event ids are not reused");
    let history = "INSERT INTO ferry_attempts (event_id, attempt, started_at, duration_ms, outcome)
                   VALUES (?1, 1, 1800000000000, 1, ?2) RETURNING id";
    let attempt: i64 = sqlx::query_scalar(history).bind(event).bind("deferred").fetch_one(&pool).await.unwrap();
    assert_eq!(attempt, 4, "history ids are not reused (3 went to the orphaned row)");

    // The constraints refuse what they refused before, and admit every value ferry writes.
    let mut statements: Vec<(String, bool)> = [
        "UPDATE ferry_events SET status = 'LOST' WHERE id = 6",
        "UPDATE ferry_events SET status = 'pending' WHERE id = 6",
        "UPDATE ferry_events SET failure_reason = 'gone' WHERE id = 6",
        "UPDATE ferry_events SET route = '' WHERE id = 6",
        "UPDATE ferry_events SET event_type = '' WHERE id = 6",
        "UPDATE ferry_events SET payload = NULL WHERE id = 6",
        "UPDATE ferry_events SET attempts = -1 WHERE id = 6",
        "UPDATE ferry_events SET max_attempts = -1 WHERE id = 6",
        "UPDATE ferry_events SET headers = '[]' WHERE id = 6",
        "UPDATE ferry_attempts SET outcome = 'lost' WHERE id = 4",
        "UPDATE ferry_attempts SET attempt = -1 WHERE id = 4",
        "UPDATE ferry_attempts SET duration_ms = -1 WHERE id = 4",
        "UPDATE ferry_attempts SET event_id = 99 WHERE id = 4",
    ]
    .into_iter()
    .map(|refused| (refused.to_string(), true))
    .collect();
    statements.extend(
        Status::ALL.map(|s| (format!("UPDATE ferry_events SET status = '{}' WHERE id = 6", s.as_str()), false)),
    );
    statements.extend(
        FailureReason::ALL
            .map(|r| (format!("UPDATE ferry_events SET failure_reason = '{}' WHERE id = 6", r.as_str()), false)),
    );
    statements.extend(
        [AttemptOutcome::Sent, AttemptOutcome::Retry, AttemptOutcome::Failed, AttemptOutcome::Deferred]
            .map(|o| (format!("UPDATE ferry_attempts SET outcome = '{}' WHERE id = 4", o.as_str()), false)),
    );
    for (statement, refused) in statements {
        let result = sqlx::query(&statement).execute(&pool).await;
        assert_eq!(result.is_err(), refused, "{statement}: {result:?}");
    }
    sqlx::query("UPDATE ferry_events SET status = 'PENDING', failure_reason = NULL WHERE id = 6")
        .execute(&pool)
        .await
        .unwrap();
    let unrepresentable =
        "INSERT INTO ferry_events (route, event_type, payload, event_time) VALUES ('r', 't', x'00', 'x')";
    assert!(sqlx::query(unrepresentable).execute(&pool).await.is_err(), "the INSERT trigger is back");

    // The store claims from the rebuilt table, and deleting an event takes its history with it.
    let now = chrono::Utc::now();
    let claimed = store
        .claim(&Claim {
            now,
            limit: 10,
            lease_until: now + chrono::Duration::minutes(1),
            instance: "test".into(),
            token: "after-0009".into(),
            ordered_routes: Vec::new(),
            blocking_routes: Vec::new(),
            paused_routes: Vec::new(),
            only_route: None,
            max_payload: 1 << 20,
        })
        .await
        .unwrap();
    let ids: Vec<i64> = claimed.iter().map(|e| e.id).collect();
    assert_eq!(ids, [4, 6], "the PENDING copy and the new event");
    sqlx::query("DELETE FROM ferry_events WHERE id = 2").execute(&pool).await.unwrap();
    let left: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM ferry_attempts WHERE event_id = 2").fetch_one(&pool).await.unwrap();
    assert_eq!(left, 0, "the foreign key names the new table");
}
