//! The plugin runtime: one wasmtime [`Engine`], a [`Registry`] of the transport components found in
//! the plugins directory (compiled once, pre-instantiated, swappable at run time), and per route a
//! [`RouteTransport`] with a small pool of sandboxed instances.
//!
//! A plugin call can trap, loop, exhaust its memory or overrun its time; every such fault comes
//! back as a [`PluginFault`] for the relay to record, the broken instance is discarded, and the
//! next call gets a fresh one. Nothing a plugin does can stop the host.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{
    Cache, CacheConfig, Config as EngineConfig, Engine, InstanceAllocationStrategy, PoolingAllocationConfig,
    ResourceLimiter, Store as WasmStore,
};
use wasmtime_wasi::sockets::SocketAddrUse;
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::{
    Error as HttpError, RequestOptions, WasiBody, WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView,
};

use crate::config::{Config, PluginLimits, SandboxConfig};
use crate::event::ClaimedEvent;
use crate::metrics::{FaultLabels, Metrics, PluginLabels, ReloadLabels};

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

/// The version of the `ferry:transport` WIT package this host implements (`wit/transport.wit`).
pub const WIT_VERSION: &str = "0.1.0";

/// How often the epoch ticker advances; the granularity of plugin timeouts.
const EPOCH_TICK: Duration = Duration::from_millis(10);

/// A plugin call that did not produce one outcome per event. The relay treats it as a transient
/// failure of every event in the call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PluginFault {
    #[error("plugin trapped: {0}")]
    Trapped(String),
    #[error("plugin timed out after {0:?}")]
    TimedOut(Duration),
    #[error("plugin exceeded its {} MiB memory limit", .0 >> 20)]
    OutOfMemory(usize),
    #[error("plugin returned {got} outcomes for {expected} events")]
    WrongOutcomeCount { expected: usize, got: usize },
}

/// Why a call could not be made or did not work.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DeliverError {
    /// The plugin misbehaved; retry later.
    #[error(transparent)]
    Fault(#[from] PluginFault),
    /// There is no usable plugin for the route (not loaded, or it rejects the route's config).
    #[error("{0}")]
    NoTransport(String),
}

/// Memory accounting for one instance: enforces the cap and remembers that it was hit, so a
/// resulting trap can be reported as what it is.
struct Limiter {
    max_memory: usize,
    hit: bool,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.max_memory {
            self.hit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _maximum: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 1_000_000)
    }
}

/// What each instance's store carries: WASI and wasi:http state, the memory limiter, and the
/// plugin's name for log lines.
pub struct HostState {
    wasi: WasiCtx,
    http: WasiHttpCtx,
    http_policy: HttpPolicy,
    table: ResourceTable,
    limiter: Limiter,
    plugin: Arc<str>,
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl WasiHttpView for HostState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView { ctx: &mut self.http, table: &mut self.table, hooks: &mut self.http_policy }
    }
}

/// Outgoing wasi:http requests go only to the plugin's allowed origins; the `Host` header is set
/// from the request's authority.
struct HttpPolicy {
    plugin: Arc<str>,
    origins: Arc<HashSet<String>>,
}

