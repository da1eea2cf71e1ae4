//! The configuration resolved once into what each part of ferry runs on: per route its plugin,
//! the plugin's config, retry policy and ordering; per plugin its sandbox and limits. Built when
//! the configuration is validated, so nothing downstream re-derives a policy or can meet an
//! unvalidated value.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::grants::normalize_path;
use super::units::normalize_origin_pattern;
use super::{AfterFailure, BackoffKind, Config, JitterKind, PluginLimits, RetryOverrides, SandboxConfig};
use crate::backoff::{Backoff, Jitter, RetryPolicy};

/// Everything resolved from one [`Config`].
#[derive(Debug, Clone)]
pub struct Settings {
    /// The configuration as loaded and validated, for the settings that need no resolving.
    pub config: Config,
    /// Every route a plugin delivers, by name: the routes with a plugin of their own and each
    /// destination of a route with destinations (as `route/destination`).
    pub routes: BTreeMap<String, Arc<RouteSettings>>,
    /// The routes with destinations, by name: their events are handed on to each destination
    /// whose event types match, as a delivery of its own.
    pub fan_outs: BTreeMap<String, Arc<FanOut>>,
    /// The policy of events whose route is not configured.
    pub default_retry: RetryPolicy,
    /// Plugins with a `[sandbox.NAME]` table, by name.
    plugins: BTreeMap<String, Arc<PluginSettings>>,
    /// What a plugin without a `[sandbox.NAME]` table gets.
    default_plugin: Arc<PluginSettings>,
}

/// One route, ready to run.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteSettings {
    pub name: String,
    /// The plugin (by the name it reports) that delivers this route's events.
    pub plugin: String,
    /// The route's `config` table, handed to the plugin's `init`.
    pub plugin_config: Vec<(String, String)>,
    pub retry: RetryPolicy,
    pub ordering: Ordering,
    /// The route that gets a copy of each event the relay makes FAILED on this one.
    pub dead_letter: Option<String>,
    /// For a destination, the route it is a destination of.
    pub destination_of: Option<String>,
}

/// What separates a route's name from a destination's in the route its deliveries carry:
/// destination `crm` of route `orders` delivers the events of route `orders/crm`.
pub const DESTINATION_SEPARATOR: char = '/';

/// A route with destinations.
#[derive(Debug, Clone, PartialEq)]
pub struct FanOut {
    pub route: String,
    pub destinations: Vec<Destination>,
    pub ordering: Ordering,
    /// The route's own retry policy, which its destinations' overrides start from.
    pub retry: RetryPolicy,
    /// The route's `dead_letter`, which each destination has.
    pub dead_letter: Option<String>,
    /// Whether the route takes webhook endpoints at run time, and how they are delivered.
    pub endpoints: Option<Arc<EndpointsSettings>>,
}

/// A route's run-time webhook endpoints: each is a destination `route/ep_…`, delivered by the
/// `route/*` template's plugin with the template's config and the endpoint's own keys.
#[derive(Debug, Clone, PartialEq)]
pub struct EndpointsSettings {
    /// The route in [`Settings::routes`] every endpoint's deliveries are made with: `route/*`.
    pub template: String,
    /// The origins an endpoint's URL may have, normalized ([`normalize_origin_pattern`]).
    pub origins: Vec<String>,
}

/// The destination name of a route's endpoint template: `orders/*` delivers to every endpoint
/// of `orders`.
pub const ENDPOINT_TEMPLATE: &str = "*";

/// How the id of every run-time endpoint begins; its deliveries carry route `route/ep_…`.
pub const ENDPOINT_ID_PREFIX: &str = "ep_";

/// The `url` an endpoint template is started with when ferry checks that its plugin accepts the
/// template's config (each endpoint's own URL replaces it); the `.invalid` name never resolves.
pub const TEMPLATE_URL: &str = "https://endpoint.invalid/";

/// Keys of an endpoint template's config that each endpoint sets for itself.
const ENDPOINT_KEYS: [&str; 3] = ["url", "secret", "secret_previous"];

