//! ferry: delivers events from a transactional outbox through WebAssembly transport plugins.
//!
//! Applications insert events with [`emit`] inside their own database transactions; the
//! [`relay`] claims them in batches and hands them to the route's transport plugin
//! ([`plugins`]), then records SENT, a retry, or FAILED in the [`store`].

pub mod admin;
pub mod backoff;
pub mod cli;
pub mod clock;
pub mod config;
pub mod emit;
pub mod event;
pub mod metrics;
pub mod plugins;
pub mod relay;
pub mod report;
pub mod service;
pub mod store;
pub mod watch;

pub use emit::{Outbox, emit};
pub use event::NewEvent;
