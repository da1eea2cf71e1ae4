//! Outgoing wasi:http requests on pooled connections. wasmtime's default sender opens a new TCP
//! connection (and TLS session) for every request and closes it after the response; a webhook
//! transport sending a batch of 500 events then pays 500 handshakes. Here each plugin's requests
//! go through clients of its own (one per origin) that keep connections alive and reuse them
//! across requests, calls and instances, speak HTTP/2 when a TLS server offers it (ALPN), and
//! resume TLS sessions. The connections a plugin has open over all its origins are bounded by
//! `sandbox.NAME.http_open_connections` (`kept.rs`).
//!
//! What stays as it was: the origin allowlist is checked before a request reaches this module
//! (`sandbox.rs`), names are resolved by the host, and the request's timeouts apply.
//! What is new: a new connection's name lookup takes one of the plugin's lookup slots (`dns.rs`),
//! waiting for one within the 10 s a connection may take to open, and the connections to one host
//! share one lookup ([`Lookups`]): a plugin granted `*.domain` can name endless origins, and would
//! otherwise queue endless `getaddrinfo` calls on the host's blocking threads, while a host whose
//! name the resolver never answers holds one slot, not all of them. And each instance may have at
//! most `sandbox.NAME.http_connections` requests per origin
//! waiting for their answer; more wait for a slot. Slots are handed out in the order the plugin
//! made its requests (a [`Ticket`] is taken when the request is handed over, before the rest of
//! its body is written), and given back when the answer's head arrives: a plugin that writes its
//! bodies and reads its answers in the order it made the requests never waits on itself. A body
//! the plugin drops unread is read to its end here (if short, a bounded number at a time), so its
//! connection can serve the next request instead of being closed.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::Uri;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore, watch};
use wasmtime_wasi_http::{Error as HttpError, RequestOptions, WasiBody};

use super::kept::{Listing, Opened, Origins};

tokio::task_local! {
    /// Set while a request's own task drives its client. When another connection serves the
    /// request first, hyper-util finishes the connection it started for it in the background, in
    /// a task of its own, where this is not set: one still waiting for a permit then gives up its
    /// place, which no request needs, and the pool the connect holds on to. (hyper-util 0.1.21
    /// polls a request's connect in the request's own future everywhere else: its race with the
    /// pool, its wait after a cancelled checkout, its retries.)
    static REQUEST: ();
}

/// How long an idle connection is kept for the next request.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Idle connections kept per origin and plugin, at most; more are closed when they become idle.
const IDLE_PER_ORIGIN: usize = 64;
/// Connections a plugin may have open over all its origins when its sandbox sets no
/// `http_open_connections`.
pub const DEFAULT_OPEN_CONNECTIONS: u32 = 256;
/// The largest HTTP/1 response head (status line and headers) read from a server, as much as a
/// plugin's own header `fields` may hold: each response `fields` a plugin keeps holds on to the
/// buffer its head was read into, so heads of 400 KiB (hyper's own limit for HTTP/1) would let a
/// plugin keep far more of the host's memory than its limits count. A longer head fails the
/// request with `HTTP-response-header-section-size`. hyper's HTTP/2 client takes at most 16 KiB of
/// headers already.
const MAX_RESPONSE_HEAD: usize = 16 << 10;
/// How long opening a connection (TCP and TLS) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// wasmtime's timeouts when a request sets none of its own.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
/// Requests per origin one instance may have waiting for their answer, when the sandbox sets no
/// `http_connections`.
pub const DEFAULT_CONNECTIONS: u32 = 32;
/// Unread bodies read to their end at once, over all plugins; past that, one is dropped and its
/// connection closed.
const MAX_DRAINS: usize = 256;
/// The most of an unread body read after it is dropped, and how long that may take; a longer body
/// costs its connection instead.
const DRAIN_BYTES: usize = 64 << 10;
const DRAIN_TIME: Duration = Duration::from_secs(1);

