//! Operator operations, written once: emit, show, resend, failed count / list / resend / purge,
//! breakers, plugins, stats and status, each with its validation. The CLI and the admin API are
//! thin front-ends over these: they parse their input, call one operation and render its typed
//! answer, so the same input gets the same answer through both.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::Notify;

use crate::breaker::{Breaker, BreakerState};
use crate::clock::Clock;
use crate::config::{Ordering, Settings};
use crate::event::{FailureReason, NewEvent, Status};
use crate::live::Live;
use crate::plugins::{Registry, Reloaded};
use crate::report::{
    BreakerView, Created, EventView, FailedCount, FailedPage, FailedSummary, JsonPayload, PluginsView, ReloadResult,
    ReloadView, ReloadedFile, RetryView, RouteView, StatsView, StatusCounts,
};
use crate::store::{self, BulkOp, EndEvent, FailedFilter, ReasonFilter, Store, StoreError};

/// Largest page of FAILED events one call returns.
pub const MAX_PAGE: u32 = 10_000;

/// The last error of an event failed by hand when the operator gives no reason.
pub const FAILED_BY_HAND: &str = "failed by an operator";

/// The reason of a breaker opened by hand when the operator gives none.
pub const OPENED_BY_HAND: &str = "opened by an operator";

/// Most groups a FAILED summary lists.
pub const MAX_GROUPS: u32 = 1000;

/// FAILED events per page when the front-end asks for no particular number.
pub const DEFAULT_PAGE: u32 = 50;

/// The latency window of `stats` when none is given.
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(3600);

/// Longest latency window accepted.
pub const MAX_WINDOW: Duration = Duration::from_secs(30 * 24 * 3600);

/// Why an operation did not happen. Front-ends map the kind to an HTTP status or an exit code and
/// show the message as it is: it names the input at fault.
#[derive(Debug, thiserror::Error)]
pub enum OpError {
    /// The input is unusable (HTTP 400).
    #[error("{0}")]
    Invalid(String),
    /// What the input names does not exist (HTTP 404).
    #[error("{0}")]
    NotFound(String),
    /// The target is in a state that does not allow it (HTTP 409).
    #[error("{0}")]
    Conflict(String),
    /// The database failed (HTTP 503).
    #[error(transparent)]
    Store(StoreError),
}

impl From<StoreError> for OpError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::InvalidEvent(message) => OpError::Invalid(message),
            other => OpError::Store(other),
        }
    }
}

/// Which front-end an operation serves: errors name inputs the way that front-end spells them
/// (`--before` on the command line, `before` in the API), and say the same otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrontEnd {
    Cli,
    Api,
}

impl FrontEnd {
    /// How this front-end spells the input `field`.
    pub fn name(self, field: &str) -> String {
        match self {
            FrontEnd::Cli => format!("--{}", field.replace('_', "-")),
            FrontEnd::Api => field.to_string(),
        }
    }

    /// How this front-end spells turning the switch `field` on.
    pub fn switch(self, field: &str) -> String {
        match self {
            FrontEnd::Cli => self.name(field),
            FrontEnd::Api => format!("{field:?}: true"),
        }
    }
}

/// Which FAILED events an operation applies to, as a front-end received it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FilterInput {
    pub route: Option<String>,
    pub event_type: Option<String>,
    /// Created at or after this time.
    pub from: Option<DateTime<Utc>>,
    /// Created before this time.
    pub before: Option<DateTime<Utc>>,
    /// Failed for this reason (`permanent`, `attempts_exhausted`, …, or `none`: no reason
    /// recorded).
    pub reason: Option<String>,
    /// With this id or a lower one.
    pub through_id: Option<i64>,
    /// Whose last error contains this text, letter case aside.
    pub error: Option<String>,
}

