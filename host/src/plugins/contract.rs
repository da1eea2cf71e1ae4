//! The versions of the `ferry:transport` contract this host implements, and one face for all of
//! them: a plugin is loaded with the bindings of the version it was built for ([`Contract`], read
//! from its exports), and called through [`Pre`] and [`Bindings`], which turn every version's
//! types into the current ones. Below 1.0 each minor version may change types, so each supported
//! one has its own generated bindings; an older version's answers are a subset of the current
//! ones (0.1 has no `deferred`).

use wasmtime::Store as WasmStore;
use wasmtime::component::{HasSelf, Linker};

use super::sandbox::HostState;
use super::{Outcome, PluginInfo};
use crate::event::ClaimedEvent;

/// Host-side bindings for the current version, `wit/transport.wit`.
pub(super) mod current {
    wasmtime::component::bindgen!({
        path: "../wit",
        world: "transport-plugin",
        exports: { default: async },
        // Events are lowered into the guest from ferry's own copy, not cloned into owned records
        // first.
        ownership: Borrowing { duplicate_if_necessary: true },
    });
}

/// Host-side bindings for version 0.1, `wit/v0.1/transport.wit`.
pub(super) mod v0_1 {
    wasmtime::component::bindgen!({
        path: "../wit/v0.1",
        world: "transport-plugin",
        exports: { default: async },
        // Events are lowered into the guest from ferry's own copy, not cloned into owned records
        // first.
        ownership: Borrowing { duplicate_if_necessary: true },
    });
}

/// The version of the `ferry:transport` WIT package this host implements (`wit/transport.wit`).
pub const WIT_VERSION: &str = "0.2.0";

/// The older versions this host still loads plugins of, each with its own bindings.
pub const OLDER_WIT_VERSIONS: &[&str] = &["0.1.0"];

/// The contract version a plugin was built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contract {
    /// [`WIT_VERSION`].
    Current,
    /// `ferry:transport@0.1`: no `deferred` outcome.
    V0_1,
}

impl Contract {
    /// The version as written in WIT, e.g. `0.2.0`.
    pub fn version(self) -> &'static str {
        match self {
            Contract::Current => WIT_VERSION,
            Contract::V0_1 => OLDER_WIT_VERSIONS[0],
        }
    }

    /// The version of a component's `ferry:transport/transport` export among `exports`. `None`
    /// when it has no such export (the world check then says what is missing); an error naming
    /// the versions this host implements when the plugin was built for another.
    pub fn of<'a>(exports: impl IntoIterator<Item = &'a str>) -> Result<Option<Contract>, String> {
        let Some(theirs) = exports.into_iter().find_map(|name| name.strip_prefix("ferry:transport/transport@")) else {
            return Ok(None);
        };
        let series = |version: &str| -> Option<(u64, u64)> {
            let mut parts = version.split(['.', '-', '+']);
            let major = parts.next()?.parse().ok()?;
            let minor = parts.next()?.parse().ok()?;
            // Semver: below 1.0 every minor release may break, above it every major one.
            Some(if major == 0 { (0, minor) } else { (major, 0) })
        };
        let theirs_series = series(theirs);
        if theirs_series.is_some() && theirs_series == series(WIT_VERSION) {
            return Ok(Some(Contract::Current));
        }
        if theirs_series.is_some() && theirs_series == series(Contract::V0_1.version()) {
            return Ok(Some(Contract::V0_1));
        }
        Err(format!(
            "is built for ferry:transport@{theirs}, but this ferry implements ferry:transport@{WIT_VERSION} (and still \
             loads plugins built for {}), an incompatible version; rebuild the plugin against this ferry's wit/ directory",
            OLDER_WIT_VERSIONS.iter().map(|v| format!("@{v}")).collect::<Vec<_>>().join(", ")
        ))
    }
}

/// Adds ferry's own imports (`logging`, `types`) of every supported version to `linker`.
pub(super) fn add_to_linker(linker: &mut Linker<HostState>) -> anyhow::Result<()> {
    current::TransportPlugin::add_to_linker::<_, HasSelf<_>>(linker, |state| state).map_err(anyhow::Error::from)?;
    v0_1::TransportPlugin::add_to_linker::<_, HasSelf<_>>(linker, |state| state).map_err(anyhow::Error::from)?;
    Ok(())
}

/// `event` as the WIT `event` record of the version whose type is `$record` (the record is the
/// same in every version), borrowing its values; `$headers` is its headers as borrowed pairs.
macro_rules! wit_event {
    ($record:path, $event:expr, $headers:expr) => {{
        let event: &ClaimedEvent = $event;
        $record {
            id: u64::try_from(event.id).unwrap_or_default(),
            event_type: &event.event_type,
            route: &event.route,
            ordering_key: event.ordering_key.as_deref(),
            payload: &event.payload,
            content_type: &event.content_type,
            headers: $headers,
            attempt: event.attempt,
            event_time: event.event_time.timestamp_millis(),
        }
    }};
}

/// Each event's headers as the borrowed pairs a WIT `event` record holds.
fn borrowed_headers<'a>(events: &[&'a ClaimedEvent]) -> Vec<Vec<(&'a str, &'a str)>> {
    events.iter().map(|e| e.headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()).collect()
}

