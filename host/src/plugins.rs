//! The plugin runtime: one wasmtime [`Engine`], the transport components found in the plugins
//! directory (compiled and pre-instantiated once), and one sandboxed instance per route.
//!
//! A plugin call can trap, loop or overrun its time; every such fault comes back as a
//! [`PluginFault`] for the relay to record, the broken instance is discarded, and the next call
//! gets a fresh one. Nothing a plugin does can stop the host.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Config as EngineConfig, Engine, Store as WasmStore, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::config::{Config, SandboxConfig};
use crate::event::ClaimedEvent;

mod bindings {
    //! Host-side bindings for the `ferry:transport` world in `wit/`.
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "transport-plugin",
        exports: { default: async },
    });
}

pub use bindings::exports::ferry::transport::transport::{Outcome, PluginInfo};
pub use bindings::ferry::transport::types::Failure;
use bindings::ferry::transport::{logging, types};
use bindings::{TransportPlugin, TransportPluginPre};

/// How often the epoch ticker advances; the granularity of plugin timeouts.
const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Memory one plugin instance may use.
const DEFAULT_MEMORY_LIMIT: usize = 64 << 20;

/// A plugin call that did not produce one outcome per event.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PluginFault {
    #[error("plugin trapped: {0}")]
    Trapped(String),
    #[error("plugin timed out after {0:?}")]
    TimedOut(Duration),
    #[error("plugin returned {got} outcomes for {expected} events")]
    WrongOutcomeCount { expected: usize, got: usize },
    #[error("plugin could not be started: {0}")]
    Unavailable(String),
}

/// What each instance's store carries: WASI state, the sandbox's limits, and the plugin's name for
/// log lines.
pub struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: StoreLimits,
    plugin: Arc<str>,
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl types::Host for HostState {}

impl logging::Host for HostState {
    fn log(&mut self, level: logging::Level, message: String) {
        let plugin = &*self.plugin;
        match level {
            logging::Level::Trace => tracing::trace!(target: "ferry::plugin", plugin, "{message}"),
            logging::Level::Debug => tracing::debug!(target: "ferry::plugin", plugin, "{message}"),
            logging::Level::Info => tracing::info!(target: "ferry::plugin", plugin, "{message}"),
            logging::Level::Warn => tracing::warn!(target: "ferry::plugin", plugin, "{message}"),
            logging::Level::Error => tracing::error!(target: "ferry::plugin", plugin, "{message}"),
        }
    }
}