/// The process's HTTP clients for plugins, by plugin (and extra CA file, and bound on open
/// connections).
pub(crate) struct HttpPool {
    clients: Mutex<HashMap<ClientKey, Arc<Clients>>>,
    /// The name lookups of each plugin's connections, whichever client makes them.
    lookups: Mutex<HashMap<Arc<str>, Arc<Lookups>>>,
    drains: Arc<Semaphore>,
}

/// A plugin, the CA file its sandbox trusts besides the public roots, whether it may reach
/// non-public addresses, and the connections it may have open.
type ClientKey = (Arc<str>, Option<PathBuf>, bool, u32);

/// One client, for one origin of one plugin.
type OriginClient = Client<Connector, WasiBody>;

/// A plugin's clients, one per origin, and what each new one is made with.
struct Clients {
    tls: tokio_rustls::TlsConnector,
    private: bool,
    lookups: Arc<Lookups>,
    idle_per_origin: usize,
    origins: Arc<Origins<OriginClient>>,
}

impl Clients {
    /// The client for `origin` (`scheme://host:port`), made if the origin is not listed (and its
    /// last client is not held by a request any more).
    fn client(&self, origin: &str) -> Arc<OriginClient> {
        self.origins.client(origin, |listing| {
            Client::builder(TokioExecutor::new())
                .pool_idle_timeout(IDLE_TIMEOUT)
                .pool_max_idle_per_host(self.idle_per_origin)
                .http1_max_buf_size(MAX_RESPONSE_HEAD)
                .pool_timer(TokioTimer::new())
                .timer(TokioTimer::new())
                .build(Connector {
                    tls: self.tls.clone(),
                    private: self.private,
                    lookups: self.lookups.clone(),
                    listing,
                })
        })
    }
}

impl std::fmt::Debug for HttpPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpPool").finish_non_exhaustive()
    }
}

impl HttpPool {
    pub(crate) fn new() -> HttpPool {
        HttpPool { clients: Mutex::default(), lookups: Mutex::default(), drains: Arc::new(Semaphore::new(MAX_DRAINS)) }
    }

    /// What sends `plugin`'s requests: clients of its own, so one plugin's connections (and, on
    /// HTTP/2, their streams and flow-control windows) are never another's. Servers are verified
    /// against the public (webpki) roots and, with `ca`, the certificates in that PEM file. The
    /// error names the file when it cannot be used. Without `private`, a host name that resolves
    /// only to non-public addresses ([`is_public`]) is not connected to. At most `open_limit`
    /// connections are open at once over all its origins (`kept.rs`).
    /// `lookup_slots` are the plugin's name lookup slots (`dns.rs`).
    pub(crate) fn sender(
        &self,
        plugin: &Arc<str>,
        ca: Option<&Path>,
        private: bool,
        open_limit: u32,
        lookup_slots: Arc<Semaphore>,
    ) -> Result<Sender, String> {
        let mut clients = self.clients.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let key = (plugin.clone(), ca.map(Path::to_path_buf), private, open_limit);
        let clients = match clients.get(&key) {
            Some(clients) => clients.clone(),
            None => {
                let open_limit = usize::try_from(open_limit).unwrap_or(usize::MAX).max(1);
                let made = Arc::new(Clients {
                    tls: tls_connector(ca)?,
                    private,
                    lookups: self.lookups_of(plugin, lookup_slots),
                    idle_per_origin: IDLE_PER_ORIGIN.min(open_limit),
                    origins: Origins::new(open_limit),
                });
                clients.insert(key, made.clone());
                made
            }
        };
        Ok(Sender { clients, drains: self.drains.clone() })
    }

    /// The lookups of `plugin`'s connections, in `slots` when they are new.
    fn lookups_of(&self, plugin: &Arc<str>, slots: Arc<Semaphore>) -> Arc<Lookups> {
        let mut lookups = self.lookups.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        lookups.entry(plugin.clone()).or_insert_with(|| Arc::new(Lookups::new(slots))).clone()
    }
}