impl FilterInput {
    /// The store's filter, or why the input is not one.
    pub fn validate(self, front: FrontEnd) -> Result<FailedFilter, OpError> {
        let name = |field| front.name(field);
        if let (Some(from), Some(before)) = (self.from, self.before)
            && from >= before
        {
            return Err(OpError::Invalid(format!(
                "{} ({from}) must be earlier than {} ({before})",
                name("from"),
                name("before")
            )));
        }
        for (field, value) in [("route", &self.route), ("type", &self.event_type), ("error", &self.error)] {
            if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                return Err(OpError::Invalid(format!("{} must not be empty", name(field))));
            }
        }
        if let Some(text) = &self.error
            && text.len() > MAX_ERROR_FILTER
        {
            return Err(OpError::Invalid(format!(
                "{} is {} bytes long; an error is at most {MAX_ERROR_FILTER} bytes, so search for a shorter part of it",
                name("error"),
                text.len()
            )));
        }
        if let Some(id) = self.through_id
            && id < 1
        {
            return Err(OpError::Invalid(format!("{} must be a positive event id, got {id}", name("through_id"))));
        }
        let reason = match self.reason.as_deref().map(str::trim) {
            None => None,
            Some("none") => Some(ReasonFilter::Unrecorded),
            Some(text) => Some(
                FailureReason::ALL.into_iter().find(|r| r.as_str() == text).map(ReasonFilter::Is).ok_or_else(|| {
                    let known: Vec<&str> = FailureReason::ALL.iter().map(|r| r.as_str()).collect();
                    OpError::Invalid(format!(
                        "{} must be one of {} or none (no reason recorded), got {text:?}",
                        name("reason"),
                        known.join(", ")
                    ))
                })?,
            ),
        };
        Ok(FailedFilter {
            route: self.route,
            event_type: self.event_type,
            from: self.from,
            before: self.before,
            after_id: None,
            reason,
            through_id: self.through_id,
            error: self.error,
            newest_first: false,
        })
    }
}

/// Which page of a listing: where it starts, how long it is, and in which order.
#[derive(Debug, Clone, Copy, Default)]
pub struct Page {
    /// The last id of the previous page.
    pub after: Option<i64>,
    /// Events per page ([`DEFAULT_PAGE`] when not given).
    pub limit: Option<u32>,
    /// The most recent events (highest ids) first.
    pub newest_first: bool,
}

/// The longest text an error filter searches for; stored errors are bounded to a few KiB (a
/// plugin's reason to `untrusted::MAX_REASON` characters).
const MAX_ERROR_FILTER: usize = 4096;

/// What the operations work on.
#[derive(Debug, Clone)]
pub struct Ops {
    /// The settings in effect; `serve` replaces them on a configuration reload.
    pub settings: Arc<Live<Settings>>,
    pub store: Arc<dyn Store>,
    pub clock: Arc<dyn Clock>,
    /// Wakes a relay in this process after events became due (emit, resend).
    pub wake: Option<Arc<Notify>>,
    /// Who asked, for naming inputs in errors.
    pub front: FrontEnd,
}

impl Ops {
    /// Operations under fixed settings (a command of its own, not `serve`).
    pub fn new(settings: Arc<Settings>, store: Arc<dyn Store>, clock: Arc<dyn Clock>, front: FrontEnd) -> Ops {
        Ops { settings: Arc::new(Live::new(settings)), store, clock, wake: None, front }
    }

    /// The settings in effect now.
    pub fn settings(&self) -> Arc<Settings> {
        self.settings.get()
    }

    fn wake(&self) {
        if let Some(wake) = &self.wake {
            wake.notify_one();
        }
    }

    /// The time operations work with (a delay given with an event counts from it).
    pub fn now(&self) -> DateTime<Utc> {
        self.clock.now()
    }

    /// The time an event given `delay` is due, counted from `now`.
    pub fn deliver_after(&self, now: DateTime<Utc>, delay: Duration) -> Result<DateTime<Utc>, OpError> {
        chrono::Duration::from_std(delay)
            .ok()
            .and_then(|d| now.checked_add_signed(d))
            .filter(|at| storable(*at))
            .ok_or_else(|| OpError::Invalid(format!("{} is too long", self.front.name("delay"))))
    }

    /// Refuses `at`, given as `field`, when the database cannot store it (it would refuse the row
    /// with an error of its own).
    pub fn check_time(&self, field: &str, at: DateTime<Utc>) -> Result<(), OpError> {
        match storable(at) {
            true => Ok(()),
            false => Err(OpError::Invalid(format!(
                "{} {at} is not a time ferry can store: use a year from 1 to 9999",
                self.front.name(field)
            ))),
        }
    }

