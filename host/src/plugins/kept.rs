//! The bound on the connections a plugin's wasi:http requests have open. hyper's pool bounds
//! the idle connections of each origin only, and a plugin granted `*.domain` can name endless
//! origins: each would keep its connections open for a minute after its last request, file
//! descriptors the rest of the host (other plugins, the database) needs.
//!
//! So a plugin has `limit` connection permits, one held by each of its connections from before it
//! is opened until it closes, whichever client opened it. And each origin it sends to has a client
//! (and a pool) of its own, listed in the plugin's [`Origins`], at most `limit` of them. A
//! connection that finds no permit unlists the origin used least recently that has connections:
//! its client is dropped, which closes its idle connections once no request holds the client any
//! more, and those still answering once their answer is read. The connection waits for a permit
//! meanwhile, in a fair queue: while connections of unlisted clients are closing, for up to a
//! second, for theirs; then unlisting one more origin every [`UNLIST_EVERY`]. It waits within the
//! 10 s a connection may take to open; without a permit its request fails
//! (`ConnectionLimitReached`). Connections of an unlisted client still hold their permits until
//! they close, so a client kept alive by a request that never ends cannot hold more than the
//! plugin's permits either.
//!
//! The next request to an unlisted origin lists it again: with the same client while a request
//! still holds that one, so the connections it keeps open (and their permits) serve the origin
//! again instead of waiting beside a new client's; with a new client otherwise.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// How long a connection waiting for a permit waits for the connections of the origin it
/// unlisted to close before it unlists another.
const UNLIST_EVERY: Duration = Duration::from_millis(50);
/// How long a connection waiting for a permit trusts connections of unlisted clients to close
/// (as they do unless a request still holds their client) before it unlists another origin.
const PATIENCE: Duration = Duration::from_secs(1);

/// One plugin's clients (`T`) by origin, and its connection permits.
pub(super) struct Origins<T> {
    permits: Arc<Semaphore>,
    kept: Mutex<Kept<T>>,
}

struct Kept<T> {
    /// Origins listed, and connections open, at most.
    limit: usize,
    origins: HashMap<Arc<str>, Listed<Arc<T>>>,
    /// Origins unlisted whose client a request may still hold, or whose connections are still
    /// open; their `used` is no longer read.
    unlisted: HashMap<Arc<str>, Listed<Weak<T>>>,
    /// How many `unlisted` there may be before those whose client is gone and whose connections
    /// are closed are forgotten.
    sweep_at: usize,
    /// The connections of the origins listed: the plugin's others are unlisted clients', closing.
    listed_open: usize,
    /// Counts requests; orders the origins by when they were last used, and numbers listings.
    clock: u64,
}

/// An origin's client (`C`: held while listed, weakly once unlisted) and its connections.
struct Listed<C> {
    client: C,
    /// Which client of the origin this is, so a connection of an earlier one is not counted here.
    id: u64,
    /// Its client's connections open or opening.
    open: usize,
    used: u64,
}

