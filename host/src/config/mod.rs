//! Configuration: the commented defaults in `ferry.default.toml`, overlaid by the user's TOML file
//! and `FERRY_*` environment variables (`env.rs`), validated once at start-up and resolved into
//! [`Settings`] (`settings.rs`). Value types with units live in `units.rs`. Every error names the
//! file (or variable) and the key.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

mod env;
mod grants;
mod settings;
mod sources;
mod units;
mod warnings;

pub use self::settings::{
    DESTINATION_SEPARATOR, Destination, ENDPOINT_ID_PREFIX, ENDPOINT_TEMPLATE, EndpointsSettings, EventTypes, FanOut,
    Ordering, PluginSettings, RouteSettings, Sandbox, Settings, TEMPLATE_URL,
};
pub use self::sources::{ConfigShown, Setting, Sources, secret_word};
pub use self::units::{
    ByteSize, ConfigValue, Dur, MaxAttempts, Retention, format_duration, normalize_origin, normalize_origin_pattern,
    origin_matches, parse_duration, parse_size,
};
pub use self::warnings::LEASE_MARGIN;

/// The reference configuration, compiled in; it supplies every default.
pub const DEFAULT_TOML: &str = include_str!("../../ferry.default.toml");

/// A configuration problem, naming where it is.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid config in {origin}: {message}")]
    Invalid { origin: String, message: String },
}

impl ConfigError {
    fn invalid(origin: &str, message: String) -> Self {
        ConfigError::Invalid { origin: origin.to_string(), message }
    }
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub database: DatabaseConfig,
    pub relay: RelayConfig,
    pub retry: RetryConfig,
    pub breaker: BreakerConfig,
    pub admin: AdminConfig,
    pub telemetry: TelemetryConfig,
    pub plugins: PluginsConfig,
    /// Per-plugin sandbox grants, keyed by plugin name.
    #[serde(default)]
    pub sandbox: BTreeMap<String, SandboxConfig>,
    /// Routes, keyed by the route name events carry.
    #[serde(default)]
    pub route: BTreeMap<String, RouteConfig>,
    /// The file this was read from, if any (for the start-up line).
    #[serde(skip)]
    pub file: Option<PathBuf>,
}

/// The per-route circuit breaker.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive transient failures that open a route's breaker; 0 turns breakers off.
    pub threshold: u32,
    /// How long an open breaker waits before letting one probe delivery through.
    pub cooldown: Dur,
}

/// The admin HTTP API.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// `HOST:PORT` to serve on; empty: no API.
    pub listen: String,
    /// The bearer token; see [`AdminConfig::bearer_token`].
    pub token: String,
    pub token_file: PathBuf,
    /// Connections served at once; more are closed at once.
    pub max_connections: u32,
    /// How long a client has to send a request's headers.
    pub header_timeout: Dur,
    /// Whether `/metrics` is served without the token.
    pub metrics_public: bool,
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token", &if self.token.is_empty() { "" } else { "<redacted>" })
            .field("token_file", &self.token_file)
            .field("max_connections", &self.max_connections)
            .field("header_timeout", &self.header_timeout)
            .field("metrics_public", &self.metrics_public)
            .finish()
    }
}

/// OpenTelemetry trace export.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The base URL of an OTLP/HTTP receiver (`http://HOST:PORT`); empty: no traces.
    pub otlp_endpoint: String,
    /// The spans' `service.name`.
    pub service_name: String,
}

/// Shortest admin token accepted.
const MIN_TOKEN_LEN: usize = 16;
/// The most database connections one process may open: far more than a database serves well, and
/// few enough that the pool's bookkeeping, sized by it at start-up, stays small.
const MAX_DB_CONNECTIONS: u32 = 10_000;
/// The largest plugin file `plugins.max_file_size` may allow; a file is read whole into memory.
const MAX_PLUGIN_FILE: usize = 1 << 30;

impl AdminConfig {
    /// The address to serve on, if the API is enabled.
    pub fn address(&self) -> Option<std::net::SocketAddr> {
        self.listen.parse().ok()
    }

