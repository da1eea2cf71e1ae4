//! The admin API's handlers: each parses its request, calls one operator operation
//! (`crate::ops`) and answers with the operation's typed view.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Value, json};

use super::extract::{ApiError, Body, EventId, Params, RouteName};
use super::{Admin, OPENAPI};
use crate::activity::ActivityView;
use crate::breaker::Breaker;
use crate::config::parse_duration;
use crate::event::NewEvent;
use crate::ops::{self, FilterInput};
use crate::report::{
    BreakerView, Cancelled, Created, EventView, FailedCount, FailedPage, FailedSummary, JsonPayload, PluginsView,
    Purged, ReloadView, Resent, RouteView, StatsView,
};
use crate::store::{BulkOp, EndEvent};

pub(super) async fn live() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready when the database answers, every configured route's plugin is loaded, and no relay
/// worker is stuck in a cycle.
pub(super) async fn ready(State(admin): State<Admin>) -> (StatusCode, Json<Value>) {
    const LIMIT: std::time::Duration = std::time::Duration::from_secs(10);
    let slow = || Err(format!("the database did not answer within {LIMIT:?}"));
    let store = admin.ops.store.clone();
    let ping = async move {
        match tokio::time::timeout(LIMIT, store.ping()).await {
            Ok(answer) => answer.map_err(|e| e.to_string()),
            Err(_) => slow(),
        }
    };
    let database = admin.database.get(LIMIT, ping).await.unwrap_or_else(slow);
    let loaded = admin.registry.names();
    let settings = admin.ops.settings();
    let missing: BTreeMap<&String, &String> =
        settings.routes.values().filter(|r| !loaded.contains(&r.plugin)).map(|r| (&r.name, &r.plugin)).collect();
    let relay = admin.relay.wedged();
    let ready = database.is_ok() && missing.is_empty() && relay.is_none();
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "database": match &database { Ok(()) => "ok".to_string(), Err(e) => e.clone() },
        "relay": relay.as_deref().unwrap_or("ok"),
        "plugins_loaded": loaded,
        "routes_without_plugin": missing,
    });
    (if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, Json(body))
}

pub(super) async fn metrics(State(admin): State<Admin>) -> Result<Response, ApiError> {
    // A scrape waits for the one in progress, but not for long: a database that stopped
    // answering must not pile scrapers up on the admin port's connections.
    let limit = std::time::Duration::from_secs(10);
    let busy = || ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the metrics could not be read within 10 s");
    let scraping = admin.clone();
    let read = async move {
        match tokio::time::timeout(limit, scrape(&scraping)).await {
            Ok(Ok(text)) => Ok(text),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("the metrics could not be read within 10 s".to_string()),
        }
    };
    let answer = admin.scrape.get(limit, read).await.ok_or_else(busy)?;
    let text = answer.map_err(|message| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message))?;
    Ok(([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response())
}

/// Reads the outbox figures and renders every metric.
async fn scrape(admin: &Admin) -> Result<String, ops::OpError> {
    let ops = &admin.ops;
    let store_error = ops::OpError::from;
    // Only the statuses with partial indexes are counted: a scrape must not read every SENT row
    // kept for retention (deliveries are counted by ferry_events_delivered instead).
    let stats = ops.store.stats(ops.clock.now(), None, false).await.map_err(store_error)?;
    let breakers: Vec<Breaker> = ops.store.breakers().await.map_err(store_error)?;
    let settings = ops.settings();
    let mut routes = settings.route_names();
    // Deliveries to webhook endpoints go by `route/endpoint`, counted under that name while the
    // endpoint exists, as the relay counts them.
    if stats.routes.keys().any(|r| settings.endpoints_of(r).is_some()) {
        let stored = ops.store.endpoints(None).await.map_err(store_error)?;
        let live: std::collections::HashSet<String> =
            stored.iter().map(|e| format!("{}{}{}", e.route, crate::config::DESTINATION_SEPARATOR, e.id)).collect();
        routes.extend(stats.routes.keys().filter(|r| live.contains(*r)).cloned());
    }
    Ok(admin.metrics.render(&stats, &breakers, &routes, settings.breaker_cooldown()))
}

pub(super) async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StatsParams {
    /// Latency is measured over events SENT this long ago or less.
    window: Option<String>,
}

pub(super) async fn stats(
    State(admin): State<Admin>,
    Params(params): Params<StatsParams>,
) -> Result<Json<StatsView>, ApiError> {
    let window = params
        .window
        .as_deref()
        .map(|text| parse_duration(text).map_err(|e| ApiError::bad_request(format!("window: {e}"))))
        .transpose()?;
    Ok(Json(admin.ops.stats(window).await?))
}

/// `POST /v1/events`: an event enqueued outside any application transaction.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EnqueueRequest {
    route: String,
    #[serde(rename = "type")]
    event_type: String,
    /// A JSON payload, stored as its JSON text exactly as sent: numbers past 64 bits, key order
    /// and repeated keys are the application's business.
    payload: Option<Box<serde_json::value::RawValue>>,
    /// A binary payload, base64-encoded.
    payload_base64: Option<String>,
    content_type: Option<String>,
    key: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    /// RFC 3339; when the business event happened.
    event_time: Option<String>,
    /// RFC 3339; not delivered before then.
    deliver_at: Option<String>,
    /// e.g. "30s"; not delivered before this long from now.
    delay: Option<String>,
    /// Attempt limit for this event; 0 = unlimited.
    max_attempts: Option<u32>,
}