/// One destination of a [`FanOut`].
#[derive(Debug, Clone, PartialEq)]
pub struct Destination {
    /// Its name within the route.
    pub name: String,
    /// The route its deliveries carry (`route/destination`), configured in [`Settings::routes`].
    pub route: String,
    pub event_types: EventTypes,
}

impl FanOut {
    /// The routes of the destinations that receive events of type `event_type`.
    pub fn routes_for<'a>(&'a self, event_type: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.destinations.iter().filter(move |d| d.event_types.matches(event_type)).map(|d| d.route.as_str())
    }
}

/// The event types a destination receives: exact names or patterns with `*` for any run of
/// characters; none: every type.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EventTypes(Vec<String>);

impl EventTypes {
    pub(crate) fn new(patterns: &[String]) -> Result<EventTypes, String> {
        if let Some(bad) = patterns.iter().find(|p| p.trim().is_empty() || p.trim() != p.as_str()) {
            return Err(format!(
                "{bad:?} is not an event type; give names such as \"order.created\" or patterns such as \"order.*\""
            ));
        }
        Ok(EventTypes(patterns.to_vec()))
    }

    pub fn matches(&self, event_type: &str) -> bool {
        self.0.is_empty() || self.0.iter().any(|pattern| glob(pattern, event_type))
    }

    /// The patterns as configured.
    pub fn patterns(&self) -> &[String] {
        &self.0
    }
}

/// Whether `text` matches `pattern`, where `*` stands for any run of characters (none included)
/// and every other character for itself. The pieces between the stars are looked for in turn, each
/// at its first place after the one before (the first piece must begin the text, the last end it):
/// for stars alone that first place is always as good as any later one, so nothing is tried twice,
/// and a match takes time in proportion to the text and the pattern together. Event types come from
/// rows, patterns from whoever may create endpoints: neither can make the relay's matching slow.
fn glob(pattern: &str, text: &str) -> bool {
    let mut pieces = pattern.split('*');
    let first = pieces.next().unwrap_or_default();
    let Some(rest) = text.strip_prefix(first) else { return false };
    let mut middle: Vec<&str> = pieces.collect();
    let Some(last) = middle.pop() else { return rest.is_empty() };
    let Some(mut rest) = rest.strip_suffix(last) else { return false };
    for piece in middle {
        match rest.find(piece) {
            Some(at) => rest = &rest[at + piece.len()..],
            None => return false,
        }
    }
    true
}

/// Route `name`'s `dead_letter`, checked: another configured route, which has none of its own (a
/// dead letter that fails stays FAILED where it is, rather than travelling on).
fn dead_letter(config: &super::Config, name: &str, target: &str) -> Result<String, String> {
    let key = format!("route.{name}.dead_letter");
    let Some(route) = config.route.get(target) else {
        let known: Vec<&str> = config.route.keys().map(String::as_str).collect();
        return Err(format!("{key}: no route {target:?} is configured (configured: {})", known.join(", ")));
    };
    if target == name {
        return Err(format!("{key}: a route cannot be its own dead letter"));
    }
    if route.dead_letter.is_some() {
        return Err(format!(
            "{key}: route {target:?} has a dead_letter of its own; dead letters do not chain, so remove one"
        ));
    }
    Ok(target.to_string())
}

/// Whether a route delivers the events of one ordering key one at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ordering {
    /// Events go out as they are claimed.
    Unordered,
    /// One event per key in flight; with `failed_blocks_key`, a FAILED event holds back the
    /// rest of its key until it is resent or purged.
    Ordered { failed_blocks_key: bool },
}

/// What one plugin may touch, and how much it may use.
#[derive(Debug, Clone, PartialEq)]
pub struct PluginSettings {
    pub sandbox: Sandbox,
    pub limits: PluginLimits,
}

