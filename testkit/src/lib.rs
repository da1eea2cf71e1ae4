//! Fixtures shared by ferry's integration tests (`tests/`) and benchmarks (`benches/`): a fresh
//! database per test (a SQLite file, or a PostgreSQL schema), the compiled plugins, the `ferry`
//! binary, real HTTP receivers and Kafka brokers, and polling with a deadline.

pub mod broker;
pub mod chaos;
pub mod fleet;
pub mod nginx;
pub mod spread;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry::config::Config;
use ferry::store::{PostgresStore, SqliteStore, Store};
use tempfile::TempDir;

/// Where tests find PostgreSQL unless `DATABASE_URL` says otherwise.
pub const DEFAULT_PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Which database a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// A database of its own for one test, removed when dropped.
pub struct TestDb {
    pub backend: Backend,
    /// A URL that reaches exactly this test's database (or schema); give it to ferry's config.
    pub url: String,
    pub store: Arc<dyn Store>,
    pub sqlite: Option<SqliteStore>,
    pub postgres: Option<PostgresStore>,
    /// Holds the SQLite file and anything else the test writes.
    pub dir: TempDir,
    schema: Option<String>,
}

impl TestDb {
    pub async fn new(backend: Backend) -> TestDb {
        match backend {
            Backend::Sqlite => Self::sqlite().await,
            Backend::Postgres => Self::postgres().await,
        }
    }

    pub async fn sqlite() -> TestDb {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("ferry.db").display());
        let store = SqliteStore::connect(&url, 4).await.expect("open sqlite");
        store.migrate().await.expect("migrate sqlite");
        TestDb {
            backend: Backend::Sqlite,
            url,
            store: Arc::new(store.clone()),
            sqlite: Some(store),
            postgres: None,
            dir,
            schema: None,
        }
    }

    pub async fn postgres() -> TestDb {
        let base = pg_base_url();
        let schema = format!("ferry_t_{:016x}", rand_u64());
        let admin = admin_pool(&base).await;
        sqlx::query(&format!("CREATE SCHEMA {schema}")).execute(&admin).await.expect("create test schema");
        admin.close().await;
        let separator = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{separator}options=-c%20search_path%3D{schema}");
        let store = PostgresStore::connect(&url, 8).await.expect("connect to the test schema");
        store.migrate().await.expect("migrate postgres");
        TestDb {
            backend: Backend::Postgres,
            url,
            store: Arc::new(store.clone()),
            sqlite: None,
            postgres: Some(store),
            dir: tempfile::tempdir().expect("temp dir"),
            schema: Some(schema),
        }
    }

    /// Makes the database refuse to insert rows of `ferry_events` for which `when` (a condition
    /// on `NEW` that reads the same in both dialects) holds, raising `message`: a constraint or
    /// trigger an operator might add, for tests that ferry survives one. `message` is put in the
    /// SQL as it is: no quotes or percent signs.
    pub async fn refuse_inserts_when(&self, when: &str, message: &str) {
        match (&self.postgres, &self.sqlite) {
            (Some(pg), _) => {
                let function = format!(
                    "CREATE FUNCTION refuse_inserts() RETURNS trigger LANGUAGE plpgsql AS $$
                     BEGIN IF {when} THEN RAISE EXCEPTION '{message}'; END IF; RETURN NEW; END $$"
                );
                let trigger = "CREATE TRIGGER refuse_inserts BEFORE INSERT ON ferry_events
                               FOR EACH ROW EXECUTE FUNCTION refuse_inserts()";
                for statement in [function.as_str(), trigger] {
                    sqlx::query(statement).execute(pg.pool()).await.unwrap();
                }
            }
            (_, Some(lite)) => {
                let trigger = format!(
                    "CREATE TRIGGER refuse_inserts BEFORE INSERT ON ferry_events WHEN {when}
                     BEGIN SELECT RAISE(ABORT, '{message}'); END"
                );
                sqlx::query(&trigger).execute(lite.pool()).await.unwrap();
            }
            _ => unreachable!("a test database has a backend"),
        }
    }

    /// Makes the database refuse every `event` on `table` (`"UPDATE OF probe_until"`, say) with
    /// `message`, as a trigger an operator added, or a failing disk, might.
    pub async fn refuse(&self, table: &str, event: &str, message: &str) {
        match (&self.postgres, &self.sqlite) {
            (Some(pg), _) => {
                let function = format!(
                    "CREATE FUNCTION refuse_{table}() RETURNS trigger LANGUAGE plpgsql AS $$
                     BEGIN RAISE EXCEPTION '{message}'; END $$"
                );
                let trigger = format!(
                    "CREATE TRIGGER refuse_{table} BEFORE {event} ON {table} FOR EACH ROW EXECUTE FUNCTION refuse_{table}()"
                );
                for statement in [function, trigger] {
                    sqlx::query(&statement).execute(pg.pool()).await.unwrap();
                }
            }
            (_, Some(lite)) => {
                let trigger = format!(
                    "CREATE TRIGGER refuse_{table} BEFORE {event} ON {table} BEGIN SELECT RAISE(ABORT, '{message}'); END"
                );
                sqlx::query(&trigger).execute(lite.pool()).await.unwrap();
            }
            _ => unreachable!("a test database has a backend"),
        }
    }

    /// A config pointing at this database, with `extra` TOML appended.
    /// Compiled plugin code is cached in one directory under `target/` shared by all tests (and
    /// runs), unless `extra` chooses another.
    pub fn config(&self, extra: &str) -> Config {
        let text = format!("[database]\nurl = {:?}\n{extra}", self.url);
        let mut config = Config::from_toml_str(&text, "test config").expect("test config is valid");
        if config.plugins.cache_dir == Config::defaults().plugins.cache_dir {
            config.plugins.cache_dir = target_dir().join("test-plugin-cache");
        }
        config
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let Some(schema) = self.schema.take() else { return };
        let base = pg_base_url();
        // Drop runs inside the test's runtime; clean up from a thread with a runtime of its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async {
                if let Ok(pool) = sqlx::PgPool::connect(&base).await {
                    let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).execute(&pool).await;
                }
            });
        })
        .join();
    }
}

