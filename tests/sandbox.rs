//! Plugins that misbehave on purpose: each test shows the host survives, the events get the
//! right outcome and reason, and other routes keep flowing. Plus the sandbox: a plugin reaches
//! only the addresses and directories it was granted, and bad plugin files are refused with a
//! clear reason.

use std::net::TcpListener;
use std::process::Command;
use std::sync::Arc;

use chrono::{TimeZone, Utc};
use ferry::NewEvent;
use ferry::clock::{Clock, ManualClock};
use ferry::event::{EventRecord, Status};
use ferry::service::Ferry;
use tokio_util::sync::CancellationToken;
use tracing::instrument::WithSubscriber as _;

use crate::common::{Backend, Captured, Receiver, TestDb, built_plugin, eventually, plugins_dir};

struct Setup {
    db: TestDb,
    clock: Arc<ManualClock>,
    ferry: Ferry,
}

/// Ferry on SQLite with the scripted plugin on route `s` (a 300 ms timeout plus the sandbox
/// settings `sandbox`) and the log plugin on route `ok`.
async fn setup(sandbox: &str) -> Setup {
    setup_timed("300ms", sandbox).await
}

/// [`setup`] with the scripted plugin's timeout `timeout`.
async fn setup_timed(timeout: &str, sandbox: &str) -> Setup {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted", "ferry_transport_log"]);
    let out = db.dir.path().join("out");
    let config = db.config(&format!(
        r#"
        [plugins]
        dir = {plugins:?}
        [sandbox.scripted]
        timeout = {timeout:?}
        {sandbox}
        [sandbox.log]
        dirs = {{ "/out" = {out:?} }}
        [route.s]
        plugin = "scripted"
        [route.ok]
        plugin = "log"
        config = {{ output = "/out/ok.jsonl" }}
        "#
    ));
    let clock = Arc::new(ManualClock::new(Utc.with_ymd_and_hms(2026, 6, 1, 0, 0, 0).unwrap()));
    let ferry = Ferry::start(&config, clock.clone()).await.expect("ferry starts");
    Setup { db, clock, ferry }
}

impl Setup {
    async fn emit(&self, event: NewEvent) -> i64 {
        self.db.store.insert(&event, self.clock.now()).await.unwrap()
    }

