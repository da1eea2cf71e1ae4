//! The admin API's webhook endpoint operations: create and list under a route
//! (`/v1/routes/{route}/endpoints`), and show, change, enable, disable, rotate the secret of and
//! delete one endpoint by id (`/v1/endpoints/{id}`).

use axum::Json;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::StatusCode;
use serde::Deserialize;

use super::Admin;
use super::extract::{ApiError, Body, Params, RouteName};
use crate::config::parse_duration;
use crate::endpoints::{DeletedEndpoint, EndpointInput, EndpointView};

/// The `{id}` of an endpoint path.
pub(super) struct EndpointId(String);

impl<S: Send + Sync> FromRequestParts<S> for EndpointId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(id)| EndpointId(id))
            .map_err(|r| ApiError::bad_request(format!("endpoint id in the path: {}", r.body_text())))
    }
}

pub(super) async fn create(
    State(admin): State<Admin>,
    RouteName(route): RouteName,
    Body(input): Body<EndpointInput>,
) -> Result<(StatusCode, Json<EndpointView>), ApiError> {
    Ok((StatusCode::CREATED, Json(admin.ops.create_endpoint(&route, input).await?)))
}

pub(super) async fn list_of_route(
    State(admin): State<Admin>,
    RouteName(route): RouteName,
) -> Result<Json<Vec<EndpointView>>, ApiError> {
    Ok(Json(admin.ops.list_endpoints(Some(&route)).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListParams {
    route: Option<String>,
}

pub(super) async fn list(
    State(admin): State<Admin>,
    Params(params): Params<ListParams>,
) -> Result<Json<Vec<EndpointView>>, ApiError> {
    Ok(Json(admin.ops.list_endpoints(params.route.as_deref()).await?))
}

pub(super) async fn show(
    State(admin): State<Admin>,
    EndpointId(id): EndpointId,
) -> Result<Json<EndpointView>, ApiError> {
    Ok(Json(admin.ops.show_endpoint(&id).await?))
}

pub(super) async fn update(
    State(admin): State<Admin>,
    EndpointId(id): EndpointId,
    Body(input): Body<EndpointInput>,
) -> Result<Json<EndpointView>, ApiError> {
    Ok(Json(admin.ops.update_endpoint(&id, input).await?))
}

pub(super) async fn enable(
    State(admin): State<Admin>,
    EndpointId(id): EndpointId,
) -> Result<Json<EndpointView>, ApiError> {
    Ok(Json(admin.ops.set_endpoint_enabled(&id, true).await?))
}

pub(super) async fn disable(
    State(admin): State<Admin>,
    EndpointId(id): EndpointId,
) -> Result<Json<EndpointView>, ApiError> {
    Ok(Json(admin.ops.set_endpoint_enabled(&id, false).await?))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RotateRequest {
    /// The new secret (`whsec_…`); ferry makes one when it is left out.
    secret: Option<String>,
    /// How long the previous secret keeps signing too, e.g. `24h` (the default) or `0s`.
    keep_previous: Option<String>,
}

pub(super) async fn rotate_secret(
    State(admin): State<Admin>,
    EndpointId(id): EndpointId,
    Body(body): Body<RotateRequest>,
) -> Result<Json<EndpointView>, ApiError> {
    let keep = match body.keep_previous.as_deref() {
        None => crate::endpoints::KEEP_PREVIOUS,
        Some(text) => parse_duration(text).map_err(|e| ApiError::bad_request(format!("keep_previous: {e}")))?,
    };
    Ok(Json(admin.ops.rotate_endpoint_secret(&id, body.secret, keep).await?))
}

pub(super) async fn delete(
    State(admin): State<Admin>,
    EndpointId(id): EndpointId,
) -> Result<Json<DeletedEndpoint>, ApiError> {
    Ok(Json(admin.ops.delete_endpoint(&id).await?))
}
