//! A Kafka-protocol broker for the tests: tansu with in-memory storage, started once per test
//! binary, plus a Kafka client (rskafka) to create topics and read back what was produced.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
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
    /// With `advertise`, it advertises `localhost:<that port>` (a front such as [`TlsFront`]).
    pub fn start_authenticated(users: &[(&str, &str, &str)], topics: &[(&str, i32)], advertise: Option<u16>) -> Broker {
        let dir = tempfile::tempdir().expect("broker storage directory");
        let storage = "sqlite://tansu.db";
        let port = free_port();
        let advertised = format!("tcp://localhost:{}", advertise.unwrap_or(port));
        let url = format!("tcp://127.0.0.1:{port}");
        let (mut setup, log) = spawn(port, &advertised, storage, &[], Some(dir.path()));
        wait_for(port, &log);
        for (name, password, mechanism) in users {
            tansu(&["user", "create", "--broker", &url, "--mechanism", mechanism, name, password]);
        }
        for (topic, partitions) in topics {
            tansu(&["topic", "create", "--broker", &url, "--partitions", &partitions.to_string(), topic]);
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
        tansu(&["topic", "create", "--broker", &url, "--partitions", &partitions.to_string(), &name]);
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

/// Runs one of tansu's own commands (which talk to the broker named by `--broker`).
fn tansu(args: &[&str]) {
    let out = std::process::Command::new(tansu_binary()).args(args).output().expect("tansu runs");
    assert!(out.status.success(), "tansu {args:?}: {}", String::from_utf8_lossy(&out.stderr));
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

/// A SASL/PLAIN front for a broker, as a Kafka broker configured for PLAIN behaves (tansu offers
/// SCRAM only): it answers SaslHandshake and SaslAuthenticate itself, checking the user name and
/// password, states a session lifetime, and forwards every other request of an authenticated
/// connection to the broker on `upstream` (ApiVersions also before). A connection that sends
/// anything else before authenticating is closed. Counts connections and authentications.
pub struct SaslPlainFront {
    connections: Arc<AtomicU32>,
    authentications: Arc<AtomicU32>,
    produced: Arc<AtomicU32>,
}

impl SaslPlainFront {
    pub async fn start_on(port: u16, upstream: u16, user: &str, password: &str, lifetime_ms: i64) -> SaslPlainFront {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.expect("bind front");
        let front =
            SaslPlainFront { connections: Arc::default(), authentications: Arc::default(), produced: Arc::default() };
        let (connections, authentications, produced) =
            (front.connections.clone(), front.authentications.clone(), front.produced.clone());
        let expected = format!("\0{user}\0{password}").into_bytes();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                connections.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else { continue };
                let (authentications, produced, expected) =
                    (authentications.clone(), produced.clone(), expected.clone());
                tokio::spawn(async move {
                    let (mut server_read, mut server_write) = server.into_split();
                    let (mut client_read, client_write) = client.into_split();
                    let client_write = Arc::new(tokio::sync::Mutex::new(client_write));
                    let answers = client_write.clone();
                    tokio::spawn(async move {
                        while let Some((size, frame)) = read_frame(&mut server_read).await {
                            let mut out = answers.lock().await;
                            if out.write_all(&size).await.is_err() || out.write_all(&frame).await.is_err() {
                                break;
                            }
                        }
                    });
                    let mut authenticated = false;
                    while let Some((size, frame)) = read_frame(&mut client_read).await {
                        let Some(request) = Request::parse(&frame) else { break };
                        let answer = match request.api_key {
                            17 => Some(handshake_answer(&request)),
                            36 => {
                                let ok = request.auth_bytes() == Some(expected.as_slice());
                                authenticated = ok;
                                if ok {
                                    authentications.fetch_add(1, Ordering::SeqCst);
                                }
                                Some(authenticate_answer(&request, ok, lifetime_ms))
                            }
                            18 => None,
                            0 if authenticated => {
                                produced.fetch_add(1, Ordering::SeqCst);
                                None
                            }
                            _ if authenticated => None,
                            _ => break,
                        };
                        match answer {
                            Some(answer) => {
                                let mut out = client_write.lock().await;
                                let framed = [&(answer.len() as i32).to_be_bytes()[..], &answer].concat();
                                if out.write_all(&framed).await.is_err() {
                                    break;
                                }
                            }
                            None => {
                                if server_write.write_all(&size).await.is_err()
                                    || server_write.write_all(&frame).await.is_err()
                                {
                                    break;
                                }
                            }
                        }
                    }
                });
            }
        });
        front
    }

    pub fn connections(&self) -> u32 {
        self.connections.load(Ordering::SeqCst)
    }

    /// Produce requests forwarded to the broker, all from authenticated connections.
    pub fn produced(&self) -> u32 {
        self.produced.load(Ordering::SeqCst)
    }

    /// Successful authentications, first ones and re-authentications.
    pub fn authentications(&self) -> u32 {
        self.authentications.load(Ordering::SeqCst)
    }
}