/// A component linked and checked against the world of its version, ready to instantiate.
pub(super) enum Pre {
    Current(current::TransportPluginPre<HostState>),
    V0_1(v0_1::TransportPluginPre<HostState>),
}

/// One instance's exports.
pub(super) enum Bindings {
    Current(current::TransportPlugin),
    V0_1(v0_1::TransportPlugin),
}

impl Pre {
    /// Checks that `pre` exports the transport world of `contract`.
    pub(super) fn new(contract: Contract, pre: wasmtime::component::InstancePre<HostState>) -> wasmtime::Result<Pre> {
        Ok(match contract {
            Contract::Current => Pre::Current(current::TransportPluginPre::new(pre)?),
            Contract::V0_1 => Pre::V0_1(v0_1::TransportPluginPre::new(pre)?),
        })
    }

    pub(super) async fn instantiate(&self, store: &mut WasmStore<HostState>) -> wasmtime::Result<Bindings> {
        Ok(match self {
            Pre::Current(pre) => Bindings::Current(pre.instantiate_async(store).await?),
            Pre::V0_1(pre) => Bindings::V0_1(pre.instantiate_async(store).await?),
        })
    }
}

impl Bindings {
    pub(super) async fn metadata(&self, store: &mut WasmStore<HostState>) -> wasmtime::Result<PluginInfo> {
        Ok(match self {
            Bindings::Current(b) => b.ferry_transport_transport().call_metadata(store).await?,
            Bindings::V0_1(b) => {
                let info = b.ferry_transport_transport().call_metadata(store).await?;
                PluginInfo { name: info.name, version: info.version }
            }
        })
    }

    pub(super) async fn init(
        &self,
        store: &mut WasmStore<HostState>,
        config: &[(String, String)],
    ) -> wasmtime::Result<Result<(), String>> {
        let config: Vec<(&str, &str)> = config.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        match self {
            Bindings::Current(b) => b.ferry_transport_transport().call_init(store, &config).await,
            Bindings::V0_1(b) => b.ferry_transport_transport().call_init(store, &config).await,
        }
    }

    /// Calls `deliver-batch` with `events`, answering in the current version's outcomes.
    pub(super) async fn deliver(
        &self,
        store: &mut WasmStore<HostState>,
        events: &[&ClaimedEvent],
    ) -> wasmtime::Result<Vec<Outcome>> {
        let headers = borrowed_headers(events);
        let pairs = events.iter().zip(&headers);
        match self {
            Bindings::Current(b) => {
                let events: Vec<_> =
                    pairs.map(|(e, h)| wit_event!(current::ferry::transport::types::Event, e, h)).collect();
                b.ferry_transport_transport().call_deliver_batch(store, &events).await
            }
            Bindings::V0_1(b) => {
                let events: Vec<_> =
                    pairs.map(|(e, h)| wit_event!(v0_1::ferry::transport::types::Event, e, h)).collect();
                let outcomes = b.ferry_transport_transport().call_deliver_batch(store, &events).await?;
                Ok(outcomes.into_iter().map(from_v0_1).collect())
            }
        }
    }
}

/// A 0.1 outcome as the current version's (0.1's are a subset).
fn from_v0_1(outcome: v0_1::exports::ferry::transport::transport::Outcome) -> Outcome {
    use super::Failure;
    use v0_1::exports::ferry::transport::transport::Outcome as Old;
    let failure =
        |f: v0_1::ferry::transport::types::Failure| Failure { reason: f.reason, retry_after_ms: f.retry_after_ms };
    match outcome {
        Old::Success => Outcome::Success,
        Old::Transient(f) => Outcome::Transient(failure(f)),
        Old::Permanent(f) => Outcome::Permanent(failure(f)),
    }
}

impl v0_1::ferry::transport::types::Host for HostState {}

impl v0_1::ferry::transport::logging::Host for HostState {
    fn log(&mut self, level: v0_1::ferry::transport::logging::Level, message: String) {
        use super::bindings::ferry::transport::logging::{Host, Level};
        use v0_1::ferry::transport::logging::Level as Old;
        let level = match level {
            Old::Trace => Level::Trace,
            Old::Debug => Level::Debug,
            Old::Info => Level::Info,
            Old::Warn => Level::Warn,
            Old::Error => Level::Error,
        };
        <HostState as Host>::log(self, level, message);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contract_versions_are_read_by_semver() {
        let of = |v: &str| Contract::of([format!("ferry:transport/transport@{v}").as_str()]);
        assert_eq!(of(WIT_VERSION), Ok(Some(Contract::Current)));
        assert_eq!(of("0.2.7"), Ok(Some(Contract::Current)), "a compatible patch release");
        assert_eq!(of("0.1.0"), Ok(Some(Contract::V0_1)));
        assert_eq!(of("0.1.3"), Ok(Some(Contract::V0_1)));
        let err = of("0.3.0").unwrap_err();
        assert!(err.contains("ferry:transport@0.3.0") && err.contains("@0.2.0") && err.contains("@0.1.0"), "{err}");
        assert!(of("1.0.0").is_err());
        assert!(of("garbage").is_err());
        assert_eq!(Contract::of(["wasi:cli/run@0.2.0"]), Ok(None), "no transport export: left to the world check");
    }
}
