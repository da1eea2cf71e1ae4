//! The relay: claim a batch, hand each route's events to its transport, record what happened.
//!
//! Claim short, deliver outside, record fenced: the claim commits before any plugin runs, and
//! the outcome write only touches rows still held by this claim's token.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rand::Rng;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use self::aside::{Batch, Driven, Lane, STEP_ASIDE_AFTER, carry_on};
use self::tally::{EventsById, Runs};
use crate::breaker::{Tally, Verdict, verdict};
use crate::clock::Clock;
use crate::config::Settings;
use crate::endpoints::EndpointTable;
use crate::event::{ClaimedEvent, Completion, Disposition, FailureReason};
use crate::live::Live;
use crate::metrics::{FailedLabels, Metrics, RouteLabels, RouteOnly};
use crate::telemetry::{Attr, Tracer};

mod aside;
mod deliver;
mod health;
mod tally;
mod trace;

pub use self::health::RelayHealth;
use crate::plugins::{Cutoff, RouteTransport};
use crate::store::{Breaker, Claim, RECOVER_BATCH, Store, StoreError, SweepWindow};

/// What one relay cycle did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CycleStats {
    pub claimed: usize,
    pub sent: usize,
    pub retried: usize,
    /// Deliveries the plugin deferred (no attempt counted).
    pub deferred: usize,
    pub failed: usize,
    /// Outcomes not written because the claim had been recovered in the meantime.
    pub fenced_off: usize,
}

/// What one call of [`Relay::purge`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Purged {
    /// SENT events deleted.
    pub deleted: u64,
    /// Events looked at to find them.
    pub looked_at: u64,
}

/// Routes resolved to transports, with their settings (retry policies among them). A cycle
/// works with the table in effect when it claimed; a configuration reload puts a new one in
/// effect for the cycles after.
#[derive(Debug)]
pub struct Routes {
    transports: HashMap<String, Arc<RouteTransport>>,
    settings: Arc<Settings>,
    ordered_routes: Vec<String>,
    blocking_routes: Vec<String>,
}

impl Routes {
    /// The route table: the settings and the transports started for them.
    pub fn new(settings: Arc<Settings>, transports: HashMap<String, Arc<RouteTransport>>) -> Self {
        let (ordered_routes, blocking_routes) = settings.ordered_routes();
        Self { transports, settings, ordered_routes, blocking_routes }
    }

    /// The transport of route `name`, if it is configured.
    pub fn transport(&self, name: &str) -> Option<&Arc<RouteTransport>> {
        self.transports.get(name)
    }

    /// Whether events of route `name` have somewhere to go: a transport, or destinations.
    pub fn knows(&self, name: &str) -> bool {
        self.transports.contains_key(name) || self.settings.fan_outs.contains_key(name)
    }

    /// Every route's transport, by route name.
    pub fn transports(&self) -> impl Iterator<Item = (&String, &Arc<RouteTransport>)> {
        self.transports.iter()
    }
}

/// The relay loop and its settings.
#[derive(Debug)]
pub struct Relay {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    routes: Live<Routes>,
    instance: String,
    batch_size: u32,
    workers: u32,
    poll_interval: Duration,
    idle_poll_max: Duration,
    listen: bool,
    lease: Duration,
    recover_every: u32,
    shutdown_grace: Duration,
    retain_sent: Option<Duration>,
    purge_batch: u32,
    /// Payloads larger than this are not loaded; such events fail alone.
    max_payload: u64,
    /// Consecutive transient failures that open a route's breaker; 0: breakers never open by
    /// themselves (operators can still open them).
    breaker_threshold: u32,
    breaker_cooldown: Duration,
    /// Cuts an idle wait short: notified by the database listener, by in-process emitters and by
    /// a worker that claimed a full batch (there may be more), for an idle one.
    wake: Arc<Notify>,
    metrics: Arc<Metrics>,
    health: Arc<RelayHealth>,
    /// Per route, when events ending FAILED were last logged and how many ended so since.
    failed_notices: std::sync::Mutex<HashMap<String, FailedNotice>>,
    /// Where each batch's trace goes, when `telemetry.otlp_endpoint` is set.
    tracer: Option<Arc<Tracer>>,
    /// Routes whose receiver asked to wait (a plugin deferred an event): not claimed from by this
    /// instance until then.
    waits: std::sync::Mutex<HashMap<String, DateTime<Utc>>>,
    /// The webhook endpoints last read, when, and under which settings.
    endpoints: tokio::sync::Mutex<Option<EndpointCache>>,
    /// The endpoint rows that could not be used, as last logged (logged again when they change).
    unusable_endpoints: std::sync::Mutex<Vec<String>>,
    /// Deliveries carried on past their cycle ([`STEP_ASIDE_AFTER`]), by the route delivered to
    /// (a webhook endpoint's own). A route or endpoint with as many as its calls may take of its
    /// transport's instances is not claimed for by this instance until one ends
    /// ([`Relay::stepped_aside_routes`]).
    stepped_aside: std::sync::Mutex<HashMap<String, usize>>,
}

/// The endpoint table as read at `read_at` for `settings`.
#[derive(Debug)]
struct EndpointCache {
    read_at: std::time::Instant,
    settings: Arc<Settings>,
    table: Arc<EndpointTable>,
}

/// How often, at most, the log says per route that events ended FAILED.
const FAILED_NOTICE_EVERY: Duration = Duration::from_secs(60);

/// The fewest due events listed when a refused claim is retried one event at a time: a probe
/// claims one, and needs others to show that the claim works while its first is refused.
const MIN_LISTED: u32 = 16;

