//! Start-up wiring: open and migrate the store, load the plugins (and watch for changes), make a
//! transport per route, and build the relay. `serve` is the same function in production and in
//! tests.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use crate::admin::Admin;
use crate::clock::{Clock, SystemClock};
use crate::config::{Config, Settings};
use crate::live::Live;
use crate::metrics::Metrics;
use crate::plugins::{Registry, RouteTransport, Runtime, route_transports};
use crate::relay::{Relay, Routes};
use crate::report::{ConfigCheck, RouteCheck};
use crate::store::{self, Store, redact_url};

/// A started ferry: everything `serve` runs, exposed so tests can drive single cycles and reloads.
#[derive(Debug)]
pub struct Ferry {
    /// The settings in effect, shared with the registry and the admin API; replaced by
    /// [`Ferry::reload`].
    pub settings: Arc<Live<Settings>>,
    pub store: Arc<dyn Store>,
    pub relay: Relay,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    pub clock: Arc<dyn Clock>,
    /// The trace exporter, when `telemetry.otlp_endpoint` is set: stopped (and flushed) by
    /// [`Ferry::flush_traces`].
    traces: Option<(CancellationToken, tokio::sync::Mutex<Option<tokio::task::JoinHandle<()>>>)>,
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
        let live = Arc::new(Live::new(settings.clone()));
        let registry = Arc::new(Registry::sharing(runtime, live.clone(), metrics.clone()));
        registry.load_dir().await?;
        let transports = route_transports(&registry, &settings);
        let checks = warm_up(&transports).await;
        for check in &checks {
            match &check.error {
                None => tracing::info!(route = %check.route, plugin = %check.plugin, "route ready"),
                Some(why) => tracing::error!(route = %check.route, "route has no transport: {why}"),
            }
        }
        for warning in warnings(&settings, &registry).into_iter().chain(private_origins(&settings).await) {
            tracing::warn!("{warning}");
        }
        let routes = Routes::new(settings.clone(), transports);
        let stop_traces = CancellationToken::new();
        let tracer = crate::telemetry::Tracer::start(
            &config.telemetry,
            &config.instance_id(),
            metrics.trace_spans_dropped.clone(),
            stop_traces.clone(),
        )?;
        let (tracer, traces) = match tracer {
            Some((tracer, task)) => (Some(tracer), Some((stop_traces, tokio::sync::Mutex::new(Some(task))))),
            None => (None, None),
        };
        let relay = Relay::new(store.clone(), clock.clone(), routes, metrics.clone()).with_tracer(tracer);
        Ok(Ferry { settings: live, store, relay, registry, metrics, clock, traces })
    }

    /// Sends the traces still queued and stops the exporter (waiting at most a few seconds for the
    /// collector). Nothing to do without `telemetry.otlp_endpoint`.
    pub async fn flush_traces(&self) {
        let Some((stop, task)) = &self.traces else { return };
        stop.cancel();
        if let Some(task) = task.lock().await.take()
            && tokio::time::timeout(std::time::Duration::from_secs(5), task).await.is_err()
        {
            tracing::warn!("the trace exporter did not finish within 5 s; the last spans are lost");
        }
    }

    /// Puts `config`'s routes and retry policies in effect while deliveries go on (what SIGHUP
    /// does). A route whose plugin and plugin config did not change keeps its transport and its
    /// warm instances (a new retry policy needs no new instance); a new one, or one whose plugin
    /// or config changed, gets a new transport, whose plugin must accept the config (its `init`
    /// runs first); a removed route's events fail with `no_transport` from then on, as at start.
    /// Batches in flight finish with the table they were claimed under.
    ///
    /// `[database]`, `[relay]`, `[breaker]`, `[admin]` and `[telemetry]` keep their running values (named in the
    /// answer); a change to `[plugins]` or `[sandbox.*]`, which routes depend on, needs a restart
    /// and refuses the reload. When anything is wrong nothing changes, and the error says why.
    pub async fn reload(&self, mut config: Config) -> anyhow::Result<ConfigReload> {
        // No plugin version is swapped in while the route table changes under it.
        let _plugins = self.registry.hold_reloads().await;
        let running = self.settings.get();
        let needs_restart = keep_restart_only(&mut config, &running.config);
        for (table, changed) in [
            ("[plugins]", config.plugins != running.config.plugins),
            ("[sandbox.*]", config.sandbox != running.config.sandbox),
        ] {
            if changed {
                anyhow::bail!(
                    "{table} differs from the running configuration, and the routes' plugins run under it: \
                     restart ferry to apply it"
                );
            }
        }
        let settings = Arc::new(config.settings()?);
        if let Some(why) = incomplete(&settings, &self.registry) {
            anyhow::bail!("{why}");
        }
        let current = self.relay.routes();
        let mut reload = ConfigReload { needs_restart, ..ConfigReload::default() };
        let mut transports = HashMap::new();
        let mut fresh = Vec::new();
        for (name, fan_out) in &settings.fan_outs {
            match running.fan_outs.get(name) {
                None if running.routes.contains_key(name) => reload.changed.push(name.clone()),
                None => reload.added.push(name.clone()),
                Some(before) if before != fan_out => reload.changed.push(name.clone()),
                Some(_) => reload.unchanged.push(name.clone()),
            }
        }
        for (name, route) in &settings.routes {
            match running.routes.get(name) {
                None if running.fan_outs.contains_key(name) => reload.changed.push(name.clone()),
                None => reload.added.push(name.clone()),
                Some(before) if before != route => reload.changed.push(name.clone()),
                Some(_) => reload.unchanged.push(name.clone()),
            }
            let transport = match current.transport(name) {
                Some(transport) if transport.serves(route) => transport.clone(),
                _ => {
                    reload.restarted.push(name.clone());
                    let transport = Arc::new(RouteTransport::new(self.registry.clone(), route.clone()));
                    fresh.push((name.clone(), transport.clone()));
                    transport
                }
            };
            transports.insert(name.clone(), transport);
        }
        reload.removed = running.route_names().into_iter().filter(|name| !settings.is_configured(name)).collect();
        for names in [&mut reload.added, &mut reload.changed, &mut reload.unchanged, &mut reload.restarted] {
            names.sort_unstable();
        }
        // The transports replaced or removed may still be delivering (their instances in use until
        // their batches finish) while the new ones start: the pool must hold both.
        let outgoing: Vec<&Arc<RouteTransport>> = current
            .transports()
            .filter(|(name, old)| transports.get(*name).is_none_or(|new| !Arc::ptr_eq(old, new)))
            .map(|(_, old)| old)
            .collect();
        let needed = settings.route_instances() + outgoing.iter().map(|t| t.instance_limit()).sum::<usize>();
        let room = self.registry.runtime().route_slots();
        if needed > room {
            anyhow::bail!(
                "the routes would need up to {needed} plugin instances at once while the change is made, more \
                 than the {room} reserved when ferry started; restart ferry to apply this configuration"
            );
        }
        for (route, transport) in fresh {
            if let Err(why) = transport.warm_up().await {
                if !settings.config.relay.allow_incomplete {
                    anyhow::bail!("route {route:?}: {why}");
                }
                tracing::error!(route = %route, "route has no transport: {why}");
            }
        }
        self.settings.set(settings.clone());
        self.relay.replace_routes(Routes::new(settings, transports));
        // The outgoing transports' idle instances free their pool slots now; calls in flight
        // keep theirs until they end.
        for transport in &outgoing {
            transport.drain_idle();
        }
        self.relay.wake();
        Ok(reload)
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

/// What a configuration reload changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigReload {
    pub added: Vec<String>,
    /// Routes whose settings changed (plugin, config, ordering or retry policy).
    pub changed: Vec<String>,
    pub removed: Vec<String>,
    pub unchanged: Vec<String>,
    /// Routes given a new transport (new, or a new plugin or plugin config), whose `init` ran.
    pub restarted: Vec<String>,
    /// Tables that differ from the running configuration but take effect only after a restart.
    pub needs_restart: Vec<&'static str>,
}

