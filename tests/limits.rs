//! Resource limits as attacks: hostile components, written here in the WebAssembly text format
//! or driven through the `scripted` plugin, try to make the host allocate far more than a plugin's
//! limits allow — many memories at once, every slot of the instance pool, host-side wasi:http
//! objects. Where memory matters, the tests measure the peak resident set of a real `ferry serve`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry::NewEvent;
use ferry::clock::Clock as _;
use ferry::event::{EventRecord, Status};

use crate::common::{
    Backend, Stepped, TestDb, eventually, plugins_dir, spawn_serve, spawn_serve_with_open_files, target_dir,
};

/// A transport component reporting the name `name`, whose `deliver-batch` answers success for
/// every event, and which also holds `hogs` core instances, each with a linear memory of its own
/// that its start function grows by `grow_mib` MiB and fills (trapping if the growth is refused),
/// and `idle` core instances of an empty module.
fn hostile(name: &str, hogs: usize, grow_mib: u32, idle: usize) -> Vec<u8> {
    let mut text = String::from("(component\n");
    text.push_str(&format!(
        "(core module $hog (memory 1)
           (func $start
             (if (i32.eq (memory.grow (i32.const {pages})) (i32.const -1)) (then unreachable))
             (memory.fill (i32.const 0) (i32.const 1) (i32.const {bytes})))
           (start $start))
         (core module $idle)\n",
        pages = grow_mib * 16,
        bytes = grow_mib << 20,
    ));
    text.push_str(&"(core instance (instantiate $hog))\n".repeat(hogs));
    text.push_str(&"(core instance (instantiate $idle))\n".repeat(idle));
    text.push_str(&TRANSPORT.replace("NAME_LEN", &format!("\\{:02x}", name.len())).replace("NAME", name));
    text.push(')');
    wat::parse_str(&text).expect("the hostile component is valid")
}

/// A transport component reporting the name `name`, whose `deliver-batch` answers `count`
/// outcomes whatever it was given, each `permanent` with a reason of `reason_mib` MiB, and every
/// reason the same bytes of its memory: a few bytes of the plugin's, `count` copies on the host.
fn aliasing(name: &str, count: u32, reason_mib: u32) -> Vec<u8> {
    const DELIVER: &str = r#"(func (export "deliver-batch") (param i32 i32) (result i32)
      (global.set $next (i32.const 1024))
      (i32.store (i32.const 80) (i32.const 32768))
      (i32.store (i32.const 84) (local.get 1))
      (i32.const 80)))"#;
    // An outcome takes 32 bytes: its case at 0, the failure's reason (pointer, length) at 8 and
    // 12, and its retry-after option's case at 16. The reason's bytes start at 64 KiB.
    let answer = format!(
        r#"(func (export "deliver-batch") (param i32 i32) (result i32)
      (local $i i32) (local $at i32)
      (global.set $next (i32.const 1024))
      (if (i32.lt_u (memory.size) (i32.const {pages}))
        (then (drop (memory.grow (i32.sub (i32.const {pages}) (memory.size))))))
      (block $done (loop $each
        (br_if $done (i32.ge_u (local.get $i) (i32.const {count})))
        (local.set $at (i32.add (i32.const 32768) (i32.mul (local.get $i) (i32.const 32))))
        (i32.store8 (local.get $at) (i32.const 2))
        (i32.store (i32.add (local.get $at) (i32.const 8)) (i32.const 65536))
        (i32.store (i32.add (local.get $at) (i32.const 12)) (i32.const {bytes}))
        (i32.store8 (i32.add (local.get $at) (i32.const 16)) (i32.const 0))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $each)))
      (i32.store (i32.const 80) (i32.const 32768))
      (i32.store (i32.const 84) (i32.const {count}))
      (i32.const 80)))"#,
        pages = 1 + reason_mib * 16,
        bytes = reason_mib << 20,
    );
    assert!(TRANSPORT.contains(DELIVER));
    let transport = TRANSPORT.replace(DELIVER, &answer);
    let text = format!(
        "(component\n{})",
        transport.replace("NAME_LEN", &format!("\\{:02x}", name.len())).replace("NAME", name)
    );
    wat::parse_str(&text).expect("the aliasing component is valid")
}

