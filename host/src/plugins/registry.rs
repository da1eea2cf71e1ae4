//! The plugin registry: scans the plugins directory, compiles and validates each component
//! (the transport world, a compatible contract version, a well-formed name), and swaps versions
//! atomically on reload, never breaking a route the active version serves.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use sha2::{Digest, Sha256};
use wasmtime::component::{Component, Linker};

use super::contract::{Contract, Pre};
use super::imports::{deny_http, imports_http};
use super::pool::Instance;
use super::runtime::Runtime;
use super::sandbox::HostState;
use super::{EPOCH_TICK, PluginInfo, root_cause};
use crate::config::{PluginLimits, Sandbox, Settings};
use crate::live::Live;
use crate::metrics::{Metrics, ReloadLabels};

/// A compiled, pre-instantiated transport component.
pub struct Plugin {
    pub info: PluginInfo,
    pub path: PathBuf,
    /// SHA-256 of the file: identifies the loaded version.
    pub hash: String,
    pub loaded_at: DateTime<Utc>,
    /// The version of the transport contract the plugin was built for.
    pub contract: Contract,
    pub(super) pre: Pre,
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("info", &self.info)
            .field("path", &self.path)
            .field("hash", &self.hash)
            .field("contract", &self.contract)
            .finish_non_exhaustive()
    }
}

/// What `ferry plugins list` and the logs show about one plugin.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PluginStatus {
    pub name: String,
    pub version: String,
    pub file: PathBuf,
    pub hash: String,
    pub loaded_at: DateTime<Utc>,
    /// The version of the `ferry:transport` contract the plugin was built for, e.g. `0.2.0`.
    pub wit: String,
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
    pub(super) runtime: Arc<Runtime>,
    /// Replaced by a configuration reload; a load in progress keeps the version it started with.
    settings: Arc<Live<Settings>>,
    pub(super) metrics: Arc<Metrics>,
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
    pub fn new(runtime: Arc<Runtime>, settings: Arc<Settings>, metrics: Arc<Metrics>) -> Self {
        Self::sharing(runtime, Arc::new(Live::new(settings)), metrics)
    }

    /// An empty registry reading its settings from `settings`, which a reload may replace.
    pub fn sharing(runtime: Arc<Runtime>, settings: Arc<Live<Settings>>, metrics: Arc<Metrics>) -> Self {
        Self {
            runtime,
            settings,
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
    pub fn dir(&self) -> PathBuf {
        self.settings.get().config.plugins.dir.clone()
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
        let mut files = wasm_files(&self.dir())?;
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

    /// Makes `plugin` the active version of its name, without the checks a file of the plugins
    /// directory goes through (its file name need not be the plugin's): for `ferry plugins try`,
    /// which runs one file from anywhere.
    pub(crate) fn activate(&self, plugin: Plugin) {
        let name = plugin.info.name.clone();
        self.plugins.write().unwrap_or_else(|e| e.into_inner()).insert(name, Arc::new(plugin));
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
                wit: p.contract.version().to_string(),
                routes: self.routes_of(&p.info.name),
                last_error: errors.get(&p.path).cloned(),
            })
            .collect();
        (list, errors)
    }

    fn routes_of(&self, plugin: &str) -> Vec<String> {
        self.settings.get().routes_of(plugin)
    }

    /// The settings the plugins run under now.
    pub fn settings(&self) -> Arc<Settings> {
        self.settings.get()
    }

    /// Holds off plugin reloads (from the watcher or `plugins reload`) while the guard lives: a
    /// configuration reload takes it, so a new plugin version is checked against one route table.
    pub async fn hold_reloads(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.reloading.lock().await
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
            self.metrics
                .plugin_reloads
                .get_or_create(&ReloadLabels { plugin: plugin.into(), result: result.into() })
                .inc();
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
        let settings = self.settings.get();
        let plugin = self.runtime.load(path, &settings).await?;
        let name = plugin.info.name.clone();
        // Grants and route configs (secrets among them) go by plugin name. The name a component
        // reports is its own claim; the file name is the operator's: they must agree, so a file
        // cannot take another plugin's grants by calling itself by that plugin's name.
        if path.file_stem().and_then(|s| s.to_str()) != Some(name.as_str()) {
            // Its own claim, of any length: cut to a line.
            let name = crate::untrusted::clean(&name, 128);
            anyhow::bail!(
                "{} reports the plugin name {name:?}, which is not its file name; grants and routes follow \
                 the name, so a plugin's file must be named after it: install it as {name}.wasm",
                path.display()
            );
        }
        if let Some(active) = self.get(&name)
            && active.hash == plugin.hash
        {
            return Ok(Reloaded::Unchanged { name });
        }
        let plugin = Arc::new(plugin);
        let active = self.get(&name);
        let grants = settings.plugin(&name);
        for route in settings.routes.values().filter(|r| r.plugin == name) {
            let Err(e) = Instance::start(&self.runtime, &plugin, route, &grants, None, None, None).await else {
                continue;
            };
            // A new version must not break a route the active version serves. A route that no
            // version can serve (its config is rejected by both) does not hold the others back;
            // its events fail with `no_transport` until it is fixed.
            let served_now = match &active {
                Some(active) => Instance::start(&self.runtime, active, route, &grants, None, None, None).await.is_ok(),
                None => false,
            };
            if served_now {
                anyhow::bail!("route {:?} cannot use {}: {e}", route.name, path.display());
            }
            tracing::error!(plugin = %name, route = %route.name, "route cannot use the plugin: {e}");
        }
        let hash = plugin.hash.clone();
        tracing::info!(plugin = %name, version = %plugin.info.version, hash = %&hash[..12], file = %path.display(), "plugin loaded");
        self.plugins.write().unwrap_or_else(|e| e.into_inner()).insert(name.clone(), plugin);
        Ok(Reloaded::Loaded { name, hash })
    }
}

