//! Start-up wiring: open and migrate the store, load the plugins (and watch for changes), make a
//! transport per route, and build the relay. `serve` is the same function in production and in
//! tests.

use std::sync::Arc;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use crate::admin::Admin;
use crate::clock::{Clock, SystemClock};
use crate::config::{Config, Settings};
use crate::metrics::Metrics;
use crate::plugins::{Registry, Runtime, route_transports};
use crate::relay::{Relay, Routes};
use crate::store::{self, Store, redact_url};

/// A started ferry: everything `serve` runs, exposed so tests can drive single cycles and reloads.
#[derive(Debug)]
pub struct Ferry {
    pub settings: Arc<Settings>,
    pub store: Arc<dyn Store>,
    pub relay: Relay,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    pub clock: Arc<dyn Clock>,
}

impl Ferry {
    /// Opens the database (migrating it), loads the plugins and prepares every route's transport.
    /// A route whose plugin is missing or rejects its config is logged; its events fail with
    /// reason `no_transport` (and can be resent) until a working plugin is loaded.
    pub async fn start(config: &Config, clock: Arc<dyn Clock>) -> anyhow::Result<Ferry> {
        let settings = Arc::new(config.settings()?);
        let store = open_store(config).await?;
        let runtime = Arc::new(Runtime::new(&settings)?);
        let metrics = Arc::new(Metrics::new());
        let registry = Arc::new(Registry::new(runtime, settings.clone(), metrics.clone()));
        registry.load_dir().await?;
        let transports = route_transports(&registry, &settings);
        for (route, transport) in &transports {
            match transport.warm_up().await {
                Ok(()) => tracing::info!(route = %route, plugin = %transport.plugin_name(), "route ready"),
                Err(why) => tracing::error!(route = %route, "route has no transport: {why}"),
            }
        }
        let routes = Routes::new(settings.clone(), transports);
        let relay = Relay::new(store.clone(), clock.clone(), routes, metrics.clone());
        Ok(Ferry { settings, store, relay, registry, metrics, clock })
    }

    /// The admin API over this ferry (not yet serving).
    pub fn admin(&self) -> anyhow::Result<Admin> {
        Admin::new(
            self.settings.clone(),
            self.store.clone(),
            self.registry.clone(),
            self.metrics.clone(),
            self.clock.clone(),
            self.relay.waker(),
            self.relay.health(),
        )
    }
}

/// Connects to the configured database (creating a missing SQLite file) and applies pending
/// migrations: what `serve` and `migrate` do.
pub async fn open_store(config: &Config) -> anyhow::Result<Arc<dyn Store>> {
    open(config, true).await
}

/// Connects to the configured database, which must exist, and applies pending migrations: what
/// every other command does, so a mistyped path is an error rather than a new, empty database.
pub async fn open_existing_store(config: &Config) -> anyhow::Result<Arc<dyn Store>> {
    open(config, false).await
}

async fn open(config: &Config, create: bool) -> anyhow::Result<Arc<dyn Store>> {
    let url = &config.database.url;
    let store = store::connect(url, config.database.max_connections, create).await?;
    store.migrate().await.with_context(|| format!("migrating {}", redact_url(url)))?;
    Ok(store)
}

/// Runs ferry until `shutdown` is cancelled, which may come while it is still starting (loading
/// plugins, say): then it stops at once.
pub async fn serve(config: &Config, shutdown: CancellationToken) -> anyhow::Result<()> {
    let ferry = tokio::select! {
        ferry = Ferry::start(config, Arc::new(SystemClock)) => ferry?,
        _ = shutdown.cancelled() => {
            tracing::info!("shutdown requested while starting; stopped");
            return Ok(());
        }
    };
    if config.plugins.watch {
        crate::watch::spawn(ferry.registry.clone(), config.plugins.debounce.0, shutdown.child_token())?;
    }
    let admin = match config.admin.address() {
        Some(_) => Some(ferry.admin()?.serve(shutdown.child_token()).await?),
        None => None,
    };
    ferry.relay.run(shutdown).await;
    if let Some((_, admin)) = admin {
        let _ = admin.await;
    }
    Ok(())
}