/// Gives `config` the running values of the tables a running ferry does not change, and names
/// the tables that differed.
fn keep_restart_only(config: &mut Config, running: &Config) -> Vec<&'static str> {
    let mut differ = Vec::new();
    macro_rules! keep {
        ($($field:ident => $table:literal),*) => {$(
            if config.$field != running.$field {
                differ.push($table);
                config.$field = running.$field.clone();
            }
        )*};
    }
    keep!(
        database => "[database]",
        relay => "[relay]",
        breaker => "[breaker]",
        admin => "[admin]",
        telemetry => "[telemetry]"
    );
    differ
}

/// Makes each route's first plugin instance (running the plugin's `init` with the route's
/// config), in route order.
async fn warm_up(transports: &HashMap<String, Arc<RouteTransport>>) -> Vec<RouteCheck> {
    let mut routes: Vec<_> = transports.iter().collect();
    routes.sort_by_key(|(name, _)| name.as_str());
    let mut checks = Vec::with_capacity(routes.len());
    for (route, transport) in routes {
        let error = transport.warm_up().await.err();
        checks.push(RouteCheck {
            route: route.clone(),
            plugin: transport.plugin_name().to_string(),
            ready: error.is_none(),
            error,
        });
    }
    checks
}

/// What is probably a mistake in the configuration but does not stop ferry: plugin files that
/// did not load, and `[sandbox.NAME]` tables for plugins that are not loaded (a typo there leaves
/// the real plugin with the defaults: no grants).
fn warnings(settings: &Settings, registry: &Registry) -> Vec<String> {
    let loaded = registry.names();
    let (_, failed) = registry.status();
    let mut warnings: Vec<String> =
        failed.iter().map(|(file, why)| format!("plugin file {} did not load: {why}", file.display())).collect();
    warnings.extend(settings.config.pool_warning());
    warnings.extend(settings.config.lease_warnings());
    // An endpoint origin the plugin may not reach: every request to such an endpoint is refused.
    for fan_out in settings.fan_outs.values() {
        let Some(endpoints) = &fan_out.endpoints else { continue };
        let Some(template) = settings.routes.get(&endpoints.template) else { continue };
        let grant = &settings.plugin(&template.plugin).sandbox.http;
        let granted = |origin: &String| grant.iter().any(|g| g == origin || crate::config::origin_matches(g, origin));
        for origin in endpoints.origins.iter().filter(|o| !granted(o)) {
            warnings.push(format!(
                "route.{}.endpoints.origins: {origin} is not among sandbox.{}.http, so the plugin may not reach endpoints there; \
                 grant it the same origins",
                fan_out.route, template.plugin
            ));
        }
    }
    for name in settings.config.sandbox.keys().filter(|name| !loaded.contains(name)) {
        warnings.push(format!(
            "[sandbox.{name}] is for a plugin named {name:?}, but no plugin of that name is loaded from {} \
             (loaded: {}); check the name the plugin reports in `ferry plugins list`",
            registry.dir().display(),
            if loaded.is_empty() { "none".to_string() } else { loaded.join(", ") }
        ));
    }
    warnings
}

