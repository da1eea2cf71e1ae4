//! The pure decisions of the Kafka transport, kept free of I/O and bindings so they are unit-tested
//! natively (the host's test suite includes this file): which partition a key lands on, and what a
//! Kafka error code means for the event.

/// Kafka's 32-bit murmur2 hash exactly as the Java client computes it (`Utils.murmur2`), so that a
/// key lands on the same partition whether it was produced by ferry or by a Java producer.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let mut h: u32 = SEED ^ data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        for (i, byte) in tail.iter().enumerate().rev() {
            h ^= u32::from(*byte) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition the Java client's default partitioner picks for `key` among `partitions`:
/// the positive part of the key's murmur2 hash, modulo the partition count.
pub fn partition_for_key(key: &[u8], partitions: u32) -> u32 {
    debug_assert!(partitions > 0);
    (murmur2(key) & 0x7fff_ffff) as u32 % partitions.max(1)
}

/// What a Kafka error code means for the events it was returned for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    /// The broker accepted the records.
    Ok,
    /// Something is wrong with the message or its destination; retrying cannot help until someone
    /// changes the topic, the permissions or the event, so the event is marked FAILED.
    Permanent(&'static str),
    /// The cluster is unavailable, busy or moving leadership; retry later.
    Transient(&'static str),
}

/// Classifies a Kafka protocol error code (as found in metadata and produce responses).
///
/// Message-specific errors are permanent: the topic does not exist or is not a valid name, the
/// producer may not write to it, or the record (or the batch) is too large or invalid. Everything
/// else, known or not, is transient: a broker that is down or not the leader, a timeout, a full
/// in-sync replica set, throttling.
pub fn classify(code: i16) -> Class {
    match code {
        0 => Class::Ok,
        3 => Class::Permanent("UNKNOWN_TOPIC_OR_PARTITION: the topic does not exist"),
        10 => Class::Permanent("MESSAGE_TOO_LARGE: the record is larger than the broker accepts"),
        17 => Class::Permanent("INVALID_TOPIC_EXCEPTION: the topic name is not valid"),
        18 => Class::Permanent("RECORD_LIST_TOO_LARGE: the record batch is larger than the broker accepts"),
        29 => Class::Permanent("TOPIC_AUTHORIZATION_FAILED: not authorized to write to the topic"),
        87 => Class::Permanent("INVALID_RECORD: the broker rejected the record"),
        other => Class::Transient(transient_name(other)),
    }
}

/// Names of the transient codes a producer commonly meets, for readable failure reasons.
fn transient_name(code: i16) -> &'static str {
    match code {
        -1 => "UNKNOWN_SERVER_ERROR",
        2 => "CORRUPT_MESSAGE",
        5 => "LEADER_NOT_AVAILABLE",
        6 => "NOT_LEADER_OR_FOLLOWER",
        7 => "REQUEST_TIMED_OUT",
        8 => "BROKER_NOT_AVAILABLE",
        13 => "NETWORK_EXCEPTION",
        14 => "COORDINATOR_LOAD_IN_PROGRESS",
        19 => "NOT_ENOUGH_REPLICAS",
        20 => "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
        45 => "OUT_OF_ORDER_SEQUENCE_NUMBER",
        47 => "INVALID_PRODUCER_EPOCH",
        56 => "KAFKA_STORAGE_ERROR",
        59 => "UNKNOWN_PRODUCER_ID",
        74 => "FENCED_LEADER_EPOCH",
        75 => "UNKNOWN_LEADER_EPOCH",
        90 => "PRODUCER_FENCED",
        _ => "broker error",
    }
}

/// DUPLICATE_SEQUENCE_NUMBER: the broker already wrote this idempotent producer's batch (an
/// earlier attempt whose answer was lost); the records are delivered.
pub fn is_duplicate(code: i16) -> bool {
    code == 46
}

/// Codes after which an idempotent producer's session cannot go on (the broker no longer knows
/// it, or its sequence numbers no longer line up): the transport starts a new one, and the
/// events are retried.
pub fn ends_producer_session(code: i16) -> bool {
    matches!(code, 45 | 47 | 59 | 90)
}

/// Whether an error code means the cached cluster metadata (partition leaders) is out of date and
/// must be fetched again before the next attempt.
pub fn stale_metadata(code: i16) -> bool {
    matches!(code, 3 | 5 | 6 | 8 | 13 | 74 | 75)
}

/// Parses the `acks` setting: `0` (no answer awaited), `1` (the leader wrote it) or `all` / `-1`
/// (every in-sync replica has it).
pub fn parse_acks(value: &str) -> Result<i16, String> {
    match value.trim() {
        "0" => Ok(0),
        "1" => Ok(1),
        "all" | "-1" => Ok(-1),
        other => Err(format!("acks: expected 0, 1 or all, got {other:?}")),
    }
}

/// Parses the `brokers` setting, a comma-separated list of `host:port`, naming the bad entry.
pub fn parse_brokers(value: &str) -> Result<Vec<(String, u16)>, String> {
    let mut brokers = Vec::new();
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (host, port) =
            entry.rsplit_once(':').ok_or_else(|| format!("brokers: {entry:?} has no port (expected host:port)"))?;
        let port = port.parse::<u16>().map_err(|_| format!("brokers: {entry:?} has an invalid port"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("brokers: {entry:?} has no host"));
        }
        brokers.push((host.to_string(), port));
    }
    if brokers.is_empty() {
        return Err("brokers: required, a comma-separated list of host:port".into());
    }
    Ok(brokers)
}
