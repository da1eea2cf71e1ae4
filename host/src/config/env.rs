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
    let rest = name.strip_prefix(ENV_PREFIX).unwrap_or(name).to_ascii_lowercase();
    if rest.starts_with("route_") || rest.starts_with("sandbox_") {
        return format!("{name}: routes and sandboxes are set in the configuration file, not from the environment");
    }
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

/// Whether `name` reads as a setting of one of ferry's tables — its first word is a table's name,
/// or one letter away from one (`FERRY_PLUGIN_DIR`, `FERRY_RELY_WORKERS`) — so an unknown one is
/// a mistake to report rather than some other program's variable (`FERRY_HOME`, `FERRY_ROOT`).
fn names_a_table(defaults: &toml::Table, name: &str) -> bool {
    let rest = name.strip_prefix(ENV_PREFIX).unwrap_or(name).to_ascii_lowercase();
    let word = rest.split('_').next().unwrap_or_default();
    let tables = defaults.keys().map(String::as_str).chain(["route", "sandbox"]);
    word.len() >= 4 && tables.into_iter().any(|table| within_one_edit(word, table))
}

/// Whether `a` becomes `b` by at most one inserted, deleted or replaced character.
fn within_one_edit(a: &str, b: &str) -> bool {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let (short, long) = if a.len() <= b.len() { (&a, &b) } else { (&b, &a) };
    if long.len() - short.len() > 1 {
        return false;
    }
    let prefix = short.iter().zip(long.iter()).take_while(|(x, y)| x == y).count();
    let skip = usize::from(short.len() == long.len());
    short[prefix + skip.min(short.len() - prefix)..] == long[prefix + 1.min(long.len() - prefix)..]
}

/// Applies the `FERRY_*` variables among `env` to `merged` and returns which `(table, key)` each
/// set, by name. Variables with meanings of their own (see `ENV_RESERVED`) are left alone. A
/// variable that names one of ferry's tables but no key of it (`FERRY_RELAY_BATCHSIZE`), or a
/// bad value, is an error naming the variable; any other `FERRY_` variable (`FERRY_HOME`) belongs
/// to something else and is ignored with a warning.
pub(super) fn overlay(
    defaults: &toml::Table,
    merged: &mut toml::Table,
    env: impl IntoIterator<Item = (String, String)>,
    warn: bool,
) -> Result<Vec<(String, String, String)>, ConfigError> {
    let mut overrides: Vec<(String, String)> = env
        .into_iter()
        .filter(|(name, _)| name.starts_with(ENV_PREFIX) && !ENV_RESERVED.contains(&name.as_str()))
        .collect();
    overrides.sort();
    let mut applied = Vec::new();
    for (name, raw) in overrides {
        let env_origin = format!("environment variable {name}");
        let Some((table, key)) = env_key(defaults, &name) else {
            if names_a_table(defaults, &name) {
                return Err(ConfigError::invalid(&env_origin, unknown_env(defaults, &name)));
            }
            if warn {
                tracing::warn!("{name} is not a ferry setting (none is named like it); ignored");
            }
            continue;
        };
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
            section.insert(key.clone(), value);
        }
        applied.push((table, key, name));
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::within_one_edit;

    #[test]
    fn one_edit_apart() {
        for (a, b) in
            [("plugin", "plugins"), ("rely", "relay"), ("databse", "database"), ("retry", "retry"), ("admim", "admin")]
        {
            assert!(within_one_edit(a, b) && within_one_edit(b, a), "{a} {b}");
        }
        for (a, b) in [("root", "route"), ("home", "route"), ("retries", "retry"), ("pluginz", "plugins1")] {
            assert!(!within_one_edit(a, b), "{a} {b}");
        }
    }
}