/// Allowed wasi:http origins whose host name resolves, now, to non-public addresses only, in the
/// sandbox of a plugin without `http_private`: every request to them would be refused. Names that
/// do not resolve are left to the requests themselves (the answer may change before they are
/// made).
async fn private_origins(settings: &Settings) -> Vec<String> {
    let mut warnings = Vec::new();
    for (plugin, sandbox) in &settings.config.sandbox {
        if sandbox.http_private {
            continue;
        }
        for origin in &sandbox.http {
            let Ok(uri) = origin.parse::<http::Uri>() else { continue };
            let Some(host) = uri.host().filter(|h| !h.starts_with('*') && h.parse::<std::net::IpAddr>().is_err())
            else {
                continue;
            };
            let Ok(Ok(found)) =
                tokio::time::timeout(std::time::Duration::from_secs(2), tokio::net::lookup_host((host, 80))).await
            else {
                continue;
            };
            let found: Vec<std::net::IpAddr> = found.map(|a| a.ip()).collect();
            if !found.is_empty() && !found.iter().copied().any(crate::plugins::is_public) {
                let found: Vec<String> = found.iter().map(ToString::to_string).collect();
                warnings.push(format!(
                    "sandbox.{plugin}.http: {host} resolves to non-public addresses only ({}), so requests to {origin} \
                     will be refused; set sandbox.{plugin}.http_private = true if it is meant to be reached",
                    found.join(", ")
                ));
            }
        }
    }
    warnings
}

const INCOMPLETE_HINT: &str =
    "set relay.allow_incomplete = true (or FERRY_RELAY_ALLOW_INCOMPLETE=true) to start anyway";

/// Why `serve` must not start with no routes (unless `relay.allow_incomplete`).
fn no_routes(config: &Config) -> Option<String> {
    (!config.relay.allow_incomplete && config.route.is_empty()).then(|| {
        format!(
            "no routes are configured, so nothing would be delivered: add a [route.NAME] table with \
             plugin = \"…\", or {INCOMPLETE_HINT}"
        )
    })
}