/// The engine, its linker, and the ticker that drives epoch interruption.
pub struct Runtime {
    engine: Engine,
    linker: Linker<HostState>,
    ticker_stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").finish_non_exhaustive()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}

impl Runtime {
    /// Creates the engine (component model, epoch interruption) and links WASI and ferry's host
    /// imports.
    pub fn new() -> anyhow::Result<Self> {
        let mut config = EngineConfig::new();
        config.wasm_component_model(true).epoch_interruption(true);
        let engine = Engine::new(&config).map_err(anyhow::Error::from).context("creating the wasm engine")?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(anyhow::Error::from)?;
        TransportPlugin::add_to_linker::<_, HasSelf<_>>(&mut linker, |state| state).map_err(anyhow::Error::from)?;

        let ticker_stop = Arc::new(AtomicBool::new(false));
        let (stop, ticking) = (ticker_stop.clone(), engine.clone());
        std::thread::Builder::new()
            .name("ferry-epoch".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    ticking.increment_epoch();
                }
            })
            .context("starting the epoch ticker")?;
        Ok(Self { engine, linker, ticker_stop })
    }

    /// Compiles and pre-instantiates one component, then asks it for its metadata. Compilation
    /// runs on a blocking thread so it never stalls the async runtime.
    pub async fn load(&self, path: &Path) -> anyhow::Result<Plugin> {
        let bytes = tokio::fs::read(path).await.with_context(|| format!("reading plugin {}", path.display()))?;
        let engine = self.engine.clone();
        let component = tokio::task::spawn_blocking(move || Component::new(&engine, &bytes))
            .await?
            .map_err(anyhow::Error::from)
            .with_context(|| format!("{} is not a valid wasm component", path.display()))?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(anyhow::Error::from)
            .with_context(|| format!("{} needs imports ferry does not provide", path.display()))?;
        let pre = TransportPluginPre::new(pre)
            .map_err(anyhow::Error::from)
            .with_context(|| format!("{} does not export the ferry:transport world", path.display()))?;
        let label: Arc<str> = Arc::from(path.file_name().and_then(|n| n.to_str()).unwrap_or("plugin"));
        let mut store = self.store(label, &SandboxConfig::default(), Duration::from_secs(10))?;
        let instance = pre.instantiate_async(&mut store).await.map_err(anyhow::Error::from)?;
        let info = instance
            .ferry_transport_transport()
            .call_metadata(&mut store)
            .await
            .map_err(anyhow::Error::from)
            .with_context(|| format!("calling metadata() of {}", path.display()))?;
        if info.name.is_empty() {
            anyhow::bail!("{} reports an empty plugin name", path.display());
        }
        Ok(Plugin { info, path: path.to_path_buf(), pre })
    }

    /// Loads every `*.wasm` file directly in `dir`. A file that fails to load is logged and
    /// skipped; the others still load. Two files claiming the same plugin name: the first (by
    /// file name) wins and the other is reported.
    pub async fn load_dir(&self, dir: &Path) -> anyhow::Result<BTreeMap<String, Arc<Plugin>>> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading plugins directory {}", dir.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|ext| ext == "wasm") && p.is_file())
            .collect();
        files.sort();
        let mut plugins = BTreeMap::new();
        for path in files {
            match self.load(&path).await {
                Ok(plugin) => {
                    if let Some(existing) = plugins.get(&plugin.info.name).map(|p: &Arc<Plugin>| p.path.clone()) {
                        tracing::error!(
                            plugin = %plugin.info.name,
                            "{} and {} both call themselves {:?}; using the first",
                            existing.display(),
                            path.display(),
                            plugin.info.name
                        );
                        continue;
                    }
                    tracing::info!(plugin = %plugin.info.name, version = %plugin.info.version, file = %path.display(), "plugin loaded");
                    plugins.insert(plugin.info.name.clone(), Arc::new(plugin));
                }
                Err(e) => tracing::error!(file = %path.display(), "plugin not loaded: {e:#}"),
            }
        }
        Ok(plugins)
    }

    fn store(
        &self,
        plugin: Arc<str>,
        sandbox: &SandboxConfig,
        timeout: Duration,
    ) -> anyhow::Result<WasmStore<HostState>> {
        let mut wasi = WasiCtxBuilder::new();
        if sandbox.stdio {
            wasi.inherit_stdout().inherit_stderr();
        }
        for (name, value) in &sandbox.env {
            wasi.env(name, value);
        }
        for (guest, host) in &sandbox.dirs {
            std::fs::create_dir_all(host)
                .with_context(|| format!("creating {} for plugin {plugin}", host.display()))?;
            wasi.preopened_dir(host, guest, FsPerms::ReadWrite)
                .map_err(anyhow::Error::from)
                .with_context(|| format!("granting {} to plugin {plugin} as {guest}", host.display()))?;
        }
        let limits = StoreLimitsBuilder::new().memory_size(DEFAULT_MEMORY_LIMIT).instances(16).build();
        let state = HostState { wasi: wasi.build(), table: ResourceTable::new(), limits, plugin };
        let mut store = WasmStore::new(&self.engine, state);
        store.limiter(|state| &mut state.limits);
        store.set_epoch_deadline(ticks(timeout));
        store.epoch_deadline_trap();
        Ok(store)
    }
}

/// Epoch ticks covering `timeout`, at least one.
fn ticks(timeout: Duration) -> u64 {
    (timeout.as_millis() / EPOCH_TICK.as_millis()).max(1) as u64 + 1
}

/// A compiled, pre-instantiated transport component.
pub struct Plugin {
    pub info: PluginInfo,
    pub path: PathBuf,
    pre: TransportPluginPre<HostState>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin").field("info", &self.info).field("path", &self.path).finish_non_exhaustive()
    }
}

/// A live instance of a plugin, configured for one route.
struct Instance {
    store: WasmStore<HostState>,
    bindings: TransportPlugin,
}

/// The transport of one route: its plugin, the route's config, and a reusable instance.
pub struct RouteTransport {
    route: String,
    plugin: Arc<Plugin>,
    runtime: Arc<Runtime>,
    config: Vec<(String, String)>,
    sandbox: SandboxConfig,
    timeout: Duration,
    instance: tokio::sync::Mutex<Option<Instance>>,
}

impl std::fmt::Debug for RouteTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteTransport").field("route", &self.route).field("plugin", &self.plugin.info.name).finish()
    }
}