impl WasiHttpHooks for HttpPolicy {
    fn send_request(
        &mut self,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
        fut: Box<dyn Future<Output = Result<(), HttpError>> + Send>,
    ) -> Box<
        dyn Future<
                Output = Result<
                    (http::Response<WasiBody>, Box<dyn Future<Output = Result<(), HttpError>> + Send>),
                    HttpError,
                >,
            > + Send,
    > {
        let _ = fut;
        let uri = request.uri();
        let origin =
            format!("{}://{}", uri.scheme_str().unwrap_or("https"), uri.authority().map_or("", |a| a.as_str()));
        let allowed = crate::config::normalize_origin(&origin).is_ok_and(|o| self.origins.contains(&o));
        if !allowed {
            tracing::warn!(plugin = %self.plugin, %origin, "plugin denied an HTTP request to an origin not on its http allowlist");
            return Box::new(async { Err(HttpError::HttpRequestDenied) });
        }
        Box::new(async move {
            use http_body_util::BodyExt;
            let (response, io) = wasmtime_wasi_http::default_send_request(request, options).await?;
            Ok((response.map(BodyExt::boxed_unsync), Box::new(io) as Box<dyn Future<Output = _> + Send>))
        })
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
    /// Whether instances come from the pooling allocator (false: allocated on demand).
    pub pooling: bool,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime").field("pooling", &self.pooling).finish_non_exhaustive()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}

impl Runtime {
    /// Creates the engine (component model, epoch interruption, the pooling allocator when the
    /// pool can be reserved, the compiled-code cache when configured) and links WASI and ferry's
    /// host imports.
    pub fn new(config: &Config) -> anyhow::Result<Self> {
        let largest_memory = config
            .sandbox
            .keys()
            .map(|name| config.plugin_limits(name).memory)
            .chain([config.plugins.memory.0])
            .max()
            .unwrap_or(config.plugins.memory.0);
        let mut engine_config = EngineConfig::new();
        engine_config.wasm_component_model(true).epoch_interruption(true);
        if !config.plugins.cache_dir.as_os_str().is_empty() {
            // wasmtime wants an absolute directory; a relative one is relative to where ferry runs.
            let dir =
                std::path::absolute(&config.plugins.cache_dir).unwrap_or_else(|_| config.plugins.cache_dir.clone());
            let mut cache = CacheConfig::new();
            cache.with_directory(&dir);
            match Cache::new(cache) {
                Ok(cache) => {
                    engine_config.cache(Some(cache));
                }
                Err(e) => tracing::warn!(dir = %dir.display(), "compiled-code cache disabled: {e:#}"),
            }
        }
        let mut pooled = engine_config.clone();
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(256)
            .total_core_instances(2048)
            .total_memories(512)
            .total_tables(512)
            .total_stacks(256)
            .max_memory_size(largest_memory);
        // Reserve only what a plugin may use, so the pool's address space stays modest.
        pooled.allocation_strategy(InstanceAllocationStrategy::Pooling(pool)).memory_reservation(largest_memory as u64);
        let (engine, pooling) = match Engine::new(&pooled) {
            Ok(engine) => (engine, true),
            Err(e) => {
                tracing::warn!("pooling allocator unavailable, allocating instances on demand: {e}");
                let engine =
                    Engine::new(&engine_config).map_err(anyhow::Error::from).context("creating the wasm engine")?;
                (engine, false)
            }
        };
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(anyhow::Error::from)?;
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker).map_err(anyhow::Error::from)?;
        log_denied_file_access(&mut linker)?;
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
        Ok(Self { engine, linker, ticker_stop, pooling })
    }

    /// Compiles and pre-instantiates one component, then asks it for its metadata. Compilation
    /// runs on a blocking thread so it never stalls the async runtime. Errors say in plain words
    /// what is wrong with the file.
    pub async fn load(&self, path: &Path) -> anyhow::Result<Plugin> {
        let bytes = tokio::fs::read(path).await.with_context(|| format!("reading plugin {}", path.display()))?;
        let hash = hex::encode(Sha256::digest(&bytes));
        let engine = self.engine.clone();
        let component = tokio::task::spawn_blocking(move || Component::new(&engine, &bytes))
            .await?
            .map_err(|e| anyhow::anyhow!("{} is not a valid wasm component: {}", path.display(), root_cause(&e)))?;
        let exports = component.component_type();
        check_wit_version(exports.exports(&self.engine).map(|(name, _)| name))
            .map_err(|e| anyhow::anyhow!("{} {e}", path.display()))?;
        let pre = self.linker.instantiate_pre(&component).map_err(|e| {
            anyhow::anyhow!("{} needs imports ferry does not provide: {}", path.display(), root_cause(&e))
        })?;
        let pre = TransportPluginPre::new(pre).map_err(|e| {
            anyhow::anyhow!(
                "{} does not export the ferry:transport world (wit/transport.wit): {}",
                path.display(),
                root_cause(&e)
            )
        })?;
        let label: Arc<str> = Arc::from(path.file_name().and_then(|n| n.to_str()).unwrap_or("plugin"));
        let probe_limits =
            PluginLimits { timeout: Duration::from_secs(10), memory: 256 << 20, instances: 1, max_calls: 1 };
        let mut store = self.store(label, &SandboxConfig::default(), &probe_limits, &[])?;
        let instance = pre
            .instantiate_async(&mut store)
            .await
            .map_err(|e| anyhow::anyhow!("{} cannot be instantiated: {}", path.display(), root_cause(&e)))?;
        let info = instance
            .ferry_transport_transport()
            .call_metadata(&mut store)
            .await
            .map_err(|e| anyhow::anyhow!("metadata() of {} failed: {}", path.display(), root_cause(&e)))?;
        if info.name.is_empty() || !info.name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        {
            anyhow::bail!(
                "{} reports the plugin name {:?}; names use lowercase letters, digits and '-'",
                path.display(),
                info.name
            );
        }
        Ok(Plugin { info, path: path.to_path_buf(), hash, loaded_at: Utc::now(), pre })
    }

    /// A store for one instance of `plugin`, with its sandbox and limits.
    fn store(
        &self,
        plugin: Arc<str>,
        sandbox: &SandboxConfig,
        limits: &PluginLimits,
        tcp: &[SocketAddr],
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
        wasi.allow_ip_name_lookup(sandbox.dns);
        // Every socket use goes through this check, even with an empty allowlist, so that each
        // refusal is logged with the plugin's name.
        let allowed: Arc<HashSet<SocketAddr>> = Arc::new(tcp.iter().copied().collect());
        let name = plugin.clone();
        wasi.allow_tcp(true).socket_addr_check(move |addr, use_| {
            let ok = match use_ {
                // Connecting binds the socket to an ephemeral local port first.
                SocketAddrUse::TcpBind => addr.port() == 0,
                SocketAddrUse::TcpConnect => allowed.contains(&addr),
                _ => false,
            };
            if !ok {
                tracing::warn!(plugin = %name, %addr, usage = ?use_, "plugin denied network access to an address not on its tcp allowlist");
            }
            Box::pin(async move { ok })
        });
        let origins = sandbox.http.iter().filter_map(|o| crate::config::normalize_origin(o).ok()).collect();
        let state = HostState {
            wasi: wasi.build(),
            http: WasiHttpCtx::new(),
            http_policy: HttpPolicy { plugin: plugin.clone(), origins: Arc::new(origins) },
            table: ResourceTable::new(),
            limiter: Limiter { max_memory: limits.memory, hit: false },
            plugin,
        };
        let mut store = WasmStore::new(&self.engine, state);
        store.limiter(|state| &mut state.limiter);
        store.set_epoch_deadline(ticks(limits.timeout));
        store.epoch_deadline_trap();
        Ok(store)
    }
}

/// Refuses a component whose `ferry:transport/transport` export is of a semver-incompatible
/// version (another major version; for 0.x, another minor). A component without that export is
/// left to the world check, which says so.
pub fn check_wit_version<'a>(exports: impl IntoIterator<Item = &'a str>) -> Result<(), String> {
    let Some(theirs) = exports.into_iter().find_map(|name| name.strip_prefix("ferry:transport/transport@")) else {
        return Ok(());
    };
    let series = |version: &str| -> Option<(u64, u64)> {
        let mut parts = version.split(['.', '-', '+']);
        let major = parts.next()?.parse().ok()?;
        let minor = parts.next()?.parse().ok()?;
        // Semver: below 1.0 every minor release may break, above it every major one.
        Some(if major == 0 { (0, minor) } else { (major, 0) })
    };
    match (series(theirs), series(WIT_VERSION)) {
        (Some(a), Some(b)) if a == b => Ok(()),
        _ => Err(format!(
            "is built for ferry:transport@{theirs}, but this ferry implements ferry:transport@{WIT_VERSION}, \
             an incompatible version; rebuild the plugin against this ferry's wit/ directory"
        )),
    }
}

