//! Webhook endpoints managed at run time: an operator (or an application, through the admin API)
//! adds, changes, disables and deletes the endpoints of a route that takes them
//! (`[route.NAME.endpoints]`), and every ferry instance sharing the database picks the change up
//! within [`REFRESH`]. Each endpoint is a destination of its route: its deliveries carry route
//! `route/ep_…`, so they have their own status, attempts, history, breaker and failed-event
//! operations, and are made by the route's endpoint template (`route/*`) with the endpoint's own
//! URL, secret and headers.
//!
//! A stored endpoint is read as untrusted input: a body that does not decode, or a URL the
//! route's `origins` no longer allow, costs that endpoint its deliveries, never anyone else's.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use rand::Rng as _;
use serde::{Deserialize, Serialize};

use crate::config::{
    DESTINATION_SEPARATOR, ENDPOINT_ID_PREFIX, EndpointsSettings, EventTypes, Ordering, Settings, TEMPLATE_URL,
    normalize_origin, origin_matches,
};
use crate::ops::{OpError, Ops};
use crate::store::StoredEndpoint;

/// How often a relay reads the endpoints again: a change made anywhere reaches every instance
/// within this long.
pub const REFRESH: Duration = Duration::from_secs(1);

/// How long the previous secret keeps signing after a rotation when the operator says nothing.
pub const KEEP_PREVIOUS: Duration = Duration::from_secs(24 * 3600);

/// Longest the previous secret may keep signing after a rotation.
pub const MAX_KEEP_PREVIOUS: Duration = Duration::from_secs(30 * 24 * 3600);

/// Most endpoints one route may have.
pub const MAX_PER_ROUTE: usize = 1000;

/// Longest URL accepted.
const MAX_URL: usize = 2048;
/// Most event-type patterns per endpoint, and the longest one.
const MAX_EVENT_TYPES: usize = 100;
const MAX_EVENT_TYPE: usize = 200;
/// Most static headers per endpoint, and the longest value.
const MAX_HEADERS: usize = 50;
const MAX_HEADER_NAME: usize = 256;
const MAX_HEADER_VALUE: usize = 4096;
const MAX_DESCRIPTION: usize = 500;
/// How the signing secrets ferry makes and accepts begin (the Standard Webhooks format).
const SECRET_PREFIX: &str = "whsec_";
/// Random bytes in a secret ferry makes, and the fewest and most in one it is given.
const SECRET_BYTES: usize = 32;
const MIN_SECRET_BYTES: usize = 16;
const MAX_SECRET_BYTES: usize = 64;
/// Headers each request sets itself (besides those wasi:http forbids a guest to set, which
/// would change how it travels).
const RESERVED_HEADERS: [&str; 2] = ["content-length", "content-type"];

/// One stored endpoint, decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    pub id: String,
    pub route: String,
    pub body: EndpointBody,
}

/// What is stored of an endpoint besides its id and route (as JSON). Fields it does not know are
/// ignored, so an instance still running an older ferry reads rows a newer one wrote.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointBody {
    pub url: String,
    #[serde(default)]
    pub description: String,
    /// Exact event types or patterns with `*`; none: every event of the route.
    #[serde(default)]
    pub event_types: Vec<String>,
    /// Sent with every request, by lowercase name.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    pub secret: String,
    /// The secret before the last rotation, which also signs until `previous_secret_until`.
    #[serde(default)]
    pub previous_secret: Option<String>,
    #[serde(default)]
    pub previous_secret_until: Option<DateTime<Utc>>,
    pub enabled: bool,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl std::fmt::Debug for EndpointBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointBody")
            .field("url", &self.url)
            .field("event_types", &self.event_types)
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

/// What a front-end was given to create or change an endpoint; `None`: not given (on a change:
/// kept as it is).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointInput {
    pub url: Option<String>,
    pub description: Option<String>,
    pub event_types: Option<Vec<String>>,
    pub headers: Option<BTreeMap<String, String>>,
    /// A signing secret of the caller's (`whsec_` and base64); only at creation, else ferry makes one.
    pub secret: Option<String>,
    pub enabled: Option<bool>,
}

/// An endpoint as a front-end shows it. The secret is masked except in the answer to the
/// request that made it (creation, rotation): it is shown once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EndpointView {
    pub id: String,
    pub route: String,
    /// The route its deliveries carry (`route/id`): for `ferry failed … --route`, breakers, metrics.
    pub delivery_route: String,
    pub url: String,
    pub description: String,
    pub event_types: Vec<String>,
    pub headers: BTreeMap<String, String>,
    pub enabled: bool,
    /// The signing secret: whole once, then masked (`whsec_…` and its last four characters).
    pub secret: String,
    /// Until when the secret before the last rotation still signs as well.
    pub previous_secret_until: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// An endpoint that was deleted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeletedEndpoint {
    pub id: String,
    pub route: String,
    pub delivery_route: String,
}

