//! Route configuration access for plugins. Pure Rust with no bindings, so the host's test suite
//! compiles and tests it natively.

/// The route's configuration as ferry passes it: string keys and values. Typed accessors name
/// the key in every error; keys that were never asked for are an error in [`Config::finish`].
#[derive(Debug)]
pub struct Config {
    entries: Vec<(String, String, bool)>,
    known: Vec<String>,
}

impl Config {
    pub fn new(entries: Vec<(String, String)>) -> Config {
        Config { entries: entries.into_iter().map(|(k, v)| (k, v, false)).collect(), known: Vec::new() }
    }

    /// The value of `key`, if set.
    pub fn optional(&mut self, key: &str) -> Option<String> {
        if !self.known.iter().any(|k| k == key) {
            self.known.push(key.to_string());
        }
        let entry = self.entries.iter_mut().find(|(k, _, _)| k == key)?;
        entry.2 = true;
        Some(entry.1.clone())
    }

    /// The value of `key`, which must be set and not blank.
    pub fn required(&mut self, key: &str) -> Result<String, String> {
        match self.optional(key) {
            Some(value) if !value.trim().is_empty() => Ok(value),
            Some(_) => Err(format!("{key}: must not be empty")),
            None => Err(format!("{key}: required")),
        }
    }

    /// `key` parsed with [`str::parse`], or `default` when unset.
    pub fn parse_or<T: std::str::FromStr>(&mut self, key: &str, default: T) -> Result<T, String> {
        match self.optional(key) {
            Some(value) => value.trim().parse().map_err(|_| {
                format!(
                    "{key}: cannot read {value:?} as {}",
                    std::any::type_name::<T>().rsplit("::").next().unwrap_or("a value")
                )
            }),
            None => Ok(default),
        }
    }

    /// A whole number of at least 1, or `default` when unset.
    pub fn positive_or(&mut self, key: &str, default: u64) -> Result<u64, String> {
        match self.optional(key) {
            Some(value) => value
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or(format!("{key}: not a positive number: {value:?}")),
            None => Ok(default),
        }
    }

    /// Every `PREFIX<name>` key as `(name, value)`, e.g. `header.` for static headers.
    pub fn prefixed(&mut self, prefix: &str) -> Vec<(String, String)> {
        self.known.push(format!("{prefix}NAME"));
        let mut found = Vec::new();
        for (key, value, used) in &mut self.entries {
            if let Some(name) = key.strip_prefix(prefix).filter(|n| !n.is_empty()) {
                *used = true;
                found.push((name.to_string(), value.clone()));
            }
        }
        found
    }

    /// Fails naming the first key no accessor asked for, and listing the known ones.
    pub fn finish(&self) -> Result<(), String> {
        match self.entries.iter().find(|(_, _, used)| !used) {
            Some((key, _, _)) => Err(format!("unknown config key {key:?} (known: {})", self.known.join(", "))),
            None => Ok(()),
        }
    }
}
