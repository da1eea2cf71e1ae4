//! Configuration: the commented defaults in `ferry.default.toml`, overlaid by the user's TOML file,
//! validated once at start-up. Every error names the file and the key.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::backoff::{Backoff, Jitter, RetryPolicy};

/// The reference configuration, compiled in; it supplies every default.
pub const DEFAULT_TOML: &str = include_str!("../ferry.default.toml");

/// A configuration problem, naming where it is.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid config in {origin}: {message}")]
    Invalid { origin: String, message: String },
}

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub database: DatabaseConfig,
    pub relay: RelayConfig,
    pub retry: RetryConfig,
    pub breaker: BreakerConfig,
    pub admin: AdminConfig,
    pub plugins: PluginsConfig,
    /// Per-plugin sandbox grants, keyed by plugin name.
    #[serde(default)]
    pub sandbox: BTreeMap<String, SandboxConfig>,
    /// Routes, keyed by the route name events carry.
    #[serde(default)]
    pub route: BTreeMap<String, RouteConfig>,
}

/// The per-route circuit breaker.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Consecutive transient failures that open a route's breaker; 0 turns breakers off.
    pub threshold: u32,
    /// How long an open breaker waits before letting one probe delivery through.
    pub cooldown: Dur,
}

/// The admin HTTP API.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// `HOST:PORT` to serve on; empty: no API.
    pub listen: String,
    /// The bearer token; see [`AdminConfig::bearer_token`].
    pub token: String,
    pub token_file: PathBuf,
}

impl fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdminConfig")
            .field("listen", &self.listen)
            .field("token", &if self.token.is_empty() { "" } else { "<redacted>" })
            .field("token_file", &self.token_file)
            .finish()
    }
}

/// Shortest admin token accepted.
const MIN_TOKEN_LEN: usize = 16;

impl AdminConfig {
    /// The address to serve on, if the API is enabled.
    pub fn address(&self) -> Option<std::net::SocketAddr> {
        self.listen.parse().ok()
    }

    /// The token from `token`, or else read from `token_file`. Errors name the key and the file.
    pub fn bearer_token(&self) -> Result<String, String> {
        let token = if self.token.is_empty() {
            let text = std::fs::read_to_string(&self.token_file)
                .map_err(|e| format!("admin.token_file: cannot read {}: {e}", self.token_file.display()))?;
            text.trim().to_string()
        } else {
            self.token.clone()
        };
        if token.chars().count() < MIN_TOKEN_LEN {
            let key = if self.token.is_empty() { "admin.token_file" } else { "admin.token" };
            return Err(format!("{key}: the admin token must be at least {MIN_TOKEN_LEN} characters long"));
        }
        Ok(token)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `sqlite://PATH` or `postgres://…`.
    pub url: String,
    pub max_connections: u32,
}

#[derive(Debug, Clone, Deserialize)]
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
}

/// The retry keys, all present in the defaults.
#[derive(Debug, Clone, Deserialize)]
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
#[derive(Debug, Clone, Default, Deserialize)]
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

/// An attempt limit: a positive number, or `"unlimited"` (stored as 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxAttempts(pub u32);

impl<'de> Deserialize<'de> for MaxAttempts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Word(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) if n >= 1 && n <= i64::from(i32::MAX) => Ok(MaxAttempts(n as u32)),
            Raw::Word(w) if w == "unlimited" => Ok(MaxAttempts(0)),
            Raw::Number(n) => {
                Err(serde::de::Error::custom(format!("max_attempts must be at least 1 (or \"unlimited\"), got {n}")))
            }
            Raw::Word(w) => {
                Err(serde::de::Error::custom(format!("max_attempts must be a number or \"unlimited\", got {w:?}")))
            }
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginsConfig {
    pub dir: PathBuf,
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

/// A size written as `"64MiB"`, `"512KiB"`, `"1GiB"` or a plain number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub usize);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        parse_size(&text).map(ByteSize).map_err(serde::de::Error::custom)
    }
}

/// Parses `"<number><unit>"` with unit `B`, `KiB`, `MiB` or `GiB`.
pub fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let bad = || format!("invalid size {text:?} (write a whole number and a unit: 512KiB, 64MiB, 1GiB)");
    let n: usize = number.parse().map_err(|_| bad())?;
    let unit: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(bad()),
    };
    n.checked_mul(unit).ok_or_else(bad)
}

