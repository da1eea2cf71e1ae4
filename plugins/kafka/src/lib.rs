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
//!   again; default 300000. Errors that mean leadership moved refresh them at once;
//! - `idempotence` — the idempotent producer, `true` by default with `acks = all`;
//! - `compression` — `none` (default), `gzip`, `snappy`, `lz4` or `zstd`;
//! - `tls`, `tls_server_name` — TLS done by the host (wasi:tls), verified for each broker's name
//!   or this one;
//! - `sasl_mechanism` (`PLAIN`, `SCRAM-SHA-256`, `SCRAM-SHA-512`), `sasl_username`, and one of
//!   `sasl_password`, `sasl_password_env`, `sasl_password_file`;
//! - `cloudevents` — `binary`: CloudEvents 1.0 attributes as `ce_` headers (the Kafka protocol
//!   binding's binary mode), the payload as the value; `cloudevents_source` — the `source`
//!   attribute, default `/ferry/ROUTE`.
//!
//! Each event becomes one record: the ordering key is the record key (which picks the partition
//! with murmur2, as the Java client does; events without a key are spread round-robin), the
//! payload is the value, the event time is the timestamp, and the headers are the event's own plus
//! `ferry-event-id`, `ferry-event-type` and `content-type`. A batch is sent as one produce request
//! per partition leader (split only where `max_request_bytes` demands). Connections stay open
//! across calls. Broker answers map to outcomes as in [`policy::classify`].

mod client;
mod codec;
pub mod policy;
mod producer;
mod sasl;
mod tls;

use std::collections::{BTreeMap, HashMap, HashSet};
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

use client::{Auth, Connection, Connections, NetError};
use ferry_plugin_sdk::cloudevents::{CloudEvents, Mode};
use ferry_plugin_sdk::outcome::{permanent, transient};
use ferry_plugin_sdk::{Config, Event, Outcome, Transport, log};
use policy::Class;
use producer::{InDoubt, MAX_REMEMBERED, Producer, sequence_after};

/// Bytes a produce request needs besides its records (headers, topic and partition framing,
/// the record batch header), rounded up generously.
const REQUEST_OVERHEAD: usize = 512;
/// The most partitions a topic may have here (Kafka's own guidance stays far below); a broker
/// that claims more is not believed.
const MAX_PARTITIONS: usize = 1 << 16;

struct Settings {
    brokers: Vec<(String, u16)>,
    topic: String,
    acks: i16,
    timeout: Duration,
    max_request_bytes: usize,
    client_id: String,
    metadata_max_age: Duration,
    compression: Compression,
    idempotence: bool,
    auth: Option<Auth>,
    tls: Option<client::Tls>,
    cloudevents: Option<CloudEvents>,
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
    producer: Option<Producer>,
}

impl Transport for State {
    const NAME: &'static str = "kafka";

    fn init(config: &mut Config) -> Result<State, String> {
        let settings = parse_settings(config)?;
        log::info(&format!("producing to topic {} via {} bootstrap broker(s)", settings.topic, settings.brokers.len()));
        Ok(State { settings, connections: Connections::default(), cluster: None, next_partition: 0, producer: None })
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
    let compression = match config.optional("compression") {
        Some(value) => codec::parse(&value)?,
        None => Compression::None,
    };
    // Idempotence needs every in-sync replica's acknowledgement: on by default with acks = all.
    let idempotence = match config.optional("idempotence").as_deref().map(str::trim) {
        None => acks == -1,
        Some("true") if acks == -1 => true,
        Some("true") => return Err("idempotence: needs acks = all".into()),
        Some("false") => false,
        Some(other) => return Err(format!("idempotence: expected true or false, got {other:?}")),
    };
    let auth = parse_auth(config)?;
    let tls = match (config.parse_or::<bool>("tls", false)?, config.optional("tls_server_name")) {
        (true, server_name) => Some(client::Tls { server_name }),
        (false, None) => None,
        (false, Some(_)) => return Err("tls_server_name: needs tls = true".into()),
    };
    let cloudevents = CloudEvents::from_config(config, &[Mode::Binary])?;
    Ok(Settings {
        auth,
        tls,
        cloudevents,
        brokers,
        topic,
        acks,
        timeout,
        max_request_bytes,
        client_id,
        metadata_max_age,
        compression,
        idempotence,
    })
}

impl Settings {
    /// How connections to brokers are made.
    fn connect(&self) -> client::Connect<'_> {
        client::Connect {
            timeout: self.timeout,
            client_id: &self.client_id,
            auth: self.auth.as_ref(),
            tls: self.tls.as_ref(),
        }
    }
}