    /// The token from `token`, or else read from `token_file`, without the white space around it
    /// (a presented token is read without it too, so a token given with a trailing newline still
    /// matches). Errors name the key and the file.
    pub fn bearer_token(&self) -> Result<String, String> {
        let token = if self.token.is_empty() {
            let text = std::fs::read_to_string(&self.token_file)
                .map_err(|e| format!("admin.token_file: cannot read {}: {e}", self.token_file.display()))?;
            text.trim().to_string()
        } else {
            self.token.trim().to_string()
        };
        if token.chars().count() < MIN_TOKEN_LEN {
            let key = if self.token.is_empty() { "admin.token_file" } else { "admin.token" };
            return Err(format!("{key}: the admin token must be at least {MIN_TOKEN_LEN} characters long"));
        }
        Ok(token)
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `sqlite://PATH` or `postgres://…`.
    pub url: String,
    /// The pool: emits, operators' commands, the admin API, LISTEN, housekeeping.
    pub max_connections: u32,
    /// On PostgreSQL, the connections the relay's claims and outcome writes run on, apart from the
    /// pool: as many of those statements run at once (SQLite writes through one connection).
    pub relay_connections: u32,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    pub batch_size: u32,
    pub workers: u32,
    pub poll_interval: Dur,
    pub idle_poll_max: Dur,
    /// On PostgreSQL, wake on NOTIFY instead of waiting for the next poll.
    pub listen: bool,
    pub retain_sent: Retention,
    pub purge_batch: u32,
    pub lease: Dur,
    pub recover_every: u32,
    pub shutdown_grace: Dur,
    pub instance_id: String,
    /// Largest payload accepted at emit and loaded at claim.
    pub max_payload: ByteSize,
    /// Whether `serve` starts with no routes, or with a route whose plugin is not loaded.
    pub allow_incomplete: bool,
}

/// The retry keys, all present in the defaults.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    pub max_attempts: MaxAttempts,
    pub backoff: BackoffKind,
    pub initial: Dur,
    pub max_delay: Dur,
    pub schedule: Vec<Dur>,
    pub jitter: JitterKind,
    pub jitter_percent: u32,
    pub retry_after_max: Dur,
}

/// A route's overrides of [`RetryConfig`]; absent keys inherit the global value.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryOverrides {
    pub max_attempts: Option<MaxAttempts>,
    pub backoff: Option<BackoffKind>,
    pub initial: Option<Dur>,
    pub max_delay: Option<Dur>,
    pub schedule: Option<Vec<Dur>>,
    pub jitter: Option<JitterKind>,
    pub jitter_percent: Option<u32>,
    pub retry_after_max: Option<Dur>,
}

