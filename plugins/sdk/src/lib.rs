//! Write a ferry transport in Rust.
//!
//! A transport is a type implementing [`Transport`], exported with [`transport!`]:
//!
//! ```ignore
//! use ferry_plugin_sdk::{Config, Event, Outcome, Transport, outcome};
//!
//! struct Stdout { prefix: String }
//!
//! impl Transport for Stdout {
//!     const NAME: &'static str = "stdout";
//!     // VERSION defaults to this crate's version (Cargo.toml).
//!
//!     fn init(config: &mut Config) -> Result<Self, String> {
//!         Ok(Stdout { prefix: config.optional("prefix").unwrap_or_default() })
//!     }
//!
//!     fn deliver(&mut self, events: Vec<Event>) -> Vec<Outcome> {
//!         events.iter().map(|e| { println!("{}{}", self.prefix, e.id); outcome::success() }).collect()
//!     }
//! }
//!
//! ferry_plugin_sdk::transport!(Stdout);
//! ```
//!
//! Build it as a `cdylib` for `wasm32-wasip2`; the result is a component ferry loads as it is.
//! Ferry calls `init` once per instance with the route's `config` table, then `deliver` with
//! batches; [`Config::finish`] turns keys nobody asked for into an error that names them, so a
//! typo in ferry's configuration is reported rather than ignored.

// The generated export macro refers to this crate by name, also from inside it.
extern crate self as ferry_plugin_sdk;

/// The bindings of the `ferry:transport` world, generated from the SDK's own copy of the WIT
/// package (`plugins/sdk/wit`, kept identical to the repository's `wit/` by a test), so a
/// transport crate anywhere builds with a dependency on this crate alone.
pub mod bindings {
    wit_bindgen::generate!({
        path: "wit",
        world: "transport-plugin",
        pub_export_macro: true,
        export_macro_name: "export_bindings",
        default_bindings_module: "ferry_plugin_sdk::bindings",
        runtime_path: "ferry_plugin_sdk::__private::wit_bindgen::rt",
    });
}

pub mod cloudevents;
mod config;
pub mod time;

pub use bindings::exports::ferry::transport::transport::{Event, Outcome, PluginInfo};
pub use bindings::ferry::transport::types::{Deferral, Failure};
pub use config::Config;

#[doc(hidden)]
pub mod __private {
    pub use wit_bindgen;
}

/// A transport: one value per plugin instance, made by `init` from the route's configuration.
pub trait Transport: Sized + 'static {
    /// The name routes use to select the plugin: lowercase letters, digits and `-`.
    const NAME: &'static str;
    /// The plugin's own version, shown by `ferry plugins list`. Left empty (the default),
    /// [`transport!`] fills in the plugin crate's version (its `CARGO_PKG_VERSION`).
    const VERSION: &'static str = "";

    /// Builds the transport for one route from its configuration. An error message should name
    /// the bad key; ferry then refuses the plugin for that route and says why.
    fn init(config: &mut Config) -> Result<Self, String>;

    /// Delivers a batch of events of one route: exactly one outcome per event, in order.
    fn deliver(&mut self, events: Vec<Event>) -> Vec<Outcome>;
}

/// Exports a [`Transport`] implementation as the plugin's `ferry:transport/transport` interface.
#[macro_export]
macro_rules! transport {
    ($transport:ty) => {
        #[doc(hidden)]
        struct __FerryExport;

        ::std::thread_local! {
            static __FERRY_TRANSPORT: ::std::cell::RefCell<::std::option::Option<$transport>> =
                const { ::std::cell::RefCell::new(::std::option::Option::None) };
        }

        impl $crate::bindings::exports::ferry::transport::transport::Guest for __FerryExport {
            fn metadata() -> $crate::PluginInfo {
                let version = match <$transport as $crate::Transport>::VERSION {
                    // Expanded in the plugin crate: its own version.
                    "" => ::std::env!("CARGO_PKG_VERSION"),
                    version => version,
                };
                $crate::PluginInfo { name: <$transport as $crate::Transport>::NAME.into(), version: version.into() }
            }

            fn init(config: ::std::vec::Vec<(::std::string::String, ::std::string::String)>) -> Result<(), String> {
                let mut config = $crate::Config::new(config);
                let transport = <$transport as $crate::Transport>::init(&mut config)?;
                config.finish()?;
                __FERRY_TRANSPORT.with(|slot| *slot.borrow_mut() = ::std::option::Option::Some(transport));
                Ok(())
            }

            fn deliver_batch(events: ::std::vec::Vec<$crate::Event>) -> ::std::vec::Vec<$crate::Outcome> {
                __FERRY_TRANSPORT.with(|slot| match slot.borrow_mut().as_mut() {
                    ::std::option::Option::Some(transport) => {
                        <$transport as $crate::Transport>::deliver(transport, events)
                    }
                    ::std::option::Option::None => events
                        .iter()
                        .map(|_| $crate::outcome::permanent(concat!(stringify!($transport), ": init was not called")))
                        .collect(),
                })
            }
        }

        $crate::bindings::export_bindings!(__FerryExport);
    };
}

/// Building outcomes.
pub mod outcome {
    use super::{Deferral, Failure, Outcome};

    /// The receiver has the event.
    pub fn success() -> Outcome {
        Outcome::Success
    }

    /// Worth retrying later, with the route's backoff.
    pub fn transient(reason: impl Into<String>) -> Outcome {
        Outcome::Transient(Failure { reason: reason.into(), retry_after_ms: None })
    }

    /// Worth retrying, but not before `retry_after_ms` (the receiver said so).
    pub fn transient_after(reason: impl Into<String>, retry_after_ms: Option<u64>) -> Outcome {
        Outcome::Transient(Failure { reason: reason.into(), retry_after_ms })
    }

    /// Can never succeed as the event stands: FAILED now, kept for inspection and resend.
    pub fn permanent(reason: impl Into<String>) -> Outcome {
        Outcome::Permanent(Failure { reason: reason.into(), retry_after_ms: None })
    }

    /// The receiver is fine but asked to wait (it rate-limits): deliver the event again after
    /// `delay_ms` without counting an attempt or touching the route's circuit breaker. The wait
    /// is the route's: the ferry instance that got this answer claims none of the route's events
    /// until then.
    pub fn deferred(reason: impl Into<String>, delay_ms: u64) -> Outcome {
        Outcome::Deferred(Deferral { reason: reason.into(), delay_ms })
    }
}

/// Writing to ferry's log, tagged with the plugin's name.
pub mod log {
    use super::bindings::ferry::transport::logging::{Level, log};

    pub fn debug(message: &str) {
        log(Level::Debug, message);
    }

    pub fn info(message: &str) {
        log(Level::Info, message);
    }

    pub fn warn(message: &str) {
        log(Level::Warn, message);
    }

    pub fn error(message: &str) {
        log(Level::Error, message);
    }
}
