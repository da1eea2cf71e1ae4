//! The admin HTTP API: health checks, Prometheus metrics, inspection and operations, as JSON.
//!
//! Every endpoint but `/health/live` and `/health/ready` requires `Authorization: Bearer <token>`.
//! Errors are JSON too, `{"error": {"code": …, "message": …}}`, and the message names the bad input.
//! `openapi.json` next to this file describes every endpoint; a test checks that the two agree.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::config::{Config, parse_duration};
use crate::event::NewEvent;
use crate::metrics::Metrics;
use crate::plugins::{Registry, Reloaded};
use crate::report;
use crate::store::{self, BulkOp, FailedFilter, Store, StoreError};

/// The OpenAPI description served at `/v1/openapi.json`.
pub const OPENAPI: &str = include_str!("openapi.json");

/// Largest page `GET /v1/failed` returns.
const MAX_PAGE: u32 = 10_000;

/// What the handlers share.
#[derive(Clone)]
pub struct Admin {
    pub config: Arc<Config>,
    pub store: Arc<dyn Store>,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    pub clock: Arc<dyn Clock>,
    /// Wakes the relay after an event is enqueued here.
    pub wake: Arc<Notify>,
    token: Arc<str>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin").field("listen", &self.config.admin.listen).finish_non_exhaustive()
    }
}

impl Admin {
    /// The API's state; reads the bearer token (from `admin.token` or `admin.token_file`).
    pub fn new(
        config: Arc<Config>,
        store: Arc<dyn Store>,
        registry: Arc<Registry>,
        metrics: Arc<Metrics>,
        clock: Arc<dyn Clock>,
        wake: Arc<Notify>,
    ) -> anyhow::Result<Admin> {
        let token = config.admin.bearer_token().map_err(anyhow::Error::msg)?;
        Ok(Admin { config, store, registry, metrics, clock, wake, token: token.into() })
    }

    /// Every endpoint.
    pub fn router(self) -> Router {
        let protected = Router::new()
            .route("/metrics", get(metrics))
            .route("/v1/openapi.json", get(openapi))
            .route("/v1/stats", get(stats))
            .route("/v1/events", post(enqueue))
            .route("/v1/events/{id}", get(show))
            .route("/v1/events/{id}/resend", post(resend_one))
            .route("/v1/failed", get(failed_list))
            .route("/v1/failed/count", get(failed_count))
            .route("/v1/failed/resend", post(failed_resend))
            .route("/v1/failed/purge", post(failed_purge))
            .route("/v1/plugins", get(plugins))
            .route("/v1/plugins/reload", post(plugins_reload))
            .route("/v1/routes", get(routes))
            .route("/v1/breakers", get(breakers))
            .route("/v1/breakers/{route}/open", post(breaker_open))
            .route("/v1/breakers/{route}/close", post(breaker_close))
            .route_layer(axum::middleware::from_fn_with_state(self.clone(), authorize));
        Router::new()
            .route("/health/live", get(live))
            .route("/health/ready", get(ready))
            .merge(protected)
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(self)
    }

    /// Binds the configured address (an error names it) and serves until `shutdown`. Returns the
    /// address bound (the port is chosen by the system for port 0) and the serving task.
    pub async fn serve(self, shutdown: CancellationToken) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
        let address: SocketAddr =
            self.config.admin.address().ok_or_else(|| anyhow::anyhow!("admin.listen is not set"))?;
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .map_err(|e| anyhow::anyhow!("admin.listen: cannot listen on {address}: {e}"))?;
        let bound = listener.local_addr()?;
        tracing::info!(address = %bound, "admin API listening");
        let router = self.router();
        let task = tokio::spawn(async move {
            let serving = axum::serve(listener, router).with_graceful_shutdown(shutdown.cancelled_owned());
            if let Err(e) = serving.await {
                tracing::error!("admin API stopped: {e}");
            }
        });
        Ok((bound, task))
    }
}

/// An error answer: a status and a message naming what was wrong.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = match self.status {
            StatusCode::BAD_REQUEST => "bad_request",
            StatusCode::UNAUTHORIZED => "unauthorized",
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
            StatusCode::CONFLICT => "conflict",
            StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
            StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
            StatusCode::UNPROCESSABLE_ENTITY => "unprocessable_entity",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable",
            _ => "internal",
        };
        let mut response =
            (self.status, Json(json!({ "error": { "code": code, "message": self.message } }))).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::InvalidEvent(message) => ApiError::bad_request(message),
            other => {
                tracing::error!("admin API: {other}");
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, other.to_string())
            }
        }
    }
}

