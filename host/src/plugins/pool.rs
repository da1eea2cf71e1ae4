//! Per-route instance pools: each route's transport keeps a few sandboxed instances of its
//! plugin, makes new ones on demand (up to the plugin's `instances` limit), reuses them so a
//! transport can keep connections open, and drops them after a fault, after `max_calls`, or when
//! the plugin is reloaded. Also the conversion of events and outcomes to and from the WIT types.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::metrics::histogram::Histogram;
use wasmtime::Store as WasmStore;

use super::contract::Bindings;
use super::registry::{Plugin, Registry};
use super::runtime::Runtime;
use super::sandbox::{HostState, resolve_allowlist, set_deadline};
use super::{DeliverError, EPOCH_TICK, Outcome, PluginFault, root_cause};
use crate::config::{PluginLimits, PluginSettings, RouteSettings, Settings};
use crate::event::ClaimedEvent;
use crate::metrics::{FaultLabels, PluginLabels};

/// A live instance of a plugin version, configured for one route.
pub(super) struct Instance {
    store: WasmStore<HostState>,
    bindings: Bindings,
    /// The version it was made from; an instance of a replaced version is not reused.
    hash: String,
    /// The config its `init` had, when not the route's own (an endpoint's).
    config: Option<PluginConfig>,
    calls: u64,
}

/// Whether `e` comes from the host running short of open files or memory (another plugin holding
/// thousands of sockets, say): a shortage that may pass, unlike a grant that cannot be met.
fn short_of_resources(e: &anyhow::Error) -> bool {
    e.chain().filter_map(|cause| cause.downcast_ref::<std::io::Error>()).any(|io| {
        io.kind() == std::io::ErrorKind::OutOfMemory
            || matches!(io.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOBUFS))
    })
}

/// Why the host cannot open a file right now, if it is out of descriptors (the process's or the
/// system's): asked after an `init` failed, which may have been for want of one.
fn host_out_of_files() -> Option<String> {
    match std::fs::File::open("/dev/null") {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => Some(e.to_string()),
        _ => None,
    }
}

/// A plugin config given per call (an endpoint's), shared by the instances made with it.
pub type PluginConfig = Arc<[(String, String)]>;

/// Why no instance could be started for a route.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(super) enum StartError {
    /// The route cannot use the plugin as things stand (it is not loaded, its sandbox cannot be
    /// set up, or `init` rejects or traps on the route's config): its events fail with
    /// `no_transport` until that is fixed.
    #[error("{0}")]
    Unusable(String),
    /// A fault that may pass (the instance pool is full, a limit was hit while starting, `init`
    /// timed out): its events are retried like after any other fault.
    #[error(transparent)]
    Fault(PluginFault),
    /// The host is short of open files or memory: its events wait a moment (see
    /// [`DeliverError::HostShort`]).
    #[error("{0}")]
    HostShort(String),
}

