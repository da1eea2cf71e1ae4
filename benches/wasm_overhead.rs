//! What handing events to a wasm transport costs per event: a batch delivered through the
//! `scripted` test transport (a real component; for ordinary events its logic is "look at each
//! event's type, answer success") against the same logic as a native Rust function, with
//! criterion. The difference, divided by the batch size, is the per-event overhead of the plugin
//! boundary: copying each event into the component's memory, the call, and reading the answers.
//!
//! Run: `cargo bench --bench wasm_overhead` (needs the plugins from `scripts/build-plugins`).
//! Criterion prints its report; the per-event figures go to standard output and
//! `target/bench/wasm_overhead.json`.

use ferry_testkit as common;

use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput};
use ferry::config::Config;
use ferry::event::ClaimedEvent;
use ferry::plugins::{Outcome, Registry, RouteTransport, Runtime};

const BATCHES: [usize; 3] = [1, 100, 500];

fn events(n: usize) -> Vec<ClaimedEvent> {
    (0..n)
        .map(|i| ClaimedEvent {
            id: i as i64 + 1,
            route: "bench".into(),
            event_type: "order.created".into(),
            ordering_key: Some(format!("key-{}", i % 64)),
            payload: format!("{{\"n\":{i},\"padding\":\"{}\"}}", "x".repeat(200)).into_bytes(),
            content_type: "application/json".into(),
            headers: vec![("trace".into(), "abc".into())],
            attempt: 1,
            max_attempts: Some(6),
            event_time: chrono::Utc::now(),
            created_at: chrono::Utc::now(),
            defect: None,
        })
        .collect()
}

/// The scripted transport's logic for a batch, natively: the batch-wide checks for the event types
/// that trap, spin or hog, then one answer per event by its type.
fn native(events: &[&ClaimedEvent]) -> Vec<Outcome> {
    for special in ["trap", "spin", "hog", "count"] {
        if events.iter().any(|e| e.event_type == special) {
            unreachable!("the benchmark sends ordinary events only");
        }
    }
    events
        .iter()
        .map(|e| match e.event_type.as_str() {
            "transient" | "permanent" => unreachable!("the benchmark sends ordinary events only"),
            _ => Outcome::Success,
        })
        .collect()
}

/// Criterion's mean estimate for one benchmark, in nanoseconds.
fn mean_ns(group: &str, bench: &str, batch: usize) -> f64 {
    let path = common::target_dir().join(format!("criterion/{group}/{bench}/{batch}/new/estimates.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let value: serde_json::Value = serde_json::from_str(&text).expect("criterion estimates");
    value["mean"]["point_estimate"].as_f64().expect("a mean estimate")
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let plugins = common::plugins_dir(dir.path(), &["ferry_test_scripted"]);
    let text = format!(
        "[plugins]\ndir = {plugins:?}\ncache_dir = {:?}\n[route.bench]\nplugin = \"scripted\"\n",
        common::target_dir().join("test-plugin-cache")
    );
    let settings = Arc::new(Config::from_toml_str(&text, "bench").unwrap().settings().unwrap());
    let transport = runtime.block_on(async {
        let registry =
            Arc::new(Registry::new(Arc::new(Runtime::new(&settings).unwrap()), settings.clone(), Arc::default()));
        registry.load_dir().await.unwrap();
        let transport = RouteTransport::new(registry, settings.routes["bench"].clone());
        transport.warm_up().await.expect("the plugin starts");
        transport
    });

    let mut criterion = Criterion::default().configure_from_args();
    let mut group = criterion.benchmark_group("deliver");
    for batch in BATCHES {
        let owned = events(batch);
        let refs: Vec<&ClaimedEvent> = owned.iter().collect();
        group.throughput(Throughput::Elements(batch as u64));
        group.bench_with_input(BenchmarkId::new("wasm", batch), &refs, |b, refs| {
            b.to_async(&runtime).iter(|| async {
                let delivery = transport.deliver(refs, None, None).await;
                assert!(delivery.result.is_ok());
                delivery
            })
        });
        group.bench_with_input(BenchmarkId::new("native", batch), &refs, |b, refs| b.iter(|| native(refs)));
    }
    group.finish();
    criterion.final_summary();

    let mut rows = Vec::new();
    println!("| events per call | wasm µs per call | native µs per call | overhead µs per event |");
    println!("| ---: | ---: | ---: | ---: |");
    for batch in BATCHES {
        let (wasm, native) = (mean_ns("deliver", "wasm", batch), mean_ns("deliver", "native", batch));
        let per_event = (wasm - native) / batch as f64 / 1000.0;
        println!("| {batch} | {:.2} | {:.3} | {per_event:.3} |", wasm / 1000.0, native / 1000.0);
        rows.push(serde_json::json!({
            "batch": batch, "wasm_ns": wasm, "native_ns": native, "overhead_us_per_event": per_event,
        }));
    }
    let out = common::repo_root().join("target/bench");
    std::fs::create_dir_all(&out).expect("create target/bench");
    std::fs::write(out.join("wasm_overhead.json"), serde_json::to_string_pretty(&rows).unwrap()).expect("write report");
}
