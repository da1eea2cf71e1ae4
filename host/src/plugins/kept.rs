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
//! more, and those still answering once their answer is read; its next request gets a new client.
//! The connection waits for a permit meanwhile, in a fair queue: while connections of unlisted
//! clients are closing, for up to a second, for theirs; then unlisting one more origin every
//! [`UNLIST_EVERY`]. It waits within the 10 s a connection may take to open; without a permit
//! its request fails (`ConnectionLimitReached`). Connections of an unlisted client still hold
//! their permits until they close, so a client kept alive by a request that never ends cannot
//! hold more than the plugin's permits either.

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

/// One plugin's clients by origin (`C` is the client), and its connection permits.
pub(super) struct Origins<C> {
    /// Origins listed, and connections open, at most.
    limit: usize,
    permits: Arc<Semaphore>,
    kept: Mutex<Kept<C>>,
}

struct Kept<C> {
    origins: HashMap<Arc<str>, Listed<C>>,
    /// The connections of the origins listed: the plugin's others are unlisted clients', closing.
    listed_open: usize,
    /// Counts requests; orders the origins by when they were last used, and numbers listings.
    clock: u64,
}

struct Listed<C> {
    client: C,
    /// Which listing of the origin this is, so a connection of an earlier one is not counted here.
    id: u64,
    /// Its client's connections open or opening.
    open: usize,
    used: u64,
}

impl<C> Origins<C> {
    fn lock(&self) -> MutexGuard<'_, Kept<C>> {
        self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<C: Clone> Origins<C> {
    pub(super) fn new(limit: usize) -> Arc<Origins<C>> {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS);
        let kept = Kept { origins: HashMap::new(), listed_open: 0, clock: 0 };
        Arc::new(Origins { limit, permits: Arc::new(Semaphore::new(limit)), kept: Mutex::new(kept) })
    }

    /// The client for `origin`; listed anew, by `make` with the [`Listing`] its connector opens
    /// connections through, when the origin is not listed. The origin counts as used now.
    pub(super) fn client(self: &Arc<Self>, origin: &str, make: impl FnOnce(Listing<C>) -> C) -> C {
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
        while kept.origins.len() >= self.limit {
            let Some(client) = kept.unlist_least_used(|_, _| true, |listed| listed.open == 0) else { break };
            unlisted.push(client);
        }
        let origin: Arc<str> = origin.into();
        let client = make(Listing { origins: Arc::downgrade(self), origin: origin.clone(), id: now });
        kept.origins.insert(origin, Listed { client: client.clone(), id: now, open: 0, used: now });
        drop(kept);
        // Dropped with the lock released: a client's pool may be dropped with it.
        drop(unlisted);
        client
    }

    /// Origins listed and the connections counted against them, for tests.
    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let kept = self.lock();
        (kept.origins.len(), kept.origins.values().map(|listed| listed.open).sum())
    }
}

impl<C> Kept<C> {
    /// Unlists the origin used least recently among those `eligible`, preferring those `first`.
    fn unlist_least_used(
        &mut self,
        eligible: impl Fn(&str, &Listed<C>) -> bool,
        first: impl Fn(&Listed<C>) -> bool,
    ) -> Option<C> {
        let (origin, _) = self
            .origins
            .iter()
            .filter(|(origin, listed)| eligible(origin, listed))
            .min_by_key(|(_, listed)| (!first(listed), listed.used))?;
        let origin = origin.clone();
        let listed = self.origins.remove(&origin)?;
        self.listed_open -= listed.open;
        Some(listed.client)
    }
}

/// Where a client opens its connections: its origin, in one listing, and its plugin's permits.
pub(super) struct Listing<C> {
    origins: Weak<Origins<C>>,
    origin: Arc<str>,
    id: u64,
}

impl<C> Clone for Listing<C> {
    fn clone(&self) -> Self {
        Listing { origins: self.origins.clone(), origin: self.origin.clone(), id: self.id }
    }
}