/// The parts of a Kafka request the PLAIN front needs.
struct Request<'a> {
    api_key: i16,
    version: i16,
    correlation: [u8; 4],
    body: &'a [u8],
}

impl<'a> Request<'a> {
    fn parse(frame: &'a [u8]) -> Option<Request<'a>> {
        let api_key = i16::from_be_bytes(frame.get(0..2)?.try_into().ok()?);
        let version = i16::from_be_bytes(frame.get(2..4)?.try_into().ok()?);
        let correlation = frame.get(4..8)?.try_into().ok()?;
        let client_id = i16::from_be_bytes(frame.get(8..10)?.try_into().ok()?).max(0) as usize;
        let mut at = 10 + client_id;
        // Flexible versions (SaslAuthenticate v2) add tagged fields to the header.
        if api_key == 36 && version >= 2 {
            let (count, used) = uvarint(frame.get(at..)?)?;
            if count != 0 {
                return None; // no client sends header tags here
            }
            at += used;
        }
        Some(Request { api_key, version, correlation, body: frame.get(at..)? })
    }

    /// The bytes of a SaslAuthenticate request.
    fn auth_bytes(&self) -> Option<&'a [u8]> {
        if self.version >= 2 {
            let (length, used) = uvarint(self.body)?;
            self.body.get(used..used + (length as usize).checked_sub(1)?)
        } else {
            let length = i32::from_be_bytes(self.body.get(0..4)?.try_into().ok()?).max(0) as usize;
            self.body.get(4..4 + length)
        }
    }
}

fn uvarint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (i, byte) in bytes.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((value, i + 1));
        }
    }
    None
}

/// SaslHandshake v0/v1 answer: PLAIN accepted when asked for, else UNSUPPORTED_SASL_MECHANISM.
fn handshake_answer(request: &Request<'_>) -> Vec<u8> {
    let length = request.body.get(0..2).map_or(0, |b| i16::from_be_bytes([b[0], b[1]]).max(0) as usize);
    let mechanism = request.body.get(2..2 + length).unwrap_or_default();
    let error: i16 = if mechanism == b"PLAIN" { 0 } else { 33 };
    let mut answer = request.correlation.to_vec();
    answer.extend_from_slice(&error.to_be_bytes());
    answer.extend_from_slice(&1i32.to_be_bytes());
    answer.extend_from_slice(&5i16.to_be_bytes());
    answer.extend_from_slice(b"PLAIN");
    answer
}

/// SaslAuthenticate answer in the request's version: success with the session lifetime, or
/// SASL_AUTHENTICATION_FAILED (58) with a message.
fn authenticate_answer(request: &Request<'_>, ok: bool, lifetime_ms: i64) -> Vec<u8> {
    let (error, message): (i16, &[u8]) =
        if ok { (0, b"") } else { (58, b"Authentication failed: invalid credentials") };
    let mut answer = request.correlation.to_vec();
    if request.version >= 2 {
        answer.push(0); // header tagged fields
        answer.extend_from_slice(&error.to_be_bytes());
        if ok {
            answer.push(0); // null message
        } else {
            answer.push(message.len() as u8 + 1);
            answer.extend_from_slice(message);
        }
        answer.push(1); // empty auth bytes
        answer.extend_from_slice(&lifetime_ms.to_be_bytes());
        answer.push(0); // tagged fields
    } else {
        answer.extend_from_slice(&error.to_be_bytes());
        if ok {
            answer.extend_from_slice(&(-1i16).to_be_bytes());
        } else {
            answer.extend_from_slice(&(message.len() as i16).to_be_bytes());
            answer.extend_from_slice(message);
        }
        answer.extend_from_slice(&0i32.to_be_bytes());
        if request.version >= 1 {
            answer.extend_from_slice(&lifetime_ms.to_be_bytes());
        }
    }
    answer
}
