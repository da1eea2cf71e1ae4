//! Integration tests: the store suite on both backends, and ferry end to end with real plugins
//! compiled from `plugins/` and `tests/plugins/`. One test binary, so wasmtime is linked once.

mod admin;
mod authoring;
mod chaos;
mod contract;
mod dashboard;
mod destinations;
mod e2e;
mod endpoints;
mod engine;
mod grants;
mod hostile;
mod http;
mod kafka;
mod languages;
mod limits;
mod operator;
mod relay;
mod reload;
mod rows;
mod sandbox;
mod sdk;
mod store;
mod telemetry;

/// The fixtures, shared with the benchmarks as the `ferry-testkit` crate.
use ferry_testkit as common;
use ferry_testkit::both_backends;