/// The FAILED events of a route not yet in the log, and when it last said so.
#[derive(Debug, Default)]
struct FailedNotice {
    logged_at: Option<DateTime<Utc>>,
    unlogged: u64,
}

impl Relay {
    pub fn new(store: Arc<dyn Store>, clock: Arc<dyn Clock>, routes: Routes, metrics: Arc<Metrics>) -> Self {
        let settings = routes.settings.clone();
        let config = &settings.config;
        Self {
            store,
            clock,
            routes: Live::new(Arc::new(routes)),
            instance: config.instance_id(),
            batch_size: config.relay.batch_size,
            workers: config.relay.workers,
            poll_interval: config.relay.poll_interval.0,
            idle_poll_max: config.relay.idle_poll_max.0,
            listen: config.relay.listen,
            lease: config.relay.lease.0,
            recover_every: config.relay.recover_every,
            shutdown_grace: config.relay.shutdown_grace.0,
            retain_sent: config.relay.retain_sent.0,
            purge_batch: config.relay.purge_batch,
            max_payload: config.relay.max_payload.0 as u64,
            breaker_threshold: config.breaker.threshold,
            breaker_cooldown: config.breaker.cooldown.0,
            wake: Arc::new(Notify::new()),
            metrics,
            health: Arc::new(RelayHealth::new(config.relay.workers, config.relay.lease.0)),
            failed_notices: std::sync::Mutex::default(),
            tracer: None,
            waits: std::sync::Mutex::default(),
            endpoints: tokio::sync::Mutex::default(),
            unusable_endpoints: std::sync::Mutex::default(),
            stepped_aside: std::sync::Mutex::default(),
        }
    }

    /// Sends a trace of each batch to `tracer`.
    pub fn with_tracer(mut self, tracer: Option<Arc<Tracer>>) -> Self {
        self.tracer = tracer;
        self
    }

    /// The route table in effect.
    pub fn routes(&self) -> Arc<Routes> {
        self.routes.get()
    }

    /// Puts a new route table in effect from the next cycle on; cycles under way finish with
    /// the table they started with (and its transports), so no delivery is dropped.
    pub fn replace_routes(&self, routes: Routes) {
        self.routes.set(Arc::new(routes));
    }

    /// Wakes one idle worker (or, with none waiting, the next to wait); for code in this process
    /// that has just emitted.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Whether the workers make progress, for readiness.
    pub fn health(&self) -> Arc<RelayHealth> {
        self.health.clone()
    }

    /// A handle that wakes the relay, for code that outlives a borrow of it.
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// Runs until `shutdown` is cancelled, with `relay.workers` batches in flight at most.
    pub async fn run(&self, shutdown: CancellationToken) {
        let listening = self.listen && self.store.spawn_waker(self.wake.clone(), shutdown.child_token());
        tracing::info!(instance = %self.instance, batch_size = self.batch_size, workers = self.workers, listening, "relay started");
        // The grace period is one for all workers, counted from the stop. Each timing its own
        // from when it noticed, a worker whose claim was still running at the stop would deliver
        // after the others' grace had ended, on plugin instances they had just given back.
        let grace_end = Cutoff::default();
        let stop = async {
            shutdown.cancelled().await;
            grace_end.fix(self.shutdown_grace);
        };
        // Deliveries the workers step aside from run here, beside them, until they end; after
        // the workers stop, until the grace period ends.
        let (lane, stragglers) = mpsc::unbounded_channel();
        let (shutdown, grace_end) = (&shutdown, &grace_end);
        let workers = async move {
            let lane = lane;
            futures::future::join_all((0..self.workers).map(|worker| self.work(worker, shutdown, grace_end, &lane)))
                .await;
        };
        futures::future::join3(stop, workers, carry_on(stragglers)).await;
        tracing::info!(instance = %self.instance, "relay stopped");
    }