impl Instance {
    /// Sets up the sandbox, instantiates `plugin` for `route` and runs its `init` with `config`,
    /// or the route's. `timed`: the histogram that observes how long that takes, unless the
    /// sandbox cannot be set up (the trial starts of a reload are not timed). Past `cutoff` the
    /// plugin is not instantiated, and this never returns (see [`Cutoff`]).
    pub(super) async fn start(
        runtime: &Runtime,
        plugin: &Plugin,
        route: &RouteSettings,
        grants: &PluginSettings,
        config: Option<&PluginConfig>,
        timed: Option<&Histogram>,
        cutoff: Option<&Cutoff>,
    ) -> Result<Instance, StartError> {
        let timer = timed.map(Stopwatch::start);
        let name: Arc<str> = Arc::from(plugin.info.name.as_str());
        let tcp = resolve_allowlist(&plugin.info.name, &grants.sandbox.tcp).await;
        let limits = &grants.limits;
        let mut store = match runtime.store(name, &grants.sandbox, limits, &tcp) {
            Ok(store) => store,
            Err(e) => {
                // A sandbox that cannot be set up is a configuration error, not a start; unless
                // the host is short of descriptors or memory, which may pass.
                if let Some(timer) = timer {
                    timer.discard();
                }
                if short_of_resources(&e) {
                    return Err(StartError::HostShort(format!("the host could not set up the sandbox: {e:#}")));
                }
                return Err(StartError::Unusable(format!("{e:#}")));
            }
        };
        // Checked here, after the allowlist's lookups and right before the plugin's code runs.
        if Cutoff::passed(cutoff) {
            if let Some(timer) = timer {
                timer.discard();
            }
            return std::future::pending().await;
        }
        let timeout = limits.timeout;
        // The epoch deadline (set on the store) stops wasm code; this timeout also covers a guest
        // parked in the host, so `init` can stall neither start-up nor a reload.
        let start = async {
            let bindings = plugin.pre.instantiate(&mut store).await?;
            let init = bindings.init(&mut store, config.map_or(&route.plugin_config[..], |c| &c[..])).await;
            wasmtime::Result::Ok((bindings, init))
        };
        let stalled =
            || StartError::Fault(PluginFault::NotInstantiated(format!("init did not finish within {timeout:?}")));
        let (bindings, init) = match tokio::time::timeout(timeout + EPOCH_TICK * 5, start).await {
            Err(_elapsed) => return Err(stalled()),
            Ok(Ok(started)) => started,
            Ok(Err(_)) if store.data().limiter.hit => {
                return Err(StartError::Fault(PluginFault::OutOfMemory(limits.memory)));
            }
            Ok(Err(e)) => return Err(StartError::Fault(PluginFault::NotInstantiated(root_cause(&e)))),
        };
        let started = match init {
            Ok(Ok(())) => {
                return Ok(Instance { store, bindings, hash: plugin.hash.clone(), config: config.cloned(), calls: 0 });
            }
            Ok(Err(message)) => {
                let message = crate::untrusted::clean(&message, crate::untrusted::MAX_REASON);
                Err(StartError::Unusable(format!(
                    "plugin {} rejected the config of route {}: {message}",
                    plugin.info.name, route.name
                )))
            }
            Err(_) if store.data().limiter.hit => Err(StartError::Fault(PluginFault::OutOfMemory(limits.memory))),
            Err(trap) if trap.downcast_ref::<wasmtime::Trap>() == Some(&wasmtime::Trap::Interrupt) => Err(stalled()),
            Err(trap) => {
                Err(StartError::Unusable(format!("plugin {} trapped in init: {}", plugin.info.name, root_cause(&trap))))
            }
        };
        // An `init` that opens a file or a connection fails when the host has no descriptor left
        // to give it, which says nothing about the route's config. Asked once the instance and
        // what it opened are gone: a plugin using up the descriptors itself is not short of them.
        drop(store);
        match (started, host_out_of_files()) {
            (Err(StartError::Unusable(why)), Some(short)) => {
                Err(StartError::HostShort(format!("{why} (the host is out of open files: {short})")))
            }
            (started, _) => started,
        }
    }
}

/// The transport of one route: a pool of instances of the route's plugin, made on demand (up to
/// the plugin's `instances` limit), reused across calls so a transport can keep connections
/// open, and replaced after a fault, after `max_calls` calls, or when the plugin is reloaded.
pub struct RouteTransport {
    route: Arc<RouteSettings>,
    registry: Arc<Registry>,
    grants: Arc<PluginSettings>,
    limits: PluginLimits,
    slots: tokio::sync::Semaphore,
    /// For the calls made with a config of their own (an endpoint's), by config: at most
    /// [`RouteTransport::config_limit`] of them at once, and how many calls hold or wait for one
    /// (the entry goes when none does).
    per_config: Mutex<HashMap<PluginConfig, (Arc<tokio::sync::Semaphore>, usize)>>,
    idle: Mutex<Vec<Instance>>,
    /// The plugin's series of `ferry_plugin_call_duration_seconds`,
    /// `ferry_plugin_instance_wait_seconds` and `ferry_plugin_instance_start_seconds`, looked up
    /// once rather than on every call.
    call_duration: Histogram,
    instance_wait: Histogram,
    instance_start: Histogram,
}

