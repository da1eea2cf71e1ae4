//! A claimed batch's deliveries after the claim: waiting for them, stepping aside from those
//! still running after [`STEP_ASIDE_AFTER`] so a slow route holds up no other and no worker,
//! giving them up at the end of shutdown's grace period, and recording their outcomes.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt as _;
use futures::stream::FuturesUnordered;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::trace::BatchTrace;
use super::{CycleStats, Outcomes, Relay, Routes, route_label};
use crate::endpoints::EndpointTable;
use crate::event::{ClaimedEvent, Completion};
use crate::plugins::Cutoff;
use crate::store::{Breaker, StoreError};

/// How long a cycle waits for its batch's deliveries before it records those that ended and
/// carries the others on beside the workers. A route whose calls are slow (a receiver taking
/// seconds to answer, a plugin running to its timeout) then holds neither the outcomes of the
/// other routes' events of its batch nor the worker: the worker claims again at once, and the
/// other routes keep flowing. The slow route keeps as many deliveries running as it has plugin
/// instances, and is left out of the claims while it has that many carried on.
pub(super) const STEP_ASIDE_AFTER: Duration = Duration::from_secs(1);

/// One route's delivery of its events of a batch: one completion per event.
pub(super) struct RouteDelivery<'a> {
    pub(super) route: String,
    pub(super) delivery: Pin<Box<dyn Future<Output = Vec<Completion>> + Send + 'a>>,
}

impl Future for RouteDelivery<'_> {
    type Output = Vec<Completion>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Vec<Completion>> {
        self.delivery.as_mut().poll(cx)
    }
}

/// The deliveries of a batch still running when its cycle moved on, and their recording.
type Straggler<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Where workers hand the deliveries they step aside from ([`Relay::run`] runs them).
pub(super) type Lane<'a> = mpsc::UnboundedSender<Straggler<'a>>;

/// A claimed batch, as its deliveries and the recording of their outcomes need it; shared with
/// the deliveries carried on past the cycle.
pub(super) struct Batch {
    pub(super) token: String,
    pub(super) routes: Arc<Routes>,
    pub(super) endpoints: Arc<EndpointTable>,
    pub(super) events: Vec<ClaimedEvent>,
    /// The breakers as read before the claim, and the routes probed by it.
    pub(super) breakers: Vec<Breaker>,
    pub(super) probed: Vec<String>,
    /// When the claim's lease ends, as stored (its probes were taken until then).
    pub(super) lease_until: DateTime<Utc>,
    /// The same by the monotonic clock: no call that waited for an instance begins that could
    /// outlast it.
    pub(super) lease_ends: std::time::Instant,
    /// The batch's trace, when traces are sent; its root span goes when the batch is dropped.
    pub(super) trace: Option<BatchTrace>,
}

/// How waiting for a batch's deliveries ended.
pub(super) enum Driven {
    /// Every delivery ended.
    Done,
    /// Shutdown's grace period ended first: the deliveries still running are to be given up.
    GraceOver,
    /// [`STEP_ASIDE_AFTER`] passed first: the deliveries still running are to be carried on.
    StepAside,
}

/// Counts one delivery set aside against its route for as long as it lives.
struct SteppedAside<'a> {
    relay: &'a Relay,
    /// The route delivered to (for a webhook endpoint, its own `ROUTE/ep_…`).
    route: String,
}

impl<'a> SteppedAside<'a> {
    fn mark(relay: &'a Relay, route: String) -> Self {
        let mut aside = relay.stepped_aside.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        *aside.entry(route.clone()).or_default() += 1;
        relay.metrics.deliveries_aside.inc();
        SteppedAside { relay, route }
    }
}

impl Drop for SteppedAside<'_> {
    fn drop(&mut self) {
        let mut aside = self.relay.stepped_aside.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(count) = aside.get_mut(&self.route) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                aside.remove(&self.route);
            }
        }
        self.relay.metrics.deliveries_aside.dec();
    }
}