/// What one plugin may touch. Everything not listed is denied.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxConfig {
    /// Guest path → host directory, pre-opened read-write for the plugin.
    #[serde(default)]
    pub dirs: BTreeMap<String, PathBuf>,
    /// Environment variables the plugin sees.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Whether the plugin's stdout and stderr reach ferry's.
    #[serde(default = "yes")]
    pub stdio: bool,
    /// `host:port` pairs the plugin may open TCP connections to.
    #[serde(default)]
    pub tcp: Vec<String>,
    /// Whether the plugin may resolve host names itself (needed when a server tells it where to
    /// connect by name, as Kafka brokers do). Connections still go only to `tcp` addresses.
    #[serde(default)]
    pub dns: bool,
    /// Origins (`scheme://host[:port]`) the plugin may send wasi:http requests to.
    #[serde(default)]
    pub http: Vec<String>,
    pub timeout: Option<Dur>,
    pub memory: Option<ByteSize>,
    pub instances: Option<u32>,
    pub max_calls: Option<u64>,
}

fn yes() -> bool {
    true
}

impl Default for SandboxConfig {
    fn default() -> Self {
        Self {
            dirs: BTreeMap::new(),
            env: BTreeMap::new(),
            stdio: true,
            tcp: Vec::new(),
            dns: false,
            http: Vec::new(),
            timeout: None,
            memory: None,
            instances: None,
            max_calls: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// The plugin (by the name it reports) that delivers this route's events.
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

/// How long SENT events are kept: a duration, or `"forever"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention(pub Option<Duration>);

impl<'de> Deserialize<'de> for Retention {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        if text == "forever" {
            return Ok(Retention(None));
        }
        parse_duration(&text)
            .map(|d| Retention(Some(d)))
            .map_err(|e| serde::de::Error::custom(format!("{e} or \"forever\"")))
    }
}

/// A scalar route-config value, handed to the plugin as a string.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigValue(pub String);

impl<'de> Deserialize<'de> for ConfigValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match toml::Value::deserialize(d)? {
            toml::Value::String(s) => Ok(ConfigValue(s)),
            toml::Value::Integer(i) => Ok(ConfigValue(i.to_string())),
            toml::Value::Float(f) => Ok(ConfigValue(f.to_string())),
            toml::Value::Boolean(b) => Ok(ConfigValue(b.to_string())),
            toml::Value::Datetime(t) => Ok(ConfigValue(t.to_string())),
            other => Err(serde::de::Error::custom(format!(
                "plugin config values must be strings, numbers or booleans, found {}",
                other.type_str()
            ))),
        }
    }
}