    /// Refuses an operator's reason longer than a plugin's may be.
    fn check_reason(&self, reason: &str) -> Result<(), OpError> {
        match reason.len() {
            n if n > crate::untrusted::MAX_REASON => Err(OpError::Invalid(format!(
                "{} is {n} bytes long; give at most {}",
                self.front.name("reason"),
                crate::untrusted::MAX_REASON
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses an event id that cannot exist.
    fn check_id(&self, id: i64) -> Result<(), OpError> {
        if id < 1 {
            return Err(OpError::Invalid(format!("event id must be a positive integer, got {id}")));
        }
        Ok(())
    }

    /// Inserts `event` (outside any application transaction) into a configured route, created at
    /// `now` (from [`Ops::now`], so a delay counted from it is exact).
    pub async fn emit(&self, event: NewEvent, now: DateTime<Utc>) -> Result<Created, OpError> {
        event.validate().map_err(OpError::Invalid)?;
        let settings = self.settings();
        event.check_payload(settings.config.relay.max_payload.0).map_err(OpError::Invalid)?;
        if !settings.is_configured(&event.route) {
            let known = settings.route_names();
            return Err(OpError::Invalid(format!(
                "route {:?} is not configured (configured: {})",
                event.route,
                if known.is_empty() { "none".to_string() } else { known.join(", ") }
            )));
        }
        // An endpoint's own deliveries: only to one that exists, and of a type it takes (as when
        // ferry hands an event of its route on to it).
        if let Some((route, id)) = event.route.split_once(crate::config::DESTINATION_SEPARATOR)
            && settings.endpoints_of(&event.route).is_some()
        {
            let Some(stored) = self.store.endpoint(id).await?.filter(|e| e.route == route) else {
                return Err(OpError::Invalid(format!("route {:?} names no endpoint of route {route:?}", event.route)));
            };
            let endpoint = crate::endpoints::Endpoint::decode(&stored).map_err(OpError::Invalid)?;
            let types = crate::config::EventTypes::new(&endpoint.body.event_types).map_err(OpError::Invalid)?;
            if !types.matches(&event.event_type) {
                return Err(OpError::Invalid(format!(
                    "endpoint {id} does not take events of type {:?} (its event_types: {})",
                    event.event_type,
                    endpoint.body.event_types.join(", ")
                )));
            }
        }
        let id = self.store.insert(&event, now).await?;
        self.wake();
        Ok(Created { id })
    }

    /// One event with its delivery history.
    pub async fn show(&self, id: i64) -> Result<EventView, OpError> {
        self.show_as(id, JsonPayload::Value).await
    }

    /// One event with its delivery history, a JSON payload shown as `json` says.
    pub async fn show_as(&self, id: i64, json: JsonPayload) -> Result<EventView, OpError> {
        self.check_id(id)?;
        let event = self.store.get(id).await?.ok_or_else(|| OpError::NotFound(format!("no event with id {id}")))?;
        let attempts = self.store.attempts(id).await?;
        let waiting = match event.status {
            Status::Pending => Some(self.why_waiting(&event, attempts.last()).await?),
            _ => None,
        };
        let deliveries = match event.status {
            Status::Sent if event.parent_id.is_none() => {
                Some(self.store.deliveries(id).await?).filter(|d| !d.is_empty())
            }
            _ => None,
        };
        let mut view = EventView::showing(event, Some(attempts), json);
        view.waiting = waiting;
        view.deliveries = deliveries;
        Ok(view)
    }

    /// Why a PENDING event is not being delivered yet, a sentence per reason: deferred or backing
    /// off, its route's breaker, an earlier event of its ordering key; "due now" when nothing
    /// holds it back. (Whether the route's plugin is loaded only the running ferry knows: its
    /// readiness check and `ferry config check` say.)
    /// `last` is the latest row of its history, if any.
    async fn why_waiting(
        &self,
        event: &crate::event::EventRecord,
        last: Option<&crate::event::AttemptRecord>,
    ) -> Result<Vec<String>, OpError> {
        let now = self.clock.now();
        let settings = self.settings();
        // A route with destinations hands its events on in key order when it is ordered.
        let ordering = match (settings.route(&event.route), settings.fan_outs.get(&event.route)) {
            (Some(route), _) => route.ordering,
            (None, Some(fan_out)) => fan_out.ordering,
            (None, None) => {
                return Ok(vec![format!(
                    "route {:?} is not configured here: when it is due, it fails with reason no_transport",
                    event.route
                )]);
            }
        };
        let mut why = Vec::new();
        if event.next_attempt_at > now {
            let when = event.next_attempt_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
            let deferred_by_plugin = last.filter(|a| a.outcome == crate::event::AttemptOutcome::Deferred);
            why.push(match (deferred_by_plugin, event.attempts) {
                (Some(a), _) => format!(
                    "deferred by plugin {} until {when}, as the receiver asked ({}); no attempt was counted",
                    a.plugin.as_deref().unwrap_or("?"),
                    a.error.as_deref().unwrap_or("no reason given")
                ),
                (None, 0) => format!("deferred until {when}"),
                (None, n) => format!("attempt {} is due at {when}, after a transient failure", u64::from(n) + 1),
            });
        }
        if settings.endpoints_of(&event.route).is_some() {
            let id = event.route.rsplit(crate::config::DESTINATION_SEPARATOR).next().unwrap_or_default();
            match self.store.endpoint(id).await? {
                None => {
                    why.push(format!("endpoint {id} was deleted: when it is due, it fails with reason no_transport"))
                }
                Some(stored) => match crate::endpoints::Endpoint::decode(&stored) {
                    Ok(endpoint) if !endpoint.body.enabled => {
                        why.push(format!("endpoint {id} is disabled: it waits until `ferry endpoints enable {id}`"))
                    }
                    Ok(_) => {}
                    Err(unusable) => why.push(format!(
                        "{unusable}: it waits until the row is fixed (then it is delivered if the endpoint takes \
                         its type, or dropped) or deleted"
                    )),
                },
            }
        }
        let cooldown = self.settings().breaker_cooldown();
        if let Some(b) = self.store.breakers().await?.into_iter().find(|b| b.route == event.route) {
            let reason = b.reason.as_deref().unwrap_or("no reason given");
            match b.state(now, cooldown) {
                BreakerState::Open if b.manual => why.push(format!(
                    "the route's breaker was opened by hand ({reason}): its events wait until `ferry breaker close {}`",
                    event.route
                )),
                BreakerState::Open => why.push(format!(
                    "the route's breaker is open after {} transient failures in a row (the last: {reason}); a probe \
                     delivery may go from {}",
                    b.consecutive_failures,
                    b.opened_at.map_or_else(String::new, |at| {
                        crate::clock::later(at, cooldown).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                    })
                )),
                BreakerState::HalfOpen => {
                    why.push("the route's breaker is half-open: one probe delivery at a time until one succeeds".into())
                }
                BreakerState::Closed => {}
            }
        }
        if let (Ordering::Ordered { failed_blocks_key }, Some(key)) = (ordering, &event.ordering_key)
            && let Some((ahead, status)) =
                self.store.ahead_in_key(&event.route, key, event.id, failed_blocks_key).await?
        {
            why.push(match status {
                Status::Failed => format!(
                    "event {ahead}, earlier in its ordering key, is FAILED and holds the key back until it is \
                     resent or purged"
                ),
                status => format!("event {ahead}, earlier in its ordering key, is {status} and goes first"),
            });
        }
        if why.is_empty() {
            why.push("due now: the next claim takes it".into());
        }
        Ok(why)
    }

    /// Makes FAILED event `id` PENDING again, attempts and error reset.
    pub async fn resend(&self, id: i64) -> Result<(), OpError> {
        self.check_id(id)?;
        let Some(event) = self.store.get(id).await? else {
            return Err(OpError::NotFound(format!("no event with id {id}")));
        };
        if self.store.resend(&[id], self.clock.now()).await? == 0 {
            return Err(OpError::Conflict(format!(
                "event {id} is {}, not FAILED; only FAILED events can be resent",
                event.status
            )));
        }
        self.wake();
        Ok(())
    }

    /// Defers PENDING event `id` until `at` (which may also be sooner), without counting an
    /// attempt; returns the event as it is afterwards.
    pub async fn reschedule(&self, id: i64, at: DateTime<Utc>) -> Result<EventView, OpError> {
        self.check_id(id)?;
        self.check_time("at", at)?;
        let at = crate::clock::truncate_ms(at);
        if !self.store.reschedule(id, at).await? {
            // As it is now: a claim may have taken it a moment ago.
            let Some(event) = self.store.get(id).await? else {
                return Err(OpError::NotFound(format!("no event with id {id}")));
            };
            let instead = match event.status {
                Status::Failed => "; resend it (it is then due at once) and reschedule it after",
                Status::Processing => "; it is being delivered now",
                _ => "",
            };
            return Err(OpError::Conflict(format!(
                "event {id} is {}, not PENDING; only PENDING events can be rescheduled{instead}",
                event.status
            )));
        }
        tracing::info!(event = id, %at, "event rescheduled by an operator");
        self.wake();
        self.show(id).await
    }

    /// Ends PENDING or PROCESSING event `id` by hand: `Cancel` deletes it, `Fail` makes it FAILED
    /// (reason `operator`, `note` as its last error). A delivery in flight loses its claim, so
    /// its outcome is not recorded. Returns the event as it is afterwards (`None`: deleted).
    pub async fn end_event(&self, id: i64, end: EndEvent<'_>) -> Result<Option<EventView>, OpError> {
        self.check_id(id)?;
        if let EndEvent::Fail { note } = end {
            self.check_reason(note)?;
        }
        let verb = match end {
            EndEvent::Cancel => "cancelled",
            EndEvent::Fail { .. } => "failed",
        };
        let refuse = |status: Status| {
            let instead = match status {
                Status::Failed => "; purge it with `failed purge` or resend it",
                _ => "",
            };
            OpError::Conflict(format!(
                "event {id} is {status}; only PENDING or PROCESSING events can be {verb} by hand{instead}"
            ))
        };
        let Some(event) = self.store.get(id).await? else {
            return Err(OpError::NotFound(format!("no event with id {id}")));
        };
        if !matches!(event.status, Status::Pending | Status::Processing) {
            return Err(refuse(event.status));
        }
        if !self.store.end_event(id, end, self.clock.now()).await? {
            // It finished (or was ended) between the read and the write.
            return match self.store.get(id).await? {
                Some(now) => Err(refuse(now.status)),
                None => Err(OpError::NotFound(format!("no event with id {id}"))),
            };
        }
        tracing::info!(event = id, was = %event.status, "event {verb} by an operator");
        match end {
            EndEvent::Cancel => Ok(None),
            EndEvent::Fail { .. } => self.show(id).await.map(Some),
        }
    }

    /// How many FAILED events match.
    pub async fn failed_count(&self, filter: FilterInput) -> Result<FailedCount, OpError> {
        let (failed, last_id) = self.store.tally_failed(&filter.validate(self.front)?).await?;
        Ok(FailedCount { failed, last_id })
    }

    /// The FAILED events matching `filter`, grouped by route, type and reason, the
    /// [`MAX_GROUPS`] largest groups at most.
    pub async fn failed_summary(&self, filter: FilterInput) -> Result<FailedSummary, OpError> {
        let mut groups = self.store.failed_groups(&filter.validate(self.front)?, MAX_GROUPS + 1).await?;
        let truncated = groups.len() > MAX_GROUPS as usize;
        groups.truncate(MAX_GROUPS as usize);
        let total = groups.iter().map(|g| g.count).sum();
        Ok(FailedSummary { groups, total, truncated })
    }

    /// A page of FAILED events in id order (`newest_first`: highest first) after id `after` in
    /// that order, `limit` ([`DEFAULT_PAGE`]) at most.
    pub async fn failed_list(&self, filter: FilterInput, page: Page) -> Result<FailedPage, OpError> {
        let limit = page.limit.unwrap_or(DEFAULT_PAGE);
        if !(1..=MAX_PAGE).contains(&limit) {
            return Err(OpError::Invalid(format!(
                "{} must be between 1 and {MAX_PAGE}, got {limit}",
                self.front.name("limit")
            )));
        }
        let mut filter = FailedFilter { newest_first: page.newest_first, ..filter.validate(self.front)? };
        match page.after {
            // Newest first, the next page holds the lower ids.
            Some(after) if page.newest_first => {
                let below = after.saturating_sub(1);
                filter.through_id = Some(filter.through_id.map_or(below, |through| through.min(below)));
            }
            after => filter.after_id = after,
        }
        Ok(FailedPage::new(self.store.list_failed(&filter, limit).await?, limit))
    }

    /// The validated filter of a bulk resend or purge: one that names nothing (an upper id bound
    /// alone still means every FAILED event up to it) must come with `all`.
    pub fn bulk_scope(&self, filter: FilterInput, all: bool) -> Result<FailedFilter, OpError> {
        let filter = filter.validate(self.front)?;
        let unbounded = FailedFilter { through_id: None, ..filter.clone() };
        if unbounded.is_everything() && !all {
            let name = |field| self.front.name(field);
            return Err(OpError::Invalid(format!(
                "no filter given: this would affect every FAILED event; narrow it with {}, {}, {}, {}, {} or {}, or \
                 add {}",
                name("route"),
                name("type"),
                name("reason"),
                name("error"),
                name("from"),
                name("before"),
                self.front.switch("all")
            )));
        }
        Ok(filter)
    }

    /// Resends or purges every FAILED event matching `filter` (every FAILED event only with
    /// `all`), a bounded step at a time, calling `progress(done, total)` after each step.
    pub async fn failed_bulk(
        &self,
        filter: FilterInput,
        all: bool,
        op: BulkOp,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<u64, OpError> {
        let filter = self.bulk_scope(filter, all)?;
        let total = self.store.count_failed(&filter).await?;
        let clock = self.clock.clone();
        let done = store::bulk(self.store.as_ref(), &filter, op, || clock.now(), |done| progress(done, total)).await?;
        tracing::info!(?filter, count = done, "FAILED events {}", op.past_tense());
        if op == BulkOp::Resend {
            self.wake();
        }
        Ok(done)
    }

    /// Every stored breaker, with its state now.
    pub async fn breakers(&self) -> Result<Vec<BreakerView>, OpError> {
        let now = self.clock.now();
        let cooldown = self.settings().breaker_cooldown();
        Ok(self.store.breakers().await?.into_iter().map(|b| BreakerView::new(b, now, cooldown)).collect())
    }

    /// Opens a configured route's breaker by hand (with `reason`), or closes it.
    pub async fn set_breaker(&self, route: &str, open: bool, reason: &str) -> Result<BreakerView, OpError> {
        if route.trim().is_empty() {
            return Err(OpError::Invalid("the route name must not be empty".into()));
        }
        if !self.settings().is_configured(route) {
            return Err(OpError::NotFound(format!("route {route:?} is not configured")));
        }
        self.check_reason(reason)?;
        let now = self.clock.now();
        let breaker = self.store.set_breaker(route, open, reason, now).await?;
        tracing::info!(route, open, "circuit breaker switched by an operator");
        Ok(BreakerView::new(breaker, now, self.settings().breaker_cooldown()))
    }

    /// Every configured route, with its plugin (as `registry` has it) and breaker.
    pub async fn routes(&self, registry: &Registry) -> Result<Vec<RouteView>, OpError> {
        let now = self.clock.now();
        let breakers = self.store.breakers().await?;
        let settings = self.settings();
        let cooldown = settings.breaker_cooldown();
        let breaker_of = |name: &str| {
            let breaker = breakers.iter().find(|b| b.route == name).cloned().unwrap_or(Breaker::closed(name, now));
            BreakerView::new(breaker, now, cooldown)
        };
        let flags = |ordering| match ordering {
            Ordering::Unordered => (false, false),
            Ordering::Ordered { failed_blocks_key } => (true, failed_blocks_key),
        };
        let mut views: Vec<RouteView> = settings
            .routes
            .values()
            .map(|route| {
                let plugin = registry.get(&route.plugin);
                let (ordered, failed_blocks_key) = flags(route.ordering);
                RouteView {
                    route: route.name.clone(),
                    plugin: route.plugin.clone(),
                    plugin_loaded: plugin.is_some(),
                    plugin_hash: plugin.map(|p| p.hash.clone()),
                    ordered,
                    failed_blocks_key,
                    dead_letter: route.dead_letter.clone(),
                    destination_of: route.destination_of.clone(),
                    event_types: route
                        .destination_of
                        .as_ref()
                        .and_then(|parent| settings.fan_outs.get(parent))
                        .and_then(|f| f.destinations.iter().find(|d| d.route == route.name))
                        .map(|d| d.event_types.patterns().to_vec())
                        .unwrap_or_default(),
                    destinations: Vec::new(),
                    breaker: breaker_of(&route.name),
                    retry: RetryView::from(&route.retry),
                }
            })
            .collect();
        views.extend(settings.fan_outs.values().map(|fan_out| {
            let (ordered, failed_blocks_key) = flags(fan_out.ordering);
            let loaded = |route: &str| settings.route(route).is_some_and(|r| registry.get(&r.plugin).is_some());
            // The endpoint template (`route/*`) delivers every endpoint's deliveries.
            let template = fan_out.endpoints.as_ref().map(|e| e.template.clone());
            RouteView {
                route: fan_out.route.clone(),
                plugin: String::new(),
                plugin_loaded: fan_out.destinations.iter().map(|d| &d.route).chain(&template).all(|r| loaded(r)),
                plugin_hash: None,
                ordered,
                failed_blocks_key,
                dead_letter: fan_out.dead_letter.clone(),
                destination_of: None,
                event_types: Vec::new(),
                destinations: fan_out.destinations.iter().map(|d| d.route.clone()).chain(template).collect(),
                breaker: breaker_of(&fan_out.route),
                retry: RetryView::from(&fan_out.retry),
            }
        }));
        views.sort_by(|a, b| a.route.cmp(&b.route));
        Ok(views)
    }

    /// The monitoring figures, latency over the last `window` ([`DEFAULT_WINDOW`]).
    pub async fn stats(&self, window: Option<Duration>) -> Result<StatsView, OpError> {
        let window = window.unwrap_or(DEFAULT_WINDOW);
        if window.is_zero() || window > MAX_WINDOW {
            return Err(OpError::Invalid(format!(
                "{} must be longer than 0 and at most 30d",
                self.front.name("window")
            )));
        }
        let now = self.clock.now();
        let since = crate::clock::earlier(now, window);
        Ok(StatsView::from(&self.store.stats(now, Some(since), true).await?))
    }

    /// Events per status.
    pub async fn status(&self) -> Result<StatusCounts, OpError> {
        Ok(self.store.counts().await?)
    }
}

/// The plugins `registry` has loaded, and the files it could not load.
pub fn plugins(registry: &Registry) -> PluginsView {
    let (plugins, errors) = registry.status();
    PluginsView { plugins, errors }
}

/// Reloads every plugin file of `registry` now.
pub async fn reload_plugins(registry: &Registry) -> anyhow::Result<ReloadView> {
    let files = registry
        .reload_all()
        .await?
        .into_iter()
        .map(|(file, result)| {
            let (result, plugin, hash, error) = match result {
                Ok(Reloaded::Loaded { name, hash }) => (ReloadResult::Loaded, Some(name), Some(hash), None),
                Ok(Reloaded::Unchanged { name }) => (ReloadResult::Unchanged, Some(name), None, None),
                Ok(Reloaded::Removed { name }) => (ReloadResult::Removed, Some(name), None, None),
                Ok(Reloaded::Ignored) => (ReloadResult::Ignored, None, None, None),
                Err(e) => (ReloadResult::Failed, None, None, Some(format!("{e:#}"))),
            };
            ReloadedFile { file, result, plugin, hash, error }
        })
        .collect();
    Ok(ReloadView { files })
}

/// Whether the database can store `at`: a year from 1 to 9999, as the schema checks.
fn storable(at: DateTime<Utc>) -> bool {
    use chrono::Datelike as _;
    (1..=9999).contains(&at.year())
}
