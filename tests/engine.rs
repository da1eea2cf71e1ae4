//! The delivery engine in real time: several instances sharing one PostgreSQL outbox, per-key
//! ordering across instances, LISTEN/NOTIFY wake-ups, graceful shutdown, and a `kill -9` in the
//! middle of a batch.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use ferry::NewEvent;
use ferry::clock::{Clock, SystemClock};
use ferry::event::Status;

use crate::common::{Backend, Running, TestDb, count, deliveries, eventually, plugins_dir};

/// Relay settings for tests that want deliveries to move quickly.
const FAST: &str = "batch_size = 50\npoll_interval = \"10ms\"\nidle_poll_max = \"50ms\"";

/// Config for instance `n`: the scripted plugin on route `s` (unordered) and `o` (ordered),
/// recording successful deliveries to `<dir>/out/i<n>.log`. `relay` holds the `[relay]` keys,
/// `extra` is appended (more routes).
fn instance_config(db: &TestDb, n: usize, relay: &str, extra: &str) -> String {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let out = db.dir.path().join("out");
    format!(
        r#"
        [relay]
        instance_id = "i{n}"
        {relay}
        [plugins]
        dir = {plugins:?}
        timeout = "1s"
        [retry]
        initial = "20ms"
        jitter = "none"
        [sandbox.scripted]
        dirs = {{ "/out" = {out:?} }}
        [route.s]
        plugin = "scripted"
        config = {{ record = "/out/i{n}.log" }}
        [route.o]
        plugin = "scripted"
        ordered = true
        config = {{ record = "/out/i{n}.log" }}
        {extra}
        "#
    )
}