/// TLS for one client: the public roots, those of `ca`, ALPN for HTTP/2 and HTTP/1.1, and
/// rustls's in-memory session cache (sessions are resumed).
fn tls_connector(ca: Option<&Path>) -> Result<tokio_rustls::TlsConnector, String> {
    let roots = super::tls::roots(ca)?;
    let mut tls = rustls::ClientConfig::builder().with_root_certificates(roots).with_no_client_auth();
    tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(tls)))
}

/// A place in the queue for one of an instance's slots for an origin, taken when the plugin hands
/// a request over (so in the order it made them), held until the answer's head arrives.
pub(crate) enum Ticket {
    Held(OwnedSemaphorePermit),
    Queued(Pin<Box<dyn Future<Output = Result<OwnedSemaphorePermit, AcquireError>> + Send>>),
    Closed,
}

impl Ticket {
    /// Joins the queue of `slots` now: the semaphore is fair, and a waiter's place is fixed by
    /// its first poll.
    pub(crate) fn take(slots: Arc<Semaphore>) -> Ticket {
        let mut wait = Box::pin(slots.acquire_owned());
        match wait.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(permit)) => Ticket::Held(permit),
            Poll::Ready(Err(_)) => Ticket::Closed,
            Poll::Pending => Ticket::Queued(wait),
        }
    }

    async fn redeem(self) -> Option<OwnedSemaphorePermit> {
        match self {
            Ticket::Held(permit) => Some(permit),
            Ticket::Queued(wait) => wait.await.ok(),
            Ticket::Closed => None,
        }
    }
}

/// One plugin's clients.
#[derive(Clone)]
pub(crate) struct Sender {
    clients: Arc<Clients>,
    drains: Arc<Semaphore>,
}

impl Sender {
    /// Sends `request` to `origin` (`scheme://host:port`, which the caller has checked against
    /// the plugin's allowlist) on a pooled connection once `ticket` gets its slot. Waiting for
    /// the slot is bounded by the request's connect timeout (`ConnectionLimitReached` when it
    /// runs out); connecting and the answer's head by its first-byte timeout plus the connect
    /// timeout (at most 10 s); each pause in the body by its between-bytes timeout.
    pub(crate) async fn send(
        self,
        origin: &str,
        ticket: Ticket,
        request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
    ) -> Result<http::Response<WasiBody>, HttpError> {
        let connect = options.and_then(|o| o.connect_timeout).unwrap_or(DEFAULT_TIMEOUT);
        let first_byte = options.and_then(|o| o.first_byte_timeout).unwrap_or(DEFAULT_TIMEOUT);
        // Tokio's interval panics on zero; a nanosecond is as good as none.
        let between_bytes =
            options.and_then(|o| o.between_bytes_timeout).unwrap_or(DEFAULT_TIMEOUT).max(Duration::from_nanos(1));
        let slot = tokio::time::timeout(connect, ticket.redeem()).await.ok().flatten();
        let Some(_slot) = slot else { return Err(HttpError::ConnectionLimitReached) };
        // Held until the answer's head arrives, which keeps it listed for its origin's next request
        // should the origin be unlisted meanwhile (`kept.rs`).
        let client = self.clients.client(origin);
        let head = tokio::time::timeout(
            first_byte.saturating_add(connect.min(CONNECT_TIMEOUT)),
            REQUEST.scope((), client.request(request)),
        );
        let response = head.await.map_err(|_| HttpError::ConnectionReadTimeout)?.map_err(|e| client_error(&e))?;
        let mut timeout = tokio::time::interval(between_bytes);
        timeout.reset();
        let drains = self.drains;
        let body = |incoming| ResponseBody { incoming: Some(incoming), timeout, drains };
        Ok(response.map(|incoming| http_body_util::BodyExt::boxed_unsync(body(incoming))))
    }
}