/// A plugin's grants, resolved: everything not listed is denied.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sandbox {
    /// Guest path → host directory (absolute, lexically normalized), pre-opened read-write.
    pub dirs: BTreeMap<String, PathBuf>,
    /// Environment variables the plugin sees.
    pub env: BTreeMap<String, String>,
    /// Whether the plugin's stdout and stderr reach ferry's.
    pub stdio: bool,
    /// `host:port` pairs the plugin may open TCP connections to (resolved per instance).
    pub tcp: Vec<String>,
    /// Whether the plugin may resolve host names itself.
    pub dns: bool,
    /// Origins (`scheme://host:port`, normalized; the host may begin with `*.`) the plugin may
    /// send wasi:http requests to.
    pub http: HashSet<String>,
    /// Whether those requests may reach non-public addresses a host name resolves to.
    pub http_private: bool,
    /// wasi:http requests per origin one instance may have waiting for their answer.
    pub http_connections: u32,
    /// Connections its wasi:http requests may have open at once over all its origins.
    pub http_open_connections: u32,
    /// A PEM file of CA certificates trusted for wasi:http, besides the public roots.
    pub http_ca: Option<PathBuf>,
    /// The same for wasi:tls connections.
    pub tls_ca: Option<PathBuf>,
    /// The client certificate chain and key for wasi:tls connections.
    pub tls_client: Option<(PathBuf, PathBuf)>,
}

impl Sandbox {
    fn resolve(config: &SandboxConfig) -> Result<Sandbox, String> {
        let http = config
            .http
            .iter()
            .map(|o| normalize_origin_pattern(o))
            .collect::<Result<_, _>>()
            .map_err(|e| format!("http: {e}"))?;
        Ok(Sandbox {
            dirs: config.dirs.iter().map(|(guest, host)| (guest.clone(), normalize_path(host))).collect(),
            env: config.env.clone(),
            stdio: config.stdio,
            tcp: config.tcp.clone(),
            dns: config.dns,
            http,
            http_private: config.http_private,
            http_connections: connections(
                "http_connections",
                config.http_connections,
                crate::plugins::DEFAULT_HTTP_CONNECTIONS,
            )?,
            http_open_connections: connections(
                "http_open_connections",
                config.http_open_connections,
                crate::plugins::DEFAULT_HTTP_OPEN_CONNECTIONS,
            )?,
            http_ca: config.http_ca.as_ref().map(|path| normalize_path(path)),
            tls_ca: config.tls_ca.as_ref().map(|path| normalize_path(path)),
            tls_client: match (&config.tls_client_cert, &config.tls_client_key) {
                (Some(cert), Some(key)) => Some((normalize_path(cert), normalize_path(key))),
                (None, None) => None,
                _ => return Err("tls_client_cert and tls_client_key: give both, or neither".into()),
            },
        })
    }
}

/// The most connections (or requests waiting) a sandbox's `http_connections` and
/// `http_open_connections` may allow: far beyond what one process has file descriptors for.
const MAX_CONNECTIONS: u32 = 1 << 20;

/// A connection limit `key` as given (between 1 and [`MAX_CONNECTIONS`]), or `default`.
fn connections(key: &str, given: Option<u32>, default: u32) -> Result<u32, String> {
    match given {
        None => Ok(default),
        Some(0) => Err(format!("{key}: must be at least 1")),
        Some(n) if n > MAX_CONNECTIONS => Err(format!("{key}: {n} is more than the {MAX_CONNECTIONS} allowed")),
        Some(n) => Ok(n),
    }
}

