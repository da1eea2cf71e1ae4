//! Hot reload: swapping a plugin while events flow loses nothing, and the real file watcher picks
//! up new, replaced, broken and deleted files.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use ferry::NewEvent;
use ferry::clock::{Clock, SystemClock};
use ferry::event::Status;
use ferry::plugins::Reloaded;
use ferry::service::Ferry;
use tokio_util::sync::CancellationToken;

use crate::common::{Backend, Running, TestDb, count, deliveries, eventually, install, plugin_variant};

/// Config with the scripted plugin (from `plugins`) on route `s`, recording to `<dir>/out`.
fn config(db: &TestDb, plugins: &std::path::Path) -> ferry::config::Config {
    let out = db.dir.path().join("out");
    db.config(&format!(
        r#"
        [relay]
        batch_size = 20
        poll_interval = "10ms"
        idle_poll_max = "50ms"
        [plugins]
        dir = {plugins:?}
        cache_dir = {cache:?}
        debounce = "200ms"
        [sandbox.scripted]
        dirs = {{ "/out" = {out:?} }}
        [route.s]
        plugin = "scripted"
        config = {{ record = "/out/deliveries.log" }}
        "#,
        cache = db.dir.path().join("cache"),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_swaps_under_load_lose_nothing() {
    const EVENTS: usize = 2000;
    const SWAPS: usize = 100;
    let db = TestDb::new(Backend::Postgres).await;
    let plugins = db.dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let file = plugins.join("scripted.wasm");
    let versions = [plugin_variant("ferry_test_scripted", "a"), plugin_variant("ferry_test_scripted", "b")];
    install(&file, &versions[0]);
    let running = Running::start(&config(&db, &plugins)).await;

    let emitter = tokio::spawn({
        let store = db.store.clone();
        async move {
            for i in 0..EVENTS {
                store.insert(&NewEvent::new("s", "ok", format!("{i}")), SystemClock.now()).await.unwrap();
                if i % 20 == 0 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
    });
    let mut hashes = HashSet::new();
    for swap in 1..=SWAPS {
        install(&file, &versions[swap % 2]);
        match running.registry.reload(&file).await.expect("a valid version loads") {
            Reloaded::Loaded { hash, .. } => hashes.insert(hash),
            other => panic!("swap {swap}: expected a new version, got {other:?}"),
        };
    }
    emitter.await.unwrap();
    eventually(Duration::from_secs(120), "every event SENT", || async {
        (count(&db.store, Status::Sent).await == EVENTS as u64).then_some(())
    })
    .await;
    running.stop().await;

    assert_eq!(hashes.len(), 2, "the two versions alternated");
    let counts = db.store.counts().await.unwrap();
    assert_eq!((counts[&Status::Failed], counts[&Status::Pending], counts[&Status::Processing]), (0, 0, 0));
    let delivered: HashSet<i64> = deliveries(&db.dir.path().join("out")).iter().map(|d| d.id).collect();
    assert_eq!(delivered.len(), EVENTS, "every event reached the plugin");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_loads_replaces_keeps_and_removes_plugins() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = db.dir.path().join("plugins");
    std::fs::create_dir_all(&plugins).unwrap();
    let config = config(&db, &plugins);
    let ferry = Ferry::start(&config, Arc::new(SystemClock)).await.unwrap();
    let registry = ferry.registry.clone();
    assert!(registry.get("scripted").is_none(), "nothing to load yet");
    let stop = CancellationToken::new();
    ferry::watch::spawn(registry.clone(), Duration::from_millis(200), stop.clone()).unwrap();

    // A new file, written in two steps: never loaded half-written.
    let file = plugins.join("scripted.wasm");
    let v1 = plugin_variant("ferry_test_scripted", "one");
    std::fs::write(&file, &v1[..v1.len() / 2]).unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    std::fs::write(&file, &v1).unwrap();
    let first =
        eventually(Duration::from_secs(20), "the new plugin to load", || async { registry.get("scripted") }).await;
    assert!(registry.status().1.is_empty(), "no error from the half-written file: {:?}", registry.status().1);

    // Replaced: the new version becomes active.
    install(&file, &plugin_variant("ferry_test_scripted", "two"));
    let second = eventually(Duration::from_secs(20), "the replacement to load", || async {
        registry.get("scripted").filter(|p| p.hash != first.hash)
    })
    .await;

    // Broken: the old version stays active and the error is shown.
    install(&file, b"\0asm garbage");
    let error = eventually(Duration::from_secs(20), "the load error to show", || async {
        registry.status().1.get(&file).cloned()
    })
    .await;
    assert!(error.contains("not a valid wasm component"), "{error}");
    assert_eq!(registry.get("scripted").unwrap().hash, second.hash, "the working version stays");
    let status = &registry.status().0[0];
    assert_eq!(status.last_error.as_deref(), Some(error.as_str()));

    // Deleted: the plugin goes away.
    std::fs::remove_file(&file).unwrap();
    eventually(Duration::from_secs(20), "the plugin to be removed", || async {
        registry.get("scripted").is_none().then_some(())
    })
    .await;
    stop.cancel();
    // Every change was counted: two versions loaded, one refused, one removal.
    let stats = ferry.store.stats(SystemClock.now(), None, true).await.unwrap();
    let metrics = ferry.metrics.render(&stats, &[], &[], Duration::ZERO);
    for (result, n) in [("loaded", 2), ("failed", 1), ("removed", 1)] {
        let line = format!("ferry_plugin_reloads_total{{plugin=\"scripted\",result=\"{result}\"}} {n}");
        assert!(metrics.contains(&line), "{line} missing from:\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compiled_code_is_cached_on_disk_and_instances_are_pooled() {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = crate::common::plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let config = config(&db, &plugins);
    let ferry = Ferry::start(&config, Arc::new(SystemClock)).await.unwrap();
    assert!(ferry.registry.runtime().pooling, "the pooling allocator is available on this machine");
    let cache = db.dir.path().join("cache");
    let cached = eventually(Duration::from_secs(10), "compiled code in the cache", || async {
        let files = walk(&cache);
        (!files.is_empty()).then_some(files)
    })
    .await;
    // A restart finds the same entries rather than adding new ones.
    drop(ferry);
    let again = Ferry::start(&config, Arc::new(SystemClock)).await.unwrap();
    assert!(again.registry.get("scripted").is_some());
    assert_eq!(walk(&cache), cached, "an unchanged plugin is not compiled again");
}

/// Every compiled-code file under `dir`, sorted. What wasmtime's cache worker writes in the
/// background, some time after the code itself, is left out: `.stats` files, their
/// `.wip-atomic-write-stats` temporaries, and its `.cleanup` markers.
fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path)
            } else if !path.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.ends_with("stats") || n.starts_with(".cleanup")
            }) {
                files.push(path)
            }
        }
    }
    files.sort();
    files
}