pub fn pg_base_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_PG_URL.to_string())
}

async fn admin_pool(url: &str) -> sqlx::PgPool {
    match sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
    {
        Ok(pool) => pool,
        Err(e) => panic!(
            "PostgreSQL is not reachable at {url}: {e}\n\
             Start it (on this machine: `pg_ctlcluster --skip-systemctl-redirect 15 main start`) \
             or set DATABASE_URL to a server whose user may create schemas."
        ),
    }
}

pub fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos());
    h.finish()
}

/// Makes a small PKI for TLS tests in `dir` with the system's `openssl`: a CA (`ca.pem`,
/// `ca.key`), a server certificate for `localhost` and 127.0.0.1 (`server.pem`, `server.key`) and
/// a client certificate (`client.pem`, `client.key`), both signed by the CA, on P-256 keys.
pub fn test_pki(dir: &Path) {
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl").args(args).current_dir(dir).output().expect("openssl runs");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
    let ca = ["-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ferry test CA"];
    openssl(&[&["req", "-x509"][..], &ec, &ca].concat());
    for (name, subject, extension) in [
        ("server", "/CN=localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"),
        ("client", "/CN=ferry test client", "extendedKeyUsage=clientAuth\n"),
    ] {
        let (key, csr, pem, ext) =
            (format!("{name}.key"), format!("{name}.csr"), format!("{name}.pem"), format!("{name}.ext"));
        openssl(&[&["req"][..], &ec, &["-keyout", &key, "-out", &csr, "-subj", subject]].concat());
        std::fs::write(dir.join(&ext), extension).unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &ext,
        ]);
    }
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("testkit/ has a parent").to_path_buf()
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set (relative to the repository root, where
/// the scripts run cargo), else `target/` in the repository.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => repo_root().join(dir),
        _ => repo_root().join("target"),
    }
}

/// The `ferry` binary built with the test or benchmark that is running (cargo builds a package's
/// binaries before its integration tests and benchmarks, next to their `deps/` directory).
pub fn ferry_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the running test's path");
    let dir = exe.parent().and_then(Path::parent).expect("tests run from target/PROFILE/deps");
    let bin = dir.join(format!("ferry{}", std::env::consts::EXE_SUFFIX));
    assert!(bin.is_file(), "{} is missing: run the tests through cargo", bin.display());
    bin
}

/// The compiled component of a plugin crate (e.g. `ferry_transport_log`).
pub fn built_plugin(crate_name: &str) -> PathBuf {
    let path = target_dir().join("wasm32-wasip2/release").join(format!("{crate_name}.wasm"));
    assert!(
        path.is_file(),
        "{} is missing: build the plugins first with scripts/build-plugins (scripts/test does it)",
        path.display()
    );
    path
}