/// A response body that fails when the server pauses longer than the request's between-bytes
/// timeout. Dropped unread, it reads the rest (if short) so the connection can be reused.
struct ResponseBody {
    /// Taken by `drop`.
    incoming: Option<Incoming>,
    timeout: tokio::time::Interval,
    drains: Arc<Semaphore>,
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        let Some(mut incoming) = self.incoming.take().filter(|i| !i.is_end_stream()) else { return };
        // Too many drains at once: this one's connection is closed instead.
        let Ok(draining) = self.drains.clone().try_acquire_owned() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(async move {
            let _draining = draining;
            let drain = async {
                let mut read = 0;
                while read <= DRAIN_BYTES {
                    match http_body_util::BodyExt::frame(&mut incoming).await {
                        Some(Ok(frame)) => read += frame.data_ref().map_or(0, |d| d.len()),
                        _ => return,
                    }
                }
            };
            let _ = tokio::time::timeout(DRAIN_TIME, drain).await;
        });
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = HttpError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, HttpError>>> {
        let Some(incoming) = self.incoming.as_mut() else { return Poll::Ready(None) };
        match Pin::new(incoming).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                self.timeout.reset();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) if e.is_timeout() => Poll::Ready(Some(Err(HttpError::HttpResponseTimeout))),
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(HttpError::Hyper(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match self.timeout.poll_tick(cx) {
                Poll::Ready(_) => Poll::Ready(Some(Err(HttpError::ConnectionReadTimeout))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.incoming.as_ref().is_none_or(Incoming::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.incoming.as_ref().map_or_else(|| SizeHint::with_exact(0), Incoming::size_hint)
    }
}

/// The wasi:http error for a failed request, from what the client reports.
fn client_error(e: &hyper_util::client::legacy::Error) -> HttpError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(failed) = cause.downcast_ref::<ConnectError>() {
            return match failed {
                ConnectError::Timeout => HttpError::ConnectionTimeout,
                ConnectError::Refused => HttpError::ConnectionRefused,
                ConnectError::Io(e) => HttpError::Connect(io::Error::new(e.kind(), e.to_string())),
                ConnectError::Tls(e) => HttpError::Tls(io::Error::new(e.kind(), e.to_string())),
                ConnectError::Name(_) => HttpError::HttpRequestUriInvalid,
                ConnectError::Prohibited(_) => HttpError::DestinationIpProhibited,
                ConnectError::Limit | ConnectError::Unwanted => HttpError::ConnectionLimitReached,
            };
        }
        if let Some(e) = cause.downcast_ref::<hyper::Error>() {
            return if e.is_timeout() {
                HttpError::ConnectionReadTimeout
            } else if e.is_parse_too_large() {
                HttpError::HttpResponseHeaderSectionSize(Some(MAX_RESPONSE_HEAD as u32))
            } else if e.is_parse() || e.is_parse_status() {
                HttpError::HttpProtocolError
            } else if e.is_incomplete_message() || e.is_closed() || e.is_canceled() {
                HttpError::ConnectionTerminated
            } else {
                HttpError::InternalError(Some(e.to_string()))
            };
        }
        source = cause.source();
    }
    HttpError::InternalError(Some(e.to_string()))
}

/// Why a connection could not be opened.
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("connecting timed out")]
    Timeout,
    #[error("connection refused")]
    Refused,
    #[error("{0}")]
    Io(io::Error),
    #[error("TLS: {0}")]
    Tls(io::Error),
    #[error("not a host name TLS can verify: {0}")]
    Name(String),
    #[error("{0}")]
    Prohibited(String),
    #[error("the plugin has as many connections open as its sandbox's http_open_connections allows")]
    Limit,
    #[error("no request waits for this connection any more")]
    Unwanted,
}

/// Opens TCP connections, and TLS over them for `https`, for one origin's client.
#[derive(Clone)]
struct Connector {
    tls: tokio_rustls::TlsConnector,
    /// Whether a host name may lead to a non-public address.
    private: bool,
    /// The name lookups of its connections.
    lookups: Arc<Lookups>,
    /// Where its connections are counted.
    listing: Listing<OriginClient>,
}

/// A host's addresses (port 0), or why it has none, as every connection waiting for them gets it.
type Answer = Result<Vec<SocketAddr>, (io::ErrorKind, String)>;