/// The `ferry:transport/transport` export in the text format: a core module with one page of
/// memory (plugin-info at 0, the name at 16, the version at 48, init's result at 64,
/// deliver-batch's list at 80, outcomes from 32768, a bump allocator from 1024), its functions
/// lifted, and a nested component that exports them with named types, as wit-component does.
const TRANSPORT: &str = r#"
  (core module $main
    (memory (export "memory") 1)
    (global $next (mut i32) (i32.const 1024))
    (func (export "realloc") (param i32 i32 i32 i32) (result i32)
      (local $at i32)
      (local.set $at (i32.and (i32.add (global.get $next) (i32.const 7)) (i32.const -8)))
      (global.set $next (i32.add (local.get $at) (local.get 3)))
      (local.get $at))
    (data (i32.const 0) "\10\00\00\00NAME_LEN\00\00\00\30\00\00\00\05\00\00\00")
    (data (i32.const 16) "NAME")
    (data (i32.const 48) "0.1.0")
    (func (export "metadata") (result i32) (i32.const 0))
    (func (export "init") (param i32 i32) (result i32)
      (global.set $next (i32.const 1024))
      (i32.const 64))
    (func (export "deliver-batch") (param i32 i32) (result i32)
      (global.set $next (i32.const 1024))
      (i32.store (i32.const 80) (i32.const 32768))
      (i32.store (i32.const 84) (local.get 1))
      (i32.const 80)))
  (core instance $m (instantiate $main))
  (type $failure (record (field "reason" string) (field "retry-after-ms" (option u64))))
  (type $event (record
    (field "id" u64) (field "event-type" string) (field "route" string)
    (field "ordering-key" (option string)) (field "payload" (list u8))
    (field "content-type" string) (field "headers" (list (tuple string string)))
    (field "attempt" u32) (field "event-time" s64)))
  (type $outcome (variant (case "success") (case "transient" $failure) (case "permanent" $failure)))
  (type $plugin-info (record (field "name" string) (field "version" string)))
  (func $metadata (result $plugin-info)
    (canon lift (core func $m "metadata") (memory $m "memory") (realloc (func $m "realloc"))))
  (func $init (param "config" (list (tuple string string))) (result (result (error string)))
    (canon lift (core func $m "init") (memory $m "memory") (realloc (func $m "realloc"))))
  (func $deliver (param "events" (list $event)) (result (list $outcome))
    (canon lift (core func $m "deliver-batch") (memory $m "memory") (realloc (func $m "realloc"))))
  (component $wrap
    (type $failure-t (record (field "reason" string) (field "retry-after-ms" (option u64))))
    (import "import-type-failure" (type $failure-i (eq $failure-t)))
    (type $event-t (record
      (field "id" u64) (field "event-type" string) (field "route" string)
      (field "ordering-key" (option string)) (field "payload" (list u8))
      (field "content-type" string) (field "headers" (list (tuple string string)))
      (field "attempt" u32) (field "event-time" s64)))
    (import "import-type-event" (type $event-i (eq $event-t)))
    (type $outcome-t (variant (case "success") (case "transient" $failure-i) (case "permanent" $failure-i)))
    (import "import-type-outcome" (type $outcome-i (eq $outcome-t)))
    (type $info-t (record (field "name" string) (field "version" string)))
    (import "import-type-plugin-info" (type $info-i (eq $info-t)))
    (import "import-func-metadata" (func $metadata (result $info-i)))
    (import "import-func-init"
      (func $init (param "config" (list (tuple string string))) (result (result (error string)))))
    (import "import-func-deliver-batch"
      (func $deliver (param "events" (list $event-i)) (result (list $outcome-i))))
    (export $failure "failure" (type $failure-t))
    (export $event "event" (type $event-t))
    (type $outcome-e (variant (case "success") (case "transient" $failure) (case "permanent" $failure)))
    (export $outcome "outcome" (type $outcome-e))
    (export $info "plugin-info" (type $info-t))
    (export "metadata" (func $metadata) (func (result $info)))
    (export "init" (func $init)
      (func (param "config" (list (tuple string string))) (result (result (error string)))))
    (export "deliver-batch" (func $deliver) (func (param "events" (list $event)) (result (list $outcome)))))
  (instance $transport (instantiate $wrap
    (with "import-type-failure" (type $failure))
    (with "import-type-event" (type $event))
    (with "import-type-outcome" (type $outcome))
    (with "import-type-plugin-info" (type $plugin-info))
    (with "import-func-metadata" (func $metadata))
    (with "import-func-init" (func $init))
    (with "import-func-deliver-batch" (func $deliver))))
  (export "ferry:transport/transport@0.1.0" (instance $transport))
