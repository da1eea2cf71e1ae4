//! The bound on the connections a plugin's wasi:http requests have open. hyper's pool bounds
//! the idle connections of each origin only, and a plugin granted `*.domain` can name endless
//! origins: each would keep its connections open for a minute after its last request, file
//! descriptors the rest of the host (other plugins, the database) needs.
//!
//! So a plugin has `limit` connection permits, one held by each of its connections from before it
//! is opened until it closes, whichever client opened it. And each origin it sends to has a client
//! (and a pool) of its own, listed in the plugin's [`Origins`], at most `limit` of them. A
//! connection that finds no permit waits for one, in a fair queue; while the connections on their
//! way to closing are fewer than those waiting, it unlists another origin, the one used least
//! recently that has connections: its client is dropped, which closes its idle connections once
//! no request holds the client any more, and those still answering once their answer is read. A
//! connection is counted on to close for [`PATIENCE`] after its origin was unlisted (or opened
//! for a request that held its client then), and no longer after that: one still answering, or
//! whose client a request waiting for its answer still holds, may stay open longer. So the
//! connections waiting unlist origins until about as many connections are closing as they need
//! permits (whole origins: there may be more), and again for each second in which those do not
//! close. A connection waits within the 10 s it may take to open; without a permit its request
//! fails (`ConnectionLimitReached`). Connections of an unlisted client still hold their permits
//! until they close, so a client kept alive by a request that never ends cannot hold more than
//! the plugin's permits either.
//!
//! The next request to an unlisted origin lists it again: with the same client while a request
//! still holds that one, so the connections it keeps open (and their permits) serve the origin
//! again instead of waiting beside a new client's; with a new client otherwise. The old client's
//! connections are then counted apart, by client, until they close, and counted on to close for
//! what is left of the second after the unlisting.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// How often a connection waiting for a permit looks again at what is closing.
const RECHECK: Duration = Duration::from_millis(50);
/// How long after its origin was unlisted a connection is counted on to close, as it does unless
/// a request still holds its client; after that, connections waiting unlist other origins.
const PATIENCE: Duration = Duration::from_secs(1);

/// One plugin's clients (`T`) by origin, and its connection permits.
pub(super) struct Origins<T> {
    permits: Arc<Semaphore>,
    kept: Mutex<Kept<T>>,
}

struct Kept<T> {
    /// Origins listed, and connections open, at most.
    limit: usize,
    origins: HashMap<Arc<str>, Listed<T>>,
    unlisted: HashMap<Arc<str>, Unlisted<T>>,
    /// Unlisted clients gone whose origins were listed again with new clients, while their
    /// connections are open, by id: at most `limit`, each holding a permit.
    replaced: HashMap<u64, Unlisted<T>>,
    /// The unlistings in the last [`PATIENCE`] of origins with connections or whose client a
    /// request held, oldest first: their connections, those still unlisted and open, are counted
    /// on to close.
    recent: VecDeque<Recent>,
    /// How many `recent` there may be before those that can no longer count are dropped.
    prune_at: usize,
    /// Numbers unlistings.
    unlistings: u64,
    /// How many `unlisted` there may be before those whose client is gone and whose connections
    /// are closed are forgotten.
    sweep_at: usize,
    /// Connections waiting for a permit.
    waiting: usize,
    /// Counts requests; orders the origins by when they were last used, and numbers listings.
    clock: u64,
}

/// An origin's client and its connections.
struct Listed<T> {
    client: Arc<T>,
    /// Which client of the origin this is, so a connection of an earlier one is not counted here.
    id: u64,
    /// Its client's connections open or opening.
    open: usize,
    used: u64,
}

/// An origin unlisted whose client a request may still hold, or whose connections are still
/// open.
struct Unlisted<T> {
    client: Weak<T>,
    id: u64,
    open: usize,
    /// Which unlisting it was (an origin listed again may be unlisted again).
    unlisting: u64,
}

impl<T> Unlisted<T> {
    /// Whether it still matters: its connections are open, or a request may open more.
    fn live(&self) -> bool {
        self.open > 0 || self.client.strong_count() > 0
    }
}