/// The lookups listed, by host: what their connections wait on for the answer.
type Running = Arc<Mutex<HashMap<String, watch::Receiver<Option<Answer>>>>>;

fn listed(running: &Running) -> MutexGuard<'_, HashMap<String, watch::Receiver<Option<Answer>>>> {
    running.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The name lookups of one plugin's connections, made by all its clients (one per CA file and
/// `http_private`: a name's addresses do not depend on them). At most one is listed per host,
/// which every new connection to that host waits for, and each runs in one of the plugin's lookup
/// slots (`dns.rs`). A host whose lookup runs until the resolver gives up so costs one slot,
/// whatever the number of connections (or endpoints) waiting for it. A lookup is listed from when
/// a connection first asks for the host until it returns, or until that connection gives up while
/// it still waits for a slot: its request's end drops it, and so does the pool's 10 s bound on
/// opening a connection (hyper-util runs a connection it no longer needs to its end, within that
/// bound). Then the connections waiting on it ask again.
struct Lookups {
    slots: Arc<Semaphore>,
    running: Running,
}

/// The lookup of one host, held by the connection that listed it until it has a slot, then by
/// the blocking job that runs it. Dropped without answering (its connection gave up, or the
/// runtime shut down before the job ran), it is unlisted and its waiters learn it has gone.
struct Leader {
    host: String,
    running: Running,
    answers: watch::Receiver<Option<Answer>>,
    done: watch::Sender<Option<Answer>>,
}

impl Leader {
    fn answer(self, answer: Answer) {
        self.unlist();
        self.done.send_replace(Some(answer));
    }

    fn unlist(&self) {
        let mut running = listed(&self.running);
        if running.get(&self.host).is_some_and(|listed| listed.same_channel(&self.answers)) {
            running.remove(&self.host);
        }
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        self.unlist();
    }
}

impl Lookups {
    fn new(slots: Arc<Semaphore>) -> Lookups {
        Lookups { slots, running: Arc::default() }
    }

    /// The addresses of `host` (port 0), from the lookup listed for it or from a new one.
    async fn resolve(&self, host: &str) -> io::Result<Vec<SocketAddr>> {
        loop {
            let (mut answers, leader) = {
                let mut running = listed(&self.running);
                match running.get(host) {
                    Some(answers) => (answers.clone(), None),
                    None => {
                        let (done, answers) = watch::channel(None);
                        running.insert(host.to_string(), answers.clone());
                        let running = self.running.clone();
                        let leader = Leader { host: host.to_string(), running, answers: answers.clone(), done };
                        (answers, Some(leader))
                    }
                }
            };
            let leads = leader.is_some();
            if let Some(leader) = leader {
                let slot = self.slots.clone().acquire_owned().await.map_err(io::Error::other)?;
                let answer = move |addresses: io::Result<Vec<SocketAddr>>| {
                    leader.answer(addresses.map_err(|e| (e.kind(), e.to_string())));
                };
                drop(super::dns::resolve(slot, host.to_string(), answer));
            }
            let answered = answers.wait_for(Option::is_some).await;
            match answered.as_deref() {
                Ok(Some(Ok(addresses))) => return Ok(addresses.clone()),
                Ok(Some(Err((kind, why)))) => return Err(io::Error::new(*kind, why.clone())),
                // This connection's own lookup was never run (the runtime is shutting down).
                _ if leads => return Err(io::Error::other("the name lookup could not be run")),
                // The connection that listed it gave up: ask again.
                _ => continue,
            }
        }
    }
}

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<Stream>;
    type Error = ConnectError;
    type Future = Pin<Box<dyn Future<Output = Result<TokioIo<Stream>, ConnectError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ConnectError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (tls, private, lookups, listing) =
            (self.tls.clone(), self.private, self.lookups.clone(), self.listing.clone());
        Box::pin(async move {
            let https = uri.scheme() == Some(&http::uri::Scheme::HTTPS);
            let host = uri.host().unwrap_or_default().trim_start_matches('[').trim_end_matches(']').to_string();
            let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
            // The plugin's connections are bounded: a permit first (`kept.rs`), waited for only
            // while its request waits for this connection ([`REQUEST`]). Waiting for it counts in
            // the time a connection may take to open.
            let started = tokio::time::Instant::now();
            let mut permit = std::pin::pin!(listing.open(CONNECT_TIMEOUT));
            let wanted = std::future::poll_fn(|cx| match REQUEST.try_with(|()| ()) {
                Ok(()) => permit.as_mut().poll(cx).map(|opened| opened.ok_or(ConnectError::Limit)),
                Err(_) => Poll::Ready(Err(ConnectError::Unwanted)),
            });
            let counted = wanted.await?;
            let open = async {
                let addresses = addresses(&host, port, private, &lookups).await?;
                let tcp = TcpStream::connect(addresses.as_slice()).await.map_err(|e| match e.kind() {
                    io::ErrorKind::ConnectionRefused => ConnectError::Refused,
                    _ => ConnectError::Io(e),
                })?;
                let _ = tcp.set_nodelay(true);
                if !https {
                    return Ok(Io::Plain(tcp));
                }
                let name = rustls::pki_types::ServerName::try_from(host.clone())
                    .map_err(|e| ConnectError::Name(format!("{host}: {e}")))?;
                let stream = tls.connect(name, tcp).await.map_err(ConnectError::Tls)?;
                Ok(Io::Tls(Box::new(stream)))
            };
            let left = CONNECT_TIMEOUT.saturating_sub(started.elapsed());
            let io = tokio::time::timeout(left, open).await.map_err(|_| ConnectError::Timeout)??;
            Ok(TokioIo::new(Stream { io, _counted: counted }))
        })
    }
}