impl Endpoint {
    /// Reads a stored endpoint and checks it as an input (a row may have been edited by hand);
    /// the error says what is wrong with the row.
    pub fn decode(stored: &StoredEndpoint) -> Result<Endpoint, String> {
        if !is_id(&stored.id) {
            return Err(format!("endpoint id {:?} is not one ferry makes", crate::untrusted::clean(&stored.id, 100)));
        }
        let unusable = |why: String| format!("endpoint {} cannot be used as stored: {why}", stored.id);
        if let Some(defect) = &stored.unreadable {
            let fix = format!("delete it (`ferry endpoints delete {}`) and create it again", stored.id);
            return Err(unusable(format!("{defect}; {fix}")));
        }
        let body: EndpointBody = serde_json::from_str(&stored.body).map_err(|e| unusable(e.to_string()))?;
        check_stored_url(&body.url).map_err(unusable)?;
        check_description(&body.description).map_err(unusable)?;
        check_event_types(&body.event_types).map_err(unusable)?;
        if check_headers(&body.headers).map_err(unusable)? != body.headers {
            return Err(unusable("header names are not lowercase".into()));
        }
        Ok(Endpoint { id: stored.id.clone(), route: stored.route.clone(), body })
    }

    fn encode(&self) -> StoredEndpoint {
        StoredEndpoint {
            id: self.id.clone(),
            route: self.route.clone(),
            body: serde_json::to_string(&self.body).unwrap_or_default(),
            unreadable: None,
        }
    }

    /// The route its deliveries carry: `route/id`.
    pub fn delivery_route(&self) -> String {
        format!("{}{DESTINATION_SEPARATOR}{}", self.route, self.id)
    }

    /// The endpoint as shown, its secret whole (`reveal`) or masked.
    pub fn view(&self, reveal: bool) -> EndpointView {
        let b = &self.body;
        EndpointView {
            id: self.id.clone(),
            route: self.route.clone(),
            delivery_route: self.delivery_route(),
            url: b.url.clone(),
            description: b.description.clone(),
            event_types: b.event_types.clone(),
            headers: b
                .headers
                .iter()
                .map(|(name, value)| {
                    let shown = if crate::config::secret_word(name) { "***".to_string() } else { value.clone() };
                    (name.clone(), shown)
                })
                .collect(),
            enabled: b.enabled,
            secret: if reveal { b.secret.clone() } else { mask(&b.secret) },
            previous_secret_until: b.previous_secret.as_ref().and(b.previous_secret_until),
            created_at: b.created_at,
            updated_at: b.updated_at,
        }
    }

    /// The config its deliveries are made with at `now`: the template's, then the endpoint's
    /// URL, secrets (the previous one while it still signs) and headers.
    fn plugin_config(&self, template: &[(String, String)], now: DateTime<Utc>) -> Vec<(String, String)> {
        let b = &self.body;
        let mut config: Vec<(String, String)> =
            template.iter().filter(|(k, v)| !(k == "url" && v == TEMPLATE_URL)).cloned().collect();
        config.push(("url".into(), b.url.clone()));
        config.push(("secret".into(), b.secret.clone()));
        if let (Some(previous), Some(until)) = (&b.previous_secret, b.previous_secret_until)
            && until > now
        {
            config.push(("secret_previous".into(), previous.clone()));
        }
        config.extend(b.headers.iter().map(|(name, value)| (format!("header.{name}"), value.clone())));
        config
    }
}

/// `secret` as shown after its creation: the prefix and its last four characters.
fn mask(secret: &str) -> String {
    let tail: String = secret.chars().rev().take(4).collect::<Vec<_>>().into_iter().rev().collect();
    format!("{SECRET_PREFIX}…{tail}")
}

