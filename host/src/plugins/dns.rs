//! `wasi:sockets/ip-name-lookup`, bounded. wasmtime-wasi answers every `resolve-addresses` by
//! queueing a `getaddrinfo` on tokio's blocking pool at once, and dropping the lookup's resource
//! does not stop it. A plugin granted `dns` could so queue lookups of names no server answers (its
//! own domain's) far faster than they time out: the pool's threads and its queue fill, and the
//! host's own blocking work waits behind them (the HTTP pool's name lookups, the allowlists'
//! resolution at instance start, file access, plugin loads), for every plugin.
//!
//! Here a plugin's instances together have at most [`LOOKUPS_PER_PLUGIN`] lookups running, each
//! counted until its `getaddrinfo` returns, whether or not the plugin still waits for it. Past
//! that, `resolve-addresses` fails at once with `temporary-resolver-failure`, what a resolver too
//! busy to answer says, which a transport retries like any other failed connection. IP literals
//! are answered without a lookup, names are checked (and turned into punycode) as wasmtime-wasi
//! does, and without a `dns` grant every lookup fails with `permanent-resolver-failure`, as there.
//!
//! The same slots bound the lookups of the plugin's wasi:http connections, granted `dns` or not
//! (`http_pool.rs`), where a `*.domain` grant lets a plugin name endless origins: there a new
//! connection waits for a slot, within the 10 s a connection may take to open, instead of
//! failing, and connections to one host share one lookup.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use wasmtime::component::{Linker, Resource, ResourceType};
use wasmtime_wasi::p2::bindings::sockets::network::{ErrorCode, IpAddress};
use wasmtime_wasi::p2::{DynPollable, Network, Pollable, subscribe};

use super::sandbox::HostState;

/// The version of `wasi:sockets` that wasmtime-wasi links.
const WASI_IP_NAME_LOOKUP: &str = "wasi:sockets/ip-name-lookup@0.2.12";

/// Lookups one plugin's instances may have running at once: a few broker or endpoint names at a
/// time is what transports resolve; tokio's blocking pool has 512 threads for the whole host.
pub const LOOKUPS_PER_PLUGIN: usize = 8;

/// The longest name looked up: a DNS name's limit, with room for an IPv6 literal's zone.
const MAX_NAME: usize = 255;

/// Whether an instance may look names up, and its plugin's lookup slots.
#[derive(Clone)]
pub(crate) struct DnsGrant {
    allowed: bool,
    slots: Arc<Semaphore>,
}

/// The lookup slots of every plugin, by name, shared by its instances and its HTTP connections
/// (and by those of its next versions: a reload does not hand out fresh slots while the old
/// lookups still run).
#[derive(Default)]
pub(crate) struct DnsSlots(Mutex<HashMap<Arc<str>, Arc<Semaphore>>>);

impl DnsSlots {
    /// The slots of `plugin`.
    pub(crate) fn of(&self, plugin: &Arc<str>) -> Arc<Semaphore> {
        let mut slots = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !slots.contains_key(plugin) {
            // Forget the plugins gone (removed, or renamed) whose lookups have all returned: only
            // this map holds their slots then.
            slots.retain(|_, held| Arc::strong_count(held) > 1);
        }
        slots.entry(plugin.clone()).or_insert_with(|| Arc::new(Semaphore::new(LOOKUPS_PER_PLUGIN))).clone()
    }

    pub(crate) fn grant(&self, plugin: &Arc<str>, allowed: bool) -> DnsGrant {
        DnsGrant { allowed, slots: self.of(plugin) }
    }
}

/// Looks `name` up on tokio's blocking pool with `slot`, which is held until getaddrinfo returns
/// (the thread is busy until then, whoever still waits for the answer), and hands the answer to
/// `then` there.
pub(crate) fn resolve<T: Send + 'static>(
    slot: OwnedSemaphorePermit,
    name: String,
    then: impl FnOnce(io::Result<Vec<SocketAddr>>) -> T + Send + 'static,
) -> JoinHandle<T> {
    tokio::task::spawn_blocking(move || {
        let answer = (name.as_str(), 0).to_socket_addrs().map(Iterator::collect);
        drop(slot);
        then(answer)
    })
}

/// One lookup, as the plugin holds it.
pub struct Lookup(State);

enum State {
    Running(JoinHandle<io::Result<Vec<SocketAddr>>>),
    Done(Result<std::vec::IntoIter<IpAddr>, ErrorCode>),
}

impl Lookup {
    fn done(result: Result<Vec<IpAddr>, ErrorCode>) -> Lookup {
        Lookup(State::Done(result.map(Vec::into_iter)))
    }