/// An unlisting whose connections are counted on to close for [`PATIENCE`] after `at`.
struct Recent {
    at: Instant,
    origin: Arc<str>,
    id: u64,
    unlisting: u64,
}

impl Recent {
    /// What this unlisting left, while it is still unlisted: by origin, or by client once the
    /// origin got a new one.
    fn of<'a, T>(
        &self,
        unlisted: &'a HashMap<Arc<str>, Unlisted<T>>,
        replaced: &'a HashMap<u64, Unlisted<T>>,
    ) -> Option<&'a Unlisted<T>> {
        let this = |u: &&Unlisted<T>| u.unlisting == self.unlisting;
        unlisted.get(&self.origin).filter(this).or_else(|| replaced.get(&self.id).filter(this))
    }
}

impl<T> Origins<T> {
    pub(super) fn new(limit: usize) -> Arc<Origins<T>> {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS);
        let kept = Kept {
            limit,
            origins: HashMap::new(),
            unlisted: HashMap::new(),
            replaced: HashMap::new(),
            recent: VecDeque::new(),
            prune_at: limit,
            unlistings: 0,
            sweep_at: limit,
            waiting: 0,
            clock: 0,
        };
        Arc::new(Origins { permits: Arc::new(Semaphore::new(limit)), kept: Mutex::new(kept) })
    }

    fn lock(&self) -> MutexGuard<'_, Kept<T>> {
        self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The client for `origin`. When the origin is not listed it is listed again with the client
    /// it had if a request still holds that one, or else with a new one, made by `make` with the
    /// [`Listing`] its connector opens connections through. The origin counts as used now.
    pub(super) fn client(self: &Arc<Self>, origin: &str, make: impl FnOnce(Listing<T>) -> T) -> Arc<T> {
        let mut unlisted = Vec::new();
        let mut kept = self.lock();
        kept.clock += 1;
        let now = kept.clock;
        if let Some(listed) = kept.origins.get_mut(origin) {
            listed.used = now;
            return listed.client.clone();
        }
        // The list is bounded too (origins whose connections all failed to open have none):
        // those without connections go first.
        let at = Instant::now();
        while kept.origins.len() >= kept.limit {
            let Some(client) = kept.unlist_least_used(|_, _| true, |listed| listed.open == 0, at) else { break };
            unlisted.push(client);
        }
        let (origin, listed) = match kept.unlisted.remove_entry(origin) {
            Some((origin, before)) => match before.client.upgrade() {
                Some(client) => (origin, Listed { client, id: before.id, open: before.open, used: now }),
                // A new client, beside which the old one's connections close.
                None => {
                    if before.open > 0 {
                        kept.replaced.insert(before.id, before);
                    }
                    self.listed_anew(origin, now, make)
                }
            },
            None => self.listed_anew(origin.into(), now, make),
        };
        let client = listed.client.clone();
        kept.origins.insert(origin, listed);
        drop(kept);
        // Dropped with the lock released: a client's pool may be dropped with it.
        drop(unlisted);
        client
    }

    fn listed_anew(
        self: &Arc<Self>,
        origin: Arc<str>,
        now: u64,
        make: impl FnOnce(Listing<T>) -> T,
    ) -> (Arc<str>, Listed<T>) {
        let client = Arc::new(make(Listing { origins: Arc::downgrade(self), origin: origin.clone(), id: now }));
        (origin, Listed { client, id: now, open: 0, used: now })
    }

    /// Origins listed and the connections counted against them, and origins unlisted, for tests.
    #[cfg(test)]
    fn counts(&self) -> (usize, usize, usize) {
        let kept = self.lock();
        (kept.origins.len(), kept.origins.values().map(|listed| listed.open).sum(), kept.unlisted.len())
    }
}