/// A duration written as `"250ms"`, `"30s"`, `"5m"`, `"2h"` or `"1d"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Dur(pub Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text).map(Dur).map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// Parses `"<number><unit>"` with unit `ms`, `s`, `m`, `h` or `d`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let bad = || format!("invalid duration {text:?} (write a whole number and a unit: 250ms, 30s, 5m, 2h, 1d)");
    let n: u64 = number.parse().map_err(|_| bad())?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    n.checked_mul(unit_ms).map(Duration::from_millis).ok_or_else(bad)
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
        let mut config = Self::from_sources(&text, &path.display().to_string(), env)?;
        let base = path.parent().unwrap_or(Path::new(""));
        config.resolve_paths(base);
        Ok(config)
    }

    /// Parses `text` over the defaults; `origin` names the source in errors.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Config, ConfigError> {
        Self::from_sources(text, origin, std::iter::empty())
    }

    /// Parses `text` over the defaults, then applies environment overrides: `FERRY_RELAY_BATCH_SIZE=500`
    /// sets `relay.batch_size`, for every key of the `database`, `relay`, `retry`, `breaker`, `admin` and `plugins`
    /// tables. A value is read as TOML when it parses as such (`500`, `true`, `["a"]`) and as a
    /// string otherwise (`5m`, `unlimited`). An unknown `FERRY_` variable, or a bad value, is an
    /// error naming the variable. Variables read elsewhere (`FERRY_CONFIG`, `FERRY_LOG`,
    /// `FERRY_LOG_FORMAT`, `FERRY_DATABASE_URL`) are left alone.
    pub fn from_sources(
        text: &str,
        origin: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let invalid = |origin: &str, message: String| ConfigError::Invalid { origin: origin.to_string(), message };
        let defaults: toml::Table = DEFAULT_TOML.parse().expect("ferry.default.toml parses");
        let mut merged = defaults.clone();
        let user: toml::Table = text.parse().map_err(|e: toml::de::Error| invalid(origin, e.to_string()))?;
        merge(&mut merged, user);
        let mut overrides: Vec<(String, String)> = env
            .into_iter()
            .filter(|(name, _)| name.starts_with(ENV_PREFIX) && !ENV_RESERVED.contains(&name.as_str()))
            .collect();
        overrides.sort();
        for (name, raw) in overrides {
            let env_origin = format!("environment variable {name}");
            let (table, key) =
                env_key(&defaults, &name).ok_or_else(|| invalid(&env_origin, unknown_env(&defaults, &name)))?;
            // Text settings take the value as it is (an instance id of `42` stays text).
            let value = match defaults.get(&table).and_then(|t| t.get(&key)) {
                Some(toml::Value::String(_)) => toml::Value::String(raw),
                _ => env_value(&raw),
            };
            // Check the value on its own first, so a bad one is blamed on its variable.
            let mut alone = defaults.clone();
            merge(
                &mut alone,
                toml::Table::from_iter([(
                    table.clone(),
                    toml::Value::Table(toml::Table::from_iter([(key.clone(), value.clone())])),
                )]),
            );
            toml::Value::Table(alone)
                .try_into::<Config>()
                .map_err(|e| invalid(&env_origin, format!("{table}.{key}: {}", e.message())))?;
            if let Some(toml::Value::Table(section)) = merged.get_mut(&table) {
                section.insert(key, value);
            }
        }
        let config: Config = toml::Value::Table(merged)
            .try_into()
            .map_err(|e: toml::de::Error| invalid(origin, e.message().to_string()))?;
        config.validate().map_err(|message| invalid(origin, message))?;
        Ok(config)
    }

    /// Checks what types alone cannot; the message names the key.
    pub fn validate(&self) -> Result<(), String> {
        let sqlite = self.database.url.starts_with("sqlite:");
        let postgres = self.database.url.starts_with("postgres://") || self.database.url.starts_with("postgresql://");
        if !sqlite && !postgres {
            return Err(format!(
                "database.url must start with sqlite:// or postgres://, got {:?}",
                redact_url(&self.database.url)
            ));
        }
        if self.database.max_connections == 0 {
            return Err("database.max_connections must be at least 1".into());
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
        if !(1..=64).contains(&self.relay.workers) {
            return Err(format!("relay.workers must be between 1 and 64, got {}", self.relay.workers));
        }
        let plugin_limits = std::iter::once(("plugins".to_string(), self.plugin_limits("")))
            .chain(self.sandbox.keys().map(|name| (format!("sandbox.{name}"), self.plugin_limits(name))));
        for (table, limits) in plugin_limits {
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
            if !self.admin.token.is_empty() && self.admin.token.chars().count() < MIN_TOKEN_LEN {
                return Err(format!("admin.token must be at least {MIN_TOKEN_LEN} characters long"));
            }
        }
        self.retry_policy_for(None).map_err(|e| format!("retry.{e}"))?;
        for (name, route) in &self.route {
            if route.plugin.trim().is_empty() {
                return Err(format!("route.{name}.plugin must name a plugin"));
            }
            self.retry_policy_for(Some(name)).map_err(|e| format!("route.{name}.retry.{e}"))?;
        }
        for (plugin, sandbox) in &self.sandbox {
            for target in &sandbox.tcp {
                if target.rsplit_once(':').is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err()) {
                    return Err(format!("sandbox.{plugin}.tcp: {target:?} is not host:port"));
                }
            }
            for origin in &sandbox.http {
                normalize_origin(origin).map_err(|e| format!("sandbox.{plugin}.http: {e}"))?;
            }
            for guest in sandbox.dirs.keys() {
                if !guest.starts_with('/') {
                    return Err(format!("sandbox.{plugin}.dirs: guest path {guest:?} must be absolute, like \"/out\""));
                }
            }
        }
        Ok(())
    }

    /// The retry policy of `route` (the global one for `None` or an unknown route). The error
    /// names the offending key relative to the retry table.
    pub fn retry_policy_for(&self, route: Option<&str>) -> Result<RetryPolicy, String> {
        let global = &self.retry;
        let o = route.and_then(|r| self.route.get(r)).map(|r| r.retry.clone()).unwrap_or_default();
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

    /// Routes that deliver per-key in order, and of those the ones a FAILED event blocks.
    pub fn ordered_routes(&self) -> (Vec<String>, Vec<String>) {
        let ordered: Vec<String> = self.route.iter().filter(|(_, r)| r.ordered).map(|(n, _)| n.clone()).collect();
        let blocking = ordered
            .iter()
            .filter(|n| self.route[n.as_str()].ordered_after_failure == AfterFailure::Block)
            .cloned()
            .collect();
        (ordered, blocking)
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

    /// The sandbox of plugin `name` (the default, deny-all one if none is configured).
    pub fn sandbox_of(&self, name: &str) -> SandboxConfig {
        self.sandbox.get(name).cloned().unwrap_or_default()
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
            for dir in sandbox.dirs.values_mut() {
                *dir = join(dir);
            }
        }
        if let Some(rest) =
            self.database.url.strip_prefix("sqlite://").or_else(|| self.database.url.strip_prefix("sqlite:"))
        {
            let (path, query) = rest.split_once('?').map_or((rest, None), |(p, q)| (p, Some(q)));
            if !path.is_empty() && path != ":memory:" && Path::new(path).is_relative() {
                let full = join(Path::new(path));
                self.database.url = match query {
                    Some(q) => format!("sqlite://{}?{q}", full.display()),
                    None => format!("sqlite://{}", full.display()),
                };
            }
        }
    }
}

