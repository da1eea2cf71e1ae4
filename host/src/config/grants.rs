//! Granted directories stay apart: no `sandbox.NAME.dirs` grant may nest in or overlap another
//! (of any plugin), nor hold or lie inside ferry's own files (plugins, compiled code, the SQLite
//! database, the admin token). Otherwise a plugin could swap another grant for a symbolic link
//! through its own, or change what ferry runs and stores.

use std::path::{Component, Path, PathBuf};

use super::{Config, sqlite_file};

/// `path` made absolute (against the working directory when it is relative, as ferry would use
/// it) and normalized lexically: `.` dropped, `..` removing the component before it. Symbolic
/// links are not looked at; instances refuse them when they pre-open a grant.
pub(super) fn normalize_path(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut normal = PathBuf::new();
    for component in absolute.components() {
        match component {
            Component::CurDir => {}
            Component::ParentDir => {
                normal.pop();
            }
            other => normal.push(other),
        }
    }
    normal
}

/// How `a` lies relative to `b`, if they overlap.
fn overlap(a: &Path, b: &Path) -> Option<&'static str> {
    if a == b {
        Some("is the same path as")
    } else if a.starts_with(b) {
        Some("lies inside")
    } else if b.starts_with(a) {
        Some("contains")
    } else {
        None
    }
}

/// Refuses grants that overlap each other or ferry's own files; the message names both keys and
/// paths and says how to fix it.
pub(super) fn check_apart(config: &Config) -> Result<(), String> {
    let grants: Vec<(String, PathBuf)> = config
        .sandbox
        .iter()
        .flat_map(|(plugin, sandbox)| {
            sandbox
                .dirs
                .iter()
                .map(move |(guest, host)| (format!("sandbox.{plugin}.dirs.{guest:?}"), normalize_path(host)))
        })
        .collect();
    for (i, (key, path)) in grants.iter().enumerate() {
        for (other_key, other) in &grants[..i] {
            if let Some(how) = overlap(path, other) {
                return Err(format!(
                    "{key} ({}) {how} {other_key} ({}): granted directories must not nest or overlap, or a plugin \
                     could replace one with a symbolic link through the other; grant directories side by side, \
                     neither inside the other",
                    path.display(),
                    other.display()
                ));
            }
        }
    }
    let mut own =
        vec![("plugins.dir", normalize_path(&config.plugins.dir), "install or replace the plugins ferry runs")];
    if !config.plugins.cache_dir.as_os_str().is_empty() {
        own.push((
            "plugins.cache_dir",
            normalize_path(&config.plugins.cache_dir),
            "change the compiled code ferry runs",
        ));
    }
    if let Some((file, _)) = sqlite_file(&config.database.url) {
        own.push(("database.url", normalize_path(Path::new(file)), "read and rewrite the outbox database"));
    }
    if !config.admin.token_file.as_os_str().is_empty() {
        own.push(("admin.token_file", normalize_path(&config.admin.token_file), "read the admin token"));
    }
    for (key, path) in &grants {
        for (own_key, own_path, harm) in &own {
            if let Some(how) = overlap(path, own_path) {
                return Err(format!(
                    "{key} ({}) {how} {own_key} ({}): a plugin could {harm}; grant a directory that neither \
                     contains nor lies inside {own_key}",
                    path.display(),
                    own_path.display()
                ));
            }
        }
    }
    Ok(())
}
