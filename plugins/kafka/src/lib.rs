//! The `kafka` transport: a Kafka producer speaking the wire protocol over wasi:sockets TCP.
//!
//! Route configuration:
//! - `brokers` (required) — bootstrap brokers, comma-separated `host:port`; every broker the
//!   cluster advertises must be on the plugin's `sandbox.kafka.tcp` allowlist;
//! - `topic` (required) — the topic every event of the route is produced to;
//! - `acks` — `all` (default), `1` or `0`;
//! - `timeout_ms` — connect and request timeout, also sent to the broker as the produce timeout;
//!   default 30000;
//! - `max_request_bytes` — the largest produce request sent; a record that cannot fit in one is
//!   refused before it is sent, like the Java client's `max.request.size`; default 1048576;
//! - `client_id` — default `ferry`;
//! - `metadata_max_age_ms` — how long partition leaders are trusted before they are fetched
//!   again; default 300000. Errors that mean leadership moved refresh them at once.
//!
//! Each event becomes one record: the ordering key is the record key (which picks the partition
//! with murmur2, as the Java client does; events without a key are spread round-robin), the
//! payload is the value, the event time is the timestamp, and the headers are the event's own plus
//! `ferry-event-id`, `ferry-event-type` and `content-type`. A batch is sent as one produce request
//! per partition leader (split only where `max_request_bytes` demands). Connections stay open
//! across calls. Broker answers map to outcomes as in [`policy::classify`].

mod client;
pub mod policy;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use kafka_protocol::indexmap::IndexMap;
use kafka_protocol::messages::ProduceRequest;
use kafka_protocol::messages::produce_request::{PartitionProduceData, TopicProduceData};
use kafka_protocol::protocol::StrBytes;
use kafka_protocol::records::{
    Compression, NO_PARTITION_LEADER_EPOCH, NO_PRODUCER_EPOCH, NO_PRODUCER_ID, NO_SEQUENCE, Record, RecordBatchEncoder,
    RecordEncodeOptions, TimestampType,
};

use client::{Connection, Connections, NetError};
use ferry_plugin_sdk::outcome::{permanent, transient};
use ferry_plugin_sdk::{Config, Event, Outcome, Transport, log};
use policy::Class;

/// Bytes a produce request needs besides its records (headers, topic and partition framing,
/// the record batch header), rounded up generously.
const REQUEST_OVERHEAD: usize = 512;

struct Settings {
    brokers: Vec<(String, u16)>,
    topic: String,
    acks: i16,
    timeout: Duration,
    max_request_bytes: usize,
    client_id: String,
    metadata_max_age: Duration,
}

/// Where the partitions of the route's topic live, as last read from the cluster.
struct Cluster {
    brokers: HashMap<i32, (String, u16)>,
    /// The leader's broker id for each partition index; `None` while a partition has no leader.
    leaders: Vec<Option<i32>>,
    fetched: Instant,
    stale: bool,
}

struct State {
    settings: Settings,
    connections: Connections,
    cluster: Option<Cluster>,
    next_partition: u32,
}

impl Transport for State {
    const NAME: &'static str = "kafka";

    fn init(config: &mut Config) -> Result<State, String> {
        let settings = parse_settings(config)?;
        log::info(&format!("producing to topic {} via {} bootstrap broker(s)", settings.topic, settings.brokers.len()));
        Ok(State { settings, connections: Connections::default(), cluster: None, next_partition: 0 })
    }

    fn deliver(&mut self, events: Vec<Event>) -> Vec<Outcome> {
        self.produce(&events)
    }
}

ferry_plugin_sdk::transport!(State);

fn parse_settings(config: &mut Config) -> Result<Settings, String> {
    let brokers = policy::parse_brokers(&config.required("brokers")?)?;
    let topic = config.required("topic")?.trim().to_string();
    let acks = match config.optional("acks") {
        Some(value) => policy::parse_acks(&value)?,
        None => -1,
    };
    let timeout = Duration::from_millis(config.positive_or("timeout_ms", 30_000)?);
    let max_request_bytes =
        usize::try_from(config.positive_or("max_request_bytes", 1024 * 1024)?).unwrap_or(usize::MAX);
    if max_request_bytes <= REQUEST_OVERHEAD {
        return Err(format!("max_request_bytes: must exceed {REQUEST_OVERHEAD}, got {max_request_bytes}"));
    }
    let client_id = config.optional("client_id").unwrap_or_else(|| "ferry".into());
    let metadata_max_age = Duration::from_millis(config.positive_or("metadata_max_age_ms", 300_000)?);
    Ok(Settings { brokers, topic, acks, timeout, max_request_bytes, client_id, metadata_max_age })
}