fn rfc3339(field: &str, text: &str) -> Result<DateTime<Utc>, ApiError> {
    DateTime::parse_from_rfc3339(text).map(|t| t.with_timezone(&Utc)).map_err(|e| {
        ApiError::bad_request(format!(
            "{field} must be an RFC 3339 time such as 2026-11-26T08:00:00Z, got {text:?} ({e})"
        ))
    })
}

impl EnqueueRequest {
    fn into_event(self, ops: &ops::Ops, now: DateTime<Utc>) -> Result<NewEvent, ApiError> {
        let (payload, default_type) = match (self.payload, self.payload_base64) {
            (Some(_), Some(_)) => return Err(ApiError::bad_request("give either payload or payload_base64, not both")),
            (None, None) => return Err(ApiError::bad_request("missing payload (or payload_base64)")),
            (Some(value), None) => (value.get().as_bytes().to_vec(), "application/json"),
            (None, Some(encoded)) => (
                base64::engine::general_purpose::STANDARD
                    .decode(encoded.trim())
                    .map_err(|e| ApiError::bad_request(format!("payload_base64 is not valid base64: {e}")))?,
                "application/octet-stream",
            ),
        };
        let mut event = NewEvent::new(self.route, self.event_type, payload)
            .with_content_type(self.content_type.unwrap_or_else(|| default_type.to_string()));
        event.ordering_key = self.key;
        event.headers = self.headers.into_iter().collect();
        event.max_attempts = self.max_attempts;
        if let Some(text) = &self.event_time {
            let at = rfc3339("event_time", text)?;
            ops.check_time("event_time", at)?;
            event.event_time = Some(at);
        }
        match (&self.deliver_at, &self.delay) {
            (Some(_), Some(_)) => return Err(ApiError::bad_request("give either deliver_at or delay, not both")),
            (Some(text), None) => {
                let at = rfc3339("deliver_at", text)?;
                ops.check_time("deliver_at", at)?;
                event.not_before = Some(at);
            }
            (None, Some(text)) => {
                let delay = parse_duration(text).map_err(|e| ApiError::bad_request(format!("delay: {e}")))?;
                event.not_before = Some(ops.deliver_after(now, delay)?);
            }
            (None, None) => {}
        }
        Ok(event)
    }
}

pub(super) async fn enqueue(
    State(admin): State<Admin>,
    Body(request): Body<EnqueueRequest>,
) -> Result<(StatusCode, Json<Created>), ApiError> {
    let now = admin.ops.now();
    let event = request.into_event(&admin.ops, now)?;
    Ok((StatusCode::CREATED, Json(admin.ops.emit(event, now).await?)))
}

