//! Hot reload: turns file-system events in the plugins directory into [`Registry::reload`] calls,
//! once a file has been quiet for the debounce period. Deliberately thin; the registry does the
//! work and tests call it directly.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use notify::{RecursiveMode, Watcher as _};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::plugins::{Registry, Reloaded, is_plugin_file};

/// Watches the registry's plugins directory until `stop`.
pub fn spawn(registry: Arc<Registry>, debounce: Duration, stop: CancellationToken) -> anyhow::Result<()> {
    let dir = registry.dir();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<PathBuf>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
        Ok(event) => event.paths.into_iter().filter(|p| is_plugin_file(p)).for_each(|p| drop(tx.send(p))),
        Err(e) => tracing::warn!("plugin directory watch error: {e}"),
    })
    .context("starting the plugin directory watcher")?;
    watcher
        .watch(&dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("watching plugins directory {}", dir.display()))?;
    tracing::info!(dir = %dir.display(), "watching for plugin changes");

    tokio::spawn(async move {
        let _watcher = watcher; // dropping it would stop the events
        let mut due: HashMap<PathBuf, Instant> = HashMap::new();
        loop {
            let next = due.values().min().copied();
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = rx.recv() => match changed {
                    // Every new event for a file restarts its quiet period.
                    Some(path) => { due.insert(path, Instant::now() + debounce); }
                    None => return,
                },
                _ = tokio::time::sleep_until(next.unwrap_or_else(Instant::now)), if next.is_some() => {
                    let now = Instant::now();
                    let ready: Vec<PathBuf> = due.iter().filter(|(_, at)| **at <= now).map(|(p, _)| p.clone()).collect();
                    for path in ready {
                        due.remove(&path);
                        match registry.reload(&path).await {
                            Ok(Reloaded::Loaded { .. } | Reloaded::Removed { .. } | Reloaded::Unchanged { .. } | Reloaded::Ignored) => {}
                            Err(e) => tracing::error!(file = %path.display(), "plugin reload failed, previous version stays active: {e:#}"),
                        }
                    }
                }
            }
        }
    });
    Ok(())
}