/// The WASI version of `wasi:filesystem` that wasmtime-wasi links.
const WASI_FILESYSTEM_TYPES: &str = "wasi:filesystem/types@0.2.12";

/// Replaces `descriptor.open-at` with a wrapper that calls wasmtime-wasi's own implementation and,
/// when it refuses a path (one that climbs out of a granted directory), leaves a warning naming
/// the plugin and the path. Paths outside every granted directory never reach the host: the
/// guest's libc finds no directory to resolve them against and fails on its own.
fn log_denied_file_access(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    use wasmtime::component::Resource;
    use wasmtime_wasi::filesystem::WasiFilesystemView;
    use wasmtime_wasi::p2::bindings::filesystem::types::{
        Descriptor, DescriptorFlags, ErrorCode, Host as _, HostDescriptor as _, OpenFlags, PathFlags,
    };
    type Args = (Resource<Descriptor>, PathFlags, String, OpenFlags, DescriptorFlags);
    linker.allow_shadowing(true);
    let mut types = linker.instance(WASI_FILESYSTEM_TYPES).map_err(anyhow::Error::from)?;
    types
        .func_wrap_async("[method]descriptor.open-at", |mut store, (fd, path_flags, path, oflags, flags): Args| {
            Box::new(async move {
                let state = store.data_mut();
                let plugin = state.plugin.clone();
                let mut fs = state.filesystem();
                let opened = fs.open_at(fd, path_flags, path.clone(), oflags, flags).await;
                let result: Result<Resource<Descriptor>, ErrorCode> = match opened {
                    Ok(fd) => Ok(fd),
                    Err(e) => Err(fs.convert_error_code(e)?),
                };
                if let Err(ErrorCode::NotPermitted | ErrorCode::Access) = &result {
                    tracing::warn!(plugin = %plugin, path = %path, "plugin denied access to a path outside its directories");
                }
                Ok((result,))
            })
        })
        .map_err(anyhow::Error::from)?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Epoch ticks covering `timeout`, at least one.
fn ticks(timeout: Duration) -> u64 {
    (timeout.as_millis() / EPOCH_TICK.as_millis()).max(1) as u64 + 1
}

/// The innermost error message: the readable part of wasmtime's error chains.
fn root_cause(error: &wasmtime::Error) -> String {
    let text = format!("{error:#}");
    text.lines().next().unwrap_or_default().to_string()
}

/// A compiled, pre-instantiated transport component.
pub struct Plugin {
    pub info: PluginInfo,
    pub path: PathBuf,
    /// SHA-256 of the file: identifies the loaded version.
    pub hash: String,
    pub loaded_at: DateTime<Utc>,
    pre: TransportPluginPre<HostState>,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("info", &self.info)
            .field("path", &self.path)
            .field("hash", &self.hash)
            .finish_non_exhaustive()
    }
}