/// The name the plugin built by crate `crate_name` reports, which its file must be named after
/// (`NAME.wasm`) to load; a crate that builds no loadable plugin keeps its crate name.
pub fn plugin_name(crate_name: &str) -> &str {
    match crate_name {
        "ferry_transport_log" => "log",
        "ferry_transport_http" => "http",
        "ferry_transport_kafka" => "kafka",
        "ferry_transport_template" => "template",
        "ferry_transport_webhook_js" => "webhook-js",
        "ferry_transport_spool_py" => "spool-py",
        "ferry_test_scripted" => "scripted",
        "ferry_test_legacy" => "legacy",
        other => other,
    }
}

/// A plugins directory holding copies of the named built plugins, each installed as
/// `NAME.wasm` after the name it reports.
pub fn plugins_dir(parent: &Path, crates: &[&str]) -> PathBuf {
    let dir = parent.join("plugins");
    std::fs::create_dir_all(&dir).expect("create plugins dir");
    for name in crates {
        std::fs::copy(built_plugin(name), dir.join(format!("{}.wasm", plugin_name(name)))).expect("copy plugin");
    }
    dir
}

/// A copy of a built plugin that differs in its bytes (a trailing custom section named after
/// `tag`) but not in behaviour: a new version for reload tests.
pub fn plugin_variant(crate_name: &str, tag: &str) -> Vec<u8> {
    let mut bytes = std::fs::read(built_plugin(crate_name)).expect("read plugin");
    let name = format!("ferry-test-{tag}");
    let mut section = vec![name.len() as u8];
    section.extend_from_slice(name.as_bytes());
    bytes.push(0); // custom section id
    bytes.push(section.len() as u8); // size, as one LEB128 byte (short names only)
    bytes.extend_from_slice(&section);
    bytes
}

/// Writes `bytes` to `path` atomically (a temporary file renamed over it), as deployment tools do.
pub fn install(path: &Path, bytes: &[u8]) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).expect("write plugin");
    std::fs::rename(&tmp, path).expect("rename plugin into place");
}

/// Starts `ferry serve --config CONFIG` (the binary this package builds), warnings and errors
/// appended to `log`.
pub fn spawn_serve(config: &Path, log: &Path) -> std::process::Child {
    serve(std::process::Command::new(ferry_bin()), config, log)
}

/// [`spawn_serve`], with at most `hard` open files, `soft` of them at first (set by `sh`'s
/// `ulimit`, which `exec`s ferry: the child is ferry itself).
pub fn spawn_serve_with_open_files(config: &Path, log: &Path, soft: u64, hard: u64) -> std::process::Child {
    let mut sh = std::process::Command::new("sh");
    sh.arg("-c").arg(format!("ulimit -Sn {soft} && ulimit -Hn {hard} && exec \"$0\" \"$@\"")).arg(ferry_bin());
    serve(sh, config, log)
}

fn serve(mut command: std::process::Command, config: &Path, log: &Path) -> std::process::Child {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("serve log");
    command
        .arg("--config")
        .arg(config)
        .arg("serve")
        .env_remove("FERRY_DATABASE_URL")
        .env("FERRY_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .expect("ferry serve starts")
}

/// A child process killed (and waited for) when dropped, so a failing test leaves no `ferry
/// serve` behind.
#[derive(Debug)]
pub struct Reaped(pub std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `check` until it returns `Some`, failing the test with `what` after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out after {timeout:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Declares an async test once per backend: `both_backends!(name)` expects `async fn name(db: TestDb)`.
#[macro_export]
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name($crate::TestDb::new($crate::Backend::Sqlite).await).await })*
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name($crate::TestDb::new($crate::Backend::Postgres).await).await })*
        }
    };
}

/// Emits `event` inside a transaction of the test database's own pool, then commits or rolls
/// back: what an application does.
pub async fn emit_in_transaction(db: &TestDb, event: &ferry::NewEvent, commit: bool) -> i64 {
    macro_rules! in_tx {
        ($pool:expr) => {{
            let mut tx = $pool.begin().await.unwrap();
            let id = ferry::emit(&mut *tx, event).await.unwrap();
            if commit {
                tx.commit().await.unwrap()
            } else {
                tx.rollback().await.unwrap()
            }
            id
        }};
    }
    match db.backend {
        Backend::Sqlite => in_tx!(db.sqlite.as_ref().unwrap().pool()),
        Backend::Postgres => in_tx!(db.postgres.as_ref().unwrap().pool()),
    }
}

