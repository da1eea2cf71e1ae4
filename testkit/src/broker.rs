//! A Kafka-protocol broker for the tests: tansu with in-memory storage, started once per test
//! binary, plus a Kafka client (rskafka) to create topics and read back what was produced.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rskafka::client::partition::UnknownTopicHandling;
use rskafka::client::{Client, ClientBuilder};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::sync::OnceCell;

/// A tansu broker with in-memory storage, shared by the tests of this binary. It is started
/// through a small shell wrapper that stops it when the test process goes away (its stdin
/// closes), so no broker outlives the tests.
pub struct Broker {
    pub port: u16,
    _wrapper: std::process::Child,
    /// The storage of a broker that keeps users (SQLite), removed with it.
    _dir: Option<tempfile::TempDir>,
}

static BROKER: OnceCell<Broker> = OnceCell::const_new();

fn tansu_binary() -> PathBuf {
    let from_env = std::env::var_os("TANSU").map(PathBuf::from);
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    let candidates = from_env.into_iter().chain(cargo_home.map(|h| h.join("bin/tansu")));
    for candidate in candidates {
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "the tansu Kafka broker is not installed: run `cargo install tansu --locked --features dynostore` \
         (scripts/test does it when it is missing) or point TANSU at the binary"
    );
}

/// The broker shared by the tests of this binary, started on first use.
pub async fn broker() -> &'static Broker {
    BROKER.get_or_init(|| async { Broker::start(None) }).await
}

impl Broker {
    /// Starts a broker of its own. It advertises itself as `localhost:<its port>` (real clusters
    /// advertise names, so the plugin needs dns), or as `127.0.0.1:<advertise>` when given, for
    /// tests that put a proxy in front of it.
    pub fn start(advertise: Option<u16>) -> Broker {
        let port = free_port();
        let advertised = match advertise {
            Some(proxy) => format!("tcp://127.0.0.1:{proxy}"),
            None => format!("tcp://localhost:{port}"),
        };
        let (wrapper, log) = spawn(port, &advertised, "memory://tansu/", &[], None);
        wait_for(port, &log);
        Broker { port, _wrapper: wrapper, _dir: None }
    }

