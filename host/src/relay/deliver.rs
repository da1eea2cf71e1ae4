//! Delivering a claimed batch and judging the answers: each route's share goes to its transport
//! (routes concurrently), a call that fails as a whole is bisected until the event at fault is
//! alone, and every answer becomes a completion (SENT, a retry at a backoff, a deferral the
//! plugin asked for, or FAILED) with its attempt in the history.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;

use futures::stream::FuturesUnordered;

use super::aside::{Batch, RouteDelivery};
use super::{CycleStats, Relay, Routes};
use crate::backoff::RetryDecision;
use crate::endpoints::EndpointTable;
use crate::event::{AttemptLog, CallLog, ClaimedEvent, Completion, Disposition, FailureReason};
use crate::plugins::{Cutoff, DeliverError, Outcome, PluginConfig, RouteTransport, Window};
use crate::store::StoreError;

/// The shortest wait a plugin's deferral gets, so an event deferred again and again cannot keep
/// the relay claiming it in a loop.
const MIN_DEFERRAL: Duration = Duration::from_secs(1);

impl Relay {
    /// Hands on the claimed events of routes with destinations ([`crate::store::Store::fan_out`]):
    /// each becomes one new event per destination whose event types match, and is itself SENT.
    /// Returns the other events, to deliver, and what became of these.
    ///
    /// Should the database refuse a batch of copies (a trigger of the operator's, say), each event
    /// is handed on alone. One the database refuses alone ([`StoreError::is_refusal`]) ends
    /// FAILED, kept for inspection and resend, rather than holding the others back; one that
    /// meets another error (a lost connection, a deadlock, a timeout) is retried as the route's
    /// policy says, its attempt counted, so it cannot come back for ever. If even that cannot be
    /// written, the error is returned and the claim's lease hands the events back later.
    pub(super) async fn hand_on(
        &self,
        routes: &Routes,
        endpoints: &EndpointTable,
        token: &str,
        events: Vec<ClaimedEvent>,
    ) -> Result<(Vec<ClaimedEvent>, CycleStats), StoreError> {
        let fan_outs = &routes.settings.fan_outs;
        if fan_outs.is_empty() {
            return Ok((events, CycleStats::default()));
        }
        // A row that could not be decoded is delivered nowhere: it fails alone, as on any route.
        let (parents, rest): (Vec<ClaimedEvent>, Vec<ClaimedEvent>) =
            events.into_iter().partition(|e| e.defect.is_none() && fan_outs.contains_key(&e.route));
        let items: Vec<(i64, Vec<String>)> = parents
            .iter()
            .filter_map(|e| {
                let fan_out = fan_outs.get(&e.route)?;
                let to = fan_out.routes_for(&e.event_type).chain(endpoints.routes_for(&e.route, &e.event_type));
                Some((e.id, to.map(String::from).collect()))
            })
            .collect();
        if items.is_empty() {
            return Ok((rest, CycleStats::default()));
        }
        let now = self.clock.now();
        let mut outcomes = Vec::new();
        let mut handed = Vec::new();
        for part in copy_runs(&items) {
            let (items, parents) = (&items[part.clone()], &parents[part]);
            let error = match self.store.fan_out(token, now, items).await {
                Ok(done) => {
                    handed.extend(done);
                    continue;
                }
                Err(error) => error,
            };
            tracing::warn!(
                "handing {} events on to their destinations failed, trying one by one: {error}",
                items.len()
            );
            for (item, event) in items.iter().zip(parents) {
                let error = match self.store.fan_out(token, now, std::slice::from_ref(item)).await {
                    Ok(one) => {
                        handed.extend(one);
                        continue;
                    }
                    Err(error) => error,
                };
                let call = self.call_log(&event.route, now, Duration::ZERO, None, None);
                let why = reason(&format!("its copies for the destinations could not be written: {error}"));
                outcomes.push(match error.is_refusal() {
                    true => self.fail(routes, event, &call, FailureReason::InvalidEvent, why),
                    false => self.retry_or_fail(routes, event, &call, now, why, None, FailureReason::AttemptsExhausted),
                });
            }
        }
        self.count_handed_on(&parents, &items, &handed);
        // Events neither handed on nor given an outcome: their claim had been recovered meanwhile.
        let fenced_off = items.len().saturating_sub(handed.len() + outcomes.len());
        let mut stats = CycleStats { claimed: items.len(), fenced_off, ..CycleStats::default() };
        if !outcomes.is_empty() {
            let recorded = self.record_outcomes(token, now, &outcomes).await?;
            let totals = super::Outcomes::of(&outcomes);
            let label = |route| super::route_label(routes, endpoints, route);
            self.count(&parents, &outcomes, &totals, now, &label);
            self.log_failed(&outcomes, now, &label);
            stats.retried = totals.retried;
            stats.failed = totals.failed;
            stats.fenced_off += recorded.fenced_off(outcomes.len());
        }
        Ok((rest, stats))
    }