/// The events bound for one partition, by their index in the batch.
type PartitionGroups = BTreeMap<i32, Vec<usize>>;

/// A produce request written to a broker and awaiting its answer.
struct InFlight {
    leader: i32,
    correlation: Option<i32>,
    partitions: PartitionGroups,
}

impl State {
    fn produce(&mut self, events: &[Event]) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = events.iter().map(|_| None).collect();
        if let Err(outcome) = self.ensure_cluster() {
            return events.iter().map(|_| outcome.clone()).collect();
        }
        let cluster = self.cluster.as_ref().expect("ensure_cluster sets the cluster");

        // Assign each event its partition, grouped by leader, refusing records that can never fit.
        let mut by_leader: BTreeMap<i32, Vec<(usize, usize, i32)>> = BTreeMap::new();
        let mut stale = false;
        for (i, event) in events.iter().enumerate() {
            let size = record_size(event);
            if size + REQUEST_OVERHEAD > self.settings.max_request_bytes {
                outcomes[i] = Some(permanent(format!(
                    "MESSAGE_TOO_LARGE: the record is {size} bytes, more than max_request_bytes ({}) allows",
                    self.settings.max_request_bytes
                )));
                continue;
            }
            let partitions = cluster.leaders.len() as u32;
            let partition = match &event.ordering_key {
                Some(key) => policy::partition_for_key(key.as_bytes(), partitions),
                None => {
                    self.next_partition = self.next_partition.wrapping_add(1);
                    self.next_partition % partitions
                }
            };
            match cluster.leaders[partition as usize] {
                Some(leader) => by_leader.entry(leader).or_default().push((i, size, partition as i32)),
                None => {
                    stale = true;
                    outcomes[i] = Some(transient(format!(
                        "LEADER_NOT_AVAILABLE: partition {partition} of {} has no leader",
                        self.settings.topic
                    )));
                }
            }
        }

