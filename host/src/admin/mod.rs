//! The admin HTTP API: health checks, Prometheus metrics, inspection and operations, as JSON.
//!
//! Every endpoint but `/health/live`, `/health/ready` and the dashboard's sign-in page and assets
//! requires `Authorization: Bearer <token>`, or the dashboard's session cookie (`ui.rs`).
//! Errors are JSON too, `{"error": {"code": …, "message": …}}`, and the message names the bad input.
//! The handlers (`handlers.rs`) are thin: they parse the request (`extract.rs`), call one operator
//! operation (`crate::ops`) and answer with its typed view. `openapi.json` next to this file
//! describes every endpoint; a test checks every answer against it.

mod endpoints;
mod extract;
mod handlers;
mod ui;

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
use crate::live::Live;
use crate::metrics::Metrics;
use crate::ops::{FrontEnd, Ops};
use crate::plugins::Registry;
use crate::relay::RelayHealth;
use crate::store::Store;

/// The OpenAPI description served at `/v1/openapi.json`.
pub const OPENAPI: &str = include_str!("openapi.json");

/// An answer shared for a second: within it, callers get the last one made; past it, one caller
/// at a time makes a new one while the others wait for it. Endpoints that anyone may call
/// (`/health/ready`, and `/metrics` with `admin.metrics_public`) reach the database at most once a
/// second this way, however many requests arrive, and however many of them hang up early: the
/// answer is made by a task of its own, which keeps it for the next callers.
#[derive(Debug)]
pub(crate) struct Recent<T>(Arc<tokio::sync::Mutex<Option<(std::time::Instant, T)>>>);

impl<T> Default for Recent<T> {
    fn default() -> Self {
        Recent(Arc::new(tokio::sync::Mutex::new(None)))
    }
}

impl<T: Clone + Send + 'static> Recent<T> {
    /// The answer of the last second, or else the one `make` gives (kept for the next second, a
    /// failure too, so that waiting callers do not each retry it); `None` when the wait for
    /// another caller's answer took longer than `limit`, or `make` panicked.
    pub(crate) async fn get(
        &self,
        limit: std::time::Duration,
        make: impl Future<Output = T> + Send + 'static,
    ) -> Option<T> {
        let mut last = tokio::time::timeout(limit, self.0.clone().lock_owned()).await.ok()?;
        if let Some((_, answer)) = last.as_ref().filter(|(at, _)| at.elapsed() < std::time::Duration::from_secs(1)) {
            return Some(answer.clone());
        }
        let making = tokio::spawn(async move {
            let answer = make.await;
            *last = Some((std::time::Instant::now(), answer.clone()));
            answer
        });
        making.await.ok()
    }
}

/// What the handlers share.
#[derive(Clone)]
pub struct Admin {
    pub ops: Ops,
    pub registry: Arc<Registry>,
    pub metrics: Arc<Metrics>,
    /// The relay's progress, for readiness.
    pub relay: Arc<RelayHealth>,
    token: Arc<str>,
    /// The dashboard's signed-in browsers.
    sessions: Arc<ui::Sessions>,
    /// The last `/metrics` answer, or why there is none.
    scrape: Arc<Recent<Result<String, String>>>,
    /// Whether the database answered `/health/ready`'s last check, or why not.
    database: Arc<Recent<Result<(), String>>>,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin").field("listen", &self.ops.settings().config.admin.listen).finish_non_exhaustive()
    }
}

impl Admin {
    /// The API's state; reads the bearer token (from `admin.token` or `admin.token_file`).
    pub fn new(
        settings: Arc<Live<Settings>>,
        store: Arc<dyn Store>,
        registry: Arc<Registry>,
        metrics: Arc<Metrics>,
        clock: Arc<dyn Clock>,
        wake: Arc<Notify>,
        relay: Arc<RelayHealth>,
    ) -> anyhow::Result<Admin> {
        let token = settings.get().config.admin.bearer_token().map_err(anyhow::Error::msg)?;
        let ops = Ops { settings, store, clock, wake: Some(wake), front: FrontEnd::Api };
        Ok(Admin {
            ops,
            registry,
            metrics,
            relay,
            token: token.into(),
            sessions: Default::default(),
            scrape: Default::default(),
            database: Default::default(),
        })
    }

    /// Every endpoint.
    pub fn router(self) -> Router {
        let public_metrics = self.ops.settings().config.admin.metrics_public;
        let protected = Router::new()
            .route("/v1/openapi.json", get(openapi))
            .route("/v1/stats", get(stats))
            .route("/v1/activity", get(activity))
            .route("/v1/events", post(enqueue))
            .route("/v1/events/{id}", get(show))
            .route("/v1/events/{id}/resend", post(resend_one))
            .route("/v1/events/{id}/cancel", post(cancel))
            .route("/v1/events/{id}/fail", post(fail))
            .route("/v1/events/{id}/reschedule", post(reschedule))
            .route("/v1/failed", get(failed_list))
            .route("/v1/failed/count", get(failed_count))
            .route("/v1/failed/summary", get(failed_summary))
            .route("/v1/failed/resend", post(failed_resend))
            .route("/v1/failed/purge", post(failed_purge))
            .route("/v1/plugins", get(plugins))
            .route("/v1/plugins/reload", post(plugins_reload))
            .route("/v1/routes", get(routes))
            .route("/v1/breakers", get(breakers))
            .route("/v1/breakers/{route}/open", post(breaker_open))
            .route("/v1/breakers/{route}/close", post(breaker_close))
            .route("/v1/endpoints", get(endpoints::list))
            .route("/v1/endpoints/{id}", get(endpoints::show).patch(endpoints::update).delete(endpoints::delete))
            .route("/v1/endpoints/{id}/enable", post(endpoints::enable))
            .route("/v1/endpoints/{id}/disable", post(endpoints::disable))
            .route("/v1/endpoints/{id}/rotate-secret", post(endpoints::rotate_secret))
            .route("/v1/routes/{route}/endpoints", get(endpoints::list_of_route).post(endpoints::create))
            .route("/ui/session/end", post(ui::sign_out));
        let (open, protected) = if public_metrics {
            (Router::new().route("/metrics", get(metrics)), protected)
        } else {
            (Router::new(), protected.route("/metrics", get(metrics)))
        };
        let protected = protected
            .route_layer(axum::middleware::from_fn_with_state(self.clone(), authorize))
            // Room for the largest payload ferry accepts, base64-encoded in JSON.
            .layer(axum::extract::DefaultBodyLimit::max(
                self.ops.settings().config.relay.max_payload.0 / 3 * 4 + (64 << 10),
            ));
        Router::new()
            .route("/health/live", get(live))
            .route("/health/ready", get(ready))
            .route("/ui", get(ui::page))
            .route("/ui/session", post(ui::sign_in))
            .route("/ui/app.js", get(ui::script))
            .route("/ui/app.css", get(ui::style))
            .route("/ui/icon.svg", get(ui::icon))
            .merge(open)
            .merge(protected)
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .with_state(self)
    }