/// A JSON request body. An empty body reads as `{}`, so endpoints whose fields are all optional
/// need none. Every failure (not JSON, wrong types, missing or unknown fields, too large) is a JSON
/// error naming the problem.
struct Body<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let content_type = req.headers().get(header::CONTENT_TYPE).map(|v| v.to_str().unwrap_or("").to_string());
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|r| ApiError::new(r.status(), format!("request body: {}", r.body_text())))?;
        let text: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { &bytes };
        if text != b"{}" && content_type.as_deref().is_some_and(|t| !t.starts_with("application/json")) {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "request body must be JSON (Content-Type: application/json), got {:?}",
                    content_type.unwrap_or_default()
                ),
            ));
        }
        let mut json = serde_json::Deserializer::from_slice(text);
        serde_path_to_error::deserialize(&mut json).map(Body).map_err(|e| {
            let path = e.path().to_string();
            match path.as_str() {
                "." => ApiError::bad_request(format!("request body is not valid: {}", e.inner())),
                _ => ApiError::bad_request(format!("request body is not valid: {path}: {}", e.inner())),
            }
        })
    }
}

/// `Query<T>` with JSON errors.
struct Params<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequestParts<S> for Params<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(value)| Params(value))
            .map_err(|r: QueryRejection| ApiError::bad_request(format!("query string: {}", r.body_text())))
    }
}

/// The `{id}` of an event path.
struct EventId(i64);

impl<S: Send + Sync> FromRequestParts<S> for EventId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|r: PathRejection| ApiError::bad_request(r.body_text()))?;
        raw.parse::<i64>()
            .ok()
            .filter(|id| *id > 0)
            .map(EventId)
            .ok_or_else(|| ApiError::bad_request(format!("event id must be a positive integer, got {raw:?}")))
    }
}

/// The `{route}` of a breaker path.
struct RouteName(String);

impl<S: Send + Sync> FromRequestParts<S> for RouteName {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(route)| RouteName(route))
            .map_err(|r: PathRejection| ApiError::bad_request(format!("route in the path: {}", r.body_text())))
    }
}

/// Checks the bearer token, in constant time.
async fn authorize(State(admin): State<Admin>, request: Request, next: Next) -> Response {
    let given = request.headers().get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or(""));
    let verdict = match given {
        None => Err("missing bearer token: send the header \"Authorization: Bearer <admin token>\""),
        Some(value) => match value.strip_prefix("Bearer ") {
            Some(token) if constant_time_eq(token.trim().as_bytes(), admin.token.as_bytes()) => Ok(()),
            Some(_) => Err("invalid bearer token"),
            None => Err("the Authorization header must be \"Bearer <admin token>\""),
        },
    };
    match verdict {
        Ok(()) => next.run(request).await,
        Err(message) => ApiError::new(StatusCode::UNAUTHORIZED, message).into_response(),
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(format!("no endpoint {} {} (see /v1/openapi.json)", request.method(), request.uri().path()))
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {} (see /v1/openapi.json)", request.method(), request.uri().path()),
    )
}

async fn live() -> Json<Value> {
    Json(json!({ "status": "ok" }))
}

/// Ready when the database answers and every configured route's plugin is loaded.
async fn ready(State(admin): State<Admin>) -> (StatusCode, Json<Value>) {
    let database = match admin.store.ping().await {
        Ok(()) => Ok(()),
        Err(e) => Err(e.to_string()),
    };
    let loaded = admin.registry.names();
    let missing: BTreeMap<&String, &String> = admin
        .config
        .route
        .iter()
        .filter(|(_, r)| !loaded.contains(&r.plugin))
        .map(|(name, r)| (name, &r.plugin))
        .collect();
    let ready = database.is_ok() && missing.is_empty();
    let body = json!({
        "status": if ready { "ready" } else { "not_ready" },
        "database": match &database { Ok(()) => "ok".to_string(), Err(e) => e.clone() },
        "plugins_loaded": loaded,
        "routes_without_plugin": missing,
    });
    (if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, Json(body))
}