/// A ferry relay running in the background of a test.
pub struct Running {
    pub registry: Arc<ferry::plugins::Registry>,
    pub metrics: Arc<ferry::metrics::Metrics>,
    waker: Arc<tokio::sync::Notify>,
    shutdown: tokio_util::sync::CancellationToken,
    relay: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Starts ferry with `config` on the system clock and runs its relay until [`Running::stop`].
    pub async fn start(config: &Config) -> Running {
        let ferry =
            ferry::service::Ferry::start(config, Arc::new(ferry::clock::SystemClock)).await.expect("ferry starts");
        let (registry, metrics) = (ferry.registry.clone(), ferry.metrics.clone());
        let waker = ferry.relay.waker();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let token = shutdown.clone();
        let relay = tokio::spawn(async move { ferry.relay.run(token).await });
        Running { registry, metrics, waker, shutdown, relay }
    }

    /// Wakes one idle worker, as an in-process emit does.
    pub fn wake(&self) {
        self.waker.notify_one();
    }

    /// Asks the relay to stop and waits until it has.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.relay.await.expect("relay task ends cleanly");
    }
}

/// Counts of one status, for polling.
pub async fn count(store: &Arc<dyn Store>, status: ferry::event::Status) -> u64 {
    store.counts().await.expect("counts")[&status]
}

/// One line a `scripted` plugin recorded: a successful delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub id: i64,
    pub key: String,
    pub attempt: u32,
    pub nanos: u128,
}

/// Every delivery recorded in the `*.log` files of `dir`, in time order.
pub fn deliveries(dir: &Path) -> Vec<Delivery> {
    let mut all = Vec::new();
    for entry in std::fs::read_dir(dir).expect("record dir") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "log") {
            for line in std::fs::read_to_string(&path).unwrap().lines() {
                let f: Vec<&str> = line.split(' ').collect();
                all.push(Delivery {
                    id: f[0].parse().unwrap(),
                    key: f[1].to_string(),
                    attempt: f[2].parse().unwrap(),
                    nanos: f[3].parse().unwrap(),
                });
            }
        }
    }
    all.sort_by_key(|d| (d.nanos, d.id));
    all
}

/// One request a [`Receiver`] got.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    /// Header names lower-cased, in arrival order.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// A real HTTP/1.1 server on 127.0.0.1 that records every request and answers by path:
/// `/fail` → 500, `/busy` → 429 with `Retry-After: 7`, `/reject` → 400 with a body, `/picky` →
/// 422 when the body holds `poison` (else 200), `/choosy` → 413 for a JSON array of several
/// objects and else 429 as `/busy`, `/hang` → no answer for 30 s, `/slow` → 200 after half a
/// second, anything else → 200.
pub struct Receiver {
    pub addr: std::net::SocketAddr,
    requests: Arc<std::sync::Mutex<Vec<Received>>>,
    connections: Arc<std::sync::atomic::AtomicUsize>,
    open: Arc<std::sync::atomic::AtomicUsize>,
}

impl Receiver {
    pub async fn start() -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(std::sync::Mutex::new(Vec::new()));
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (log, accepted, still_open) = (requests.clone(), connections.clone(), open.clone());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                still_open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let (log, still_open) = (log.clone(), still_open.clone());
                tokio::spawn(async move {
                    serve_connection(socket, log).await;
                    still_open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                });
            }
        });
        Receiver { addr, requests, connections, open }
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Connections open now: accepted, and not yet closed by the client.
    pub fn open(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// `http://<addr><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn requests(&self) -> Vec<Received> {
        self.requests.lock().unwrap().clone()
    }

    /// How many requests it got so far.
    pub fn received(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
}

