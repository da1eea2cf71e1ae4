//! The sandbox of one plugin instance: what its store carries (WASI and wasi:http state, the
//! plugin's name for log lines) and what it enforces: the memory cap over all its memories, the
//! counts of core instances, memories and tables, the pre-opened directories
//! (with refused paths logged), the TCP allowlist, the HTTP origin allowlist, and the host side of
//! ferry's `logging` import.

use std::collections::HashSet;
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use wasmtime::component::{Linker, ResourceTable};
use wasmtime::{ResourceLimiter, Store as WasmStore};
use wasmtime_wasi::sockets::SocketAddrUse;
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::{
    Error as HttpError, RequestOptions, WasiBody, WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView,
};

use super::bindings::ferry::transport::{logging, types};
use super::runtime::Runtime;
use super::ticks;
use crate::config::{PluginLimits, Sandbox, normalize_origin};

/// Core instances one plugin instance may hold. The bundled Python transport (componentize-py)
/// needs 14, the JavaScript one 4, the Rust ones 3. Also the pool's per-component cap.
pub(super) const MAX_CORE_INSTANCES: u32 = 32;
/// Linear memories one plugin instance may hold. Every bundled plugin has one; components that
/// carry the WASI preview-1 adapter have two. Also the pool's per-component cap.
pub(super) const MAX_MEMORIES: u32 = 4;
/// Tables one plugin instance may hold. Every bundled plugin has two. Also the pool's
/// per-component cap.
pub(super) const MAX_TABLES: u32 = 4;
/// Table elements all tables of one instance may hold together (a pointer or two each). The
/// JavaScript transport needs about 7 700, the Python one about 5 800.
const MAX_TABLE_ELEMENTS: usize = 100_000;

/// Resource accounting for one instance, over its whole store: the bytes of all its linear
/// memories together, the elements of all its tables together, and (through the counts below)
/// how many core instances, memories and tables it may create. Remembers that the memory cap was
/// hit, so a resulting trap or failed instantiation can be reported as what it is.
pub(super) struct Limiter {
    max_memory: usize,
    /// Bytes held by all linear memories of the store.
    memory: usize,
    /// Elements held by all tables of the store.
    table_elements: usize,
    pub(super) hit: bool,
}

impl Limiter {
    pub(super) fn new(max_memory: usize) -> Self {
        Self { max_memory, memory: 0, table_elements: 0, hit: false }
    }
}

impl ResourceLimiter for Limiter {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        // Growth past the memory's own maximum fails after this check anyway; it never happens,
        // so it is not counted.
        if maximum.is_some_and(|max| desired > max) {
            return Ok(true);
        }
        // `current` was counted when this memory was created or last grew (creation reports 0).
        let total = self.memory.saturating_sub(current).saturating_add(desired);
        if total > self.max_memory {
            self.hit = true;
            return Ok(false);
        }
        self.memory = total;
        Ok(true)
    }

    fn table_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|max| desired > max) {
            return Ok(true);
        }
        let total = self.table_elements.saturating_sub(current).saturating_add(desired);
        if total > MAX_TABLE_ELEMENTS {
            return Ok(false);
        }
        self.table_elements = total;
        Ok(true)
    }

    fn instances(&self) -> usize {
        MAX_CORE_INSTANCES as usize
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES as usize
    }

    fn tables(&self) -> usize {
        MAX_TABLES as usize
    }
}

/// What each instance's store carries: WASI and wasi:http state, the memory limiter, and the
/// plugin's name for log lines.
pub struct HostState {
    wasi: WasiCtx,
    http: WasiHttpCtx,
    http_policy: HttpPolicy,
    table: ResourceTable,
    pub(super) limiter: Limiter,
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
    origins: HashSet<String>,
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
        let allowed = normalize_origin(&origin).is_ok_and(|o| self.origins.contains(&o));
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

impl Runtime {
    /// A store for one instance of `plugin`, with its sandbox and limits.
    pub(super) fn store(
        &self,
        plugin: Arc<str>,
        sandbox: &Sandbox,
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
            // Creating the directory would follow a link as well, so look before and after.
            refuse_symlinks(&plugin, guest, host)?;
            std::fs::create_dir_all(host)
                .with_context(|| format!("creating {} for plugin {plugin}", host.display()))?;
            refuse_symlinks(&plugin, guest, host)?;
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
        let state = HostState {
            wasi: wasi.build(),
            http: WasiHttpCtx::new(),
            http_policy: HttpPolicy { plugin: plugin.clone(), origins: sandbox.http.clone() },
            table: ResourceTable::new(),
            limiter: Limiter::new(limits.memory),
            plugin,
        };
        let mut store = WasmStore::new(&self.engine, state);
        store.limiter(|state| &mut state.limiter);
        store.set_epoch_deadline(ticks(limits.timeout));
        store.epoch_deadline_trap();
        Ok(store)
    }
}

/// Refuses a granted directory that is, or lies under, a symbolic link: pre-opening it would
/// follow the link to wherever it points, outside every grant. `host` is absolute and normalized
/// (see `Sandbox`), so each of its ancestors is a real path component; the walk stops at the
/// first one that does not exist yet.
fn refuse_symlinks(plugin: &str, guest: &str, host: &Path) -> anyhow::Result<()> {
    let mut ancestors: Vec<&Path> = host.ancestors().collect();
    ancestors.reverse();
    for path in ancestors {
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let target = std::fs::read_link(path).map(|t| t.display().to_string()).unwrap_or_default();
                let under = if path == host { String::new() } else { format!("lies under {}, which ", path.display()) };
                anyhow::bail!(
                    "plugin {plugin}: granted directory {} (sandbox.{plugin}.dirs.{guest:?}) {under}is a symbolic link \
                     to {target:?}; grant the real directory, with no symbolic link on its path",
                    host.display()
                );
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("plugin {plugin}: checking granted directory {}", path.display()));
            }
        }
    }
    Ok(())
}