        // Write every request first, so the leaders work in parallel, then collect the answers.
        let mut in_flight = Vec::new();
        for (leader, members) in by_leader {
            for chunk in split_by_size(&members, self.settings.max_request_bytes) {
                let mut partitions = PartitionGroups::new();
                for &(i, _, partition) in chunk {
                    partitions.entry(partition).or_default().push(i);
                }
                match self.send(leader, events, &partitions) {
                    Ok(correlation) => in_flight.push(InFlight { leader, correlation, partitions }),
                    Err(reason) => {
                        stale = true;
                        fill(&mut outcomes, partitions.values().flatten(), transient(reason));
                    }
                }
            }
        }
        for request in in_flight {
            stale |= self.collect(request, &mut outcomes);
        }
        if stale && let Some(cluster) = self.cluster.as_mut() {
            cluster.stale = true;
        }
        outcomes.into_iter().map(|o| o.unwrap_or_else(|| transient("kafka transport: no answer"))).collect()
    }

    /// Makes sure partition leaders are known and fresh; the error is the outcome for every event.
    fn ensure_cluster(&mut self) -> Result<(), Outcome> {
        if let Some(cluster) = &self.cluster
            && !cluster.stale
            && cluster.fetched.elapsed() < self.settings.metadata_max_age
        {
            return Ok(());
        }
        let topic = self.settings.topic.clone();
        let mut failures = Vec::new();
        // Any open connection will do; otherwise bootstrap from the configured brokers.
        let ids: Vec<i32> = self.connections.by_broker.keys().copied().collect();
        for id in ids {
            let connection = self.connections.by_broker.get_mut(&id).expect("listed");
            match connection.metadata(&topic, &self.settings.client_id) {
                Ok(response) => return self.adopt(response),
                Err(e) => {
                    failures.push(e);
                    self.connections.by_broker.remove(&id);
                }
            }
        }
        for (host, port) in self.settings.brokers.clone() {
            let attempt = Connection::open(&host, port, self.settings.timeout, &self.settings.client_id)
                .and_then(|mut c| c.metadata(&topic, &self.settings.client_id).map(|r| (c, r)));
            match attempt {
                Ok((connection, response)) => {
                    self.connections.bootstrap = Some(connection);
                    return self.adopt(response);
                }
                Err(e) => failures.push(e),
            }
        }
        Err(transient(format!("no broker answered a metadata request: {}", failures.join("; "))))
    }

    fn adopt(&mut self, response: kafka_protocol::messages::MetadataResponse) -> Result<(), Outcome> {
        let topic_name = &self.settings.topic;
        let brokers: HashMap<i32, (String, u16)> = response
            .brokers
            .iter()
            .map(|b| (b.node_id.0, (b.host.as_str().to_string(), u16::try_from(b.port).unwrap_or(0))))
            .collect();
        let Some(topic) = response.topics.iter().find(|t| t.name.as_ref().is_some_and(|n| n.0.as_str() == topic_name))
        else {
            return Err(transient(format!("metadata response does not mention topic {topic_name}")));
        };
        match policy::classify(topic.error_code) {
            Class::Ok => {}
            Class::Permanent(why) => {
                return Err(permanent(format!("topic {topic_name}: {why} (code {})", topic.error_code)));
            }
            Class::Transient(why) => {
                return Err(transient(format!("topic {topic_name}: {why} (code {})", topic.error_code)));
            }
        }
        let count = topic.partitions.iter().map(|p| p.partition_index + 1).max().unwrap_or(0).max(0) as usize;
        if count == 0 {
            return Err(transient(format!("topic {topic_name} has no partitions")));
        }
        let mut leaders = vec![None; count];
        for partition in &topic.partitions {
            let leader = partition.leader_id.0;
            if partition.error_code == 0 && leader >= 0 && brokers.contains_key(&leader) {
                leaders[partition.partition_index as usize] = Some(leader);
            }
        }
        // Keep connections only to brokers that are still in the cluster at the same address.
        let previous = self.cluster.as_ref().map(|c| c.brokers.clone()).unwrap_or_default();
        self.connections.by_broker.retain(|id, _| previous.get(id).is_some_and(|a| brokers.get(id) == Some(a)));
        self.cluster = Some(Cluster { brokers, leaders, fetched: Instant::now(), stale: false });
        Ok(())
    }

    fn connection(&mut self, leader: i32) -> Result<&mut Connection, NetError> {
        if !self.connections.by_broker.contains_key(&leader) {
            let cluster = self.cluster.as_ref().expect("cluster known");
            let (host, port) = cluster.brokers.get(&leader).ok_or(format!("broker {leader} is not in the metadata"))?;
            // The bootstrap connection is reused when it reached this very broker.
            let reuse = self.connections.bootstrap.take_if(|c| c.address() == format!("{host}:{port}"));
            let connection = match reuse {
                Some(c) => c,
                None => Connection::open(host, *port, self.settings.timeout, &self.settings.client_id)?,
            };
            self.connections.by_broker.insert(leader, connection);
        }
        Ok(self.connections.by_broker.get_mut(&leader).expect("inserted"))
    }

    fn send(&mut self, leader: i32, events: &[Event], partitions: &PartitionGroups) -> Result<Option<i32>, NetError> {
        let mut request = ProduceRequest::default();
        request.acks = self.settings.acks;
        request.timeout_ms = i32::try_from(self.settings.timeout.as_millis()).unwrap_or(i32::MAX);
        let mut data = TopicProduceData::default();
        data.name = StrBytes::from_string(self.settings.topic.clone()).into();
        for (&partition, members) in partitions {
            let mut part = PartitionProduceData::default();
            part.index = partition;
            part.records = Some(encode_batch(members.iter().map(|&i| &events[i]))?);
            data.partition_data.push(part);
        }
        request.topic_data.push(data);
        let client_id = self.settings.client_id.clone();
        let result = self.connection(leader)?.send_produce(&request, &client_id);
        if result.is_err() {
            self.connections.by_broker.remove(&leader);
        }
        result
    }

    /// Reads one produce answer into `outcomes`; returns whether the metadata should be refreshed.
    fn collect(&mut self, request: InFlight, outcomes: &mut [Option<Outcome>]) -> bool {
        let all = |outcomes: &mut [Option<Outcome>], outcome: Outcome| {
            fill(outcomes, request.partitions.values().flatten(), outcome);
        };
        let Some(correlation) = request.correlation else {
            all(outcomes, Outcome::Success);
            return false;
        };
        let answer = match self.connections.by_broker.get_mut(&request.leader) {
            Some(connection) => connection.receive_produce(correlation),
            None => Err(format!("connection to broker {} was lost", request.leader)),
        };
        let response = match answer {
            Ok(response) => response,
            Err(reason) => {
                // The stream may hold half an answer; start afresh next time.
                self.connections.by_broker.remove(&request.leader);
                all(outcomes, transient(reason));
                return true;
            }
        };
        let topic = &self.settings.topic;
        let mut stale = false;
        let answers: HashMap<i32, _> = response
            .responses
            .iter()
            .filter(|t| t.name.0.as_str() == topic)
            .flat_map(|t| t.partition_responses.iter().map(|p| (p.index, p)))
            .collect();
        for (partition, members) in &request.partitions {
            let Some(answer) = answers.get(partition) else {
                fill(outcomes, members, transient(format!("no answer for partition {partition} of {topic}")));
                continue;
            };
            let code = answer.error_code;
            stale |= policy::stale_metadata(code);
            let detail = answer.error_message.as_ref().map(|m| format!(": {}", m.as_str())).unwrap_or_default();
            match policy::classify(code) {
                Class::Ok => fill(outcomes, members, Outcome::Success),
                Class::Transient(why) => {
                    fill(outcomes, members, transient(format!("{topic}[{partition}]: {why} (code {code}){detail}")))
                }
                Class::Permanent(why) if code == 87 && !answer.record_errors.is_empty() => {
                    // Only the records the broker names are invalid; the rest of the batch was
                    // refused with them and goes again on the next attempt.
                    for (index, &i) in members.iter().enumerate() {
                        let named = answer.record_errors.iter().find(|r| r.batch_index as usize == index);
                        outcomes[i] = Some(match named {
                            Some(r) => permanent(format!(
                                "{topic}[{partition}]: {why} (code {code}): {}",
                                r.batch_index_error_message.as_ref().map(|m| m.as_str()).unwrap_or("no detail")
                            )),
                            None => transient(format!(
                                "{topic}[{partition}]: refused together with an invalid record in the same batch"
                            )),
                        });
                    }
                }
                Class::Permanent(why) => {
                    fill(outcomes, members, permanent(format!("{topic}[{partition}]: {why} (code {code}){detail}")))
                }
            }
        }
        stale
    }
}

