//! What an operator meets before and around `serve`, through the binary: `config check` and
//! `config show`, errors that name the key, line or variable, `--json` as a contract (errors
//! included), the CLI's conventions (version, completions, man pages, help, dry runs, the
//! purge question), `serve` refusing an incomplete configuration, and `/metrics` that reads no
//! SENT rows and can be scraped without the token when the operator says so.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::common::{Backend, Reaped, TestDb, eventually, plugins_dir, spawn_serve};
use crate::e2e::run_ferry;

/// Runs the binary with `args` and `env`, nothing else of the caller's `FERRY_*` environment.
fn ferry_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut command = Command::new(crate::common::ferry_bin());
    command.current_dir(dir).args(args);
    for (name, _) in std::env::vars().filter(|(name, _)| name.starts_with("FERRY_")) {
        command.env_remove(name);
    }
    let out = command.envs(env.iter().copied()).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code(), text(&out.stdout), text(&out.stderr))
}

/// A configuration with the log plugin on route `audit`, plus `extra` TOML.
fn log_route(dir: &Path, extra: &str) -> PathBuf {
    let plugins = plugins_dir(dir, &["ferry_transport_log"]);
    let out = dir.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let path = dir.join("ferry.toml");
    let database = dir.join("never-created").join("ferry.db");
    let text = format!(
        "[database]\nurl = \"sqlite://{}\"\n[plugins]\ndir = {plugins:?}\ncache_dir = {:?}\n\
         [sandbox.log]\ndirs = {{ \"/out\" = {out:?} }}\n\
         [route.audit]\nplugin = \"log\"\nconfig = {{ output = \"/out/audit.jsonl\" }}\n{extra}",
        database.display(),
        crate::common::target_dir().join("test-plugin-cache"),
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// The routes of `failed_fixture`, so events can be emitted to them.
const ROUTES: &str = "[route.a]\nplugin = \"log\"\n[route.b]\nplugin = \"log\"\n";

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_check_runs_what_serve_checks_without_the_database() {
    let dir = tempfile::tempdir().unwrap();
    // A route whose plugin name is mistyped, a sandbox table for that name, and a route whose
    // plugin is there but refuses its config in `init`.
    let config = log_route(
        dir.path(),
        "[sandbox.lgo]\nstdio = true\nhttp = [\"http://localhost:8080\", \"http://127.0.0.1:9\"]\n[route.typo]\nplugin = \"lgo\"\n\
         [route.broken]\nplugin = \"log\"\nconfig = { output = \"relative.jsonl\" }\n",
    );
    let (code, text, _) = run_ferry(&config, &["config", "check"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("route \"typo\" needs plugin \"lgo\""), "the missing plugin is named:\n{text}");
    assert!(text.contains("[sandbox.lgo] is for a plugin named \"lgo\""), "the stray sandbox is warned about:\n{text}");
    assert!(
        text.contains("sandbox.lgo.http: localhost resolves to non-public addresses only")
            && text.contains("http_private = true")
            && !text.contains("requests to http://127.0.0.1:9"),
        "an allowed host name that leads to loopback is warned about, an address named outright is not:\n{text}"
    );
    assert!(text.contains("audit") && text.contains("ready"), "the good route is ready:\n{text}");
    assert!(text.contains("not ok"), "{text}");

    let (code, out, stderr) = run_ferry(&config, &["--json", "config", "check"]);
    assert_eq!(code, Some(1), "{stderr}");
    let check = json(&out);
    assert_eq!(check["ok"], false);
    let route = |name: &str| check["routes"].as_array().unwrap().iter().find(|r| r["route"] == name).unwrap().clone();
    assert_eq!(route("audit")["ready"], true);
    assert_eq!(route("typo")["ready"], false);
    let broken = route("broken");
    assert_eq!(broken["ready"], false, "init ran and refused the config: {check}");
    assert!(broken["error"].as_str().unwrap().contains("relative.jsonl"), "{broken}");
    assert_eq!(check["plugins"]["plugins"][0]["name"], "log");
    assert!(!dir.path().join("never-created").exists(), "the database was not touched");

    // Fixed, it passes; the same configuration starts `serve`.
    let config = log_route(dir.path(), "");
    let (code, text, stderr) = run_ferry(&config, &["config", "check"]);
    assert_eq!(code, Some(0), "{text}{stderr}");
    assert!(text.contains("ok: ferry serve would start"), "{text}");

    // On PostgreSQL, a pool with no connection to spare beside LISTEN and the relay's statements
    // that do not run on its own connections is warned about (it is not an error: nothing
    // breaks, requests wait). The workers take none of it.
    let config_arg = config.to_str().unwrap();
    let pg = [("FERRY_DATABASE_URL", "postgres://ferry@db.invalid/outbox"), ("FERRY_DATABASE_MAX_CONNECTIONS", "2")];
    let (code, text, stderr) = ferry_env(dir.path(), &["--config", config_arg, "config", "check"], &pg);
    assert_eq!(code, Some(0), "{text}{stderr}");
    assert!(text.contains("database.max_connections (2) leaves no connection spare on PostgreSQL"), "{text}");
    let many = [pg[0], ("FERRY_RELAY_WORKERS", "64")];
    let (_, text, _) = ferry_env(dir.path(), &["--config", config_arg, "config", "check"], &many);
    assert!(!text.contains("max_connections"), "64 workers fit the default pool: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_an_incomplete_configuration_unless_told_otherwise() {
    let dir = tempfile::tempdir().unwrap();
    let config = log_route(dir.path(), "[route.typo]\nplugin = \"lgo\"\n");
    let (code, _, stderr) = run_ferry(&config, &["serve"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("not starting")
            && stderr.contains("route \"typo\" needs plugin \"lgo\"")
            && stderr.contains("relay.allow_incomplete"),
        "{stderr}"
    );
    let no_routes = dir.path().join("empty.toml");
    let database = dir.path().join("empty.db");
    std::fs::write(&no_routes, format!("[database]\nurl = \"sqlite://{}\"\n", database.display())).unwrap();
    let (code, _, stderr) = run_ferry(&no_routes, &["serve"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("no routes are configured"), "{stderr}");

    // A plugin whose file is there but does not load fails only its own route's events.
    std::fs::write(dir.path().join("plugins").join("broken.wasm"), b"\0asm but not really").unwrap();
    let broken = log_route(dir.path(), "[route.shaky]\nplugin = \"broken\"\n");
    runs_without_a_transport(&broken, &[], &dir.path().join("broken.log")).await;
    std::fs::remove_file(dir.path().join("plugins").join("broken.wasm")).unwrap();
    assert!(!database.exists(), "refused before the database was created");

    // Told otherwise, the mistyped route starts too, and is said to have no transport.
    let typo = log_route(dir.path(), "[route.typo]\nplugin = \"lgo\"\n");
    runs_without_a_transport(&typo, &[("FERRY_RELAY_ALLOW_INCOMPLETE", "true")], &dir.path().join("serve.log")).await;
}

/// Starts `serve` on `config` with `env`, waits for it to log a route without a transport, checks
/// that it is still running, and stops it.
async fn runs_without_a_transport(config: &Path, env: &[(&str, &str)], log: &Path) {
    let mut serve = Command::new(crate::common::ferry_bin())
        .args(["--config", config.to_str().unwrap(), "serve"])
        .env_remove("FERRY_DATABASE_URL")
        .envs(env.iter().copied())
        .env("FERRY_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    eventually(Duration::from_secs(30), "serve to report the route without transport", || async {
        std::fs::read_to_string(log).unwrap_or_default().contains("route has no transport").then_some(())
    })
    .await;
    assert!(serve.try_wait().unwrap().is_none(), "serve is running: {}", std::fs::read_to_string(log).unwrap());
    let _ = serve.kill();
    let _ = serve.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_tells_systemd_it_is_ready_alive_and_stopping() {
    let dir = tempfile::tempdir().unwrap();
    let config = log_route(dir.path(), "");
    let socket_path = dir.path().join("notify.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&socket_path).unwrap();
    socket.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut serve = Command::new(crate::common::ferry_bin())
        .args(["--config", config.to_str().unwrap(), "serve"])
        .env_remove("FERRY_DATABASE_URL")
        .env("NOTIFY_SOCKET", &socket_path)
        .env("WATCHDOG_USEC", "200000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut heard = Vec::new();
    let mut buf = [0u8; 512];
    let mut receive = |heard: &mut Vec<String>| {
        let n = socket.recv(&mut buf).expect("a notification within 30 s");
        heard.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    };
    receive(&mut heard);
    assert!(heard[0].starts_with("READY=1\nSTATUS=delivering routes audit"), "{heard:?}");
    for _ in 0..3 {
        receive(&mut heard);
    }
    assert!(heard[1..].iter().all(|m| m == "WATCHDOG=1"), "fed every 100 ms: {heard:?}");
    assert!(Command::new("kill").args(["-TERM", &serve.id().to_string()]).status().unwrap().success());
    let stopping = (0..50).find_map(|_| {
        let n = socket.recv(&mut buf).ok()?;
        let message = String::from_utf8_lossy(&buf[..n]).into_owned();
        (message == "STOPPING=1").then_some(message)
    });
    assert_eq!(stopping.as_deref(), Some("STOPPING=1"));
    assert!(serve.wait().unwrap().success());
}

#[test]
fn configuration_errors_name_the_key_line_and_variable() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ferry.toml");
    std::fs::write(&file, "[database]\nurl = \"sqlite://x.db\"\n\n[relay]\nworkers = 2\nbatch_size = \"ten\"\n")
        .unwrap();
    let (code, _, stderr) = ferry_env(dir.path(), &["status"], &[]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("ferry.toml, line 6") && stderr.contains("relay.batch_size"), "{stderr}");
    assert!(stderr.contains("\"ten\""), "the bad value is quoted: {stderr}");

    // Secrets are not quoted back: toml's own message would show the line, serde's the value.
    std::fs::write(&file, "[admin]\ntoken = hunter2-unquoted\n").unwrap();
    let (code, _, stderr) = ferry_env(dir.path(), &["status"], &[]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("ferry.toml, line 2") && !stderr.contains("hunter2"), "{stderr}");
    std::fs::write(&file, "[sandbox.x]\nenv = { PIN = 123456 }\n").unwrap();
    let (code, _, stderr) = ferry_env(dir.path(), &["status"], &[]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("sandbox.x.env.PIN") && !stderr.contains("123456"), "{stderr}");

    std::fs::write(&file, "[relay]\nbatch_size = 10\n").unwrap();
    // A variable of some other program is not ferry's business; a mistyped key of ours is.
    let (code, out, stderr) = ferry_env(dir.path(), &["config", "show"], &[("FERRY_HOME", "/opt/ferry")]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("FERRY_HOME is not a ferry setting") && out.contains("relay.batch_size"), "{stderr}");
    for typo in ["FERRY_RELAY_BATCHSIZE", "FERRY_PLUGIN_DIR", "FERRY_RELY_WORKERS", "FERRY_ROUTE_ORDERS_PLUGIN"] {
        let (code, _, stderr) = ferry_env(dir.path(), &["config", "show"], &[(typo, "5")]);
        assert_eq!(code, Some(1), "{typo}");
        assert!(stderr.contains(&format!("environment variable {typo}")), "{stderr}");
    }
    let (_, _, stderr) = ferry_env(dir.path(), &["config", "show"], &[("FERRY_HOME", "/opt/ferry")]);
    assert_eq!(stderr.matches("FERRY_HOME").count(), 1, "warned about once: {stderr}");
    let (code, _, stderr) = ferry_env(dir.path(), &["config", "show"], &[("FERRY_RELAY_BATCH_SIZE", "ten")]);
    assert_eq!(code, Some(1));
    assert!(
        stderr.contains("environment variable FERRY_RELAY_BATCH_SIZE") && !stderr.contains("ferry.toml"),
        "{stderr}"
    );

    // The logging variables are checked too, and named.
    for (name, value, says) in [
        ("FERRY_LOG", "verbose", "\"verbose\", which is not a level"),
        ("FERRY_LOG", "ferry=loud", "not a level"),
        ("FERRY_LOG_FORMAT", "xml", "use text or json"),
    ] {
        let (code, out, stderr) = ferry_env(dir.path(), &["--json", "config", "show"], &[(name, value)]);
        assert_eq!(code, Some(1), "{name}={value}");
        let error = json(&out);
        assert_eq!(error["error"]["code"], "config");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(name) && message.contains(says), "{name}={value}: {message}");
        assert!(stderr.is_empty(), "with --json the error is on stdout only: {stderr}");
    }
    let (code, _, stderr) = ferry_env(dir.path(), &["config", "show"], &[("FERRY_LOG", "warn,ferry=debug")]);
    assert_eq!(code, Some(0), "{stderr}");
}

#[test]
fn config_show_says_where_each_value_comes_from_and_masks_secrets() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("ferry.toml"),
        "[relay]\nbatch_size = 50\n[admin]\nlisten = \"127.0.0.1:9464\"\ntoken = \"file-token-0123456789\"\n\
         [sandbox.http]\nenv = { API_KEY = \"sandbox-secret\" }\n\
         [route.hooks]\nplugin = \"http\"\nconfig = { url = \"https://example.com/in\", signing_secret = \"route-secret\" }\n\
         [route.relay]\nplugin = \"http\"\nconfig = { url = \"https://hook:url-password@example.com/in\", Authorization = \"Bearer bearer-secret\" }\n",
    )
    .unwrap();
    let env = [("FERRY_RELAY_WORKERS", "3"), ("FERRY_DATABASE_URL", "postgres://ferry:db-password@db.internal/outbox")];
    let (code, out, stderr) = ferry_env(dir.path(), &["--json", "config", "show"], &env);
    assert_eq!(code, Some(0), "{stderr}");
    for secret in
        ["file-token-0123456789", "sandbox-secret", "route-secret", "db-password", "url-password", "bearer-secret"]
    {
        assert!(!out.contains(secret), "{secret} is shown: {out}");
    }
    let shown = json(&out);
    let setting = |key: &str| {
        shown["settings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["key"] == key)
            .unwrap_or_else(|| panic!("no {key}"))
            .clone()
    };
    assert_eq!(setting("relay.batch_size")["value"], 50);
    assert_eq!(setting("relay.batch_size")["source"], "file ferry.toml");
    assert_eq!(setting("relay.workers")["value"], 3);
    assert_eq!(setting("relay.workers")["source"], "environment FERRY_RELAY_WORKERS");
    assert_eq!(setting("relay.lease")["source"], "default");
    assert_eq!(setting("admin.token")["value"], "********");
    assert_eq!(setting("sandbox.http.env.API_KEY")["value"], "********");
    assert_eq!(setting("route.hooks.config.signing_secret")["value"], "********");
    assert_eq!(setting("route.hooks.config.url")["value"], "https://example.com/in");
    assert!(setting("route.relay.config.url")["value"].as_str().unwrap().contains("example.com/in"));
    assert_eq!(setting("admin.token_file")["value"], "", "an empty setting is shown as empty");
    let url = setting("database.url");
    assert_eq!(url["source"], "--database-url / FERRY_DATABASE_URL");
    assert!(url["value"].as_str().unwrap().contains("db.internal/outbox"), "{url}");

    let (code, text, _) = ferry_env(dir.path(), &["config", "show"], &env);
    assert_eq!(code, Some(0));
    let line = text.lines().find(|l| l.starts_with("relay.workers ")).unwrap();
    assert!(line.contains(" 3 ") && line.ends_with("environment FERRY_RELAY_WORKERS"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_is_a_contract_for_answers_and_errors() {
    let db = TestDb::new(Backend::Sqlite).await;
    let ids = crate::store::failed_fixture(&db).await;
    let config = db.dir.path().join("ferry.toml");
    std::fs::write(&config, format!("[database]\nurl = {:?}\n{ROUTES}", db.url)).unwrap();
    let ferry = |args: &[&str]| run_ferry(&config, args);

    for (args, code, kind) in [
        (vec!["--json", "show", "999999"], 1, "not_found"),
        (vec!["--json", "failed", "purge"], 1, "bad_request"),
        (vec!["--json", "failed", "count", "--reason", "boredom"], 1, "bad_request"),
        (vec!["--json", "frobnicate"], 2, "usage"),
        (vec!["--json", "failed", "count", "--from", "yesterday"], 2, "usage"),
    ] {
        let (exit, out, stderr) = ferry(&args);
        assert_eq!(exit, Some(code), "{args:?}: {out}{stderr}");
        let error = json(out.trim());
        assert_eq!(error["error"]["code"], kind, "{args:?}: {error}");
        assert!(error["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{error}");
        assert!(stderr.is_empty(), "{args:?}: nothing on stderr: {stderr}");
    }
    // Resending several ids, some of which cannot be: one error, which says what was done.
    let (code, out, stderr) = ferry(&["--json", "resend", &ids[0].to_string(), "999999"]);
    assert_eq!(code, Some(1), "{stderr}");
    let error = json(out.trim());
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("1 of 2 events resent") && message.contains("999999"), "{error}");
    let (_, text, stderr) = ferry(&["show", "999999"]);
    assert!(text.is_empty() && stderr.starts_with("error: no event with id 999999"), "{stderr}");

    // Headers are a JSON object, as the API takes them.
    let (code, out, stderr) = ferry(&["--json", "emit", "a", "x", "{}", "--header", "tenant=acme"]);
    assert_eq!(code, Some(0), "{stderr}");
    let id = json(&out)["id"].as_i64().unwrap();
    let (_, out, _) = ferry(&["--json", "show", &id.to_string()]);
    assert_eq!(json(&out)["headers"]["tenant"], "acme", "{out}");
    let (_, out, _) = ferry(&["--json", "show", &ids[0].to_string()]);
    assert!(json(&out)["headers"].is_object(), "{out}");

    // A JSON payload is JSON, its text as stored: a number past 2^64 keeps every digit. Text is
    // text, whatever it looks like, and so is JSON that does not parse.
    let big = r#"{"amount": 123456789012345678901234567890.5, "tags": ["a"]}"#;
    for (payload, content_type, shown) in [
        (big, "application/json", format!(r#""payload_json":{big}"#)),
        ("[1,2]", "application/cloudevents+json; charset=utf-8", r#""payload_json":[1,2]"#.to_string()),
        ("123", "text/plain", r#""payload":"123""#.to_string()),
        ("{\"unclosed\": ", "application/json", r#""payload":"{\"unclosed\": ""#.to_string()),
    ] {
        let (_, out, stderr) = ferry(&["--json", "emit", "a", "x", payload, "--content-type", content_type]);
        let id = json(&out)["id"].as_i64().unwrap_or_else(|| panic!("{stderr}"));
        let (_, out, _) = ferry(&["--json", "show", &id.to_string()]);
        assert!(out.contains(&shown), "{payload} as {content_type}: {out}");
        let view = json(&out);
        assert!(view.get("payload_json").is_none() || view.get("payload").is_none(), "one of them: {view}");
    }

    // The newest failures first, and failures by the text of their error.
    let (_, out, _) = ferry(&["--json", "failed", "list", "--newest", "--limit", "2", "--error", "REJECTED"]);
    let page = json(&out);
    let listed: Vec<i64> = page["events"].as_array().unwrap().iter().map(|e| e["id"].as_i64().unwrap()).collect();
    assert_eq!(listed, [ids[5], ids[4]], "{page}");
    let (_, out, _) = ferry(&["--json", "failed", "list", "--newest", "--limit", "2", "--after", &ids[4].to_string()]);
    assert_eq!(json(&out)["events"][0]["id"].as_i64(), Some(ids[3]), "{out}");
    let (_, out, _) = ferry(&["--json", "failed", "count", "--error", "timed out"]);
    assert_eq!(json(&out)["failed"], 0, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_prints_as_much_payload_as_asked() {
    let db = TestDb::new(Backend::Sqlite).await;
    let config = db.dir.path().join("ferry.toml");
    std::fs::write(&config, format!("[database]\nurl = {:?}\n{ROUTES}", db.url)).unwrap();
    // Seven bytes, then two-byte characters: byte 1024 falls inside one.
    let payload = format!("{{\"n\": \"{}\"}}", "é".repeat(2000));
    let (_, out, stderr) = run_ferry(&config, &["--json", "emit", "a", "x", &payload]);
    let id = json(&out)["id"].as_i64().unwrap_or_else(|| panic!("{stderr}")).to_string();

    let (_, text, _) = run_ferry(&config, &["show", &id, "--payload", "head"]);
    assert!(text.contains(&format!("the first 1023 of {} bytes", payload.len())), "cut on a character: {text}");
    let (_, out, _) = run_ferry(&config, &["--json", "show", &id, "--payload", "head"]);
    let view = json(&out);
    assert_eq!(view["payload_bytes"], payload.len());
    assert_eq!(view["payload"].as_str().unwrap().len(), 1023);
    let (_, out, _) = run_ferry(&config, &["--json", "show", &id, "--payload", "none"]);
    let view = json(&out);
    assert!(view.get("payload").is_none() && view["payload_bytes"] == payload.len(), "{view}");
    let (_, text, _) = run_ferry(&config, &["show", &id, "--payload", "none"]);
    assert!(text.ends_with(&format!("payload       {} bytes, not shown\n", payload.len())), "{text}");
    let (_, out, _) = run_ferry(&config, &["--json", "show", &id]);
    let view = json(&out);
    assert_eq!(view["payload_json"], json(&payload), "a JSON payload in full is JSON");
    assert!(view.get("payload").is_none() && view.get("payload_bytes").is_none(), "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_says_why_a_pending_event_waits() {
    let db = TestDb::new(Backend::Postgres).await;
    let config = db.dir.path().join("ferry.toml");
    let routes = "[route.a]\nplugin = \"log\"\n[route.o]\nplugin = \"log\"\nordered = true\n";
    std::fs::write(&config, format!("[database]\nurl = {:?}\n{routes}", db.url)).unwrap();
    let ferry = |args: &[&str]| run_ferry(&config, args);
    let emit = |args: &[&str]| {
        let (code, out, stderr) = ferry(&[&["--json", "emit"], args].concat());
        assert_eq!(code, Some(0), "{stderr}");
        json(&out)["id"].as_i64().unwrap().to_string()
    };
    let waiting = |id: &str| {
        let (_, out, _) = ferry(&["--json", "show", id]);
        json(&out)["waiting"].as_array().map(|w| w.iter().map(|s| s.as_str().unwrap().to_string()).collect::<Vec<_>>())
    };

    let later = emit(&["a", "x", "{}", "--delay", "1h"]);
    let now = emit(&["a", "x", "{}"]);
    assert!(waiting(&later).unwrap()[0].starts_with("deferred until "), "{:?}", waiting(&later));
    assert_eq!(waiting(&now).unwrap(), ["due now: the next claim takes it"]);
    ferry(&["breaker", "open", "a", "--reason", "receiver maintenance"]);
    let why = waiting(&now).unwrap();
    assert!(
        why[0].contains("opened by hand (receiver maintenance)") && why[0].contains("ferry breaker close a"),
        "{why:?}"
    );
    let (_, text, _) = ferry(&["show", &now]);
    assert!(text.contains("waiting       the route's breaker was opened by hand"), "{text}");

    let first = emit(&["o", "x", "{}", "--key", "k"]);
    let second = emit(&["o", "x", "{}", "--key", "k"]);
    let other_key = emit(&["o", "x", "{}", "--key", "j"]);
    assert_eq!(
        waiting(&second).unwrap(),
        [format!("event {first}, earlier in its ordering key, is PENDING and goes first")]
    );
    assert_eq!(waiting(&other_key).unwrap(), ["due now: the next claim takes it"]);
    ferry(&["event", "fail", &first]);
    let why = waiting(&second).unwrap();
    assert!(
        why[0].starts_with(&format!("event {first}, earlier in its ordering key, is FAILED and holds the key back")),
        "{why:?}"
    );
    assert_eq!(waiting(&first), None, "only PENDING events wait");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_has_a_dry_run_and_asks_on_a_terminal() {
    let db = TestDb::new(Backend::Sqlite).await;
    crate::store::failed_fixture(&db).await;
    let config = db.dir.path().join("ferry.toml");
    std::fs::write(&config, format!("[database]\nurl = {:?}\n", db.url)).unwrap();
    let count = || run_ferry(&config, &["failed", "count"]).1.trim().to_string();

    let (code, out, _) = run_ferry(&config, &["failed", "purge", "--route", "a", "--dry-run"]);
    assert_eq!((code, out.trim()), (Some(0), "3 FAILED events would be purged (dry run: nothing changed)"));
    let (_, out, _) = run_ferry(&config, &["--json", "failed", "resend", "--all", "--dry-run"]);
    assert_eq!(json(&out)["failed"], 6);
    let (code, _, stderr) = run_ferry(&config, &["failed", "purge", "--dry-run"]);
    assert_eq!(code, Some(1), "a dry run still needs a filter or --all");
    assert!(stderr.contains("--all"), "{stderr}");
    assert_eq!(count(), "6");

    // On a terminal (a pseudo-terminal made by script(1)), the purge asks first.
    let on_a_terminal = |args: &str, answer: &str| {
        let command = format!("{} --config {} {args}", crate::common::ferry_bin().display(), config.display());
        let mut child = Command::new("script")
            .args(["-q", "-e", "-c", &command, "/dev/null"])
            .env_remove("FERRY_DATABASE_URL")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("script(1) from util-linux runs");
        child.stdin.take().unwrap().write_all(answer.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let (code, screen) = on_a_terminal("failed purge --route a", "n\n");
    assert_eq!(code, Some(1), "{screen}");
    assert!(
        screen.contains("Purge 3 FAILED events for good? [y/N]") && screen.contains("nothing was purged"),
        "{screen}"
    );
    assert_eq!(count(), "6");
    let (code, screen) = on_a_terminal("--json failed purge --route a", "no\n");
    assert_eq!(code, Some(1), "{screen}");
    assert!(screen.contains("\"error\":{\"code\":\"failed\",\"message\":\"not confirmed"), "{screen}");
    let (code, screen) = on_a_terminal("failed purge --route a", "y\n");
    assert_eq!(code, Some(0), "{screen}");
    assert!(screen.contains("3 events purged"), "{screen}");
    assert_eq!(count(), "3");
    let (code, screen) = on_a_terminal("failed purge --route b --yes", "");
    assert_eq!(code, Some(0), "{screen}");
    assert!(!screen.contains("[y/N]") && screen.contains("3 events purged"), "{screen}");
    // A script (standard input not a terminal) is not asked.
    assert_eq!(run_ferry(&config, &["failed", "purge", "--all"]).1.trim(), "no FAILED event matches; nothing purged");
}

#[test]
fn version_completions_manual_and_help_fit_the_usual_tools() {
    let dir = tempfile::tempdir().unwrap();
    let (code, version, _) = ferry_env(dir.path(), &["--version"], &[]);
    assert_eq!(code, Some(0));
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(crate::common::repo_root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or_else(|| "unknown".to_string(), |o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    assert_eq!(
        version.trim(),
        format!(
            "ferry {} (commit {commit}, transport contract ferry:transport@{}, also loads @{})",
            env!("CARGO_PKG_VERSION"),
            ferry::plugins::WIT_VERSION,
            ferry::plugins::OLDER_WIT_VERSIONS.join(", @")
        )
    );

    let (code, bash, _) = ferry_env(dir.path(), &["completions", "bash"], &[]);
    assert_eq!(code, Some(0));
    assert!(bash.contains("_ferry()") && bash.contains("purge") && bash.contains("--dry-run"), "{}", &bash[..200]);
    let (_, zsh, _) = ferry_env(dir.path(), &["completions", "zsh"], &[]);
    assert!(zsh.starts_with("#compdef ferry"), "{}", &zsh[..100]);

    let (code, page, _) = ferry_env(dir.path(), &["man"], &[]);
    assert_eq!(code, Some(0));
    assert!(page.contains(".TH ferry 1") && page.contains("Delivers events"), "{}", &page[..300]);
    let pages = dir.path().join("man1");
    let (code, _, stderr) = ferry_env(dir.path(), &["man", "--dir", pages.to_str().unwrap()], &[]);
    assert_eq!(code, Some(0), "{stderr}");
    let purge = std::fs::read_to_string(pages.join("ferry-failed-purge.1")).expect("a page per subcommand");
    assert!(purge.contains("dry\\-run"), "{purge}");

    let (_, help, _) = ferry_env(dir.path(), &["--help"], &[]);
    assert!(help.contains("Global options:") && help.contains("Examples:") && help.contains("FERRY_LOG"), "{help}");
    let commands = help.split("Global options:").next().unwrap();
    assert!(!commands.contains("--database-url"), "global flags sit under their own heading: {help}");
    let (_, help, _) = ferry_env(dir.path(), &["failed", "purge", "--help"], &[]);
    assert!(help.contains("--dry-run") && help.contains("--yes") && help.contains("Examples:"), "{help}");
}

/// The statements a `/metrics` scrape runs read only the partial indexes of unfinished events:
/// with sequential scans disabled, each plan names one of those indexes and nothing else, so
/// millions of retained SENT rows cost a scrape nothing.
async fn a_scrape_reads_no_sent_rows(db: TestDb) {
    use ferry::store::{UNFINISHED_COUNTS_SQL, WATCH_SQL};
    const UNFINISHED: [&str; 3] = ["ferry_events_pending", "ferry_events_claimed", "ferry_events_failed"];
    let plans: Vec<String> = match db.backend {
        Backend::Postgres => {
            use sqlx::Connection as _;
            let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
            sqlx::query("SET enable_seqscan = off").execute(&mut conn).await.unwrap();
            sqlx::query("SET enable_indexonlyscan = off").execute(&mut conn).await.unwrap();
            sqlx::query(&format!("PREPARE watch(timestamptz, timestamptz) AS {WATCH_SQL}"))
                .execute(&mut conn)
                .await
                .unwrap();
            let mut plans = Vec::new();
            for statement in [
                "EXPLAIN EXECUTE watch(now(), now() + interval '48 hours')".to_string(),
                format!("EXPLAIN {UNFINISHED_COUNTS_SQL}"),
            ] {
                let rows: Vec<(String,)> = sqlx::query_as(&statement).fetch_all(&mut conn).await.unwrap();
                plans.push(rows.into_iter().map(|(line,)| line).collect::<Vec<_>>().join("\n"));
            }
            plans
        }
        Backend::Sqlite => {
            let pool = &sqlx::SqlitePool::connect(&db.url).await.unwrap();
            let mut plans = Vec::new();
            for statement in [WATCH_SQL, UNFINISHED_COUNTS_SQL] {
                let rows: Vec<(i64, i64, i64, String)> = sqlx::query_as(&format!("EXPLAIN QUERY PLAN {statement}"))
                    .bind("2026-01-01T00:00:00Z")
                    .bind("2026-01-03T00:00:00Z")
                    .fetch_all(pool)
                    .await
                    .unwrap();
                plans.push(rows.into_iter().map(|r| r.3).collect::<Vec<_>>().join("\n"));
            }
            plans
        }
    };
    for plan in plans {
        let scans = plan
            .lines()
            .filter(|l| l.contains("ferry_events") && ["Scan", "SCAN", "SEARCH"].iter().any(|w| l.contains(w)))
            // A bitmap heap scan reads only the rows its bitmap index scan (checked) found.
            .filter(|l| !l.contains("Bitmap Heap Scan"));
        for line in scans {
            let index = UNFINISHED.iter().find(|index| line.contains(*index));
            assert!(index.is_some() && !line.contains("Seq Scan"), "reads more than unfinished events: {line}\n{plan}");
        }
    }
}

async fn metrics_can_be_public_and_nothing_else_is(db: TestDb) {
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_log"]);
    let out = db.dir.path().join("out");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = db.dir.path().join("ferry.toml");
    let write = |public: bool| {
        std::fs::write(
            &config,
            format!(
                "[database]\nurl = {:?}\n[plugins]\ndir = {plugins:?}\n[sandbox.log]\ndirs = {{ \"/out\" = {out:?} }}\n\
                 [route.audit]\nplugin = \"log\"\nconfig = {{ output = \"/out/a.jsonl\" }}\n\
                 [admin]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"metrics-test-token-0123\"\nmetrics_public = {public}\n",
                db.url
            ),
        )
        .unwrap()
    };
    let http = reqwest::Client::new();
    for public in [false, true] {
        write(public);
        let log = db.dir.path().join(format!("serve-{public}.log"));
        let mut serve = spawn_serve(&config, &log);
        let url = |path: &str| format!("http://127.0.0.1:{port}{path}");
        eventually(Duration::from_secs(30), "the admin API", || async {
            http.get(url("/health/live")).send().await.ok().map(drop)
        })
        .await;
        let metrics = http.get(url("/metrics")).send().await.unwrap();
        let expected = if public { 200 } else { 401 };
        assert_eq!(metrics.status().as_u16(), expected, "metrics_public = {public}");
        if public {
            let text = metrics.text().await.unwrap();
            assert!(
                text.contains("ferry_breaker_state{route=\"audit\"} 0") && !text.contains("status=\"SENT\""),
                "{text}"
            );
            // A configured route with nothing unfinished reads 0, not a missing series.
            assert!(text.contains("ferry_events{route=\"audit\",status=\"PENDING\"} 0"), "{text}");
        }
        for path in ["/v1/stats", "/v1/failed", "/v1/openapi.json"] {
            assert_eq!(http.get(url(path)).send().await.unwrap().status().as_u16(), 401, "{path} needs the token");
        }
        let authorized = http.get(url("/metrics")).bearer_auth("metrics-test-token-0123").send().await.unwrap();
        assert_eq!(authorized.status().as_u16(), 200);
        let _ = serve.kill();
        let _ = serve.wait();
    }
}

crate::both_backends!(a_scrape_reads_no_sent_rows, metrics_can_be_public_and_nothing_else_is);

/// `ferry serve`'s configuration for the reload test: the scripted plugin recording to `out`,
/// with `relay` in [relay] and `routes` appended.
fn reload_config(db: &TestDb, port: u16, relay: &str, routes: &str) -> String {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let out = db.dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    format!(
        "[database]\nurl = {:?}\n[relay]\npoll_interval = \"10ms\"\nidle_poll_max = \"50ms\"\nbatch_size = 20\n{relay}\n\
         [admin]\nlisten = \"127.0.0.1:{port}\"\ntoken = \"reload-admin-token-0123456789\"\n\
         [plugins]\ndir = {plugins:?}\ncache_dir = {:?}\n[retry]\ninitial = \"20ms\"\njitter = \"none\"\n\
         [sandbox.scripted]\ndirs = {{ \"/out\" = {out:?} }}\n{routes}",
        db.url,
        crate::common::target_dir().join("test-plugin-cache"),
    )
}

/// Route `name` on the scripted plugin, recording its deliveries to `/out/FILE.log`.
fn scripted_route(name: &str, file: &str) -> String {
    format!("[route.{name}]\nplugin = \"scripted\"\nconfig = {{ record = \"/out/{file}.log\", delay_ms = \"5\" }}\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_routes_while_events_flow() {
    let db = TestDb::new(Backend::Postgres).await;
    let port = crate::common::broker::free_port();
    let path = db.dir.path().join("ferry.toml");
    std::fs::write(&path, reload_config(&db, port, "", &scripted_route("a", "a1"))).unwrap();
    let log_path = db.dir.path().join("serve.log");
    let mut serve = Reaped(
        Command::new(crate::common::ferry_bin())
            .args(["--config", path.to_str().unwrap(), "serve"])
            .env_remove("FERRY_DATABASE_URL")
            .env_remove("FERRY_LOG_FORMAT")
            .env("FERRY_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .unwrap(),
    );
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let logged = |text: &'static str, times: usize| {
        let log = &log;
        async move {
            for _ in 0..300 {
                if log().matches(text).count() >= times {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("{text:?} not logged {times} times within 30 s: {}", log());
        }
    };
    logged("ferry started", 1).await;
    let pid = serve.0.id().to_string();
    let hangup = || assert!(Command::new("kill").args(["-HUP", &pid]).status().unwrap().success());

    // Events keep coming on route a, from before the reload until well after it, while its
    // config changes (recording to another file) and route b is added.
    let store = db.store.clone();
    let reloaded = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let emitter = tokio::spawn({
        let reloaded = reloaded.clone();
        async move {
            let mut ids = Vec::new();
            let mut after = 0;
            while after < 100 {
                let event = ferry::NewEvent::new("a", "e", format!("{}", ids.len()));
                ids.push(store.insert(&event, chrono::Utc::now()).await.unwrap());
                after += usize::from(reloaded.load(std::sync::atomic::Ordering::Relaxed));
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            ids
        }
    });
    eventually(Duration::from_secs(30), "deliveries under the first configuration", || async {
        (crate::common::count(&db.store, ferry::event::Status::Sent).await >= 20).then_some(())
    })
    .await;
    let both = format!("{}{}", scripted_route("a", "a2"), scripted_route("b", "b"));
    std::fs::write(&path, reload_config(&db, port, "", &both)).unwrap();
    hangup();
    logged("configuration reloaded", 1).await;
    reloaded.store(true, std::sync::atomic::Ordering::Relaxed);
    let text = log();
    assert!(text.contains("added=b changed=a removed= unchanged=0 restarted=a,b"), "{text}");

    // The admin API knows route b at once: it takes an event for it.
    let api = reqwest::Client::new();
    let created: Value = api
        .post(format!("http://127.0.0.1:{port}/v1/events"))
        .bearer_auth("reload-admin-token-0123456789")
        .json(&serde_json::json!({ "route": "b", "type": "e", "payload": {} }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let on_b = created["id"].as_i64().unwrap_or_else(|| panic!("{created}"));
    let on_a = emitter.await.unwrap();
    let total = on_a.len() as u64 + 1;
    eventually(Duration::from_secs(60), "every event SENT", || async {
        (crate::common::count(&db.store, ferry::event::Status::Sent).await == total).then_some(())
    })
    .await;
    let out = db.dir.path().join("out");
    let mut delivered: HashMap<i64, usize> = HashMap::new();
    for d in crate::common::deliveries(&out) {
        *delivered.entry(d.id).or_default() += 1;
    }
    assert!(on_a.iter().chain([&on_b]).all(|id| delivered.get(id) == Some(&1)), "each event once: {delivered:?}");
    let lines = |file: &str| std::fs::read_to_string(out.join(file)).map(|t| t.lines().count()).unwrap_or(0);
    assert!(lines("a1.log") > 0 && lines("a2.log") > 0, "a's old config, then its new one, delivered");
    assert_eq!(lines("b.log"), 1, "the new route delivers");

    // Nothing changes, and ferry goes on, when the file does not parse, a plugin refuses its
    // new config, or the sandbox changed.
    std::fs::write(&path, "[route.a\nplugin = ").unwrap();
    hangup();
    logged("configuration not reloaded, the running one stays", 1).await;
    let refused = format!("{both}[route.c]\nplugin = \"scripted\"\nconfig = {{ reject = \"yes\" }}\n");
    std::fs::write(&path, reload_config(&db, port, "", &refused)).unwrap();
    hangup();
    logged("configuration not reloaded, the running one stays", 2).await;
    assert!(log().contains("route \"c\""), "the route is named: {}", log());
    let sandbox =
        reload_config(&db, port, "", &both).replace("[sandbox.scripted]", "[sandbox.scripted]\nenv = { X = \"1\" }");
    std::fs::write(&path, sandbox).unwrap();
    hangup();
    logged("configuration not reloaded, the running one stays", 3).await;
    assert!(log().contains("[sandbox.*] differs from the running configuration"), "{}", log());
    // A retry policy alone starts no instance; what cannot change while running is kept and
    // named; a removed route's events fail alone.
    let retry_only = scripted_route("a", "a2").replace("[route.a]", "[route.a]\nretry = { max_attempts = 3 }");
    std::fs::write(&path, reload_config(&db, port, "workers = 1", &retry_only)).unwrap();
    hangup();
    logged("configuration reloaded", 2).await;
    assert!(log().contains("added= changed=a removed=b unchanged=0 restarted=\n"), "{}", log());
    // Logged right after the line above, so waited for rather than read at once.
    logged("[relay] changed, but a running ferry keeps its value", 1).await;
    let orphan = db.store.insert(&ferry::NewEvent::new("b", "e", "{}"), chrono::Utc::now()).await.unwrap();
    let kept = db.store.insert(&ferry::NewEvent::new("a", "e", "{}"), chrono::Utc::now()).await.unwrap();
    eventually(Duration::from_secs(30), "both events finished", || async {
        let status = |id| {
            let store = db.store.clone();
            async move { store.get(id).await.unwrap().unwrap() }
        };
        let (orphan, kept) = (status(orphan).await, status(kept).await);
        (orphan.status == ferry::event::Status::Failed && kept.status == ferry::event::Status::Sent).then_some(orphan)
    })
    .await;

    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    assert!(serve.0.wait().unwrap().success(), "{}", log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reschedule_defers_a_pending_event_without_counting_an_attempt() {
    let db = TestDb::new(Backend::Sqlite).await;
    let failed = crate::store::failed_fixture(&db).await;
    let config = db.dir.path().join("ferry.toml");
    std::fs::write(&config, format!("[database]\nurl = {:?}\n{ROUTES}", db.url)).unwrap();
    let (_, out, _) = run_ferry(&config, &["--json", "emit", "a", "x", "{}"]);
    let id = json(&out)["id"].as_i64().unwrap().to_string();

    let before = chrono::Utc::now();
    let (code, out, stderr) = run_ferry(&config, &["--json", "reschedule", &id, "--delay", "2h"]);
    assert_eq!(code, Some(0), "{stderr}");
    let view = json(&out);
    let due: chrono::DateTime<chrono::Utc> = view["next_attempt_at"].as_str().unwrap().parse().unwrap();
    let ahead = due - before;
    assert!(ahead >= chrono::Duration::minutes(119) && ahead <= chrono::Duration::minutes(121), "{view}");
    assert_eq!((&view["status"], &view["attempts"]), (&json("\"PENDING\""), &json("0")), "no attempt counted");
    assert!(view["waiting"][0].as_str().is_some_and(|w| w.contains("deferred")), "{view}");
    let (code, text, _) = run_ferry(&config, &["reschedule", &id, "--at", "2026-01-01T00:00:00Z"]);
    assert_eq!((code, text.trim()), (Some(0), format!("event {id} is due at 2026-01-01T00:00:00+00:00").as_str()));

    let (code, _, stderr) = run_ferry(&config, &["reschedule", &failed[1].to_string(), "--delay", "1m"]);
    assert_eq!(code, Some(1));
    assert!(stderr.contains("is FAILED, not PENDING") && stderr.contains("resend it"), "{stderr}");
    let (code, _, stderr) = run_ferry(&config, &["reschedule", &id]);
    assert_eq!(code, Some(2), "--at or --delay is required: {stderr}");
    let (code, _, _) = run_ferry(&config, &["reschedule", &id, "--at", "2026-01-01T00:00:00Z", "--delay", "1m"]);
    assert_eq!(code, Some(2), "not both");
}
