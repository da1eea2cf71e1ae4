//! The wasmtime engine every plugin runs in: component model, epoch interruption driven by a
//! ticker thread, the pooling allocator sized from the configured routes and the largest plugin
//! memory cap (with a fallback to on-demand allocation), the on-disk code cache, and two linkers
//! with WASI and ferry's own imports: one with wasi:http, for plugins granted an origin, and one
//! without.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context as _;
use wasmtime::component::Linker;
use wasmtime::{
    Cache, CacheConfig, Config as EngineConfig, Engine, InstanceAllocationStrategy, PoolingAllocationConfig,
};

use super::EPOCH_TICK;
use super::imports::{free_request_options, guard_file_access};
use super::sandbox::{HostState, MAX_CORE_INSTANCES, MAX_MEMORIES, MAX_TABLES};
use crate::config::Settings;

/// Instances the pool holds beyond every route's share: loading a plugin file makes one instance
/// to ask for its metadata, and a reload one per route to check it; one at a time.
const SPARE_INSTANCES: usize = 4;

/// Instances the pool holds beyond the configured routes' for routes a configuration reload
/// adds: as many again as the routes have, and at least this many. The pool reserves address
/// space, not memory, for them.
const RELOAD_ROOM: usize = 16;

/// The routes' instances a pool made for `settings` holds: theirs, and room for a reload.
fn route_slots(settings: &Settings) -> usize {
    let now = settings.route_instances();
    now.saturating_add(now.max(RELOAD_ROOM))
}

/// The engine, its linkers, and the ticker that drives epoch interruption.
pub struct Runtime {
    pub(super) engine: Engine,
    /// WASI, wasi:http and ferry's imports: for plugins with an `http` grant.
    pub(super) linker: Linker<HostState>,
    /// WASI and ferry's imports only; a plugin without an `http` grant gets wasi:http stubs that
    /// trap (see `imports::deny_http`).
    pub(super) linker_without_http: Linker<HostState>,
    ticker_stop: Arc<AtomicBool>,
    /// Whether instances come from the pooling allocator (false: allocated on demand).
    pub pooling: bool,
    /// The routes' instances the pool was sized for (the spares aside).
    route_slots: usize,
    /// Largest plugin file read (`plugins.max_file_size`).
    pub(super) max_file_size: u64,
    /// Whether a missing granted directory is created (by `serve`) or an error (when inspecting).
    pub(super) create_dirs: bool,
    /// The deadline of `metadata` when a file is loaded (`plugins.timeout`).
    pub(super) load_timeout: std::time::Duration,
    /// Pooled connections for every plugin's wasi:http requests.
    pub(super) http: Arc<super::http_pool::HttpPool>,
    /// The TLS client configurations of plugins' wasi:tls connections, made once per plugin and
    /// files, so instances share them (and their session cache).
    pub(super) tls: super::tls::TlsConfigs,
    /// Each plugin's slots for name lookups (`dns.rs`).
    pub(super) dns: super::dns::DnsSlots,
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
    /// How many plugin instances the routes may hold at once: what the instance pool was sized
    /// for when ferry started (a reload cannot grow it).
    pub fn route_slots(&self) -> usize {
        if self.pooling { self.route_slots } else { usize::MAX }
    }

    /// Creates the engine (component model, epoch interruption, the pooling allocator when the
    /// pool can be reserved, the compiled-code cache when configured) and links WASI and ferry's
    /// host imports.
    pub fn new(settings: &Settings) -> anyhow::Result<Self> {
        let config = &settings.config;
        let largest_memory = settings.largest_plugin_memory();
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
        // Room for every route's instances at once, each as large as a component may be, so no
        // plugin's instances can take the slots another plugin needs; and for the routes a
        // reload may add.
        let route_slots = route_slots(settings);
        let instances = u32::try_from(route_slots.saturating_add(SPARE_INSTANCES)).unwrap_or(u32::MAX);
        pool.total_component_instances(instances)
            .total_stacks(instances)
            .total_core_instances(instances.saturating_mul(MAX_CORE_INSTANCES))
            .total_memories(instances.saturating_mul(MAX_MEMORIES))
            .total_tables(instances.saturating_mul(MAX_TABLES))
            .max_core_instances_per_component(MAX_CORE_INSTANCES)
            .max_memories_per_component(MAX_MEMORIES)
            .max_tables_per_component(MAX_TABLES)
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
        guard_file_access(&mut linker)?;
        super::dns::bound_name_lookups(&mut linker)?;
        super::contract::add_to_linker(&mut linker)?;
        // wasi:tls (a draft interface, switched on here): the host does the TLS of a plugin's TCP
        // connection, with the roots and client certificate its sandbox grants.
        let mut tls = wasmtime_wasi_tls::p2::LinkOptions::default();
        tls.tls(true);
        wasmtime_wasi_tls::p2::add_to_linker(&mut linker, &tls).map_err(anyhow::Error::from)?;
        let linker_without_http = linker.clone();
        wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker).map_err(anyhow::Error::from)?;
        free_request_options(&mut linker)?;

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
        let max_file_size = config.plugins.max_file_size.0 as u64;
        let load_timeout = config.plugins.timeout.0;
        Ok(Self {
            engine,
            linker,
            linker_without_http,
            ticker_stop,
            pooling,
            route_slots,
            max_file_size,
            create_dirs: true,
            load_timeout,
            http: Arc::new(super::http_pool::HttpPool::new()),
            tls: super::tls::TlsConfigs::default(),
            dns: super::dns::DnsSlots::default(),
        })
    }

    /// This runtime for commands that only inspect plugins: a missing granted directory is an
    /// error naming it, not created.
    pub fn inspecting(mut self) -> Self {
        self.create_dirs = false;
        self
    }
}
