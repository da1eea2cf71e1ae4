//! The bound on the connections a plugin's wasi:http requests keep open between requests.
//! hyper's pool bounds the idle connections of each origin only, and a plugin granted `*.domain`
//! can name endless origins: each would keep its connections open for a minute after its last
//! request, file descriptors the rest of the host (other plugins, the database) needs.
//!
//! So each origin a plugin sends to has a client (and a pool) of its own, listed in the plugin's
//! [`Origins`], which keeps at most `limit` origins listed and counts the connections their
//! clients open. When a connection is opened past `limit`, the origin used least recently that
//! has connections is unlisted: its client is dropped, which closes its idle connections at once
//! and those still answering once their answer is read, and its next request gets a new client.
//! An origin's own connections never make room for each other: those are bounded by hyper's
//! idle limit per origin and the plugin's requests in flight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// One plugin's clients by origin (`C` is the client), and the connections they keep.
pub(super) struct Origins<C> {
    /// Origins listed, and connections counted, at most.
    limit: usize,
    kept: Mutex<Kept<C>>,
}

struct Kept<C> {
    origins: HashMap<Arc<str>, Listed<C>>,
    /// The connections of the origins listed.
    open: usize,
    /// Counts requests; orders the origins by when they were last used, and numbers listings.
    clock: u64,
}

struct Listed<C> {
    client: C,
    /// Which listing of the origin this is, so a connection of an earlier one is not counted here.
    id: u64,
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
        let kept = Kept { origins: HashMap::new(), open: 0, clock: 0 };
        Arc::new(Origins { limit: limit.max(1), kept: Mutex::new(kept) })
    }

    /// The client for `origin`; listed anew, by `make` with the [`Listing`] its connector counts
    /// connections against, when the origin is not listed. The origin counts as used now.
    pub(super) fn client(self: &Arc<Self>, origin: &str, make: impl FnOnce(Listing<C>) -> C) -> C {
        let mut unlisted = Vec::new();
        let mut kept = self.lock();
        kept.clock += 1;
        let now = kept.clock;
        if let Some(listed) = kept.origins.get_mut(origin) {
            listed.used = now;
            return listed.client.clone();
        }
        // Origins whose connections all failed to open count none: the list itself is bounded.
        while kept.origins.len() >= self.limit {
            let Some(client) = kept.unlist_least_used(None) else { break };
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

    /// Origins listed and the connections counted, for tests.
    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let kept = self.lock();
        (kept.origins.len(), kept.open)
    }
}

impl<C> Kept<C> {
    /// Unlists the origin used least recently, other than `except`; with `except`, only among
    /// those with connections (it makes room for one of `except`'s). `None` when there is none.
    fn unlist_least_used(&mut self, except: Option<&str>) -> Option<C> {
        let (origin, _) = self
            .origins
            .iter()
            .filter(|(origin, listed)| except.is_none_or(|except| &***origin != except && listed.open > 0))
            .min_by_key(|(_, listed)| listed.used)?;
        let origin = origin.clone();
        let listed = self.origins.remove(&origin)?;
        self.open -= listed.open;
        Some(listed.client)
    }
}

/// Where a client's connections are counted: its origin, in one listing.
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
    /// Counts a connection just opened, unlisting other origins past the limit; the connection
    /// holds what this returns until it closes. Not counted when its origin was unlisted since
    /// its client was made: that client is on its way out.
    pub(super) fn opened(&self) -> Opened<C> {
        let mut unlisted = Vec::new();
        let counted = self.origins.upgrade().is_some_and(|origins| {
            let mut kept = origins.lock();
            if kept.origins.get(&self.origin).is_none_or(|listed| listed.id != self.id) {
                return false;
            }
            while kept.open >= origins.limit {
                let Some(client) = kept.unlist_least_used(Some(&self.origin)) else { break };
                unlisted.push(client);
            }
            kept.open += 1;
            if let Some(listed) = kept.origins.get_mut(&self.origin) {
                listed.open += 1;
            }
            true
        });
        drop(unlisted);
        Opened { listing: self.clone(), counted }
    }
}

/// A counted connection: uncounted when dropped, if its listing is still the origin's.
pub(super) struct Opened<C> {
    listing: Listing<C>,
    counted: bool,
}

impl<C> Drop for Opened<C> {
    fn drop(&mut self) {
        let Some(origins) = self.listing.origins.upgrade().filter(|_| self.counted) else { return };
        let mut kept = origins.lock();
        let Some(listed) = kept.origins.get_mut(&self.listing.origin).filter(|l| l.id == self.listing.id) else {
            return;
        };
        listed.open -= 1;
        kept.open -= 1;
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

    #[test]
    fn past_the_limit_the_origin_used_least_recently_is_unlisted() {
        let origins = Origins::new(2);
        let (a, a_listing) = client(&origins, "http://a");
        let (_, b_listing) = client(&origins, "http://b");
        let (a_listing, b_listing) = (a_listing.unwrap(), b_listing.unwrap());
        let a_open = a_listing.opened();
        let _b_open = b_listing.opened();
        assert_eq!(origins.counts(), (2, 2));
        // `a` is used again, so `b` is the one used least recently.
        let (again, made) = client(&origins, "http://a");
        assert!(Arc::ptr_eq(&a, &again) && made.is_none(), "a listed origin keeps its client");
        let (_, c_listing) = client(&origins, "http://c");
        assert_eq!(origins.counts(), (2, 1), "b is unlisted, with its connection, to list c");
        let c_listing = c_listing.unwrap();
        let _c_open = c_listing.opened();
        assert_eq!(origins.counts(), (2, 2));
        // A second connection of `c` makes room by unlisting `a`, the other origin.
        let _c_second = c_listing.opened();
        assert_eq!(origins.counts(), (1, 2), "only c is left, with its two connections");
        // `a`'s connection closing now is not counted against c's.
        drop(a_open);
        assert_eq!(origins.counts(), (1, 2));
        // `b`'s client was unlisted: a connection it opens now is not counted.
        let late = b_listing.opened();
        assert_eq!(origins.counts(), (1, 2));
        drop(late);
        assert_eq!(origins.counts(), (1, 2));
    }

    #[test]
    fn an_origins_own_connections_never_make_room_for_each_other() {
        let origins = Origins::new(2);
        let listing = client(&origins, "http://a").1.unwrap();
        let open: Vec<_> = (0..5).map(|_| listing.opened()).collect();
        assert_eq!(origins.counts(), (1, 5));
        drop(open);
        assert_eq!(origins.counts(), (1, 0));
    }

    #[test]
    fn origins_without_connections_are_bounded_too() {
        let origins = Origins::new(3);
        for n in 0..100 {
            client(&origins, &format!("http://{n}.example"));
        }
        assert_eq!(origins.counts(), (3, 0));
        let kept = origins.lock();
        let mut listed: Vec<&str> = kept.origins.keys().map(|o| &**o).collect();
        listed.sort_unstable();
        assert_eq!(listed, ["http://97.example", "http://98.example", "http://99.example"]);
    }
}
