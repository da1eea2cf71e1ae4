//! How the admin API reads requests and writes errors: the bearer-token check, JSON error
//! answers, and extractors that turn every bad input into a 400 naming the field.

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::Admin;
use crate::ops::OpError;

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }

    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub(super) fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = match self.status {
            StatusCode::BAD_REQUEST => "bad_request",
            StatusCode::UNAUTHORIZED => "unauthorized",
            StatusCode::FORBIDDEN => "forbidden",
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

impl From<OpError> for ApiError {
    fn from(e: OpError) -> Self {
        match e {
            OpError::Invalid(message) => ApiError::bad_request(message),
            OpError::NotFound(message) => ApiError::not_found(message),
            OpError::Conflict(message) => ApiError::new(StatusCode::CONFLICT, message),
            OpError::Store(e) => {
                tracing::error!("admin API: {e}");
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
        }
    }
}

/// A JSON request body. An empty body reads as `{}`, so endpoints whose fields are all optional
/// need none. Every failure (not JSON, wrong types, missing or unknown fields, too large) is a JSON
/// error naming the problem.
pub(super) struct Body<T>(pub(super) T);

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
pub(super) struct Params<T>(pub(super) T);

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
pub(super) struct EventId(pub(super) i64);

impl<S: Send + Sync> FromRequestParts<S> for EventId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|r: PathRejection| ApiError::bad_request(r.body_text()))?;
        // Positive or not is the operation's to say, as for the CLI.
        raw.parse::<i64>()
            .ok()
            .map(EventId)
            .ok_or_else(|| ApiError::bad_request(format!("event id must be a positive integer, got {raw:?}")))
    }
}

/// The `{route}` of a breaker path.
pub(super) struct RouteName(pub(super) String);

impl<S: Send + Sync> FromRequestParts<S> for RouteName {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(route)| RouteName(route))
            .map_err(|r: PathRejection| ApiError::bad_request(format!("route in the path: {}", r.body_text())))
    }
}

/// Checks the bearer token, in constant time; without one, the dashboard's session cookie and key
/// (see `ui.rs`).
pub(super) async fn authorize(State(admin): State<Admin>, request: Request, next: Next) -> Response {
    let given = request.headers().get(header::AUTHORIZATION).map(|v| v.to_str().unwrap_or(""));
    if given.is_none()
        && let Some(cookie) = super::ui::session_cookie(request.headers())
    {
        return match super::ui::check_session(&admin, &request, cookie) {
            Ok(()) => {
                let mut response = next.run(request).await;
                response.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
                response
            }
            Err(e) => e.into_response(),
        };
    }
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

pub(super) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub(super) async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(format!("no endpoint {} {} (see /v1/openapi.json)", request.method(), request.uri().path()))
}

pub(super) async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {} (see /v1/openapi.json)", request.method(), request.uri().path()),
    )
}