/// What `ferry plugins list` and the logs show about one plugin.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PluginStatus {
    pub name: String,
    pub version: String,
    pub file: PathBuf,
    pub hash: String,
    pub loaded_at: DateTime<Utc>,
    pub routes: Vec<String>,
    /// The last failed attempt to (re)load this plugin's file, if the active version is older.
    pub last_error: Option<String>,
}

/// How a reload ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reloaded {
    /// A new version of plugin `name` is active.
    Loaded { name: String, hash: String },
    /// The file's content is what is already active.
    Unchanged { name: String },
    /// The file is gone; plugin `name` was removed.
    Removed { name: String },
    /// The file was neither loaded before nor now (e.g. deleted before it was ever valid).
    Ignored,
}

/// The plugins currently active, by name, and which file each came from. Swapping a plugin is
/// atomic: calls already running keep the instance (and version) they started with.
pub struct Registry {
    runtime: Arc<Runtime>,
    config: Arc<Config>,
    metrics: Arc<Metrics>,
    plugins: RwLock<BTreeMap<String, Arc<Plugin>>>,
    /// Load errors by file, kept until that file loads successfully.
    errors: Mutex<BTreeMap<PathBuf, String>>,
    /// Serialises reloads so two events for one file cannot interleave their swaps.
    reloading: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("plugins", &self.names()).finish_non_exhaustive()
    }
}