/// Splits one leader's events into runs whose records fit in `max_bytes` requests.
fn split_by_size(members: &[(usize, usize, i32)], max_bytes: usize) -> Vec<&[(usize, usize, i32)]> {
    let mut chunks = Vec::new();
    let mut start = 0;
    let mut bytes = REQUEST_OVERHEAD;
    for (n, &(_, size, _)) in members.iter().enumerate() {
        if n > start && bytes + size > max_bytes {
            chunks.push(&members[start..n]);
            start = n;
            bytes = REQUEST_OVERHEAD;
        }
        bytes += size;
    }
    if start < members.len() {
        chunks.push(&members[start..]);
    }
    chunks
}

/// An upper bound on the encoded size of the event's record.
fn record_size(event: &Event) -> usize {
    let headers: usize = event.headers.iter().map(|(k, v)| k.len() + v.len() + 10).sum();
    let own = "ferry-event-id".len() + 20 + "ferry-event-type".len() + event.event_type.len() + "content-type".len();
    64 + event.payload.len()
        + event.ordering_key.as_ref().map_or(0, String::len)
        + headers
        + own
        + event.content_type.len()
}

/// Encodes the events as one uncompressed record batch (format v2, with headers).
fn encode_batch<'a>(events: impl Iterator<Item = &'a Event>) -> Result<Bytes, NetError> {
    let records: Vec<Record> = events
        .enumerate()
        .map(|(offset, event)| {
            let mut headers = IndexMap::new();
            for (name, value) in &event.headers {
                headers.insert(StrBytes::from_string(name.clone()), Some(Bytes::from(value.clone().into_bytes())));
            }
            headers.insert(StrBytes::from_static_str("ferry-event-id"), Some(Bytes::from(event.id.to_string())));
            headers.insert(StrBytes::from_static_str("ferry-event-type"), Some(Bytes::from(event.event_type.clone())));
            headers.insert(StrBytes::from_static_str("content-type"), Some(Bytes::from(event.content_type.clone())));
            Record {
                transactional: false,
                control: false,
                delete_horizon: false,
                partition_leader_epoch: NO_PARTITION_LEADER_EPOCH,
                producer_id: NO_PRODUCER_ID,
                producer_epoch: NO_PRODUCER_EPOCH,
                timestamp_type: TimestampType::Creation,
                offset: offset as i64,
                sequence: NO_SEQUENCE,
                timestamp: event.event_time,
                key: event.ordering_key.as_ref().map(|k| Bytes::from(k.clone().into_bytes())),
                value: Some(Bytes::from(event.payload.clone())),
                headers,
            }
        })
        .collect();
    let mut buf = BytesMut::new();
    RecordBatchEncoder::encode(&mut buf, &records, &RecordEncodeOptions { version: 2, compression: Compression::None })
        .map_err(|e| format!("encoding records: {e}"))?;
    Ok(buf.freeze())
}

fn fill<'a>(outcomes: &mut [Option<Outcome>], members: impl IntoIterator<Item = &'a usize>, outcome: Outcome) {
    for &i in members {
        outcomes[i] = Some(outcome.clone());
    }
}