    /// Counts the events handed on (`handed`: their claim still held), per route, and the
    /// deliveries made of them.
    fn count_handed_on(&self, parents: &[ClaimedEvent], items: &[(i64, Vec<String>)], handed: &[i64]) {
        let handed: std::collections::HashSet<&i64> = handed.iter().collect();
        for (event, (id, routes)) in parents.iter().zip(items) {
            if handed.contains(id) {
                let labels = crate::metrics::RouteOnly { route: event.route.as_str().into() };
                self.metrics.handed_on.get_or_create(&labels).inc();
                self.metrics.deliveries_made.get_or_create(&labels).inc_by(routes.len() as u64);
            }
        }
    }

    /// Starts delivering a claimed batch route by route: the completions of events that fail
    /// without a call (a row that could not be decoded), and one delivery per route, to run
    /// concurrently, each returning one completion per event of its route. An endpoint's
    /// deliveries go to its route's endpoint template with the endpoint's config. No plugin
    /// instance or call is started past `cutoff`. The deliveries own what they need of `batch`,
    /// so those still running when the cycle moves on can be carried on beside it.
    pub(super) fn deliver_all<'a>(
        &'a self,
        batch: &Arc<Batch>,
        cutoff: &'a Cutoff,
    ) -> (Vec<Completion>, FuturesUnordered<RouteDelivery<'a>>) {
        let mut by_route: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        let mut completions = Vec::new();
        for (i, event) in batch.events.iter().enumerate() {
            if let Some(defect) = &event.defect {
                let call = self.call_log(&event.route, self.clock.now(), Duration::ZERO, None, None);
                completions.push(self.fail(&batch.routes, event, &call, FailureReason::InvalidEvent, reason(defect)));
            } else {
                by_route.entry(&event.route).or_default().push(i);
            }
        }
        let deliveries = by_route.into_iter().map(|(route, positions)| {
            let batch = batch.clone();
            RouteDelivery {
                route: route.to_string(),
                delivery: Box::pin(async move {
                    let events: Vec<&ClaimedEvent> = positions.iter().map(|&i| &batch.events[i]).collect();
                    let window = Window { cutoff, lease_ends: batch.lease_ends };
                    self.deliver_route(&batch.routes, &batch.endpoints, events, &window).await
                }),
            }
        });
        (completions, deliveries.collect())
    }

    /// Delivers `batch`, the events of one route, to the route's transport, or to its endpoint's.
    async fn deliver_route(
        &self,
        routes: &Routes,
        endpoints: &EndpointTable,
        batch: Vec<&ClaimedEvent>,
        window: &Window<'_>,
    ) -> Vec<Completion> {
        let route = batch[0].route.as_str();
        let endpoint = || {
            let template = routes.settings.endpoints_of(route)?;
            Some((routes.transport(&template.template)?, endpoints.get(route)))
        };
        let why = match (routes.transport(route), endpoint()) {
            (Some(transport), _) => {
                return self.deliver_isolating(routes, transport, None, batch, window).await;
            }
            // Claimed under an older table: its deliveries wait (no attempt counted), and the
            // next claims hold them.
            (None, Some((_, Some(endpoint)))) if !endpoint.enabled => {
                let call = self.call_log(route, self.clock.now(), Duration::ZERO, None, None);
                let why = match &endpoint.config {
                    Ok(_) => format!("endpoint {} is disabled", endpoint.id),
                    Err(why) => why.clone(),
                };
                return self.hold(routes, &batch, &call, self.clock.now(), "endpoint_disabled", &why);
            }
            (None, Some((transport, Some(endpoint)))) => match &endpoint.config {
                Ok(config) => {
                    return self.deliver_isolating(routes, transport, Some(config), batch, window).await;
                }
                Err(why) => format!("endpoint {} cannot be delivered to: {why}", endpoint.id),
            },
            (None, Some((_, None))) => format!("route {route:?} names no endpoint: it was deleted"),
            (None, None) => format!("no route {route:?} is configured"),
        };
        let call = self.call_log(route, self.clock.now(), Duration::ZERO, None, None);
        self.judge(routes, &batch, &call, Err(DeliverError::NoTransport(why)))
    }

    /// Delivers one route's `batch`. When a call fails as a whole (the plugin trapped, timed out,
    /// ran out of memory or answered wrongly), one event may be at fault: the batch is split in
    /// halves and each delivered on its own, down to the event that faults alone, so only it is
    /// charged and the others get their own outcomes. Splitting stops after twice as many faulted
    /// calls as the batch has levels (a plugin that fails whatever it is given: a few events at
    /// fault cost about one level each), or when another call might outlast the claim's lease
    /// (`window.lease_ends`); what is left is charged with the fault.
    async fn deliver_isolating(
        &self,
        routes: &Routes,
        transport: &RouteTransport,
        config: Option<&PluginConfig>,
        batch: Vec<&ClaimedEvent>,
        window: &Window<'_>,
    ) -> Vec<Completion> {
        let levels = usize::BITS - batch.len().leading_zeros() + 1;
        let mut faults = 0;
        let mut parts = vec![batch];
        let mut completions = Vec::new();
        while let Some(part) = parts.pop() {
            let started_at = self.clock.now();
            let started = std::time::Instant::now();
            let delivery = transport.deliver(&part, config, Some(window)).await;
            let call = self.call_log(
                &part[0].route,
                started_at,
                started.elapsed(),
                Some(transport.plugin_name().into()),
                delivery.plugin_hash,
            );
            let result = match delivery.result {
                Err(DeliverError::Fault(fault)) => {
                    faults += 1;
                    let time_left = std::time::Instant::now() + transport.timeout() * 2 < window.lease_ends;
                    if part.len() > 1 && faults <= 2 * levels && time_left {
                        tracing::info!(
                            route = %part[0].route,
                            events = part.len(),
                            "{fault}; delivering the batch in halves to find the event at fault"
                        );
                        let mut first = part;
                        let second = first.split_off(first.len() / 2);
                        parts.push(second);
                        parts.push(first);
                        continue;
                    }
                    Err(DeliverError::Fault(fault))
                }
                other => other,
            };
            completions.extend(self.judge(routes, &part, &call, result));
        }
        completions
    }

    fn call_log(
        &self,
        route: &str,
        started_at: DateTime<Utc>,
        duration: Duration,
        plugin: Option<String>,
        plugin_hash: Option<String>,
    ) -> Arc<CallLog> {
        Arc::new(CallLog {
            route: route.to_string(),
            started_at,
            duration,
            plugin,
            plugin_hash,
            instance: self.instance.clone(),
            held: None,
        })
    }

    /// Turns a plugin's answer for `batch`, given by plugin call `call`, into completions.
    fn judge(
        &self,
        routes: &Routes,
        batch: &[&ClaimedEvent],
        call: &Arc<CallLog>,
        result: Result<Vec<Outcome>, DeliverError>,
    ) -> Vec<Completion> {
        let now = self.clock.now();
        match result {
            Ok(outcomes) => batch
                .iter()
                .zip(outcomes)
                .map(|(event, outcome)| match outcome {
                    Outcome::Success => self.complete(routes, event, call, Disposition::Sent),
                    Outcome::Permanent(f) => {
                        self.fail(routes, event, call, FailureReason::Permanent, reason(&f.reason))
                    }
                    Outcome::Transient(f) => {
                        let hint = f.retry_after_ms.map(Duration::from_millis);
                        let why = reason(&f.reason);
                        self.retry_or_fail(routes, event, call, now, why, hint, FailureReason::AttemptsExhausted)
                    }
                    Outcome::Deferred(d) => {
                        let policy = routes.settings.retry(&event.route);
                        let delay = Duration::from_millis(d.delay_ms)
                            .clamp(MIN_DEFERRAL, policy.retry_after_max.max(MIN_DEFERRAL));
                        let at = crate::clock::truncate_ms(crate::clock::later(now, delay));
                        self.complete(routes, event, call, Disposition::Deferred { at, error: reason(&d.reason) })
                    }
                })
                .collect(),
            Err(DeliverError::Fault(fault)) => batch
                .iter()
                .map(|event| {
                    let why = reason(&fault.to_string());
                    self.retry_or_fail(routes, event, call, now, why, None, FailureReason::PluginFault)
                })
                .collect(),
            Err(DeliverError::NoTransport(why)) => {
                let why = reason(&why);
                batch
                    .iter()
                    .map(|event| self.fail(routes, event, call, FailureReason::NoTransport, why.clone()))
                    .collect()
            }
            Err(DeliverError::LeaseShort(why)) => self.hold(routes, batch, call, now, "lease", &why),
            Err(DeliverError::HostShort(why)) => self.hold(routes, batch, call, now, "host_resources", &why),
        }
    }

    /// Defers `batch`, which the host could not hand to its plugin now (`held` says why, as
    /// `ferry_events_held` counts it): no attempt is counted and no breaker touched.
    fn hold(
        &self,
        routes: &Routes,
        batch: &[&ClaimedEvent],
        call: &Arc<CallLog>,
        now: DateTime<Utc>,
        held: &'static str,
        why: &str,
    ) -> Vec<Completion> {
        let call = Arc::new(CallLog { held: Some(held), ..CallLog::clone(call) });
        let at = crate::clock::truncate_ms(crate::clock::later(now, MIN_DEFERRAL));
        let why = reason(why);
        let wait = |event: &&ClaimedEvent| {
            self.complete(routes, event, &call, Disposition::Deferred { at, error: why.clone() })
        };
        batch.iter().map(wait).collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn retry_or_fail(
        &self,
        routes: &Routes,
        event: &ClaimedEvent,
        call: &Arc<CallLog>,
        now: DateTime<Utc>,
        error: String,
        hint: Option<Duration>,
        exhausted: FailureReason,
    ) -> Completion {
        let policy = routes.settings.retry(&event.route);
        let max = event.max_attempts.unwrap_or(policy.max_attempts);
        let unit: f64 = rand::rng().random();
        match policy.decide(event.attempt, max, hint, unit) {
            RetryDecision::RetryAfter(delay) => {
                let at = crate::clock::later(now, delay);
                self.complete(routes, event, call, Disposition::Retry { at: crate::clock::truncate_ms(at), error })
            }
            RetryDecision::GiveUp => self.fail(routes, event, call, exhausted, error),
        }
    }

    fn fail(
        &self,
        routes: &Routes,
        event: &ClaimedEvent,
        call: &Arc<CallLog>,
        reason: FailureReason,
        error: String,
    ) -> Completion {
        self.complete(routes, event, call, Disposition::Failed { reason, error })
    }

    /// The completion of `event`, with its attempt in the history of plugin call `call`.
    fn complete(
        &self,
        routes: &Routes,
        event: &ClaimedEvent,
        call: &Arc<CallLog>,
        disposition: Disposition,
    ) -> Completion {
        let max_attempts = event.max_attempts.unwrap_or_else(|| routes.settings.retry(&event.route).max_attempts);
        // A row ferry cannot decode is not copied: it stays, FAILED, where it is.
        let dead_letter = match &disposition {
            Disposition::Failed { reason, .. } if *reason != FailureReason::InvalidEvent => {
                routes.settings.route(&event.route).and_then(|r| r.dead_letter.clone())
            }
            _ => None,
        };
        let attempt = AttemptLog { number: event.attempt, call: call.clone() };
        Completion { id: event.id, disposition, max_attempts, attempt, dead_letter }
    }
}