/// Where a connection to `host` may go. An IP address is taken as it is: the allowlist named it.
/// A host name is resolved now, for this connection (so a DNS answer that changes later is
/// checked again) by `lookups`, and its non-public addresses are left out, unless `private` allows
/// them, which never allows link-local and cloud metadata addresses ([`is_metadata`]). If none is
/// left the connection is refused, naming the addresses and what would allow them.
async fn addresses(host: &str, port: u16, private: bool, lookups: &Lookups) -> Result<Vec<SocketAddr>, ConnectError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let resolved = lookups.resolve(host).await.map_err(ConnectError::Io)?;
    let resolved = resolved.into_iter().map(|mut address| {
        address.set_port(port);
        address
    });
    let (allowed, refused): (Vec<SocketAddr>, Vec<SocketAddr>) =
        resolved.partition(|a| !is_metadata(a.ip()) && (private || is_public(a.ip())));
    if !allowed.is_empty() {
        return Ok(allowed);
    }
    let refused: Vec<String> = refused.iter().map(|a| a.ip().to_string()).collect();
    Err(ConnectError::Prohibited(match private {
        false => format!(
            "{host} resolves to non-public addresses only ({}); requests to loopback, private, link-local and \
             metadata addresses need the plugin's sandbox http_private = true",
            refused.join(", ")
        ),
        true => format!(
            "{host} resolves to link-local or cloud metadata addresses only ({}), which a host name never \
             leads to; list the address itself in the plugin's sandbox http if it is meant to be reached",
            refused.join(", ")
        ),
    }))
}

/// Whether `ip` is where cloud instance metadata (credentials among it) is served, or link-local
/// IPv4 (169.254.0.0/16, where most clouds serve it): AWS's IPv6 `fd00:ec2::254`, Alibaba's
/// `100.100.100.200` and Azure's `168.63.129.16` besides.
pub(crate) fn is_metadata(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local() || [[100, 100, 100, 200], [168, 63, 129, 16]].contains(&v4.octets()),
        IpAddr::V6(v6) => {
            embedded_v4(v6).is_some_and(|v4| is_metadata(IpAddr::V4(v4)))
                || v6.segments() == [0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254]
        }
    }
}