async fn metrics(State(admin): State<Admin>) -> Result<Response, ApiError> {
    let stats = admin.store.stats(admin.clock.now(), None).await?;
    let breakers = admin.store.breakers().await?;
    let routes: Vec<String> = admin.config.route.keys().cloned().collect();
    let text = admin.metrics.render(&stats, &breakers, &routes, admin.config.breaker.cooldown.0);
    Ok(([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], text).into_response())
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StatsParams {
    /// Latency is measured over events SENT this long ago or less.
    window: Option<String>,
}

/// Longest latency window accepted.
const MAX_WINDOW: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

async fn stats(State(admin): State<Admin>, Params(params): Params<StatsParams>) -> Result<Json<Value>, ApiError> {
    let window = match params.window.as_deref() {
        None => std::time::Duration::from_secs(3600),
        Some(text) => parse_duration(text).map_err(|e| ApiError::bad_request(format!("window: {e}")))?,
    };
    if window.is_zero() || window > MAX_WINDOW {
        return Err(ApiError::bad_request("window must be longer than 0 and at most 30d"));
    }
    let now = admin.clock.now();
    let since = now - chrono::Duration::from_std(window).expect("bounded above");
    let stats = admin.store.stats(now, Some(since)).await?;
    Ok(Json(report::stats(&stats)))
}

/// `POST /v1/events`: an event enqueued outside any application transaction.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EnqueueRequest {
    route: String,
    #[serde(rename = "type")]
    event_type: String,
    /// A JSON payload, stored as its JSON text.
    payload: Option<Value>,
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
    fn into_event(self, now: DateTime<Utc>) -> Result<NewEvent, ApiError> {
        let (payload, default_type) = match (self.payload, self.payload_base64) {
            (Some(_), Some(_)) => return Err(ApiError::bad_request("give either payload or payload_base64, not both")),
            (None, None) => return Err(ApiError::bad_request("missing payload (or payload_base64)")),
            (Some(value), None) => (value.to_string().into_bytes(), "application/json"),
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
            event.event_time = Some(rfc3339("event_time", text)?);
        }
        match (&self.deliver_at, &self.delay) {
            (Some(_), Some(_)) => return Err(ApiError::bad_request("give either deliver_at or delay, not both")),
            (Some(text), None) => event.not_before = Some(rfc3339("deliver_at", text)?),
            (None, Some(text)) => {
                let delay = parse_duration(text).map_err(|e| ApiError::bad_request(format!("delay: {e}")))?;
                let delay =
                    chrono::Duration::from_std(delay).map_err(|_| ApiError::bad_request("delay is too long"))?;
                event.not_before = Some(now + delay);
            }
            (None, None) => {}
        }
        event.validate().map_err(ApiError::bad_request)?;
        Ok(event)
    }
}

async fn enqueue(
    State(admin): State<Admin>,
    Body(request): Body<EnqueueRequest>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let now = admin.clock.now();
    let event = request.into_event(now)?;
    if !admin.config.route.contains_key(&event.route) {
        let known: Vec<&String> = admin.config.route.keys().collect();
        return Err(ApiError::bad_request(format!(
            "route {:?} is not configured (configured: {})",
            event.route,
            if known.is_empty() {
                "none".to_string()
            } else {
                known.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
            }
        )));
    }
    let id = admin.store.insert(&event, now).await?;
    admin.wake.notify_one();
    Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
}

async fn show(State(admin): State<Admin>, EventId(id): EventId) -> Result<Json<Value>, ApiError> {
    let event = admin.store.get(id).await?.ok_or_else(|| ApiError::not_found(format!("no event with id {id}")))?;
    let attempts = admin.store.attempts(id).await?;
    Ok(Json(report::event(&event, Some(&attempts))))
}

async fn resend_one(State(admin): State<Admin>, EventId(id): EventId) -> Result<Json<Value>, ApiError> {
    let Some(event) = admin.store.get(id).await? else {
        return Err(ApiError::not_found(format!("no event with id {id}")));
    };
    if admin.store.resend(&[id], admin.clock.now()).await? == 0 {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("event {id} is {}, not FAILED; only FAILED events can be resent", event.status),
        ));
    }
    admin.wake.notify_one();
    Ok(Json(json!({ "resent": 1 })))
}

/// Narrows the FAILED events an operation applies to.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilterParams {
    route: Option<String>,
    #[serde(rename = "type")]
    event_type: Option<String>,
    from: Option<String>,
    before: Option<String>,
    after: Option<i64>,
    limit: Option<u32>,
    /// Bulk operations only: required when no other filter is given.
    #[serde(default)]
    all: bool,
}

