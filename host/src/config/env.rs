//! `FERRY_<TABLE>_<KEY>` environment variables laid over the merged TOML, each checked on its own
//! so a bad value is blamed on its variable, not on the file.

use super::{Config, ConfigError};

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

pub(super) fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// Applies the `FERRY_*` variables among `env` to `merged`. Variables with meanings of their own
/// (see `ENV_RESERVED`) are left alone; an unknown `FERRY_` variable or a bad value is an error
/// naming the variable.
pub(super) fn overlay(
    defaults: &toml::Table,
    merged: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(), ConfigError> {
    let mut overrides: Vec<(String, String)> = env
        .into_iter()
        .filter(|(name, _)| name.starts_with(ENV_PREFIX) && !ENV_RESERVED.contains(&name.as_str()))
        .collect();
    overrides.sort();
    for (name, raw) in overrides {
        let env_origin = format!("environment variable {name}");
        let (table, key) =
            env_key(defaults, &name).ok_or_else(|| ConfigError::invalid(&env_origin, unknown_env(defaults, &name)))?;
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
            .map_err(|e| ConfigError::invalid(&env_origin, format!("{table}.{key}: {}", e.message())))?;
        if let Some(toml::Value::Table(section)) = merged.get_mut(&table) {
            section.insert(key, value);
        }
    }
    Ok(())
}
