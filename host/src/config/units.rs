//! Config values with units or special words: durations (`30s`), sizes (`64MiB`), attempt
//! limits (`unlimited`), retention (`forever`), plugin config scalars and HTTP origins. Each
//! parses once, with an error that shows the accepted forms.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

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

/// A size written as `"64MiB"`, `"512KiB"`, `"1GiB"` or a plain number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub usize);

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        parse_size(&text).map(ByteSize).map_err(serde::de::Error::custom)
    }
}

/// A duration as the configuration writes it: the largest unit (`d`, `h`, `m`, `s`, `ms`) it is a
/// whole number of, so `format_duration(parse_duration(t)) == t` for canonical `t`.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, size) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)] {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
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
    let ms = n.checked_mul(unit_ms).ok_or_else(bad)?;
    if ms > MAX_DURATION_MS {
        return Err(format!("duration {text:?} is longer than 36500d (100 years), the longest ferry takes"));
    }
    Ok(Duration::from_millis(ms))
}

/// The longest duration `parse_duration` takes: a time this far from now still fits every
/// database's timestamps (a retention of millions of years would make each purge's cut-off one
/// PostgreSQL refuses, and so fail every purge).
const MAX_DURATION_MS: u64 = 36_500 * 86_400_000;

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
    let authority = uri.authority().map_or("", |a| a.as_str());
    if authority.contains('@') {
        return Err(format!("{text:?}: an origin has no user name or password"));
    }
    // The http crate reads a port it cannot parse (`:`, `:65536`) as none: a typo, not the default.
    let after_host = authority.rsplit_once(']').map_or(authority, |(_, rest)| rest);
    if let Some((_, port)) = after_host.rsplit_once(':')
        && port.parse::<u16>().is_err()
    {
        return Err(format!("{text:?}: {port:?} is not a port number"));
    }
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/" && !p.as_str().is_empty()) {
        return Err(format!("{text:?}: an origin has no path"));
    }
    Ok(format!("{scheme}://{}:{}", host.to_ascii_lowercase(), uri.port_u16().unwrap_or(default_port)))
}

/// What an allowlist entry stands for in place of its host's first label when that label is `*`.
const ANY_SUBDOMAIN: &str = "any-subdomain.invalid";

/// An allowlist entry, normalized like [`normalize_origin`]; its host may begin with `*.`, which
/// stands for any one or more labels (`https://*.example.com` allows `https://a.example.com` and
/// `https://a.b.example.com`, not `https://example.com`). Nothing else may be a wildcard, and a
/// wildcard entry must name a domain (`*.com` is refused).
pub fn normalize_origin_pattern(text: &str) -> Result<String, String> {
    let Some((scheme, rest)) = text.split_once("://*.") else {
        if text.contains('*') {
            return Err(format!(
                "{text:?}: a wildcard may only stand for the first labels of a host name, as in https://*.example.com"
            ));
        }
        return normalize_origin(text);
    };
    if rest.contains('*') {
        return Err(format!("{text:?}: only one wildcard, at the start of the host, is allowed"));
    }
    // Errors about the stand-in name are told about the entry as written.
    let blame = |why: String| format!("{text:?}: {}", why.rsplit_once(": ").map_or(why.as_str(), |(_, w)| w));
    let normal = normalize_origin(&format!("{scheme}://{ANY_SUBDOMAIN}.{rest}")).map_err(blame)?;
    let (normal_scheme, host_port) = normal.split_once("://").unwrap_or_default();
    let (host, port) = host_port.rsplit_once(':').unwrap_or_default();
    let domain = host.strip_prefix(ANY_SUBDOMAIN).and_then(|d| d.strip_prefix('.')).unwrap_or_default();
    if !domain.contains('.') || domain.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(format!(
            "{text:?}: a wildcard must stand for subdomains of a domain name, as in https://*.example.com"
        ));
    }
    Ok(format!("{normal_scheme}://*.{domain}:{port}"))
}

/// Whether the normalized `origin` of a request is allowed by the normalized allowlist entry
/// `pattern` ([`normalize_origin_pattern`]). A request to an IP address matches only an entry
/// naming that address: a wildcard matches host names alone.
pub fn origin_matches(pattern: &str, origin: &str) -> bool {
    if pattern == origin {
        return true;
    }
    let Some((scheme, rest)) = pattern.split_once("://*.") else { return false };
    let Some((origin_scheme, origin_rest)) = origin.split_once("://") else { return false };
    let Some((host, port)) = origin_rest.rsplit_once(':') else { return false };
    let Some((domain, pattern_port)) = rest.rsplit_once(':') else { return false };
    let is_ip = host.starts_with('[') || host.parse::<std::net::Ipv4Addr>().is_ok();
    scheme == origin_scheme
        && port == pattern_port
        && !is_ip
        && host.strip_suffix(domain).and_then(|sub| sub.strip_suffix('.')).is_some_and(|sub| !sub.is_empty())
}