impl FilterParams {
    fn filter(&self) -> Result<FailedFilter, ApiError> {
        let from = self.from.as_deref().map(|t| rfc3339("from", t)).transpose()?;
        let before = self.before.as_deref().map(|t| rfc3339("before", t)).transpose()?;
        if let (Some(from), Some(before)) = (from, before)
            && from >= before
        {
            return Err(ApiError::bad_request(format!("from ({from}) must be earlier than before ({before})")));
        }
        let empty = |field: &str, value: &Option<String>| match value {
            Some(v) if v.trim().is_empty() => Err(ApiError::bad_request(format!("{field} must not be empty"))),
            _ => Ok(()),
        };
        empty("route", &self.route)?;
        empty("type", &self.event_type)?;
        Ok(FailedFilter {
            route: self.route.clone(),
            event_type: self.event_type.clone(),
            from,
            before,
            after_id: self.after,
        })
    }

    fn only(&self, allowed: &[&str]) -> Result<(), ApiError> {
        let given = [("after", self.after.is_some()), ("limit", self.limit.is_some()), ("all", self.all)];
        match given.iter().find(|(name, set)| *set && !allowed.contains(name)) {
            Some((name, _)) => Err(ApiError::bad_request(format!("{name} is not accepted here"))),
            None => Ok(()),
        }
    }
}

async fn failed_list(
    State(admin): State<Admin>,
    Params(params): Params<FilterParams>,
) -> Result<Json<Value>, ApiError> {
    params.only(&["after", "limit"])?;
    let limit = params.limit.unwrap_or(50);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::bad_request(format!("limit must be between 1 and {MAX_PAGE}, got {limit}")));
    }
    let events = admin.store.list_failed(&params.filter()?, limit).await?;
    Ok(Json(report::failed_page(&events, limit)))
}

async fn failed_count(
    State(admin): State<Admin>,
    Params(params): Params<FilterParams>,
) -> Result<Json<Value>, ApiError> {
    params.only(&[])?;
    let n = admin.store.count_failed(&params.filter()?).await?;
    Ok(Json(json!({ "failed": n })))
}

async fn failed_resend(State(admin): State<Admin>, Body(params): Body<FilterParams>) -> Result<Json<Value>, ApiError> {
    let result = failed_bulk(&admin, params, BulkOp::Resend).await;
    admin.wake.notify_one();
    result
}

async fn failed_purge(State(admin): State<Admin>, Body(params): Body<FilterParams>) -> Result<Json<Value>, ApiError> {
    failed_bulk(&admin, params, BulkOp::Purge).await
}

async fn failed_bulk(admin: &Admin, params: FilterParams, op: BulkOp) -> Result<Json<Value>, ApiError> {
    params.only(&["all"])?;
    let filter = params.filter()?;
    if filter.is_everything() && !params.all {
        return Err(ApiError::bad_request(
            "no filter given: this would affect every FAILED event; narrow it with route, type, from or before, or send \"all\": true",
        ));
    }
    let clock = admin.clock.clone();
    let done = store::bulk(admin.store.as_ref(), &filter, op, || clock.now(), |_| {}).await?;
    tracing::info!(?filter, count = done, "FAILED events {} through the admin API", op.past_tense());
    Ok(Json(json!({ op.past_tense(): done })))
}

async fn plugins(State(admin): State<Admin>) -> Json<Value> {
    let (plugins, errors) = admin.registry.status();
    Json(report::plugins(&plugins, &errors))
}

async fn plugins_reload(State(admin): State<Admin>) -> Result<Json<Value>, ApiError> {
    let results = admin
        .registry
        .reload_all()
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")))?;
    let files: Vec<Value> = results
        .iter()
        .map(|(path, result)| {
            let (outcome, plugin, detail) = match result {
                Ok(Reloaded::Loaded { name, hash }) => ("loaded", Some(name.as_str()), Some(hash.clone())),
                Ok(Reloaded::Unchanged { name }) => ("unchanged", Some(name.as_str()), None),
                Ok(Reloaded::Removed { name }) => ("removed", Some(name.as_str()), None),
                Ok(Reloaded::Ignored) => ("ignored", None, None),
                Err(e) => ("failed", None, Some(format!("{e:#}"))),
            };
            let mut row = json!({ "file": path.display().to_string(), "result": outcome, "plugin": plugin });
            match (outcome, detail) {
                ("loaded", Some(hash)) => row["hash"] = hash.into(),
                ("failed", Some(error)) => row["error"] = error.into(),
                _ => {}
            }
            row
        })
        .collect();
    Ok(Json(json!({ "files": files })))
}

