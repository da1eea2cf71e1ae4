//! Grouping a batch's completions after its delivery, once per batch and for every event, without
//! hashing each: completions come in the order their events were claimed within a route (a batch
//! is mostly one route's), so each is looked for where the last one was found first.

use std::collections::HashMap;
use std::hash::Hash;

use crate::event::ClaimedEvent;

/// The claimed events of a batch by id, for the completions that name them.
pub(super) struct EventsById<'a> {
    events: &'a [ClaimedEvent],
    /// Where the next completion's event most likely is: after the last one found.
    next: usize,
    /// Each event's position, made the first time a completion is not where expected.
    positions: Option<HashMap<i64, usize>>,
}

impl<'a> EventsById<'a> {
    pub(super) fn new(events: &'a [ClaimedEvent]) -> Self {
        Self { events, next: 0, positions: None }
    }

    /// The event with id `id`, if the batch has it.
    pub(super) fn get(&mut self, id: i64) -> Option<&'a ClaimedEvent> {
        let events = self.events;
        let at = match events.get(self.next) {
            Some(event) if event.id == id => self.next,
            _ => {
                let positions =
                    self.positions.get_or_insert_with(|| events.iter().enumerate().map(|(i, e)| (e.id, i)).collect());
                *positions.get(&id)?
            }
        };
        self.next = at + 1;
        events.get(at)
    }
}

/// Values kept per key, in the order the keys first came, for keys that mostly repeat from one
/// item to the next: the key of the last item is compared, and only a different one is hashed.
pub(super) struct Runs<K, V> {
    entries: Vec<(K, V)>,
    index: HashMap<K, usize>,
    last: usize,
}

impl<K: Copy + Eq + Hash, V: Default> Runs<K, V> {
    pub(super) fn new() -> Self {
        Self { entries: Vec::new(), index: HashMap::new(), last: 0 }
    }

    /// The value kept under `key`, new (its default) when `key` has not come before.
    pub(super) fn entry(&mut self, key: K) -> &mut V {
        if !self.entries.get(self.last).is_some_and(|(k, _)| *k == key) {
            let next = self.entries.len();
            self.last = *self.index.entry(key).or_insert(next);
            if self.last == next {
                self.entries.push((key, V::default()));
            }
        }
        &mut self.entries[self.last].1
    }

    /// Every key with its value, in the order the keys first came.
    pub(super) fn into_entries(self) -> Vec<(K, V)> {
        self.entries
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: i64) -> ClaimedEvent {
        ClaimedEvent::defective(id, "r".into(), String::new())
    }

    #[test]
    fn events_are_found_in_any_order() {
        let events: Vec<ClaimedEvent> = [5, 6, 7, 9].map(event).into();
        let mut by_id = EventsById::new(&events);
        // In order, then out of it, then in order again from where the last was found.
        let found: Vec<Option<i64>> = [5, 6, 9, 7, 9, 42, 5, 6].iter().map(|id| by_id.get(*id).map(|e| e.id)).collect();
        assert_eq!(found, [Some(5), Some(6), Some(9), Some(7), Some(9), None, Some(5), Some(6)]);
    }

    #[test]
    fn runs_keep_one_value_per_key_in_first_come_order() {
        let mut runs: Runs<&str, u32> = Runs::new();
        for key in ["a", "a", "b", "a", "c", "c", "b"] {
            *runs.entry(key) += 1;
        }
        assert_eq!(runs.into_entries(), [("a", 3), ("b", 2), ("c", 2)]);
    }
}