impl std::fmt::Debug for RouteTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteTransport").field("route", &self.route.name).field("plugin", &self.route.plugin).finish()
    }
}

impl RouteTransport {
    /// The transport of `route`, served by its plugin from `registry` (it need not be loaded yet).
    pub fn new(registry: Arc<Registry>, route: Arc<RouteSettings>) -> Self {
        let grants = registry.settings().plugin(&route.plugin);
        let limits = grants.limits;
        let labels = PluginLabels { plugin: route.plugin.as_str().into() };
        let metrics = &registry.metrics;
        let call_duration = metrics.plugin_call_duration.get_or_create(&labels).clone();
        let instance_wait = metrics.plugin_instance_wait.get_or_create(&labels).clone();
        let instance_start = metrics.plugin_instance_start.get_or_create(&labels).clone();
        Self {
            route,
            slots: tokio::sync::Semaphore::new(limits.instances),
            grants,
            limits,
            registry,
            per_config: Mutex::new(HashMap::new()),
            idle: Mutex::new(Vec::new()),
            call_duration,
            instance_wait,
            instance_start,
        }
    }

    /// Whether this transport can serve `route` as it is: the same plugin with the same config
    /// (its retry policy and ordering are the relay's business).
    pub fn serves(&self, route: &RouteSettings) -> bool {
        self.route.name == route.name
            && self.route.plugin == route.plugin
            && self.route.plugin_config == route.plugin_config
    }

    /// The most instances this transport holds at once.
    pub fn instance_limit(&self) -> usize {
        self.limits.instances
    }

    /// The most calls made with one config of their own (an endpoint's) at once: half the
    /// instances, rounded up. The calls of an endpoint whose receiver hangs thus leave the other
    /// half to the route's other endpoints, and its further calls wait for its own, not in the
    /// line for all of them. (With one instance, there is no half to leave.)
    pub fn config_limit(&self) -> usize {
        self.limits.instances.div_ceil(2)
    }

    /// Takes one of the calls `config` may make at once ([`RouteTransport::config_limit`]),
    /// waiting for one if need be; and whether it had to wait.
    async fn config_slot(&self, config: &PluginConfig) -> (ConfigSlot<'_>, bool) {
        let semaphore = {
            let mut per_config = self.per_config.lock().unwrap_or_else(|e| e.into_inner());
            let limit = self.config_limit();
            let entry =
                per_config.entry(config.clone()).or_insert_with(|| (Arc::new(tokio::sync::Semaphore::new(limit)), 0));
            entry.1 += 1;
            entry.0.clone()
        };
        // Counted before the wait, so a wait cut short (the delivery dropped) still counts down.
        let mut slot = ConfigSlot { transport: self, config: config.clone(), _permit: None };
        let (permit, waited) = match semaphore.clone().try_acquire_owned() {
            Ok(permit) => (permit, false),
            Err(_) => (semaphore.acquire_owned().await.expect("the semaphore is never closed"), true),
        };
        slot._permit = Some(permit);
        (slot, waited)
    }