/// The IPv4 address inside an IPv6 one that carries one: mapped (`::ffff:a.b.c.d`), compatible
/// (`::a.b.c.d`) and NAT64 (`64:ff9b::a.b.c.d`) addresses end in it, 6to4 (`2002::/16`) ones
/// carry it after their prefix.
fn embedded_v4(v6: std::net::Ipv6Addr) -> Option<std::net::Ipv4Addr> {
    let segments = v6.segments();
    let v4 = |high: u16, low: u16| std::net::Ipv4Addr::from((u32::from(high) << 16) | u32::from(low));
    if let Some(v4) = v6.to_ipv4_mapped() {
        return Some(v4);
    }
    if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || segments[..6] == [0; 6] {
        return Some(v4(segments[6], segments[7]));
    }
    (segments[0] == 0x2002).then(|| v4(segments[1], segments[2]))
}

/// Whether `ip` is an address on the public internet: not loopback, private (RFC 1918, unique
/// local), link-local (where cloud metadata services answer), shared (CGNAT), unspecified,
/// broadcast, multicast, documentation, benchmarking or discard space, local-use NAT64. IPv4
/// addresses inside IPv6 ones (mapped, compatible, NAT64, 6to4) are judged as IPv4.
pub(crate) fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b))
                || (a == 192 && b == 0 && c == 0)
                || (a == 198 && (18..20).contains(&b))
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            // `::` and `::1` are judged as 0.0.0.0 and 0.0.0.1, in 0.0.0.0/8: not public.
            if let Some(v4) = embedded_v4(v6) {
                return is_public(IpAddr::V4(v4));
            }
            let segments = v6.segments();
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (segments[0] & 0xfe00) == 0xfc00
                || (segments[0] & 0xffc0) == 0xfe80
                || (segments[0] & 0xffc0) == 0xfec0
                || segments[..3] == [0x64, 0xff9b, 1]
                || segments[..4] == [0x100, 0, 0, 0]
                || (segments[0] == 0x2001 && segments[1] == 0x0db8))
        }
    }
}

/// A pooled connection, counted among its plugin's kept connections while it is open.
struct Stream {
    io: Io,
    _counted: Opened<OriginClient>,
}