impl Settings {
    /// Resolves `config`; the error names the offending key.
    pub fn resolve(config: &Config) -> Result<Settings, String> {
        let default_retry = config.retry_policy_for(None).map_err(|e| format!("retry.{e}"))?;
        let mut routes = BTreeMap::new();
        let mut fan_outs = BTreeMap::new();
        for (name, route) in &config.route {
            if name.is_empty() || name.contains(DESTINATION_SEPARATOR) {
                return Err(format!(
                    "route.{name:?}: a route's name must not be empty or contain {DESTINATION_SEPARATOR:?}, which separates a route from its destinations"
                ));
            }
            if name == crate::metrics::UNCONFIGURED || name == crate::metrics::UNCLAIMED {
                return Err(format!(
                    "route.{name:?}: the metrics use this name for routes not configured and events not claimed; choose another"
                ));
            }
            let ordering = match (route.ordered, route.ordered_after_failure) {
                (false, _) => Ordering::Unordered,
                (true, after) => Ordering::Ordered { failed_blocks_key: after == AfterFailure::Block },
            };
            let dead_letter = match &route.dead_letter {
                None => None,
                Some(target) => Some(dead_letter(config, name, target)?),
            };
            let delivered_by = |route_name: String,
                                plugin: &str,
                                plugin_config: &BTreeMap<String, super::ConfigValue>,
                                retry,
                                destination_of: Option<&String>| {
                Arc::new(RouteSettings {
                    name: route_name,
                    plugin: plugin.to_string(),
                    plugin_config: plugin_config.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect(),
                    retry,
                    ordering,
                    dead_letter: dead_letter.clone(),
                    destination_of: destination_of.cloned(),
                })
            };
            if route.destinations.is_empty() && route.endpoints.is_none() {
                if route.plugin.trim().is_empty() {
                    return Err(format!("route.{name}.plugin must name a plugin (or give the route destinations)"));
                }
                let retry = config.retry_policy_for(Some(name)).map_err(|e| format!("route.{name}.retry.{e}"))?;
                routes.insert(name.clone(), delivered_by(name.clone(), &route.plugin, &route.config, retry, None));
                continue;
            }
            if !route.plugin.is_empty() || !route.config.is_empty() {
                return Err(format!(
                    "route.{name}: a route with destinations or endpoints has no plugin or config of its own; give each destination its own (route.{name}.destinations.NAME.plugin), and the endpoints theirs (route.{name}.endpoints.plugin)"
                ));
            }
            // The route's own overrides are checked as such, before each destination's adds to them.
            let retry = config.retry_policy_for(Some(name)).map_err(|e| format!("route.{name}.retry.{e}"))?;
            let mut destinations = Vec::with_capacity(route.destinations.len());
            for (destination, d) in &route.destinations {
                let key = format!("route.{name}.destinations.{destination}");
                if destination.is_empty() || destination.contains(DESTINATION_SEPARATOR) {
                    return Err(format!(
                        "{key}: a destination's name must not be empty or contain {DESTINATION_SEPARATOR:?}"
                    ));
                }
                if destination == ENDPOINT_TEMPLATE
                    || (route.endpoints.is_some() && destination.starts_with(ENDPOINT_ID_PREFIX))
                {
                    return Err(format!(
                        "{key}: {ENDPOINT_TEMPLATE:?} and names beginning with {ENDPOINT_ID_PREFIX:?} are kept for the route's endpoints; rename the destination"
                    ));
                }
                if d.plugin.trim().is_empty() {
                    return Err(format!("{key}.plugin must name a plugin"));
                }
                let retry = config.retry_policy(&d.retry.over(&route.retry)).map_err(|e| format!("{key}.retry.{e}"))?;
                let event_types = EventTypes::new(&d.event_types).map_err(|e| format!("{key}.event_types: {e}"))?;
                let delivery_route = format!("{name}{DESTINATION_SEPARATOR}{destination}");
                let settings = delivered_by(delivery_route.clone(), &d.plugin, &d.config, retry, Some(name));
                routes.insert(delivery_route.clone(), settings);
                destinations.push(Destination { name: destination.clone(), route: delivery_route, event_types });
            }
            let endpoints = match &route.endpoints {
                None => None,
                Some(e) => {
                    let key = format!("route.{name}.endpoints");
                    if e.plugin.trim().is_empty() {
                        return Err(format!("{key}.plugin must name a plugin"));
                    }
                    if let Some(own) =
                        e.config.keys().find(|k| ENDPOINT_KEYS.contains(&k.as_str()) || k.starts_with("header."))
                    {
                        return Err(format!(
                            "{key}.config.{own}: each endpoint sets its own url, secret and headers; remove the key here"
                        ));
                    }
                    if e.origins.is_empty() {
                        return Err(format!(
                            "{key}.origins must list the origins an endpoint may point at, such as [\"https://*.example.com\"]"
                        ));
                    }
                    let origins = e
                        .origins
                        .iter()
                        .map(|o| normalize_origin_pattern(o).map_err(|why| format!("{key}.origins: {why}")))
                        .collect::<Result<Vec<_>, _>>()?;
                    let retry =
                        config.retry_policy(&e.retry.over(&route.retry)).map_err(|why| format!("{key}.retry.{why}"))?;
                    let template = format!("{name}{DESTINATION_SEPARATOR}{ENDPOINT_TEMPLATE}");
                    let mut settings = delivered_by(template.clone(), &e.plugin, &e.config, retry, Some(name));
                    Arc::make_mut(&mut settings).plugin_config.push(("url".into(), TEMPLATE_URL.into()));
                    routes.insert(template.clone(), settings);
                    Some(Arc::new(EndpointsSettings { template, origins }))
                }
            };
            let fan_out = FanOut { route: name.clone(), destinations, ordering, retry, dead_letter, endpoints };
            fan_outs.insert(name.clone(), Arc::new(fan_out));
        }
        let mut plugins = BTreeMap::new();
        for (name, sandbox) in &config.sandbox {
            let sandbox = Sandbox::resolve(sandbox).map_err(|e| format!("sandbox.{name}.{e}"))?;
            plugins.insert(name.clone(), Arc::new(PluginSettings { sandbox, limits: config.plugin_limits(name) }));
        }
        let default_plugin = Arc::new(PluginSettings {
            sandbox: Sandbox::resolve(&SandboxConfig::default())?,
            limits: config.plugin_limits(""),
        });
        Ok(Settings { config: config.clone(), routes, fan_outs, default_retry, plugins, default_plugin })
    }