/// Pauses before the second, third and fourth try of recording a batch's outcomes: 1.55 s in all,
/// so the last try comes after more than `CHECK_AFTER_IDLE` and takes a pooled connection that is
/// checked first, even when every connection was dropped at once (a failover).
const RECORD_RETRY_PAUSES: [Duration; 3] =
    [Duration::from_millis(50), Duration::from_millis(250), Duration::from_millis(1_250)];
const _: () = assert!(
    RECORD_RETRY_PAUSES[0].as_millis() + RECORD_RETRY_PAUSES[1].as_millis() + RECORD_RETRY_PAUSES[2].as_millis()
        > crate::store::CHECK_AFTER_IDLE.as_millis()
);

/// What recording a batch's outcomes wrote.
#[derive(Debug, Clone, Copy)]
pub(super) struct Recorded {
    written: u64,
    /// Whether a try failed before the one that succeeded.
    after_failure: bool,
}

impl Recorded {
    /// How many of `total` outcomes were fenced off: not written because their claims were
    /// recovered meanwhile. After a failed try, rows the try that succeeded did not write may
    /// instead be ones the failed try wrote before its answer was lost; the count cannot tell
    /// them apart, so none are counted and their number is logged.
    pub(super) fn fenced_off(self, total: usize) -> usize {
        let missing = total.saturating_sub(usize::try_from(self.written).unwrap_or(usize::MAX));
        if self.after_failure && missing > 0 {
            tracing::info!(
                missing,
                "after trying again, some outcomes were not written: a try whose answer was lost wrote them, \
                 or their claims were recovered meanwhile"
            );
            return 0;
        }
        missing
    }
}