/// The `*.wasm` entries directly in `dir`, sorted.
pub fn wasm_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading plugins directory {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        // Not only regular files: a FIFO or a device named `*.wasm` is listed too, and refused
        // with a reason when read.
        .filter(|p| is_plugin_file(p))
        .collect();
    files.sort();
    Ok(files)
}

/// Whether `path` names a plugin file (`*.wasm`).
pub fn is_plugin_file(path: &Path) -> bool {
    path.extension().is_some_and(|ext| ext == "wasm")
}

impl Runtime {
    /// Compiles and pre-instantiates one component, then asks it for its metadata. Compilation
    /// runs on a blocking thread so it never stalls the async runtime. Errors say in plain words
    /// what is wrong with the file.
    ///
    /// The component is linked with wasi:http only if `settings` grant the plugin (by the name it
    /// reports) an origin; otherwise its wasi:http imports trap when called. Until that name is
    /// known, for the metadata call, it gets no wasi:http, no grants, and the largest memory
    /// limit any plugin has.
    pub async fn load(&self, path: &Path, settings: &Settings) -> anyhow::Result<Plugin> {
        self.load_granting(path, settings.largest_plugin_memory(), |name| {
            !settings.plugin(name).sandbox.http.is_empty()
        })
        .await
    }

    /// [`Runtime::load`] for a caller that decides the grants itself once the component has said
    /// its name: `memory` caps the metadata call, and `grants_http(name)` says whether the plugin
    /// is linked with wasi:http.
    pub(crate) async fn load_granting(
        &self,
        path: &Path,
        memory: usize,
        grants_http: impl FnOnce(&str) -> bool,
    ) -> anyhow::Result<Plugin> {
        let (file, max) = (path.to_path_buf(), self.max_file_size);
        let bytes = tokio::task::spawn_blocking(move || read_plugin_file(&file, max))
            .await?
            .with_context(|| format!("reading plugin {}", path.display()))?;
        let hash = hex::encode(Sha256::digest(&bytes));
        let engine = self.engine.clone();
        let compiled = tokio::task::spawn_blocking(move || {
            // Its shape first: compiling some components takes host memory without bound.
            super::shape::check(&bytes).map_err(|why| anyhow::anyhow!("is refused: {why}"))?;
            Component::new(&engine, &bytes)
                .map_err(|e| anyhow::anyhow!("is not a valid wasm component: {}", root_cause(&e)))
        });
        let component = compiled.await?.map_err(|e| anyhow::anyhow!("{} {e}", path.display()))?;
        let exports = component.component_type();
        let contract = Contract::of(exports.exports(&self.engine).map(|(name, _)| name))
            .map_err(|e| anyhow::anyhow!("{} {e}", path.display()))?
            // Without a transport export the world check below says what is missing.
            .unwrap_or(Contract::Current);
        let wants_http = imports_http(&component, &self.engine);
        let mut without_http = self.linker_without_http.clone();
        if wants_http {
            deny_http(&mut without_http, &component, &self.engine).with_context(|| path.display().to_string())?;
        }
        let pre = self.pre_instantiate(&without_http, &component, contract, path)?;
        let label: Arc<str> = Arc::from(path.file_name().and_then(|n| n.to_str()).unwrap_or("plugin"));
        let probe_limits = PluginLimits { timeout: self.load_timeout, memory, instances: 1, max_calls: 1 };
        let mut store = self.store(label, &Sandbox::default(), &probe_limits, &[])?;
        // The epoch deadline stops wasm code; this timeout also covers a guest parked in the host.
        let metadata = async {
            let instance = pre.instantiate(&mut store).await.map_err(|e| {
                if store.data().limiter.hit {
                    anyhow::anyhow!(
                        "{} cannot be instantiated: it exceeded the {} MiB memory limit",
                        path.display(),
                        memory >> 20
                    )
                } else {
                    anyhow::anyhow!("{} cannot be instantiated: {}", path.display(), root_cause(&e))
                }
            })?;
            instance
                .metadata(&mut store)
                .await
                .map_err(|e| anyhow::anyhow!("metadata() of {} failed: {}", path.display(), root_cause(&e)))
        };
        let mut info =
            tokio::time::timeout(probe_limits.timeout + EPOCH_TICK * 5, metadata).await.map_err(|_| {
                anyhow::anyhow!("metadata() of {} did not answer within {:?}", path.display(), probe_limits.timeout)
            })??;
        info.version = crate::untrusted::clean(&info.version, 64);
        if info.name.is_empty() || !info.name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        {
            anyhow::bail!(
                "{} reports the plugin name {:?}; names use lowercase letters, digits and '-'",
                path.display(),
                crate::untrusted::clean(&info.name, 64)
            );
        }
        let pre = if wants_http && grants_http(&info.name) {
            self.pre_instantiate(&self.linker, &component, contract, path)?
        } else {
            pre
        };
        Ok(Plugin { info, path: path.to_path_buf(), hash, loaded_at: Utc::now(), contract, pre })
    }