    /// The route called `name`, if configured; for an endpoint's deliveries (`route/ep_…`), its
    /// route's endpoint template.
    pub fn route(&self, name: &str) -> Option<&Arc<RouteSettings>> {
        self.routes.get(name).or_else(|| self.routes.get(&self.endpoints_of(name)?.template))
    }

    /// For the route of an endpoint's deliveries (`route/ep_…`, with an id as ferry makes them),
    /// the endpoint settings of its route, if that route takes endpoints.
    pub fn endpoints_of(&self, delivery_route: &str) -> Option<&Arc<EndpointsSettings>> {
        let (route, endpoint) = delivery_route.split_once(DESTINATION_SEPARATOR)?;
        if !crate::endpoints::is_id(endpoint) {
            return None;
        }
        self.fan_outs.get(route)?.endpoints.as_ref()
    }

    /// Whether events of `route` are delivered: by a plugin of its own, or by its destinations.
    pub fn is_configured(&self, route: &str) -> bool {
        self.routes.contains_key(route) || self.fan_outs.contains_key(route) || self.endpoints_of(route).is_some()
    }

    /// Every configured route's name: those with a plugin, those with destinations and each
    /// destination's.
    pub fn route_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.routes.keys().chain(self.fan_outs.keys()).cloned().collect();
        names.sort_unstable();
        names
    }

    /// The retry policy of `route` (the global one for a route that is not configured).
    pub fn retry(&self, route: &str) -> &RetryPolicy {
        match (self.route(route), self.fan_outs.get(route)) {
            (Some(route), _) => &route.retry,
            (None, Some(fan_out)) => &fan_out.retry,
            (None, None) => &self.default_retry,
        }
    }

    /// The sandbox and limits of plugin `name`.
    pub fn plugin(&self, name: &str) -> Arc<PluginSettings> {
        self.plugins.get(name).unwrap_or(&self.default_plugin).clone()
    }

    /// The configured routes served by plugin `name`.
    pub fn routes_of(&self, plugin: &str) -> Vec<String> {
        self.routes.values().filter(|r| r.plugin == plugin).map(|r| r.name.clone()).collect()
    }

    /// How many plugin instances may be live at once for the configured routes: each route keeps
    /// up to its plugin's `instances`. The instance pool is sized to hold them all, so no plugin's
    /// instances can crowd out another's.
    pub fn route_instances(&self) -> usize {
        self.routes.values().map(|r| self.plugin(&r.plugin).limits.instances).sum()
    }

    /// The largest memory any plugin may use: what the instance pool must be sized for.
    pub fn largest_plugin_memory(&self) -> usize {
        self.plugins.values().chain([&self.default_plugin]).map(|p| p.limits.memory).max().unwrap_or(0)
    }

    /// Routes that deliver per key in order, and of those the ones a FAILED event blocks.
    /// A route with destinations hands its events on in order too, so each destination's
    /// deliveries are made in the route's order.
    pub fn ordered_routes(&self) -> (Vec<String>, Vec<String>) {
        let ordered = |blocking: bool| {
            let routes = self.routes.values().map(|r| (&r.name, r.ordering));
            let fan_outs = self.fan_outs.values().map(|f| (&f.route, f.ordering));
            routes
                .chain(fan_outs)
                .filter(|(_, ordering)| match ordering {
                    Ordering::Unordered => false,
                    Ordering::Ordered { failed_blocks_key } => !blocking || *failed_blocks_key,
                })
                .map(|(name, _)| name.clone())
                .collect()
        };
        (ordered(false), ordered(true))
    }

    /// How long an open breaker waits before a probe.
    pub fn breaker_cooldown(&self) -> Duration {
        self.config.breaker.cooldown.0
    }
}

