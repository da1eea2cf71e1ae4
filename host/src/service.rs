//! Start-up wiring: open and migrate the store, load the plugins, start a transport per route,
//! and build the relay. `serve` is the same function in production and in tests.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, SystemClock};
use crate::config::{Config, redact_url};
use crate::plugins::{Plugin, RouteTransport, Runtime};
use crate::relay::{Relay, Routes};
use crate::store::{self, Store};

/// A started ferry: everything `serve` runs, exposed so tests can drive single cycles.
#[derive(Debug)]
pub struct Ferry {
    pub store: Arc<dyn Store>,
    pub relay: Relay,
    pub plugins: BTreeMap<String, Arc<Plugin>>,
}

impl Ferry {
    /// Opens the database (migrating it), loads the plugins and starts every route's transport.
    /// A route whose plugin is missing or rejects its config is logged; its events fail with
    /// reason `no_transport` and can be resent once it is fixed.
    pub async fn start(config: &Config, clock: Arc<dyn Clock>) -> anyhow::Result<Ferry> {
        let store = open_store(config).await?;
        let runtime = Arc::new(Runtime::new()?);
        let plugins = runtime.load_dir(&config.plugins.dir).await?;
        let mut transports = HashMap::new();
        for (route, route_config) in &config.route {
            let started = match plugins.get(&route_config.plugin) {
                Some(plugin) => RouteTransport::start(runtime.clone(), plugin.clone(), route, config)
                    .await
                    .map(Arc::new)
                    .map_err(|fault| fault.to_string()),
                None => Err(format!(
                    "plugin {:?} of route {route:?} is not loaded (loaded: {})",
                    route_config.plugin,
                    if plugins.is_empty() {
                        "none".to_string()
                    } else {
                        plugins.keys().cloned().collect::<Vec<_>>().join(", ")
                    }
                )),
            };
            match &started {
                Ok(t) => tracing::info!(route = %route, plugin = %t.plugin().info.name, "route ready"),
                Err(why) => tracing::error!(route = %route, "route has no transport: {why}"),
            }
            transports.insert(route.clone(), started);
        }
        let relay = Relay::new(store.clone(), clock, config, Routes::new(config, transports));
        Ok(Ferry { store, relay, plugins })
    }
}

/// Connects to the configured database and applies pending migrations.
pub async fn open_store(config: &Config) -> anyhow::Result<Arc<dyn Store>> {
    let url = &config.database.url;
    let store = store::connect(url, config.database.max_connections).await?;
    store.migrate().await.with_context(|| format!("migrating {}", redact_url(url)))?;
    Ok(store)
}

/// Runs ferry until `shutdown` is cancelled.
pub async fn serve(config: &Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let ferry = Ferry::start(config, Arc::new(SystemClock)).await?;
    ferry.relay.run(shutdown).await;
    Ok(())
}