async fn bulk_insert(db: &TestDb, route: &str, n: usize) {
    let pool = db.postgres.as_ref().expect("bulk insert is for PostgreSQL").pool();
    sqlx::query(
        "INSERT INTO ferry_events (route, event_type, payload)
         SELECT $1, 'ok', convert_to(g::text, 'UTF8') FROM generate_series(1, $2) g",
    )
    .bind(route)
    .bind(n as i32)
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_sharing_postgres_deliver_every_event_exactly_once() {
    const EVENTS: usize = 3000;
    let db = TestDb::new(Backend::Postgres).await;
    let mut instances = Vec::new();
    for n in 0..3 {
        instances.push(Running::start(&db.config(&instance_config(&db, n, FAST, ""))).await);
    }
    bulk_insert(&db, "s", EVENTS).await;
    eventually(Duration::from_secs(120), "every event SENT", || async {
        (count(&db.store, Status::Sent).await == EVENTS as u64).then_some(())
    })
    .await;
    for instance in instances {
        instance.stop().await;
    }

    let delivered = deliveries(&db.dir.path().join("out"));
    let mut per_id: HashMap<i64, usize> = HashMap::new();
    for d in &delivered {
        *per_id.entry(d.id).or_default() += 1;
    }
    assert_eq!(per_id.len(), EVENTS, "every event delivered");
    let twice: Vec<_> = per_id.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "delivered more than once without any crash: {twice:?}");
    let busy = (0..3).filter(|n| db.dir.path().join(format!("out/i{n}.log")).exists()).count();
    assert!(busy >= 2, "the work was shared, not done by one instance alone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ordered_keys_stay_in_order_under_retries_and_several_instances() {
    const KEYS: usize = 8;
    const PER_KEY: usize = 25;
    let db = TestDb::new(Backend::Postgres).await;
    // Interleave keys, and make every 4th event fail once so retries are part of the picture.
    let mut emitted: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for i in 0..KEYS * PER_KEY {
        let key = format!("k{}", i % KEYS);
        let kind = if i % 4 == 0 { "flaky" } else { "ok" };
        let id = db.store.insert(&NewEvent::new("o", kind, "{}").with_key(&key), SystemClock.now()).await.unwrap();
        emitted.entry(key).or_default().push(id);
    }
    let mut instances = Vec::new();
    for n in 0..3 {
        instances.push(Running::start(&db.config(&instance_config(&db, n, FAST, ""))).await);
    }
    eventually(Duration::from_secs(120), "every ordered event SENT", || async {
        (count(&db.store, Status::Sent).await == (KEYS * PER_KEY) as u64).then_some(())
    })
    .await;
    for instance in instances {
        instance.stop().await;
    }

    let mut seen: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for d in deliveries(&db.dir.path().join("out")) {
        seen.entry(d.key).or_default().push(d.id);
    }
    assert_eq!(seen, emitted, "each key delivered once per event, in emit order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_notify_wakes_an_idle_relay_at_once() {
    let db = TestDb::new(Backend::Postgres).await;
    // Polling alone would take 30 s: only a notification can explain a fast delivery.
    let config = db.config(&instance_config(&db, 0, "poll_interval = \"30s\"\nidle_poll_max = \"30s\"", ""));
    let running = Running::start(&config).await;
    // Let the relay finish its first (empty) cycle and go idle.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut latencies = Vec::new();
    for _ in 0..3 {
        let start = Instant::now();
        let id = crate::common::emit_in_transaction(&db, &NewEvent::new("s", "ok", "{}"), true).await;
        eventually(Duration::from_secs(10), "the event to be SENT", || async {
            (db.store.get(id).await.unwrap().unwrap().status == Status::Sent).then_some(())
        })
        .await;
        latencies.push(start.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    running.stop().await;
    assert!(latencies.iter().all(|l| *l < Duration::from_secs(5)), "woken by NOTIFY, not by polling: {latencies:?}");
}

/// A resend through ferry wakes idle relays at once, as an insert does: no trigger watches
/// UPDATEs (migration 12), so each resend (of events by id, and of failed events by filter)
/// notifies them itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_wakes_an_idle_relay_at_once() {
    let db = TestDb::new(Backend::Postgres).await;
    let ids = [
        db.store.insert(&NewEvent::new("s", "ok", "{}"), SystemClock.now()).await.unwrap(),
        db.store.insert(&NewEvent::new("s", "ok", "{}"), SystemClock.now()).await.unwrap(),
    ];
    let failed = "UPDATE ferry_events SET status = 'FAILED', failure_reason = 'permanent'";
    sqlx::query(failed).execute(db.postgres.as_ref().unwrap().pool()).await.unwrap();
    // Polling alone would take 30 s: only a notification can explain a fast delivery.
    let config = db.config(&instance_config(&db, 0, "poll_interval = \"30s\"\nidle_poll_max = \"30s\"", ""));
    let running = Running::start(&config).await;
    for (n, id) in ids.into_iter().enumerate() {
        // Idle again, after its first (empty) cycle or the last delivery.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let start = Instant::now();
        if n == 0 {
            assert_eq!(db.store.resend(&[id], SystemClock.now()).await.unwrap(), 1);
        } else {
            let filter = ferry::store::FailedFilter::default();
            assert_eq!(db.store.resend_failed(&filter, SystemClock.now(), 10).await.unwrap(), [id]);
        }
        eventually(Duration::from_secs(10), "the resent event to be SENT", || async {
            (db.store.get(id).await.unwrap().unwrap().status == Status::Sent).then_some(())
        })
        .await;
        assert!(start.elapsed() < Duration::from_secs(5), "woken by resend {n}, not by polling: {:?}", start.elapsed());
    }
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_listen_off_the_relay_only_polls() {
    let db = TestDb::new(Backend::Postgres).await;
    let relay = "poll_interval = \"2s\"\nidle_poll_max = \"2s\"\nlisten = false";
    let config = db.config(&instance_config(&db, 0, relay, ""));
    let running = Running::start(&config).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let start = Instant::now();
    let id = crate::common::emit_in_transaction(&db, &NewEvent::new("s", "ok", "{}"), true).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let early = db.store.get(id).await.unwrap().unwrap().status;
    eventually(Duration::from_secs(10), "the event to be SENT", || async {
        (db.store.get(id).await.unwrap().unwrap().status == Status::Sent).then_some(())
    })
    .await;
    running.stop().await;
    assert_eq!(early, Status::Pending, "no wake-up: the event waits for the next poll");
    assert!(start.elapsed() < Duration::from_secs(5), "the next poll delivers it: {:?}", start.elapsed());
}

async fn one_wake_up_sets_every_worker_to_a_backlog(db: TestDb) {
    const BATCH: u64 = 10;
    // Idle waits of 30 s, and a second per batch: within the test's window the second worker
    // claims only if the first wakes it on finding a full batch.
    let relay = format!("batch_size = {BATCH}\nworkers = 2\npoll_interval = \"30s\"\nidle_poll_max = \"30s\"");
    let base = instance_config(&db, 0, &relay, "")
        .replace("timeout = \"1s\"", "timeout = \"5s\"")
        .replace("config = { record = \"/out/i0.log\" }", "config = { record = \"/out/i0.log\", delay_ms = \"1000\" }");
    let running = Running::start(&db.config(&base)).await;
    let idle = running.registry.metrics().idle_workers.clone();
    eventually(Duration::from_secs(10), "both workers idle after their first, empty cycle", || async {
        (idle.get() == 2).then_some(())
    })
    .await;
    match db.backend {
        // One commit: one notification, which wakes one worker.
        Backend::Postgres => bulk_insert(&db, "s", 4 * BATCH as usize).await,
        // No notifications: an emit in this process wakes one worker.
        Backend::Sqlite => {
            for i in 0..4 * BATCH {
                db.store.insert(&NewEvent::new("s", "ok", format!("{i}")), SystemClock.now()).await.unwrap();
            }
            running.wake();
        }
    }
    eventually(Duration::from_secs(10), "both workers holding a batch", || async {
        (count(&db.store, Status::Processing).await == 2 * BATCH).then_some(())
    })
    .await;
    running.stop().await;
}

async fn shutdown_hands_unfinished_claims_back(db: TestDb) {
    // The plugin takes 5 s per call; shutdown grants 200 ms.
    let slow = "[route.slow]\nplugin = \"scripted\"\nconfig = { delay_ms = \"5000\" }";
    let config = db.config(&instance_config(&db, 0, &format!("{FAST}\nshutdown_grace = \"200ms\""), slow));
    let running = Running::start(&config).await;
    let id = db.store.insert(&NewEvent::new("slow", "ok", "{}"), SystemClock.now()).await.unwrap();
    eventually(Duration::from_secs(10), "the event to be claimed", || async {
        (db.store.get(id).await.unwrap().unwrap().status == Status::Processing).then_some(())
    })
    .await;
    let asked = Instant::now();
    running.stop().await;
    assert!(asked.elapsed() < Duration::from_secs(3), "shutdown waited {:?}", asked.elapsed());
    let row = db.store.get(id).await.unwrap().unwrap();
    assert_eq!(
        (row.status, row.attempts, row.claim_token),
        (Status::Pending, 0, None),
        "handed back, attempt not counted"
    );
}

/// A circuit breaker's half-open probe still running when shutdown's grace period ends is given
/// back with its event, so the next ferry to run probes the route at once. Kept, it would hold
/// the route (no other instance probes it) until the claim's lease ran out, five minutes here.
async fn a_probe_cut_short_by_the_stop_is_given_back(db: TestDb) {
    let slow = "[route.slow]\nplugin = \"scripted\"\nconfig = { delay_ms = \"5000\" }\n\
                [breaker]\nthreshold = 3\ncooldown = \"1s\"";
    let relay = format!("{FAST}\nshutdown_grace = \"200ms\"\nlease = \"5m\"");
    let config = db.config(&instance_config(&db, 0, &relay, slow).replace("timeout = \"1s\"", "timeout = \"10s\""));
    // Opened by three failures a minute ago, so cooled down: the route's next delivery is a probe.
    let opened = SystemClock.now() - chrono::Duration::minutes(1);
    db.store.record_breaker("slow", 3, "the receiver is down", 3, opened).await.unwrap();
    let id = db.store.insert(&NewEvent::new("slow", "ok", "{}"), SystemClock.now()).await.unwrap();
    let breaker = || async { db.store.breakers().await.unwrap().into_iter().find(|b| b.route == "slow").unwrap() };
    let running = Running::start(&config).await;
    eventually(Duration::from_secs(10), "the probe taken and its event claimed", || async {
        let claimed = db.store.get(id).await.unwrap().unwrap().status == Status::Processing;
        (claimed && breaker().await.probe_until.is_some()).then_some(())
    })
    .await;
    running.stop().await;
    let row = db.store.get(id).await.unwrap().unwrap();
    assert_eq!((row.status, row.attempts), (Status::Pending, 0), "the probe's event handed back");
    let b = breaker().await;
    assert!(b.is_open() && b.probe_until.is_none(), "still open, its probe given back: {b:?}");
}

/// A route whose calls are slow holds up no other route: once a batch's deliveries have run a
/// second, the worker records the events of the routes that are done and goes on claiming, and
/// the slow route's deliveries go on beside it, as many at once as the route has instances; past
/// that the route waits on this instance (its events PENDING, no attempt spent) instead of
/// taking workers. Before, every batch waited for its slowest route: here, the other route's
/// events would have waited the whole 30 s of the slow call.
async fn a_slow_route_holds_up_no_other_route(db: TestDb) {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let config = db.config(&format!(
        "[relay]\n{FAST}\nshutdown_grace = \"500ms\"\n[plugins]\ndir = {plugins:?}\ntimeout = \"60s\"\ninstances = 2\n\
         [route.s]\nplugin = \"scripted\"\n[route.slow]\nplugin = \"scripted\"\nconfig = {{ delay_ms = \"30000\" }}\n"
    ));
    let running = Running::start(&config).await;
    let status = |id: i64| {
        let store = db.store.clone();
        async move {
            let row = store.get(id).await.unwrap().unwrap();
            (row.status, row.attempts)
        }
    };
    let aside = running.registry.metrics().deliveries_aside.clone();
    let mut slow = Vec::new();
    for round in 0..3 {
        if round == 2 {
            // Each slow delivery goes on beside the workers once its cycle has waited a second.
            eventually(Duration::from_secs(10), "both slow deliveries aside", || async {
                (aside.get() == 2).then_some(())
            })
            .await;
        }
        // One batch: the slow route's event first, then ten of the other route's.
        slow.push(db.store.insert(&NewEvent::new("slow", "ok", "{}"), SystemClock.now()).await.unwrap());
        let mut fast = Vec::new();
        for i in 0..10 {
            fast.push(db.store.insert(&NewEvent::new("s", "ok", format!("{i}")), SystemClock.now()).await.unwrap());
        }
        running.wake();
        eventually(Duration::from_secs(10), &format!("round {round}: the other route's events SENT"), || async {
            for &id in &fast {
                if status(id).await.0 != Status::Sent {
                    return None;
                }
            }
            Some(())
        })
        .await;
        let expected = match round {
            // Its two instances each deliver one of the slow route's events, still running ...
            0 | 1 => (Status::Processing, 1),
            // ... and its third waits for one of them, not claimed.
            _ => (Status::Pending, 0),
        };
        assert_eq!(status(slow[round]).await, expected, "round {round}");
    }
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(status(slow[2]).await, (Status::Pending, 0), "not claimed while two calls of its route run");
    }
    // Stopping, the deliveries still running get the grace period, then their events are
    // handed back, no attempt counted.
    let asked = Instant::now();
    running.stop().await;
    assert_eq!(aside.get(), 0, "none left aside");
    assert!(asked.elapsed() < Duration::from_secs(5), "shutdown waited {:?}", asked.elapsed());
    for id in slow {
        assert_eq!(status(id).await, (Status::Pending, 0), "event {id} handed back");
    }
}

/// `ferry serve` as a child process, for the crash test.
fn spawn_serve(config: &Path, log: &Path) -> Child {
    Command::new(crate::common::ferry_bin())
        .arg("--config")
        .arg(config)
        .arg("serve")
        .env_remove("FERRY_DATABASE_URL")
        .stdout(Stdio::null())
        .stderr(std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap())
        .spawn()
        .expect("ferry serve starts")
}

async fn kill_9_mid_batch_loses_nothing(db: TestDb) {
    const EVENTS: usize = 300;
    const BATCH: usize = 20;
    // Four workers (the default, set here so the environment cannot change it) and the route's
    // two instances: two workers deliver while two wait for an instance, holding their batches.
    // A batch whose call has waited a second is set aside and its worker claims again, until the
    // route has as many set aside as it has instances; workers that claimed before that count
    // filled set theirs aside too, so up to WORKERS + INSTANCES - 1 batches can be claimed at once.
    const WORKERS: usize = 4;
    const INSTANCES: usize = 2;
    // Slow deliveries (half a second a batch) keep batches in flight nearly all the time, so the
    // kill lands mid-batch even when the machine is busy. The plugin timeout is far above that
    // half second, so no call times out on a loaded machine and is delivered again; the lease is
    // just above the timeout, so the restarted process recovers the killed one's claim soon.
    let relay = format!(
        "batch_size = {BATCH}\nworkers = {WORKERS}\npoll_interval = \"10ms\"\nidle_poll_max = \"50ms\"\nlease = \"6s\""
    );
    let base = instance_config(&db, 0, &relay, "")
        .replace("timeout = \"1s\"", &format!("timeout = \"5s\"\ninstances = {INSTANCES}"))
        .replace("config = { record = \"/out/i0.log\" }", "config = { record = \"/out/i0.log\", delay_ms = \"500\" }");
    let config_path = db.dir.path().join("ferry.toml");
    std::fs::write(&config_path, format!("[database]\nurl = {:?}\n{base}", db.url)).unwrap();
    let mut ids = Vec::with_capacity(EVENTS);
    for i in 0..EVENTS {
        ids.push(db.store.insert(&NewEvent::new("s", "ok", format!("{i}")), SystemClock.now()).await.unwrap());
    }

    let log = db.dir.path().join("serve.log");
    // The workers deliver in step, so their batches can all commit between the look that saw
    // one in flight and the kill (on a busy machine, some milliseconds). Such a kill strands
    // nothing and tests nothing: the process is started and killed again, a few times at most
    // (each try delivers some sixty events of the 300).
    let mut stranded = BTreeSet::new();
    for _ in 0..4 {
        let mut first = spawn_serve(&config_path, &log);
        eventually(Duration::from_secs(60), "a batch in flight after some deliveries", || async {
            let c = db.store.counts().await.unwrap();
            (c[&Status::Sent] >= 3 * BATCH as u64 && c[&Status::Processing] > 0).then_some(())
        })
        .await;
        first.kill().expect("SIGKILL");
        first.wait().unwrap();
        for &id in &ids {
            if db.store.get(id).await.unwrap().unwrap().status == Status::Processing {
                stranded.insert(id);
            }
        }
        if !stranded.is_empty() {
            break;
        }
    }
    assert!(!stranded.is_empty(), "the kill left a claimed batch behind");
    let most = (WORKERS + INSTANCES - 1) * BATCH;
    assert!(stranded.len() <= most, "at most {most} events are claimed at once, {} were stranded", stranded.len());

    let mut second = spawn_serve(&config_path, &log);
    eventually(Duration::from_secs(90), "every event SENT after the restart", || async {
        (count(&db.store, Status::Sent).await == EVENTS as u64).then_some(())
    })
    .await;
    assert!(Command::new("kill").args(["-TERM", &second.id().to_string()]).status().unwrap().success());
    second.wait().unwrap();

    let c = db.store.counts().await.unwrap();
    assert_eq!((c[&Status::Pending], c[&Status::Processing], c[&Status::Failed]), (0, 0, 0));
    let mut attempts: BTreeMap<i64, Vec<u32>> = BTreeMap::new();
    for d in deliveries(&db.dir.path().join("out")) {
        attempts.entry(d.id).or_default().push(d.attempt);
    }
    assert_eq!(attempts.len(), EVENTS, "every event delivered at least once");
    let log = std::fs::read_to_string(&log).unwrap();
    // Only an event claimed at the kill may have been delivered twice: its delivery may have
    // happened before the kill, its completion not.
    let unexplained: Vec<_> = attempts.iter().filter(|(id, seen)| seen.len() > 1 && !stranded.contains(*id)).collect();
    assert!(
        unexplained.is_empty(),
        "delivered more than once though not claimed at the kill (id, attempts): {unexplained:?}\n\
         stranded: {stranded:?}\nlog:\n{log}"
    );
    assert!(log.contains("claim lease expired"), "recovery is logged: {log}");
}

crate::both_backends!(
    one_wake_up_sets_every_worker_to_a_backlog,
    shutdown_hands_unfinished_claims_back,
    a_probe_cut_short_by_the_stop_is_given_back,
    a_slow_route_holds_up_no_other_route,
    kill_9_mid_batch_loses_nothing
);