impl Registry {
    /// An empty registry; call [`Registry::load_dir`] to fill it.
    pub fn new(runtime: Arc<Runtime>, config: Arc<Config>, metrics: Arc<Metrics>) -> Self {
        Self {
            runtime,
            config,
            metrics,
            plugins: RwLock::new(BTreeMap::new()),
            errors: Mutex::new(BTreeMap::new()),
            reloading: tokio::sync::Mutex::new(()),
        }
    }

    /// The runtime the plugins live in.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    /// Where plugin calls and reloads are counted.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The directory plugins are loaded from.
    pub fn dir(&self) -> &Path {
        &self.config.plugins.dir
    }

    /// Loads every `*.wasm` file directly in the plugins directory. A file that fails to load is
    /// logged and skipped; the others still load.
    pub async fn load_dir(&self) -> anyhow::Result<()> {
        for (path, result) in self.reload_all().await? {
            if let Err(e) = result {
                tracing::error!(file = %path.display(), "plugin not loaded: {e:#}");
            }
        }
        Ok(())
    }

    /// Reloads every plugin file in the directory, and drops plugins whose file is gone: what the
    /// watcher does file by file, all at once. Returns each file's result.
    pub async fn reload_all(&self) -> anyhow::Result<Vec<(PathBuf, anyhow::Result<Reloaded>)>> {
        let mut files = wasm_files(&self.config.plugins.dir)?;
        let loaded: Vec<PathBuf> =
            self.plugins.read().unwrap_or_else(|e| e.into_inner()).values().map(|p| p.path.clone()).collect();
        files.extend(loaded.into_iter().filter(|path| !path.exists()));
        let mut results = Vec::with_capacity(files.len());
        for path in files {
            let result = self.reload(&path).await;
            results.push((path, result));
        }
        Ok(results)
    }

