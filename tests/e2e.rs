//! End to end: the real `log` plugin compiled from `plugins/log`, a real database, events in,
//! JSON lines out. Once in-process and once through the `ferry` binary and its CLI.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ferry::NewEvent;
use ferry::clock::{Clock, SystemClock};
use ferry::event::Status;
use ferry::service::Ferry;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::common::{TestDb, emit_in_transaction, eventually, plugins_dir};

/// The plugin's pure line writer, compiled here too so its unit tests run.
#[path = "../plugins/log/src/line.rs"]
mod line;

/// Config for the log plugin writing to `<dir>/out/orders.jsonl`, on an ordered route.
fn log_config(db: &TestDb) -> String {
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_log"]);
    let out = db.dir.path().join("out");
    format!(
        r#"
        [relay]
        poll_interval = "20ms"
        [plugins]
        dir = {plugins:?}
        [sandbox.log]
        dirs = {{ "/out" = {out:?} }}
        [route.orders]
        plugin = "log"
        config = {{ output = "/out/orders.jsonl" }}
        # The tests check emit order per key, which ferry promises on ordered routes only.
        ordered = true
        "#
    )
}

/// The JSON lines the log plugin has written so far.
fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect()
}

async fn events_flow_through_the_log_plugin(db: TestDb) {
    let config = db.config(&log_config(&db));
    let ferry = Ferry::start(&config, Arc::new(SystemClock)).await.expect("ferry starts");
    let store = ferry.store.clone();
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { ferry.relay.run(shutdown).await }
    });

    let json = NewEvent::new("orders", "order.created", r#"{"order":1}"#).with_key("c-7").with_header("tenant", "acme");
    let a = emit_in_transaction(&db, &json, true).await;
    emit_in_transaction(&db, &NewEvent::new("orders", "order.created", r#"{"order":"ghost"}"#), false).await;
    let text = NewEvent::new("orders", "note", "plain text").with_content_type("text/plain");
    let b = emit_in_transaction(&db, &text, true).await;
    let binary = NewEvent::new("orders", "blob", vec![0xff, 0x00, 0x10]).with_content_type("application/octet-stream");
    let c = store.insert(&binary, SystemClock.now()).await.unwrap();

    let out = db.dir.path().join("out/orders.jsonl");
    let written = eventually(Duration::from_secs(20), "3 delivered lines", || async {
        let l = lines(&out);
        (l.len() >= 3).then_some(l)
    })
    .await;
    shutdown.cancel();
    relay.await.unwrap();

    let by_id = |id: i64| written.iter().find(|l| l["id"] == id).unwrap_or_else(|| panic!("event {id} not delivered"));
    let first = by_id(a);
    assert_eq!(first["type"], "order.created");
    assert_eq!(first["route"], "orders");
    assert_eq!(first["key"], "c-7");
    assert_eq!(first["attempt"], 1);
    assert_eq!(first["headers"]["tenant"], "acme");
    assert_eq!(first["payload"]["order"], 1, "a JSON payload is embedded as JSON");
    assert_eq!(by_id(b)["payload"], "plain text");
    assert_eq!(by_id(c)["payload_base64"], "/wAQ");
    assert_eq!(written.len(), 3, "nothing delivered twice, nothing extra: {written:?}");
    assert!(written.iter().all(|l| l["payload"]["order"] != "ghost"), "a rolled-back event is never delivered");

    let counts = store.counts().await.unwrap();
    assert_eq!((counts[&Status::Sent], counts[&Status::Pending], counts[&Status::Processing]), (3, 0, 0));
    let sent = store.get(a).await.unwrap().unwrap();
    assert!(sent.processed_at.unwrap() >= sent.created_at);
}

async fn the_binary_serves_emits_reports_and_stops_on_sigterm(db: TestDb) {
    let config_path = db.dir.path().join("ferry.toml");
    std::fs::write(&config_path, format!("[database]\nurl = {:?}\n{}", db.url, log_config(&db))).unwrap();
    let ferry = |args: &[&str]| {
        let mut cmd = Command::new(crate::common::ferry_bin());
        cmd.arg("--config").arg(&config_path).args(args).env_remove("FERRY_DATABASE_URL");
        cmd
    };
    let log_path = db.dir.path().join("serve.log");
    let mut serve = ferry(&["serve"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .expect("ferry serve starts");

    let mut ids = Vec::new();
    for n in 0..3 {
        let out =
            ferry(&["emit", "orders", "order.created", &format!(r#"{{"n":{n}}}"#), "--key", "k"]).output().unwrap();
        assert!(out.status.success(), "emit failed: {}", String::from_utf8_lossy(&out.stderr));
        ids.push(String::from_utf8(out.stdout).unwrap().trim().parse::<i64>().expect("emit prints the id"));
    }
    let bad = ferry(&["emit", "orders", "order.created"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no payload"));

    let out = db.dir.path().join("out/orders.jsonl");
    eventually(Duration::from_secs(30), "3 lines from ferry serve", || async {
        (lines(&out).len() >= 3).then_some(())
    })
    .await;
    let delivered: Vec<i64> = lines(&out).iter().map(|l| l["id"].as_i64().unwrap()).collect();
    assert_eq!(delivered, ids, "delivered once each, in emit order");

    let status = ferry(&["status", "--json"]).output().unwrap();
    let status: Value = serde_json::from_slice(&status.stdout).expect("status --json prints JSON");
    assert_eq!(status["SENT"], 3);

    let pid = serve.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let exit = eventually(Duration::from_secs(20), "ferry serve to exit", || {
        let status = serve.try_wait().unwrap();
        async move { status }
    })
    .await;
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(exit.success(), "ferry serve exited with {exit}: {log}");
    assert!(log.contains("relay stopped"), "{log}");
    assert!(log.contains("plugin=\"log\"") || log.contains("plugin=log"), "plugin log lines are tagged: {log}");
}

crate::both_backends!(events_flow_through_the_log_plugin, the_binary_serves_emits_reports_and_stops_on_sigterm);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_emits_from_files_and_stdin_defers_and_resends() {
    use std::io::Write as _;
    let db = TestDb::new(crate::common::Backend::Sqlite).await;
    let config_path = db.dir.path().join("ferry.toml");
    // Events go to configured routes only.
    std::fs::write(&config_path, format!("[database]\nurl = {:?}\n[route.r]\nplugin = \"log\"\n", db.url)).unwrap();
    let ferry = |args: &[&str]| {
        let mut cmd = Command::new(crate::common::ferry_bin());
        cmd.arg("--config").arg(&config_path).args(args).env_remove("FERRY_DATABASE_URL");
        cmd
    };
    let id_of = |out: std::process::Output| -> i64 {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().trim().parse().unwrap()
    };
    assert!(ferry(&["migrate"]).output().unwrap().status.success());

    let file = db.dir.path().join("payload.bin");
    std::fs::write(&file, [1u8, 2, 3]).unwrap();
    let from_file = id_of(ferry(&["emit", "r", "t", "--file"]).arg(&file).output().unwrap());
    assert_eq!(store_payload(&db, from_file).await, vec![1, 2, 3]);

    let mut child = ferry(&["emit", "r", "t", "-", "--header", "a=b"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"from stdin").unwrap();
    let from_stdin = id_of(child.wait_with_output().unwrap());
    assert_eq!(store_payload(&db, from_stdin).await, b"from stdin");
    assert_eq!(db.store.get(from_stdin).await.unwrap().unwrap().headers, r#"{"a":"b"}"#);

    let deferred = id_of(ferry(&["emit", "r", "t", "{}", "--delay", "5m"]).output().unwrap());
    let row = db.store.get(deferred).await.unwrap().unwrap();
    assert_eq!(row.next_attempt_at - row.created_at, chrono::Duration::minutes(5));

    let bad = ferry(&["emit", "r", "t", "{}", "--header", "no-equals"]).output().unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("NAME=VALUE"));
    let bad = ferry(&["emit", "r", "t", "{}", "--delay", "soon"]).output().unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("soon"));

    // Resend: only FAILED events, and saying so when some are not.
    let claim = ferry::store::Claim {
        now: SystemClock.now() + chrono::Duration::seconds(1),
        limit: 1,
        lease_until: SystemClock.now() + chrono::Duration::minutes(5),
        instance: "test".into(),
        token: "tok".into(),
        ordered_routes: vec![],
        blocking_routes: vec![],
        paused_routes: vec![],
        only_route: None,
        max_payload: 1 << 20,
    };
    let claimed = db.store.claim(&claim).await.unwrap();
    let failed = ferry::event::Completion {
        id: claimed[0].id,
        disposition: ferry::event::Disposition::Failed {
            reason: ferry::event::FailureReason::Permanent,
            error: "x".into(),
        },
        max_attempts: 6,
        attempt: Default::default(),
        dead_letter: None,
    };
    db.store.complete("tok", SystemClock.now(), &[failed]).await.unwrap();
    let resent = ferry(&["resend", &claimed[0].id.to_string()]).output().unwrap();
    assert!(resent.status.success(), "{}", String::from_utf8_lossy(&resent.stderr));
    assert_eq!(db.store.get(claimed[0].id).await.unwrap().unwrap().status, Status::Pending);
    let not_failed = ferry(&["resend", &deferred.to_string()]).output().unwrap();
    assert_eq!(not_failed.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&not_failed.stderr).contains("not FAILED"));
}

async fn store_payload(db: &TestDb, id: i64) -> Vec<u8> {
    db.store.get(id).await.unwrap().unwrap().payload
}

#[test]
fn environment_overrides_reach_the_binary_and_bad_ones_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let config_path = dir.path().join("ferry.toml");
    std::fs::write(&config_path, "[plugins]\ndir = \"not-here\"\n").unwrap();
    let plugins = crate::common::plugins_dir(dir.path(), &["ferry_transport_log"]);
    let ferry = |env: &[(&str, &str)]| {
        let mut cmd = Command::new(crate::common::ferry_bin());
        cmd.arg("--config").arg(&config_path).args(["plugins", "list", "--json"]);
        cmd.envs(env.iter().copied()).output().unwrap()
    };
    // FERRY_PLUGINS_DIR wins over the file.
    let out = ferry(&[("FERRY_PLUGINS_DIR", plugins.to_str().unwrap())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["plugins"][0]["name"], "log");

    // With --json the error is a JSON object on standard output.
    let out = ferry(&[("FERRY_PLUGINS_INSTANCES", "several")]);
    assert_eq!(out.status.code(), Some(1));
    let error = String::from_utf8_lossy(&out.stdout);
    assert!(error.contains("environment variable FERRY_PLUGINS_INSTANCES: plugins.instances:"), "{error}");
    let out = ferry(&[("FERRY_PLUGIN_DIR", "x")]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("FERRY_PLUGIN_DIR is not a setting ferry knows"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_switch_breakers_from_the_cli() {
    let db = TestDb::new(crate::common::Backend::Sqlite).await;
    let config_path = db.dir.path().join("ferry.toml");
    std::fs::write(&config_path, format!("[database]\nurl = {:?}\n[route.r]\nplugin = \"log\"\n", db.url)).unwrap();
    let ferry = |args: &[&str]| run_ferry(&config_path, &[&["breaker"], args].concat());
    let (code, stdout, stderr) = ferry(&["open", "r", "--reason", "receiver maintenance"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stdout.trim(), "breaker of route r: open until closed by hand");
    let (_, table, _) = ferry(&["list"]);
    assert!(table.contains("open (by hand)") && table.contains("receiver maintenance"), "{table}");
    let (_, json, _) = ferry(&["list", "--json"]);
    let list: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!((list[0]["route"].as_str(), list[0]["state"].as_str()), (Some("r"), Some("open")));
    assert_eq!(list[0]["manual"], true);
    let breaker = db.store.breakers().await.unwrap();
    assert!(breaker[0].opened_at.is_some(), "the CLI wrote to the shared table");

    let (code, stdout, _) = ferry(&["close", "r"]);
    assert_eq!((code, stdout.trim()), (Some(0), "breaker of route r: closed"));
    let (_, json, _) = ferry(&["list", "--json"]);
    assert_eq!(serde_json::from_str::<serde_json::Value>(&json).unwrap()[0]["state"], "closed");
    let (code, _, stderr) = ferry(&["open", " "]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("the route name must not be empty"), "{stderr}");
    let (code, _, stderr) = ferry(&["open"]);
    assert_eq!(code, Some(2), "clap's usage error");
    assert!(stderr.contains("<ROUTE>"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_count_list_show_resend_and_purge_failed_events() {
    let db = TestDb::new(crate::common::Backend::Sqlite).await;
    let ids = crate::store::failed_fixture(&db).await;
    let config_path = db.dir.path().join("ferry.toml");
    std::fs::write(&config_path, format!("[database]\nurl = {:?}\n", db.url)).unwrap();
    let ferry = |args: &[&str]| run_ferry(&config_path, args);

    assert_eq!(ferry(&["failed", "count"]).1.trim(), "6");
    let (_, json, _) = ferry(&["failed", "count", "--route", "a", "--type", "x", "--json"]);
    assert_eq!(serde_json::from_str::<Value>(&json).unwrap()["failed"], 2);
    let (_, json, _) =
        ferry(&["failed", "count", "--from", "2026-03-01T12:01:00Z", "--before", "2026-03-01T12:04:00Z", "--json"]);
    assert_eq!(serde_json::from_str::<Value>(&json).unwrap()["failed"], 3);

    // A page of two, then the next.
    let (_, json, _) = ferry(&["failed", "list", "--limit", "2", "--json"]);
    let page: Value = serde_json::from_str(&json).unwrap();
    assert_eq!(page["events"].as_array().unwrap().len(), 2);
    assert_eq!(page["next_after"], ids[1]);
    let (_, table, _) = ferry(&["failed", "list", "--after", &ids[1].to_string(), "--limit", "2"]);
    assert!(table.contains(&ids[2].to_string()) && table.contains("rejected"), "{table}");
    assert!(table.contains(&format!("more: --after {}", ids[3])), "{table}");

    let (code, text, _) = ferry(&["show", &ids[0].to_string()]);
    assert_eq!(code, Some(0));
    assert!(text.contains("status        FAILED") && text.contains("last error    rejected"), "{text}");
    let (code, _, stderr) = ferry(&["show", "999999"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("no event with id 999999"), "{stderr}");

    // Bulk operations need a filter or --all; bad input is named.
    let (code, _, stderr) = ferry(&["failed", "resend"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("no filter given") && stderr.contains("--all"), "{stderr}");
    let (code, _, stderr) = ferry(&["failed", "count", "--from", "yesterday"]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("expected an RFC 3339 time") && stderr.contains("yesterday"), "{stderr}");
    // Checked by the operation, as for the API (tests/contract.rs), not by the parser.
    let (code, _, stderr) = ferry(&["failed", "list", "--limit", "0"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("--limit must be between 1 and 10000"), "{stderr}");
    let (code, _, stderr) =
        ferry(&["failed", "count", "--from", "2026-03-02T00:00:00Z", "--before", "2026-03-01T00:00:00Z"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("must be earlier than --before"), "{stderr}");

    let (code, out, _) = ferry(&["failed", "resend", "--route", "a"]);
    assert_eq!((code, out.trim()), (Some(0), "3 events resent"));
    assert_eq!(db.store.get(ids[0]).await.unwrap().unwrap().status, Status::Pending);
    let (code, out, _) = ferry(&["failed", "purge", "--all"]);
    assert_eq!((code, out.trim()), (Some(0), "3 events purged"));
    assert_eq!(ferry(&["failed", "count"]).1.trim(), "0");
}

/// Runs the binary with `--config config` and `args`; returns its exit code, stdout and stderr.
pub(crate) fn run_ferry(config: &Path, args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(crate::common::ferry_bin())
        .arg("--config")
        .arg(config)
        .args(args)
        .env_remove("FERRY_DATABASE_URL")
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// A port nothing listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_reaches_a_running_ferry_and_reports_history_and_stats() {
    let db = TestDb::new(crate::common::Backend::Sqlite).await;
    let port = free_port();
    let config_path = db.dir.path().join("ferry.toml");
    let admin = format!("[admin]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"e2e-admin-token-0123456789\"\n");
    std::fs::write(&config_path, format!("[database]\nurl = {:?}\n{admin}{}", db.url, log_config(&db))).unwrap();

    let (code, _, stderr) = run_ferry(&config_path, &["health"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("cannot reach the admin API"), "{stderr}");

    let log_path = db.dir.path().join("serve.log");
    let mut serve = Command::new(crate::common::ferry_bin())
        .arg("--config")
        .arg(&config_path)
        .arg("serve")
        .env_remove("FERRY_DATABASE_URL")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .expect("ferry serve starts");
    let ready = eventually(Duration::from_secs(30), "ferry serve to be ready", || async {
        let (code, stdout, _) = run_ferry(&config_path, &["health", "--json"]);
        (code == Some(0)).then_some(stdout)
    })
    .await;
    assert_eq!(serde_json::from_str::<Value>(&ready).unwrap()["status"], "ready");

    let (code, stdout, stderr) = run_ferry(&config_path, &["emit", "orders", "order.created", "{}", "--json"]);
    assert_eq!(code, Some(0), "{stderr}");
    let id = serde_json::from_str::<Value>(&stdout).unwrap()["id"].as_i64().expect("emit --json prints the id");
    let out = db.dir.path().join("out/orders.jsonl");
    eventually(Duration::from_secs(30), "the event delivered", || async { (!lines(&out).is_empty()).then_some(()) })
        .await;
    // The outcome is written just after the plugin returns.
    eventually(Duration::from_secs(10), "the event SENT", || async {
        (db.store.get(id).await.unwrap().unwrap().status == Status::Sent).then_some(())
    })
    .await;

    let (code, stdout, _) = run_ferry(&config_path, &["show", &id.to_string()]);
    assert_eq!(code, Some(0));
    assert!(stdout.contains("history       1 attempts recorded"), "{stdout}");
    assert!(stdout.contains("sent") && stdout.contains("log@"), "the attempt names the plugin version: {stdout}");
    let (_, stdout, _) = run_ferry(&config_path, &["show", &id.to_string(), "--json"]);
    let shown: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(shown["attempts_history"][0]["outcome"], "sent");

    let (code, stdout, _) = run_ferry(&config_path, &["stats", "--json"]);
    assert_eq!(code, Some(0));
    let stats: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(stats["routes"]["orders"]["SENT"], 1, "{stats}");
    assert_eq!(stats["latency"]["samples"], 1, "{stats}");
    let (code, stdout, _) = run_ferry(&config_path, &["stats"]);
    assert_eq!(code, Some(0));
    assert!(stdout.contains("orders") && stdout.contains("p50"), "{stdout}");

    let (code, stdout, stderr) = run_ferry(&config_path, &["plugins", "reload"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("unchanged") && stdout.contains("log.wasm"), "{stdout}");
    let (code, stdout, _) = run_ferry(&config_path, &["breaker", "open", "orders", "--json"]);
    assert_eq!(code, Some(0));
    assert_eq!(serde_json::from_str::<Value>(&stdout).unwrap()["state"], "open");

    let metrics = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .bearer_auth("e2e-admin-token-0123456789")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains(r#"ferry_events_delivered_total{route="orders",plugin="log"} 1"#), "{metrics}");
    assert!(metrics.contains(r#"ferry_breaker_state{route="orders"} 1"#), "{metrics}");

    assert!(Command::new("kill").args(["-TERM", &serve.id().to_string()]).status().unwrap().success());
    let exit = eventually(Duration::from_secs(20), "ferry serve to exit", || {
        let status = serve.try_wait().unwrap();
        async move { status }
    })
    .await;
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(exit.success(), "{log}");
    assert!(log.contains("admin API listening"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_stops_with_a_clear_error_when_the_admin_address_is_taken() {
    let db = TestDb::new(crate::common::Backend::Sqlite).await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let config_path = db.dir.path().join("ferry.toml");
    let admin = format!("[admin]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"e2e-admin-token-0123456789\"\n");
    std::fs::write(&config_path, format!("[database]\nurl = {:?}\n{admin}{}", db.url, log_config(&db))).unwrap();
    let (code, _, stderr) = run_ferry(&config_path, &["serve"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains(&format!("admin.listen: cannot listen on 127.0.0.1:{port}")), "{stderr}");
}