impl RouteTransport {
    /// Instantiates `plugin` for `route` and runs its `init`; an `Err` is the reason the route
    /// cannot be served (bad config, instantiation failure).
    pub async fn start(
        runtime: Arc<Runtime>,
        plugin: Arc<Plugin>,
        route: &str,
        config: &Config,
    ) -> Result<Self, PluginFault> {
        let route_config = &config.route[route];
        let transport = Self {
            route: route.to_string(),
            sandbox: config.sandbox.get(&plugin.info.name).cloned().unwrap_or_default(),
            config: route_config.config.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect(),
            plugin,
            runtime,
            timeout: config.plugins.timeout.0,
            instance: tokio::sync::Mutex::new(None),
        };
        let instance = transport.instantiate().await?;
        *transport.instance.lock().await = Some(instance);
        Ok(transport)
    }

    /// The plugin serving this route.
    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    async fn instantiate(&self) -> Result<Instance, PluginFault> {
        let name: Arc<str> = Arc::from(self.plugin.info.name.as_str());
        let mut store = self
            .runtime
            .store(name, &self.sandbox, self.timeout)
            .map_err(|e| PluginFault::Unavailable(format!("{e:#}")))?;
        let bindings = self
            .plugin
            .pre
            .instantiate_async(&mut store)
            .await
            .map_err(|e| PluginFault::Unavailable(format!("instantiating: {e:#}")))?;
        let init = bindings.ferry_transport_transport().call_init(&mut store, &self.config).await;
        match init {
            Ok(Ok(())) => Ok(Instance { store, bindings }),
            Ok(Err(message)) => Err(PluginFault::Unavailable(format!(
                "plugin {} rejected the config of route {}: {message}",
                self.plugin.info.name, self.route
            ))),
            Err(trap) => Err(PluginFault::Trapped(format!("in init: {}", describe_trap(&trap)))),
        }
    }

    /// Hands `events` to the plugin and returns one outcome per event, in order.
    pub async fn deliver(&self, events: &[ClaimedEvent]) -> Result<Vec<Outcome>, PluginFault> {
        let mut slot = self.instance.lock().await;
        if slot.is_none() {
            *slot = Some(self.instantiate().await?);
        }
        let instance = slot.as_mut().expect("instance present");
        let wit_events: Vec<types::Event> = events.iter().map(to_wit).collect();
        instance.store.set_epoch_deadline(ticks(self.timeout));
        let call = instance.bindings.ferry_transport_transport().call_deliver_batch(&mut instance.store, &wit_events);
        // The epoch deadline stops wasm code; this timeout also covers a call parked in the host.
        let result = tokio::time::timeout(self.timeout + EPOCH_TICK * 5, call).await;
        let fault = match result {
            Ok(Ok(outcomes)) if outcomes.len() == events.len() => return Ok(outcomes),
            Ok(Ok(outcomes)) => PluginFault::WrongOutcomeCount { expected: events.len(), got: outcomes.len() },
            Ok(Err(trap)) if is_timeout(&trap) => PluginFault::TimedOut(self.timeout),
            Ok(Err(trap)) => PluginFault::Trapped(describe_trap(&trap)),
            Err(_elapsed) => PluginFault::TimedOut(self.timeout),
        };
        // The instance's state is unknown after a fault: start afresh next time.
        *slot = None;
        tracing::warn!(plugin = %self.plugin.info.name, route = %self.route, "{fault}; instance discarded");
        Err(fault)
    }
}

fn is_timeout(error: &wasmtime::Error) -> bool {
    error.downcast_ref::<wasmtime::Trap>() == Some(&wasmtime::Trap::Interrupt)
}

fn describe_trap(error: &wasmtime::Error) -> String {
    // The root cause is the readable part ("wasm trap: wasm `unreachable` instruction executed").
    let text = format!("{error:#}");
    text.lines().next().unwrap_or_default().to_string()
}

fn to_wit(event: &ClaimedEvent) -> types::Event {
    types::Event {
        id: u64::try_from(event.id).unwrap_or_default(),
        event_type: event.event_type.clone(),
        route: event.route.clone(),
        ordering_key: event.ordering_key.clone(),
        payload: event.payload.clone(),
        content_type: event.content_type.clone(),
        headers: event.headers.clone(),
        attempt: event.attempt,
        event_time: event.event_time.timestamp_millis(),
    }
}