"#;

/// The peak resident set of process `pid` so far, in MiB.
fn peak_rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kib >> 10
}

/// A `ferry serve` process of a test, killed when dropped.
struct Served {
    child: std::process::Child,
    log: PathBuf,
}

impl Served {
    /// Starts `ferry serve` on `db` with `config` (TOML after the database and relay sections).
    fn start(db: &TestDb, config: &str) -> Served {
        Served::start_with(db, config, spawn_serve)
    }

    /// [`Served::start`], spawned by `spawn`, given the config file and the log.
    fn start_with(db: &TestDb, config: &str, spawn: impl FnOnce(&Path, &Path) -> std::process::Child) -> Served {
        let path = db.dir.path().join("ferry.toml");
        let text = format!(
            // Some routes here have no plugin at all, on purpose: their events fail alone.
            "[database]\nurl = {:?}\n[relay]\npoll_interval = \"20ms\"\nidle_poll_max = \"50ms\"\nallow_incomplete = true\n{config}",
            db.url
        );
        std::fs::write(&path, text).unwrap();
        let log = db.dir.path().join("serve.log");
        Served { child: spawn(&path, &log), log }
    }

    fn peak_rss_mib(&self) -> u64 {
        peak_rss_mib(self.child.id())
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `[plugins]` table of a test: `dir`, and the compiled-code cache the tests share.
fn plugins_table(dir: &Path) -> String {
    format!("[plugins]\ndir = {dir:?}\ncache_dir = {:?}\n", target_dir().join("test-plugin-cache"))
}

/// Waits until event `id` has been attempted, and returns its row.
async fn attempted(db: &TestDb, id: i64) -> EventRecord {
    eventually(Duration::from_secs(60), &format!("event {id} attempted"), || async {
        db.store.get(id).await.unwrap().filter(|row| row.attempts > 0 && row.status != Status::Processing)
    })
    .await
}

async fn emit(db: &TestDb, event: NewEvent) -> i64 {
    db.store.insert(&event, ferry::clock::SystemClock.now()).await.unwrap()
}

/// Starts `ferry serve` on `db` with the plugins in `plugins`, the log plugin on route `ok` and
/// `extra` (TOML tables), and waits until an event on `ok` is delivered.
async fn serve_beside_log(db: &TestDb, plugins: &Path, extra: &str) -> Served {
    let out = db.dir.path().join("out");
    let served = Served::start(
        db,
        &format!(
            "{}[sandbox.log]\ndirs = {{ \"/out\" = {out:?} }}\n\
             [route.ok]\nplugin = \"log\"\nconfig = {{ output = \"/out/ok.jsonl\" }}\n{extra}",
            plugins_table(plugins)
        ),
    );
    assert_eq!(delivered_on_ok(db).await.status, Status::Sent);
    served
}

/// Emits an event on route `ok` and returns its row once it has been attempted.
async fn delivered_on_ok(db: &TestDb) -> EventRecord {
    let ok = emit(db, NewEvent::new("ok", "e", "{}")).await;
    attempted(db, ok).await
}

/// A row whose headers were written past `emit`'s limit and the INSERT trigger, as logical
/// replication writes rows: 96 MiB of them. The claim does not load them, so ferry's memory does
/// not grow by them, and the event fails alone. (On PostgreSQL: SQLite runs in ferry's process,
/// where updating such a row passes through memory.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_written_past_the_limit_are_not_loaded() {
    let db = TestDb::new(Backend::Postgres).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_log"]);
    let served = serve_beside_log(&db, &plugins, "").await;
    let baseline = served.peak_rss_mib();
    let mut replica = db.postgres.as_ref().unwrap().pool().acquire().await.unwrap();
    sqlx::query("SET session_replication_role = replica").execute(&mut *replica).await.unwrap();
    let huge: i64 = sqlx::query_scalar(
        "INSERT INTO ferry_events (route, event_type, payload, headers)
         VALUES ('ok', 'e', '\\x7b7d', ('{\"h\": \"' || repeat('v', $1) || '\"}')::jsonb) RETURNING id",
    )
    .bind(96 << 20)
    .fetch_one(&mut *replica)
    .await
    .unwrap();
    sqlx::query("RESET session_replication_role").execute(&mut *replica).await.unwrap();
    drop(replica);
    let row = attempted(&db, huge).await;
    assert_eq!(row.failure_reason.map(|r| r.as_str()), Some("invalid_event"), "{:?}", row.last_error);
    let error = row.last_error.unwrap_or_default();
    assert!(error.contains("its headers print in more than the 131072 bytes ferry loads"), "{error}");
    assert_eq!(delivered_on_ok(&db).await.status, Status::Sent, "the route flows on");
    let peak = served.peak_rss_mib();
    assert!(peak <= baseline + 16, "peak RSS {peak} MiB after the row, {baseline} MiB before");
}

/// Runs `ferry serve` with the log plugin on route `ok` and `files` (name, component) in its
/// plugins directory, routes `w` and `m` naming plugins `wide` and `many`, and `[sandbox.wide]`
/// allowed 128 MiB; delivers one event on each route, and returns the process's peak RSS, its
/// log and the rows.
async fn serve_with(files: &[(&str, Vec<u8>)]) -> (u64, String, Vec<EventRecord>) {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_log"]);
    for (name, bytes) in files {
        std::fs::write(plugins.join(name), bytes).unwrap();
    }
    let out = db.dir.path().join("out");
    let served = Served::start(
        &db,
        &format!(
            "{}[sandbox.wide]\nmemory = \"128MiB\"\n\
             [sandbox.log]\ndirs = {{ \"/out\" = {out:?} }}\n\
             [route.ok]\nplugin = \"log\"\nconfig = {{ output = \"/out/ok.jsonl\" }}\n\
             [route.w]\nplugin = \"wide\"\n[route.m]\nplugin = \"many\"\n",
            plugins_table(&plugins)
        ),
    );
    let mut rows = Vec::new();
    for route in ["ok", "w", "m"] {
        let id = emit(&db, NewEvent::new(route, "e", "{}")).await;
        rows.push(attempted(&db, id).await);
    }
    (served.peak_rss_mib(), served.log(), rows)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_memories_of_an_instance_count_against_its_one_limit() {
    let (baseline, _, rows) = serve_with(&[]).await;
    assert_eq!(rows[0].status, Status::Sent, "{:?}", rows[0].last_error);
    // `wide` has four memories, as many as a component may have, and grows three of them by
    // 120 MiB each: 360 MiB under a 128 MiB limit if each memory were checked on its own. `many`
    // has 32 memories, 31 of them grown by 60 MiB: 1.8 GB if nothing counted them.
    let (peak, log, rows) =
        serve_with(&[("wide.wasm", hostile("wide", 3, 120, 0)), ("many.wasm", hostile("many", 31, 60, 0))]).await;
    assert_eq!(rows[0].status, Status::Sent, "other routes keep flowing: {:?}", rows[0].last_error);
    assert!(log.contains("wide.wasm cannot be instantiated: it exceeded the 128 MiB memory limit"), "{log}");
    assert!(
        log.contains(
            "many.wasm is not a valid wasm component: The component transitively contains 32 Wasm linear memories"
        ) || log.contains("many.wasm cannot be instantiated"),
        "the pool refuses more memories than a component may have: {log}"
    );
    for row in &rows[1..] {
        assert_eq!(row.failure_reason.map(|r| r.as_str()), Some("no_transport"), "not loaded: {row:?}");
    }
    assert!(
        peak < baseline + 128 + 48,
        "ferry's peak RSS was {peak} MiB with the hostile plugins, {baseline} MiB without"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_over_its_limit_is_a_transient_fault() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_log"]);
    // Two memories of 40 MiB: each below the 64 MiB limit, together above it.
    std::fs::write(plugins.join("split.wasm"), hostile("split", 2, 40, 0)).unwrap();
    let out = db.dir.path().join("out");
    // A roomier plugin makes the metadata probe's limit 128 MiB, so `split` loads, and fails
    // only when an instance is made for its route under its own limit.
    let s = Stepped::start(
        db,
        &format!(
            "[plugins]\ndir = {plugins:?}\n[sandbox.roomy]\nmemory = \"128MiB\"\n\
             [sandbox.log]\ndirs = {{ \"/out\" = {out:?} }}\n\
             [route.h]\nplugin = \"split\"\n[route.ok]\nplugin = \"log\"\nconfig = {{ output = \"/out/ok.jsonl\" }}\n"
        ),
    )
    .await;
    assert_eq!(s.ferry.registry.names(), ["log", "split"]);
    let rows = s.deliver(&[NewEvent::new("h", "e", "{}"), NewEvent::new("ok", "e", "{}")]).await;
    assert_eq!((rows[0].status, rows[0].attempts), (Status::Pending, 1), "retried later: {:?}", rows[0]);
    assert_eq!(rows[0].last_error.as_deref(), Some("plugin exceeded its 64 MiB memory limit"));
    assert_eq!(rows[1].status, Status::Sent, "other routes keep flowing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_on_many_routes_leaves_the_instance_pool_to_the_others() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_log"]);
    // 32 core instances, as many as a component may have; on 70 routes, with an instance each,
    // 2240: more than a pool of 2048 core instances shared by all would hold.
    std::fs::write(plugins.join("crowd.wasm"), hostile("crowd", 0, 0, 31)).unwrap();
    std::fs::write(plugins.join("big.wasm"), hostile("big", 0, 0, 99)).unwrap();
    let out = db.dir.path().join("out");
    let mut config = format!(
        "[plugins]\ndir = {plugins:?}\n[sandbox.log]\ndirs = {{ \"/out\" = {out:?} }}\n\
         [route.ok]\nplugin = \"log\"\nconfig = {{ output = \"/out/ok.jsonl\" }}\n"
    );
    for n in 0..70 {
        config.push_str(&format!("[route.c{n:02}]\nplugin = \"crowd\"\n"));
    }
    let s = Stepped::start(db, &config).await;
    assert!(s.ferry.registry.runtime().pooling, "the pooling allocator is available on this machine");
    let (_, errors) = s.ferry.registry.status();
    let big = errors.iter().find(|(file, _)| file.ends_with("big.wasm")).map(|(_, e)| e.as_str()).unwrap_or_default();
    assert!(
        big.contains("100 core module instances, which exceeds the configured maximum of 32"),
        "a component with more core instances than allowed is refused: {big}"
    );

    let mut events: Vec<NewEvent> = (0..70).map(|n| NewEvent::new(format!("c{n:02}"), "e", "{}")).collect();
    events.push(NewEvent::new("ok", "e", "{}"));
    let rows = s.deliver(&events).await;
    for row in &rows {
        assert_eq!(row.status, Status::Sent, "every route got an instance: {row:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_objects_a_plugin_makes_are_bounded() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted", "ferry_transport_log"]);
    // The origin is never contacted: the grant only links wasi:http for the plugin.
    let served = serve_beside_log(
        &db,
        &plugins,
        "[sandbox.scripted]\nhttp = [\"http://127.0.0.1:9\"]\n[route.s]\nplugin = \"scripted\"\n",
    )
    .await;
    let before = served.peak_rss_mib();

    // 10 000 copies of 120 KiB of headers (within wasmtime's default limit of 128 KiB per
    // `fields`), then 100 000 copies of 8 KiB (within its default of a million table entries):
    // 1.2 GB and 800 MB on the host, for a few bytes each in the plugin.
    for (headers, count, stopped_by) in
        [("15", "10000", "total size of fields exceeds limit"), ("1", "100000", "resource table has no free keys")]
    {
        let hoard =
            emit(&db, NewEvent::new("s", "fields", "{}").with_header("headers", headers).with_header("count", count))
                .await;
        let row = attempted(&db, hoard).await;
        let after = served.peak_rss_mib();
        assert_eq!(row.status, Status::Pending, "the plugin is stopped, and the event retried: {row:?}");
        let error = row.last_error.unwrap();
        assert!(error.starts_with("plugin trapped: ") && error.ends_with(stopped_by), "{error}");
        assert!(after < before + 64, "ferry's peak RSS went from {before} MiB to {after} MiB");
    }

    assert_eq!(delivered_on_ok(&db).await.status, Status::Sent, "the host and other routes are fine");
    assert!(served.log().contains("plugin=scripted"), "the fault is logged naming the plugin");
}

/// What one call may copy from a plugin to the host is capped at the plugin's memory limit: an
/// answer of 120 reasons of 1 MiB, all the same bytes in the plugin's memory, would have the host
/// copy 120 MiB for a plugin allowed 64 MiB (wasmtime's own cap is 128 MiB per call). The call
/// fails as a fault of the plugin, the event is retried, and the host's memory does not grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_copies_no_more_than_the_plugin_may_hold() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_log"]);
    std::fs::write(plugins.join("alias.wasm"), aliasing("alias", 120, 1)).unwrap();
    let served = serve_beside_log(&db, &plugins, "[route.a]\nplugin = \"alias\"\n").await;
    let before = served.peak_rss_mib();

    let aliased = emit(&db, NewEvent::new("a", "e", "{}")).await;
    let row = attempted(&db, aliased).await;
    let after = served.peak_rss_mib();
    // Up to the limit is copied before the call is stopped.
    assert!(after < before + 64 + 16, "ferry's peak RSS went from {before} MiB to {after} MiB");
    assert_eq!(row.status, Status::Pending, "the plugin's fault, retried: {row:?}");
    let error = row.last_error.unwrap_or_default();
    assert!(error.contains("too much data is being copied between the host and the guest"), "{error}");

    assert_eq!(delivered_on_ok(&db).await.status, Status::Sent, "the host and other routes are fine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_without_an_http_grant_gets_no_wasi_http() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted", "ferry_transport_log"]);
    let out = db.dir.path().join("out");
    let s = Stepped::start(
        db,
        &format!(
            "[plugins]\ndir = {plugins:?}\n[sandbox.log]\ndirs = {{ \"/out\" = {out:?} }}\n\
             [route.s]\nplugin = \"scripted\"\n\
             [route.ok]\nplugin = \"log\"\nconfig = {{ output = \"/out/ok.jsonl\" }}\n"
        ),
    )
    .await;
    let rows = s
        .deliver(&[
            NewEvent::new("s", "fields", "{}").with_header("count", "10"),
            NewEvent::new("s", "ok", "{}"),
            NewEvent::new("ok", "e", "{}"),
        ])
        .await;
    assert_eq!(rows[0].status, Status::Pending, "{:?}", rows[0]);
    let error = rows[0].last_error.clone().unwrap();
    assert!(
        error.contains("plugin scripted called wasi:http/types@")
            && error.contains("#[constructor]fields, but sandbox.scripted.http grants no origin"),
        "{error}"
    );
    assert_eq!(rows[2].status, Status::Sent, "other routes keep flowing");
    // The plugin itself still runs: without wasi:http calls it delivers.
    let rows = s.deliver(&[NewEvent::new("s", "ok", "{}")]).await;
    assert_eq!(rows[0].status, Status::Sent, "{:?}", rows[0].last_error);
}