/// The route whose transport delivers the events of `route`: the route itself, or for a webhook
/// endpoint's deliveries (`ROUTE/ep_…`) its route's endpoint template, whose instances every
/// endpoint of the route shares.
fn transport_route<'a>(routes: &'a Routes, route: &'a str) -> &'a str {
    routes.settings.endpoints_of(route).map_or(route, |endpoints| endpoints.template.as_str())
}

impl Relay {
    /// Waits for `running`, adding what each delivery returns to `completions`, until all have
    /// ended, or until `step_aside` passes, or, once `shutdown` fires, until the grace period
    /// ends. The stop and then the grace's end are looked at before the deliveries are polled;
    /// the deliveries themselves start no instance and no call past the end (`Cutoff`).
    pub(super) async fn drive(
        &self,
        running: &mut FuturesUnordered<RouteDelivery<'_>>,
        completions: &mut Vec<Completion>,
        shutdown: &CancellationToken,
        grace_end: &Cutoff,
        step_aside: Option<tokio::time::Instant>,
    ) -> Driven {
        let aside = async {
            match step_aside {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(aside);
        while !running.is_empty() {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    let end = tokio::time::sleep_until(grace_end.fix(self.shutdown_grace));
                    tokio::pin!(end);
                    while !running.is_empty() {
                        tokio::select! {
                            biased;
                            () = &mut end => return Driven::GraceOver,
                            Some(done) = running.next() => completions.extend(done),
                        }
                    }
                    return Driven::Done;
                }
                Some(done) = running.next() => completions.extend(done),
                () = &mut aside => return Driven::StepAside,
            }
        }
        Driven::Done
    }

    /// Hands back the events of `batch` that the deliveries of `unfinished` routes hold, at the
    /// end of shutdown's grace period: all of their routes' events but the rows that could not be
    /// decoded, which failed without a delivery. Should that fail, they come back when their
    /// lease ends instead (the attempt counted). The half-open probes among them are given back
    /// too, so the next instance to run probes at once rather than when the lease ends.
    pub(super) async fn give_up(&self, batch: &Batch, unfinished: &BTreeSet<String>) {
        let held = |e: &&ClaimedEvent| e.defect.is_none() && unfinished.contains(&e.route);
        let ids: Vec<i64> = batch.events.iter().filter(held).map(|e| e.id).collect();
        match self.store.release(&batch.token, &ids, self.clock.now()).await {
            Ok(released) => tracing::warn!(released, "shutdown grace period over; unfinished events handed back"),
            Err(error) => tracing::warn!(
                events = ids.len(),
                "shutdown grace period over; handing unfinished events back failed, they come back when their \
                 lease ends: {error}"
            ),
        }
        for route in batch.probed.iter().filter(|r| unfinished.contains(*r)) {
            if let Err(error) = self.store.release_probe(route, batch.lease_until).await {
                tracing::warn!(
                    route,
                    "shutdown grace period over; giving the circuit breaker's probe back failed, the route is \
                     probed again when the lease ends: {error}"
                );
            }
        }
    }