    /// Drops the idle instances (calls in flight keep theirs): for a transport being replaced,
    /// so its slots in the instance pool are free for the new one.
    pub fn drain_idle(&self) {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// The plugin's name.
    pub fn plugin_name(&self) -> &str {
        &self.route.plugin
    }

    /// The longest one call may take.
    pub fn timeout(&self) -> std::time::Duration {
        self.limits.timeout
    }

    /// Makes sure an instance can be started for this route now: the plugin is loaded and
    /// accepts the route's config. Keeps the instance for the first delivery.
    pub async fn warm_up(&self) -> Result<(), String> {
        let instance = self.instance(None, None).await.map_err(|e| e.to_string())?;
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(instance);
        Ok(())
    }

    /// An idle instance of the active version made with `config` (the route's: `None`), or a
    /// new one (not past `cutoff`).
    async fn instance(&self, config: Option<&PluginConfig>, cutoff: Option<&Cutoff>) -> Result<Instance, StartError> {
        let Some(plugin) = self.registry.get(&self.route.plugin) else {
            let loaded = self.registry.names();
            return Err(StartError::Unusable(format!(
                "plugin {:?} of route {:?} is not loaded (loaded: {})",
                self.route.plugin,
                self.route.name,
                if loaded.is_empty() { "none".to_string() } else { loaded.join(", ") }
            )));
        };
        let reusable = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            // Instances of a replaced version are dropped here.
            idle.retain(|i| i.hash == plugin.hash);
            match idle.iter().rposition(|i| i.config.as_ref().map(|c| &c[..]) == config.map(|c| &c[..])) {
                Some(at) => Some(idle.remove(at)),
                None => {
                    // A new instance for another config (an endpoint's): the oldest idle ones give
                    // way, so the route never holds more than its `instances` at once.
                    let room = self.slots.available_permits();
                    let excess = idle.len().saturating_sub(room);
                    idle.drain(..excess);
                    None
                }
            }
        };
        match reusable {
            Some(instance) => Ok(instance),
            None => {
                let runtime = &self.registry.runtime;
                Instance::start(runtime, &plugin, &self.route, &self.grants, config, Some(&self.instance_start), cutoff)
                    .await
            }
        }
    }

    /// Hands `events` to the plugin: one outcome per event, in order, and which version answered.
    /// `config`: an instance made with this config (an endpoint's) rather than the route's.
    /// `window`: the relay's bounds on when the call may begin (see [`Window`]). Once its cutoff
    /// has passed, neither an instance start nor the call begins: the delivery then never
    /// finishes, and the relay, which fixed the cutoff, drops it after giving its events back.
    pub async fn deliver(
        &self,
        events: &[&ClaimedEvent],
        config: Option<&PluginConfig>,
        window: Option<&Window<'_>>,
    ) -> Delivery {
        let asked = std::time::Instant::now();
        let cutoff = window.map(|w| w.cutoff);
        let waiting = Stopwatch::start(&self.instance_wait);
        let (_own, mut waited) = match config {
            Some(config) => {
                let (slot, waited) = self.config_slot(config).await;
                (Some(slot), waited)
            }
            None => (None, false),
        };
        let _slot = match self.slots.try_acquire() {
            Ok(slot) => slot,
            Err(_) => {
                waited = true;
                self.slots.acquire().await.expect("the semaphore is never closed")
            }
        };
        drop(waiting);
        let waited = waited.then(|| asked.elapsed());
        let (plugin_hash, result) = match self.instance(config, cutoff).await {
            Ok(instance) => {
                if Cutoff::passed(cutoff) {
                    return std::future::pending().await;
                }
                // After a wait for an instance, the call, begun now, could still be running when
                // the claim's lease ends, and another instance of ferry may by then have claimed
                // and delivered the events. (A call that did not wait begins: a lease longer than
                // the timeout is the configuration's to give.)
                if let (Some(window), Some(waited)) = (window, waited)
                    && std::time::Instant::now() + self.longest_call() > window.lease_ends
                {
                    self.keep(instance);
                    let why = format!(
                        "not delivered: it waited {waited:.1?} for one of plugin {}'s {} instances, and a call \
                         begun then could have run past the claim's lease (relay.lease); tried again in a moment, \
                         no attempt counted",
                        self.route.plugin, self.limits.instances,
                    );
                    tracing::warn!(route = %self.route.name, events = events.len(), "{why}");
                    return Delivery { plugin_hash: None, result: Err(DeliverError::LeaseShort(why)) };
                }
                let plugin_hash = Some(instance.hash.clone());
                let _timed = Stopwatch::start(&self.call_duration);
                (plugin_hash, self.call(instance, events).await)
            }
            Err(StartError::Unusable(why)) => (None, Err(DeliverError::NoTransport(why))),
            Err(StartError::HostShort(why)) => {
                tracing::warn!(plugin = %self.route.plugin, route = %self.route.name, "{why}; its events wait a moment");
                (None, Err(DeliverError::HostShort(why)))
            }
            Err(StartError::Fault(fault)) => {
                tracing::warn!(plugin = %self.route.plugin, route = %self.route.name, "{fault}; retried later");
                (None, Err(fault.into()))
            }
        };
        if let Err(DeliverError::Fault(fault)) = &result {
            let kind = match fault {
                PluginFault::Trapped(_) => "trap",
                PluginFault::TimedOut(_) => "timeout",
                PluginFault::OutOfMemory(_) => "out_of_memory",
                PluginFault::WrongOutcomeCount { .. } => "wrong_outcome_count",
                PluginFault::NotInstantiated(_) => "not_instantiated",
            };
            let labels = FaultLabels { plugin: self.route.plugin.as_str().into(), kind: kind.into() };
            self.registry.metrics.plugin_faults.get_or_create(&labels).inc();
        }
        Delivery { plugin_hash, result }
    }

