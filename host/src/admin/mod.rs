//! The admin HTTP API: health checks, Prometheus metrics, inspection and operations, as JSON.
//!
//! Every endpoint but `/health/live` and `/health/ready` requires `Authorization: Bearer <token>`.
//! Errors are JSON too, `{"error": {"code": …, "message": …}}`, and the message names the bad input.
//! The handlers (`handlers.rs`) are thin: they parse the request (`extract.rs`), call one operator
//! operation (`crate::ops`) and answer with its typed view. `openapi.json` next to this file
//! describes every endpoint; a test checks every answer against it.

mod extract;
mod handlers;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use self::extract::{authorize, method_not_allowed, not_found};
use self::handlers::*;
use crate::clock::Clock;
use crate::config::Settings;
use crate::metrics::Metrics;
use crate::ops::{FrontEnd, Ops};
use crate::plugins::Registry;
use crate::store::Store;

/// The OpenAPI description served at `/v1/openapi.json`.
pub const OPENAPI: &str = include_str!("openapi.json");

/// What the handlers share.
#[derive(Clone)]
pub struct Admin {
    pub ops: Ops,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    token: Arc<str>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin").field("listen", &self.ops.settings.config.admin.listen).finish_non_exhaustive()
    }
}

impl Admin {
    /// The API's state; reads the bearer token (from `admin.token` or `admin.token_file`).
    pub fn new(
        settings: Arc<Settings>,
        store: Arc<dyn Store>,
        registry: Arc<Registry>,
        metrics: Arc<Metrics>,
        clock: Arc<dyn Clock>,
        wake: Arc<Notify>,
    ) -> anyhow::Result<Admin> {
        let token = settings.config.admin.bearer_token().map_err(anyhow::Error::msg)?;
        let ops = Ops { settings, store, clock, wake: Some(wake), front: FrontEnd::Api };
        Ok(Admin { ops, registry, metrics, token: token.into() })
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
            self.ops.settings.config.admin.address().ok_or_else(|| anyhow::anyhow!("admin.listen is not set"))?;
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