    /// Ready once the answer is in.
    fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if let State::Running(job) = &mut self.0 {
            let Poll::Ready(joined) = Pin::new(job).poll(cx) else { return Poll::Pending };
            // A lookup that panicked or was cancelled (the runtime shutting down) is a resolver
            // that failed to answer.
            *self = Lookup::done(match joined {
                Ok(Ok(addrs)) => Ok(addrs.iter().map(|addr| addr.ip().to_canonical()).collect()),
                Ok(Err(_)) => Err(ErrorCode::NameUnresolvable),
                Err(_) => Err(ErrorCode::TemporaryResolverFailure),
            });
        }
        Poll::Ready(())
    }
}

#[async_trait::async_trait]
impl Pollable for Lookup {
    async fn ready(&mut self) {
        std::future::poll_fn(|cx| self.poll_answer(cx)).await;
    }
}

/// Starts looking `name` up for an instance with `grant`.
fn start(grant: &DnsGrant, name: &str) -> Result<Lookup, ErrorCode> {
    if !grant.allowed {
        return Err(ErrorCode::PermanentResolverFailure);
    }
    // No host name is longer; a longer one is not parsed (the parse runs on the relay's task).
    if name.len() > MAX_NAME {
        return Err(ErrorCode::InvalidArgument);
    }
    let domain = match url::Host::parse(name) {
        Ok(url::Host::Domain(domain)) => domain,
        Ok(url::Host::Ipv4(ip)) => return Ok(Lookup::done(Ok(vec![IpAddr::V4(ip)]))),
        Ok(url::Host::Ipv6(ip)) => return Ok(Lookup::done(Ok(vec![IpAddr::V6(ip)]))),
        // `url` wants an IPv6 address in brackets; the WIT's names may be bare ones.
        Err(_) => match name.parse::<Ipv6Addr>() {
            Ok(ip) => return Ok(Lookup::done(Ok(vec![IpAddr::V6(ip)]))),
            Err(_) => return Err(ErrorCode::InvalidArgument),
        },
    };
    let Ok(slot) = grant.slots.clone().try_acquire_owned() else {
        return Err(ErrorCode::TemporaryResolverFailure);
    };
    Ok(Lookup(State::Running(resolve(slot, domain, |answer| answer))))
}

/// Shadows wasmtime-wasi's `wasi:sockets/ip-name-lookup` (its resource and all its functions)
/// with the bounded lookups above.
pub(super) fn bound_name_lookups(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    linker.allow_shadowing(true);
    let mut lookups = linker.instance(WASI_IP_NAME_LOOKUP).map_err(anyhow::Error::from)?;
    lookups
        .resource("resolve-address-stream", ResourceType::host::<Lookup>(), |mut store, rep| {
            store.data_mut().table().delete(Resource::<Lookup>::new_own(rep))?;
            Ok(())
        })
        .map_err(anyhow::Error::from)?;
    lookups
        .func_wrap("resolve-addresses", |mut store, (network, name): (Resource<Network>, String)| {
            let state = store.data_mut();
            // The network resource is the capability to look names up: it must be a real one.
            state.table().get(&network)?;
            let result = match start(&state.dns, &name) {
                Ok(lookup) => Ok(state.table().push(lookup)?),
                Err(e) => Err(e),
            };
            Ok((result,))
        })
        .map_err(anyhow::Error::from)?;
    lookups
        .func_wrap("[method]resolve-address-stream.resolve-next-address", |mut store, (this,): (Resource<Lookup>,)| {
            let lookup = store.data_mut().table().get_mut(&this)?;
            if lookup.poll_answer(&mut Context::from_waker(Waker::noop())).is_pending() {
                return Ok((Err(ErrorCode::WouldBlock),));
            }
            let next: Result<Option<IpAddress>, ErrorCode> = match &mut lookup.0 {
                State::Done(Ok(addrs)) => Ok(addrs.next().map(IpAddress::from)),
                State::Done(Err(e)) => Err(*e),
                State::Running(_) => Err(ErrorCode::WouldBlock),
            };
            Ok((next,))
        })
        .map_err(anyhow::Error::from)?;
    lookups
        .func_wrap("[method]resolve-address-stream.subscribe", |mut store, (this,): (Resource<Lookup>,)| {
            let pollable: Resource<DynPollable> = subscribe(store.data_mut().table(), this)?;
            Ok((pollable,))
        })
        .map_err(anyhow::Error::from)?;
    linker.allow_shadowing(false);
    Ok(())
}
