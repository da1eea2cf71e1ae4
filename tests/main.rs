//! Integration tests: the store suite on both backends, and ferry end to end with real plugins
//! compiled from `plugins/` and `tests/plugins/`. One test binary, so wasmtime is linked once.

mod admin;
mod chaos;
mod common;
mod e2e;
mod engine;
mod http;
mod kafka;
mod languages;
mod relay;
mod reload;
mod sandbox;
mod sdk;
mod store;
