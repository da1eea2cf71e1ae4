//! The idempotent producer's session state: the producer id and epoch, each partition's next
//! sequence number, the batches in doubt (sent, answer lost) and the events such a batch delivered.
//! What an answer means for that state is decided here; `lib.rs` sends and reads.

use std::collections::{BTreeMap, HashMap, HashSet};

use bytes::Bytes;

use crate::policy::{self, Class};

/// The idempotent producer's session: the id and epoch the cluster gave it, the next sequence
/// number of each partition, and the batches whose answer was lost.
pub struct Producer {
    pub id: i64,
    pub epoch: i16,
    pub next_sequence: HashMap<i32, i32>,
    /// Per partition, in the order they were sent, the batches the broker may or may not have
    /// written (the answer was lost, or said something that leaves it open), as they were sent,
    /// with their events' ids and base sequences. They are sent again unchanged before anything
    /// else goes to that partition, so a broker that wrote one recognises it as a duplicate
    /// instead of writing it twice; their events wait until then.
    pub in_doubt: BTreeMap<i32, Vec<InDoubt>>,
    /// Events that such a batch wrote and that have not come back since: when they do, they are
    /// answered at once, not produced again.
    pub delivered: HashSet<u64>,
    /// A fatal answer (fenced, unknown producer, sequence out of order): start a new session.
    pub reset: bool,
}

pub struct InDoubt {
    pub ids: Vec<u64>,
    pub batch: Bytes,
    pub base_sequence: i32,
}

/// Events delivered by a batch in doubt that are remembered until they come back; beyond this,
/// the oldest are forgotten (and would be produced again, as without idempotence).
pub const MAX_REMEMBERED: usize = 100_000;

impl Producer {
    /// Records the broker's answer for a partition's batch: `code`, or `None` when the answer
    /// did not mention the partition. Written (or a duplicate of what was): the sequence moves
    /// on. Refused for good: not written, its numbers are free again. Anything else may have been
    /// written: the batch is kept in doubt. A broken session ends.
    pub fn settle(&mut self, partition: i32, batch: InDoubt, code: Option<i16>) {
        let base = batch.base_sequence;
        match code {
            Some(code) if code == 0 || policy::is_duplicate(code) => {
                self.next_sequence.insert(partition, sequence_after(base, batch.ids.len()));
            }
            Some(code) if policy::ends_producer_session(code) => self.reset = true,
            Some(code) if matches!(policy::classify(code), Class::Permanent(_)) => {
                self.next_sequence.insert(partition, base);
            }
            _ => {
                self.next_sequence.insert(partition, base);
                self.in_doubt.entry(partition).or_default().push(batch);
            }
        }
    }

    /// Whether a batch of `partition` is in doubt.
    pub fn doubts(&self, partition: i32) -> bool {
        self.in_doubt.get(&partition).is_some_and(|batches| !batches.is_empty())
    }
}

/// The sequence number after `count` records from `base`; Kafka's sequences wrap at i32::MAX.
pub fn sequence_after(base: i32, count: usize) -> i32 {
    let next = i64::from(base) + count as i64;
    (next % (i64::from(i32::MAX) + 1)) as i32
}