/// How `GET /v1/events/{id}` shows the payload.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ShowParams {
    /// `json` (the default): a JSON payload as a JSON value; `text`: as the stored text.
    payload: Option<String>,
}

pub(super) async fn show(
    State(admin): State<Admin>,
    EventId(id): EventId,
    Params(params): Params<ShowParams>,
) -> Result<Json<EventView>, ApiError> {
    let json = match params.payload.as_deref() {
        None | Some("json") => JsonPayload::Value,
        Some("text") => JsonPayload::Text,
        Some(other) => return Err(ApiError::bad_request(format!("payload must be json or text, got {other:?}"))),
    };
    Ok(Json(admin.ops.show_as(id, json).await?))
}

pub(super) async fn resend_one(State(admin): State<Admin>, EventId(id): EventId) -> Result<Json<Resent>, ApiError> {
    admin.ops.resend(id).await?;
    Ok(Json(Resent { resent: 1 }))
}

pub(super) async fn cancel(State(admin): State<Admin>, EventId(id): EventId) -> Result<Json<Cancelled>, ApiError> {
    admin.ops.end_event(id, EndEvent::Cancel).await?;
    Ok(Json(Cancelled { cancelled: 1 }))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FailRequest {
    /// Why, kept as the event's last error.
    reason: Option<String>,
}

pub(super) async fn fail(
    State(admin): State<Admin>,
    EventId(id): EventId,
    Body(body): Body<FailRequest>,
) -> Result<Json<Option<EventView>>, ApiError> {
    let note = body.reason.unwrap_or_else(|| ops::FAILED_BY_HAND.to_string());
    Ok(Json(admin.ops.end_event(id, EndEvent::Fail { note: &note }).await?))
}

/// `POST /v1/events/{id}/reschedule`: when the event becomes due.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RescheduleRequest {
    /// RFC 3339.
    at: Option<String>,
    /// e.g. "2h": this long from now.
    delay: Option<String>,
}

pub(super) async fn reschedule(
    State(admin): State<Admin>,
    EventId(id): EventId,
    Body(body): Body<RescheduleRequest>,
) -> Result<Json<EventView>, ApiError> {
    let at = match (&body.at, &body.delay) {
        (Some(text), None) => rfc3339("at", text)?,
        (None, Some(text)) => {
            let delay = parse_duration(text).map_err(|e| ApiError::bad_request(format!("delay: {e}")))?;
            admin.ops.deliver_after(admin.ops.now(), delay)?
        }
        _ => return Err(ApiError::bad_request("give either at or delay")),
    };
    Ok(Json(admin.ops.reschedule(id, at).await?))
}

/// Narrows the FAILED events an operation applies to.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FilterParams {
    route: Option<String>,
    #[serde(rename = "type")]
    event_type: Option<String>,
    reason: Option<String>,
    through_id: Option<i64>,
    error: Option<String>,
    from: Option<String>,
    before: Option<String>,
    after: Option<i64>,
    limit: Option<u32>,
    /// Listing only: `oldest` (the default) or `newest` first.
    order: Option<String>,
    /// Bulk operations only: required when no other filter is given.
    #[serde(default)]
    all: bool,
}

impl FilterParams {
    /// The filter, with the times parsed; the rest is checked by the operation.
    fn input(&self) -> Result<FilterInput, ApiError> {
        Ok(FilterInput {
            route: self.route.clone(),
            event_type: self.event_type.clone(),
            reason: self.reason.clone(),
            through_id: self.through_id,
            error: self.error.clone(),
            from: self.from.as_deref().map(|t| rfc3339("from", t)).transpose()?,
            before: self.before.as_deref().map(|t| rfc3339("before", t)).transpose()?,
        })
    }