/// Plain TCP, or TLS over it.
enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        match &self.io {
            Io::Plain(_) => Connected::new(),
            Io::Tls(tls) if tls.get_ref().1.alpn_protocol() == Some(b"h2") => Connected::new().negotiated_h2(),
            Io::Tls(_) => Connected::new(),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_addresses_on_the_public_internet_are_public() {
        let public = |text: &str| is_public(text.parse().unwrap());
        for address in
            ["93.184.215.14", "8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"]
        {
            assert!(public(address), "{address}");
        }
        for address in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "0.1.2.3",
            "255.255.255.255",
            "224.0.0.1",
            "192.0.2.1",
            "198.18.0.1",
            "::1",
            "::",
            "fc00::1",
            "fd00:ec2::254",
            "fe80::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "::127.0.0.1",
            "2001:db8::1",
            "2002:7f00:1::1",
            "2002:a9fe:a9fe::1",
            "fec0::1",
            "64:ff9b:1::a00:1",
            "100::1",
        ] {
            assert!(!public(address), "{address}");
        }
    }

    /// Connections to one host wait for one lookup, in one slot: here 20 of them while the
    /// blocking thread is busy, so the lookup cannot return before all have joined it.
    #[test]
    fn connections_to_one_host_share_one_lookup() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let slots = Arc::new(Semaphore::new(crate::plugins::dns::LOOKUPS_PER_PLUGIN));
            let lookups = Arc::new(Lookups::new(slots.clone()));
            let (release, wait) = std::sync::mpsc::channel::<()>();
            let busy = tokio::task::spawn_blocking(move || wait.recv_timeout(Duration::from_secs(10)));
            let connections: Vec<_> = (0..20)
                .map(|_| {
                    let lookups = lookups.clone();
                    tokio::spawn(async move { lookups.resolve("localhost").await.map_err(|e| e.to_string()) })
                })
                .collect();
            while listed(&lookups.running).is_empty() {
                tokio::task::yield_now().await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(slots.available_permits(), crate::plugins::dns::LOOKUPS_PER_PLUGIN - 1, "one slot taken");
            release.send(()).unwrap();
            busy.await.unwrap().unwrap();
            for connection in connections {
                let addresses = connection.await.unwrap().unwrap();
                assert!(addresses.iter().any(|a| a.ip().is_loopback()), "{addresses:?}");
            }
            assert!(listed(&lookups.running).is_empty(), "the lookup is listed only while it runs");
            assert_eq!(slots.available_permits(), crate::plugins::dns::LOOKUPS_PER_PLUGIN);
        });
    }

    /// A plugin's clients (here with and without `http_private`) share its lookups; another
    /// plugin's are its own.
    #[tokio::test]
    async fn a_plugins_clients_share_its_lookups() {
        let pool = HttpPool::new();
        let slots = || Arc::new(Semaphore::new(1));
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        pool.sender(&a, None, false, 8, slots()).unwrap();
        pool.sender(&a, None, true, 8, slots()).unwrap();
        pool.sender(&b, None, false, 8, slots()).unwrap();
        assert_eq!(pool.clients.lock().unwrap().len(), 3);
        let lookups = pool.lookups.lock().unwrap();
        assert_eq!(lookups.len(), 2, "one per plugin");
        assert!(!Arc::ptr_eq(&lookups[&a], &lookups[&b]));
    }

    /// With every slot taken, connections to one host wait on the lookup the first one listed;
    /// when that one gives up, the others ask again, and one of them runs it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lookup_whose_connection_gave_up_is_asked_again() {
        let slots = Arc::new(Semaphore::new(2));
        let taken = slots.clone().acquire_many_owned(2).await.unwrap();
        let lookups = Arc::new(Lookups::new(slots.clone()));
        let connect = || {
            let lookups = lookups.clone();
            tokio::spawn(async move { lookups.resolve("localhost").await.map_err(|e| e.to_string()) })
        };
        let first = connect();
        while listed(&lookups.running).is_empty() {
            tokio::task::yield_now().await;
        }
        let others: Vec<_> = (0..19).map(|_| connect()).collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(listed(&lookups.running).len(), 1, "one lookup listed for the host");
        first.abort();
        assert!(first.await.unwrap_err().is_cancelled());
        drop(taken);
        for other in others {
            let addresses = other.await.unwrap().unwrap();
            assert!(addresses.iter().any(|a| a.ip().is_loopback()), "{addresses:?}");
        }
        assert!(listed(&lookups.running).is_empty());
        assert_eq!(slots.available_permits(), 2);
    }

    #[tokio::test]
    async fn host_names_that_lead_to_private_addresses_are_refused_unless_allowed() {
        let lookups = Lookups::new(Arc::new(Semaphore::new(1)));
        let refused = addresses("localhost", 80, false, &lookups).await.unwrap_err().to_string();
        assert!(
            refused.contains("localhost resolves to non-public addresses only (127.0.0.1")
                && refused.contains("http_private = true"),
            "{refused}"
        );
        assert!(addresses("localhost", 80, true, &lookups).await.unwrap().iter().all(|a| a.ip().is_loopback()));
        for metadata in [
            "169.254.169.254",
            "169.254.0.1",
            "100.100.100.200",
            "168.63.129.16",
            "fd00:ec2::254",
            "::ffff:169.254.169.254",
            // The same address inside compatible, NAT64 and 6to4 ones.
            "::a9fe:a9fe",
            "64:ff9b::a9fe:a9fe",
            "2002:a9fe:a9fe::",
        ] {
            assert!(is_metadata(metadata.parse().unwrap()), "{metadata}");
        }
        for other in ["127.0.0.1", "10.0.0.1", "fd00:ec2::253", "8.8.8.8"] {
            assert!(!is_metadata(other.parse().unwrap()), "{other}");
        }
        let named = addresses("127.0.0.1", 80, false, &lookups).await.unwrap();
        assert_eq!(
            named,
            [SocketAddr::from(([127, 0, 0, 1], 80))],
            "an address named by the allowlist is taken as it is"
        );
    }
}