impl RetryOverrides {
    /// These overrides, and `base`'s where these have none.
    pub fn over(&self, base: &RetryOverrides) -> RetryOverrides {
        RetryOverrides {
            max_attempts: self.max_attempts.or(base.max_attempts),
            backoff: self.backoff.or(base.backoff),
            initial: self.initial.or(base.initial),
            max_delay: self.max_delay.or(base.max_delay),
            schedule: self.schedule.clone().or_else(|| base.schedule.clone()),
            jitter: self.jitter.or(base.jitter),
            jitter_percent: self.jitter_percent.or(base.jitter_percent),
            retry_after_max: self.retry_after_max.or(base.retry_after_max),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackoffKind {
    Exponential,
    Fixed,
    Schedule,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JitterKind {
    None,
    Symmetric,
    Equal,
    Full,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginsConfig {
    pub dir: PathBuf,
    /// Largest plugin file loaded.
    pub max_file_size: ByteSize,
    pub watch: bool,
    pub debounce: Dur,
    pub cache_dir: PathBuf,
    pub timeout: Dur,
    pub memory: ByteSize,
    pub instances: u32,
    pub max_calls: u64,
}

/// The limits one plugin runs under, after per-plugin overrides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PluginLimits {
    pub timeout: Duration,
    pub memory: usize,
    pub instances: usize,
    pub max_calls: u64,
}

/// What one plugin may touch. Everything not listed is denied.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxConfig {
    /// Guest path → host directory, pre-opened read-write for the plugin.
    #[serde(default)]
    pub dirs: BTreeMap<String, PathBuf>,
    /// Environment variables the plugin sees.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Whether the plugin's stdout and stderr reach ferry's (raw, unbounded: off by default; the
    /// `logging` import is the bounded, tagged way for a plugin to be heard).
    #[serde(default)]
    pub stdio: bool,
    /// `host:port` pairs the plugin may open TCP connections to.
    #[serde(default)]
    pub tcp: Vec<String>,
    /// Whether the plugin may resolve host names itself (needed when a server tells it where to
    /// connect by name, as Kafka brokers do). Connections still go only to `tcp` addresses.
    #[serde(default)]
    pub dns: bool,
    /// Origins (`scheme://host[:port]`) the plugin may send wasi:http requests to; a host may
    /// begin with `*.` for any subdomain (`https://*.example.com`).
    #[serde(default)]
    pub http: Vec<String>,
    /// Whether wasi:http requests may reach loopback, private and other non-public addresses that
    /// an allowed host name resolves to (default false); link-local and cloud metadata addresses
    /// never. An origin that names an address itself (`http://10.0.0.5:8080`) is allowed
    /// regardless.
    #[serde(default)]
    pub http_private: bool,
    /// wasi:http requests per origin one instance may have waiting for their answer (default 32).
    pub http_connections: Option<u32>,
    /// Connections the plugin's wasi:http requests may have open at once over all its origins
    /// (default 256); at it, those of the origins it used least recently are closed to make room.
    pub http_open_connections: Option<u32>,
    /// A PEM file of CA certificates the plugin's HTTPS servers may be verified against, besides
    /// the public roots.
    pub http_ca: Option<PathBuf>,
    /// A PEM file of CA certificates the servers of the plugin's TLS connections (wasi:tls) may be
    /// verified against, besides the public roots.
    pub tls_ca: Option<PathBuf>,
    /// A PEM certificate chain and its private key (PEM) presented to servers that ask for a
    /// client certificate on the plugin's TLS connections. Read by ferry; the plugin never sees
    /// them.
    pub tls_client_cert: Option<PathBuf>,
    pub tls_client_key: Option<PathBuf>,
    pub timeout: Option<Dur>,
    pub memory: Option<ByteSize>,
    pub instances: Option<u32>,
    pub max_calls: Option<u64>,
}

impl SandboxConfig {
    /// Makes the granted directories and the CA file absolute, relative to `base` (the directory
    /// of the file they were read from).
    pub fn resolve_paths(&mut self, base: &Path) {
        let join = |p: &Path| if p.is_relative() { base.join(p) } else { p.to_path_buf() };
        for dir in self.dirs.values_mut() {
            *dir = join(dir);
        }
        for path in [&mut self.http_ca, &mut self.tls_ca, &mut self.tls_client_cert, &mut self.tls_client_key]
            .into_iter()
            .flatten()
        {
            *path = join(path);
        }
    }
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The plugin (by the name it reports) that delivers this route's events; empty when the
    /// route has `destinations` instead.
    #[serde(default)]
    pub plugin: String,
    /// Passed to the plugin's `init` as key/value strings.
    #[serde(default)]
    pub config: BTreeMap<String, ConfigValue>,
    #[serde(default)]
    pub retry: RetryOverrides,
    /// Deliver events sharing an ordering key one at a time, in id order.
    #[serde(default)]
    pub ordered: bool,
    /// What a FAILED event does to the rest of its key on an ordered route.
    #[serde(default)]
    pub ordered_after_failure: AfterFailure,
    /// A route that gets a copy of each event the relay makes FAILED here, with the failure in
    /// its headers (a dead-letter topic, an archive).
    #[serde(default)]
    pub dead_letter: Option<String>,
    /// Where each event goes when it goes to more than one place: every destination whose
    /// `event_types` match gets its own delivery (status, attempts, history and breaker).
    #[serde(default)]
    pub destinations: BTreeMap<String, DestinationConfig>,
    /// Webhook endpoints managed at run time (`ferry endpoints`, `/v1/routes/NAME/endpoints`):
    /// each endpoint is a destination of the route, delivered by this plugin with this config
    /// and the endpoint's URL, secret and headers.
    #[serde(default)]
    pub endpoints: Option<EndpointsConfig>,
}

/// How a route's run-time webhook endpoints are delivered, and where they may point.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointsConfig {
    /// The plugin (by the name it reports) that delivers to every endpoint; `http` by default.
    #[serde(default = "default_endpoint_plugin")]
    pub plugin: String,
    /// Passed to the plugin's `init` for every endpoint, under the endpoint's own `url`,
    /// `secret`, `secret_previous` and `header.NAME` keys (which it may therefore not set).
    #[serde(default)]
    pub config: BTreeMap<String, ConfigValue>,
    /// Overrides of the route's retry policy for the endpoints' deliveries.
    #[serde(default)]
    pub retry: RetryOverrides,
    /// The origins an endpoint's URL may have: `https://hooks.example.com`, or
    /// `https://*.example.com` for any subdomain. Required: an endpoint can point nowhere else.
    #[serde(default)]
    pub origins: Vec<String>,
}

fn default_endpoint_plugin() -> String {
    "http".to_string()
}

/// One destination of a route: a plugin with its own config and retry policy, and the event
/// types it receives.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DestinationConfig {
    /// The plugin (by the name it reports) that delivers to this destination.
    pub plugin: String,
    /// Passed to the plugin's `init` as key/value strings.
    #[serde(default)]
    pub config: BTreeMap<String, ConfigValue>,
    /// Overrides of the route's retry policy (which overrides the global one).
    #[serde(default)]
    pub retry: RetryOverrides,
    /// The event types this destination receives: exact names, or patterns where `*` stands for
    /// any run of characters (`order.*`). Empty: every event of the route.
    #[serde(default)]
    pub event_types: Vec<String>,
}

/// On an ordered route, what happens to a key whose oldest unfinished event has FAILED.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AfterFailure {
    /// Hold the key's later events until the failed one is resent (and delivered) or purged.
    #[default]
    Block,
    /// Let the key's next event go ahead.
    Skip,
}