/// Why `serve` must not start (unless `relay.allow_incomplete`): no routes, or routes whose
/// plugin has no file in the plugins directory (a mistyped name, a plugin not deployed). A
/// plugin whose file is there but does not load (broken, hostile, over its limits) does not stop
/// `serve`: its routes' events fail alone, with reason no_transport, and the others flow.
fn incomplete(settings: &Settings, registry: &Registry) -> Option<String> {
    if let Some(why) = no_routes(&settings.config) {
        return Some(why);
    }
    if settings.config.relay.allow_incomplete {
        return None;
    }
    let loaded = registry.names();
    let missing: Vec<String> = settings
        .routes
        .values()
        .filter(|route| {
            !loaded.contains(&route.plugin) && !registry.dir().join(format!("{}.wasm", route.plugin)).exists()
        })
        .map(|route| format!("route {:?} needs plugin {:?}", route.name, route.plugin))
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "{}, which is not loaded from {} (loaded: {}): check the plugin name and the directory \
             (`ferry plugins list`), or {INCOMPLETE_HINT}",
            missing.join("; "),
            registry.dir().display(),
            if loaded.is_empty() { "none".to_string() } else { loaded.join(", ") }
        )
    })
}

/// Everything `serve` checks before it starts, except the database: the configuration (already
/// loaded), the admin token, the plugins directory, and each route's plugin and `init`.
pub async fn check(config: &Config) -> anyhow::Result<ConfigCheck> {
    let settings = Arc::new(config.settings()?);
    let mut errors = Vec::new();
    if config.admin.address().is_some()
        && let Err(why) = config.admin.bearer_token()
    {
        errors.push(why);
    }
    let runtime = Arc::new(Runtime::new(&settings)?);
    let registry = Arc::new(Registry::new(runtime, settings.clone(), Arc::default()));
    registry.load_dir().await?;
    let routes = warm_up(&route_transports(&registry, &settings)).await;
    errors.extend(incomplete(&settings, &registry));
    errors.extend(routes.iter().filter_map(|r| r.error.as_ref().map(|why| format!("route {:?}: {why}", r.route))));
    let mut warnings = warnings(&settings, &registry);
    warnings.extend(private_origins(&settings).await);
    if settings.routes.is_empty() && config.relay.allow_incomplete {
        warnings.push("no routes are configured: nothing will be delivered".into());
    }
    Ok(ConfigCheck {
        ok: errors.is_empty(),
        database: redact_url(&config.database.url),
        plugins: crate::ops::plugins(&registry),
        routes,
        errors,
        warnings,
    })
}

/// Tells systemd every `every` that ferry is alive, as long as no relay worker is wedged (stuck
/// in one cycle past its lease): then it stays silent, and systemd restarts the service.
async fn watchdog(
    systemd: Arc<crate::systemd::Notifier>,
    every: std::time::Duration,
    health: Arc<crate::relay::RelayHealth>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled() => return,
        }
        match health.wedged() {
            None => systemd.notify("WATCHDOG=1"),
            Some(why) => tracing::error!("not telling systemd's watchdog that ferry is alive: {why}"),
        }
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
    let store = store::open(&config.database, create).await?;
    store.migrate().await.with_context(|| format!("migrating {}", redact_url(url)))?;
    Ok(store)
}

/// Reads the configuration again, from where it was read at start: what a reload puts in effect.
pub type Reread = Box<dyn Fn() -> anyhow::Result<Config> + Send + Sync>;

/// Raises the soft limit on open files to the hard limit, as servers that hold many connections do,
/// and returns the soft limit now in force (`None`: unlimited). Every plugin socket, pooled HTTP
/// connection, granted directory and database connection takes a descriptor; many systems start
/// processes at 1024, which a few busy plugins can use up (a start that then fails waits and is
/// tried again, see `plugins::pool`). The hard limit is the operator's (systemd's `LimitNOFILE=`,
/// `ulimit -Hn`) and stays as it is. macOS refuses a soft limit above `OPEN_MAX` (10240), however
/// high the hard one.
fn raise_open_files_limit() -> Option<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    const OPEN_MAX: u64 = 10240;
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current?;
    let most = match limit.maximum {
        _ if cfg!(target_os = "macos") => limit.maximum.map_or(OPEN_MAX, |hard| hard.min(OPEN_MAX)),
        Some(hard) => hard,
        // Unlimited: Linux never says so for open files; elsewhere the soft limit stays.
        None => return Some(soft),
    };
    if soft >= most {
        return Some(soft);
    }
    match setrlimit(Resource::Nofile, Rlimit { current: Some(most), maximum: limit.maximum }) {
        Ok(()) => Some(most),
        Err(e) => {
            tracing::warn!(soft, most, "could not raise the limit on open files: {e}");
            Some(soft)
        }
    }
}