impl Relay {
    /// Records a delivered batch's outcomes, trying again when the database may well not fail
    /// the same way twice ([`StoreError::is_transient`]: a dropped connection, a failover, a
    /// deadlock): unrecorded, the batch would be delivered a second time once its claim's lease
    /// ran out. Trying again is safe: writes are fenced by the claim's token and status, so
    /// outcomes a failed try did commit (its answer lost) are not written twice. The pauses do
    /// not watch for a stop: they add at most 1.55 s to it.
    pub(super) async fn record_outcomes(
        &self,
        token: &str,
        at: DateTime<Utc>,
        completions: &[Completion],
    ) -> Result<Recorded, StoreError> {
        let mut after_failure = false;
        for pause in RECORD_RETRY_PAUSES {
            match self.store.complete(token, at, completions).await {
                Err(error) if error.is_transient() => {
                    tracing::warn!(
                        events = completions.len(),
                        "recording a batch's outcomes failed, trying again in {pause:?}: {error}"
                    );
                    after_failure = true;
                    tokio::time::sleep(pause).await;
                }
                done => return Ok(Recorded { written: done?, after_failure }),
            }
        }
        let written = self.store.complete(token, at, completions).await?;
        Ok(Recorded { written, after_failure })
    }
}

/// Most copies one statement writes when handing events on: a route with many endpoints has
/// each event's copies written a few hundred events at a time, not a whole batch at once.
const MAX_COPIES_PER_STATEMENT: usize = 10_000;

/// `items` split into runs of consecutive events whose copies number at most
/// [`MAX_COPIES_PER_STATEMENT`] (or one event, however many it has).
fn copy_runs(items: &[(i64, Vec<String>)]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let (mut start, mut copies) = (0, 0);
    for (i, (_, routes)) in items.iter().enumerate() {
        if i > start && copies + routes.len() > MAX_COPIES_PER_STATEMENT {
            runs.push(start..i);
            (start, copies) = (i, 0);
        }
        copies += routes.len();
    }
    if start < items.len() {
        runs.push(start..items.len());
    }
    runs
}

/// A failure reason as stored: a plugin chooses its text, so it is bounded and escaped.
fn reason(text: &str) -> String {
    crate::untrusted::clean(text, crate::untrusted::MAX_REASON)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_written_in_bounded_runs() {
        let item = |copies: usize| (1, vec![String::new(); copies]);
        assert_eq!(copy_runs(&[]), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(copy_runs(&[item(2), item(0), item(3)]).len(), 1, "one run");
        let many = [item(6000), item(4000), item(1), item(20_000), item(5)];
        assert_eq!(copy_runs(&many), [0..2, 2..3, 3..4, 4..5], "an event over the bound is a run of its own");
    }
}