/// A plugin that uses up every file the process may open costs the other routes time, not their
/// events. `hoard` connects to a local listener until the host refuses, and holds the connections
/// for a while; meanwhile an instance of the log plugin cannot be started (its directory grant,
/// and the output file its `init` opens, each need a descriptor). Its event waits, no attempt
/// spent and its route's breaker untouched, and is delivered once the connections are closed; it
/// used to fail for good (`no_transport`). Also: `serve` raises its soft limit on open files to
/// the hard one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_uses_up_open_files_delays_other_routes_but_fails_none() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_log", "ferry_test_scripted"]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let out = db.dir.path().join("out");
    // Every call of the log plugin starts an instance of its own (`max_calls = 1`).
    let config = format!(
        "{}[sandbox.log]\ndirs = {{ \"/out\" = {out:?} }}\nmax_calls = 1\n\
         [sandbox.scripted]\ntcp = [\"{addr}\"]\ntimeout = \"30s\"\n\
         [route.ok]\nplugin = \"log\"\nconfig = {{ output = \"/out/ok.jsonl\" }}\n\
         [route.h]\nplugin = \"scripted\"\n",
        plugins_table(&plugins)
    );
    const HARD: usize = 320;
    let spawn = |path: &Path, log: &Path| spawn_serve_with_open_files(path, log, 96, HARD as u64);
    let served = Served::start_with(&db, &config, spawn);
    assert_eq!(delivered_on_ok(&db).await.status, Status::Sent);
    let pid = served.child.id();
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let open_files = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    assert_eq!(open_files.split_whitespace().collect::<Vec<_>>()[3..5], [HARD.to_string(), HARD.to_string()]);

    let hoard = NewEvent::new("h", "hoard", "{}").with_header("addr", addr.to_string()).with_header("hold-ms", "8000");
    let hoard = emit(&db, hoard).await;
    eventually(Duration::from_secs(30), "the plugin to hold every descriptor left", || async {
        let open = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |fds| fds.count());
        (open >= HARD - 2).then_some(())
    })
    .await;
    let ok = emit(&db, NewEvent::new("ok", "e", "{}")).await;
    let waiting = eventually(Duration::from_secs(30), "the event on ok to wait", || async {
        db.store.get(ok).await.unwrap().filter(|row| row.last_error.is_some() && row.status == Status::Pending)
    })
    .await;
    assert_eq!((waiting.status, waiting.attempts), (Status::Pending, 0), "waiting, no attempt spent: {waiting:?}");
    let why = waiting.last_error.as_deref().unwrap_or_default();
    assert!(why.contains("open files"), "{why}");

    let hoard = attempted(&db, hoard).await;
    assert!(hoard.last_error.as_deref().unwrap_or_default().starts_with("held "), "{hoard:?}");
    let ok = eventually(Duration::from_secs(60), "event on ok delivered", || async {
        db.store.get(ok).await.unwrap().filter(|row| row.status == Status::Sent)
    })
    .await;
    assert_eq!(ok.attempts, 1, "the shortage cost no attempt: {ok:?}");
    let breakers = db.store.breakers().await.unwrap();
    assert!(breakers.iter().all(|b| b.route != "ok" || b.consecutive_failures == 0), "{breakers:?}");
    let log = served.log();
    assert!(!log.contains("panicked"), "{log}");
    holder.abort();
}

/// A component of a few kilobytes that instantiates a nested component a thousand times, which
/// does the same, three levels deep: wasmtime, asked to compile it, took gigabytes of memory and
/// aborted the process (at start-up, and again at every restart while the file stayed). It is now
/// refused by its shape, before compiling, the host's memory stays where it was, and the other
/// routes flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_component_that_expands_without_bound_is_refused_before_it_is_compiled() {
    let instances: String = (0..1000).map(|_| "(instance (instantiate $c))").collect();
    let mut body = String::new();
    for _ in 0..3 {
        body = format!("(component $c {body}) {instances}");
    }
    let bomb = wat::parse_str(format!("(component {body})")).unwrap();
    assert!(bomb.len() < 20_000, "{} bytes", bomb.len());
    let (baseline, _, _) = serve_with(&[]).await;
    let (peak, log, rows) = serve_with(&[("bomb.wasm", bomb)]).await;
    assert_eq!(rows[0].status, Status::Sent, "the log route flows: {:?}", rows[0].last_error);
    assert!(log.contains("bomb.wasm is refused: compiling it would expand"), "{log}");
    assert!(peak <= baseline + 16, "peak RSS {peak} MiB with the file, {baseline} MiB without");
}