/// An origin as `scheme://host:port`, with the scheme's default port filled in, so the allowlist
/// and the requests compare equal however they were written.
pub fn normalize_origin(text: &str) -> Result<String, String> {
    let uri: http::Uri = text.parse().map_err(|e| format!("{text:?} is not an origin like https://host:port: {e}"))?;
    let scheme = uri.scheme_str().ok_or_else(|| format!("{text:?} has no scheme (http:// or https://)"))?;
    let default_port = match scheme {
        "http" => 80,
        "https" => 443,
        other => return Err(format!("{text:?}: scheme {other:?} is not http or https")),
    };
    let host = uri.host().filter(|h| !h.is_empty()).ok_or_else(|| format!("{text:?} has no host"))?;
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/" && !p.as_str().is_empty()) {
        return Err(format!("{text:?}: an origin has no path"));
    }
    Ok(format!("{scheme}://{}:{}", host.to_ascii_lowercase(), uri.port_u16().unwrap_or(default_port)))
}

/// Overlays `over` onto `base`, table by table.
/// Environment variables that override config keys start with this.
const ENV_PREFIX: &str = "FERRY_";
/// `FERRY_` variables with meanings of their own.
const ENV_RESERVED: [&str; 4] = ["FERRY_CONFIG", "FERRY_LOG", "FERRY_LOG_FORMAT", "FERRY_DATABASE_URL"];

/// The `(table, key)` a `FERRY_TABLE_KEY` variable names, if any: matched against the keys the
/// defaults define, so keys with underscores (`batch_size`) resolve unambiguously.
fn env_key(defaults: &toml::Table, name: &str) -> Option<(String, String)> {
    let rest = name.strip_prefix(ENV_PREFIX)?.to_ascii_lowercase();
    defaults.iter().find_map(|(table, section)| {
        let key = rest.strip_prefix(table.as_str())?.strip_prefix('_')?;
        section.as_table()?.contains_key(key).then(|| (table.clone(), key.to_string()))
    })
}

fn unknown_env(defaults: &toml::Table, name: &str) -> String {
    let known: Vec<String> = defaults
        .iter()
        .filter_map(|(table, section)| Some((table, section.as_table()?)))
        .flat_map(|(table, section)| section.keys().map(move |key| format!("FERRY_{table}_{key}").to_ascii_uppercase()))
        .collect();
    format!("{name} is not a setting ferry knows; the overridable ones are {}", known.join(", "))
}

