//! The sandbox of one plugin instance: what its store carries (WASI and wasi:http state, the
//! plugin's name for log lines) and what it enforces: the memory cap over all its memories, the
//! counts of core instances, memories and tables, caps on the host objects it makes (resource-table
//! entries, header fields, buffered body chunks), the pre-opened directories (refused when they
//! are symbolic links), the TCP allowlist, the HTTP origin allowlist, and the host side of
//! ferry's `logging` import. What the linker shadows or withholds is in `imports.rs`.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use tokio::sync::Semaphore;
use wasmtime::component::ResourceTable;
use wasmtime::{ResourceLimiter, Store as WasmStore, UpdateDeadline};
use wasmtime_wasi::sockets::SocketAddrUse;
use wasmtime_wasi::{FsPerms, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};
use wasmtime_wasi_http::{
    Error as HttpError, RequestOptions, WasiBody, WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView,
};

use super::bindings::ferry::transport::{logging, types};
use super::http_pool::{Sender, Ticket};
use super::runtime::Runtime;
use crate::config::{PluginLimits, Sandbox, normalize_origin, origin_matches};

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
/// Host memory one resource-table entry may stand for, at most: a wasi:http `fields` resource
/// ([`FIELD_SIZE_LIMIT`]), or half an outgoing body (its body and stream entries, and two
/// buffered writes of [`BODY_CHUNK_SIZE`]). An instance's table holds at most
/// `memory / RESOURCE_BYTES` entries (and at least [`MIN_RESOURCES`]), so what the host keeps on
/// a plugin's behalf stays within about its own memory limit.
const RESOURCE_BYTES: usize = 16 << 10;
/// Resource-table entries an instance may always have, whatever its memory limit: stdio,
/// pre-opened directories and a few hundred connections or requests.
const MIN_RESOURCES: usize = 1024;
/// Bytes (roughly, in memory) one wasi:http `fields` resource may hold. Headers on the wire are
/// rarely above 8 KiB; wasmtime's default of 128 KiB would let a plugin make the host hold
/// 128 KiB per table entry.
const FIELD_SIZE_LIMIT: usize = 16 << 10;
/// The largest write to an outgoing wasi:http body the host buffers (wasmtime's default: 1 MiB).
/// WASI's own `blocking-write-and-flush` writes at most 4 KiB at a time.
const BODY_CHUNK_SIZE: usize = 16 << 10;

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
    tls: wasmtime_wasi_tls::WasiTlsCtx,
    http_policy: HttpPolicy,
    table: ResourceTable,
    pub(super) limiter: Limiter,
    pub(super) plugin: Arc<str>,
    /// When the running call's wasm code is stopped (see [`set_deadline`]).
    deadline: Instant,
    /// Whether it may look names up, and its plugin's lookup slots (`dns.rs`).
    pub(super) dns: super::dns::DnsGrant,
}

/// Gives the wasm code of `store` until `timeout` from now. The epoch ticker interrupts it every
/// [`EPOCH_TICK`](super::EPOCH_TICK): past the deadline the call traps (`Trap::Interrupt`, a
/// timeout); before it, the call yields to the async executor and goes on at its next poll. The
/// relay's workers and routes are futures of one task, so a plugin computing in a loop would
/// otherwise hold all of them, every other route's deliveries included, for its whole timeout;
/// yielding, it holds them for a tick at most.
pub(crate) fn set_deadline(store: &mut WasmStore<HostState>, timeout: Duration) {
    let now = Instant::now();
    // A timeout past what `Instant` can hold is as good as none: a century will do.
    let far = Duration::from_secs(100 * 365 * 86_400);
    store.data_mut().deadline = now.checked_add(timeout).or_else(|| now.checked_add(far)).unwrap_or(now);
    store.set_epoch_deadline(1);
}

impl HostState {
    pub(super) fn table(&mut self) -> &mut ResourceTable {
        &mut self.table
    }