    /// Emits `event` on route `s` next to an event on route `ok`, runs one cycle, and returns the
    /// `s` event's row after checking that the `ok` event was delivered regardless.
    async fn deliver_beside_a_healthy_route(&self, event: NewEvent) -> EventRecord {
        let id = self.emit(event).await;
        let healthy = self.emit(NewEvent::new("ok", "fine", "{}")).await;
        self.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
        assert_eq!(
            self.db.store.get(healthy).await.unwrap().unwrap().status,
            Status::Sent,
            "other routes keep flowing"
        );
        self.db.store.get(id).await.unwrap().unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traps_loops_and_memory_hogs_become_transient_failures() {
    let s = setup("memory = \"16MiB\"").await;
    let cases = [
        ("hog", "plugin exceeded its 16 MiB memory limit"),
        ("spin", "plugin timed out after 300ms"),
        ("trap", "plugin trapped:"),
        ("transient", "scripted transient failure"),
    ];
    for (kind, reason) in cases {
        let row = s.deliver_beside_a_healthy_route(NewEvent::new("s", kind, "{}")).await;
        assert_eq!((row.status, row.attempts), (Status::Pending, 1), "{kind}: retried later");
        let error = row.last_error.unwrap();
        assert!(error.starts_with(reason), "{kind}: {error:?} should start with {reason:?}");
    }
    let row = s.deliver_beside_a_healthy_route(NewEvent::new("s", "permanent", "{}")).await;
    assert_eq!((row.status, row.failure_reason.map(|r| r.as_str())), (Status::Failed, Some("permanent")));
    // After all that, the same plugin still delivers.
    let row = s.deliver_beside_a_healthy_route(NewEvent::new("s", "ok", "{}")).await;
    assert_eq!(row.status, Status::Sent);
    // Each kind of fault is counted for the metrics.
    let stats = s.db.store.stats(s.clock.now(), None, true).await.unwrap();
    let metrics = s.ferry.metrics.render(&stats, &[], &[], std::time::Duration::ZERO);
    for kind in ["out_of_memory", "timeout", "trap"] {
        let line = format!("ferry_plugin_faults_total{{plugin=\"scripted\",kind=\"{kind}\"}} 1");
        assert!(metrics.contains(&line), "{line} missing from:\n{metrics}");
    }
}

/// Random bytes are made in the host's memory first: a plugin may ask for no more than its memory
/// limit in one call. Without that cap wasmtime makes up to 64 MiB, here twice the limit, before
/// the instance runs out of memory receiving them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_cannot_make_the_host_hold_more_random_bytes_than_its_memory() {
    let s = setup("memory = \"16MiB\"").await;
    let random = |bytes: u64| NewEvent::new("s", "random", "{}").with_header("bytes", bytes.to_string());
    let row = s.deliver_beside_a_healthy_route(random(32 << 20)).await;
    assert_eq!((row.status, row.attempts), (Status::Pending, 1));
    let error = row.last_error.unwrap();
    assert!(error.contains("requested len 33554432 exceeds limit 16777216"), "{error}");
    let row = s.deliver_beside_a_healthy_route(random(1 << 20)).await;
    assert_eq!(row.status, Status::Sent, "{:?}", row.last_error);
}

/// The relay's workers are futures of one task. A plugin computing in a loop, far inside its
/// timeout, holds only its own call: the loop gives the task back at every epoch tick, so another
/// worker claims and delivers another route's event meanwhile. Without that, the loop would hold
/// the task, and every worker and route with it, until its timeout trapped it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_spinning_in_its_code_holds_up_no_other_worker() {
    let s = setup_timed("60s", "").await;
    let spinning = s.emit(NewEvent::new("s", "spin", "{}")).await;
    let never = CancellationToken::new();
    let spin = s.ferry.relay.cycle(&never);
    let other_worker = async {
        crate::common::eventually(std::time::Duration::from_secs(30), "the spinning event claimed", || async {
            (s.db.store.get(spinning).await.unwrap().unwrap().status == Status::Processing).then_some(())
        })
        .await;
        let healthy = s.emit(NewEvent::new("ok", "fine", "{}")).await;
        let cycle = s.ferry.relay.cycle(&never).await.expect("the other worker's cycle completes");
        (healthy, cycle)
    };
    // Both in this one task, as the relay runs its workers.
    tokio::select! {
        _ = spin => panic!("the spinning call ended (timed out) before the other worker could deliver"),
        (healthy, cycle) = other_worker => {
            assert_eq!(cycle.claimed, 1, "the other worker claims only the healthy event");
            assert_eq!(s.db.store.get(healthy).await.unwrap().unwrap().status, Status::Sent);
            let row = s.db.store.get(spinning).await.unwrap().unwrap();
            assert_eq!(row.status, Status::Processing, "the spinning call is still running");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_are_reused_then_recycled() {
    let s = setup("instances = 1\nmax_calls = 2").await;
    let mut reasons = Vec::new();
    for _ in 0..5 {
        let row = s.deliver_beside_a_healthy_route(NewEvent::new("s", "count", "{}")).await;
        reasons.push(row.last_error.unwrap());
    }
    // The warmed-up instance serves two calls, then a fresh one takes over, and so on.
    assert_eq!(reasons, ["call 1", "call 2", "call 1", "call 2", "call 1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_reaches_only_its_tcp_allowlist() {
    let allowed = TcpListener::bind("127.0.0.1:0").unwrap();
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let (allowed, other) = (allowed.local_addr().unwrap(), other.local_addr().unwrap());
    let s = setup(&format!("tcp = [\"{allowed}\"]")).await;
    let log = Captured::default();

    let ok = s
        .deliver_beside_a_healthy_route(NewEvent::new("s", "connect", "{}").with_header("addr", allowed.to_string()))
        .with_subscriber(log.subscriber())
        .await;
    assert_eq!(ok.status, Status::Sent, "{:?}", ok.last_error);

    let denied = s
        .deliver_beside_a_healthy_route(NewEvent::new("s", "connect", "{}").with_header("addr", other.to_string()))
        .with_subscriber(log.subscriber())
        .await;
    assert_eq!(denied.status, Status::Failed);
    let error = denied.last_error.unwrap();
    assert!(error.starts_with(&format!("connect {other}: ")), "{error}");
    let log = log.text();
    assert!(log.contains("not on its tcp allowlist") && log.contains(&other.to_string()), "{log}");
    assert!(log.contains("plugin=scripted"), "the warning names the plugin: {log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_without_an_allowlist_reaches_nothing_and_the_attempt_is_logged() {
    let target = TcpListener::bind("127.0.0.1:0").unwrap();
    let target = target.local_addr().unwrap();
    let s = setup("").await;
    let log = Captured::default();
    let denied = s
        .deliver_beside_a_healthy_route(NewEvent::new("s", "connect", "{}").with_header("addr", target.to_string()))
        .with_subscriber(log.subscriber())
        .await;
    assert_eq!(denied.status, Status::Failed);
    let log = log.text();
    assert!(log.contains("not on its tcp allowlist") && log.contains(&target.to_string()), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_sees_only_its_own_directories() {
    let db_dir = tempfile::tempdir().unwrap();
    let data = db_dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("granted.txt"), "yes").unwrap();
    let s = setup(&format!("dirs = {{ \"/data\" = {data:?} }}")).await;
    let read = |path: &str| NewEvent::new("s", "read", "{}").with_header("path", path);

    let granted = s.deliver_beside_a_healthy_route(read("/data/granted.txt")).await;
    assert_eq!(granted.status, Status::Sent, "{:?}", granted.last_error);
    let log = Captured::default();
    for outside in ["/etc/hostname", "/data/../../etc/hostname", "/data/../data/../../../etc/passwd"] {
        let row = s.deliver_beside_a_healthy_route(read(outside)).with_subscriber(log.subscriber()).await;
        assert_eq!(row.status, Status::Failed, "{outside} must not be readable");
        assert!(row.last_error.as_deref().unwrap().starts_with(&format!("read {outside}: ")), "{:?}", row.last_error);
    }
    // Climbing out of a granted directory reaches the host, which refuses and says so.
    let text = log.text();
    assert!(text.contains("denied access to a path outside its directories"), "{text}");
    assert!(text.contains("plugin=scripted") && text.contains("../../etc/hostname"), "{text}");
    // The plugin chooses the path the refusal shows: it is cut and its line breaks escaped, so it
    // can neither forge a log line nor write one of megabytes.
    let forged = Captured::default();
    // Within the 4 096 bytes a path may have, each name within 255.
    let path = format!("/data/../x\nERROR forged line\n{}", format!("{}/", "a".repeat(200)).repeat(15));
    let row = s.deliver_beside_a_healthy_route(read(&path)).with_subscriber(forged.subscriber()).await;
    assert_eq!(row.status, Status::Failed);
    let text = forged.text();
    assert!(text.contains("denied access to a path outside its directories"), "{text}");
    assert!(text.contains("x\\nERROR forged line\\na") && text.contains("more bytes)"), "{text}");
    assert!(!text.lines().any(|line| line.starts_with("ERROR forged")), "{text}");
    assert!(text.len() < 4096, "{} bytes logged", text.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_sees_only_the_environment_it_is_given() {
    let s = setup("env = { GRANTED = \"yes\" }").await;
    let env = |name: &str| NewEvent::new("s", "env", "{}").with_header("name", name);
    let granted = s.deliver_beside_a_healthy_route(env("GRANTED")).await;
    assert_eq!(granted.last_error.as_deref(), Some("env GRANTED=yes"));
    assert!(std::env::var("PATH").is_ok(), "the host has PATH");
    let host_only = s.deliver_beside_a_healthy_route(env("PATH")).await;
    assert_eq!(host_only.last_error.as_deref(), Some("env PATH unset"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_pool_instances_are_allocated_on_demand() {
    // Memory slots of 64 TiB, four for each of the six instances the pool would hold: more
    // address space than a machine has, so the pool cannot be created.
    let s = setup("").await;
    assert!(s.ferry.registry.runtime().pooling, "the pool is used when it can be");
    drop(s);
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let config =
        db.config(&format!("[plugins]\ndir = {plugins:?}\nmemory = \"65536GiB\"\n[route.s]\nplugin = \"scripted\""));
    let ferry = Ferry::start(&config, Arc::new(ferry::clock::SystemClock)).await.expect("ferry starts without a pool");
    assert!(!ferry.registry.runtime().pooling);
    let id = db.store.insert(&NewEvent::new("s", "ok", "{}"), ferry::clock::SystemClock.now()).await.unwrap();
    ferry.relay.cycle(&CancellationToken::new()).await.unwrap();
    assert_eq!(db.store.get(id).await.unwrap().unwrap().status, Status::Sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_plugin_files_are_refused_with_a_reason_and_the_rest_load() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted", "ferry_test_other_world"]);
    std::fs::write(plugins.join("garbage.wasm"), "this is not webassembly").unwrap();
    let config = db.config(&format!("[plugins]\ndir = {plugins:?}\n[route.s]\nplugin = \"scripted\""));
    let ferry = Ferry::start(&config, Arc::new(ferry::clock::SystemClock)).await.expect("ferry starts anyway");
    let (loaded, errors) = ferry.registry.status();
    assert_eq!(loaded.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["scripted"]);
    assert_eq!(loaded[0].routes, ["s"]);
    let garbage = &errors[&plugins.join("garbage.wasm")];
    assert!(garbage.contains("is not a valid wasm component"), "{garbage}");
    let other = &errors[&plugins.join("ferry_test_other_world.wasm")];
    assert!(other.contains("does not export the ferry:transport world"), "{other}");

    // The same verdicts from the command line, with exit codes.
    let check = |file: &std::path::Path| {
        Command::new(crate::common::ferry_bin()).args(["plugins", "check"]).arg(file).output().unwrap()
    };
    let good = check(&built_plugin("ferry_test_scripted"));
    assert!(good.status.success());
    assert!(String::from_utf8_lossy(&good.stdout).contains("\"scripted\""));
    for (file, message) in [
        (plugins.join("garbage.wasm"), "is not a valid wasm component"),
        (plugins.join("ferry_test_other_world.wasm"), "does not export the ferry:transport world"),
        (plugins.join("missing.wasm"), "reading plugin"),
    ] {
        let out = check(&file);
        assert_eq!(out.status.code(), Some(1), "{}", file.display());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_list_shows_versions_routes_and_errors() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    std::fs::write(plugins.join("broken.wasm"), [0, 97, 115, 109]).unwrap();
    let config_path = db.dir.path().join("ferry.toml");
    std::fs::write(&config_path, format!("[plugins]\ndir = {plugins:?}\n[route.a]\nplugin = \"scripted\"")).unwrap();
    let out = Command::new(crate::common::ferry_bin())
        .arg("--config")
        .arg(&config_path)
        .args(["plugins", "list", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let scripted = &list["plugins"][0];
    assert_eq!((scripted["name"].as_str(), scripted["routes"][0].as_str()), (Some("scripted"), Some("a")));
    assert_eq!(scripted["hash"].as_str().unwrap().len(), 64);
    let broken = list["errors"][plugins.join("broken.wasm").display().to_string()].as_str().unwrap();
    assert!(broken.contains("not a valid wasm component"), "{broken}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasi_http_reaches_only_allowed_origins_with_the_right_host_header() {
    let allowed_receiver = Receiver::start().await;
    let other_receiver = Receiver::start().await;
    let (allowed, other) = (allowed_receiver.addr, other_receiver.addr);
    let s = setup(&format!("http = [\"http://{allowed}\"]")).await;
    let get = |authority: std::net::SocketAddr| {
        NewEvent::new("s", "http", "{}").with_header("authority", authority.to_string())
    };

    let ok = s.deliver_beside_a_healthy_route(get(allowed)).await;
    assert_eq!(ok.status, Status::Sent, "{:?}", ok.last_error);
    let request = &allowed_receiver.requests()[0];
    assert_eq!((request.method.as_str(), request.path.as_str()), ("GET", "/"));
    assert_eq!(request.header("host"), Some(allowed.to_string().as_str()), "the Host header names the origin");

    let denied = s.deliver_beside_a_healthy_route(get(other)).await;
    assert_eq!(denied.status, Status::Failed);
    let error = denied.last_error.unwrap();
    assert!(error.starts_with(&format!("http {other}: ")) && error.contains("HttpRequestDenied"), "{error}");
    assert!(other_receiver.requests().is_empty(), "nothing reached the origin that is not allowed");
}

/// The pool keeps connections per authority as written. A plugin spelling its one allowed origin
/// endlessly (`127.0.0.1:0PORT`, `127.0.0.1:00PORT`, …, all the same origin to the allowlist)
/// would keep a connection open for each spelling, and so as many sockets as it likes: its
/// requests go out respelled, on the origin's shared connections, and name it as the allowlist
/// does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spellings_of_one_origin_share_its_connections() {
    let receiver = Receiver::start().await;
    let (ip, port) = (receiver.addr.ip(), receiver.addr.port());
    let s = setup(&format!("http = [\"http://{}\"]", receiver.addr)).await;
    for zeros in 1..=20 {
        let authority = format!("{ip}:{}{port}", "0".repeat(zeros));
        let row = s
            .deliver_beside_a_healthy_route(NewEvent::new("s", "http", "{}").with_header("authority", authority))
            .await;
        assert_eq!(row.status, Status::Sent, "{zeros} zeros: {:?}", row.last_error);
    }
    let requests = receiver.requests();
    assert_eq!(requests.len(), 20);
    let addr = receiver.addr.to_string();
    assert!(requests.iter().all(|r| r.header("host") == Some(addr.as_str())), "each names the origin as allowed");
    // Twenty requests one after the other: one connection, reused (one more, at most, if a request
    // set out before the last one's connection was back in the pool).
    assert!(receiver.connections() <= 2, "{} connections for 20 spellings", receiver.connections());
}

/// hyper keeps each origin's idle connections open for a minute after its last request, and a
/// plugin granted `*.domain` names endless origins: a connection to each would hold as many of the
/// host's open files as the plugin likes. Over all its origins a plugin has at most
/// `http_open_connections` open; at that, those of the origins it used least recently are
/// closed to make room. Here a plugin allowed 4 sends to 12 origins in turn: the last 4 keep theirs, the others
/// are closed, and only a request to an origin used earlier opens a connection anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_keeps_no_more_connections_open_than_its_sandbox_allows() {
    use std::time::Duration;
    let mut receivers = Vec::new();
    for _ in 0..12 {
        receivers.push(Receiver::start().await);
    }
    let origins: Vec<String> = receivers.iter().map(|r| format!("\"http://{}\"", r.addr)).collect();
    let s = setup(&format!("http = [{}]\nhttp_open_connections = 4", origins.join(", "))).await;
    let get = async |n: usize| {
        let event = NewEvent::new("s", "http", "{}").with_header("authority", receivers[n].addr.to_string());
        let row = s.deliver_beside_a_healthy_route(event).await;
        assert_eq!(row.status, Status::Sent, "origin {n}: {:?}", row.last_error);
    };
    // A connection closes once its client's task has seen its pool go: soon, not at once.
    let settled = async |expected: [usize; 12]| {
        let what = format!("open connections per origin to be {expected:?}");
        let open = || receivers.iter().map(Receiver::open).collect::<Vec<_>>();
        eventually(Duration::from_secs(5), &what, || async { (open() == expected).then_some(()) }).await;
    };
    for n in 0..12 {
        get(n).await;
    }
    settled([0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]).await;
    assert!(receivers.iter().all(|r| r.connections() == 1), "one connection per origin so far");
    // Origin 11 is used again, on its kept connection; origin 0, whose connection was closed,
    // opens one, and origin 8, now the one used least recently, is closed for it.
    get(11).await;
    assert_eq!(receivers[11].connections(), 1, "a kept connection is reused");
    get(0).await;
    assert_eq!(receivers[0].connections(), 2, "a closed one is opened anew");
    settled([1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]).await;
}

/// A runtime of two workers whose blocking pool has four threads, few enough for a test to keep
/// them all busy.
fn four_blocking_threads() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).max_blocking_threads(4).enable_all().build().unwrap()
}

/// A plugin granted `dns` floods the resolver: ten thousand lookups, each dropped as soon as it is
/// started. Dropping one does not stop its getaddrinfo, which holds one of the host's blocking
/// threads until it returns, the threads the host's own lookups and file access use; here those
/// threads are kept busy meanwhile, as names no server answers would keep them. At most 8 of a
/// plugin's lookups are waiting or running at once; the rest are refused at once, as by a busy
/// resolver, and once the threads are free the plugin's lookups are answered again. Without the
/// grant, no lookup is.
#[test]
fn a_plugin_cannot_flood_the_hosts_resolver() {
    let runtime = four_blocking_threads();
    runtime.block_on(async {
        let resolve = |count: &str| {
            NewEvent::new("s", "resolve", "{}").with_header("name", "localhost").with_header("count", count.to_string())
        };
        let s = setup_timed("20s", "dns = true").await;
        let busy_for = std::time::Duration::from_secs(3);
        let busy: Vec<_> = (0..4).map(|_| tokio::task::spawn_blocking(move || std::thread::sleep(busy_for))).collect();
        let reason = s.deliver_beside_a_healthy_route(resolve("10000")).await.last_error.unwrap();
        // Without the bound every lookup is queued, and none refused.
        assert!(reason.starts_with("refused 9992 of 10000; then: "), "{reason}");
        assert!(reason.contains("Ipv4((127, 0, 0, 1))"), "{reason}");
        for thread in busy {
            thread.await.unwrap();
        }

        let s = setup("").await;
        let reason = s.deliver_beside_a_healthy_route(resolve("0")).await.last_error.unwrap();
        assert!(reason.starts_with("refused 0 of 0; then: error"), "{reason}");
        assert!(reason.contains("permanent-resolver-failure"), "{reason}");
    });
}

/// The same flood through wasi:http: a plugin granted a wildcard origin names ten thousand origins,
/// one request each, dropping each hundred a millisecond after starting them. Each new origin's
/// connection looks its name up on the host's blocking threads, kept busy here meanwhile. The
/// lookups of a plugin's connections take the same 8 slots as its own, so at most 8 are queued
/// (and the plugin's own lookup, made after the flood, finds them all taken); without them all
/// ten thousand would be, and the host's own blocking work, queued after the flood, would wait
/// for every one of them: 2 500 lookups' time on four threads.
#[test]
fn a_plugin_cannot_flood_the_hosts_resolver_through_wasi_http() {
    use std::time::{Duration, Instant};
    let runtime = four_blocking_threads();
    let outcome = runtime.block_on(async {
        let domain = "flood.invalid";
        let s = setup_timed("60s", &format!("http = [\"http://*.{domain}\"]\ndns = true")).await;
        // What a lookup of a name no one answers takes here, the slowest of three.
        let mut slowest = Duration::ZERO;
        for n in 0..3 {
            let name = format!("probe-{n}.{domain}");
            let started = Instant::now();
            tokio::task::spawn_blocking(move || std::net::ToSocketAddrs::to_socket_addrs(&(name.as_str(), 80)).is_ok())
                .await
                .unwrap();
            slowest = slowest.max(started.elapsed());
        }
        let releases: Vec<_> = (0..4)
            .map(|_| {
                let (release, wait) = std::sync::mpsc::channel::<()>();
                tokio::task::spawn_blocking(move || wait.recv_timeout(Duration::from_secs(60)));
                release
            })
            .collect();
        let flood = NewEvent::new("s", "http-flood", "{}").with_header("domain", domain).with_header("count", "10000");
        let id = s.emit(flood).await;
        s.ferry.relay.cycle(&CancellationToken::new()).await.expect("the cycle completes");
        let row = s.db.store.get(id).await.unwrap().unwrap();
        let reason = row.last_error.unwrap_or_default();
        // Checked without panicking, here and below: a panic would drop the runtime, which waits
        // for every lookup queued.
        if !reason.starts_with("started 10000 of 10000; own lookup: ") || !reason.contains("temporary-resolver-failure")
        {
            return Err(format!("the flood's lookups should hold every slot: {reason}"));
        }

        // Queued now, the host's own blocking work waits for what the flood queued before it.
        let probe = tokio::task::spawn_blocking(Instant::now);
        let released = Instant::now();
        for release in releases {
            let _ = release.send(());
        }
        // With the bound at most 8 lookups, two rounds on four threads, are ahead of it: the limit
        // is a hundred times that (room for lookups that wait for the resolver's retry), where ten
        // thousand lookups would take 2 500 times as long as one.
        let limit = (slowest * 200).clamp(Duration::from_secs(1), Duration::from_secs(60));
        let Ok(ran) = tokio::time::timeout(limit, probe).await else {
            return Err(format!("the host's blocking work waited more than {limit:?} behind the plugin's lookups"));
        };
        assert!(ran.unwrap() >= released);
        let row = s.deliver_beside_a_healthy_route(NewEvent::new("s", "fine", "{}")).await;
        assert_eq!(row.status, Status::Sent);
        Ok(())
    });
    // A failure leaves the flood's lookups queued: they are not waited for.
    runtime.shutdown_background();
    outcome.unwrap();
}

/// A server's response head is read up to 16 KiB, what a plugin's own header fields may hold:
/// a longer one (here 40 KiB in one header) fails the request, so a plugin cannot keep many such
/// heads in the host's memory; a head within it is answered as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasi_http_refuses_a_response_head_longer_than_a_plugins_fields() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut n = 0;
        while let Ok((mut socket, _)) = listener.accept().await {
            // The first answer's head is 40 KiB, the next ones' 4 KiB.
            let value = "v".repeat(if n == 0 { 40 << 10 } else { 4 << 10 });
            n += 1;
            tokio::spawn(async move {
                let mut request = [0; 4096];
                let _ = socket.read(&mut request).await;
                let head =
                    format!("HTTP/1.1 200 OK\r\nx-big: {value}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                let _ = socket.write_all(head.as_bytes()).await;
            });
        }
    });
    let s = setup(&format!("http = [\"http://{addr}\"]")).await;
    let get = || NewEvent::new("s", "http", "{}").with_header("authority", addr.to_string());
    let refused = s.deliver_beside_a_healthy_route(get()).await;
    assert_eq!(refused.status, Status::Failed, "{:?}", refused.last_error);
    let error = refused.last_error.unwrap();
    assert!(error.starts_with(&format!("http {addr}: ")) && error.contains("HttpResponseHeaderSectionSize"), "{error}");
    let ok = s.deliver_beside_a_healthy_route(get()).await;
    assert_eq!(ok.status, Status::Sent, "a head within the limit: {:?}", ok.last_error);
}

/// A host name on the allowlist that resolves to a loopback, private or metadata address (as one
/// whose DNS answer an attacker changed after it was allowed would) is not connected to: the
/// address is checked when the connection is made. The sandbox's `http_private` allows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wasi_http_does_not_follow_a_host_name_to_a_private_address() {
    let receiver = Receiver::start().await;
    let name = format!("localhost:{}", receiver.addr.port());
    let get = || NewEvent::new("s", "http", "{}").with_header("authority", name.clone());
    let s = setup(&format!("http = [\"http://{name}\"]")).await;
    let refused = s.deliver_beside_a_healthy_route(get()).await;
    assert_eq!(refused.status, Status::Failed);
    let error = refused.last_error.unwrap();
    assert!(error.starts_with(&format!("http {name}: ")) && error.contains("DestinationIpProhibited"), "{error}");
    assert!(receiver.requests().is_empty(), "nothing reached the loopback address");

    let s = setup(&format!("http = [\"http://{name}\"]\nhttp_private = true")).await;
    let allowed = s.deliver_beside_a_healthy_route(get()).await;
    assert_eq!(allowed.status, Status::Sent, "{:?}", allowed.last_error);
    assert_eq!(receiver.requests().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_of_one_route_use_several_instances_at_once() {
    // Two instances: the batches run side by side, each on its own instance's first call, and
    // neither waits for an instance. The second instance is started for the second batch, after
    // the one started at start-up.
    let seen = calls_seen_with(2, "500", None).await;
    assert_eq!(seen.reasons, ["call 1", "call 1"]);
    assert_eq!(seen.waits.0, 2, "every call's wait is counted, a wait of nothing included");
    assert!(seen.waits.1 < 0.25, "two instances for two batches: no call waits for one, yet {} s in all", seen.waits.1);
    assert_eq!(seen.starts.0, 2, "the instance of start-up and the second batch's are timed");
    // One instance: the second batch waits for it (the first call's 500 ms) and is its second
    // call; the wait shows in the histogram, as it shows in no call's duration.
    let seen = calls_seen_with(1, "500", None).await;
    assert_eq!(seen.reasons, ["call 1", "call 2"]);
    assert_eq!(seen.waits.0, 2);
    assert!(seen.waits.1 > 0.25, "the second call waited for most of the first's 500 ms: {} s counted", seen.waits.1);
    assert_eq!(seen.starts.0, 1, "one instance, started once, served both calls");
    assert_eq!(seen.calls.0, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wait_for_an_instance_that_shutdown_cuts_short_is_counted() {
    // One instance and calls of 10 s: one batch is in its call and the other waits for the
    // instance when ferry is asked to stop. Shutdown's grace (300 ms) ends both; the call and the
    // wait are counted with the time they took up to then, though neither finished.
    let seen = calls_seen_with(1, "10000", Some(std::time::Duration::from_millis(300))).await;
    assert!(seen.reasons.is_empty(), "both batches were handed back: {:?}", seen.reasons);
    assert_eq!(seen.waits.0, 2, "the wait cut short is counted beside the first batch's wait of nothing");
    assert!(seen.waits.1 >= 0.3, "the second batch waited through the 300 ms of grace at least: {} s", seen.waits.1);
    // The workers share one grace period, and no call begins after it: the instance the first
    // batch gives back is not taken by the second. (Before that was so, their grace periods began
    // microseconds apart and this held all but always; the next test is the one that tells.)
    assert_eq!(seen.calls.0, 1, "only the call in flight at the stop is counted; the waiting one never started");
    assert!(seen.calls.1 >= 0.3, "it ran through the grace period at least: {} s", seen.calls.1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_claimed_after_the_grace_period_is_handed_back_without_a_call() {
    // One of the route's two instances busy with a call of 10 s (carried on beside the workers
    // after its first second), when ferry is asked to stop with 300 ms of grace; the workers'
    // claims are held up (the test holds SQLite's write lock) until the grace has ended. The batch
    // one of them then gets is handed back unopened: with a grace period of its own from when its
    // claim came back, it would take the idle instance and call the plugin after ferry's grace
    // was over.
    //
    // In about one run in twenty the lock catches the idle worker before its claim, at a step
    // not yet pinned down; it then sees the stop and claims nothing, which is right but not this
    // case. Such a run is told by the claims counted and tried again, three times at most.
    for _ in 0..3 {
        if grace_period_run().await {
            return;
        }
    }
    panic!("in three runs the lock never held up the idle worker's claim itself");
}

/// One run of the test above; false when no worker made a claim while the lock was held.
async fn grace_period_run() -> bool {
    let db = TestDb::new(Backend::Sqlite).await;
    // Two instances: with one, the route would be left out of the claims while its one call runs.
    let mut config = two_workers_one_route(&db, 2, "10000", std::time::Duration::from_millis(300));
    // Recovery only at start: the idle worker's next write after the lock is taken is its claim.
    config.relay.recover_every = 1_000_000;
    let first = db.store.insert(&NewEvent::new("s", "count", "{}"), ferry::clock::SystemClock.now()).await.unwrap();
    let running = crate::common::Running::start(&config).await;
    crate::common::eventually(std::time::Duration::from_secs(20), "the first event claimed", || async {
        (crate::common::count(&db.store, Status::Processing).await == 1).then_some(())
    })
    .await;
    let labels = ferry::metrics::PluginLabels { plugin: "scripted".into() };
    let calls = running.registry.metrics().plugin_call_duration.get_or_create(&labels).clone();
    let batches = running.registry.metrics().batch_size.clone();
    let claims = running.registry.metrics().claim_duration.clone();

    let mut lock = db.sqlite.as_ref().unwrap().pool().acquire().await.unwrap();
    sqlx::query("BEGIN IMMEDIATE").execute(&mut *lock).await.unwrap();
    // Due a minute ago: a worker's claim may have read its clock before the lock was
    // taken, and an event due at the insert's own time would not yet be due to that claim.
    let second: i64 = sqlx::query_scalar(
        "INSERT INTO ferry_events (route, event_type, payload, next_attempt_at)
         VALUES ('s', 'count', x'7b7d', CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER) - 60000)
         RETURNING id",
    )
    .fetch_one(&mut *lock)
    .await
    .unwrap();
    // The idle workers (the first is free again once its call has gone aside) poll every 20 ms
    // at most, so they soon wait for the lock; from then on neither completes a claim until the
    // lock is let go.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let claims_held = claims.count();
    let stopping = tokio::spawn(running.stop());
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    assert!(!stopping.is_finished(), "the first batch's release waits for the lock too");
    sqlx::query("COMMIT").execute(&mut *lock).await.unwrap();
    drop(lock);
    tokio::time::timeout(std::time::Duration::from_secs(20), stopping).await.expect("ferry stops").unwrap();

    // Whichever step the lock held up, the plugin was called for the first event only and both
    // events are handed back.
    assert_eq!(calls.count(), 1, "the plugin was called for the first event only");
    for id in [first, second] {
        let event = db.store.get(id).await.unwrap().unwrap();
        assert_eq!((event.status, event.attempts), (Status::Pending, 0), "event {id} is handed back");
    }
    if claims.count() == claims_held {
        return false;
    }
    let late = claims.count() - claims_held;
    assert!((1..=2).contains(&late), "only the claims the lock held end after the stop, one per worker: {late}");
    assert_eq!(batches.count(), 2, "a claim held up by the lock came back with an event");
    true
}

/// A call that waited for an instance until too little of its claim's lease was left for it is
/// not begun: its event waits a moment, no attempt counted, and is delivered by a later claim.
/// Begun, the call could still run when the lease ended and recovery handed the event to another
/// instance of ferry, which would deliver it a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_call_that_waited_for_an_instance_past_its_lease_is_not_begun() {
    let db = TestDb::new(Backend::Sqlite).await;
    // One instance and calls of 2.5 s, a timeout of 3 s and a lease of 4 s: the second worker's
    // batch has its instance 2.5 s into its claim, when a call could end 1.5 s past the lease.
    let mut config = two_workers_one_route(&db, 1, "2500", std::time::Duration::from_secs(10));
    config.plugins.timeout = ferry::config::Dur(std::time::Duration::from_secs(3));
    config.relay.lease = ferry::config::Dur(std::time::Duration::from_secs(4));
    let mut inserted = Vec::new();
    for _ in 0..2 {
        let event = NewEvent::new("s", "count", "{}");
        inserted.push(db.store.insert(&event, ferry::clock::SystemClock.now()).await.unwrap());
    }
    let running = crate::common::Running::start(&config).await;
    crate::common::eventually(std::time::Duration::from_secs(30), "both events answered", || async {
        (crate::common::count(&db.store, Status::Failed).await == 2).then_some(())
    })
    .await;
    let metrics = running.metrics.clone();
    running.stop().await;
    let stats = db.store.stats(ferry::clock::SystemClock.now(), None, true).await.unwrap();
    let metrics = metrics.render(&stats, &[], &[], std::time::Duration::ZERO);
    let held = "ferry_events_held_total{route=\"s\",plugin=\"scripted\",reason=\"lease\"} 1";
    assert!(metrics.contains(held), "{held} missing from:\n{metrics}");
    let mut histories = Vec::new();
    for id in inserted {
        let event = db.store.get(id).await.unwrap().unwrap();
        let attempts = db.store.attempts(id).await.unwrap();
        histories.push((event, attempts));
    }
    // Each worker claimed one event; the one whose worker waited for the instance has a deferral
    // first, saying why, and was then delivered in the instance's second call.
    histories.sort_by_key(|(_, attempts)| attempts.len());
    let [(first, once), (second, twice)] = &histories[..] else { unreachable!() };
    assert_eq!(once.len(), 1, "the first event was delivered at once: {once:?}");
    assert_eq!((first.attempts, first.last_error.as_deref()), (1, Some("call 1")));
    assert_eq!(twice.len(), 2, "the second event was deferred, then delivered: {twice:?}");
    let (deferral, delivery) = (&twice[0], &twice[1]);
    assert_eq!(deferral.outcome, ferry::event::AttemptOutcome::Deferred, "{deferral:?}");
    let why = deferral.error.as_deref().unwrap_or_default();
    assert!(why.contains("for one of plugin scripted's 1 instances") && why.contains("relay.lease"), "{why}");
    assert_eq!(deferral.plugin_hash, None, "no version answered: the call was not begun");
    assert_eq!(delivery.outcome, ferry::event::AttemptOutcome::Failed);
    assert_eq!((second.attempts, second.last_error.as_deref()), (1, Some("call 2")), "the deferral cost no attempt");
}

/// Ferry with two workers claiming one event at a time, a shutdown grace period of `grace`, and
/// route `s` on the scripted plugin with `instances` instances, answering after `delay_ms`.
fn two_workers_one_route(
    db: &TestDb,
    instances: u32,
    delay_ms: &str,
    grace: std::time::Duration,
) -> ferry::config::Config {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    db.config(&format!(
        r#"
        [relay]
        batch_size = 1
        workers = 2
        poll_interval = "10ms"
        idle_poll_max = "20ms"
        shutdown_grace = "{}ms"
        [plugins]
        dir = {plugins:?}
        [sandbox.scripted]
        instances = {instances}
        [route.s]
        plugin = "scripted"
        config = {{ delay_ms = "{delay_ms}" }}
        "#,
        grace.as_millis()
    ))
}

/// What [`calls_seen_with`] saw: the reasons the events failed with (`call N` per instance), and
/// the number and total seconds of `ferry_plugin_instance_wait_seconds`,
/// `ferry_plugin_call_duration_seconds` and `ferry_plugin_instance_start_seconds`.
struct Seen {
    reasons: Vec<String>,
    waits: (u64, f64),
    calls: (u64, f64),
    starts: (u64, f64),
}

/// Runs two `count` events, each answered after `delay_ms`, through ferry with two workers and
/// `instances` instances of the plugin, and reports what was seen (see [`Seen`]). With `stop_after`,
/// ferry is stopped with that grace period 200 ms after both events are claimed; without, once
/// both have been answered.
async fn calls_seen_with(instances: u32, delay_ms: &str, stop_after: Option<std::time::Duration>) -> Seen {
    let db = TestDb::new(Backend::Sqlite).await;
    let config =
        two_workers_one_route(&db, instances, delay_ms, stop_after.unwrap_or(std::time::Duration::from_secs(10)));
    let mut ids = Vec::new();
    for _ in 0..2 {
        ids.push(db.store.insert(&NewEvent::new("s", "count", "{}"), ferry::clock::SystemClock.now()).await.unwrap());
    }
    let running = crate::common::Running::start(&config).await;
    let (awaited, status) = match stop_after {
        None => ("both events answered", Status::Failed),
        Some(_) => ("both events claimed", Status::Processing),
    };
    crate::common::eventually(std::time::Duration::from_secs(20), awaited, || async {
        (crate::common::count(&db.store, status).await == 2).then_some(())
    })
    .await;
    if stop_after.is_some() {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let labels = ferry::metrics::PluginLabels { plugin: "scripted".into() };
    let metrics = running.registry.metrics();
    let wait = metrics.plugin_instance_wait.get_or_create(&labels).clone();
    let call = metrics.plugin_call_duration.get_or_create(&labels).clone();
    let start = metrics.plugin_instance_start.get_or_create(&labels).clone();
    running.stop().await;
    let mut reasons = Vec::new();
    for id in ids {
        let event = db.store.get(id).await.unwrap().unwrap();
        if stop_after.is_some() {
            assert_eq!(event.status, Status::Pending, "a batch cut short by shutdown is handed back");
        }
        reasons.extend(event.last_error);
    }
    reasons.sort();
    Seen {
        reasons,
        waits: (wait.count(), wait.sum()),
        calls: (call.count(), call.sum()),
        starts: (start.count(), start.sum()),
    }
}
