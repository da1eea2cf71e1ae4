//! The chaos run: events delivered through the HTTP plugin to a receiver that counts deliveries
//! per event id, by several `ferry serve` processes on one PostgreSQL that are killed with SIGKILL
//! at random and restarted, while PostgreSQL itself is restarted once. Used by the test suite (a
//! small run) and by `cargo bench --bench chaos` (the full one).
//!
//! PostgreSQL is a private cluster made for the run (`initdb` in a temporary directory, on a free
//! port), so restarting it does not disturb anything else on the machine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::Rng as _;

use crate::{Receiver, plugins_dir, spawn_serve};

/// How hard to shake.
#[derive(Debug, Clone)]
pub struct Options {
    pub events: usize,
    /// `ferry serve` processes sharing the outbox.
    pub instances: usize,
    /// Each kill comes after a random pause in this range.
    pub kill_every: (Duration, Duration),
    /// Restart PostgreSQL once, when about half of the events are delivered.
    pub restart_postgres: bool,
    /// Give up (and fail) if the events are not all SENT by then.
    pub deadline: Duration,
}

/// What happened.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub events: usize,
    pub instances: usize,
    pub kills: usize,
    pub postgres_restarts: usize,
    pub seconds: f64,
    /// Requests the receiver got.
    pub deliveries: usize,
    /// Event ids the receiver got at least once.
    pub distinct: usize,
    /// Deliveries beyond the first, over all events.
    pub duplicates: usize,
    /// The most deliveries one event got.
    pub most_deliveries: usize,
    /// Events the receiver never got (must be 0).
    pub lost: usize,
    /// Events per status at the end (all must be SENT).
    pub statuses: HashMap<String, i64>,
}

/// A PostgreSQL cluster of its own, stopped and removed when dropped.
pub struct PrivatePostgres {
    dir: tempfile::TempDir,
    bin: PathBuf,
    pub port: u16,
}