async fn serve_connection(mut socket: tokio::net::TcpStream, log: Arc<std::sync::Mutex<Vec<Received>>>) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut buf = Vec::new();
    loop {
        // One request: the head, then Content-Length bytes of body.
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let mut first = lines.next().unwrap_or_default().split(' ');
        let (method, path) =
            (first.next().unwrap_or_default().to_string(), first.next().unwrap_or_default().to_string());
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let length: usize =
            headers.iter().find(|(n, _)| n == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body = buf[head_end..head_end + length].to_vec();
        buf.drain(..head_end + length);
        let poison = body.windows(6).any(|w| w == b"poison");
        let several = body.windows(3).any(|w| w == b"},{");
        log.lock().unwrap().push(Received { method, path: path.clone(), headers, body });
        let answer: &[u8] = match path.as_str() {
            "/fail" => b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n",
            "/choosy" if several => b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 0\r\n\r\n",
            "/busy" | "/choosy" => b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 7\r\ncontent-length: 0\r\n\r\n",
            "/reject" => b"HTTP/1.1 400 Bad Request\r\ncontent-length: 20\r\n\r\nmissing field: total",
            "/picky" if poison => b"HTTP/1.1 422 Unprocessable Content\r\ncontent-length: 15\r\n\r\npoison refused.",
            "/hang" => {
                tokio::time::sleep(Duration::from_secs(30)).await;
                return;
            }
            "/slow" => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
            }
            _ => b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        };
        if socket.write_all(answer).await.is_err() {
            return;
        }
    }
}

/// A `tracing` subscriber writing into a buffer, to check what the host logged.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// A plain-text subscriber writing into this buffer, for `.with_subscriber(..)`.
    pub fn subscriber(&self) -> tracing::Dispatch {
        keep_interest_shared();
        let log = self.clone();
        tracing_subscriber::fmt().with_ansi(false).with_writer(move || log.clone()).finish().into()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}

/// Keeps a second subscriber registered for the rest of the process, so that a scoped
/// [`Captured`] subscriber is never the only one. With only one, `tracing` decides whether a log
/// line is wanted by asking the subscriber of whichever thread reaches its call site first, and
/// caches the answer for every thread: a test running beside another that reached the call site
/// first, on a thread without a subscriber, lost the line (a flaky test). With two or more it
/// asks every registered subscriber.
fn keep_interest_shared() {
    static SECOND: std::sync::OnceLock<tracing::Dispatch> = std::sync::OnceLock::new();
    SECOND.get_or_init(|| tracing::Dispatch::new(tracing::subscriber::NoSubscriber::new()));
}

/// Ferry on a manual clock, driven one relay cycle at a time: for tests of what a plugin does with
/// a batch.
pub struct Stepped {
    pub db: TestDb,
    pub clock: Arc<ferry::clock::ManualClock>,
    pub ferry: ferry::service::Ferry,
}

impl Stepped {
    /// The clock's start; events a test inserts are due at once.
    pub fn epoch() -> chrono::DateTime<chrono::Utc> {
        use chrono::TimeZone as _;
        chrono::Utc.with_ymd_and_hms(2026, 7, 1, 0, 0, 0).unwrap()
    }

    /// Starts ferry on `db` with `config` (TOML appended to the database section).
    pub async fn start(db: TestDb, config: &str) -> Stepped {
        let clock = Arc::new(ferry::clock::ManualClock::new(Self::epoch()));
        let ferry = ferry::service::Ferry::start(&db.config(config), clock.clone()).await.expect("ferry starts");
        Stepped { db, clock, ferry }
    }

    /// Inserts `events`, runs one relay cycle, and returns the rows as they are afterwards.
    pub async fn deliver(&self, events: &[ferry::NewEvent]) -> Vec<ferry::event::EventRecord> {
        use ferry::clock::Clock as _;
        let mut ids = Vec::new();
        for event in events {
            ids.push(self.db.store.insert(event, self.clock.now()).await.expect("insert"));
        }
        self.ferry.relay.cycle(&tokio_util::sync::CancellationToken::new()).await.expect("relay cycle");
        let mut rows = Vec::new();
        for id in ids {
            rows.push(self.db.store.get(id).await.expect("read back").expect("row exists"));
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::Captured;

    /// A line logged in a test is captured even when another thread, with no subscriber, reached
    /// the same call site first (the flake `keep_interest_shared` prevents).
    #[test]
    fn captured_sees_a_call_site_another_thread_reached_first() {
        let log = Captured::default();
        let dispatch = log.subscriber();
        let emit = || tracing::info!("from a shared call site");
        std::thread::spawn(emit).join().expect("the other thread logs");
        tracing::dispatcher::with_default(&dispatch, emit);
        assert!(log.text().contains("from a shared call site"), "{:?}", log.text());
    }
}
