//! Where a configuration comes from — the built-in defaults, a file, `FERRY_*` variables and
//! `--database-url` — and what `ferry config show` prints of it: every setting in effect with the
//! source that set it, secrets masked.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{Config, ConfigError, DEFAULT_TOML, env};

/// The inputs of one configuration, read but not yet merged.
#[derive(Debug, Clone)]
pub struct Sources {
    /// The file and its text, when there is a file.
    pub file: Option<(PathBuf, String)>,
    /// The process environment (only `FERRY_*` variables are read).
    pub env: Vec<(String, String)>,
    /// `--database-url` (or `FERRY_DATABASE_URL`), which replaces `database.url`.
    pub database_url: Option<String>,
}

/// One setting in effect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Setting {
    /// The dotted key, such as `relay.batch_size` or `route.orders.config.url`.
    pub key: String,
    /// The value as ferry reads it, or `"********"` for a secret.
    pub value: serde_json::Value,
    /// `default`, `file PATH` or `environment FERRY_…` (or `--database-url`).
    pub source: String,
}

/// What `ferry config show` prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigShown {
    /// The configuration file, if one was read.
    pub file: Option<PathBuf>,
    pub settings: Vec<Setting>,
}

/// How a masked secret is shown.
const MASK: &str = "********";

impl Sources {
    /// Reads `file` (if any) and keeps the rest as given.
    pub fn read(
        file: Option<PathBuf>,
        env: Vec<(String, String)>,
        database_url: Option<String>,
    ) -> Result<Sources, ConfigError> {
        let file = match file {
            Some(path) => {
                let text = std::fs::read_to_string(&path)
                    .map_err(|source| ConfigError::Read { path: path.clone(), source })?;
                Some((path, text))
            }
            None => None,
        };
        Ok(Sources { file, env, database_url })
    }

    fn origin(&self) -> String {
        self.file.as_ref().map_or_else(|| "defaults".to_string(), |(path, _)| path.display().to_string())
    }

    /// The validated configuration.
    pub fn load(&self) -> Result<Config, ConfigError> {
        let (text, base) = match &self.file {
            Some((path, text)) => (text.as_str(), Some(path.parent().unwrap_or(Path::new("")))),
            None => ("", None),
        };
        let mut config = Config::parse(text, &self.origin(), self.env.iter().cloned(), base)?;
        config.file = self.file.as_ref().map(|(path, _)| path.clone());
        if let Some(url) = &self.database_url {
            config.database.url = url.clone();
            config
                .validate()
                .map_err(|message| ConfigError::invalid("--database-url / FERRY_DATABASE_URL", message))?;
        }
        Ok(config)
    }

    /// Every setting in effect with its source, after checking the whole configuration as `load`
    /// does (a configuration ferry would refuse is not shown as if it were in effect).
    pub fn show(&self) -> Result<ConfigShown, ConfigError> {
        let config = self.load()?;
        let defaults: toml::Table = DEFAULT_TOML.parse().expect("ferry.default.toml parses");
        let user: toml::Table = match &self.file {
            Some((_, text)) => {
                text.parse().map_err(|e: toml::de::Error| super::syntax_error(&self.origin(), text, &e))?
            }
            None => toml::Table::new(),
        };
        let mut merged = defaults.clone();
        env::merge(&mut merged, user.clone());
        // Quietly: `load` above has already warned about variables that are not ferry's.
        let from_env = env::overlay(&defaults, &mut merged, self.env.iter().cloned(), false)?;
        let mut settings = Vec::new();
        leaves(&toml::Value::Table(merged), &mut Vec::new(), &mut |path, value| {
            let key = path.join(".");
            let source = if key == "database.url" && self.database_url.is_some() {
                "--database-url / FERRY_DATABASE_URL".to_string()
            } else if let Some(name) = from_env.iter().find(|(table, k, _)| path == [table.as_str(), k.as_str()]) {
                format!("environment {}", name.2)
            } else if lookup(&user, path).is_some() {
                format!("file {}", self.origin())
            } else {
                "default".to_string()
            };
            let value = match value {
                _ if key == "database.url" => serde_json::Value::String(crate::store::redact_url(&config.database.url)),
                // An empty secret is shown as empty: "not set" is what the operator needs to see.
                toml::Value::String(text) if text.is_empty() => serde_json::Value::String(String::new()),
                _ if secret(path) => serde_json::Value::String(MASK.into()),
                // A URL may carry a secret wherever it is (`https://user:pass@host/`, `?token=…`).
                toml::Value::String(text) if text.contains("://") => serde_json::Value::String(redact_any_url(text)),
                _ => serde_json::to_value(value).unwrap_or(serde_json::Value::Null),
            };
            settings.push(Setting { key, value, source });
        });
        Ok(ConfigShown { file: self.file.as_ref().map(|(path, _)| path.clone()), settings })
    }
}

/// Calls `visit` with the path and value of every leaf of `value`: tables are walked into, arrays
/// are leaves, and an empty table is a leaf (so `[route.x.config]` with nothing in it still shows).
fn leaves<'a>(value: &'a toml::Value, path: &mut Vec<&'a str>, visit: &mut impl FnMut(&[&str], &toml::Value)) {
    match value {
        toml::Value::Table(table) if !table.is_empty() => {
            for (key, child) in table {
                path.push(key);
                leaves(child, path, visit);
                path.pop();
            }
        }
        leaf => visit(path, leaf),
    }
}

