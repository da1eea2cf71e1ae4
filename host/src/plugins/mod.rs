//! The plugin runtime: one wasmtime engine ([`Runtime`]), a [`Registry`] of the transport components found in
//! the plugins directory (compiled once, pre-instantiated, swappable at run time), and per route a
//! [`RouteTransport`] with a small pool of sandboxed instances.
//!
//! A plugin call can trap, loop, exhaust its memory or overrun its time; every such fault comes
//! back as a [`PluginFault`] for the relay to record, the broken instance is discarded, and the
//! next call gets a fresh one. Nothing a plugin does can stop the host.
//!
//! One concern per file: `contract.rs` (the versions of the WIT contract, their bindings, and
//! the conversion to and from the WIT types), `runtime.rs` (the engine: pooling with fallback,
//! code cache, epoch ticker, linkers), `sandbox.rs` (what an instance's store carries and
//! enforces: memory, tables, instances, host resources, files, sockets, HTTP, logging),
//! `imports.rs` (what the linker shadows or withholds: file-access guards, wasi:http for plugins
//! without an `http` grant), `dns.rs` (name lookups, bounded per plugin), `http_pool.rs` (pooled
//! connections for wasi:http requests), `kept.rs` (the bound on the connections a plugin keeps
//! open over all its origins), `tls.rs`
//! (TLS done by the host for wasi:tls and wasi:http: roots, a private CA, client certificates),
//! `registry.rs` (scan, load, validate and hot-swap plugin files), `shape.rs` (what compiling a
//! component would expand to, checked before wasmtime compiles it) and `pool.rs` (per-route
//! instance pools and delivery calls).

mod contract;
mod dns;
mod http_pool;
mod imports;
mod kept;
mod pool;
mod registry;
mod runtime;
mod sandbox;
mod shape;
mod tls;
pub mod trial;

use std::time::Duration;

pub use self::contract::{Contract, OLDER_WIT_VERSIONS, WIT_VERSION};
pub use self::http_pool::DEFAULT_CONNECTIONS as DEFAULT_HTTP_CONNECTIONS;
pub use self::http_pool::DEFAULT_OPEN_CONNECTIONS as DEFAULT_HTTP_OPEN_CONNECTIONS;
pub(crate) use self::http_pool::is_public;
pub use self::pool::{Cutoff, Delivery, PluginConfig, RouteTransport, Window, route_transports};
pub use self::registry::{Plugin, PluginStatus, Registry, Reloaded, is_plugin_file, wasm_files};
pub use self::runtime::Runtime;
pub use self::sandbox::HostState;

use self::contract::current as bindings;

pub use bindings::exports::ferry::transport::transport::{Outcome, PluginInfo};
pub use bindings::ferry::transport::types::Failure;

/// How often the epoch ticker advances: the granularity of plugin timeouts, and the longest a
/// plugin's wasm code runs before it gives the relay's other work a turn (see
/// `sandbox::set_deadline`).
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(10);

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
    /// No instance could be made: the instance pool was full, or instantiating broke one of the
    /// plugin's limits (core instances, memories, tables) or trapped.
    #[error("plugin could not be instantiated: {0}")]
    NotInstantiated(String),
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
    /// The host ran short of open files or memory while starting an instance (another plugin
    /// holding thousands of sockets, say). Nobody's fault that the events or their route could
    /// mend: they wait a moment, no attempt counted, their route's breaker left alone.
    #[error("{0}")]
    HostShort(String),
    /// The call was not begun: it had waited for an instance so long that, begun, it could have
    /// run past the claim's lease (see [`Window`]). Like `HostShort`: the events wait a moment,
    /// no attempt counted, their route's breaker left alone.
    #[error("{0}")]
    LeaseShort(String),
}

/// The readable part of a wasmtime error, on one line: its causes joined by ": ", without the
/// wasm backtrace wasmtime adds to traps (whose header would otherwise be all that shows).
pub(crate) fn root_cause(error: &wasmtime::Error) -> String {
    let causes: Vec<String> = error
        .chain()
        .map(|cause| cause.to_string())
        .filter(|cause| !cause.starts_with("error while executing at wasm backtrace"))
        .collect();
    causes.join(": ").lines().next().unwrap_or_default().to_string()
}