impl Config {
    /// The built-in defaults alone.
    pub fn defaults() -> Config {
        Self::from_toml_str("", "defaults").expect("built-in defaults are valid")
    }

    /// Loads `path` over the defaults, resolving relative paths against the file's directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Self::load_with_env(path, std::iter::empty())
    }

    /// Like [`Config::load`], then applies `FERRY_<TABLE>_<KEY>` overrides from `env` (see
    /// [`Config::from_sources`]).
    pub fn load_with_env(path: &Path, env: impl IntoIterator<Item = (String, String)>) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        let base = path.parent().unwrap_or(Path::new(""));
        Self::parse(&text, &path.display().to_string(), env, Some(base))
    }

    /// Parses `text` over the defaults; `origin` names the source in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        Self::from_sources(text, origin, std::iter::empty())
    }

    /// Parses `text` over the defaults, then applies environment overrides: `FERRY_RELAY_BATCH_SIZE=500`
    /// sets `relay.batch_size`, for every key of the `database`, `relay`, `retry`, `breaker`, `admin`, `telemetry` and
    /// `plugins` tables. A value is read as TOML when it parses as such (`500`, `true`, `["a"]`) and as a
    /// string otherwise (`5m`, `unlimited`). A bad value, or an unknown key of one of ferry's
    /// tables, is an error naming the variable; a `FERRY_` variable that names no table of ferry's
    /// is some other program's, ignored with a warning. Variables read elsewhere (`FERRY_CONFIG`, `FERRY_LOG`,
    /// `FERRY_LOG_FORMAT`, `FERRY_DATABASE_URL`) are left alone.
    pub fn from_sources(
        text: &str,
        origin: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        Self::parse(text, origin, env, None)
    }

    /// Parses and overlays the sources, makes relative paths absolute against `base` (the config
    /// file's directory, if there is a file), then validates: the checks see the paths ferry uses.
    fn parse(
        text: &str,
        origin: &str,
        env: impl IntoIterator<Item = (String, String)>,
        base: Option<&Path>,
    ) -> Result<Config, ConfigError> {
        let defaults: toml::Table = DEFAULT_TOML.parse().expect("ferry.default.toml parses");
        let mut merged = defaults.clone();
        let user: toml::Table = text.parse().map_err(|e: toml::de::Error| syntax_error(origin, text, &e))?;
        env::merge(&mut merged, user);
        env::overlay(&defaults, &mut merged, env, true)?;
        // Every variable was checked alone above, so what fails here is the file's: blamed on the
        // key, and on its line when the file sets it.
        let mut config: Config = serde_path_to_error::deserialize(toml::Value::Table(merged)).map_err(|e| {
            let key = e.path().to_string();
            let message = match sources::is_secret(&key) {
                // serde's message quotes the value (`invalid type: integer `123456``).
                true => "invalid type or value (not shown: the setting holds a secret)".to_string(),
                false => e.inner().message().to_string(),
            };
            let place = match sources::line_of(text, &key) {
                Some(line) => format!("{origin}, line {line}"),
                None => origin.to_string(),
            };
            match key.as_str() {
                "" | "." => ConfigError::invalid(&place, message),
                _ => ConfigError::invalid(&place, format!("{key}: {message}")),
            }
        })?;
        if let Some(base) = base {
            config.resolve_paths(base);
        }
        config.validate().map_err(|message| ConfigError::invalid(origin, message))?;
        Ok(config)
    }

    /// Checks what types alone cannot; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        if !self.database.url.starts_with("sqlite:") && !self.on_postgres() {
            return Err(format!(
                "database.url must start with sqlite:// or postgres://, got {:?}",
                crate::store::redact_url(&self.database.url)
            ));
        }
        if !(1..=MAX_DB_CONNECTIONS).contains(&self.database.max_connections) {
            return Err(format!(
                "database.max_connections must be between 1 and {MAX_DB_CONNECTIONS}, got {}",
                self.database.max_connections
            ));
        }
        if !(1..=MAX_DB_CONNECTIONS).contains(&self.database.relay_connections) {
            return Err(format!(
                "database.relay_connections must be between 1 and {MAX_DB_CONNECTIONS}, got {}",
                self.database.relay_connections
            ));
        }
        if !(1..=10_000).contains(&self.relay.batch_size) {
            return Err(format!("relay.batch_size must be between 1 and 10000, got {}", self.relay.batch_size));
        }
        if self.relay.poll_interval.0.is_zero() {
            return Err("relay.poll_interval must be greater than 0".into());
        }
        if self.relay.idle_poll_max < self.relay.poll_interval {
            return Err("relay.idle_poll_max must not be shorter than relay.poll_interval".into());
        }
        if self.relay.purge_batch == 0 {
            return Err("relay.purge_batch must be at least 1".into());
        }
        if self.relay.recover_every == 0 {
            return Err("relay.recover_every must be at least 1".into());
        }
        if self.relay.max_payload.0 == 0 || self.relay.max_payload.0 > 256 << 20 {
            return Err("relay.max_payload must be between 1B and 256MiB".into());
        }
        if self.plugins.max_file_size.0 == 0 || self.plugins.max_file_size.0 > MAX_PLUGIN_FILE {
            return Err(format!(
                "plugins.max_file_size must be between 1B and {}MiB, got {} bytes",
                MAX_PLUGIN_FILE >> 20,
                self.plugins.max_file_size.0
            ));
        }
        if self.relay.lease.0 > crate::store::MAX_LEASE {
            return Err(format!(
                "relay.lease ({}) must be at most 24h: ferry recovers claims whose lease ends further ahead as written by something else",
                self.relay.lease
            ));
        }
        if !(1..=64).contains(&self.relay.workers) {
            return Err(format!("relay.workers must be between 1 and 64, got {}", self.relay.workers));
        }
        // Written into every claimed row and into the message of a recovered one, and logged.
        let instance = &self.relay.instance_id;
        if instance.len() > crate::store::MAX_CLAIMANT as usize || instance.chars().any(char::is_control) {
            return Err(format!(
                "relay.instance_id must be at most {} bytes without control characters, got {} bytes starting {:?}",
                crate::store::MAX_CLAIMANT,
                instance.len(),
                instance.chars().take(40).collect::<String>()
            ));
        }
        for (table, limits) in self.plugin_tables() {
            if limits.timeout.is_zero() {
                return Err(format!("{table}.timeout must be greater than 0"));
            }
            if self.relay.lease.0 <= limits.timeout {
                return Err(format!(
                    "relay.lease ({}) must be longer than {table}.timeout ({:?}), or events would be recovered while still being delivered",
                    self.relay.lease, limits.timeout
                ));
            }
            if limits.memory < (1 << 20) {
                return Err(format!("{table}.memory must be at least 1MiB"));
            }
            if !(1..=64).contains(&limits.instances) {
                return Err(format!("{table}.instances must be between 1 and 64, got {}", limits.instances));
            }
            if limits.max_calls == 0 {
                return Err(format!("{table}.max_calls must be at least 1"));
            }
        }
        if !self.telemetry.otlp_endpoint.is_empty() {
            crate::telemetry::traces_uri(&self.telemetry.otlp_endpoint)
                .map_err(|why| format!("telemetry.otlp_endpoint: {why}"))?;
        }
        if self.telemetry.service_name.trim().is_empty() {
            return Err("telemetry.service_name must not be empty".into());
        }
        if !self.admin.listen.is_empty() {
            if self.admin.address().is_none() {
                return Err(format!(
                    "admin.listen must be an address such as \"127.0.0.1:9464\", got {:?}",
                    self.admin.listen
                ));
            }
            if self.admin.token.is_empty() && self.admin.token_file.as_os_str().is_empty() {
                return Err("admin.token (or admin.token_file) must be set when admin.listen is set".into());
            }
            if !(1..=10_000).contains(&self.admin.max_connections) {
                return Err(format!(
                    "admin.max_connections must be between 1 and 10000, got {}",
                    self.admin.max_connections
                ));
            }
            if self.admin.header_timeout.0.is_zero() {
                return Err("admin.header_timeout must be greater than 0".into());
            }
            if !self.admin.token.is_empty() && self.admin.token.trim().chars().count() < MIN_TOKEN_LEN {
                return Err(format!("admin.token must be at least {MIN_TOKEN_LEN} characters long"));
            }
        }
        for (plugin, sandbox) in &self.sandbox {
            for target in &sandbox.tcp {
                if target.rsplit_once(':').is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err()) {
                    return Err(format!("sandbox.{plugin}.tcp: {target:?} is not host:port"));
                }
            }
            for guest in sandbox.dirs.keys() {
                if !guest.starts_with('/') {
                    return Err(format!("sandbox.{plugin}.dirs: guest path {guest:?} must be absolute, like \"/out\""));
                }
            }
        }
        grants::check_apart(self)?;
        Settings::resolve(self).map(drop)
    }

    /// Whether `database.url` names a PostgreSQL database.
    fn on_postgres(&self) -> bool {
        self.database.url.starts_with("postgres://") || self.database.url.starts_with("postgresql://")
    }

    /// Resolves the validated configuration into what ferry runs on.
    pub fn settings(&self) -> Result<Settings, ConfigError> {
        Settings::resolve(self).map_err(|message| ConfigError::invalid("config", message))
    }

    /// The instance name written to `claimed_by`.
    pub fn instance_id(&self) -> String {
        if !self.relay.instance_id.is_empty() {
            return self.relay.instance_id.clone();
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_else(|| "ferry".into());
        format!("{host}-{}", std::process::id())
    }

    fn resolve_paths(&mut self, base: &Path) {
        let join = |p: &Path| if p.is_relative() { base.join(p) } else { p.to_path_buf() };
        self.plugins.dir = join(&self.plugins.dir);
        if !self.admin.token_file.as_os_str().is_empty() {
            self.admin.token_file = join(&self.admin.token_file);
        }
        if !self.plugins.cache_dir.as_os_str().is_empty() {
            self.plugins.cache_dir = join(&self.plugins.cache_dir);
        }
        for sandbox in self.sandbox.values_mut() {
            sandbox.resolve_paths(base);
        }
        if let Some((path, query)) = sqlite_file(&self.database.url)
            && Path::new(path).is_relative()
        {
            let full = join(Path::new(path));
            self.database.url = match query {
                Some(q) => format!("sqlite://{}?{q}", full.display()),
                None => format!("sqlite://{}", full.display()),
            };
        }
    }
}

/// A TOML syntax error, placed by its line. toml's own rendering quotes the offending source line,
/// which may hold a secret (`token = hunter2`), so only its message is kept.
pub(crate) fn syntax_error(origin: &str, text: &str, e: &toml::de::Error) -> ConfigError {
    match e.span() {
        Some(span) => {
            let line = sources::line_at(text, span.start);
            ConfigError::invalid(&format!("{origin}, line {line}"), e.message().to_string())
        }
        None => ConfigError::invalid(origin, e.message().to_string()),
    }
}

/// The file of a `sqlite:` database URL and the query after it; `None` for other databases and
/// for in-memory ones.
fn sqlite_file(url: &str) -> Option<(&str, Option<&str>)> {
    let rest = url.strip_prefix("sqlite://").or_else(|| url.strip_prefix("sqlite:"))?;
    let (path, query) = rest.split_once('?').map_or((rest, None), |(p, q)| (p, Some(q)));
    (!path.is_empty() && path != ":memory:").then_some((path, query))
}

#[cfg(test)]
mod tests;