    /// One worker: claims as long as there is work, and waits (polling with a growing interval,
    /// or for a wake-up) when there is none. Worker 0 also does the housekeeping. Database errors
    /// are logged and retried; they never end the loop.
    async fn work<'a>(&'a self, worker: u32, shutdown: &'a CancellationToken, grace_end: &'a Cutoff, lane: &Lane<'a>) {
        let mut cycle: u64 = 0;
        let mut idle_pause = self.poll_interval;
        let mut error_pause = self.poll_interval;
        while !shutdown.is_cancelled() {
            self.health.busy(worker, true);
            if worker == 0 && cycle.is_multiple_of(u64::from(self.recover_every)) {
                self.housekeeping().await;
            }
            cycle += 1;
            let result = self.cycle_within(shutdown, grace_end, Some(lane)).await;
            self.health.busy(worker, false);
            let pause = match result {
                Ok(stats) if stats.claimed > 0 => {
                    // Work found: look again at once, and start idling afresh afterwards.
                    (idle_pause, error_pause) = (self.poll_interval, self.poll_interval);
                    continue;
                }
                Ok(_) => {
                    error_pause = self.poll_interval;
                    let pause = idle_pause;
                    idle_pause = (idle_pause * 2).min(self.idle_poll_max);
                    pause
                }
                Err(e) => {
                    tracing::error!("relay cycle failed, retrying in {error_pause:?}: {e}");
                    let pause = error_pause;
                    error_pause = (error_pause * 2).min(Duration::from_secs(5));
                    pause
                }
            };
            self.metrics.idle_workers.inc();
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(pause) => {}
                _ = self.wake.notified() => idle_pause = self.poll_interval,
            }
            self.metrics.idle_workers.dec();
        }
    }

    /// Stuck-claim recovery, unreadable retry times and retention; failures are logged, not
    /// fatal.
    pub async fn housekeeping(&self) {
        if let Err(e) = self.recover().await {
            tracing::error!("stuck-claim recovery failed: {e}");
        }
        match self.store.reschedule_unreadable(self.clock.now()).await {
            Ok(ids) => {
                for id in ids {
                    tracing::warn!(
                        event = id,
                        "next_attempt_at was not a time ferry can compare (edited by hand?); the event is due now"
                    );
                }
            }
            Err(e) => tracing::error!("rescheduling events with unreadable retry times failed: {e}"),
        }
        if let Err(e) = self.purge().await {
            tracing::error!("purging old SENT events failed: {e}");
        }
    }

    /// Deletes SENT events older than the retention period. There is no index of SENT rows to
    /// find them by (keeping one cost every delivery a write): retention sweeps the table along
    /// its primary key instead, a window of `purge_batch` events per step and at most ten steps
    /// per call, going on where the last call stopped (kept in the database, so across restarts;
    /// on PostgreSQL instances take turns moving it on, and an instance whose run overlapped
    /// another's leaves the other's position). A sweep ends at the end of the table or
    /// at a window written entirely after the cut-off: an event with a later id was written after
    /// that window, so it cannot have been delivered before the cut-off. The next sweep starts
    /// again from the lowest id, where events delivered late (retried, deferred, resent) come due
    /// in their turn. A call reads one window when no event older than the cut-off is left, and
    /// up to ten when some are kept (FAILED ones, say): each sweep walks past them again, so an
    /// outbox keeping ten windows' worth or more reads ten windows every run.
    pub async fn purge(&self) -> Result<Purged, StoreError> {
        let mut purged = Purged::default();
        let Some(retain) = self.retain_sent else { return Ok(purged) };
        let now = self.clock.now();
        let before = crate::clock::earlier(now, retain);
        let start = self.store.sweep_position().await?;
        let mut from = start;
        let mut failed = None;
        for _ in 0..10 {
            let window = SweepWindow { from, limit: self.purge_batch, before, now };
            let step = match self.store.purge_sent(&window).await {
                Ok(step) => step,
                Err(e) => {
                    // What the run did so far is kept: a window that keeps failing is not
                    // walked up to again and again.
                    failed = Some(e);
                    break;
                }
            };
            purged.deleted += step.deleted;
            purged.looked_at += step.seen;
            let next = match step.last {
                Some(last) if !step.young && step.seen >= u64::from(self.purge_batch) => last.checked_add(1),
                _ => None,
            };
            from = next.unwrap_or(i64::MIN);
            if next.is_none() {
                break;
            }
        }
        if from != start {
            self.store.set_sweep_position(start, from).await?;
        }
        if purged.deleted > 0 {
            tracing::info!(purged = purged.deleted, "deleted SENT events past their retention");
        }
        failed.map_or(Ok(purged), Err)
    }

    /// Hands PROCESSING events with an expired lease back to PENDING, [`RECOVER_BATCH`] at a
    /// time until none is left; returns how many.
    pub async fn recover(&self) -> Result<usize, StoreError> {
        let mut total = 0;
        loop {
            let recovered = self.store.recover_expired(self.clock.now(), RECOVER_BATCH).await?;
            for r in &recovered {
                tracing::warn!(
                    event = r.id,
                    claimed_by = r.claimed_by.as_deref().unwrap_or("?"),
                    "claim lease expired; event handed back to PENDING"
                );
            }
            total += recovered.len();
            if recovered.len() < RECOVER_BATCH as usize {
                return Ok(total);
            }
        }
    }

    /// One claim → deliver → record round, waiting for every delivery of the batch (the workers
    /// of [`Relay::run`] wait [`STEP_ASIDE_AFTER`] at most). If `shutdown` fires during delivery,
    /// in-flight calls get the grace period, after which unfinished events are handed back; once
    /// it has fired, nothing more is claimed (with a token already cancelled, nothing at all).
    pub async fn cycle(&self, shutdown: &CancellationToken) -> Result<CycleStats, StoreError> {
        self.cycle_within(shutdown, &Cutoff::default(), None).await
    }

    /// [`Relay::cycle`], as one of the workers that share `grace_end` (fixed at the stop; by the
    /// first to see it, when it is not). With a `lane`, deliveries still running after
    /// [`STEP_ASIDE_AFTER`] are handed to it, and the cycle records the others and returns.
    async fn cycle_within<'a>(
        &'a self,
        shutdown: &'a CancellationToken,
        grace_end: &'a Cutoff,
        lane: Option<&Lane<'a>>,
    ) -> Result<CycleStats, StoreError> {
        let now = self.clock.now();
        // The claim's lease runs from `now`: its end by the monotonic clock, which times the calls.
        let lease_ends = std::time::Instant::now() + self.lease;
        let token = new_token();
        let routes = self.routes.get();
        let breakers = self.store.breakers().await?;
        // An automatic breaker left from before its route had destinations: the route delivers
        // nothing itself, so no probe would ever close it.
        let stale =
            breakers.iter().filter(|b| b.is_open() && !b.manual && routes.settings.fan_outs.contains_key(&b.route));
        for breaker in stale {
            self.store.record_breaker(&breaker.route, 0, "", self.breaker_threshold, now).await?;
            tracing::info!(route = %breaker.route, "circuit breaker closed: the route hands its events on to destinations");
        }
        // Routes whose receiver asked this instance to wait: neither claimed from nor probed.
        let waiting = self.waiting_routes(now);
        let mut endpoints = self.endpoint_table(&routes, false).await?;
        // With them, disabled endpoints (their deliveries wait until they are enabled again), and
        // routes whose transport has as many deliveries running past their cycle as instances.
        let held: Vec<String> = waiting
            .into_iter()
            .chain(endpoints.disabled().map(String::from))
            .chain(self.stepped_aside_routes(&routes, &endpoints))
            .collect();
        let (mut ordered_routes, mut blocking_routes) = (routes.ordered_routes.clone(), routes.blocking_routes.clone());
        if !endpoints.is_empty() {
            let (ordered, blocking) = endpoints.ordered(&routes.settings);
            ordered_routes.extend(ordered);
            blocking_routes.extend(blocking);
        }
        let claim = Claim {
            now,
            limit: self.batch_size,
            // Whole milliseconds, as stored: a probe is given back by the time it was taken until.
            lease_until: crate::clock::truncate_ms(crate::clock::later(now, self.lease)),
            instance: self.instance.clone(),
            token: token.clone(),
            ordered_routes,
            blocking_routes,
            // A route with destinations delivers nothing itself, so only an operator pauses it; an
            // automatic breaker left from before it had destinations has no probe to close it.
            paused_routes: breakers
                .iter()
                .filter(|b| b.is_open() && (b.manual || !routes.settings.fan_outs.contains_key(&b.route)))
                .map(|b| b.route.clone())
                .chain(held.iter().cloned())
                .collect(),
            only_route: None,
            max_payload: self.max_payload,
        };
        // Stopped while reading the breakers or endpoints: nothing is claimed only to be handed back.
        if shutdown.is_cancelled() {
            return Ok(CycleStats::default());
        }
        let claiming = std::time::Instant::now();
        let claim_started = self.clock.now();
        let mut events = self.claim_due(&claim).await?;
        let claim_took = claiming.elapsed();
        // A full batch leaves work behind, most likely: an idle worker is woken to claim it
        // rather than sleep out its wait. One wake-up (LISTEN/NOTIFY, an emit) thus sets every
        // worker to a backlog, one after the other.
        if events.len() >= self.batch_size as usize && self.metrics.idle_workers.get() > 0 {
            self.wake.notify_one();
        }
        self.metrics.claim_duration.observe(claim_took.as_secs_f64());
        // A probe taken now would hold its route's half-open breaker until the lease ends.
        let probes =
            if shutdown.is_cancelled() { Vec::new() } else { self.probes(&claim, &routes, &breakers, &held).await };
        let probed: Vec<String> = probes.iter().map(|e| e.route.clone()).collect();
        events.extend(probes);
        // A reload between reading the table and claiming may have added routes whose events were
        // just claimed: they are handed back (no attempt counted) for the next cycle to claim
        // under the new table. The rest is delivered with the table it was claimed under.
        let latest = self.routes.get();
        if !Arc::ptr_eq(&routes, &latest) {
            let (newer, claimed): (Vec<ClaimedEvent>, Vec<ClaimedEvent>) =
                events.into_iter().partition(|e| !routes.knows(&e.route) && latest.knows(&e.route));
            self.hand_back(&token, &newer).await;
            events = claimed;
        }
        let (mut events, handed_on) = self.hand_on(&routes, &endpoints, &token, events).await?;
        // Deliveries to an endpoint this table does not have: made by another instance for one
        // created since this one last read them (or deleted since). Read again before judging;
        // should that fail, or the endpoint's route be ordered and the event keyed (it was claimed
        // without its order), they are handed back, no attempt counted, for a later cycle.
        let settings = &routes.settings;
        let unknown = |table: &EndpointTable, e: &ClaimedEvent| {
            settings.endpoints_of(&e.route).is_some() && table.get(&e.route).is_none()
        };
        if events.iter().any(|e| unknown(&endpoints, e)) {
            let claimed_with = endpoints.clone();
            let read = match self.endpoint_table(&routes, true).await {
                Ok(fresh) => {
                    endpoints = fresh;
                    true
                }
                Err(error) => {
                    tracing::warn!("reading the webhook endpoints failed; their deliveries are handed back: {error}");
                    false
                }
            };
            let (back, rest): (Vec<ClaimedEvent>, Vec<ClaimedEvent>) = events.into_iter().partition(|e| {
                let unordered_claim = e.ordering_key.is_some() && ordered_parent(settings, &e.route);
                unknown(&claimed_with, e) && (!read || (!unknown(&endpoints, e) && unordered_claim))
            });
            self.hand_back(&token, &back).await;
            events = rest;
        }
        let events = self.drop_untaken(&token, &endpoints, events).await;
        if events.is_empty() {
            return Ok(handed_on);
        }
        let claim_ended = crate::clock::later(claim_started, claim_took);
        self.metrics.batch_size.observe(events.len() as f64);
        let claimed = events.len() + handed_on.claimed;
        let lease_until = claim.lease_until;
        let claim = (claim_started, claim_ended);
        let trace = self.tracer.clone().map(|tracer| trace::BatchTrace::start(self, tracer, now, claim, events.len()));
        let batch =
            Arc::new(Batch { token, routes, endpoints, events, breakers, probed, lease_until, lease_ends, trace });
        let (mut completions, mut running) = self.deliver_all(&batch, grace_end);
        let step_aside = lane.map(|_| tokio::time::Instant::now() + STEP_ASIDE_AFTER);
        let driven = self.drive(&mut running, &mut completions, shutdown, grace_end, step_aside).await;
        let unfinished: BTreeSet<String> = running.iter().map(|d| d.route.clone()).collect();
        match driven {
            Driven::Done => {}
            Driven::GraceOver => {
                // The unfinished deliveries are dropped only once their events are released:
                // dropped first, they would free their plugin instances at once, and another
                // worker's call waiting for one could start after the grace period.
                self.give_up(&batch, &unfinished).await;
                drop(running);
            }
            Driven::StepAside => {
                tracing::debug!(
                    routes = ?unfinished,
                    "deliveries still running after {STEP_ASIDE_AFTER:?} go on beside the workers, which claim \
                     again; a transport with as many of them as it has instances is left out of the claims"
                );
                // Each on its own, so each is recorded as soon as it ends.
                for delivery in running {
                    let straggler = self.straggle(batch.clone(), delivery, shutdown.clone(), grace_end);
                    if let Some(Err(mpsc::error::SendError(straggler))) = lane.map(|lane| lane.send(straggler)) {
                        straggler.await;
                    }
                }
            }
        }
        let probed: Vec<String> = batch.probed.iter().filter(|r| !unfinished.contains(*r)).cloned().collect();
        let settled = match completions.is_empty() {
            true => CycleStats::default(),
            false => self.settle(&batch, &completions, &probed).await?,
        };
        Ok(CycleStats {
            claimed,
            sent: settled.sent,
            retried: settled.retried + handed_on.retried,
            deferred: settled.deferred,
            failed: settled.failed + handed_on.failed,
            fenced_off: settled.fenced_off + handed_on.fenced_off,
        })
    }

    /// `events` without the copies for an endpoint that does not take their type (any more: its
    /// types changed while they waited; or they were made while its row could not be read, when
    /// it was handed every type), which are deleted, as if never made. Delivered, they would reach
    /// a receiver that did not ask for them; failed, they would hold back its later events of their
    /// key and go to the route's dead letter. Should the delete fail, they are handed back.
    async fn drop_untaken(
        &self,
        token: &str,
        endpoints: &EndpointTable,
        events: Vec<ClaimedEvent>,
    ) -> Vec<ClaimedEvent> {
        let untaken = |e: &ClaimedEvent| {
            e.defect.is_none() && endpoints.get(&e.route).is_some_and(|endpoint| !endpoint.takes(&e.event_type))
        };
        if endpoints.is_empty() || !events.iter().any(untaken) {
            return events;
        }
        let (untaken, events): (Vec<ClaimedEvent>, Vec<ClaimedEvent>) = events.into_iter().partition(untaken);
        let ids: Vec<i64> = untaken.iter().map(|e| e.id).collect();
        match self.store.drop_copies(token, &ids).await {
            Ok(dropped) => {
                let mut by_route: BTreeMap<&str, usize> = BTreeMap::new();
                for event in untaken.iter().filter(|e| dropped.binary_search(&e.id).is_ok()) {
                    *by_route.entry(&event.route).or_default() += 1;
                }
                for (route, copies) in by_route {
                    tracing::info!(route, copies, "copies dropped: the endpoint does not take their event types");
                }
            }
            Err(error) => {
                tracing::warn!("dropping copies an endpoint does not take failed; handed back: {error}");
                self.hand_back(token, &untaken).await;
            }
        }
        events
    }

    /// Gives `events` back unattempted for a later cycle. Should that fail, they come back when
    /// their lease ends instead (the attempt counted), and the rest of the batch goes on.
    async fn hand_back(&self, token: &str, events: &[ClaimedEvent]) {
        if events.is_empty() {
            return;
        }
        let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
        if let Err(error) = self.store.release(token, &ids, self.clock.now()).await {
            tracing::warn!(
                events = ids.len(),
                "handing events back failed; they come back when their lease ends: {error}"
            );
        }
    }

    /// [`Store::claim`], around rows that break it. When the database refuses a claim for a value
    /// it met (one it cannot return, a trigger or constraint refusing a row's update), a row may
    /// be at fault, and it would fail every later claim too, stopping every route. The due events
    /// (at least [`MIN_LISTED`], so a probe's one-event claim has others to try) are then claimed
    /// one at a time, up to the claim's limit, and delivered. Those whose own claim is refused are
    /// set FAILED (`invalid_event`, with the database's error), but only when another event was
    /// taken: a refusal every row meets is the statement's or the database's, not a row's, and
    /// fails the cycle instead, leaving the events PENDING. Claiming one at a time stops after a
    /// quarter of the lease, so the events claimed by then are delivered well within it.
    async fn claim_due(&self, claim: &Claim) -> Result<Vec<ClaimedEvent>, StoreError> {
        let error = match self.store.claim(claim).await {
            Err(error) if error.refuses_a_value() => error,
            other => return other,
        };
        tracing::warn!(
            "the database refused a claim; claiming the due events one at a time to find the row at fault: {error}"
        );
        let (mut claimed, mut refused) = (Vec::new(), Vec::new());
        let listed = Claim { limit: claim.limit.max(MIN_LISTED), ..claim.clone() };
        let started = std::time::Instant::now();
        for id in self.store.due(&listed).await? {
            if claimed.len() >= claim.limit as usize {
                break;
            }
            if started.elapsed() > self.lease / 4 {
                tracing::warn!(
                    "claiming the due events one at a time took a quarter of the lease; the rest wait for the next cycle"
                );
                break;
            }
            match self.store.claim_one(claim, id).await {
                // An event taken, not only a statement run, shows the claim works: a refusal of
                // every update lets through the claim of a row no longer due.
                Ok(events) => claimed.extend(events),
                Err(error) if error.refuses_a_value() => refused.push((id, error)),
                // Its lock held past the wait the one-event claim allows (an open transaction
                // holds the row): tried again next cycle.
                Err(error) if error.is_transient() => {
                    tracing::warn!(event = id, "event skipped this cycle: {error}");
                }
                // Those claimed so far are delivered; the next cycle meets the error again.
                Err(error) if !claimed.is_empty() => {
                    tracing::warn!("claiming the due events one at a time stopped: {error}");
                    break;
                }
                Err(error) => return Err(error),
            }
        }
        if claimed.is_empty() {
            return Err(error);
        }
        for (id, error) in refused {
            let reason = crate::untrusted::clean(
                &format!(
                    "event {id}: the database refuses to claim it ({error}); fix the row and resend it, or purge it"
                ),
                crate::untrusted::MAX_REASON,
            );
            match self.store.set_unclaimable(id, self.clock.now(), &self.instance, &reason).await {
                Ok(true) => {
                    tracing::error!(event = id, "event set FAILED (invalid_event): {reason}");
                    let labels = crate::metrics::FailedLabels {
                        route: crate::metrics::UNCLAIMED.into(),
                        plugin: "".into(),
                        reason: FailureReason::InvalidEvent.as_str().into(),
                    };
                    self.metrics.failed.get_or_create(&labels).inc();
                }
                Ok(false) => {}
                Err(e) => tracing::error!(
                    event = id,
                    "the database refuses to claim event {id} ({error}) and to set it FAILED ({e}); it is skipped"
                ),
            }
        }
        Ok(claimed)
    }

    /// For each route whose breaker has cooled down, takes the half-open probe (one instance
    /// wins it) and claims one event to try the route with. Routes with destinations are not
    /// probed: their events are handed on, not delivered (see `cycle`); nor are routes `paused`
    /// for other reasons (their receiver asked to wait, a disabled endpoint). A probe that cannot
    /// be taken (the database failed the statement) costs its route this cycle's probe, not the
    /// batch already claimed: the next cycle tries again.
    async fn probes(
        &self,
        claim: &Claim,
        routes: &Routes,
        breakers: &[Breaker],
        paused: &[String],
    ) -> Vec<ClaimedEvent> {
        let mut probes = Vec::new();
        for breaker in breakers {
            if paused.contains(&breaker.route)
                || routes.settings.fan_outs.contains_key(&breaker.route)
                || !breaker.probe_due(claim.now, self.breaker_cooldown)
            {
                continue;
            }
            match self.probe(claim, &breaker.route).await {
                Ok(Some(event)) => {
                    tracing::info!(route = %breaker.route, event = event.id, "circuit breaker half-open: probing with one event");
                    probes.push(event);
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(route = %breaker.route, "circuit breaker half-open, but its probe could not be taken; trying again next cycle: {error}");
                }
            }
        }
        probes
    }

    /// Takes `route`'s probe and claims one event for it; gives the probe back if there is none.
    async fn probe(&self, claim: &Claim, route: &str) -> Result<Option<ClaimedEvent>, StoreError> {
        let cooled = crate::clock::earlier(claim.now, self.breaker_cooldown);
        if !self.store.take_probe(route, cooled, claim.now, claim.lease_until).await? {
            return Ok(None);
        }
        let one = Claim { limit: 1, paused_routes: Vec::new(), only_route: Some(route.to_string()), ..claim.clone() };
        let claimed = self.claim_due(&one).await.map(|mut events| events.pop());
        if !matches!(claimed, Ok(Some(_))) {
            // Nothing to probe with, or the claim failed: the probe is given back (if that fails
            // too, it is held until its lease ends).
            self.store.release_probe(route, claim.lease_until).await?;
        }
        claimed
    }

    /// Feeds each route's results into its circuit breaker: a success resets it (and closes it),
    /// transient failures count towards opening it (or reopen it after a probe). Permanent
    /// failures say nothing about the endpoint and are left out; a probe that ended that way is
    /// given back at once, so the next cycle probes again.
    async fn record_breakers(
        &self,
        batch: &Batch,
        completions: &[Completion],
        probed: &[String],
    ) -> Result<(), StoreError> {
        let mut by_id = EventsById::new(&batch.events);
        let mut tallies: BTreeMap<&str, Tally> = BTreeMap::new();
        for completion in completions {
            if let Some(event) = by_id.get(completion.id) {
                tallies.entry(&event.route).or_default().add(&completion.disposition);
            }
        }
        for route in probed {
            tallies.entry(route).or_default();
        }
        let now = self.clock.now();
        for (route, tally) in tallies {
            let before = batch.breakers.iter().find(|b| b.route == route);
            let probed = probed.iter().any(|p| p == route);
            match verdict(before, &tally, self.breaker_threshold, probed) {
                Verdict::Keep => {}
                Verdict::ReleaseProbe => self.store.release_probe(route, batch.lease_until).await?,
                Verdict::Reset => {
                    let after = self.store.record_breaker(route, 0, "", self.breaker_threshold, now).await?;
                    if before.is_some_and(|b| b.is_open()) && !after.is_open() {
                        tracing::info!(route, "circuit breaker closed: the route delivers again");
                    }
                }
                Verdict::Count { failures, reason } => {
                    let after =
                        self.store.record_breaker(route, failures, &reason, self.breaker_threshold, now).await?;
                    if after.opened_at == Some(now) && !after.manual {
                        tracing::warn!(
                            route,
                            consecutive_failures = after.consecutive_failures,
                            cooldown = ?self.breaker_cooldown,
                            "circuit breaker open: the route's events wait until a probe succeeds; {reason}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// The webhook endpoints of the routes that take them: read again when `fresh`, when older
    /// than [`crate::endpoints::REFRESH`] or read under other settings; not read at all when no route
    /// takes endpoints. Rows that cannot be used are logged when they change; when the table
    /// cannot be read, the last one read under these settings serves meanwhile.
    async fn endpoint_table(&self, routes: &Routes, fresh: bool) -> Result<Arc<EndpointTable>, StoreError> {
        let settings = &routes.settings;
        if !settings.fan_outs.values().any(|f| f.endpoints.is_some()) {
            return Ok(Arc::default());
        }
        let mut cache = self.endpoints.lock().await;
        if let Some(cached) = cache.as_ref()
            && !fresh
            && cached.read_at.elapsed() < crate::endpoints::REFRESH
            && Arc::ptr_eq(&cached.settings, settings)
        {
            return Ok(cached.table.clone());
        }
        let stored = match (self.store.endpoints(None).await, cache.as_mut()) {
            (Ok(stored), _) => stored,
            // The table read last serves until the next try, a second later, so other routes do
            // not wait on this. Before any was read, the cycle fails: handing events on to no
            // endpoint would lose them.
            (Err(e), Some(cached)) if !fresh && Arc::ptr_eq(&cached.settings, settings) => {
                tracing::error!("reading the webhook endpoints failed, trying again in a second: {e}");
                cached.read_at = std::time::Instant::now();
                return Ok(cached.table.clone());
            }
            (Err(e), _) => return Err(e),
        };
        let (table, unusable) = EndpointTable::build(settings, &stored, self.clock.now());
        let mut logged = self.unusable_endpoints.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if *logged != unusable {
            for why in &unusable {
                tracing::error!("{why}");
            }
            *logged = unusable;
        }
        let table = Arc::new(table);
        *cache = Some(EndpointCache {
            read_at: std::time::Instant::now(),
            settings: settings.clone(),
            table: table.clone(),
        });
        Ok(table)
    }

    /// Routes whose receiver asked to wait until after `now`; forgets those whose wait is over.
    fn waiting_routes(&self, now: DateTime<Utc>) -> Vec<String> {
        let mut waits = self.waits.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        waits.retain(|_, until| *until > now);
        waits.keys().cloned().collect()
    }

    /// A deferral says the receiver asked to wait (the plugin deferred), or that the host could
    /// not make the call now (short of files or memory, too little of the lease left after waiting
    /// for an instance): its route's other events wait too (on this instance), until the earliest
    /// deferral of the batch is due (or a longer wait already set ends), so a rate-limited
    /// receiver is not sent the rest of a backlog meanwhile, nor a busy host asked again at once.
    fn wait_where_deferred(&self, completions: &[Completion]) {
        let mut waits = self.waits.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // By route: the earliest deferral, and whether a plugin asked for any.
        let mut batch: HashMap<&str, (DateTime<Utc>, bool)> = HashMap::new();
        for completion in completions {
            if let Disposition::Deferred { at, .. } = completion.disposition {
                let call = &completion.attempt.call;
                let until = batch.entry(&call.route).or_insert((at, false));
                *until = (until.0.min(at), until.1 || call.held.is_none());
            }
        }
        for (route, (until, asked)) in batch {
            // Another batch's longer wait, still running, is kept.
            let wait = waits.entry(route.to_string()).or_insert(until);
            *wait = (*wait).max(until);
            let why = match asked {
                true => "the receiver asked to wait",
                false => "the host could not make the call now (the events' last error says why)",
            };
            tracing::info!(route, until = %wait.to_rfc3339_opts(chrono::SecondsFormat::Millis, true), "{why}: the route's events wait until then on this instance");
        }
    }

    /// Says in the log, at most once a minute per route, that events ended FAILED: how many since
    /// the last line, why the last one failed, and the command that lists them.
    /// Routes not configured here share one notice (by `label`), which names the last of them.
    fn log_failed<'a>(&self, completions: &'a [Completion], now: DateTime<Utc>, label: &dyn Fn(&'a str) -> &'a str) {
        let mut failed: BTreeMap<&str, (u64, FailureReason, &str, &str)> = BTreeMap::new();
        for completion in completions {
            if let Disposition::Failed { reason, error } = &completion.disposition {
                // A plugin call is for one route: the event's.
                let route = completion.attempt.call.route.as_str();
                let entry = failed.entry(label(route)).or_insert((0, *reason, error, route));
                *entry = (entry.0 + 1, *reason, error, route);
            }
        }
        if failed.is_empty() {
            return;
        }
        let mut notices = self.failed_notices.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for (key, (count, reason, error, route)) in failed {
            let notice = notices.entry(key.to_string()).or_default();
            notice.unlogged += count;
            if notice.logged_at.is_some_and(|at| crate::clock::later(at, FAILED_NOTICE_EVERY) > now) {
                continue;
            }
            if key == crate::metrics::UNCONFIGURED {
                tracing::warn!(
                    last_route = route,
                    failed = notice.unlogged,
                    last_reason = %reason,
                    last_error = error,
                    "events of routes not configured here ended FAILED (kept for inspection: `ferry failed summary`, `ferry failed resend`)"
                );
            } else {
                tracing::warn!(
                    route,
                    failed = notice.unlogged,
                    last_reason = %reason,
                    last_error = error,
                    "events ended FAILED (kept for inspection: `ferry failed list --route {route}`, `ferry failed resend`)"
                );
            }
            notice.logged_at = Some(now);
            notice.unlogged = 0;
        }
    }

    /// Counts a batch's outcomes in the metrics, each route under its `label`.
    fn count<'a>(
        &self,
        events: &'a [ClaimedEvent],
        completions: &[Completion],
        totals: &Outcomes,
        done_at: DateTime<Utc>,
        label: &dyn Fn(&'a str) -> &'a str,
    ) {
        // Tallied first, so each label set is looked up once per batch, not once per event.
        let mut by_id = EventsById::new(events);
        // By route, plugin and (for failures) failure reason.
        let mut tally: Runs<(&str, &str, Option<FailureReason>), Outcomes> = Runs::new();
        let mut latencies: Runs<&str, Vec<f64>> = Runs::new();
        // Deferrals the host made, by route, plugin and why.
        let mut held: Runs<(&str, &str, &str), u64> = Runs::new();
        for completion in completions {
            let Some(event) = by_id.get(completion.id) else { continue };
            let plugin = completion.attempt.call.plugin.as_deref().unwrap_or_default();
            let reason = completion.disposition.reason();
            let route = event.route.as_str();
            tally.entry((route, plugin, reason)).count(&completion.disposition);
            if let Some(why) = completion.attempt.call.held {
                *held.entry((route, plugin, why)) += 1;
            }
            if completion.disposition == Disposition::Sent {
                let latency = (done_at - event.created_at).num_milliseconds().max(0) as f64 / 1000.0;
                latencies.entry(route).push(latency);
            }
        }
        let (tally, latencies) = (tally.into_entries(), latencies.into_entries());
        // Labelled per route, not per event: routes not configured share one label, and their
        // counts add up in it.
        for ((route, plugin, reason), outcomes) in tally {
            let labels = RouteLabels { route: label(route).into(), plugin: plugin.into() };
            match reason {
                None => {
                    self.metrics.delivered.get_or_create(&labels).inc_by(count(outcomes.sent));
                    self.metrics.retried.get_or_create(&labels).inc_by(count(outcomes.retried));
                    self.metrics.deferred.get_or_create(&labels).inc_by(count(outcomes.deferred));
                }
                Some(reason) => {
                    let labels =
                        FailedLabels { route: labels.route, plugin: labels.plugin, reason: reason.as_str().into() };
                    self.metrics.failed.get_or_create(&labels).inc_by(count(outcomes.failed));
                }
            }
        }
        for ((route, plugin, why), events) in held.into_entries() {
            let labels = FailedLabels { route: label(route).into(), plugin: plugin.into(), reason: why.into() };
            self.metrics.held.get_or_create(&labels).inc_by(events);
        }
        let all: Vec<f64> = latencies.iter().flat_map(|(_, values)| values).map(|seconds| seconds * 1000.0).collect();
        self.metrics.activity.record(done_at, count(totals.sent), count(totals.retried), count(totals.failed), &all);
        for (route, values) in latencies {
            let histogram = self.metrics.delivery_latency.get_or_create(&RouteOnly { route: label(route).into() });
            values.into_iter().for_each(|v| histogram.observe(v));
        }
    }
}

/// `route`, if it is configured here (a route, a route's destination or one of the endpoints in
/// `endpoints`); [`crate::metrics::UNCONFIGURED`] otherwise.
fn route_label<'a>(routes: &Routes, endpoints: &EndpointTable, route: &'a str) -> &'a str {
    let settings = &routes.settings;
    let known =
        settings.routes.contains_key(route) || settings.fan_outs.contains_key(route) || endpoints.get(route).is_some();
    if known { route } else { crate::metrics::UNCONFIGURED }
}

/// How many events of a call or batch ended each way.
#[derive(Debug, Default, Clone, Copy)]
struct Outcomes {
    sent: usize,
    retried: usize,
    deferred: usize,
    failed: usize,
}

impl Outcomes {
    fn of<'a>(items: impl IntoIterator<Item = &'a Completion>) -> Outcomes {
        let mut outcomes = Outcomes::default();
        items.into_iter().for_each(|item| outcomes.count(&item.disposition));
        outcomes
    }

    fn add(&mut self, other: &Outcomes) {
        self.sent += other.sent;
        self.retried += other.retried;
        self.deferred += other.deferred;
        self.failed += other.failed;
    }

    fn count(&mut self, disposition: &Disposition) {
        match disposition {
            Disposition::Sent => self.sent += 1,
            Disposition::Retry { .. } => self.retried += 1,
            Disposition::Deferred { .. } => self.deferred += 1,
            Disposition::Failed { .. } => self.failed += 1,
        }
    }

    fn attributes(&self) -> [(&'static str, Attr); 4] {
        [
            ("ferry.sent", self.sent.into()),
            ("ferry.retried", self.retried.into()),
            ("ferry.deferred", self.deferred.into()),
            ("ferry.failed", self.failed.into()),
        ]
    }
}

/// A count as a metric takes it.
fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Whether the route of the endpoint delivery route `route` (`route/ep_…`) is ordered.
fn ordered_parent(settings: &Settings, route: &str) -> bool {
    let parent = route.split_once(crate::config::DESTINATION_SEPARATOR).map(|(parent, _)| parent);
    parent.and_then(|p| settings.fan_outs.get(p)).is_some_and(|f| f.ordering != crate::config::Ordering::Unordered)
}

/// A fresh, unguessable claim token.
fn new_token() -> String {
    let bits: u128 = rand::rng().random();
    format!("{bits:032x}")
}