    /// The active version of plugin `name`.
    pub fn get(&self, name: &str) -> Option<Arc<Plugin>> {
        self.plugins.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    /// Names of the active plugins.
    pub fn names(&self) -> Vec<String> {
        self.plugins.read().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect()
    }

    /// Status of every active plugin, and of files that failed to load.
    pub fn status(&self) -> (Vec<PluginStatus>, BTreeMap<PathBuf, String>) {
        let plugins = self.plugins.read().unwrap_or_else(|e| e.into_inner());
        let errors = self.errors.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let list = plugins
            .values()
            .map(|p| PluginStatus {
                name: p.info.name.clone(),
                version: p.info.version.clone(),
                file: p.path.clone(),
                hash: p.hash.clone(),
                loaded_at: p.loaded_at,
                routes: self.routes_of(&p.info.name),
                last_error: errors.get(&p.path).cloned(),
            })
            .collect();
        (list, errors)
    }

    fn routes_of(&self, plugin: &str) -> Vec<String> {
        self.config.route.iter().filter(|(_, r)| r.plugin == plugin).map(|(name, _)| name.clone()).collect()
    }

    /// (Re)loads the plugin file at `path`: compiles it, checks that it exports our world and that
    /// `init` accepts the config of every route the active version serves, and only then makes it
    /// the active version. A missing file removes the plugin it provided. On error the previous version stays
    /// active and the error is kept for [`Registry::status`].
    pub async fn reload(&self, path: &Path) -> anyhow::Result<Reloaded> {
        let _one_at_a_time = self.reloading.lock().await;
        let result = self.reload_locked(path).await;
        let counted = match &result {
            Ok(Reloaded::Loaded { name, .. }) => Some((name.clone(), "loaded")),
            Ok(Reloaded::Removed { name }) => Some((name.clone(), "removed")),
            Ok(Reloaded::Unchanged { .. } | Reloaded::Ignored) => None,
            Err(_) => Some((path.file_stem().unwrap_or_default().to_string_lossy().into_owned(), "failed")),
        };
        if let Some((plugin, result)) = counted {
            self.metrics.plugin_reloads.get_or_create(&ReloadLabels { plugin, result: result.to_string() }).inc();
        }
        let mut errors = self.errors.lock().unwrap_or_else(|e| e.into_inner());
        match &result {
            Ok(_) => {
                errors.remove(path);
            }
            Err(e) => {
                errors.insert(path.to_path_buf(), format!("{e:#}"));
            }
        }
        result
    }

    async fn reload_locked(&self, path: &Path) -> anyhow::Result<Reloaded> {
        if !path.exists() {
            let mut plugins = self.plugins.write().unwrap_or_else(|e| e.into_inner());
            let Some(name) = plugins.iter().find(|(_, p)| p.path == path).map(|(n, _)| n.clone()) else {
                return Ok(Reloaded::Ignored);
            };
            plugins.remove(&name);
            tracing::warn!(plugin = %name, file = %path.display(), "plugin file deleted; plugin removed");
            return Ok(Reloaded::Removed { name });
        }
        let plugin = self.runtime.load(path).await?;
        let name = plugin.info.name.clone();
        if let Some(active) = self.get(&name) {
            if active.path != plugin.path && active.path.exists() {
                anyhow::bail!(
                    "{} and {} both call themselves {name:?}; keeping the one already loaded",
                    active.path.display(),
                    path.display()
                );
            }
            if active.hash == plugin.hash {
                return Ok(Reloaded::Unchanged { name });
            }
        }
        let plugin = Arc::new(plugin);
        let active = self.get(&name);
        let limits = self.config.plugin_limits(&name);
        for route in self.routes_of(&name) {
            let Err(e) = Instance::start(&self.runtime, &plugin, &self.config, &route, &limits).await else { continue };
            // A new version must not break a route the active version serves. A route that no
            // version can serve (its config is rejected by both) does not hold the others back;
            // its events fail with `no_transport` until it is fixed.
            let served_now = match &active {
                Some(active) => Instance::start(&self.runtime, active, &self.config, &route, &limits).await.is_ok(),
                None => false,
            };
            if served_now {
                anyhow::bail!("route {route:?} cannot use {}: {e}", path.display());
            }
            tracing::error!(plugin = %name, route = %route, "route cannot use the plugin: {e}");
        }
        let hash = plugin.hash.clone();
        tracing::info!(plugin = %name, version = %plugin.info.version, hash = %&hash[..12], file = %path.display(), "plugin loaded");
        self.plugins.write().unwrap_or_else(|e| e.into_inner()).insert(name.clone(), plugin);
        Ok(Reloaded::Loaded { name, hash })
    }
}

/// The `*.wasm` files directly in `dir`, sorted.
pub fn wasm_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading plugins directory {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| is_plugin_file(p) && p.is_file())
        .collect();
    files.sort();
    Ok(files)
}

/// Whether `path` names a plugin file (`*.wasm`).
pub fn is_plugin_file(path: &Path) -> bool {
    path.extension().is_some_and(|ext| ext == "wasm")
}