impl<T> Origins<T> {
    pub(super) fn new(limit: usize) -> Arc<Origins<T>> {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS);
        let kept = Kept {
            limit,
            origins: HashMap::new(),
            unlisted: HashMap::new(),
            sweep_at: limit,
            listed_open: 0,
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
        while kept.origins.len() >= kept.limit {
            let Some(client) = kept.unlist_least_used(|_, _| true, |listed| listed.open == 0) else { break };
            unlisted.push(client);
        }
        let (origin, listed) = match kept.unlisted.remove_entry(origin) {
            Some((origin, before)) => match before.client.upgrade() {
                Some(client) => (origin, Listed { client, id: before.id, open: before.open, used: now }),
                // Its connections are no longer counted by origin; they still hold their permits.
                None => self.listed_anew(origin, now, make),
            },
            None => self.listed_anew(origin.into(), now, make),
        };
        kept.listed_open += listed.open;
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
    ) -> (Arc<str>, Listed<Arc<T>>) {
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
        eligible: impl Fn(&str, &Listed<Arc<T>>) -> bool,
        first: impl Fn(&Listed<Arc<T>>) -> bool,
    ) -> Option<Arc<T>> {
        let (origin, _) = self
            .origins
            .iter()
            .filter(|(origin, listed)| eligible(origin, listed))
            .min_by_key(|(_, listed)| (!first(listed), listed.used))?;
        let origin = origin.clone();
        let listed = self.origins.remove(&origin)?;
        self.listed_open -= listed.open;
        if self.unlisted.len() >= self.sweep_at {
            self.unlisted.retain(|_, unlisted| unlisted.open > 0 || unlisted.client.strong_count() > 0);
            self.sweep_at = (self.unlisted.len() * 2).max(self.limit);
        }
        let Listed { client, id, open, used } = listed;
        self.unlisted.insert(origin, Listed { client: Arc::downgrade(&client), id, open, used });
        Some(client)
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
            step(&mut self.listed_open);
            return true;
        }
        let Some(unlisted) = self.unlisted.get_mut(origin).filter(|unlisted| unlisted.id == id) else { return false };
        step(&mut unlisted.open);
        if unlisted.open == 0 && unlisted.client.strong_count() == 0 {
            self.unlisted.remove(origin);
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
        let now = tokio::time::Instant::now();
        let deadline = now + within;
        // Connections of unlisted clients are closing (unless a request still holds their
        // client): for up to `PATIENCE` their permits are waited for before another origin is
        // unlisted.
        let patient_until = now + PATIENCE;
        // One place in the (fair) queue for the whole wait.
        let mut acquire = std::pin::pin!(origins.permits.clone().acquire_owned());
        let permit = loop {
            let (unlisted, wait) = {
                let mut kept = origins.lock();
                let in_use = kept.limit.saturating_sub(origins.permits.available_permits());
                let closing = in_use > kept.listed_open;
                let others = |origin: &str, listed: &Listed<Arc<T>>| origin != &*self.origin && listed.open > 0;
                match closing && tokio::time::Instant::now() < patient_until {
                    true => (None, UNLIST_EVERY),
                    false => match kept.unlist_least_used(others, |_| true) {
                        Some(client) => (Some(client), UNLIST_EVERY),
                        // Nothing left to unlist: one of the open connections has to close.
                        None => (None, within),
                    },
                }
            };
            drop(unlisted);
            let until = deadline.min(tokio::time::Instant::now() + wait);
            match tokio::time::timeout_at(until, &mut acquire).await {
                Ok(Ok(permit)) => break permit,
                Ok(Err(_)) => return None,
                Err(_) if tokio::time::Instant::now() >= deadline => return None,
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
        tokio::time::sleep(UNLIST_EVERY * 2).await;
        drop(a_open);
        assert!(waiting.await.unwrap());
        // `b`'s client is forgotten: a connection it opens holds a permit, uncounted by origin.
        drop(c_open);
        let late = b_listing.open(SOON).await.unwrap();
        assert_eq!(origins.counts(), (1, 0, 1));
        drop(late);
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
        let (again, made) = client(&origins, "http://a");
        assert!(Arc::ptr_eq(&a, &again) && made.is_none(), "listed again with the client it had");
        assert_eq!(origins.counts(), (2, 2, 1), "with its connection: `c`, without any, made room");
        drop(a_open);
        assert_eq!(origins.counts(), (2, 1, 1));
        // Unlisted again once no one holds its client, it gets a new one.
        drop((a, again));
        client(&origins, "http://d");
        let (_, made) = client(&origins, "http://a");
        assert!(made.is_some_and(|listing| listing.id != 1), "a client no one holds is not listed again");
        drop(b_open);
    }

    #[tokio::test]
    async fn an_origin_whose_client_is_gone_gets_a_new_one_and_its_old_connections_count_no_more() {
        let origins = Origins::new(3);
        let a_open = client(&origins, "http://a").1.unwrap().open(SOON).await.unwrap();
        let _b_open = client(&origins, "http://b").1.unwrap().open(SOON).await.unwrap();
        let _c_open = client(&origins, "http://c").1.unwrap().open(SOON).await.unwrap();
        // `a`, used least recently, is unlisted to list `d`; no one holds its client, and its
        // connection is still open, so it is remembered.
        client(&origins, "http://d");
        assert_eq!(origins.counts(), (3, 2, 1));
        let (_, made) = client(&origins, "http://a");
        assert!(made.is_some_and(|listing| listing.id != 1), "a new client");
        assert_eq!(origins.counts(), (3, 2, 1), "`d`, without connections, unlisted for it; `a`'s old one forgotten");
        drop(a_open);
        assert_eq!(origins.counts(), (3, 2, 1), "the old client's connection is not counted against the new one");
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