/// The SASL settings: a mechanism, a user name, and the password from exactly one of the route's
/// config, an environment variable granted to the plugin, or a file in a directory granted to it.
fn parse_auth(config: &mut Config) -> Result<Option<Auth>, String> {
    let mechanism = config.optional("sasl_mechanism");
    let username = config.optional("sasl_username");
    let sources =
        (config.optional("sasl_password"), config.optional("sasl_password_env"), config.optional("sasl_password_file"));
    let Some(mechanism) = mechanism else {
        if username.is_some() || sources != (None, None, None) {
            return Err(
                "sasl_mechanism: required with sasl_username and a password (PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512)"
                    .into(),
            );
        }
        return Ok(None);
    };
    let mechanism = sasl::Mechanism::parse(&mechanism)?;
    let username = username.filter(|u| !u.is_empty()).ok_or("sasl_username: required with sasl_mechanism")?;
    let password = match sources {
        (Some(password), None, None) => password,
        (None, Some(variable), None) => std::env::var(&variable).map_err(|_| {
            format!("sasl_password_env: the plugin sees no variable {variable:?} (grant it with sandbox.kafka.env)")
        })?,
        (None, None, Some(path)) => {
            std::fs::read_to_string(&path).map(|text| text.trim_end_matches(['\r', '\n']).to_string()).map_err(|e| {
                format!("sasl_password_file: cannot read {path:?}: {e} (grant its directory with sandbox.kafka.dirs)")
            })?
        }
        (None, None, None) => {
            return Err(
                "sasl_password: required with sasl_mechanism (or sasl_password_env, or sasl_password_file)".into()
            );
        }
        _ => return Err("sasl_password: give one of sasl_password, sasl_password_env and sasl_password_file".into()),
    };
    Ok(Some(Auth { mechanism, credentials: sasl::Credentials { username, password } }))
}

/// The events bound for one partition, by their index in the batch.
type PartitionGroups = BTreeMap<i32, Vec<usize>>;

/// Events of one leader: (index in the batch, record size bound, partition).
type Members = Vec<(usize, usize, i32)>;

/// A produce request written to a broker and awaiting its answer.
struct InFlight {
    leader: i32,
    correlation: Option<i32>,
    partitions: PartitionGroups,
    /// Each partition's record batch as sent, and its base sequence number (idempotent producer).
    batches: BTreeMap<i32, (Bytes, i32)>,
}

impl State {
    fn produce(&mut self, events: &[Event]) -> Vec<Outcome> {
        let mut outcomes: Vec<Option<Outcome>> = events.iter().map(|_| None).collect();
        if let Err(outcome) = self.ensure_cluster().and_then(|()| self.ensure_producer()) {
            return events.iter().map(|_| outcome.clone()).collect();
        }
        let mut stale = self.resend_in_doubt();
        if let Some(producer) = self.producer.as_mut() {
            let waiting: HashSet<u64> =
                producer.in_doubt.values().flatten().flat_map(|b| b.ids.iter().copied()).collect();
            for (i, event) in events.iter().enumerate() {
                if producer.delivered.remove(&event.id) {
                    outcomes[i] = Some(Outcome::Success);
                } else if waiting.contains(&event.id) {
                    // Its batch may be written already; it goes again only as that batch.
                    outcomes[i] = Some(transient(format!(
                        "{}: waiting for its earlier batch, whose answer was lost, to be sent again",
                        self.settings.topic
                    )));
                }
            }
        }
        let (by_leader, unassigned) = self.assign(events, &mut outcomes);
        stale |= unassigned;
        stale |= self.round(events, by_leader, &mut outcomes);
        if stale && let Some(cluster) = self.cluster.as_mut() {
            cluster.stale = true;
        }
        if self.producer.as_ref().is_some_and(|p| p.reset) {
            log::warn(&format!("starting a new idempotent producer session for topic {}", self.settings.topic));
            self.producer = None;
        }
        outcomes.into_iter().map(|o| o.unwrap_or_else(|| transient("kafka transport: no answer"))).collect()
    }