    fn only(&self, allowed: &[&str]) -> Result<(), ApiError> {
        let given = [
            ("after", self.after.is_some()),
            ("limit", self.limit.is_some()),
            ("order", self.order.is_some()),
            ("all", self.all),
        ];
        match given.iter().find(|(name, set)| *set && !allowed.contains(name)) {
            Some((name, _)) => Err(ApiError::bad_request(format!("{name} is not accepted here"))),
            None => Ok(()),
        }
    }
}

pub(super) async fn failed_list(
    State(admin): State<Admin>,
    Params(params): Params<FilterParams>,
) -> Result<Json<FailedPage>, ApiError> {
    params.only(&["after", "limit", "order"])?;
    let newest_first = match params.order.as_deref() {
        None | Some("oldest") => false,
        Some("newest") => true,
        Some(other) => return Err(ApiError::bad_request(format!("order must be oldest or newest, got {other:?}"))),
    };
    let page = ops::Page { after: params.after, limit: params.limit, newest_first };
    Ok(Json(admin.ops.failed_list(params.input()?, page).await?))
}

pub(super) async fn failed_count(
    State(admin): State<Admin>,
    Params(params): Params<FilterParams>,
) -> Result<Json<FailedCount>, ApiError> {
    params.only(&[])?;
    Ok(Json(admin.ops.failed_count(params.input()?).await?))
}

pub(super) async fn failed_summary(
    State(admin): State<Admin>,
    Params(params): Params<FilterParams>,
) -> Result<Json<FailedSummary>, ApiError> {
    params.only(&[])?;
    Ok(Json(admin.ops.failed_summary(params.input()?).await?))
}

/// `GET /v1/activity`: this instance's deliveries minute by minute over the last hour.
pub(super) async fn activity(State(admin): State<Admin>) -> Json<ActivityView> {
    Json(admin.metrics.activity.last_hour(admin.ops.now()))
}

pub(super) async fn failed_resend(
    State(admin): State<Admin>,
    Body(params): Body<FilterParams>,
) -> Result<Json<Resent>, ApiError> {
    params.only(&["all"])?;
    let resent = admin.ops.failed_bulk(params.input()?, params.all, BulkOp::Resend, |_, _| {}).await?;
    Ok(Json(Resent { resent }))
}

pub(super) async fn failed_purge(
    State(admin): State<Admin>,
    Body(params): Body<FilterParams>,
) -> Result<Json<Purged>, ApiError> {
    params.only(&["all"])?;
    let purged = admin.ops.failed_bulk(params.input()?, params.all, BulkOp::Purge, |_, _| {}).await?;
    Ok(Json(Purged { purged }))
}

pub(super) async fn plugins(State(admin): State<Admin>) -> Json<PluginsView> {
    Json(ops::plugins(&admin.registry))
}

pub(super) async fn plugins_reload(State(admin): State<Admin>) -> Result<Json<ReloadView>, ApiError> {
    ops::reload_plugins(&admin.registry)
        .await
        .map(Json)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")))
}

pub(super) async fn routes(State(admin): State<Admin>) -> Result<Json<Vec<RouteView>>, ApiError> {
    Ok(Json(admin.ops.routes(&admin.registry).await?))
}

pub(super) async fn breakers(State(admin): State<Admin>) -> Result<Json<Vec<BreakerView>>, ApiError> {
    Ok(Json(admin.ops.breakers().await?))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct OpenRequest {
    reason: Option<String>,
}

pub(super) async fn breaker_open(
    State(admin): State<Admin>,
    RouteName(route): RouteName,
    Body(body): Body<OpenRequest>,
) -> Result<Json<BreakerView>, ApiError> {
    let reason = body.reason.unwrap_or_else(|| ops::OPENED_BY_HAND.to_string());
    Ok(Json(admin.ops.set_breaker(&route, true, &reason).await?))
}

pub(super) async fn breaker_close(
    State(admin): State<Admin>,
    RouteName(route): RouteName,
) -> Result<Json<BreakerView>, ApiError> {
    Ok(Json(admin.ops.set_breaker(&route, false, "").await?))
}