    /// How many host objects the instance holds and may hold, if it holds more than half of what
    /// it may between calls: a sign that it leaks them (some language runtimes give handles back
    /// only when they collect garbage). Such an instance is replaced, like after `max_calls`,
    /// before it runs out in the middle of a call.
    pub(super) fn hoarding(&mut self) -> Option<(usize, usize)> {
        let held = self.table.iter_mut().count();
        let most = self.table.max_capacity();
        (held * 2 > most).then_some((held, most))
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl wasmtime_wasi_tls::WasiTlsView for HostState {
    fn tls(&mut self) -> wasmtime_wasi_tls::WasiTlsCtxView<'_> {
        wasmtime_wasi_tls::WasiTlsCtxView { ctx: &mut self.tls, table: &mut self.table }
    }
}

impl WasiHttpView for HostState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView { ctx: &mut self.http, table: &mut self.table, hooks: &mut self.http_policy }
    }
}

/// Origins an instance keeps slots for before it forgets those without a request in flight.
const IDLE_ORIGINS: usize = 256;

/// Outgoing wasi:http requests go only to the plugin's allowed origins, on the plugin's pooled
/// connections (`http_pool.rs`), with at most `connections` per origin waiting for an answer in
/// this instance; the `Host` header is set from the request's authority.
struct HttpPolicy {
    plugin: Arc<str>,
    origins: HashSet<String>,
    connections: u32,
    /// The plugin's client; `None` without an `http` grant (its requests never get this far).
    sender: Option<Sender>,
    /// This instance's slots, per allowed origin.
    slots: HashMap<String, Arc<Semaphore>>,
}

impl WasiHttpHooks for HttpPolicy {
    fn p2_outgoing_body_chunk_size(&mut self) -> usize {
        BODY_CHUNK_SIZE
    }

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
        let allowed = |o: &String| self.origins.contains(o) || self.origins.iter().any(|p| origin_matches(p, o));
        let Some(origin) = normalize_origin(&origin).ok().filter(allowed) else {
            tracing::warn!(plugin = %self.plugin, %origin, "plugin denied an HTTP request to an origin not on its http allowlist");
            return Box::new(async { Err(HttpError::HttpRequestDenied) });
        };
        let connections = self.connections.max(1) as usize;
        if self.slots.len() >= IDLE_ORIGINS && !self.slots.contains_key(&origin) {
            // A wildcard grant allows endless origins: forget the ones without a request in flight
            // (a ticket holds its semaphore), which a new semaphore of the same size replaces as
            // well. What stays is bounded by the requests in flight, hence by the resource table.
            self.slots.retain(|_, slots| Arc::strong_count(slots) > 1);
        }
        let Some(request) = respelled(request, &origin) else {
            return Box::new(async { Err(HttpError::HttpRequestUriInvalid) });
        };
        let slots = match self.slots.get(&origin) {
            Some(slots) => slots.clone(),
            None => self.slots.entry(origin.clone()).or_insert_with(|| Arc::new(Semaphore::new(connections))).clone(),
        };
        // Taken now, while the plugin hands the request over: slots go in the order of requests.
        let ticket = Ticket::take(slots);
        let Some(sender) = self.sender.clone() else { return Box::new(async { Err(HttpError::HttpRequestDenied) }) };
        Box::new(async move {
            let response = sender.send(&origin, ticket, request, options).await?;
            // The pool drives its connections itself: nothing is left for the caller to await.
            let done = async { Ok(()) };
            Ok((response, Box::new(done) as Box<dyn Future<Output = _> + Send>))
        })
    }
}

/// `request` addressed the way its normalized `origin` (`scheme://host:port`) spells it: host in
/// lower case, the port without leading zeros and left out when it is the scheme's default. The
/// pool keeps connections per authority as written, so spellings of one allowed origin
/// (`host:443`, `host:0443`, `host:00443`, …) would each keep connections of their own, without
/// end; respelled, they share one origin's. The `host` header wasmtime set from the authority is
/// respelled with it. `None` when the respelling is not a valid URI.
fn respelled(mut request: http::Request<WasiBody>, origin: &str) -> Option<http::Request<WasiBody>> {
    let (scheme, authority) = origin.split_once("://")?;
    let default_port = if scheme == "http" { ":80" } else { ":443" };
    let authority = authority.strip_suffix(default_port).unwrap_or(authority);
    if request.uri().authority().map(|a| a.as_str()) == Some(authority) {
        return Some(request);
    }
    let mut parts = request.uri().clone().into_parts();
    parts.authority = Some(authority.parse().ok()?);
    *request.uri_mut() = http::Uri::from_parts(parts).ok()?;
    if request.headers().contains_key(http::header::HOST) {
        request.headers_mut().insert(http::header::HOST, http::HeaderValue::from_str(authority).ok()?);
    }
    Some(request)
}