    /// The longest a call may take: its timeout, and the moment the host may take to notice.
    fn longest_call(&self) -> std::time::Duration {
        self.limits.timeout + EPOCH_TICK * 5
    }

    /// Keeps `instance` for a later call.
    fn keep(&self, instance: Instance) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        // Instances made with many configs (a route's endpoints) keep the latest few.
        if idle.len() >= self.limits.instances {
            idle.remove(0);
        }
        idle.push(instance);
    }

    async fn call(&self, mut instance: Instance, events: &[&ClaimedEvent]) -> Result<Vec<Outcome>, DeliverError> {
        set_deadline(&mut instance.store, self.limits.timeout);
        let call = instance.bindings.deliver(&mut instance.store, events);
        // The epoch deadline stops wasm code; this timeout also covers a call parked in the host.
        let result = tokio::time::timeout(self.longest_call(), call).await;
        let fault = match result {
            Ok(Ok(outcomes)) if outcomes.len() == events.len() => {
                instance.calls += 1;
                if let Some((held, most)) = instance.store.data_mut().hoarding() {
                    tracing::info!(plugin = %self.route.plugin, route = %self.route.name, "instance replaced: it holds {held} of the {most} host objects it may");
                } else if instance.calls < self.limits.max_calls {
                    self.keep(instance);
                }
                return Ok(outcomes);
            }
            Ok(Ok(outcomes)) => PluginFault::WrongOutcomeCount { expected: events.len(), got: outcomes.len() },
            Ok(Err(_)) if instance.store.data().limiter.hit => PluginFault::OutOfMemory(self.limits.memory),
            Ok(Err(trap)) if trap.downcast_ref::<wasmtime::Trap>() == Some(&wasmtime::Trap::Interrupt) => {
                PluginFault::TimedOut(self.limits.timeout)
            }
            Ok(Err(trap)) => PluginFault::Trapped(root_cause(&trap)),
            Err(_elapsed) => PluginFault::TimedOut(self.limits.timeout),
        };
        // The instance's state is unknown after a fault: it is dropped, the next call starts afresh.
        tracing::warn!(plugin = %self.route.plugin, route = %self.route.name, "{fault}; instance discarded");
        Err(fault.into())
    }
}

/// One of the calls a config may make at once, held or waited for; the config's entry goes when
/// the last of its calls does.
struct ConfigSlot<'a> {
    transport: &'a RouteTransport,
    config: PluginConfig,
    /// Released with the slot (dropped after `drop` below has counted it out).
    _permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Drop for ConfigSlot<'_> {
    fn drop(&mut self) {
        let mut per_config = self.transport.per_config.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = per_config.get_mut(&self.config) {
            entry.1 = entry.1.saturating_sub(1);
            if entry.1 == 0 {
                per_config.remove(&self.config);
            }
        }
    }
}