/// A live instance of a plugin version, configured for one route.
struct Instance {
    store: WasmStore<HostState>,
    bindings: TransportPlugin,
    /// The version it was made from; an instance of a replaced version is not reused.
    hash: String,
    calls: u64,
}

impl Instance {
    /// Instantiates `plugin` for `route` and runs its `init` with the route's config.
    async fn start(
        runtime: &Runtime,
        plugin: &Plugin,
        config: &Config,
        route: &str,
        limits: &PluginLimits,
    ) -> Result<Instance, String> {
        let name: Arc<str> = Arc::from(plugin.info.name.as_str());
        let sandbox = config.sandbox_of(&plugin.info.name);
        let tcp = resolve_allowlist(&plugin.info.name, &sandbox.tcp);
        let mut store = runtime.store(name, &sandbox, limits, &tcp).map_err(|e| format!("{e:#}"))?;
        let bindings = plugin
            .pre
            .instantiate_async(&mut store)
            .await
            .map_err(|e| format!("plugin {} cannot be instantiated: {}", plugin.info.name, root_cause(&e)))?;
        let route_config: Vec<(String, String)> = config
            .route
            .get(route)
            .map(|r| r.config.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect())
            .unwrap_or_default();
        match bindings.ferry_transport_transport().call_init(&mut store, &route_config).await {
            Ok(Ok(())) => Ok(Instance { store, bindings, hash: plugin.hash.clone(), calls: 0 }),
            Ok(Err(message)) => {
                Err(format!("plugin {} rejected the config of route {route}: {message}", plugin.info.name))
            }
            Err(trap) => Err(format!("plugin {} trapped in init: {}", plugin.info.name, root_cause(&trap))),
        }
    }
}

/// Resolves `host:port` allowlist entries to addresses. An entry that does not resolve is logged
/// and grants nothing.
fn resolve_allowlist(plugin: &str, entries: &[String]) -> Vec<SocketAddr> {
    entries
        .iter()
        .flat_map(|entry| match entry.to_socket_addrs() {
            Ok(addrs) => addrs.collect::<Vec<_>>(),
            Err(e) => {
                tracing::warn!(plugin, entry = %entry, "tcp allowlist entry does not resolve: {e}");
                Vec::new()
            }
        })
        .collect()
}

/// The transport of one route: a pool of instances of the route's plugin, made on demand (up to
/// the plugin's `instances` limit), reused across calls so a transport can keep connections
/// open, and replaced after a fault, after `max_calls` calls, or when the plugin is reloaded.
pub struct RouteTransport {
    route: String,
    plugin: String,
    registry: Arc<Registry>,
    limits: PluginLimits,
    slots: tokio::sync::Semaphore,
    idle: Mutex<Vec<Instance>>,
}

impl std::fmt::Debug for RouteTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteTransport").field("route", &self.route).field("plugin", &self.plugin).finish()
    }
}

