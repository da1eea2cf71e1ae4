//! A Kafka-protocol broker for the tests: tansu with in-memory storage, started once per test
//! binary, plus a Kafka client (rskafka) to create topics and read back what was produced.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use rskafka::client::partition::UnknownTopicHandling;
use rskafka::client::{Client, ClientBuilder};
use tokio::sync::OnceCell;

/// A tansu broker with in-memory storage, shared by the tests of this binary. It is started
/// through a small shell wrapper that stops it when the test process goes away (its stdin
/// closes), so no broker outlives the tests.
pub struct Broker {
    pub port: u16,
    _wrapper: std::process::Child,
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

pub async fn broker() -> &'static Broker {
    BROKER
        .get_or_init(|| async {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let tansu = tansu_binary();
            // Brokers advertise themselves by name, as real clusters do, so the plugin needs dns.
            let script = format!(
                "{tansu:?} broker --listener-url tcp://127.0.0.1:{port} --advertised-listener-url tcp://localhost:{port} \
                 --storage-engine memory://tansu/ >\"$LOG\" 2>&1 & pid=$!; cat >/dev/null; kill $pid"
            );
            let log = std::env::temp_dir().join(format!("ferry-test-tansu-{port}.log"));
            let wrapper = std::process::Command::new("sh")
                .arg("-c")
                .arg(script)
                .env("LOG", &log)
                .stdin(Stdio::piped())
                .spawn()
                .expect("start tansu");
            let broker = Broker { port, _wrapper: wrapper };
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "tansu did not listen on {port} within 30s; its log: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            broker
        })
        .await
}

impl Broker {
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