    /// A route's `delivery` of `batch`, still running after its cycle moved on, run to its end
    /// (or to the end of shutdown's grace period) and its outcomes recorded. It counts against
    /// its transport from now until then ([`Relay::stepped_aside_routes`]); once it ends, a worker
    /// is woken, as the transport may be claimed for again.
    pub(super) fn straggle<'a>(
        &'a self,
        batch: Arc<Batch>,
        delivery: RouteDelivery<'a>,
        shutdown: CancellationToken,
        grace_end: &'a Cutoff,
    ) -> Straggler<'a> {
        let aside = SteppedAside::mark(self, delivery.route.clone());
        Box::pin(async move {
            let route = BTreeSet::from([delivery.route.clone()]);
            let mut running = FuturesUnordered::from_iter([delivery]);
            let mut completions = Vec::new();
            let driven = self.drive(&mut running, &mut completions, &shutdown, grace_end, None).await;
            if let Driven::GraceOver = driven {
                self.give_up(&batch, &route).await;
            }
            drop(running);
            let probed: Vec<String> = batch.probed.iter().filter(|r| route.contains(*r)).cloned().collect();
            if !completions.is_empty()
                && let Err(error) = self.settle(&batch, &completions, &probed).await
            {
                tracing::error!(
                    "recording the outcomes of deliveries that ran past their cycle failed; their events come back \
                     when their lease ends: {error}"
                );
            }
            drop(aside);
            self.wake.notify_one();
        })
    }

    /// Records `completions` of `batch` and accounts for them: metrics, the trace, the log,
    /// deferrals and the breakers (of the routes that delivered and of `probed`).
    pub(super) async fn settle(
        &self,
        batch: &Batch,
        completions: &[Completion],
        probed: &[String],
    ) -> Result<CycleStats, StoreError> {
        let totals = Outcomes::of(completions);
        let done_at = self.clock.now();
        let recording = std::time::Instant::now();
        let recorded = self.record_outcomes(&batch.token, done_at, completions).await?;
        self.metrics.record_duration.observe(recording.elapsed().as_secs_f64());
        let stats = CycleStats {
            claimed: 0,
            sent: totals.sent,
            retried: totals.retried,
            deferred: totals.deferred,
            failed: totals.failed,
            fenced_off: recorded.fenced_off(completions.len()),
        };
        if let Some(trace) = &batch.trace {
            trace.part(&batch.events, completions, (done_at, self.clock.now()), &totals, stats.fenced_off);
        }
        // Routes not configured here are counted and logged together (see `metrics::UNCONFIGURED`).
        let label = |route| route_label(&batch.routes, &batch.endpoints, route);
        self.count(&batch.events, completions, &totals, done_at, &label);
        self.wait_where_deferred(completions);
        self.log_failed(completions, done_at, &label);
        self.record_breakers(batch, completions, probed).await?;
        if stats.fenced_off > 0 {
            tracing::warn!(
                fenced_off = stats.fenced_off,
                "outcomes discarded: their claims expired and were recovered before delivery finished"
            );
        }
        Ok(stats)
    }

    /// The routes not to claim from now, by the deliveries carried on past their cycle: a
    /// webhook endpoint with as many of those as its calls may take of its template's instances
    /// ([`RouteTransport::config_limit`]); and a transport with as many as it has instances,
    /// where an endpoint counts for no more than it may take, with, when the transport is a
    /// route's endpoint template, every endpoint of that route in `endpoints`.
    ///
    /// [`RouteTransport::config_limit`]: crate::plugins::RouteTransport::config_limit
    pub(super) fn stepped_aside_routes(&self, routes: &Routes, endpoints: &EndpointTable) -> Vec<String> {
        let aside = self.stepped_aside.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut held = Vec::new();
        let mut taken: BTreeMap<&str, usize> = BTreeMap::new();
        for (route, &running) in aside.iter() {
            let transport = transport_route(routes, route);
            let mut takes = running;
            if transport != route {
                let most = routes.transport(transport).map_or(1, |t| t.config_limit());
                if running >= most {
                    held.push(route.clone());
                }
                // Its calls past that wait for its own, not for the other endpoints' instances.
                takes = running.min(most);
            }
            *taken.entry(transport).or_default() += takes;
        }
        for (transport, taken) in taken {
            let limit = routes.transport(transport).map_or(1, |t| t.instance_limit());
            if taken < limit {
                continue;
            }
            held.push(transport.to_string());
            for (route, fan_out) in &routes.settings.fan_outs {
                if fan_out.endpoints.as_ref().is_some_and(|e| e.template == transport) {
                    held.extend(endpoints.delivery_routes(route).map(String::from));
                }
            }
        }
        held
    }
}

/// Runs the deliveries workers step aside from, as they are handed over, until every sender is
/// gone and all of them have ended.
pub(super) async fn carry_on(mut handed: mpsc::UnboundedReceiver<Straggler<'_>>) {
    let mut running = FuturesUnordered::new();
    loop {
        tokio::select! {
            next = handed.recv() => match next {
                Some(straggler) => running.push(straggler),
                None => break,
            },
            Some(()) = running.next() => {}
        }
    }
    while running.next().await.is_some() {}
}