impl RouteTransport {
    /// The transport of `route`, served by `plugin` from `registry` (it need not be loaded yet).
    pub fn new(registry: Arc<Registry>, route: &str, plugin: &str) -> Self {
        let limits = registry.config.plugin_limits(plugin);
        Self {
            route: route.to_string(),
            plugin: plugin.to_string(),
            slots: tokio::sync::Semaphore::new(limits.instances),
            limits,
            registry,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// The plugin's name.
    pub fn plugin_name(&self) -> &str {
        &self.plugin
    }

    /// Makes sure an instance can be started for this route now: the plugin is loaded and
    /// accepts the route's config. Keeps the instance for the first delivery.
    pub async fn warm_up(&self) -> Result<(), String> {
        let instance = self.instance().await?;
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(instance);
        Ok(())
    }

    /// An idle instance of the active version, or a new one.
    async fn instance(&self) -> Result<Instance, String> {
        let Some(plugin) = self.registry.get(&self.plugin) else {
            let loaded = self.registry.names();
            return Err(format!(
                "plugin {:?} of route {:?} is not loaded (loaded: {})",
                self.plugin,
                self.route,
                if loaded.is_empty() { "none".to_string() } else { loaded.join(", ") }
            ));
        };
        let reusable = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            // Instances of a replaced version are dropped here.
            idle.retain(|i| i.hash == plugin.hash);
            idle.pop()
        };
        match reusable {
            Some(instance) => Ok(instance),
            None => {
                Instance::start(&self.registry.runtime, &plugin, &self.registry.config, &self.route, &self.limits).await
            }
        }
    }

    /// Hands `events` to the plugin: one outcome per event, in order, and which version answered.
    pub async fn deliver(&self, events: &[&ClaimedEvent]) -> Delivery {
        let _slot = self.slots.acquire().await.expect("the semaphore is never closed");
        let instance = match self.instance().await {
            Ok(instance) => instance,
            Err(why) => return Delivery { plugin_hash: None, result: Err(DeliverError::NoTransport(why)) },
        };
        let plugin_hash = Some(instance.hash.clone());
        let started = std::time::Instant::now();
        let result = self.call(instance, events).await;
        let labels = PluginLabels { plugin: self.plugin.clone() };
        self.registry.metrics.plugin_call_duration.get_or_create(&labels).observe(started.elapsed().as_secs_f64());
        if let Err(DeliverError::Fault(fault)) = &result {
            let kind = match fault {
                PluginFault::Trapped(_) => "trap",
                PluginFault::TimedOut(_) => "timeout",
                PluginFault::OutOfMemory(_) => "out_of_memory",
                PluginFault::WrongOutcomeCount { .. } => "wrong_outcome_count",
            };
            let labels = FaultLabels { plugin: self.plugin.clone(), kind: kind.to_string() };
            self.registry.metrics.plugin_faults.get_or_create(&labels).inc();
        }
        Delivery { plugin_hash, result }
    }

    async fn call(&self, mut instance: Instance, events: &[&ClaimedEvent]) -> Result<Vec<Outcome>, DeliverError> {
        let wit_events: Vec<types::Event> = events.iter().map(|e| to_wit(e)).collect();
        instance.store.set_epoch_deadline(ticks(self.limits.timeout));
        let call = instance.bindings.ferry_transport_transport().call_deliver_batch(&mut instance.store, &wit_events);
        // The epoch deadline stops wasm code; this timeout also covers a call parked in the host.
        let result = tokio::time::timeout(self.limits.timeout + EPOCH_TICK * 5, call).await;
        let fault = match result {
            Ok(Ok(outcomes)) if outcomes.len() == events.len() => {
                instance.calls += 1;
                if instance.calls < self.limits.max_calls {
                    self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(instance);
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
        tracing::warn!(plugin = %self.plugin, route = %self.route, "{fault}; instance discarded");
        Err(fault.into())
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
pub fn route_transports(registry: &Arc<Registry>, config: &Config) -> HashMap<String, Arc<RouteTransport>> {
    config
        .route
        .iter()
        .map(|(route, r)| (route.clone(), Arc::new(RouteTransport::new(registry.clone(), route, &r.plugin))))
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wit_versions_are_checked_by_semver() {
        let ok = |v: &str| check_wit_version([format!("ferry:transport/transport@{v}").as_str()]);
        assert!(ok("0.1.0").is_ok());
        assert!(ok("0.1.7").is_ok(), "a compatible patch release");
        let err = ok("0.2.0").unwrap_err();
        assert!(
            err.contains("ferry:transport@0.2.0") && err.contains(&format!("ferry:transport@{WIT_VERSION}")),
            "{err}"
        );
        assert!(ok("1.0.0").is_err());
        assert!(ok("garbage").is_err());
        assert!(check_wit_version(["wasi:cli/run@0.2.0"]).is_ok(), "no transport export: left to the world check");
    }
}
