//! Attacks on the host that do not need a special plugin build: a poison event in a batch,
//! oversized payloads, plugins that flood reasons and logs, files that lie about their name or are
//! not files, plugins that stall `init`, an admin client that holds connections, a reader that
//! closes the pipe, and commands pointed at paths that do not exist. Each test is the attack that
//! succeeded before its defence; each asserts the defence and that everything else keeps working.

use std::io::{Read as _, Write as _};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry::NewEvent;
use ferry::clock::{Clock as _, SystemClock};
use ferry::event::{FailureReason, Status};
use ferry::service::Ferry;
use tokio_util::sync::CancellationToken;
use tracing::instrument::WithSubscriber as _;

use crate::common::{Backend, Captured, Stepped, TestDb, built_plugin, plugins_dir};
use crate::e2e::run_ferry;

/// Ferry on a manual clock with the scripted plugin on route `s` (300 ms timeout, breaker
/// threshold 3) plus `extra` config.
async fn stepped(extra: &str) -> Stepped {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let config = format!(
        "[plugins]\ndir = {plugins:?}\ntimeout = \"300ms\"\n[breaker]\nthreshold = 3\n[route.s]\nplugin = \"scripted\"\n{extra}"
    );
    Stepped::start(db, &config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_event_is_isolated_and_only_it_is_charged() {
    for poison in ["trap", "hog", "spin"] {
        let s = stepped("[retry]\njitter = \"none\"\n").await;
        let mut batch: Vec<NewEvent> = (0..9).map(|_| NewEvent::new("s", "ok", "{}")).collect();
        batch.insert(6, NewEvent::new("s", poison, "{}"));
        let rows = s.deliver(&batch).await;
        for (i, row) in rows.iter().enumerate() {
            if i == 6 {
                assert_eq!((row.status, row.attempts), (Status::Pending, 1), "{poison}: the poison waits for a retry");
                assert!(row.last_error.as_deref().is_some_and(|e| e.contains("plugin")), "{poison}: {row:?}");
            } else {
                assert_eq!(row.status, Status::Sent, "{poison}: event {i} is delivered in spite of its neighbour");
            }
        }
        let history = s.db.store.attempts(rows[6].id).await.unwrap();
        assert_eq!(history.len(), 1, "{poison}: one attempt charged to the poison event");
        let breakers = s.db.store.breakers().await.unwrap();
        assert!(
            breakers.iter().all(|b| b.opened_at.is_none() && b.consecutive_failures <= 1),
            "{poison}: the breaker counts the fault once at most: {breakers:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_hears_of_a_poison_event_once() {
    let s = stepped("[retry]\njitter = \"none\"\n").await;
    // Permanent failures say nothing about the endpoint; before bisection the trap charged all
    // five events, and three failures open this breaker.
    let mut batch: Vec<NewEvent> = (0..4).map(|_| NewEvent::new("s", "permanent", "{}")).collect();
    batch.push(NewEvent::new("s", "trap", "{}"));
    let rows = s.deliver(&batch).await;
    assert!(rows[..4].iter().all(|r| r.failure_reason == Some(FailureReason::Permanent)), "{rows:?}");
    assert_eq!(rows[4].status, Status::Pending);
    let breakers = s.db.store.breakers().await.unwrap();
    assert_eq!(breakers.len(), 1);
    assert_eq!((breakers[0].consecutive_failures, breakers[0].opened_at), (1, None), "{breakers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payloads_over_the_limit_are_refused_at_emit_and_failed_alone_at_claim() {
    let s = stepped("[relay]\nmax_payload = \"4KiB\"\n").await;
    // A row inserted by SQL, bypassing every emit path, is not even loaded.
    let pool = s.db.sqlite.as_ref().unwrap().pool();
    let big = vec![b'x'; 64 << 10];
    sqlx::query("INSERT INTO ferry_events (route, event_type, payload, next_attempt_at) VALUES ('s', 'big', ?, ?)")
        .bind(&big)
        .bind(s.clock.now().timestamp_millis())
        .execute(pool)
        .await
        .unwrap();
    let rows = s.deliver(&[NewEvent::new("s", "ok", "{}")]).await;
    assert_eq!(rows[0].status, Status::Sent, "the small event beside it is delivered");
    let failed = s.db.store.list_failed(&Default::default(), 10).await.unwrap();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0].failure_reason, Some(FailureReason::InvalidEvent));
    let error = failed[0].last_error.clone().unwrap();
    assert!(error.contains("65536 bytes") && error.contains("relay.max_payload"), "{error}");

    // The CLI refuses a big file without reading it all; the operation names the limit.
    let config = s.db.dir.path().join("cli.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = {:?}\n[relay]\nmax_payload = \"4KiB\"\n[route.s]\nplugin = \"scripted\"\n",
            s.db.url
        ),
    )
    .unwrap();
    let file = s.db.dir.path().join("big.json");
    std::fs::write(&file, &big).unwrap();
    let (code, _, err) = run_ferry(&config, &["emit", "s", "big", "--file", file.to_str().unwrap()]);
    assert_eq!(code, Some(1));
    assert!(err.contains("65536 bytes") && err.contains("relay.max_payload"), "{err}");
    // A source without a size is read only up to the limit; the operation refuses it.
    let (code, _, err) = run_ferry(&config, &["emit", "s", "big", "--file", "/dev/zero"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("4097 bytes") && err.contains("relay.max_payload"), "{err}");
    let (code, _, err) = run_ferry(&config, &["emit", "s", "big", &"y".repeat(5000)]);
    assert_eq!(code, Some(1));
    assert!(err.contains("5000 bytes") && err.contains("relay.max_payload"), "{err}");

    // An application's emit refuses more than the default limit.
    let mut conn = pool.acquire().await.unwrap();
    let huge = NewEvent::new("s", "big", vec![0u8; ferry_outbox::DEFAULT_MAX_PAYLOAD + 1]);
    let refused = ferry::emit(&mut *conn, &huge).await.unwrap_err().to_string();
    assert!(refused.contains("relay.max_payload"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasons_and_log_lines_from_a_plugin_are_bounded_and_cannot_forge_lines() {
    let s = stepped("").await;
    let log = Captured::default();
    let flood = NewEvent::new("s", "long-reason", "{}").with_header("bytes", (20 << 20).to_string());
    let forged = "line\n2026-01-01T00:00:00Z ERROR ferry: forged \u{1b}[2J";
    let chatty = NewEvent::new("s", "log", "{}")
        .with_header("message", format!("{forged}{}", "z".repeat(60_000)))
        .with_header("times", "3");
    let rows = async { s.deliver(&[flood, chatty]).await }.with_subscriber(log.subscriber()).await;
    let reason = rows[0].last_error.clone().unwrap();
    assert_eq!(rows[0].status, Status::Failed);
    assert!(reason.len() <= ferry::untrusted::MAX_REASON + 64, "{} bytes stored", reason.len());
    assert!(!reason.contains('\n') && !reason.contains('\u{1b}') && reason.contains("\\n"), "{reason:.200}");
    assert!(reason.contains("more bytes"), "the cut says so");
    let text = log.text();
    let plugin_lines: Vec<&str> = text.lines().filter(|l| l.contains("plugin=")).collect();
    assert_eq!(plugin_lines.len(), 3, "one line per message: {:?}", &plugin_lines);
    assert!(text.lines().all(|l| !l.starts_with("2026-01-01T00:00:00Z")), "no line is forged");
    assert!(plugin_lines.iter().all(|l| l.len() < ferry::untrusted::MAX_LOG_LINE + 512), "bounded");
    assert_eq!(rows[1].status, Status::Sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_file_cannot_take_another_plugins_name() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    // Sorts first and reports the name `scripted`: it would get route s's config and grants.
    std::fs::copy(built_plugin("ferry_test_scripted"), plugins.join("aaa.wasm")).unwrap();
    let config = db.config(&format!("[plugins]\ndir = {plugins:?}\n[route.s]\nplugin = \"scripted\"\n"));
    let ferry = Ferry::start(&config, Arc::new(SystemClock)).await.unwrap();
    let (loaded, errors) = ferry.registry.status();
    assert_eq!(loaded.iter().map(|p| p.file.clone()).collect::<Vec<_>>(), vec![plugins.join("scripted.wasm")]);
    let refused = &errors[&plugins.join("aaa.wasm")];
    assert!(refused.contains("\"scripted\"") && refused.contains("install it as scripted.wasm"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifos_devices_and_huge_files_in_the_plugins_directory_are_refused_at_once() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let fifo = plugins.join("fifo.wasm");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    std::os::unix::fs::symlink("/dev/zero", plugins.join("zero.wasm")).unwrap();
    std::fs::write(plugins.join("huge.wasm"), vec![0u8; 2 << 20]).unwrap();
    let config = db
        .config(&format!("[plugins]\ndir = {plugins:?}\nmax_file_size = \"1MiB\"\n[route.s]\nplugin = \"scripted\"\n"));
    let started = Instant::now();
    let ferry = tokio::time::timeout(Duration::from_secs(30), Ferry::start(&config, Arc::new(SystemClock)))
        .await
        .expect("start-up is not held by a FIFO or /dev/zero")
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(20));
    let (_, errors) = ferry.registry.status();
    for (file, why) in
        [("fifo.wasm", "not a regular file"), ("zero.wasm", "not a regular file"), ("huge.wasm", "max_file_size")]
    {
        let error = &errors[&plugins.join(file)];
        assert!(error.contains(why), "{file}: {error}");
    }
    // A reload (what the watcher and the API do) returns too, and the real plugin still works.
    tokio::time::timeout(Duration::from_secs(10), ferry.registry.reload(&fifo)).await.unwrap().unwrap_err();
    let id = ferry.store.insert(&NewEvent::new("s", "ok", "{}"), SystemClock.now()).await.unwrap();
    ferry.relay.cycle(&CancellationToken::new()).await.unwrap();
    assert_eq!(ferry.store.get(id).await.unwrap().unwrap().status, Status::Sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_stalls_in_init_cannot_stall_start_up() {
    for mode in ["sleep", "spin"] {
        let db = TestDb::new(Backend::Sqlite).await;
        let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
        let config = db.config(&format!(
            "[plugins]\ndir = {plugins:?}\ntimeout = \"300ms\"\n[route.stall]\nplugin = \"scripted\"\nconfig = {{ init = \"{mode}\" }}\n[route.s]\nplugin = \"scripted\"\n"
        ));
        let started = Instant::now();
        let ferry = tokio::time::timeout(Duration::from_secs(20), Ferry::start(&config, Arc::new(SystemClock)))
            .await
            .unwrap_or_else(|_| panic!("{mode}: start-up waited on init"))
            .unwrap();
        assert!(started.elapsed() < Duration::from_secs(10), "{mode}: {:?}", started.elapsed());
        let ok = ferry.store.insert(&NewEvent::new("s", "ok", "{}"), SystemClock.now()).await.unwrap();
        let stalled = ferry.store.insert(&NewEvent::new("stall", "ok", "{}"), SystemClock.now()).await.unwrap();
        tokio::time::timeout(Duration::from_secs(20), ferry.relay.cycle(&CancellationToken::new()))
            .await
            .unwrap_or_else(|_| panic!("{mode}: a cycle waited on init"))
            .unwrap();
        assert_eq!(ferry.store.get(ok).await.unwrap().unwrap().status, Status::Sent, "{mode}: other routes flow");
        let stalled = ferry.store.get(stalled).await.unwrap().unwrap();
        assert!(stalled.last_error.unwrap_or_default().contains("init"), "{mode}: the reason names init");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_whose_metadata_never_answers_is_refused_after_the_deadline() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    std::fs::copy(built_plugin("ferry_test_stall"), plugins.join("stall.wasm")).unwrap();
    let config =
        db.config(&format!("[plugins]\ndir = {plugins:?}\ntimeout = \"300ms\"\n[route.s]\nplugin = \"scripted\"\n"));
    let started = Instant::now();
    let ferry = tokio::time::timeout(Duration::from_secs(20), Ferry::start(&config, Arc::new(SystemClock)))
        .await
        .expect("start-up does not wait for metadata()")
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    let (loaded, errors) = ferry.registry.status();
    assert_eq!(loaded.len(), 1, "the other plugin loaded");
    let refused = &errors[&plugins.join("stall.wasm")];
    assert!(refused.contains("metadata()") && refused.contains("did not answer"), "{refused}");
}

#[test]
fn serve_stops_on_sigterm_while_a_plugin_stalls_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let plugins = plugins_dir(dir.path(), &["ferry_test_scripted"]);
    let config = dir.path().join("ferry.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"sqlite://{}/f.db\"\n[relay]\nlease = \"5m\"\n[plugins]\ndir = {plugins:?}\ntimeout = \"120s\"\n[route.stall]\nplugin = \"scripted\"\nconfig = {{ init = \"sleep\" }}\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let mut serve = crate::common::spawn_serve(&config, &dir.path().join("serve.log"));
    // The database is opened before the plugins load: once it exists, start-up is in init.
    let opened = Instant::now() + Duration::from_secs(15);
    while !dir.path().join("f.db").exists() {
        assert!(Instant::now() < opened, "ferry serve never opened its database");
        std::thread::sleep(Duration::from_millis(20));
    }
    let sent = Instant::now();
    assert!(std::process::Command::new("kill").args(["-TERM", &serve.id().to_string()]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = serve.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "ferry serve ignored SIGTERM while init stalled");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(sent.elapsed() < Duration::from_secs(10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_admin_clients_cannot_hold_the_server() {
    let s = stepped(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"a-token-of-sixteen-chars\"\nmax_connections = 8\nheader_timeout = \"500ms\"\n",
    )
    .await;
    let shutdown = CancellationToken::new();
    let (address, _task) = s.ferry.admin().unwrap().serve(shutdown.clone()).await.unwrap();
    // Half a request, then nothing: closed once the header timeout passes.
    let mut slow = std::net::TcpStream::connect(address).unwrap();
    slow.write_all(b"GET /health/live HTTP/1.1\r\nHost: x\r\n").unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let started = Instant::now();
    let mut buf = [0u8; 512];
    let n = slow.read(&mut buf).unwrap_or(0);
    let answer = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(started.elapsed() < Duration::from_secs(4), "the half-sent request was dropped in time");
    assert!(n == 0 || answer.contains("408"), "closed (or 408) after the header timeout: {answer:?}");

    // Many idle connections: past the cap they are closed at once.
    let idle: Vec<std::net::TcpStream> = (0..40).map(|_| std::net::TcpStream::connect(address).unwrap()).collect();
    let mut closed = 0;
    for mut connection in idle {
        connection.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        if matches!(connection.read(&mut buf), Ok(0)) {
            closed += 1;
        }
    }
    assert!(closed >= 32, "connections past admin.max_connections are closed at once ({closed} of 40)");
    // Once the idle ones time out, the API answers again; deliveries went on meanwhile.
    let rows = s.deliver(&[NewEvent::new("s", "ok", "{}")]).await;
    assert_eq!(rows[0].status, Status::Sent);
    crate::common::eventually(Duration::from_secs(10), "the API answers again", || async {
        let mut c = std::net::TcpStream::connect(address).ok()?;
        c.write_all(b"GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
        let mut answer = String::new();
        c.read_to_string(&mut answer).ok()?;
        answer.starts_with("HTTP/1.1 200").then_some(())
    })
    .await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_closes_the_pipe_ends_the_command_quietly() {
    let s = stepped("").await;
    let id = s.db.store.insert(&NewEvent::new("s", "ok", vec![b'p'; 900 << 10]), s.clock.now()).await.unwrap();
    let config = s.db.dir.path().join("cli.toml");
    std::fs::write(&config, format!("[database]\nurl = {:?}\n", s.db.url)).unwrap();
    let ferry = crate::common::ferry_bin();
    let script = format!(
        "set -o pipefail; {ferry:?} --config {config:?} show {id} | head -c 10 >/dev/null",
        ferry = ferry.display().to_string(),
        config = config.display().to_string()
    );
    let out = std::process::Command::new("bash").arg("-c").arg(&script).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn read_only_commands_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("typo").join("ferry.db");
    let config = dir.path().join("ferry.toml");
    let out_dir = dir.path().join("not-yet");
    let plugins = plugins_dir(dir.path(), &["ferry_transport_log"]);
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"sqlite://{}\"\n[plugins]\ndir = {plugins:?}\n[sandbox.log]\ndirs = {{ \"/out\" = {out_dir:?} }}\n[route.r]\nplugin = \"log\"\nconfig = {{ output = \"/out/r.jsonl\" }}\n",
            missing.display()
        ),
    )
    .unwrap();
    for args in [&["status"][..], &["failed", "count"], &["emit", "r", "t", "{}"], &["show", "1"]] {
        let (code, _, err) = run_ferry(&config, args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains(&missing.display().to_string()) && err.contains("ferry migrate"), "{args:?}: {err}");
    }
    assert!(!missing.parent().unwrap().exists(), "no directory was created");
    let (code, out, err) = run_ferry(&config, &["plugins", "list"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(!out_dir.exists(), "plugins list does not create granted directories: {out}");
    let (code, _, err) = run_ferry(&config, &["migrate"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(missing.is_file(), "migrate creates the database");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_reports_a_wedged_relay() {
    let db = TestDb::new(Backend::Postgres).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let config = db.config(&format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"a-token-of-sixteen-chars\"\n[relay]\nlease = \"2s\"\npoll_interval = \"50ms\"\nidle_poll_max = \"100ms\"\n[plugins]\ndir = {plugins:?}\ntimeout = \"300ms\"\n[route.s]\nplugin = \"scripted\"\n"
    ));
    let ferry = Ferry::start(&config, Arc::new(SystemClock)).await.unwrap();
    let shutdown = CancellationToken::new();
    let (address, _api) = ferry.admin().unwrap().serve(shutdown.clone()).await.unwrap();
    let ready = || async move {
        let response = reqwest::get(format!("http://{address}/health/ready")).await.unwrap();
        let status = response.status().as_u16();
        (status, response.json::<serde_json::Value>().await.unwrap())
    };
    let pool = db.postgres.as_ref().unwrap().pool().clone();
    let relay = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { ferry.relay.run(shutdown).await }
    });
    crate::common::eventually(Duration::from_secs(10), "ready", || async { (ready().await.0 == 200).then_some(()) })
        .await;
    // An operator's transaction holds the outbox: every claim waits on it.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE ferry_events IN ACCESS EXCLUSIVE MODE").execute(&mut *tx).await.unwrap();
    let (_, body) = crate::common::eventually(Duration::from_secs(15), "not ready", || async {
        let answer = ready().await;
        (answer.0 == 503).then_some(answer)
    })
    .await;
    assert!(body["relay"].as_str().unwrap().contains("relay.lease"), "{body}");
    tx.rollback().await.unwrap();
    crate::common::eventually(Duration::from_secs(10), "ready again", || async {
        (ready().await.0 == 200).then_some(())
    })
    .await;
    shutdown.cancel();
    relay.await.unwrap();
}