/// The WASI version of `wasi:filesystem` that wasmtime-wasi links.
const WASI_FILESYSTEM_TYPES: &str = "wasi:filesystem/types@0.2.12";

/// Shadows three `wasi:filesystem` functions in the linker:
///
/// - `descriptor.open-at` calls wasmtime-wasi's own implementation and, when it refuses a path
///   (one that climbs out of a granted directory), leaves a warning naming the plugin and the path.
///   Paths outside every granted directory never reach the host: the guest's libc finds no
///   directory to resolve them against and fails on its own.
/// - `descriptor.symlink-at` refuses a link whose target is absolute or has a `..` component
///   (see [`link_target_stays_inside`]): host tools such as log shippers and backups follow links,
///   and must not be led out of the grant.
/// - `descriptor.link-at` refuses every hard link: transports have no use for them, and a hard
///   link keeps a file alive and reachable under a name the operator did not choose.
///
/// Refusals answer `not-permitted` and leave a warning naming the plugin and the target.
pub(super) fn guard_file_access(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    use wasmtime::component::Resource;
    use wasmtime_wasi::filesystem::WasiFilesystemView;
    use wasmtime_wasi::p2::bindings::filesystem::types::{
        Descriptor, DescriptorFlags, ErrorCode, Host as _, HostDescriptor as _, OpenFlags, PathFlags,
    };
    type OpenArgs = (Resource<Descriptor>, PathFlags, String, OpenFlags, DescriptorFlags);
    type SymlinkArgs = (Resource<Descriptor>, String, String);
    type LinkArgs = (Resource<Descriptor>, PathFlags, String, Resource<Descriptor>, String);
    linker.allow_shadowing(true);
    let mut types = linker.instance(WASI_FILESYSTEM_TYPES).map_err(anyhow::Error::from)?;
    types
        .func_wrap_async("[method]descriptor.open-at", |mut store, (fd, path_flags, path, oflags, flags): OpenArgs| {
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
    types
        .func_wrap_async("[method]descriptor.symlink-at", |mut store, (fd, target, link): SymlinkArgs| {
            Box::new(async move {
                let state = store.data_mut();
                if !link_target_stays_inside(&target) {
                    tracing::warn!(plugin = %state.plugin, target = %target, link = %link, "plugin denied a symbolic link to a target outside its directories");
                    return Ok((Err(ErrorCode::NotPermitted),));
                }
                let mut fs = state.filesystem();
                let result: Result<(), ErrorCode> = match fs.symlink_at(fd, target, link).await {
                    Ok(()) => Ok(()),
                    Err(e) => Err(fs.convert_error_code(e)?),
                };
                Ok((result,))
            })
        })
        .map_err(anyhow::Error::from)?;
    types
        .func_wrap_async("[method]descriptor.link-at", |store, (_, _, target, _, link): LinkArgs| {
            Box::new(async move {
                tracing::warn!(plugin = %store.data().plugin, target = %target, link = %link, "plugin denied a hard link; plugins may not make them");
                Ok((Err::<(), _>(ErrorCode::NotPermitted),))
            })
        })
        .map_err(anyhow::Error::from)?;
    linker.allow_shadowing(false);
    Ok(())
}

/// Whether a symbolic link with this target, made anywhere inside a granted directory, resolves
/// inside it: the target is relative and never climbs (`..`). A chain of such links stays inside
/// too, since each step only descends.
pub(super) fn link_target_stays_inside(target: &str) -> bool {
    !target.starts_with('/') && !target.split('/').any(|part| part == "..")
}

/// Resolves `host:port` allowlist entries to addresses. An entry that does not resolve is logged
/// and grants nothing.
pub(super) fn resolve_allowlist(plugin: &str, entries: &[String]) -> Vec<SocketAddr> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_targets_must_stay_inside_the_grant() {
        for inside in ["file.txt", "sub/file.txt", "./file", ".", "a/.../b", "..hidden", "sub/"] {
            assert!(link_target_stays_inside(inside), "{inside}");
        }
        for outside in ["/etc/passwd", "/", "..", "../x", "../../etc/passwd", "sub/../../x", "sub/..", "a//../b"] {
            assert!(!link_target_stays_inside(outside), "{outside}");
        }
    }
}