impl types::Host for HostState {}

impl logging::Host for HostState {
    fn log(&mut self, level: logging::Level, message: String) {
        let plugin = &*self.plugin;
        let message = crate::untrusted::clean(&message, crate::untrusted::MAX_LOG_LINE);
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
            if !host.is_dir() {
                anyhow::ensure!(
                    self.create_dirs,
                    "sandbox.{plugin}.dirs: {} does not exist (`ferry serve` creates granted directories)",
                    host.display()
                );
                std::fs::create_dir_all(host)
                    .with_context(|| format!("creating {} for plugin {plugin}", host.display()))?;
                tracing::info!(plugin = %plugin, dir = %host.display(), "created the directory granted to the plugin");
            }
            refuse_symlinks(&plugin, guest, host)?;
            wasi.preopened_dir(host, guest, FsPerms::ReadWrite)
                .map_err(anyhow::Error::from)
                .with_context(|| format!("granting {} to plugin {plugin} as {guest}", host.display()))?;
        }
        wasi.allow_ip_name_lookup(sandbox.dns);
        // Random bytes are made in ferry's memory before they are copied into the instance's:
        // without a cap of its own, wasmtime makes up to 64 MiB per call, whatever the instance
        // may hold. The call fails as a fault of the plugin past its memory limit.
        wasi.max_random_size(u64::try_from(limits.memory).unwrap_or(u64::MAX));
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
        let mut http = WasiHttpCtx::new();
        http.set_field_size_limit(FIELD_SIZE_LIMIT);
        let mut table = ResourceTable::new();
        table.set_max_capacity((limits.memory / RESOURCE_BYTES).max(MIN_RESOURCES));
        let sender = match sandbox.http.is_empty() {
            true => None,
            false => Some(
                self.http
                    .sender(
                        &plugin,
                        sandbox.http_ca.as_deref(),
                        sandbox.http_private,
                        sandbox.http_open_connections,
                        self.dns.of(&plugin),
                    )
                    .map_err(|e| anyhow::anyhow!("sandbox.{plugin}.http_ca: {e}"))?,
            ),
        };
        // TLS over the plugin's own TCP connections (wasi:tls), verified and authenticated with
        // the operator's files; without a tcp grant there is nothing to connect.
        let mut tls = wasmtime_wasi_tls::WasiTlsCtxBuilder::new();
        if !sandbox.tcp.is_empty() {
            let config = self.tls.config(&plugin, sandbox).map_err(|e| anyhow::anyhow!("sandbox.{plugin}.{e}"))?;
            tls = tls.provider(Box::new(super::tls::PluginTls { config }));
        }
        let dns = self.dns.grant(&plugin, sandbox.dns);
        let state = HostState {
            wasi: wasi.build(),
            http,
            tls: tls.build(),
            http_policy: HttpPolicy {
                plugin: plugin.clone(),
                origins: sandbox.http.clone(),
                connections: sandbox.http_connections,
                sender,
                slots: HashMap::new(),
            },
            table,
            limiter: Limiter::new(limits.memory),
            plugin,
            deadline: Instant::now(),
            dns,
        };
        let mut store = WasmStore::new(&self.engine, state);
        store.limiter(|state| &mut state.limiter);
        // What one call may copy from the guest to the host (an answer's strings and lists, an
        // import's arguments): no more than the instance's own memory limit, as a guest that
        // stays within it needs. Without it wasmtime allows 128 MiB per call, and one answer whose
        // strings all point at the same bytes is copied once per string.
        store.set_hostcall_fuel(limits.memory);
        store.epoch_deadline_callback(|store| {
            let passed = Instant::now() >= store.data().deadline;
            Ok(if passed { UpdateDeadline::Interrupt } else { UpdateDeadline::Yield(1) })
        });
        set_deadline(&mut store, limits.timeout);
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

/// Resolves `host:port` allowlist entries to addresses. An entry that does not resolve is logged
/// and grants nothing. The lookups run off the async threads: a slow resolver delays this start
/// only, not the relay workers sharing the thread.
pub(super) async fn resolve_allowlist(plugin: &str, entries: &[String]) -> Vec<SocketAddr> {
    let mut addrs = Vec::new();
    for entry in entries {
        match tokio::net::lookup_host(entry.as_str()).await {
            Ok(found) => addrs.extend(found),
            Err(e) => tracing::warn!(plugin, entry = %entry, "tcp allowlist entry does not resolve: {e}"),
        }
    }
    addrs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn allowlist_entries_resolve_and_the_ones_that_do_not_grant_nothing() {
        let entries = ["127.0.0.1:9", "localhost:10", "no-such-host.invalid:11", "no port"].map(String::from);
        let addrs = resolve_allowlist("p", &entries).await;
        assert!(addrs.contains(&"127.0.0.1:9".parse().unwrap()), "{addrs:?}");
        assert!(addrs.iter().any(|a| a.port() == 10 && a.ip().is_loopback()), "localhost resolves: {addrs:?}");
        assert!(addrs.iter().all(|a| a.port() == 9 || a.port() == 10), "{addrs:?}");
    }

    #[test]
    fn requests_go_out_under_their_origins_spelling() {
        use http_body_util::BodyExt as _;
        let cases = [
            ("http://example.com:0080/x?q=1", "http://example.com:80", "example.com"),
            ("https://Example.COM:00443/", "https://example.com:443", "example.com"),
            ("http://example.com:08080/", "http://example.com:8080", "example.com:8080"),
            ("http://[::1]:080/", "http://[::1]:80", "[::1]"),
            ("https://example.com/", "https://example.com:443", "example.com"),
        ];
        for (uri, origin, want) in cases {
            let body = http_body_util::Empty::new().map_err(|never| match never {}).boxed_unsync();
            let written = uri.parse::<http::Uri>().unwrap();
            let request = http::Request::post(uri)
                .header(http::header::HOST, written.authority().unwrap().as_str())
                .body(body)
                .unwrap();
            let sent = respelled(request, origin).unwrap();
            assert_eq!(sent.uri().authority().unwrap().as_str(), want, "{uri}");
            assert_eq!(sent.uri().path_and_query(), written.path_and_query(), "{uri}");
            assert_eq!(sent.uri().scheme(), written.scheme(), "{uri}");
            assert_eq!(sent.headers()[http::header::HOST], want, "{uri}");
        }
    }

    /// A plugin granted a wildcard origin can name endless origins; the slots kept for them stay
    /// bounded, while those with a request in flight are kept.
    #[tokio::test]
    async fn slots_for_endless_wildcard_origins_stay_bounded() {
        use http_body_util::BodyExt as _;
        let mut policy = HttpPolicy {
            plugin: Arc::from("p"),
            // As the configuration stores it: normalized, with the port.
            origins: HashSet::from(["http://*.example.com:80".to_string()]),
            connections: 2,
            sender: None,
            slots: HashMap::new(),
        };
        let request = |host: &str| {
            let body = http_body_util::Empty::new().map_err(|never| match never {}).boxed_unsync();
            http::Request::get(format!("http://{host}/")).body(body).unwrap()
        };
        // One origin with a request in flight: its semaphore is held by a ticket.
        let _ = policy.send_request(request("held.example.com"), None, Box::new(async { Ok(()) }));
        let held = policy.slots["http://held.example.com:80"].clone();
        let in_flight = Ticket::take(held);
        for n in 0..10_000 {
            let _ = policy.send_request(request(&format!("h{n}.example.com")), None, Box::new(async { Ok(()) }));
            assert!(policy.slots.len() <= IDLE_ORIGINS + 1, "{n}: {} origins kept", policy.slots.len());
        }
        assert!(policy.slots.contains_key("http://held.example.com:80"), "the origin in flight keeps its slots");
        drop(in_flight);
    }
}