impl PrivatePostgres {
    /// Creates and starts a cluster with trust authentication on a free port of 127.0.0.1.
    pub fn start() -> PrivatePostgres {
        let bin = postgres_bin();
        let dir = tempfile::tempdir().expect("temp dir");
        if running_as_root() {
            // initdb and postgres refuse to run as root; the cluster belongs to `postgres`.
            run(Command::new("chown").arg("postgres:postgres").arg(dir.path()), "chown the cluster directory");
        }
        let data = dir.path().join("data");
        run(
            as_postgres(&bin.join("initdb"))
                .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8", "-D"])
                .arg(&data),
            "initdb",
        );
        let port = free_port();
        let pg = PrivatePostgres { dir, bin, port };
        pg.ctl("start");
        pg
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops (fast: connections are cut) and starts again.
    pub fn restart(&self) {
        self.ctl("restart");
    }

    fn ctl(&self, action: &str) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
            self.port,
            self.dir.path().display()
        );
        run(
            as_postgres(&self.bin.join("pg_ctl"))
                .args(["-w", "-m", "fast", "-t", "60", "-D"])
                .arg(self.dir.path().join("data"))
                .arg("-l")
                .arg(self.dir.path().join("postgres.log"))
                .args(["-o", &options, action]),
            &format!("pg_ctl {action}"),
        );
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = as_postgres(&self.bin.join("pg_ctl"))
            .args(["-w", "-m", "immediate", "-D"])
            .arg(self.dir.path().join("data"))
            .arg("stop")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The directory of PostgreSQL's server programs (`initdb`, `pg_ctl`).
fn postgres_bin() -> PathBuf {
    let from_config = Command::new("pg_config").arg("--bindir").output().ok().and_then(|out| {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        dir.join("initdb").exists().then_some(dir)
    });
    from_config
        .or_else(|| {
            let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
                .ok()?
                .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
                .filter(|bin| bin.join("initdb").exists())
                .collect();
            dirs.sort();
            dirs.pop()
        })
        .expect("PostgreSQL's initdb and pg_ctl are needed for the chaos run: install the PostgreSQL server package")
}

fn running_as_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

fn as_postgres(program: &Path) -> Command {
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn run(command: &mut Command, what: &str) {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One `ferry serve` process, restarted after each kill.
struct Instance {
    child: Child,
    log: PathBuf,
    starts: usize,
}

/// Runs the chaos and reports; panics (with the instances' logs) if events are still not SENT at
/// the deadline. The caller judges the report.
pub async fn run_chaos(options: &Options) -> Report {
    let pg = tokio::task::spawn_blocking(PrivatePostgres::start).await.unwrap();
    let receiver = Receiver::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let plugins = plugins_dir(dir.path(), &["ferry_transport_http"]);
    let config = dir.path().join("ferry.toml");
    let cache = super::target_dir().join("test-plugin-cache");
    std::fs::write(
        &config,
        format!(
            r#"
            [database]
            url = "{url}"
            max_connections = 4
            [relay]
            batch_size = 200
            poll_interval = "20ms"
            lease = "3s"
            recover_every = 5
            shutdown_grace = "2s"
            [plugins]
            dir = {plugins:?}
            cache_dir = {cache:?}
            watch = false
            timeout = "2s"
            [sandbox.http]
            http = ["http://{addr}"]
            [route.chaos]
            plugin = "http"
            config = {{ url = "{target}", concurrency = "32" }}
            "#,
            url = pg.url(),
            addr = receiver.addr,
            target = receiver.url("/chaos"),
        ),
    )
    .unwrap();

    let store = ferry::store::PostgresStore::connect(&pg.url(), 4).await.expect("connect to the private cluster");
    ferry::store::Store::migrate(&store).await.expect("migrate");
    sqlx::query(
        "INSERT INTO ferry_events (route, event_type, payload)
         SELECT 'chaos', 'chaos.tick', convert_to('{\"n\":' || n || '}', 'UTF8') FROM generate_series(1, $1) AS n",
    )
    .bind(i64::try_from(options.events).unwrap())
    .execute(store.pool())
    .await
    .expect("insert the events");

    let started = Instant::now();
    let mut instances: Vec<Instance> = (0..options.instances)
        .map(|n| {
            let log = dir.path().join(format!("instance-{n}.log"));
            Instance { child: spawn_serve(&config, &log), log, starts: 1 }
        })
        .collect();
    let (mut kills, mut restarts) = (0, 0);
    let sent = |store: &ferry::store::PostgresStore| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM ferry_events WHERE status = 'SENT'")
                .fetch_one(&pool)
                .await
                .ok()
        }
    };
    let mut next_kill = started + pause(options);
    loop {
        let delivered = sent(&store).await.unwrap_or(0);
        if delivered == options.events as i64 {
            break;
        }
        if started.elapsed() > options.deadline {
            let logs: String = instances
                .iter()
                .map(|i| format!("--- {}:\n{}", i.log.display(), tail(&i.log)))
                .collect::<Vec<_>>()
                .join("\n");
            panic!("chaos: only {delivered} of {} events SENT after {:?}\n{logs}", options.events, options.deadline);
        }
        if options.restart_postgres && restarts == 0 && delivered * 2 >= options.events as i64 {
            let cluster = &pg;
            tokio::task::block_in_place(|| cluster.restart());
            restarts += 1;
        }
        if Instant::now() >= next_kill {
            let victim = rand::rng().random_range(0..instances.len());
            let instance = &mut instances[victim];
            instance.child.kill().expect("SIGKILL");
            instance.child.wait().expect("reaped");
            instance.child = spawn_serve(&config, &instance.log);
            instance.starts += 1;
            kills += 1;
            next_kill = Instant::now() + pause(options);
        }
        // An instance that exited by itself (e.g. it started while PostgreSQL was down) is
        // started again too.
        for instance in &mut instances {
            if instance.child.try_wait().expect("child status").is_some() {
                instance.child = spawn_serve(&config, &instance.log);
                instance.starts += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seconds = started.elapsed().as_secs_f64();
    for instance in &mut instances {
        let _ = Command::new("kill").args(["-TERM", &instance.child.id().to_string()]).status();
    }
    for instance in &mut instances {
        let _ = instance.child.wait();
    }

    let statuses: HashMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT status, COUNT(*) FROM ferry_events GROUP BY status")
            .fetch_all(store.pool())
            .await
            .expect("final counts")
            .into_iter()
            .collect();
    let mut per_event: HashMap<String, usize> = HashMap::new();
    let requests = receiver.requests();
    for request in &requests {
        *per_event.entry(request.header("webhook-id").unwrap_or("?").to_string()).or_default() += 1;
    }
    Report {
        events: options.events,
        instances: options.instances,
        kills,
        postgres_restarts: restarts,
        seconds,
        deliveries: requests.len(),
        distinct: per_event.len(),
        duplicates: requests.len() - per_event.len(),
        most_deliveries: per_event.values().copied().max().unwrap_or(0),
        lost: options.events.saturating_sub(per_event.len()),
        statuses,
    }
}

fn pause(options: &Options) -> Duration {
    let (low, high) = options.kill_every;
    rand::rng().random_range(low..=high)
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}