impl<C> Listing<C> {
    /// A permit for a connection about to be opened, held by it until it closes; waited for up to
    /// `within`, unlisting other origins that have connections meanwhile. `None` when none came.
    pub(super) async fn open(&self, within: Duration) -> Option<Opened<C>> {
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
                let in_use = origins.limit.saturating_sub(origins.permits.available_permits());
                let closing = in_use > kept.listed_open;
                let others = |origin: &str, listed: &Listed<C>| origin != &*self.origin && listed.open > 0;
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

    /// A connection with `permit`, counted against this listing if it is still its origin's.
    fn opened(&self, origins: &Origins<C>, permit: OwnedSemaphorePermit) -> Opened<C> {
        let mut kept = origins.lock();
        let listed = match kept.origins.get_mut(&self.origin).filter(|listed| listed.id == self.id) {
            Some(listed) => {
                listed.open += 1;
                true
            }
            None => false,
        };
        kept.listed_open += usize::from(listed);
        Opened { listing: self.clone(), listed, _permit: permit }
    }
}

/// A connection's permit, and its count against its origin's listing (while that lasts).
pub(super) struct Opened<C> {
    listing: Listing<C>,
    listed: bool,
    _permit: OwnedSemaphorePermit,
}

impl<C> Drop for Opened<C> {
    fn drop(&mut self) {
        let Some(origins) = self.listing.origins.upgrade().filter(|_| self.listed) else { return };
        let mut kept = origins.lock();
        if let Some(listed) = kept.origins.get_mut(&self.listing.origin).filter(|l| l.id == self.listing.id) {
            listed.open -= 1;
            kept.listed_open -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that says which listing made it, and is shared by its clones.
    type Client = Arc<u64>;

    fn client(origins: &Arc<Origins<Client>>, origin: &str) -> (Client, Option<Listing<Client>>) {
        let mut made = None;
        let client = origins.client(origin, |listing| {
            let client = Arc::new(listing.id);
            made = Some(listing);
            client
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
        assert_eq!(origins.counts(), (2, 2));
        // `a` is used again, so `b` is the one used least recently.
        let (again, made) = client(&origins, "http://a");
        assert!(Arc::ptr_eq(&a, &again) && made.is_none(), "a listed origin keeps its client");
        let c_listing = client(&origins, "http://c").1.unwrap();
        assert_eq!(origins.counts(), (2, 1), "b is unlisted to list c");
        // Both permits are held, and neither connection closes: c's connection waits for b's, which
        // is unlisted, for a second, then unlists `a` and waits for its, in vain.
        assert!(c_listing.open(SOON).await.is_none(), "no permit while both connections are open");
        assert_eq!(origins.counts(), (2, 1), "a is not unlisted while b's connection may be closing");
        assert!(c_listing.open(PATIENCE + SOON).await.is_none(), "unlisted connections hold their permits");
        assert_eq!(origins.counts(), (1, 0), "only c is left, without connections");
        drop(b_open);
        let c_open = c_listing.open(SOON).await.expect("b's connection closed: its permit is free");
        assert_eq!(origins.counts(), (1, 1));
        // One waits, and gets the permit of a connection that closes meanwhile.
        let waiting = tokio::spawn({
            let c_listing = c_listing.clone();
            async move { c_listing.open(Duration::from_secs(5)).await.is_some() }
        });
        tokio::time::sleep(UNLIST_EVERY * 2).await;
        drop(a_open);
        assert!(waiting.await.unwrap());
        // `b`'s listing is gone: a connection its client opens holds a permit, uncounted by origin.
        drop(c_open);
        let late = b_listing.open(SOON).await.unwrap();
        assert_eq!(origins.counts(), (1, 0));
        drop(late);
    }

    #[tokio::test]
    async fn an_origins_own_connections_are_bounded_too() {
        let origins = Origins::new(2);
        let listing = client(&origins, "http://a").1.unwrap();
        let open = [listing.open(SOON).await.unwrap(), listing.open(SOON).await.unwrap()];
        assert!(listing.open(SOON).await.is_none());
        assert_eq!(origins.counts(), (1, 2), "an origin never unlists itself");
        drop(open);
        assert_eq!(origins.counts(), (1, 0));
    }

    #[tokio::test]
    async fn the_list_is_bounded_and_origins_without_connections_go_first() {
        let origins = Origins::new(3);
        let first = client(&origins, "http://first").1.unwrap();
        let _open = first.open(SOON).await.unwrap();
        for n in 0..100 {
            client(&origins, &format!("http://{n}.example"));
        }
        assert_eq!(origins.counts(), (3, 1));
        let kept = origins.lock();
        let mut listed: Vec<&str> = kept.origins.keys().map(|o| &**o).collect();
        listed.sort_unstable();
        assert_eq!(listed, ["http://98.example", "http://99.example", "http://first"]);
    }
}
