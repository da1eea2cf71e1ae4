//! ferry: delivers events from a transactional outbox through WebAssembly transport plugins.
//!
//! Applications insert events with [`emit`] (from the `ferry-outbox` crate) inside their own database transactions; the
//! [`relay`] claims them in batches and hands them to the route's transport plugin
//! ([`plugins`]), then records SENT, a retry, or FAILED in the [`store`].

pub mod activity;
pub mod admin;
pub mod backoff;
pub mod breaker;
pub mod cli;
pub mod clock;
pub mod config;
pub mod endpoints;
pub mod event;
pub mod live;
pub mod metrics;
pub mod ops;
pub mod plugins;
pub mod relay;
pub mod report;
pub mod service;
pub mod store;
pub mod systemd;
pub mod telemetry;
pub mod untrusted;
pub mod watch;

/// Emitting needs only the `ferry-outbox` crate; it is re-exported here for applications that
/// embed ferry whole.
pub use ferry_outbox::{EmitError, NewEvent, Outbox, emit};