/// Runs ferry until `shutdown` is cancelled, which may come while it is still starting (loading
/// plugins, say): then it stops at once. With `reread`, SIGHUP reloads the configuration
/// ([`Ferry::reload`]).
pub async fn serve(config: &Config, shutdown: CancellationToken, reread: Option<Reread>) -> anyhow::Result<()> {
    // Before the database is opened or created.
    if let Some(why) = no_routes(config) {
        anyhow::bail!("not starting: {why}");
    }
    // Listening from the start: SIGHUP's default action would end the process, and a reload asked
    // for while ferry starts is done once it has.
    let hangups = match reread {
        Some(reread) => Some((hangups()?, reread)),
        None => None,
    };
    let open_files = raise_open_files_limit();
    let ferry = tokio::select! {
        ferry = Ferry::start(config, Arc::new(SystemClock)) => ferry?,
        _ = shutdown.cancelled() => {
            tracing::info!("shutdown requested while starting; stopped");
            return Ok(());
        }
    };
    if let Some(why) = incomplete(&ferry.settings.get(), &ferry.registry) {
        anyhow::bail!("not starting: {why}");
    }
    if config.plugins.watch {
        crate::watch::spawn(ferry.registry.clone(), config.plugins.debounce.0, shutdown.child_token())?;
    }
    let admin = match config.admin.address() {
        Some(_) => Some(ferry.admin()?.serve(shutdown.child_token()).await?),
        None => None,
    };
    let plugins: Vec<String> = ferry
        .registry
        .status()
        .0
        .iter()
        .map(|p| format!("{} {}", crate::untrusted::clean(&p.name, 64), crate::untrusted::clean(&p.version, 32)))
        .collect();
    let routes = route_names(&ferry.settings.get());
    tracing::info!(
        version = crate::cli::VERSION,
        config = %config.file.as_deref().map_or_else(|| "(built-in defaults)".into(), |p| p.display().to_string()),
        database = %redact_url(&config.database.url),
        routes = %routes,
        plugins = %plugins.join(","),
        admin = %admin.as_ref().map_or_else(|| "off".into(), |(address, _)| address.to_string()),
        open_files = %open_files.map_or_else(|| "unlimited".into(), |n| n.to_string()),
        "ferry started"
    );
    let systemd = Arc::new(crate::systemd::Notifier::from_env());
    systemd.notify(&format!("READY=1\nSTATUS=delivering routes {routes}"));
    if let Some(every) = systemd.watchdog_interval() {
        tokio::spawn(watchdog(systemd.clone(), every, ferry.relay.health(), shutdown.child_token()));
    }
    // As soon as the stop is asked for, while deliveries in flight finish; joined, so it is sent
    // before `serve` returns.
    let stopping = async {
        shutdown.cancelled().await;
        systemd.notify("STOPPING=1");
    };
    let reloads = async {
        if let Some((hangups, reread)) = hangups {
            reload_on_hangup(&ferry, hangups, reread, &systemd, &shutdown).await;
        }
    };
    tokio::join!(ferry.relay.run(shutdown.clone()), stopping, reloads);
    ferry.flush_traces().await;
    if let Some((_, admin)) = admin {
        let _ = admin.await;
    }
    Ok(())
}

/// The configured routes' names, comma-separated, for the log and systemd's status line.
fn route_names(settings: &Settings) -> String {
    settings.route_names().join(",")
}

fn hangups() -> anyhow::Result<tokio::signal::unix::Signal> {
    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).context("listening for SIGHUP")
}

/// Reloads the configuration on every SIGHUP until `shutdown`. A configuration that cannot be
/// read or put in effect is logged and changes nothing: the running one stays.
async fn reload_on_hangup(
    ferry: &Ferry,
    mut hangups: tokio::signal::unix::Signal,
    reread: Reread,
    systemd: &crate::systemd::Notifier,
    shutdown: &CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            got = hangups.recv() => if got.is_none() { return },
        }
        systemd.notify("STATUS=reloading the configuration");
        tracing::info!("SIGHUP: reloading the configuration");
        let reload = async {
            match reread() {
                Ok(config) => ferry.reload(config).await,
                Err(e) => Err(e),
            }
        };
        // Nothing changes until a reload's last step, so a stop may cut one short.
        let result = tokio::select! {
            result = reload => result,
            _ = shutdown.cancelled() => return,
        };
        match result {
            Ok(done) => {
                tracing::info!(
                    added = %done.added.join(","),
                    changed = %done.changed.join(","),
                    removed = %done.removed.join(","),
                    unchanged = done.unchanged.len(),
                    restarted = %done.restarted.join(","),
                    "configuration reloaded; batches in flight finish under the previous one"
                );
                for table in done.needs_restart {
                    tracing::warn!("{table} changed, but a running ferry keeps its value; restart ferry to apply it");
                }
            }
            Err(e) => tracing::error!("configuration not reloaded, the running one stays: {e:#}"),
        }
        systemd.notify(&format!("STATUS=delivering routes {}", route_names(&ferry.settings.get())));
    }
}