/// An environment value as TOML when it is a TOML value, else as a string.
fn env_value(raw: &str) -> toml::Value {
    format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// A database URL with any password replaced, for error messages and logs.
pub fn redact_url(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://")
        && let Some((auth, host)) = rest.split_once('@')
        && let Some((user, _password)) = auth.split_once(':')
    {
        return format!("{scheme}://{user}:***@{host}");
    }
    url.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        Config::from_toml_str(text, "test.toml").unwrap_err().to_string()
    }

    fn with_env(text: &str, env: &[(&str, &str)]) -> Result<Config, String> {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        Config::from_sources(text, "ferry.toml", env).map_err(|e| e.to_string())
    }

    #[test]
    fn environment_variables_override_the_file() {
        let c = with_env(
            "[relay]\nbatch_size = 10\n",
            &[
                ("FERRY_RELAY_BATCH_SIZE", "500"),
                ("FERRY_RELAY_LEASE", "2m"),
                ("FERRY_RETRY_MAX_ATTEMPTS", "unlimited"),
                ("FERRY_RETRY_SCHEDULE", "[\"1s\", \"1m\"]"),
                ("FERRY_PLUGINS_WATCH", "false"),
                ("FERRY_RELAY_INSTANCE_ID", "42"),
                // Read elsewhere, not config keys; and variables of other programs.
                ("FERRY_LOG", "debug"),
                ("FERRY_DATABASE_URL", "postgres://elsewhere"),
                ("PATH", "/usr/bin"),
            ],
        )
        .unwrap();
        assert_eq!(c.relay.batch_size, 500, "the environment beats the file");
        assert_eq!(c.relay.lease.0, std::time::Duration::from_secs(120));
        assert_eq!(c.retry.max_attempts.0, 0, "unlimited");
        assert_eq!(c.retry.schedule.len(), 2);
        assert!(!c.plugins.watch);
        assert_eq!(c.relay.instance_id, "42", "text settings stay text");
        assert_eq!(c.database.url, "sqlite://ferry.db", "FERRY_DATABASE_URL is the CLI's business");
    }

    #[test]
    fn bad_environment_variables_are_named() {
        let unknown = with_env("", &[("FERRY_RELAY_BATCHSIZE", "5")]).unwrap_err();
        assert!(
            unknown.starts_with(
                "invalid config in environment variable FERRY_RELAY_BATCHSIZE: FERRY_RELAY_BATCHSIZE is not a setting"
            ),
            "{unknown}"
        );
        assert!(unknown.contains("FERRY_RELAY_BATCH_SIZE"), "the message lists the real names: {unknown}");
        let bad = with_env("", &[("FERRY_RELAY_BATCH_SIZE", "lots")]).unwrap_err();
        assert!(
            bad.starts_with("invalid config in environment variable FERRY_RELAY_BATCH_SIZE: relay.batch_size:"),
            "{bad}"
        );
        let bad = with_env("", &[("FERRY_RELAY_LEASE", "soon")]).unwrap_err();
        assert!(bad.contains("FERRY_RELAY_LEASE") && bad.contains("soon"), "{bad}");
    }

    #[test]
    fn defaults_are_valid_and_match_the_documented_values() {
        let c = Config::defaults();
        assert_eq!(c.database.url, "sqlite://ferry.db");
        assert_eq!(c.relay.batch_size, 100);
        assert_eq!(c.relay.lease.0, Duration::from_secs(300));
        assert_eq!(c.relay.retain_sent, Retention(Some(Duration::from_secs(7 * 86_400))));
        let p = c.retry_policy_for(None).unwrap();
        assert_eq!(p.max_attempts, 6);
        assert_eq!(p.backoff, Backoff::Exponential { initial: Duration::from_secs(1), max: Duration::from_secs(3600) });
        assert_eq!(p.jitter, Jitter::Symmetric { percent: 10 });
        assert!(SandboxConfig::default().stdio, "an unconfigured plugin keeps its stdout, as documented");
    }

    #[test]
    fn route_overrides_inherit_the_rest() {
        let c = Config::from_toml_str(
            r#"
            [route.hooks]
            plugin = "http"
            config = { url = "http://x", retries = 3, verbose = true }
            retry = { backoff = "schedule", max_attempts = "unlimited" }
            "#,
            "t",
        )
        .unwrap();
        let p = c.retry_policy_for(Some("hooks")).unwrap();
        assert_eq!(p.max_attempts, 0);
        assert_eq!(p.backoff.base_delay(2), Duration::from_secs(300));
        assert_eq!(p.jitter, Jitter::Symmetric { percent: 10 }, "inherited");
        let cfg = &c.route["hooks"].config;
        assert_eq!(cfg["retries"], ConfigValue("3".into()));
        assert_eq!(cfg["verbose"], ConfigValue("true".into()));
    }

    #[test]
    fn errors_name_the_file_and_key() {
        let e = err("[relay]\nbatch_size = 0");
        assert!(e.contains("test.toml") && e.contains("relay.batch_size"), "{e}");
        let e = err("[relay]\nbatchsize = 5");
        assert!(e.contains("batchsize"), "{e}");
        let e = err("[relay]\npoll_interval = \"soon\"");
        assert!(e.contains("soon"), "{e}");
        let e = err("[relay]\nlease = \"10s\"");
        assert!(e.contains("relay.lease"), "{e}");
        let e = err("[route.a]\nplugin = \"log\"\nretry = { max_attempts = 0 }");
        assert!(e.contains("max_attempts"), "{e}");
        let e = err("[route.a]\nplugin = \"log\"\nretry = { jitter_percent = 150 }");
        assert!(e.contains("route.a.retry.jitter_percent"), "{e}");
        let e = err("[route.a]\nplugin = \"log\"\nconfig = { nested = { x = 1 } }");
        assert!(e.contains("table"), "{e}");
        let e = err("[database]\nurl = \"mysql://u:secret@h/db\"");
        assert!(e.contains("database.url") && !e.contains("secret"), "{e}");
        let e = err("[sandbox.log]\ndirs = { \"out\" = \"/tmp\" }");
        assert!(e.contains("sandbox.log.dirs"), "{e}");
        let e = err("[relay]\nretain_sent = \"always\"");
        assert!(e.contains("forever"), "{e}");
        let e = err("[relay]\nidle_poll_max = \"10ms\"");
        assert!(e.contains("relay.idle_poll_max"), "{e}");
        let e = err("[route.a]\nplugin = \"log\"\nordered = true\nordered_after_failure = \"wait\"");
        assert!(e.contains("wait"), "{e}");
        let e = err("[sandbox.kafka]\ntcp = [\"localhost\"]");
        assert!(e.contains("sandbox.kafka.tcp") && e.contains("host:port"), "{e}");
        let e = err("[sandbox.web]\nhttp = [\"ftp://x\"]");
        assert!(e.contains("sandbox.web.http") && e.contains("ftp"), "{e}");
        let e = err("[sandbox.slow]\ntimeout = \"10m\"");
        assert!(e.contains("sandbox.slow.timeout") && e.contains("relay.lease"), "{e}");
        let e = err("[plugins]\nmemory = \"lots\"");
        assert!(e.contains("lots"), "{e}");
        let e = err("not toml at all [");
        assert!(e.contains("test.toml"), "{e}");
    }

    #[test]
    fn ordered_routes_and_their_failure_mode() {
        let c = Config::from_toml_str(
            r#"
            [route.a]
            plugin = "p"
            ordered = true
            [route.b]
            plugin = "p"
            ordered = true
            ordered_after_failure = "skip"
            [route.c]
            plugin = "p"
            "#,
            "t",
        )
        .unwrap();
        assert_eq!(c.ordered_routes(), (vec!["a".to_string(), "b".to_string()], vec!["a".to_string()]));
        assert_eq!(
            Config::from_toml_str("[relay]\nretain_sent = \"forever\"", "t").unwrap().relay.retain_sent,
            Retention(None)
        );
    }

    #[test]
    fn origins_are_normalized() {
        assert_eq!(normalize_origin("https://Hooks.Example.com").unwrap(), "https://hooks.example.com:443");
        assert_eq!(normalize_origin("http://127.0.0.1:8080/").unwrap(), "http://127.0.0.1:8080");
        assert_eq!(normalize_origin("http://h").unwrap(), "http://h:80");
        for bad in ["h:80", "ftp://h", "https://h/path", "https://"] {
            assert!(normalize_origin(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn plugin_limits_take_per_plugin_overrides() {
        let c = Config::from_toml_str("[sandbox.big]\nmemory = \"256MiB\"\ninstances = 4", "t").unwrap();
        let big = c.plugin_limits("big");
        assert_eq!((big.memory, big.instances, big.timeout), (256 << 20, 4, Duration::from_secs(30)));
        assert_eq!(c.plugin_limits("other").memory, 64 << 20);
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("1.5GiB").is_err() && parse_size("64MB").is_err());
    }

    #[test]
    fn durations_parse_every_unit_and_reject_the_rest() {
        let ok = [("250ms", 250), ("30s", 30_000), ("5m", 300_000), ("2h", 7_200_000), ("1d", 86_400_000)];
        for (text, ms) in ok {
            assert_eq!(parse_duration(text), Ok(Duration::from_millis(ms)), "{text}");
        }
        for bad in ["", "5", "m", "1.5s", "-1s", "5 weeks", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn relative_paths_follow_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ferry.toml");
        std::fs::write(
            &file,
            "[database]\nurl = \"sqlite://data/f.db?mode=rwc\"\n[sandbox.log]\ndirs = { \"/out\" = \"out\" }",
        )
        .unwrap();
        let c = Config::load(&file).unwrap();
        assert_eq!(c.database.url, format!("sqlite://{}/data/f.db?mode=rwc", dir.path().display()));
        assert_eq!(c.plugins.dir, dir.path().join("plugins"));
        assert_eq!(c.sandbox["log"].dirs["/out"], dir.path().join("out"));
        let missing = Config::load(&dir.path().join("nope.toml")).unwrap_err().to_string();
        assert!(missing.contains("nope.toml"), "{missing}");
    }

    #[test]
    fn the_admin_api_needs_an_address_and_a_long_token() {
        assert!(Config::defaults().admin.address().is_none(), "off by default");
        let missing = err("[admin]\nlisten = \"127.0.0.1:9464\"");
        assert!(missing.contains("admin.token") && missing.contains("test.toml"), "{missing}");
        let short = err("[admin]\nlisten = \"127.0.0.1:9464\"\ntoken = \"secret\"");
        assert!(short.contains("admin.token must be at least 16 characters"), "{short}");
        let bad = err("[admin]\nlisten = \"localhost\"\ntoken = \"0123456789abcdef\"");
        assert!(bad.contains("admin.listen") && bad.contains("localhost"), "{bad}");
        let env = [("FERRY_ADMIN_TOKEN".to_string(), "0123456789abcdef".to_string())];
        let c = Config::from_sources("[admin]\nlisten = \"127.0.0.1:0\"", "t", env).unwrap();
        assert_eq!(c.admin.bearer_token().unwrap(), "0123456789abcdef");
        assert!(!format!("{c:?}").contains("0123456789abcdef"), "Debug output hides the token");
    }

    #[test]
    fn the_admin_token_can_come_from_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ferry.toml");
        std::fs::write(&file, "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"token\"").unwrap();
        let c = Config::load(&file).unwrap();
        let unreadable = c.admin.bearer_token().unwrap_err();
        assert!(unreadable.contains("admin.token_file") && unreadable.contains("token"), "{unreadable}");
        std::fs::write(dir.path().join("token"), "short\n").unwrap();
        assert!(c.admin.bearer_token().unwrap_err().contains("at least 16"));
        std::fs::write(dir.path().join("token"), "  0123456789abcdefXYZ\n").unwrap();
        assert_eq!(c.admin.bearer_token().unwrap(), "0123456789abcdefXYZ");
    }

    #[test]
    fn the_container_config_is_valid_with_a_token_from_the_environment() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/container.toml");
        let no_token = Config::load(&path).unwrap_err().to_string();
        assert!(no_token.contains("admin.token"), "{no_token}");
        let env = [("FERRY_ADMIN_TOKEN".to_string(), "0123456789abcdef".to_string())];
        let c = Config::load_with_env(&path, env).unwrap();
        assert_eq!(c.admin.address(), Some("0.0.0.0:9464".parse().unwrap()));
        assert_eq!(c.plugins.dir, Path::new("/var/lib/ferry/plugins"));
        // Every file the image copies from the build context exists.
        let containerfile = std::fs::read_to_string(path.with_file_name("Containerfile")).unwrap();
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for line in containerfile.lines().filter(|l| l.starts_with("COPY ") && !l.contains("--from")) {
            let source = line.split_whitespace().nth(1).unwrap();
            assert!(source == "." || root.join(source).exists(), "{line}: {source} is missing");
        }
    }
}