/// When the relay lets a delivery's call begin.
#[derive(Debug, Clone, Copy)]
pub struct Window<'a> {
    /// Shutdown's: past it, nothing begins.
    pub cutoff: &'a Cutoff,
    /// When the claim on the events ends. A call that could run past it (it waited for an
    /// instance nearly that long) is not begun: [`DeliverError::LeaseShort`].
    pub lease_ends: std::time::Instant,
}

/// A moment, fixed once, from which no plugin instance is started and no call begins: the end of
/// shutdown's grace period, shared by the relay's workers. Checked right before each start and
/// each call, where nothing else decides whether they begin: a delivery may be polled a moment
/// past the end (timers fire on the next millisecond, and a poll that runs a plugin's code does
/// not look at the clock until it returns).
#[derive(Debug, Default)]
pub struct Cutoff(std::sync::OnceLock<tokio::time::Instant>);

impl Cutoff {
    /// The cutoff: `after` from now, unless it was fixed before. Only the relay fixes one, where
    /// a timer for it drops the deliveries held at it.
    pub(crate) fn fix(&self, after: std::time::Duration) -> tokio::time::Instant {
        *self.0.get_or_init(|| tokio::time::Instant::now() + after)
    }

    /// Whether `cutoff` is fixed and has passed. A start or call that finds it so does not begin
    /// and never returns: the relay drops it once it has given its events back.
    fn passed(cutoff: Option<&Cutoff>) -> bool {
        cutoff.and_then(|c| c.0.get()).is_some_and(|end| tokio::time::Instant::now() >= *end)
    }
}

/// Observes the time from its start to its drop in a histogram, so a wait, start or call whose
/// future is dropped (when shutdown's grace period ends) is still recorded, with the time it took.
struct Stopwatch<'a> {
    /// `None` once discarded.
    histogram: Option<&'a Histogram>,
    started: std::time::Instant,
}

impl<'a> Stopwatch<'a> {
    fn start(histogram: &'a Histogram) -> Self {
        Self { histogram: Some(histogram), started: std::time::Instant::now() }
    }

    /// Stops without observing anything.
    fn discard(mut self) {
        self.histogram = None;
    }
}

impl Drop for Stopwatch<'_> {
    fn drop(&mut self) {
        if let Some(histogram) = self.histogram {
            histogram.observe(self.started.elapsed().as_secs_f64());
        }
    }
}

/// What a plugin call came to.
#[derive(Debug)]
pub struct Delivery {
    /// The SHA-256 of the plugin version that was called; `None` when none could be.
    pub plugin_hash: Option<String>,
    pub result: Result<Vec<Outcome>, DeliverError>,
}

/// One transport per configured route.
pub fn route_transports(registry: &Arc<Registry>, settings: &Settings) -> HashMap<String, Arc<RouteTransport>> {
    settings
        .routes
        .iter()
        .map(|(name, route)| (name.clone(), Arc::new(RouteTransport::new(registry.clone(), route.clone()))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cutoff_passes_only_once_fixed_and_reached() {
        let cutoff = Cutoff::default();
        assert!(!Cutoff::passed(None), "no cutoff: deliveries outside the relay");
        assert!(!Cutoff::passed(Some(&cutoff)), "not fixed: the relay has not stopped");
        let later = Cutoff::default();
        let end = later.fix(std::time::Duration::from_secs(3600));
        assert_eq!(later.fix(std::time::Duration::ZERO), end, "fixed once, by the first");
        assert!(!Cutoff::passed(Some(&later)), "fixed but not reached");
        cutoff.fix(std::time::Duration::ZERO);
        assert!(Cutoff::passed(Some(&cutoff)), "reached");
    }
}