    /// Starts a broker that requires SASL (SCRAM-SHA-256 and -512; tansu has no PLAIN) from the
    /// users `(name, password, mechanism)` (mechanism `scram256` or `scram512`), with the topics
    /// `(name, partitions)` already made. Users live in the storage, so it is a SQLite file: the
    /// broker is started once without authentication to create them and the topics, then again
    /// with it.
    pub fn start_authenticated(users: &[(&str, &str, &str)], topics: &[(&str, i32)]) -> Broker {
        let dir = tempfile::tempdir().expect("broker storage directory");
        let storage = "sqlite://tansu.db";
        let port = free_port();
        let advertised = format!("tcp://localhost:{port}");
        let url = format!("tcp://127.0.0.1:{port}");
        let (mut setup, log) = spawn(port, &advertised, storage, &[], Some(dir.path()));
        wait_for(port, &log);
        let run = |args: &[&str]| {
            let out = std::process::Command::new(tansu_binary())
                .args(args)
                .current_dir(dir.path())
                .output()
                .expect("tansu runs");
            assert!(out.status.success(), "tansu {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        for (name, password, mechanism) in users {
            run(&["user", "create", "--broker", &url, "--mechanism", mechanism, name, password]);
        }
        for (topic, partitions) in topics {
            run(&["topic", "create", "--broker", &url, "--partitions", &partitions.to_string(), topic]);
        }
        drop(setup.stdin.take());
        let _ = setup.wait();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let (wrapper, log) = spawn(port, &advertised, storage, &["--authentication"], Some(dir.path()));
        wait_for(port, &log);
        Broker { port, _wrapper: wrapper, _dir: Some(dir) }
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub async fn client(&self) -> Client {
        ClientBuilder::new(vec![self.addr()]).build().await.expect("kafka client connects to tansu")
    }

    /// Creates a topic with a name unique to the calling test.
    pub async fn topic(&self, prefix: &str, partitions: i32) -> String {
        let name = format!("{prefix}-{}", super::rand_u64());
        self.client().await.controller_client().unwrap().create_topic(&name, partitions, 1, 5_000).await.unwrap();
        name
    }

    /// Creates a topic with a name unique to the calling test through tansu's own command, which
    /// talks to this broker only: for a broker that advertises an address a Kafka client cannot
    /// follow in plaintext (a TLS front).
    pub fn topic_directly(&self, prefix: &str, partitions: i32) -> String {
        let name = format!("{prefix}-{}", super::rand_u64());
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let out = std::process::Command::new(tansu_binary())
            .args(["topic", "create", "--broker", &url, "--partitions", &partitions.to_string(), &name])
            .output()
            .expect("tansu runs");
        assert!(out.status.success(), "tansu topic create: {}", String::from_utf8_lossy(&out.stderr));
        name
    }

    /// Every record of `topic`, with its partition.
    pub async fn records(&self, topic: &str, partitions: i32) -> Vec<(i32, rskafka::record::Record)> {
        let client = self.client().await;
        let mut all = Vec::new();
        for partition in 0..partitions {
            let pc = client.partition_client(topic, partition, UnknownTopicHandling::Retry).await.unwrap();
            let (records, _) = pc.fetch_records(0, 1..10_000_000, 100).await.unwrap();
            all.extend(records.into_iter().map(|r| (partition, r.record)));
        }
        all
    }
}

/// A TLS front for a broker: Debian's stunnel, with the server certificate of [`crate::test_pki`]
/// made in `pki`, forwarding to `upstream`; with `client_certificates`, it refuses clients without
/// a certificate from that CA. Stopped when dropped.
pub struct TlsFront {
    pub port: u16,
    process: std::process::Child,
}

impl TlsFront {
    pub fn start(pki: &std::path::Path, port: u16, upstream: u16, client_certificates: bool) -> TlsFront {
        let mut config = format!(
            "foreground = yes\npid =\noutput = {log}\n[kafka]\naccept = 127.0.0.1:{port}\n\
             connect = 127.0.0.1:{upstream}\ncert = {cert}\nkey = {key}\n",
            log = pki.join(format!("stunnel-{port}.log")).display(),
            cert = pki.join("server.pem").display(),
            key = pki.join("server.key").display(),
        );
        if client_certificates {
            config.push_str(&format!(
                "requireCert = yes\nverifyChain = yes\nCAfile = {}\n",
                pki.join("ca.pem").display()
            ));
        }
        let file = pki.join(format!("stunnel-{port}.conf"));
        std::fs::write(&file, config).unwrap();
        let process = std::process::Command::new("stunnel4")
            .arg(&file)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("stunnel4 runs (scripts/test installs Debian's stunnel4)");
        wait_for(port, &pki.join(format!("stunnel-{port}.log")));
        TlsFront { port, process }
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts tansu on `port` through a shell wrapper that stops it when its stdin closes (when the
/// test process goes away, or the returned child's stdin is dropped). Returns the wrapper and
/// the broker's log file.
fn spawn(
    port: u16,
    advertised: &str,
    storage: &str,
    extra: &[&str],
    dir: Option<&std::path::Path>,
) -> (std::process::Child, PathBuf) {
    let tansu = tansu_binary();
    let extra = extra.join(" ");
    let script = format!(
        "{tansu:?} broker --listener-url tcp://127.0.0.1:{port} --advertised-listener-url {advertised} \
         --storage-engine {storage} {extra} >\"$LOG\" 2>&1 & pid=$!; cat >/dev/null; kill $pid; wait $pid"
    );
    let log = std::env::temp_dir().join(format!("ferry-test-tansu-{port}.log"));
    let mut command = std::process::Command::new("sh");
    command.arg("-c").arg(script).env("LOG", &log).stdin(Stdio::piped());
    if let Some(dir) = dir {
        command.current_dir(dir);
    }
    (command.spawn().expect("start tansu"), log)
}

/// Waits until the broker on `port` accepts connections.
fn wait_for(port: u16, log: &std::path::Path) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "tansu did not listen on {port} within 30s; its log: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A TCP proxy in front of a broker that counts the Kafka requests passing through it, by API key
/// (the first two bytes after each frame's length), and their bytes; it can also lose the answer
/// to a produce request (the broker gets the request, the client never sees the answer).
pub struct CountingProxy {
    counts: Arc<Mutex<HashMap<i16, (u32, u64)>>>,
    lose_produce_answer: Arc<AtomicBool>,
}

impl CountingProxy {
    /// Listens on `port` (which the broker advertises) and forwards to the broker on `upstream`.
    pub async fn start_on(port: u16, upstream: u16) -> CountingProxy {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("bind proxy");
        let proxy = CountingProxy { counts: Arc::default(), lose_produce_answer: Arc::default() };
        let (tally, lose) = (proxy.counts.clone(), proxy.lose_produce_answer.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else { continue };
                let (mut server_read, mut server_write) = server.into_split();
                let (mut client_read, mut client_write) = client.into_split();
                let (tally, lose) = (tally.clone(), lose.clone());
                // Set when this connection's next answer is to be lost.
                let swallow = Arc::new(AtomicBool::new(false));
                let swallowing = swallow.clone();
                tokio::spawn(async move {
                    // Requests: forward frame by frame, counting API keys.
                    while let Some((size, frame)) = read_frame(&mut client_read).await {
                        if frame.len() >= 2 {
                            let key = i16::from_be_bytes([frame[0], frame[1]]);
                            let mut counts = tally.lock().unwrap();
                            let entry = counts.entry(key).or_insert((0, 0));
                            entry.0 += 1;
                            entry.1 += frame.len() as u64 + 4;
                            if key == 0 && lose.swap(false, Ordering::SeqCst) {
                                swallowing.store(true, Ordering::SeqCst);
                            }
                        }
                        if server_write.write_all(&size).await.is_err() || server_write.write_all(&frame).await.is_err()
                        {
                            break;
                        }
                    }
                });
                tokio::spawn(async move {
                    // Answers: forwarded, unless one is to be lost: then the connection closes
                    // without it, as when a network fails after the broker wrote the records.
                    while let Some((size, frame)) = read_frame(&mut server_read).await {
                        if swallow.load(Ordering::SeqCst) {
                            let _ = client_write.shutdown().await;
                            break;
                        }
                        if client_write.write_all(&size).await.is_err() || client_write.write_all(&frame).await.is_err()
                        {
                            break;
                        }
                    }
                });
            }
        });
        proxy
    }

    /// How many requests with this API key went through (0 = Produce, 3 = Metadata).
    pub fn count(&self, api_key: i16) -> u32 {
        self.counts.lock().unwrap().get(&api_key).map_or(0, |c| c.0)
    }

    /// How many bytes of requests with this API key went through, frames included.
    pub fn bytes(&self, api_key: i16) -> u64 {
        self.counts.lock().unwrap().get(&api_key).map_or(0, |c| c.1)
    }

    /// Loses the answer to the next produce request: the broker handles it, the connection to
    /// the client is closed before the answer reaches it.
    pub fn lose_next_produce_answer(&self) {
        self.lose_produce_answer.store(true, Ordering::SeqCst);
    }
}

/// One Kafka frame (size prefix, then that many bytes), or `None` at the end of the stream.
async fn read_frame(from: &mut (impl tokio::io::AsyncRead + Unpin)) -> Option<([u8; 4], Vec<u8>)> {
    let mut size = [0u8; 4];
    from.read_exact(&mut size).await.ok()?;
    let mut frame = vec![0u8; i32::from_be_bytes(size).max(0) as usize];
    from.read_exact(&mut frame).await.ok()?;
    Some((size, frame))
}