impl<T> Kept<T> {
    /// Unlists the origin used least recently among those `eligible`, preferring those `first`;
    /// its client is handed back to be dropped once the lock is released.
    fn unlist_least_used(
        &mut self,
        eligible: impl Fn(&str, &Listed<T>) -> bool,
        first: impl Fn(&Listed<T>) -> bool,
        at: Instant,
    ) -> Option<Arc<T>> {
        let (origin, _) = self
            .origins
            .iter()
            .filter(|(origin, listed)| eligible(origin, listed))
            .min_by_key(|(_, listed)| (!first(listed), listed.used))?;
        let origin = origin.clone();
        let Listed { client, id, open, .. } = self.origins.remove(&origin)?;
        if self.unlisted.len() >= self.sweep_at {
            self.unlisted.retain(|_, unlisted| unlisted.live());
            self.sweep_at = (self.unlisted.len() * 2).max(self.limit);
        }
        self.unlistings += 1;
        let unlisting = self.unlistings;
        self.forget_lapsed(at);
        // A client a request holds may open connections yet (one may be waiting for a permit).
        if open > 0 || Arc::strong_count(&client) > 1 {
            if self.recent.len() >= self.prune_at {
                // Bounded by the unlisted entries that still count, not by how fast a plugin
                // unlists: each counts once, and has connections or a request holding its client.
                let (unlisted, replaced) = (&self.unlisted, &self.replaced);
                self.recent.retain(|recent| recent.of(unlisted, replaced).is_some_and(Unlisted::live));
                self.prune_at = (self.recent.len() * 2).max(self.limit);
            }
            self.recent.push_back(Recent { at, origin: origin.clone(), id, unlisting });
        }
        self.unlisted.insert(origin, Unlisted { client: Arc::downgrade(&client), id, open, unlisting });
        Some(client)
    }

    /// The connections still open of the origins unlisted in the last [`PATIENCE`] before `now`
    /// that are still unlisted (an origin listed again with its client keeps its connections).
    fn closing(&mut self, now: Instant) -> usize {
        self.forget_lapsed(now);
        let (unlisted, replaced) = (&self.unlisted, &self.replaced);
        self.recent.iter().map(|recent| recent.of(unlisted, replaced).map_or(0, |u| u.open)).sum()
    }

    fn forget_lapsed(&mut self, now: Instant) {
        while self.recent.front().is_some_and(|recent| now >= recent.at + PATIENCE) {
            self.recent.pop_front();
        }
    }

    /// Counts a connection of `origin`'s client `id` opened (or closed), listed or not; `false`
    /// when that client is forgotten.
    fn count(&mut self, origin: &str, id: u64, opened: bool) -> bool {
        let step = |open: &mut usize| match opened {
            true => *open += 1,
            false => *open -= 1,
        };
        if let Some(listed) = self.origins.get_mut(origin).filter(|listed| listed.id == id) {
            step(&mut listed.open);
            return true;
        }
        if let Some(unlisted) = self.unlisted.get_mut(origin).filter(|unlisted| unlisted.id == id) {
            step(&mut unlisted.open);
            if !unlisted.live() {
                self.unlisted.remove(origin);
            }
            return true;
        }
        let Some(replaced) = self.replaced.get_mut(&id) else { return false };
        step(&mut replaced.open);
        if replaced.open == 0 {
            self.replaced.remove(&id);
        }
        true
    }
}

/// Where a client opens its connections: its origin, which of the origin's clients it is, and
/// its plugin's permits.
pub(super) struct Listing<T> {
    origins: Weak<Origins<T>>,
    origin: Arc<str>,
    id: u64,
}

impl<T> Clone for Listing<T> {
    fn clone(&self) -> Self {
        Listing { origins: self.origins.clone(), origin: self.origin.clone(), id: self.id }
    }
}

impl<T> Listing<T> {
    /// A permit for a connection about to be opened, held by it until it closes; waited for up to
    /// `within`, unlisting other origins that have connections meanwhile. `None` when none came.
    pub(super) async fn open(&self, within: Duration) -> Option<Opened<T>> {
        let origins = self.origins.upgrade()?;
        if let Ok(permit) = origins.permits.clone().try_acquire_owned() {
            return Some(self.opened(&origins, permit));
        }
        let deadline = Instant::now() + within;
        let _waiting = Waiting::new(&origins);
        // One place in the (fair) queue for the whole wait.
        let mut acquire = std::pin::pin!(origins.permits.clone().acquire_owned());
        let permit = loop {
            let unlisted = {
                let mut kept = origins.lock();
                let now = Instant::now();
                let others = |origin: &str, listed: &Listed<T>| origin != &*self.origin && listed.open > 0;
                // Fewer connections on their way to closing than waiting for their permits: one
                // more origin lets go of its connections (if another has any).
                match kept.closing(now) < kept.waiting {
                    true => kept.unlist_least_used(others, |_| true, now),
                    false => None,
                }
            };
            drop(unlisted);
            let until = deadline.min(Instant::now() + RECHECK);
            match tokio::time::timeout_at(until, &mut acquire).await {
                Ok(Ok(permit)) => break permit,
                Ok(Err(_)) => return None,
                Err(_) if Instant::now() >= deadline => return None,
                Err(_) => {}
            }
        };
        Some(self.opened(&origins, permit))
    }