    /// `component` linked by `linker`, checked to export the transport world.
    fn pre_instantiate(
        &self,
        linker: &Linker<HostState>,
        component: &Component,
        contract: Contract,
        path: &Path,
    ) -> anyhow::Result<Pre> {
        let pre = linker.instantiate_pre(component).map_err(|e| {
            anyhow::anyhow!("{} needs imports ferry does not provide: {}", path.display(), root_cause(&e))
        })?;
        Pre::new(contract, pre).map_err(|e| {
            anyhow::anyhow!(
                "{} does not export the ferry:transport world (version {}): {}",
                path.display(),
                contract.version(),
                root_cause(&e)
            )
        })
    }
}

/// Reads a plugin file: a regular file (or a symlink to one) of at most `max` bytes. It is opened
/// without blocking, so a FIFO or device named `*.wasm` is refused at once instead of hanging the
/// reload (and the watcher, and shutdown), and read only up to the cap.
fn read_plugin_file(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let refuse = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(refuse("not a regular file; plugins are loaded from regular files only".into()));
    }
    if meta.len() > max {
        return Err(refuse(format!("{} bytes, more than plugins.max_file_size ({max} bytes)", meta.len())));
    }
    // Sized by what the file says it holds, at most the cap, which `validate` bounds.
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(refuse(format!("grew past plugins.max_file_size ({max} bytes) while being read")));
    }
    Ok(bytes)
}
