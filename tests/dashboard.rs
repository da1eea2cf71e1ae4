//! The web dashboard in a real browser: `ferry serve` (the binary) on PostgreSQL with the scripted
//! plugin, driven by `tests/ui/dashboard.mjs` in headless Chromium through playwright-core. The
//! script signs in, watches counts change, resends, opens and closes a breaker, reloads a new
//! version of a plugin, attacks the session from another origin, and checks contrast, keyboard use
//! and a narrow screen; screenshots go to `target/dashboard/`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{TestDb, eventually, install, plugin_variant, plugins_dir, repo_root, spawn_serve, target_dir};

const TOKEN: &str = "dashboard-test-token-0123456789";

/// Stops the spawned server however the test ends.
use crate::common::Reaped as Serve;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

async fn call(http: &reqwest::Client, method: reqwest::Method, url: String, body: Option<Value>) -> Value {
    let mut request = http.request(method, &url).bearer_auth(TOKEN);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap_or_else(|e| panic!("{url}: {e}"));
    let status = response.status();
    let text = response.text().await.unwrap();
    assert!(status.is_success(), "{url}: {status} {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{url}: not JSON ({e}): {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_uses_the_dashboard_in_a_real_browser() {
    let script_dir = repo_root().join("tests/ui");
    assert!(
        script_dir.join("node_modules/playwright-core").is_dir(),
        "playwright-core is not installed: run `npm ci` in tests/ui (scripts/test does)"
    );
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    assert!(Path::new(&chromium).exists(), "no Chromium at {chromium}: apt-get install chromium (scripts/test does)");

    let db = TestDb::postgres().await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let port = free_port();
    let config = db.dir.path().join("ferry.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[database]
url = {url:?}
[admin]
listen = "127.0.0.1:{port}"
token = "{TOKEN}"
[plugins]
dir = {plugins:?}
# Reloads happen when the page asks, so the test sees the page's reload load the new version.
watch = false
cache_dir = {cache:?}
[retry]
max_attempts = 1
[route.orders]
plugin = "scripted"
[route.audit]
plugin = "scripted"
"#,
            url = db.url,
            cache = target_dir().join("test-plugin-cache"),
        ),
    )
    .unwrap();
    let log = db.dir.path().join("serve.log");
    let _serve = Serve(spawn_serve(&config, &log));
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    eventually(Duration::from_secs(60), "ferry serve is ready", || async {
        let ready = http.get(format!("{base}/health/ready")).send().await.ok()?;
        ready.status().is_success().then_some(())
    })
    .await;

    // An event that fails for good, with a payload that would run script if it were ever treated
    // as markup, a number beyond a double's precision, and a header; and a binary one.
    let hostile = r#"{"note": "<img src=x onerror=\"window.__pwned=1\">", "amount": 12345678901234567890123}"#;
    // Emitted as an application does, so the payload is stored byte for byte.
    let mut event = ferry::NewEvent::new("orders", "permanent", hostile).with_content_type("application/json");
    event.headers = vec![("x-tenant".into(), "acme".into())];
    let failed_id = crate::common::emit_in_transaction(&db, &event, true).await;
    let binary = call(
        &http,
        reqwest::Method::POST,
        format!("{base}/v1/events"),
        Some(json!({ "route": "audit", "type": "blob", "payload_base64": "AAEC//4=" })),
    )
    .await["id"]
        .as_i64()
        .unwrap();
    // A payload too large to show whole: 300 000 characters of text.
    let huge = call(
        &http,
        reqwest::Method::POST,
        format!("{base}/v1/events"),
        Some(json!({ "route": "audit", "type": "huge", "payload": "x".repeat(300_000) })),
    )
    .await["id"]
        .as_i64()
        .unwrap();
    eventually(Duration::from_secs(30), "the hostile event has failed", || async {
        let event = call(&http, reqwest::Method::GET, format!("{base}/v1/events/{failed_id}"), None).await;
        (event["status"] == "FAILED").then_some(())
    })
    .await;

    // A new version of the plugin waits in the directory for the page's reload.
    let before = call(&http, reqwest::Method::GET, format!("{base}/v1/plugins"), None).await;
    let old_hash = before["plugins"][0]["hash"].as_str().unwrap().to_string();
    install(&plugins.join("scripted.wasm"), &plugin_variant("ferry_test_scripted", "dashboard"));
    // And a file that is no component at all, for the page to report.
    std::fs::write(plugins.join("broken.wasm"), b"not a component").unwrap();

    let shots = target_dir().join("dashboard");
    std::fs::create_dir_all(&shots).unwrap();
    let run = Command::new("node")
        .arg(script_dir.join("dashboard.mjs"))
        .current_dir(&script_dir)
        .env("FERRY_URL", &base)
        .env("FERRY_TOKEN", TOKEN)
        .env("FERRY_FAILED_ID", failed_id.to_string())
        .env("FERRY_BINARY_ID", binary.to_string())
        .env("FERRY_OLD_HASH", &old_hash)
        .env("FERRY_HUGE_ID", huge.to_string())
        .env("FERRY_SHOTS", &shots)
        .env("CHROMIUM", &chromium)
        .stdin(Stdio::null())
        .output()
        .expect("node runs (Node.js 18 or newer)");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    let serve_log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(run.status.success(), "the browser script failed\n{stdout}\n{stderr}\nferry serve's log:\n{serve_log}");
    assert!(stdout.contains("every step passed"), "{stdout}");

    // What the browser did happened in the database, and the screenshots are pictures.
    let event = call(&http, reqwest::Method::GET, format!("{base}/v1/events/{failed_id}"), None).await;
    assert_eq!(event["attempts_history"].as_array().unwrap().len(), 2, "resent once from the page: {event}");
    let after = call(&http, reqwest::Method::GET, format!("{base}/v1/plugins"), None).await;
    assert_ne!(
        after["plugins"][0]["hash"].as_str(),
        Some(old_hash.as_str()),
        "the page's reload loaded the new version"
    );
    let breakers = call(&http, reqwest::Method::GET, format!("{base}/v1/breakers"), None).await;
    assert!(
        breakers.as_array().unwrap().iter().any(|b| b["route"] == "orders" && b["state"] == "closed"),
        "{breakers}"
    );
    for shot in ["sign-in-refused", "overview", "failed", "event", "plugins", "overview-narrow"] {
        let png = std::fs::read(shots.join(format!("{shot}.png"))).unwrap_or_else(|e| panic!("{shot}.png: {e}"));
        assert!(png.starts_with(b"\x89PNG") && png.len() > 5_000, "{shot}.png is a screenshot");
    }
}