/// Whether `id` is one ferry makes: the prefix and 20 lowercase hex digits.
pub fn is_id(id: &str) -> bool {
    id.strip_prefix(ENDPOINT_ID_PREFIX)
        .is_some_and(|hex| hex.len() == 20 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
}

/// A fresh endpoint id: the prefix and 20 hex digits (80 random bits).
fn new_id() -> String {
    let bits: u128 = rand::rng().random();
    format!("{ENDPOINT_ID_PREFIX}{:020x}", bits >> 48)
}

/// A fresh signing secret: the prefix and 32 random bytes in base64.
fn new_secret() -> String {
    let bytes: [u8; SECRET_BYTES] = rand::rng().random();
    format!("{SECRET_PREFIX}{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// Checks a secret given by a caller.
fn check_secret(secret: &str, field: &str) -> Result<(), String> {
    let decoded = secret
        .strip_prefix(SECRET_PREFIX)
        .and_then(|b64| base64::engine::general_purpose::STANDARD.decode(b64).ok())
        .ok_or_else(|| {
            format!("{field} must be {SECRET_PREFIX} followed by base64, as ferry makes them (leave it out to get one)")
        })?;
    if !(MIN_SECRET_BYTES..=MAX_SECRET_BYTES).contains(&decoded.len()) {
        return Err(format!(
            "{field} holds {} bytes; a signing secret holds {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES}",
            decoded.len()
        ));
    }
    Ok(())
}

/// Why `url` is not a URL an endpoint may have, whatever its origin: at most [`MAX_URL`] bytes,
/// `http://` or `https://` in lowercase (as the plugins read it), no fragment, nothing that is not
/// printable ASCII.
fn check_stored_url(url: &str) -> Result<(), String> {
    if url.len() > MAX_URL {
        return Err(format!("url is {} bytes long; at most {MAX_URL} are accepted", url.len()));
    }
    if !url.starts_with("http://") && !url.starts_with("https://") {
        return Err(format!("url {:?} must begin with http:// or https://", crate::untrusted::clean(url, 200)));
    }
    if url.contains('#') || !url.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("url must be printable ASCII without spaces or a #fragment (percent-encode the rest)".into());
    }
    Ok(())
}

/// Why `url` cannot be an endpoint of `route`, whose endpoints may point at `origins`.
pub fn check_url(route: &str, url: &str, origins: &[String]) -> Result<(), String> {
    check_stored_url(url)?;
    let uri: http::Uri = url.parse().map_err(|e| format!("url {url:?} is not a URL: {e}"))?;
    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return Err(format!("url {url:?} must be absolute, as in https://hooks.example.com/ferry"));
    };
    let origin = normalize_origin(&format!("{scheme}://{authority}")).map_err(|e| format!("url: {e}"))?;
    if !origins.iter().any(|pattern| origin_matches(pattern, &origin)) {
        return Err(format!(
            "url {url:?} is not allowed: its origin {origin} matches none of route.{route}.endpoints.origins ({})",
            origins.join(", ")
        ));
    }
    Ok(())
}

fn check_headers(headers: &BTreeMap<String, String>) -> Result<BTreeMap<String, String>, String> {
    if headers.len() > MAX_HEADERS {
        return Err(format!("headers has {} entries; at most {MAX_HEADERS} are accepted", headers.len()));
    }
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    let mut checked = BTreeMap::new();
    for (name, value) in headers {
        let lower = name.to_ascii_lowercase();
        if lower.is_empty() || !lower.chars().all(token) {
            return Err(format!("headers: {:?} is not a header name", crate::untrusted::clean(name, 100)));
        }
        if lower.len() > MAX_HEADER_NAME {
            return Err(format!(
                "headers: a header name is at most {MAX_HEADER_NAME} bytes, got one of {} starting {:?}",
                lower.len(),
                &lower[..40]
            ));
        }
        let forbidden = wasmtime_wasi_http::DEFAULT_FORBIDDEN_HEADERS.iter().any(|h| h.as_str() == lower);
        if forbidden || RESERVED_HEADERS.contains(&lower.as_str()) || lower.starts_with("webhook-") {
            return Err(format!("headers: {name:?} is set by each request itself and cannot be given"));
        }
        if value.len() > MAX_HEADER_VALUE || value.chars().any(|c| c.is_control() && c != '\t') {
            return Err(format!(
                "headers.{name}: a header value is at most {MAX_HEADER_VALUE} bytes without control characters"
            ));
        }
        checked.insert(lower, value.clone());
    }
    Ok(checked)
}

fn check_event_types(patterns: &[String]) -> Result<(), String> {
    if patterns.len() > MAX_EVENT_TYPES {
        return Err(format!("event_types has {} entries; at most {MAX_EVENT_TYPES} are accepted", patterns.len()));
    }
    if let Some(long) = patterns.iter().find(|p| p.len() > MAX_EVENT_TYPE) {
        return Err(format!("event_types: {long:?} is longer than {MAX_EVENT_TYPE} bytes"));
    }
    EventTypes::new(patterns).map(drop).map_err(|e| format!("event_types: {e}"))
}

fn check_description(text: &str) -> Result<(), String> {
    if text.len() > MAX_DESCRIPTION || text.chars().any(char::is_control) {
        return Err(format!("description is at most {MAX_DESCRIPTION} bytes without control characters"));
    }
    Ok(())
}

impl EndpointInput {
    /// Applies the fields given to `body`, checking each against the route's `origins`.
    fn apply(self, route: &str, origins: &[String], body: &mut EndpointBody) -> Result<(), String> {
        if let Some(url) = self.url {
            check_url(route, &url, origins)?;
            body.url = url;
        }
        if let Some(description) = self.description {
            check_description(&description)?;
            body.description = description;
        }
        if let Some(patterns) = self.event_types {
            check_event_types(&patterns)?;
            body.event_types = patterns;
        }
        if let Some(headers) = self.headers {
            body.headers = check_headers(&headers)?;
        }
        if let Some(enabled) = self.enabled {
            body.enabled = enabled;
        }
        Ok(())
    }
}

impl Ops {
    /// The endpoint settings of `route`, or why it takes no endpoints.
    fn endpoints_settings(&self, route: &str) -> Result<Arc<EndpointsSettings>, OpError> {
        let settings = self.settings();
        match settings.fan_outs.get(route).and_then(|f| f.endpoints.clone()) {
            Some(endpoints) => Ok(endpoints),
            None if settings.is_configured(route) => Err(OpError::Invalid(format!(
                "route {route:?} does not take endpoints: give it a [route.{route}.endpoints] table with the plugin and the origins its endpoints may have"
            ))),
            None => Err(OpError::NotFound(format!("no route {route:?} is configured"))),
        }
    }

    /// Creates an endpoint of `route`; the answer shows its secret, the only time it is shown.
    pub async fn create_endpoint(&self, route: &str, input: EndpointInput) -> Result<EndpointView, OpError> {
        let endpoints = self.endpoints_settings(route)?;
        let url_field = self.front.name("url");
        if input.url.is_none() {
            return Err(OpError::Invalid(format!("{url_field} is required: where the endpoint's requests go")));
        }
        let secret = match input.secret.clone() {
            Some(secret) => {
                check_secret(&secret, &self.front.name("secret")).map_err(OpError::Invalid)?;
                secret
            }
            None => new_secret(),
        };
        if self.store.endpoints(Some(route)).await?.len() >= MAX_PER_ROUTE {
            return Err(OpError::Conflict(format!("route {route:?} has {MAX_PER_ROUTE} endpoints, the most it may")));
        }
        let now = self.clock.now();
        let mut body = EndpointBody {
            url: String::new(),
            description: String::new(),
            event_types: Vec::new(),
            headers: BTreeMap::new(),
            secret,
            previous_secret: None,
            previous_secret_until: None,
            enabled: true,
            created_at: now,
            updated_at: now,
        };
        let input = EndpointInput { secret: None, ..input };
        input.apply(route, &endpoints.origins, &mut body).map_err(OpError::Invalid)?;
        let endpoint = Endpoint { id: new_id(), route: route.to_string(), body };
        if !self.store.insert_endpoint(&endpoint.encode()).await? {
            return Err(OpError::Conflict(format!("endpoint id {} is taken; try again", endpoint.id)));
        }
        Ok(endpoint.view(true))
    }

    /// The endpoints of `route` (of every route: `None`), secrets masked.
    pub async fn list_endpoints(&self, route: Option<&str>) -> Result<Vec<EndpointView>, OpError> {
        if let Some(route) = route {
            self.endpoints_settings(route)?;
        }
        let stored = self.store.endpoints(route).await?;
        let mut views = Vec::with_capacity(stored.len());
        for row in &stored {
            match Endpoint::decode(row) {
                Ok(endpoint) => views.push(endpoint.view(false)),
                Err(why) => tracing::warn!("{why}; not listed"),
            }
        }
        Ok(views)
    }

    async fn load_endpoint(&self, id: &str) -> Result<(Endpoint, String), OpError> {
        let stored = self
            .store
            .endpoint(id)
            .await?
            .ok_or_else(|| OpError::NotFound(format!("endpoint {id:?} does not exist")))?;
        let endpoint = Endpoint::decode(&stored).map_err(OpError::Conflict)?;
        Ok((endpoint, stored.body))
    }

    /// Endpoint `id`, its secret masked.
    pub async fn show_endpoint(&self, id: &str) -> Result<EndpointView, OpError> {
        Ok(self.load_endpoint(id).await?.0.view(false))
    }

    /// Changes the fields of endpoint `id` that `input` gives (its secret changes only by
    /// rotation); answers with the endpoint, its secret masked.
    pub async fn update_endpoint(&self, id: &str, input: EndpointInput) -> Result<EndpointView, OpError> {
        if input.secret.is_some() {
            return Err(OpError::Invalid(format!(
                "{} cannot be changed here: rotate it, so the previous one keeps signing for a while",
                self.front.name("secret")
            )));
        }
        self.change_endpoint(id, false, |route, origins, body| input.apply(route, origins, body)).await
    }

    /// Enables or disables endpoint `id`.
    pub async fn set_endpoint_enabled(&self, id: &str, enabled: bool) -> Result<EndpointView, OpError> {
        self.update_endpoint(id, EndpointInput { enabled: Some(enabled), ..EndpointInput::default() }).await
    }

    /// Gives endpoint `id` a new signing secret (`secret`, or one ferry makes); the old one keeps
    /// signing as well for `keep_previous`. Answers with the new secret, shown this once.
    pub async fn rotate_endpoint_secret(
        &self,
        id: &str,
        secret: Option<String>,
        keep_previous: Duration,
    ) -> Result<EndpointView, OpError> {
        if let Some(secret) = &secret {
            check_secret(secret, &self.front.name("secret")).map_err(OpError::Invalid)?;
        }
        if keep_previous > MAX_KEEP_PREVIOUS {
            return Err(OpError::Invalid(format!(
                "{} is at most {}",
                self.front.name("keep_previous"),
                crate::config::format_duration(MAX_KEEP_PREVIOUS)
            )));
        }
        let now = self.clock.now();
        self.change_endpoint(id, true, |_, _, body| {
            let until = crate::clock::later(now, keep_previous);
            body.previous_secret = (until > now).then(|| body.secret.clone());
            body.previous_secret_until = (until > now).then_some(until);
            body.secret = secret.unwrap_or_else(new_secret);
            Ok(())
        })
        .await
    }

    /// Reads endpoint `id`, changes it with `change` and writes it back unless it changed
    /// meanwhile (then it is an error to try again).
    async fn change_endpoint(
        &self,
        id: &str,
        reveal: bool,
        change: impl FnOnce(&str, &[String], &mut EndpointBody) -> Result<(), String>,
    ) -> Result<EndpointView, OpError> {
        let (mut endpoint, before) = self.load_endpoint(id).await?;
        let endpoints = self.endpoints_settings(&endpoint.route)?;
        change(&endpoint.route, &endpoints.origins, &mut endpoint.body).map_err(OpError::Invalid)?;
        endpoint.body.updated_at = self.clock.now();
        if !self.store.update_endpoint(&endpoint.encode(), &before).await? {
            return Err(OpError::Conflict(format!(
                "endpoint {id} was changed or deleted meanwhile; look and try again"
            )));
        }
        Ok(endpoint.view(reveal))
    }

    /// Deletes endpoint `id`. Its deliveries not yet made end FAILED (`no_transport`) when next
    /// claimed, kept for inspection like any other.
    pub async fn delete_endpoint(&self, id: &str) -> Result<DeletedEndpoint, OpError> {
        // A row that cannot be used can be deleted all the same: it is read for its route only.
        let stored = self
            .store
            .endpoint(id)
            .await?
            .ok_or_else(|| OpError::NotFound(format!("endpoint {id:?} does not exist")))?;
        if !self.store.delete_endpoint(id).await? {
            return Err(OpError::NotFound(format!("endpoint {id:?} does not exist")));
        }
        let delivery_route = format!("{}{DESTINATION_SEPARATOR}{}", stored.route, stored.id);
        Ok(DeletedEndpoint { id: stored.id, route: stored.route, delivery_route })
    }
}

/// One endpoint as the relay delivers to it.
pub struct LiveEndpoint {
    pub id: String,
    /// `route/id`.
    pub delivery_route: String,
    pub event_types: EventTypes,
    /// Whether its deliveries are made; false also for an endpoint whose row cannot be used,
    /// whose deliveries wait until it is fixed or deleted.
    pub enabled: bool,
    /// Its row cannot be read, so which events it takes is not known: it is handed every event
    /// of its route, and the copies wait. Once the row is fixed, those it takes are delivered
    /// and the others dropped (see [`LiveEndpoint::takes`]); nothing emitted meanwhile is lost.
    pub unreadable: bool,
    /// The config of its plugin instances (its secrets among them); `Err`: why it cannot be
    /// delivered to (a row that cannot be used, a URL the route's origins no longer allow).
    pub config: Result<Arc<[(String, String)]>, String>,
}

impl LiveEndpoint {
    /// Whether a copy of an `event_type` event is delivered to this endpoint: its types are
    /// checked again at delivery, as they may have changed while the copy waited, or not been
    /// known when it was made (the row could not be read).
    pub fn takes(&self, event_type: &str) -> bool {
        self.event_types.matches(event_type)
    }
}

impl std::fmt::Debug for LiveEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveEndpoint")
            .field("delivery_route", &self.delivery_route)
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

/// Every endpoint of the routes that take them, as read at one moment.
#[derive(Debug, Default)]
pub struct EndpointTable {
    by_route: HashMap<String, Vec<Arc<LiveEndpoint>>>,
    by_delivery: HashMap<String, Arc<LiveEndpoint>>,
}

impl EndpointTable {
    /// The table of `stored` under `settings` at `now`, with why each row that cannot be used
    /// cannot: such a row's endpoint is held (handed nothing, its deliveries waiting) until it is
    /// fixed or deleted. Rows of routes that take no endpoints are left out: their deliveries
    /// fail as having no route.
    pub fn build(settings: &Settings, stored: &[StoredEndpoint], now: DateTime<Utc>) -> (EndpointTable, Vec<String>) {
        let mut table = EndpointTable::default();
        let mut unusable = Vec::new();
        let mut per_route: HashMap<&str, usize> = HashMap::new();
        for row in stored {
            let Some(endpoints) = settings.fan_outs.get(&row.route).and_then(|f| f.endpoints.as_ref()) else {
                continue;
            };
            let Some(template) = settings.routes.get(&endpoints.template) else { continue };
            // Rows come in id order; the store reads one past the limit to tell this.
            let seen = per_route.entry(row.route.as_str()).or_default();
            *seen += 1;
            if *seen > MAX_PER_ROUTE {
                if *seen == MAX_PER_ROUTE + 1 {
                    unusable.push(format!(
                        "route {} has more than {MAX_PER_ROUTE} endpoints, the most ferry creates (rows written by SQL?): \
                         only its first {MAX_PER_ROUTE} by id are used; delete the others (`ferry endpoints delete ID`)",
                        row.route
                    ));
                }
                continue;
            }
            let live = match Endpoint::decode(row) {
                Ok(endpoint) => LiveEndpoint {
                    id: endpoint.id.clone(),
                    delivery_route: endpoint.delivery_route(),
                    // Checked by `decode`.
                    event_types: EventTypes::new(&endpoint.body.event_types).unwrap_or_default(),
                    enabled: endpoint.body.enabled,
                    unreadable: false,
                    config: check_url(&endpoint.route, &endpoint.body.url, &endpoints.origins)
                        .map(|()| Arc::from(endpoint.plugin_config(&template.plugin_config, now))),
                },
                Err(why) if is_id(&row.id) => {
                    unusable.push(format!(
                        "{why}; its deliveries, of every event of its route, wait until it is fixed or deleted"
                    ));
                    let delivery_route = format!("{}{DESTINATION_SEPARATOR}{}", row.route, row.id);
                    LiveEndpoint {
                        id: row.id.clone(),
                        delivery_route,
                        // Every type, as no other is known.
                        event_types: EventTypes::default(),
                        enabled: false,
                        unreadable: true,
                        config: Err(why),
                    }
                }
                Err(why) => {
                    unusable.push(why);
                    continue;
                }
            };
            let live = Arc::new(live);
            table.by_delivery.insert(live.delivery_route.clone(), live.clone());
            table.by_route.entry(row.route.clone()).or_default().push(live);
        }
        (table, unusable)
    }

    /// The endpoint whose deliveries carry `delivery_route`.
    pub fn get(&self, delivery_route: &str) -> Option<&Arc<LiveEndpoint>> {
        self.by_delivery.get(delivery_route)
    }

    /// The delivery routes of `route`'s endpoints that receive `event_type`: its enabled ones
    /// that take the type, and those whose row cannot be read (held until it is fixed).
    pub fn routes_for<'a>(&'a self, route: &str, event_type: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.by_route
            .get(route)
            .into_iter()
            .flatten()
            .filter(move |e| (e.enabled || e.unreadable) && e.event_types.matches(event_type))
            .map(|e| e.delivery_route.as_str())
    }

    /// The delivery routes of every endpoint of `route`.
    pub fn delivery_routes(&self, route: &str) -> impl Iterator<Item = &str> {
        self.by_route.get(route).into_iter().flatten().map(|e| e.delivery_route.as_str())
    }

    /// The delivery routes of disabled endpoints, and of those whose row cannot be read: their
    /// deliveries wait until they are enabled or fixed.
    pub fn disabled(&self) -> impl Iterator<Item = &str> {
        self.by_delivery.values().filter(|e| !e.enabled).map(|e| e.delivery_route.as_str())
    }

    /// The delivery routes of the endpoints of ordered routes, and of those the ones a FAILED
    /// delivery blocks: each endpoint delivers in its route's order.
    pub fn ordered(&self, settings: &Settings) -> (Vec<String>, Vec<String>) {
        let (mut ordered, mut blocking) = (Vec::new(), Vec::new());
        for (route, endpoints) in &self.by_route {
            if let Some(Ordering::Ordered { failed_blocks_key }) = settings.fan_outs.get(route).map(|f| f.ordering) {
                let names = endpoints.iter().map(|e| e.delivery_route.clone());
                if failed_blocks_key {
                    blocking.extend(names.clone());
                }
                ordered.extend(names);
            }
        }
        (ordered, blocking)
    }

    /// How many endpoints the table holds.
    pub fn len(&self) -> usize {
        self.by_delivery.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_delivery.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store reads no body longer than `MAX_STORED_BODY`: every body ferry's checks accept
    /// must fit, each field at its longest in the characters JSON writes longest (a quote takes
    /// two bytes, a control character six).
    #[test]
    fn the_largest_body_ferry_accepts_is_one_the_store_loads() {
        let quotes = |n: usize| "\"".repeat(n);
        let secret = format!("whsec_{}", "A".repeat(MAX_SECRET_BYTES * 4 / 3 + 4));
        let body = EndpointBody {
            url: quotes(MAX_URL),
            description: quotes(MAX_DESCRIPTION),
            event_types: vec!["\u{1}".repeat(MAX_EVENT_TYPE); MAX_EVENT_TYPES],
            headers: (0..MAX_HEADERS).map(|i| (format!("{i:0>MAX_HEADER_NAME$}"), quotes(MAX_HEADER_VALUE))).collect(),
            secret: secret.clone(),
            previous_secret: Some(secret),
            previous_secret_until: Some(DateTime::<Utc>::MAX_UTC),
            enabled: true,
            created_at: DateTime::<Utc>::MAX_UTC,
            updated_at: DateTime::<Utc>::MAX_UTC,
        };
        let written = serde_json::to_string(&body).unwrap().len();
        assert!(written <= crate::store::MAX_STORED_BODY, "{written} bytes");
        let name = "h".repeat(MAX_HEADER_NAME + 1);
        let err = check_headers(&BTreeMap::from([(name, "v".into())])).unwrap_err();
        assert!(err.contains("a header name is at most 256 bytes, got one of 257"), "{err}");
    }

    #[test]
    fn urls_must_match_the_route_origins() {
        let origins = vec!["https://*.example.com:443".to_string(), "http://127.0.0.1:8080".to_string()];
        assert!(check_url("r", "https://a.example.com/hook", &origins).is_ok());
        assert!(check_url("r", "https://a.b.example.com:443/x?y=1", &origins).is_ok());
        assert!(check_url("r", "http://127.0.0.1:8080/", &origins).is_ok());
        for bad in [
            "https://example.com/hook",
            "http://a.example.com/hook",
            "https://a.example.com:8443/",
            "https://evil.com/?https://a.example.com",
            "https://a.example.com@evil.com/",
            "http://127.0.0.1:8081/",
            "/relative",
            "not a url",
        ] {
            let err = check_url("r", bad, &origins).unwrap_err();
            assert!(err.contains("url"), "{bad}: {err}");
        }
        let err = check_url("orders", "https://evil.com/", &origins).unwrap_err();
        assert!(err.contains("route.orders.endpoints.origins"), "{err}");
    }

    #[test]
    fn secrets_are_made_checked_and_masked() {
        let made = new_secret();
        assert!(check_secret(&made, "secret").is_ok(), "{made}");
        assert_ne!(made, new_secret());
        assert!(check_secret("whsec_c2hvcnQ=", "secret").unwrap_err().contains("16 to 64"));
        assert!(check_secret("hunter2hunter2hunter2", "secret").unwrap_err().contains("whsec_"));
        let masked = mask(&made);
        assert!(masked.starts_with("whsec_…") && made.ends_with(&masked["whsec_…".len()..]), "{masked}");
        assert_eq!(masked.chars().count(), "whsec_…".chars().count() + 4);
    }

    #[test]
    fn headers_are_checked() {
        let ok = BTreeMap::from([("X-Tenant".to_string(), "a b".to_string())]);
        assert_eq!(check_headers(&ok).unwrap(), BTreeMap::from([("x-tenant".to_string(), "a b".to_string())]));
        for (name, value) in [("Host", "x"), ("webhook-signature", "x"), ("bad name", "x"), ("x-a", "a\r\nb: c")] {
            let headers = BTreeMap::from([(name.to_string(), value.to_string())]);
            assert!(check_headers(&headers).is_err(), "{name}: {value:?}");
        }
    }

    #[test]
    fn ids_are_fresh_and_route_safe() {
        let id = new_id();
        assert!(id.starts_with(ENDPOINT_ID_PREFIX) && id.len() == ENDPOINT_ID_PREFIX.len() + 20, "{id}");
        assert_ne!(id, new_id());
        let bad = StoredEndpoint { id: "orders/x".into(), route: "r".into(), body: "{}".into(), unreadable: None };
        assert!(Endpoint::decode(&bad).is_err());
        assert!(
            is_id(&id) && !is_id("ep_0123") && !is_id("ep_0123456789ABCDEF0123") && !is_id("ep_../../0123456789ab")
        );
        let garbage = StoredEndpoint { id: new_id(), route: "r".into(), body: "{not json".into(), unreadable: None };
        assert!(Endpoint::decode(&garbage).unwrap_err().contains("cannot be used as stored"));
        // A row edited by hand is checked as an input would be.
        let forged = r#"{"url":"http://a.example.com/","secret":"whsec_x","enabled":true,
            "created_at":"2026-01-01T00:00:00Z","updated_at":"2026-01-01T00:00:00Z","headers":{"host":"evil"}}"#;
        let forged = StoredEndpoint { id: new_id(), route: "r".into(), body: forged.into(), unreadable: None };
        assert!(Endpoint::decode(&forged).unwrap_err().contains("host"));
        let fine = StoredEndpoint { body: forged.body.replace(r#""host":"evil""#, r#""x-a":"1""#), ..forged.clone() };
        assert!(Endpoint::decode(&fine).is_ok(), "{:?}", Endpoint::decode(&fine));
    }

    #[test]
    fn the_table_checks_each_row_against_the_settings_in_effect() {
        let text = "[route.hooks.endpoints]\norigins = [\"https://*.example.com\"]\n";
        let settings = crate::config::Config::from_toml_str(text, "t").unwrap().settings().unwrap();
        let row = |id: &str, url: &str| StoredEndpoint {
            id: id.into(),
            route: "hooks".into(),
            body: format!(
                r#"{{"url":"{url}","secret":"whsec_x","enabled":true,"event_types":["a.*"],
                    "created_at":"2026-01-01T00:00:00Z","updated_at":"2026-01-01T00:00:00Z","added_later":1}}"#
            ),
            unreadable: None,
        };
        let (ok, moved, broken) = ("ep_0000000000000000000a", "ep_0000000000000000000b", "ep_0000000000000000000c");
        let stored = [
            row(ok, "https://a.example.com/in"),
            // Saved when the origins allowed it; they no longer do.
            row(moved, "https://elsewhere.org/in"),
            StoredEndpoint { body: "{".into(), ..row(broken, "") },
            // A route that takes no endpoints (any more).
            StoredEndpoint { route: "gone".into(), ..row("ep_0000000000000000000d", "https://a.example.com/") },
        ];
        let (table, unusable) = EndpointTable::build(&settings, &stored, Utc::now());
        assert_eq!(table.len(), 3);
        assert_eq!(unusable.len(), 1, "{unusable:?}");
        let live = |id: &str| table.get(&format!("hooks/{id}")).unwrap();
        assert!(live(ok).enabled && live(ok).config.is_ok(), "unknown fields of a newer ferry are ignored");
        assert!(live(moved).config.as_ref().unwrap_err().contains("endpoints.origins"));
        assert!(!live(broken).enabled && live(broken).config.is_err(), "held until fixed or deleted");
        assert_eq!(table.disabled().collect::<Vec<_>>(), [format!("hooks/{broken}")]);
        let mut to: Vec<&str> = table.routes_for("hooks", "a.b").collect();
        to.sort_unstable();
        assert_eq!(to, [format!("hooks/{ok}"), format!("hooks/{moved}"), format!("hooks/{broken}")]);
        // Which types the broken one takes is not known: it is handed every one, to hold.
        assert_eq!(table.routes_for("hooks", "b.a").collect::<Vec<_>>(), [format!("hooks/{broken}")]);
        assert!(live(ok).takes("a.b") && !live(ok).takes("b.a") && live(broken).takes("b.a"));
    }

    #[test]
    fn the_previous_secret_signs_only_until_its_time() {
        let now = Utc::now();
        let body = EndpointBody {
            url: "https://a.example.com/".into(),
            description: String::new(),
            event_types: Vec::new(),
            headers: BTreeMap::from([("x-a".to_string(), "1".to_string())]),
            secret: "new".into(),
            previous_secret: Some("old".into()),
            previous_secret_until: Some(now + chrono::Duration::seconds(60)),
            enabled: true,
            created_at: now,
            updated_at: now,
        };
        let endpoint = Endpoint { id: new_id(), route: "r".into(), body };
        let template = vec![("timeout_ms".to_string(), "500".to_string()), ("url".to_string(), TEMPLATE_URL.into())];
        let config = endpoint.plugin_config(&template, now);
        let get = |k: &str| config.iter().find(|(key, _)| key == k).map(|(_, v)| v.as_str());
        assert_eq!(get("url"), Some("https://a.example.com/"));
        assert_eq!(config.iter().filter(|(k, _)| k == "url").count(), 1, "the template's stand-in URL is gone");
        assert_eq!((get("secret"), get("secret_previous")), (Some("new"), Some("old")));
        assert_eq!((get("timeout_ms"), get("header.x-a")), (Some("500"), Some("1")));
        let later = endpoint.plugin_config(&template, now + chrono::Duration::seconds(61));
        assert!(!later.iter().any(|(k, _)| k == "secret_previous"), "the previous secret no longer signs");
    }
}