    /// Gives each event without an outcome its partition, grouped by leader; records that can
    /// never fit are refused here. Also returns whether the metadata should be refreshed.
    fn assign(&mut self, events: &[Event], outcomes: &mut [Option<Outcome>]) -> (BTreeMap<i32, Members>, bool) {
        let cluster = self.cluster.as_ref().expect("ensure_cluster sets the cluster");
        let mut by_leader = BTreeMap::<i32, Members>::new();
        let mut stale = false;
        for (i, event) in events.iter().enumerate() {
            if outcomes[i].is_some() {
                continue;
            }
            let size = record_size(event, self.settings.cloudevents.as_ref());
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
        (by_leader, stale)
    }

    /// Sends one produce request per leader (split where `max_request_bytes` demands), all before
    /// reading any answer so the leaders work in parallel, then collects the answers. A partition
    /// whose batch is still in doubt waits. Returns whether metadata should be refreshed.
    fn round(&mut self, events: &[Event], by_leader: BTreeMap<i32, Members>, outcomes: &mut [Option<Outcome>]) -> bool {
        let mut stale = false;
        let mut cursor: HashMap<i32, i32> = HashMap::new();
        let mut in_flight = Vec::new();
        for (leader, members) in by_leader {
            for chunk in split_by_size(&members, self.settings.max_request_bytes) {
                let mut partitions = PartitionGroups::new();
                for &(i, _, partition) in chunk {
                    partitions.entry(partition).or_default().push(i);
                }
                let mut batches = BTreeMap::new();
                let mut refused = Vec::new();
                for (&partition, members) in &partitions {
                    let producer = self.producer.as_ref();
                    if producer.is_some_and(|p| p.doubts(partition)) {
                        refused.push(partition);
                        continue;
                    }
                    let identity = producer.map(|p| {
                        let next = cursor
                            .entry(partition)
                            .or_insert_with(|| p.next_sequence.get(&partition).copied().unwrap_or(0));
                        let base = *next;
                        *next = sequence_after(base, members.len());
                        ((p.id, p.epoch), base)
                    });
                    let batch = encode_batch(
                        members.iter().map(|&i| &events[i]),
                        self.settings.compression,
                        identity,
                        self.settings.cloudevents.as_ref(),
                    );
                    match batch {
                        Ok(batch) => {
                            batches.insert(partition, (batch, identity.map_or(NO_SEQUENCE, |(_, base)| base)));
                        }
                        Err(reason) => {
                            if let Some(((_, _), base)) = identity {
                                cursor.insert(partition, base);
                            }
                            fill(outcomes, members, transient(reason));
                            refused.push(partition);
                        }
                    }
                }
                for partition in refused {
                    if let Some(members) = partitions.remove(&partition)
                        && members.iter().any(|&i| outcomes[i].is_none())
                    {
                        let reason = format!(
                            "{}[{partition}]: waiting for an earlier batch whose answer was lost",
                            self.settings.topic
                        );
                        fill(outcomes, &members, transient(reason));
                    }
                }
                if partitions.is_empty() {
                    continue;
                }
                match self.send(leader, &batches) {
                    Ok(correlation) => in_flight.push(InFlight { leader, correlation, partitions, batches }),
                    Err((reason, maybe_written)) => {
                        stale = true;
                        if maybe_written {
                            self.doubt(events, &partitions, &batches);
                        }
                        fill(outcomes, partitions.values().flatten(), transient(reason));
                    }
                }
            }
        }
        for request in in_flight {
            stale |= self.collect(events, request, outcomes);
        }
        stale
    }

    /// Sends the batches in doubt again, unchanged and in order (the first of every partition in
    /// one request per leader, then the next), and reads the answers: a batch the broker has
    /// (written now, or recognised as a duplicate) is settled and its events remembered as
    /// delivered; one it still leaves open stays in doubt, and so do those behind it. Returns
    /// whether metadata should be refreshed.
    fn resend_in_doubt(&mut self) -> bool {
        let mut stale = false;
        loop {
            let Some(producer) = &self.producer else { return stale };
            let cluster = self.cluster.as_ref().expect("ensure_cluster sets the cluster");
            let mut by_leader: BTreeMap<i32, BTreeMap<i32, (Bytes, i32)>> = BTreeMap::new();
            for (&partition, batches) in &producer.in_doubt {
                if let (Some(first), Some(Some(leader))) = (batches.first(), cluster.leaders.get(partition as usize)) {
                    by_leader.entry(*leader).or_default().insert(partition, (first.batch.clone(), first.base_sequence));
                }
            }
            if by_leader.is_empty() {
                return stale;
            }
            let mut progress = false;
            for (leader, batches) in by_leader {
                let answer = self.send(leader, &batches).map_err(|(reason, _)| reason).and_then(|correlation| {
                    let connection =
                        self.connections.by_broker.get_mut(&leader).ok_or_else(|| "connection lost".to_string())?;
                    connection.receive_produce(correlation.unwrap_or_default())
                });
                let response = match answer {
                    Ok(response) => response,
                    Err(reason) => {
                        self.connections.by_broker.remove(&leader);
                        log::warn(&format!("sending again a batch whose answer was lost: {reason}"));
                        stale = true;
                        continue;
                    }
                };
                let codes: HashMap<i32, i16> = partition_codes(&response, &self.settings.topic).into_iter().collect();
                let producer = self.producer.as_mut().expect("checked above");
                for partition in batches.keys() {
                    let code = codes.get(partition).copied();
                    stale |= code.is_some_and(policy::stale_metadata);
                    let written = code.is_some_and(|c| c == 0 || policy::is_duplicate(c));
                    let refused = code.is_some_and(|c| matches!(policy::classify(c), Class::Permanent(_)));
                    if !(written || refused) {
                        // Still open (or the session is over): it stays first in line.
                        producer.reset |= code.is_some_and(policy::ends_producer_session);
                        continue;
                    }
                    let Some(first) = producer.in_doubt.get_mut(partition).map(|queue| queue.remove(0)) else {
                        continue;
                    };
                    progress = true;
                    if written {
                        if producer.delivered.len() + first.ids.len() > MAX_REMEMBERED {
                            producer.delivered.clear();
                        }
                        producer.delivered.extend(first.ids.iter().copied());
                    }
                    producer.settle(*partition, first, code);
                }
                producer.in_doubt.retain(|_, batches| !batches.is_empty());
            }
            if !progress || self.producer.as_ref().is_some_and(|p| p.reset) {
                return stale;
            }
        }
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
            let attempt = Connection::open(&host, port, &self.settings.connect())
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

    /// With idempotence on, makes sure this instance has a producer session.
    fn ensure_producer(&mut self) -> Result<(), Outcome> {
        if !self.settings.idempotence || self.producer.is_some() {
            return Ok(());
        }
        let cluster = self.cluster.as_ref().expect("ensure_cluster sets the cluster");
        let Some(leader) = cluster.leaders.iter().flatten().next().copied() else {
            return Err(transient(format!(
                "no partition of {} has a leader to ask for a producer id",
                self.settings.topic
            )));
        };
        let (timeout, client_id) = (self.settings.timeout, self.settings.client_id.clone());
        let answer = self.connection(leader).and_then(|c| c.init_producer_id(timeout, &client_id));
        let response = match answer {
            Ok(response) => response,
            Err(reason) => {
                self.connections.by_broker.remove(&leader);
                return Err(transient(format!("InitProducerId: {reason}")));
            }
        };
        match policy::classify(response.error_code) {
            Class::Ok => {}
            Class::Transient(why) | Class::Permanent(why) => {
                return Err(transient(format!("InitProducerId: {why} (code {})", response.error_code)));
            }
        }
        self.producer = Some(Producer {
            id: response.producer_id.0,
            epoch: response.producer_epoch,
            next_sequence: HashMap::new(),
            in_doubt: BTreeMap::new(),
            delivered: HashSet::new(),
            reset: false,
        });
        Ok(())
    }

    /// Marks the batches of `partitions` as in doubt: written or not, nobody knows.
    fn doubt(&mut self, events: &[Event], partitions: &PartitionGroups, batches: &BTreeMap<i32, (Bytes, i32)>) {
        let Some(producer) = self.producer.as_mut() else { return };
        for (partition, members) in partitions {
            if let Some((batch, base_sequence)) = batches.get(partition) {
                let ids = members.iter().map(|&i| events[i].id).collect();
                producer.settle(*partition, InDoubt { ids, batch: batch.clone(), base_sequence: *base_sequence }, None);
            }
        }
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
        // The broker's partition numbers are taken only where they fit: a negative one, or one
        // past the most a topic may have here, is left out rather than trusted as an index.
        let count = topic
            .partitions
            .iter()
            .filter_map(|p| usize::try_from(p.partition_index).ok().filter(|&i| i < MAX_PARTITIONS))
            .max()
            .map_or(0, |i| i + 1);
        if count == 0 {
            return Err(transient(format!("topic {topic_name} has no partitions")));
        }
        let mut leaders = vec![None; count];
        for partition in &topic.partitions {
            let leader = partition.leader_id.0;
            let slot = usize::try_from(partition.partition_index).ok().and_then(|i| leaders.get_mut(i));
            if let Some(slot) = slot
                && partition.error_code == 0
                && leader >= 0
                && brokers.contains_key(&leader)
            {
                *slot = Some(leader);
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
                None => Connection::open(host, *port, &self.settings.connect())?,
            };
            self.connections.by_broker.insert(leader, connection);
        }
        Ok(self.connections.by_broker.get_mut(&leader).expect("inserted"))
    }

    /// Writes one produce request of `batches` (per partition); the error says whether the
    /// broker may have received it.
    fn send(&mut self, leader: i32, batches: &BTreeMap<i32, (Bytes, i32)>) -> Result<Option<i32>, (NetError, bool)> {
        let mut request = ProduceRequest::default();
        request.acks = self.settings.acks;
        request.timeout_ms = i32::try_from(self.settings.timeout.as_millis()).unwrap_or(i32::MAX);
        let mut data = TopicProduceData::default();
        data.name = StrBytes::from_string(self.settings.topic.clone()).into();
        for (&partition, (batch, _)) in batches {
            let mut part = PartitionProduceData::default();
            part.index = partition;
            part.records = Some(batch.clone());
            data.partition_data.push(part);
        }
        request.topic_data.push(data);
        let client_id = self.settings.client_id.clone();
        let connection = self.connection(leader).map_err(|e| (e, false))?;
        let result = connection.send_produce(&request, &client_id);
        if result.is_err() {
            self.connections.by_broker.remove(&leader);
        }
        result.map_err(|e| (e, true))
    }

    /// Reads one produce answer into `outcomes`; returns whether the metadata should be refreshed.
    fn collect(&mut self, events: &[Event], request: InFlight, outcomes: &mut [Option<Outcome>]) -> bool {
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
                // The stream may hold half an answer; start afresh next time. The broker may
                // have written the records: with idempotence they go again as they were.
                self.connections.by_broker.remove(&request.leader);
                self.doubt(events, &request.partitions, &request.batches);
                all(outcomes, transient(reason));
                return true;
            }
        };
        let topic = self.settings.topic.clone();
        let topic = &topic;
        let mut stale = false;
        let answers: HashMap<i32, _> = response
            .responses
            .iter()
            .filter(|t| t.name.0.as_str() == topic)
            .flat_map(|t| t.partition_responses.iter().map(|p| (p.index, p)))
            .collect();
        for (partition, members) in &request.partitions {
            if let (Some(producer), Some((batch, base))) = (self.producer.as_mut(), request.batches.get(partition)) {
                let ids = members.iter().map(|&i| events[i].id).collect();
                let sent = InDoubt { ids, batch: batch.clone(), base_sequence: *base };
                producer.settle(*partition, sent, answers.get(partition).map(|a| a.error_code));
            }
            let Some(answer) = answers.get(partition) else {
                fill(outcomes, members, transient(format!("no answer for partition {partition} of {topic}")));
                continue;
            };
            let code = answer.error_code;
            stale |= policy::stale_metadata(code);
            // The broker already has these records from an attempt whose answer was lost.
            let code = if policy::is_duplicate(code) { 0 } else { code };
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
fn record_size(event: &Event, cloudevents: Option<&CloudEvents>) -> usize {
    let headers: usize = event.headers.iter().map(|(k, v)| k.len() + v.len() + 10).sum::<usize>()
        + cloudevents.map_or(0, |ce| ce.attributes(event).iter().map(|(k, v)| k.len() + 3 + v.len() + 10).sum());
    let own = "ferry-event-id".len() + 20 + "ferry-event-type".len() + event.event_type.len() + "content-type".len();
    64 + event.payload.len()
        + event.ordering_key.as_ref().map_or(0, String::len)
        + headers
        + own
        + event.content_type.len()
}

/// Encodes the events as one record batch (format v2, with headers), compressed with `compression`.
/// With `identity` (producer id and epoch, and the batch's base sequence), the batch is an
/// idempotent producer's.
fn encode_batch<'a>(
    events: impl Iterator<Item = &'a Event>,
    compression: Compression,
    identity: Option<((i64, i16), i32)>,
    cloudevents: Option<&CloudEvents>,
) -> Result<Bytes, NetError> {
    let ((producer_id, producer_epoch), base_sequence) =
        identity.unwrap_or(((NO_PRODUCER_ID, NO_PRODUCER_EPOCH), NO_SEQUENCE));
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
            for (name, value) in cloudevents.map(|ce| ce.attributes(event)).unwrap_or_default() {
                headers.insert(StrBytes::from_string(format!("ce_{name}")), Some(Bytes::from(value)));
            }
            Record {
                transactional: false,
                control: false,
                delete_horizon: false,
                partition_leader_epoch: NO_PARTITION_LEADER_EPOCH,
                producer_id,
                producer_epoch,
                timestamp_type: TimestampType::Creation,
                offset: offset as i64,
                sequence: if base_sequence == NO_SEQUENCE {
                    NO_SEQUENCE
                } else {
                    sequence_after(base_sequence, offset)
                },
                timestamp: event.event_time,
                key: event.ordering_key.as_ref().map(|k| Bytes::from(k.clone().into_bytes())),
                value: Some(Bytes::from(event.payload.clone())),
                headers,
            }
        })
        .collect();
    let mut buf = BytesMut::new();
    let options = RecordEncodeOptions { version: 2, compression };
    RecordBatchEncoder::encode_with_custom_compression(&mut buf, &records, &options, Some(codec::compress))
        .map_err(|e| format!("encoding records: {e}"))?;
    Ok(buf.freeze())
}

/// Each partition's error code in a produce answer, for `topic`.
fn partition_codes(response: &kafka_protocol::messages::ProduceResponse, topic: &str) -> Vec<(i32, i16)> {
    response
        .responses
        .iter()
        .filter(|t| t.name.0.as_str() == topic)
        .flat_map(|t| t.partition_responses.iter().map(|p| (p.index, p.error_code)))
        .collect()
}

fn fill<'a>(outcomes: &mut [Option<Outcome>], members: impl IntoIterator<Item = &'a usize>, outcome: Outcome) {
    for &i in members {
        outcomes[i] = Some(outcome.clone());
    }
}