    /// A connection with `permit`, counted against its client while the origin's list knows it.
    fn opened(&self, origins: &Origins<T>, permit: OwnedSemaphorePermit) -> Opened<T> {
        let counted = origins.lock().count(&self.origin, self.id, true);
        Opened { listing: self.clone(), counted, _permit: permit }
    }
}

/// A connection waiting for a permit, counted while it waits (and until its wait is dropped).
struct Waiting<'a, T>(&'a Origins<T>);

impl<'a, T> Waiting<'a, T> {
    fn new(origins: &'a Origins<T>) -> Self {
        origins.lock().waiting += 1;
        Waiting(origins)
    }
}

impl<T> Drop for Waiting<'_, T> {
    fn drop(&mut self) {
        self.0.lock().waiting -= 1;
    }
}

/// A connection's permit, and its count against its client (while the list knows that).
pub(super) struct Opened<T> {
    listing: Listing<T>,
    counted: bool,
    _permit: OwnedSemaphorePermit,
}

impl<T> Drop for Opened<T> {
    fn drop(&mut self) {
        let Some(origins) = self.listing.origins.upgrade().filter(|_| self.counted) else { return };
        origins.lock().count(&self.listing.origin, self.listing.id, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lists `origin`, with a client that is the number of its listing; the listing when it is new.
    fn client(origins: &Arc<Origins<u64>>, origin: &str) -> (Arc<u64>, Option<Listing<u64>>) {
        let mut made = None;
        let client = origins.client(origin, |listing| {
            let id = listing.id;
            made = Some(listing);
            id
        });
        (client, made)
    }

    const SOON: Duration = Duration::from_millis(200);

    fn closing(origins: &Origins<u64>) -> usize {
        origins.lock().closing(Instant::now())
    }

    #[tokio::test]
    async fn past_the_limit_the_origin_used_least_recently_is_unlisted_and_its_connections_waited_for() {
        let origins = Origins::new(2);
        let (a, a_listing) = client(&origins, "http://a");
        let b_listing = client(&origins, "http://b").1.unwrap();
        let a_open = a_listing.unwrap().open(SOON).await.unwrap();
        let b_open = b_listing.open(SOON).await.unwrap();
        assert_eq!(origins.counts(), (2, 2, 0));
        // `a` is used again, so `b` is the one used least recently.
        let (again, made) = client(&origins, "http://a");
        assert!(Arc::ptr_eq(&a, &again) && made.is_none(), "a listed origin keeps its client");
        let c_listing = client(&origins, "http://c").1.unwrap();
        assert_eq!(origins.counts(), (2, 1, 1), "b is unlisted to list c");
        // Both permits are held, and neither connection closes: c's connection waits for b's, which
        // is unlisted, for a second, then unlists `a` and waits for its, in vain.
        assert!(c_listing.open(SOON).await.is_none(), "no permit while both connections are open");
        assert_eq!(origins.counts(), (2, 1, 1), "a is not unlisted while b's connection may be closing");
        assert!(c_listing.open(PATIENCE + SOON).await.is_none(), "unlisted connections hold their permits");
        assert_eq!(origins.counts(), (1, 0, 2), "only c is left, without connections");
        drop(b_open);
        assert_eq!(origins.counts(), (1, 0, 1), "b, whose client is gone, is forgotten once its connection closes");
        let c_open = c_listing.open(SOON).await.expect("b's connection closed: its permit is free");
        assert_eq!(origins.counts(), (1, 1, 1));
        // One waits, and gets the permit of a connection that closes meanwhile.
        let waiting = tokio::spawn({
            let c_listing = c_listing.clone();
            async move { c_listing.open(Duration::from_secs(5)).await.is_some() }
        });
        tokio::time::sleep(RECHECK * 2).await;
        drop(a_open);
        assert!(waiting.await.unwrap());
        // `b`'s client is forgotten: a connection it opens holds a permit, uncounted by origin.
        drop(c_open);
        let late = b_listing.open(SOON).await.unwrap();
        assert_eq!(origins.counts(), (1, 0, 1));
        drop(late);
    }

    #[tokio::test]
    async fn connections_waiting_unlist_as_many_connections_as_they_wait_for() {
        let origins = Origins::new(12);
        let mut open = Vec::new();
        for n in 0..12 {
            open.push(client(&origins, &format!("http://{n}")).1.unwrap().open(SOON).await.unwrap());
        }
        // Listing `new` unlists `0`, used least recently: its connection is counted on to close.
        let listing = client(&origins, "http://new").1.unwrap();
        assert_eq!(origins.counts(), (12, 11, 1));
        let waiting: Vec<_> = (0..3)
            .map(|_| {
                let listing = listing.clone();
                tokio::spawn(async move { listing.open(Duration::from_secs(5)).await.is_some() })
            })
            .collect();
        tokio::time::sleep(SOON).await;
        assert_eq!(origins.counts(), (10, 9, 3), "three wait for one connection closing: `1` and `2` are unlisted too");
        // None of the three closes (as if requests held their clients). Once they are no longer
        // counted on, three more origins are unlisted for the three waiting, and no more.
        tokio::time::sleep(PATIENCE + SOON).await;
        // (Woken late, this task may run before the waiting ones, woken at the same time.)
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        assert_eq!(origins.counts(), (7, 6, 6), "`3`, `4` and `5` unlisted, `6` to `11` kept");
        drop(open);
        for waiting in waiting {
            assert!(waiting.await.unwrap(), "a permit once the connections close");
        }
        assert_eq!(origins.counts(), (7, 0, 0));
    }

    #[tokio::test]
    async fn a_connection_opened_for_a_request_after_its_origin_was_unlisted_is_counted_on_to_close() {
        let origins = Origins::new(2);
        let (a, a_listing) = client(&origins, "http://a");
        let _b_open = client(&origins, "http://b").1.unwrap().open(SOON).await.unwrap();
        // `c` unlists `a`, without connections, while a request holds its client.
        let c_listing = client(&origins, "http://c").1.unwrap();
        assert_eq!(origins.counts(), (2, 1, 1));
        // The request's connection opens only now; it closes once its answer is in.
        let a_open = a_listing.unwrap().open(SOON).await.unwrap();
        assert_eq!(closing(&origins), 1);
        let waiting = tokio::spawn(async move { c_listing.open(Duration::from_secs(5)).await.is_some() });
        tokio::time::sleep(SOON).await;
        assert_eq!(origins.counts(), (2, 1, 1), "`c` waits for `a`'s connection; `b` keeps its own");
        drop((a, a_open));
        assert!(waiting.await.unwrap());
    }

    #[tokio::test]
    async fn unlistings_that_no_longer_count_are_not_kept_however_fast_origins_are_unlisted() {
        let origins = Origins::new(2);
        let mut held = VecDeque::new();
        // Each origin's client is held (by a request) while it is unlisted, and let go right after.
        for n in 0..100 {
            held.push_back(client(&origins, &format!("http://{n}")).0);
            if held.len() > 3 {
                held.pop_front();
            }
        }
        let recent = origins.lock().recent.len();
        assert!(recent <= 8, "{recent} unlistings kept, of 98");
    }

    #[tokio::test]
    async fn an_unlisted_origin_whose_client_is_held_is_listed_again_with_it_and_its_connections() {
        let origins = Origins::new(2);
        let (a, a_listing) = client(&origins, "http://a");
        let a_open = a_listing.unwrap().open(SOON).await.unwrap();
        let b_open = client(&origins, "http://b").1.unwrap().open(SOON).await.unwrap();
        // Both have connections: `a`, used least recently, is unlisted to list `c`, but its client is
        // still held (as a request waiting for its answer holds it).
        client(&origins, "http://c");
        assert_eq!(origins.counts(), (2, 1, 1));
        assert_eq!(closing(&origins), 1, "its connection is counted on to close");
        let (again, made) = client(&origins, "http://a");
        assert!(Arc::ptr_eq(&a, &again) && made.is_none(), "listed again with the client it had");
        assert_eq!(origins.counts(), (2, 2, 1), "with its connection: `c`, without any, made room");
        assert_eq!(closing(&origins), 0, "its connection serves it again");
        // Unlisted a second time within the second, its connection is counted once.
        client(&origins, "http://b");
        client(&origins, "http://d");
        assert_eq!(origins.counts(), (2, 1, 2));
        assert_eq!(closing(&origins), 1);
        let (later, _) = client(&origins, "http://a");
        drop(a_open);
        assert_eq!(origins.counts(), (2, 1, 1), "`d` made room; `c`, without client or connections, swept");
        // Unlisted again once no one holds its client, it gets a new one.
        drop((a, again, later));
        client(&origins, "http://d");
        let (_, made) = client(&origins, "http://a");
        assert!(made.is_some_and(|listing| listing.id != 1), "a client no one holds is not listed again");
        drop(b_open);
    }

    #[tokio::test]
    async fn an_origin_whose_client_is_gone_gets_a_new_one_that_waits_for_the_old_ones_connections() {
        let origins = Origins::new(3);
        let a_open = client(&origins, "http://a").1.unwrap().open(SOON).await.unwrap();
        let _b_open = client(&origins, "http://b").1.unwrap().open(SOON).await.unwrap();
        let _c_open = client(&origins, "http://c").1.unwrap().open(SOON).await.unwrap();
        // `a`, used least recently, is unlisted to list `d`; no one holds its client, and its
        // connection is still open, so it is remembered.
        client(&origins, "http://d");
        assert_eq!(origins.counts(), (3, 2, 1));
        let (_, made) = client(&origins, "http://a");
        let a_new = made.filter(|listing| listing.id != 1).expect("a new client");
        assert_eq!(origins.counts(), (3, 2, 1), "`d`, without connections, unlisted for it; `a`'s old one forgotten");
        // The old client's connection is closing: the new one's waits for its permit, and unlists
        // no origin meanwhile.
        assert!(a_new.open(SOON).await.is_none());
        assert_eq!(origins.counts(), (3, 2, 1), "`b` and `c` keep theirs");
        drop(a_open);
        assert_eq!(origins.counts(), (3, 2, 1), "the old client's connection is not counted against the new one");
        let _a_new_open = a_new.open(SOON).await.expect("the old connection's permit");
        assert_eq!(origins.counts(), (3, 3, 1));
    }

    #[tokio::test]
    async fn an_origins_own_connections_are_bounded_too() {
        let origins = Origins::new(2);
        let listing = client(&origins, "http://a").1.unwrap();
        let open = [listing.open(SOON).await.unwrap(), listing.open(SOON).await.unwrap()];
        assert!(listing.open(SOON).await.is_none());
        assert_eq!(origins.counts(), (1, 2, 0), "an origin never unlists itself");
        drop(open);
        assert_eq!(origins.counts(), (1, 0, 0));
    }

    #[tokio::test]
    async fn the_lists_are_bounded_and_origins_without_connections_go_first() {
        let origins = Origins::new(3);
        let first = client(&origins, "http://first").1.unwrap();
        let _open = first.open(SOON).await.unwrap();
        for n in 0..100 {
            client(&origins, &format!("http://{n}.example"));
        }
        let (listed, open, unlisted) = origins.counts();
        assert_eq!((listed, open), (3, 1));
        assert!(unlisted <= 3, "unlisted origins without a client or connections are forgotten: {unlisted} kept");
        let kept = origins.lock();
        let mut listed: Vec<&str> = kept.origins.keys().map(|o| &**o).collect();
        listed.sort_unstable();
        assert_eq!(listed, ["http://98.example", "http://99.example", "http://first"]);
    }
}
