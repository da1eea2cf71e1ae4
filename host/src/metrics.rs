//! Prometheus metrics. Counters and histograms are updated where things happen (the relay, the
//! plugin calls, the reloads); gauges describing the outbox are refreshed from the database when
//! the metrics are scraped, so every instance reports the same shared state.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use chrono::{DateTime, Utc};
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::event::Status;
use crate::store::{Breaker, Stats};

/// The content type of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `route` label of events whose route is not configured here, all in one series: rows may
/// carry any number of route names (a typo, an id in the name), and each name would otherwise be
/// a series of its own until the process ends. `ferry stats` and `ferry failed list` name them.
pub const UNCONFIGURED: &str = "(not configured)";

/// The `route` label of events set FAILED because the database refused every claim of them: their
/// route was never read (it may be what the database refuses), so they share one series.
pub const UNCLAIMED: &str = "(not claimed)";

/// A label value, escaped as the text format asks (`\\`, `\"`, `\n`) when rendered: prometheus-client
/// writes label values as they are, and route names come from rows and requests, so a name
/// holding a quote or a line break could otherwise close its label early, forge series or end the
/// scrape with its own `# EOF`.
#[derive(Debug, Clone, Hash, PartialEq, Eq)]
pub struct Label(String);

impl From<&str> for Label {
    fn from(text: &str) -> Label {
        Label(text.to_string())
    }
}

impl From<String> for Label {
    fn from(text: String) -> Label {
        Label(text)
    }
}