async fn routes(State(admin): State<Admin>) -> Result<Json<Value>, ApiError> {
    let now = admin.clock.now();
    let breakers = admin.store.breakers().await?;
    let (ordered, blocking) = admin.config.ordered_routes();
    let rows: Vec<Value> = admin
        .config
        .route
        .iter()
        .map(|(name, route)| {
            let plugin = admin.registry.get(&route.plugin);
            let breaker = breakers.iter().find(|b| &b.route == name);
            json!({
                "route": name,
                "plugin": route.plugin,
                "plugin_loaded": plugin.is_some(),
                "plugin_hash": plugin.map(|p| p.hash.clone()),
                "ordered": ordered.contains(name),
                "failed_blocks_key": blocking.contains(name),
                "breaker": match breaker {
                    Some(b) => report::breaker(b, now, admin.config.breaker.cooldown.0),
                    None => json!({ "state": "closed", "consecutive_failures": 0 }),
                },
            })
        })
        .collect();
    Ok(Json(Value::Array(rows)))
}

async fn breakers(State(admin): State<Admin>) -> Result<Json<Value>, ApiError> {
    let now = admin.clock.now();
    let rows = admin.store.breakers().await?;
    Ok(Json(rows.iter().map(|b| report::breaker(b, now, admin.config.breaker.cooldown.0)).collect()))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct OpenRequest {
    reason: Option<String>,
}

async fn breaker_open(
    State(admin): State<Admin>,
    RouteName(route): RouteName,
    Body(body): Body<OpenRequest>,
) -> Result<Json<Value>, ApiError> {
    let reason = body.reason.unwrap_or_else(|| "opened by an operator".to_string());
    set_breaker(&admin, &route, true, &reason).await
}

async fn breaker_close(State(admin): State<Admin>, RouteName(route): RouteName) -> Result<Json<Value>, ApiError> {
    set_breaker(&admin, &route, false, "").await
}

async fn set_breaker(admin: &Admin, route: &str, open: bool, reason: &str) -> Result<Json<Value>, ApiError> {
    if !admin.config.route.contains_key(route) {
        return Err(ApiError::not_found(format!("route {route:?} is not configured")));
    }
    let now = admin.clock.now();
    let breaker = admin.store.set_breaker(route, open, reason, now).await?;
    tracing::info!(route, open, "circuit breaker switched through the admin API");
    Ok(Json(report::breaker(&breaker, now, admin.config.breaker.cooldown.0)))
}

/// Just enough of an HTTP/1.1 client for the CLI to call the admin API of a ferry on this host.
pub mod client {
    use std::net::SocketAddr;
    use std::time::Duration;

    use anyhow::{Context as _, bail};
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// How long the CLI waits for the admin API (a reload compiles plugins, so not too short).
    const TIMEOUT: Duration = Duration::from_secs(120);

    /// Sends `METHOD path` with an empty body, and the bearer token if given; returns the status
    /// code and the body.
    pub async fn request(
        method: &str,
        address: SocketAddr,
        path: &str,
        token: Option<&str>,
    ) -> anyhow::Result<(u16, String)> {
        let exchange = async {
            let mut stream = tokio::net::TcpStream::connect(address)
                .await
                .with_context(|| format!("cannot reach the admin API at {address} (is ferry serving?)"))?;
            let authorization = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
            let request = format!(
                "{method} {path} HTTP/1.1\r\nHost: {address}\r\n{authorization}\
                 Content-Length: 0\r\nConnection: close\r\n\r\n"
            );
            stream.write_all(request.as_bytes()).await?;
            let mut response = Vec::new();
            stream.read_to_end(&mut response).await?;
            anyhow::Ok(response)
        };
        let response = tokio::time::timeout(TIMEOUT, exchange)
            .await
            .with_context(|| format!("the admin API at {address} did not answer within {TIMEOUT:?}"))??;
        let text = String::from_utf8_lossy(&response);
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            bail!("the admin API at {address} sent an incomplete answer");
        };
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .with_context(|| format!("the admin API at {address} sent no HTTP status line"))?;
        let chunked = head.lines().any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding: chunked"));
        Ok((status, if chunked { dechunk(body) } else { body.to_string() }))
    }

    /// Joins the chunks of a chunked body.
    fn dechunk(mut body: &str) -> String {
        let mut out = String::new();
        while let Some((size, rest)) = body.split_once("\r\n") {
            let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
            if size == 0 || rest.len() < size {
                break;
            }
            out.push_str(&rest[..size]);
            body = rest[size..].strip_prefix("\r\n").unwrap_or(&rest[size..]);
        }
        out
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn chunked_bodies_are_joined() {
            assert_eq!(super::dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"), "hello world");
            assert_eq!(super::dechunk("0\r\n\r\n"), "");
        }
    }
}