impl Config {
    /// The retry policy of `route` (the global one for `None` or an unknown route). The error
    /// names the offending key relative to the retry table.
    pub fn retry_policy_for(&self, route: Option<&str>) -> Result<RetryPolicy, String> {
        let o = route.and_then(|r| self.route.get(r)).map(|r| r.retry.clone()).unwrap_or_default();
        self.retry_policy(&o)
    }

    /// The global retry policy with the overrides `o`.
    pub fn retry_policy(&self, o: &RetryOverrides) -> Result<RetryPolicy, String> {
        let global = &self.retry;
        let o = o.clone();
        let max_attempts = o.max_attempts.unwrap_or(global.max_attempts).0;
        let initial = o.initial.unwrap_or(global.initial).0;
        let max_delay = o.max_delay.unwrap_or(global.max_delay).0;
        let schedule = o.schedule.unwrap_or_else(|| global.schedule.clone());
        let backoff = match o.backoff.unwrap_or(global.backoff) {
            BackoffKind::Exponential => {
                if initial.is_zero() {
                    return Err("initial must be greater than 0 for exponential backoff".into());
                }
                if max_delay < initial {
                    return Err("max_delay must not be shorter than initial".into());
                }
                Backoff::Exponential { initial, max: max_delay }
            }
            BackoffKind::Fixed => Backoff::Fixed { delay: initial },
            BackoffKind::Schedule => {
                if schedule.is_empty() {
                    return Err("schedule must list at least one delay for backoff = \"schedule\"".into());
                }
                Backoff::Schedule(schedule.into_iter().map(|d| d.0).collect())
            }
        };
        let percent = o.jitter_percent.unwrap_or(global.jitter_percent);
        if percent > 100 {
            return Err(format!("jitter_percent must be between 0 and 100, got {percent}"));
        }
        let jitter = match o.jitter.unwrap_or(global.jitter) {
            JitterKind::None => Jitter::None,
            JitterKind::Symmetric => Jitter::Symmetric { percent },
            JitterKind::Equal => Jitter::Equal,
            JitterKind::Full => Jitter::Full,
        };
        let retry_after_max = o.retry_after_max.unwrap_or(global.retry_after_max).0;
        Ok(RetryPolicy { backoff, jitter, max_attempts, retry_after_max })
    }

    /// Each table that sets plugin limits, by the name its errors give it (`plugins`, and
    /// `sandbox.NAME` for each sandbox), with the limits that hold there.
    pub(super) fn plugin_tables(&self) -> impl Iterator<Item = (String, PluginLimits)> + '_ {
        std::iter::once(("plugins".to_string(), self.plugin_limits("")))
            .chain(self.sandbox.keys().map(|name| (format!("sandbox.{name}"), self.plugin_limits(name))))
    }

    /// The limits plugin `name` runs under: `[plugins]` with `[sandbox.NAME]` overrides.
    pub fn plugin_limits(&self, name: &str) -> PluginLimits {
        let sandbox = self.sandbox.get(name);
        let base = &self.plugins;
        PluginLimits {
            timeout: sandbox.and_then(|s| s.timeout).unwrap_or(base.timeout).0,
            memory: sandbox.and_then(|s| s.memory).unwrap_or(base.memory).0,
            instances: sandbox.and_then(|s| s.instances).unwrap_or(base.instances) as usize,
            max_calls: sandbox.and_then(|s| s.max_calls).unwrap_or(base.max_calls),
        }
    }
}