fn lookup<'a>(table: &'a toml::Table, path: &[&str]) -> Option<&'a toml::Value> {
    let (first, rest) = path.split_first()?;
    let value = table.get(*first)?;
    match (rest.is_empty(), value) {
        (true, value) => Some(value),
        (false, toml::Value::Table(inner)) => lookup(inner, rest),
        (false, _) => None,
    }
}

/// Whether the setting at dotted `key` (as serde_path_to_error prints it) is a secret.
pub(super) fn is_secret(key: &str) -> bool {
    let path: Vec<&str> = key.split('.').map(|step| step.split('[').next().unwrap_or(step)).collect();
    secret(&path)
}

/// `url` with its user information and any query parameter named like a secret masked:
/// `https://***@host/in?sig=********&v=2`.
fn redact_any_url(url: &str) -> String {
    crate::store::mask_url(url, true, MASK, |name| secret_word(name) || name.eq_ignore_ascii_case("sig"))
}

/// Whether a key or header `name` says it holds a secret (`api_key`, `Authorization`, …).
pub fn secret_word(name: &str) -> bool {
    const SECRET_WORDS: [&str; 10] =
        ["secret", "password", "passwd", "token", "key", "credential", "sasl", "auth", "bearer", "dsn"];
    let name = name.to_ascii_lowercase();
    SECRET_WORDS.iter().any(|w| name.contains(w))
}

/// Whether the setting at `path` is a secret: the admin token, a plugin's environment values,
/// and route config keys whose names say they hold one.
fn secret(path: &[&str]) -> bool {
    match path {
        ["admin", "token"] => true,
        ["sandbox", _, "env", ..] => true,
        ["route", _, "config", name, ..]
        | ["route", _, "destinations", _, "config", name, ..]
        | ["route", _, "endpoints", "config", name, ..] => secret_word(name),
        _ => false,
    }
}

/// The line (1-based) of the value at the dotted `path` (as serde_path_to_error prints it) in the
/// TOML `text`, when the text sets it.
pub(super) fn line_of(text: &str, path: &str) -> Option<usize> {
    let parsed = toml::de::DeTable::parse(text).ok()?;
    let mut table = parsed.get_ref();
    let mut span = None;
    let mut steps = path.split('.').peekable();
    while let Some(step) = steps.next() {
        // serde_path_to_error writes array elements as `schedule[2]`: the array's line will do.
        let name = step.split('[').next().unwrap_or(step);
        let (_, value) = table.iter().find(|(key, _)| key.get_ref().as_ref() == name)?;
        span = Some(value.span());
        match value.get_ref() {
            toml::de::DeValue::Table(inner) if steps.peek().is_some() => table = inner,
            _ => break,
        }
    }
    Some(line_at(text, span?.start))
}

/// The line (1-based) holding byte `offset` of `text`. Counted over bytes, so an offset inside a
/// multi-byte character, or past the end, cannot make it panic.
pub(super) fn line_at(text: &str, offset: usize) -> usize {
    let before = text.as_bytes().get(..offset).unwrap_or(text.as_bytes());
    before.iter().filter(|&&b| b == b'\n').count() + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_of_finds_keys_in_tables_dotted_keys_and_inline_tables() {
        let text = "[relay]\nworkers = 2\nbatch_size = \"ten\"\n\n[route.orders]\nplugin = \"log\"\nretry = { initial = \"x\" }\n";
        assert_eq!(line_of(text, "relay.batch_size"), Some(3));
        assert_eq!(line_of(text, "route.orders.plugin"), Some(6));
        assert_eq!(line_of(text, "route.orders.retry.initial"), Some(7));
        assert_eq!(line_of("retry.schedule = [\"1s\",\n 2]\n", "retry.schedule[1]"), Some(1));
        assert_eq!(line_of(text, "relay.lease"), None);
        assert_eq!(line_of("not toml [", "relay.lease"), None);
    }

    #[test]
    fn line_at_takes_any_offset_without_panicking() {
        let text = "a = \"é\"\nb = 1\n";
        assert_eq!(line_at(text, 0), 1);
        // Inside the two bytes of `é`: slicing the `str` there would panic.
        assert_eq!(line_at(text, 6), 1);
        assert_eq!(line_at(text, 10), 2);
        assert_eq!(line_at(text, usize::MAX), 3);
    }

    #[test]
    fn urls_lose_user_information_and_secret_parameters() {
        assert_eq!(redact_any_url("https://ghp_abc@host/x"), "https://***@host/x");
        assert_eq!(
            redact_any_url("https://u:p@host:8443/x?v=2&access_token=t&sig=s"),
            "https://***@host:8443/x?v=2&access_token=********&sig=********"
        );
        assert_eq!(redact_any_url("http://plain/x"), "http://plain/x");
        assert!(is_secret("sandbox.x.env.PIN") && is_secret("admin.token") && !is_secret("relay.batch_size"));
    }

    #[test]
    fn secrets_are_recognised_by_place_and_name() {
        assert!(secret(&["admin", "token"]));
        assert!(secret(&["sandbox", "http", "env", "API_KEY"]));
        assert!(secret(&["route", "hooks", "config", "signing_secret"]));
        assert!(secret(&["route", "hooks", "endpoints", "config", "api_key"]));
        assert!(secret(&["route", "k", "config", "sasl_password"]));
        assert!(secret(&["route", "k", "config", "Authorization"]));
        assert!(!secret(&["route", "hooks", "config", "url"]));
        assert!(secret(&["route", "hooks", "destinations", "crm", "config", "signing_secret"]));
        assert!(!secret(&["route", "hooks", "destinations", "crm", "config", "url"]));
        assert!(!secret(&["admin", "token_file"]));
        assert!(!secret(&["relay", "batch_size"]));
    }
}