    /// Binds the configured address (an error names it) and serves until `shutdown`. Returns the
    /// address bound (the port is chosen by the system for port 0) and the serving task.
    ///
    /// The API is reachable before any token is checked, so a client that connects and sends
    /// nothing (or half a request) must not hold the connection: each connection has
    /// `admin.header_timeout` to send its request's headers, and at most `admin.max_connections`
    /// are served at once; more are closed at once, so idle clients cannot use up the file
    /// descriptors the relay and the plugins need.
    pub async fn serve(self, shutdown: CancellationToken) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
        let address: SocketAddr =
            self.ops.settings().config.admin.address().ok_or_else(|| anyhow::anyhow!("admin.listen is not set"))?;
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .map_err(|e| anyhow::anyhow!("admin.listen: cannot listen on {address}: {e}"))?;
        let bound = listener.local_addr()?;
        tracing::info!(address = %bound, "admin API listening");
        let limits = &self.ops.settings().config.admin;
        let (max_connections, header_timeout) = (limits.max_connections as usize, limits.header_timeout.0);
        let service = hyper_util::service::TowerToHyperService::new(self.router());
        let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
        let task = tokio::spawn(async move {
            let mut refused_logged = None::<tokio::time::Instant>;
            loop {
                let (stream, peer) = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok(accepted) => accepted,
                        Err(e) => {
                            // Out of file descriptors, say: wait a little rather than spin.
                            tracing::warn!("admin API cannot accept a connection: {e}");
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                            continue;
                        }
                    },
                };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    if refused_logged.is_none_or(|at| at.elapsed() > std::time::Duration::from_secs(10)) {
                        tracing::warn!(%peer, "admin API has {max_connections} connections open (admin.max_connections); refusing more");
                        refused_logged = Some(tokio::time::Instant::now());
                    }
                    continue;
                };
                let (service, shutdown) = (service.clone(), shutdown.clone());
                // Every request learns its client's address (wrong tokens are counted per address).
                let service = hyper::service::service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
                    request.extensions_mut().insert(ui::Peer(peer));
                    hyper::service::Service::call(&service, request)
                });
                tokio::spawn(async move {
                    let _slot = slot;
                    let mut http = hyper::server::conn::http1::Builder::new();
                    http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(header_timeout);
                    let connection = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                    tokio::pin!(connection);
                    let served = tokio::select! {
                        served = connection.as_mut() => served,
                        _ = shutdown.cancelled() => {
                            connection.as_mut().graceful_shutdown();
                            connection.await
                        }
                    };
                    if let Err(e) = served {
                        tracing::debug!(%peer, "admin API connection ended: {e}");
                    }
                });
            }
        });
        Ok((bound, task))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::Recent;

    /// A hundred callers at once make one answer, and share it (a failure too).
    #[tokio::test]
    async fn callers_within_a_second_share_one_answer() {
        let recent = Recent::<Result<(), String>>::default();
        let made = Arc::new(AtomicUsize::new(0));
        let make = || {
            let made = made.clone();
            async move {
                made.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                Err("down".to_string())
            }
        };
        let answers = futures::future::join_all((0..100).map(|_| recent.get(Duration::from_secs(10), make()))).await;
        assert!(answers.iter().all(|a| a == &Some(Err("down".to_string()))), "{answers:?}");
        assert_eq!(made.load(Ordering::SeqCst), 1);
    }

    /// A caller that gives up while the answer is being made (a client that hung up) does not
    /// waste it: the next callers get it.
    #[tokio::test]
    async fn an_answer_outlives_the_caller_that_asked_for_it() {
        let recent = Recent::<u32>::default();
        let made = Arc::new(AtomicUsize::new(0));
        let make = |made: Arc<AtomicUsize>| async move {
            let n = made.fetch_add(1, Ordering::SeqCst) as u32;
            tokio::time::sleep(Duration::from_millis(100)).await;
            n
        };
        let gave_up =
            tokio::time::timeout(Duration::from_millis(10), recent.get(Duration::from_secs(10), make(made.clone())));
        assert!(gave_up.await.is_err());
        for _ in 0..10 {
            assert_eq!(recent.get(Duration::from_secs(10), make(made.clone())).await, Some(0));
        }
        assert_eq!(made.load(Ordering::SeqCst), 1);
    }
}