impl EncodeLabelValue for Label {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        use std::fmt::Write as _;
        let mut rest = self.0.as_str();
        while let Some(at) = rest.find(['\\', '"', '\n']) {
            encoder.write_str(&rest[..at])?;
            let escaped = match rest[at..].chars().next() {
                Some('\\') => "\\\\",
                Some('"') => "\\\"",
                _ => "\\n",
            };
            encoder.write_str(escaped)?;
            rest = &rest[at + 1..];
        }
        encoder.write_str(rest)
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabels {
    pub route: Label,
    pub plugin: Label,
}

/// A route, its plugin and a reason: why events failed, or why the host held them.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailedLabels {
    pub route: Label,
    pub plugin: Label,
    pub reason: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteOnly {
    pub route: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabels {
    pub plugin: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FaultLabels {
    pub plugin: Label,
    /// `trap`, `timeout`, `out_of_memory`, `wrong_outcome_count` or `not_instantiated`.
    pub kind: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    pub plugin: Label,
    /// `loaded`, `removed` or `failed`.
    pub result: Label,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabels {
    pub route: Label,
    pub status: Label,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;
type FloatGauge = Gauge<f64, AtomicU64>;

fn latency_buckets() -> Histogram {
    // 1 ms to about 2.5 minutes.
    Histogram::new(exponential_buckets(0.001, 2.5, 14))
}

fn statement_buckets() -> Histogram {
    // 0.5 ms to about 4 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 14))
}

fn call_buckets() -> Histogram {
    // 0.5 ms to about 16 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// Every metric ferry exports, and the registry that renders them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub delivered: Family<RouteLabels, Counter>,
    pub retried: Family<RouteLabels, Counter>,
    pub deferred: Family<RouteLabels, Counter>,
    /// Deferrals the host made without calling the plugin, by route, plugin and why (`lease`,
    /// `host_resources`, `endpoint_disabled`); also counted in `deferred`.
    pub held: Family<FailedLabels, Counter>,
    /// Events of routes with destinations handed on, and the deliveries made of them.
    pub handed_on: Family<RouteOnly, Counter>,
    pub deliveries_made: Family<RouteOnly, Counter>,
    pub failed: Family<FailedLabels, Counter>,
    pub delivery_latency: Histograms<RouteOnly>,
    pub batch_size: Histogram,
    pub claim_duration: Histogram,
    /// Writing the outcomes of one batch's plugin calls, waiting for a connection (on SQLite the
    /// relay's writing connection) included; events handed on to destinations are not timed here.
    pub record_duration: Histogram,
    pub plugin_call_duration: Histograms<PluginLabels>,
    /// How long a plugin call waited for one of its route's instances to be free.
    pub plugin_instance_wait: Histograms<PluginLabels>,
    /// How long starting an instance for a route's deliveries took, whether it started or not.
    pub plugin_instance_start: Histograms<PluginLabels>,
    pub plugin_faults: Family<FaultLabels, Counter>,
    /// Trace spans dropped: turned away by the exporter's full queue, or in an export that failed.
    pub trace_spans_dropped: Counter,
    pub plugin_reloads: Family<ReloadLabels, Counter>,
    events: Family<StatusLabels, Gauge>,
    oldest_pending_age: FloatGauge,
    claim_lag: FloatGauge,
    stuck: Gauge,
    last_attempt: Gauge,
    breaker_state: Family<RouteOnly, Gauge>,
    /// Relay workers waiting for work now.
    pub idle_workers: Gauge,
    /// Route deliveries still running after their cycle moved on (`relay::aside`).
    pub deliveries_aside: Gauge,
    /// The last hour minute by minute, for the dashboard.
    pub activity: crate::activity::Activity,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let delivered = Family::<RouteLabels, Counter>::default();
        registry.register("ferry_events_delivered", "Events delivered (SENT), by route and plugin", delivered.clone());
        let retried = Family::<RouteLabels, Counter>::default();
        registry.register("ferry_events_retried", "Transient failures scheduled for a retry", retried.clone());
        let deferred = Family::<RouteLabels, Counter>::default();
        registry.register(
            "ferry_events_deferred",
            "Deliveries deferred with no attempt counted: the plugin asked to wait, or the host could not make the call now (ferry_events_held)",
            deferred.clone(),
        );
        let held = Family::<FailedLabels, Counter>::default();
        registry.register(
            "ferry_events_held",
            "Deliveries the host deferred without calling the plugin, by reason: lease (a call that waited for an instance could outlast the claim's lease), host_resources (too few open files or too little memory to start an instance), endpoint_disabled (claimed for an endpoint disabled since)",
            held.clone(),
        );
        let handed_on = Family::<RouteOnly, Counter>::default();
        registry.register(
            "ferry_events_handed_on",
            "Events of a route with destinations handed on to them (an event no destination receives included)",
            handed_on.clone(),
        );
        let deliveries_made = Family::<RouteOnly, Counter>::default();
        registry.register(
            "ferry_deliveries_made",
            "Deliveries made of handed-on events, one per destination that receives the event, by route",
            deliveries_made.clone(),
        );
        let failed = Family::<FailedLabels, Counter>::default();
        registry.register("ferry_events_failed", "Events that became FAILED, by failure reason", failed.clone());
        let delivery_latency: Histograms<RouteOnly> = Family::new_with_constructor(latency_buckets);
        registry.register(
            "ferry_delivery_latency_seconds",
            "Time from an event's creation to its delivery",
            delivery_latency.clone(),
        );
        let batch_size = Histogram::new(exponential_buckets(1.0, 2.0, 14));
        registry.register("ferry_batch_size", "Events per claimed batch", batch_size.clone());
        let claim_duration = statement_buckets();
        registry.register("ferry_claim_duration_seconds", "Time taken by one claim statement", claim_duration.clone());
        let record_duration = statement_buckets();
        registry.register(
            "ferry_record_duration_seconds",
            "Time taken to write the outcomes of one batch's plugin calls, waiting for a connection and trying again included",
            record_duration.clone(),
        );
        let plugin_call_duration: Histograms<PluginLabels> = Family::new_with_constructor(call_buckets);
        registry.register(
            "ferry_plugin_call_duration_seconds",
            "Time taken by one deliver-batch call into a plugin",
            plugin_call_duration.clone(),
        );
        let plugin_instance_wait: Histograms<PluginLabels> = Family::new_with_constructor(call_buckets);
        registry.register(
            "ferry_plugin_instance_wait_seconds",
            "Time a deliver-batch call waited for one of its route's plugin instances (plugins.instances) to be free",
            plugin_instance_wait.clone(),
        );
        let plugin_instance_start: Histograms<PluginLabels> = Family::new_with_constructor(call_buckets);
        registry.register(
            "ferry_plugin_instance_start_seconds",
            "Time taken to start a plugin instance for a route: instantiating the component and running its init",
            plugin_instance_start.clone(),
        );
        let trace_spans_dropped = Counter::default();
        registry.register(
            "ferry_trace_spans_dropped",
            "Trace spans dropped: the OTLP exporter's queue was full, or their export failed",
            trace_spans_dropped.clone(),
        );
        let plugin_faults = Family::<FaultLabels, Counter>::default();
        registry.register(
            "ferry_plugin_faults",
            "Plugin calls that trapped, timed out, ran out of memory or answered wrongly",
            plugin_faults.clone(),
        );
        let plugin_reloads = Family::<ReloadLabels, Counter>::default();
        registry.register("ferry_plugin_reloads", "Plugin files loaded, removed or refused", plugin_reloads.clone());
        let events = Family::<StatusLabels, Gauge>::default();
        registry.register(
            "ferry_events",
            "Unfinished events in the outbox (PENDING, PROCESSING, FAILED), by route and status",
            events.clone(),
        );
        let oldest_pending_age = FloatGauge::default();
        registry.register(
            "ferry_oldest_pending_age_seconds",
            "Age of the oldest PENDING event (deferred and retrying ones included)",
            oldest_pending_age.clone(),
        );
        let claim_lag = FloatGauge::default();
        registry.register(
            "ferry_claim_lag_seconds",
            "How long the longest-waiting due PENDING event has been due",
            claim_lag.clone(),
        );
        let stuck = Gauge::default();
        registry.register(
            "ferry_events_stuck",
            "PROCESSING events whose claim lease has expired, or that have none",
            stuck.clone(),
        );
        let last_attempt = Gauge::default();
        registry.register("ferry_events_last_attempt", "PENDING events with one attempt left", last_attempt.clone());
        let breaker_state = Family::<RouteOnly, Gauge>::default();
        registry.register(
            "ferry_breaker_state",
            "Circuit breaker per route: 0 closed, 1 open, 2 half-open",
            breaker_state.clone(),
        );
        let idle_workers = Gauge::default();
        registry.register(
            "ferry_relay_idle_workers",
            "Relay workers waiting for work now; 0 for long under load means every worker is busy",
            idle_workers.clone(),
        );
        let deliveries_aside = Gauge::default();
        registry.register(
            "ferry_relay_deliveries_aside",
            "Route deliveries still running after their batch's cycle moved on: a slow route's calls",
            deliveries_aside.clone(),
        );
        Self {
            registry,
            delivered,
            retried,
            deferred,
            held,
            handed_on,
            deliveries_made,
            failed,
            delivery_latency,
            batch_size,
            claim_duration,
            record_duration,
            plugin_call_duration,
            plugin_instance_wait,
            plugin_instance_start,
            plugin_faults,
            trace_spans_dropped,
            plugin_reloads,
            events,
            oldest_pending_age,
            claim_lag,
            stuck,
            last_attempt,
            breaker_state,
            idle_workers,
            deliveries_aside,
            activity: Default::default(),
        }
    }

    /// Sets the outbox gauges from fresh figures and renders every metric in the OpenMetrics text
    /// format. `routes` are the configured routes: each gets a breaker state, closed by default,
    /// and its event counts, 0 when it has none (a series that drops to 0 rather than going
    /// stale when a route's last unfinished event is delivered). Events of other routes are
    /// counted together, as route [`UNCONFIGURED`].
    pub fn render(&self, stats: &Stats, breakers: &[Breaker], routes: &[String], cooldown: Duration) -> String {
        self.events.clear();
        // Every configured route, 0 where it has no events; the others summed under one label.
        let mut by_label: BTreeMap<&str, BTreeMap<Status, u64>> =
            routes.iter().map(|r| (r.as_str(), BTreeMap::new())).collect();
        for (route, counts) in &stats.routes {
            let label = if by_label.contains_key(route.as_str()) { route.as_str() } else { UNCONFIGURED };
            let sums = by_label.entry(label).or_default();
            for (status, n) in counts {
                *sums.entry(*status).or_default() += n;
            }
        }
        for (route, counts) in by_label {
            // SENT rows are not counted on a scrape (see `Store::stats`): ferry_events_delivered
            // counts deliveries.
            for status in Status::ALL.into_iter().filter(|s| *s != Status::Sent) {
                let n = counts.get(&status).copied().unwrap_or(0);
                let labels = StatusLabels { route: route.into(), status: status.as_str().into() };
                self.events.get_or_create(&labels).set(i64::try_from(n).unwrap_or(i64::MAX));
            }
        }
        self.oldest_pending_age.set(age(stats.at, stats.oldest_pending_created_at));
        self.claim_lag.set(age(stats.at, stats.oldest_due_at));
        self.stuck.set(i64::try_from(stats.stuck).unwrap_or(i64::MAX));
        self.last_attempt.set(i64::try_from(stats.last_attempt).unwrap_or(i64::MAX));
        let mut states: BTreeMap<&str, i64> = routes.iter().map(|r| (r.as_str(), 0)).collect();
        for b in breakers {
            states.insert(&b.route, b.state(stats.at, cooldown).gauge());
        }
        self.breaker_state.clear();
        for (route, state) in states {
            self.breaker_state.get_or_create(&RouteOnly { route: route.into() }).set(state);
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }
}

/// Seconds from `since` to `now`, 0 when there is nothing to measure.
fn age(now: DateTime<Utc>, since: Option<DateTime<Utc>>) -> f64 {
    since.map_or(0.0, |t| (now - t).num_milliseconds().max(0) as f64 / 1000.0)
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;

    use super::*;

    /// A name with a quote, a backslash and line breaks stays inside its label: one series, and
    /// the scrape ends where the registry's own `# EOF` is.
    #[test]
    fn label_values_are_escaped() {
        let mut registry = Registry::default();
        let family = Family::<RouteOnly, Counter>::default();
        registry.register("forged", "a counter", family.clone());
        let route = "r\"} 7\n# EOF\nferry_up{x=\"\\";
        family.get_or_create(&RouteOnly { route: route.into() }).inc();
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        assert!(text.contains(r#"forged_total{route="r\"} 7\n# EOF\nferry_up{x=\"\\"} 1"#), "{text}");
        assert_eq!(text.lines().filter(|l| l.starts_with("# EOF")).count(), 1, "{text}");
        assert_eq!(text.lines().filter(|l| !l.starts_with('#')).count(), 1, "{text}");
    }
}
