//! The web dashboard under `/ui`: a sign-in form that trades the admin token for a session, and
//! one page (HTML, CSS and script compiled into the binary, no CDN) that draws itself from the
//! JSON API.
//!
//! A session is two secrets, and the API wants both. The cookie `ferry_session` (random,
//! HttpOnly, SameSite=Strict) is out of the page's script's reach. The session key is handed out
//! once, in the answer to the sign-in, and kept by the script in the origin's `localStorage`; every
//! API request from the page carries it in `X-Ferry-Session`. Browsers send cookies to every port
//! of a host name, so another web service on the same host receives the cookie, but not the key,
//! which `localStorage` keeps per origin (port included); a page of another site can make the
//! browser send the cookie, but cannot add the header. The admin token never travels in a URL and
//! never reaches the script. Sessions live in this process's memory: a restart, or another
//! instance behind a load balancer, asks to sign in again.
//!
//! Sign-ins are counted per client address (IPv6 per /64): after [`MAX_FAILURES`] wrong ones in
//! [`FAILURE_WINDOW`], that address's sign-ins are answered 429 until the window ends, at once, so
//! nobody waits in line holding a connection. Only the form is limited: bearer-token clients
//! (scripts, Prometheus) behind the same address as a guesser are never locked out, and a token
//! of at least 16 characters (better: 32 random bytes) is what makes guessing it hopeless.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use rand::Rng as _;
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use super::Admin;
use super::extract::{ApiError, constant_time_eq};

/// The session cookie's name.
pub(super) const COOKIE: &str = "ferry_session";

/// The header every cookie-authenticated request must carry: the session key.
pub(super) const KEY_HEADER: &str = "x-ferry-session";

/// How long a session lasts from sign-in.
const LIFETIME: Duration = Duration::from_secs(12 * 3600);

/// Sessions kept at once; signing in beyond this ends the oldest.
const MAX_SESSIONS: usize = 256;

/// Sign-ins with a wrong token one client address may make in [`FAILURE_WINDOW`] before its
/// sign-ins are refused.
const MAX_FAILURES: u32 = 10;

/// See [`MAX_FAILURES`].
const FAILURE_WINDOW: Duration = Duration::from_secs(60);

/// Client addresses whose failures are remembered; past this, the one tracked longest is forgotten.
const MAX_TRACKED: usize = 4096;

/// Largest sign-in form accepted.
const MAX_FORM: usize = 4096;

const APP_HTML: &str = include_str!("ui/app.html");
const SIGN_IN_HTML: &str = include_str!("ui/sign-in.html");
const SIGNED_IN_HTML: &str = include_str!("ui/signed-in.html");
const APP_JS: &str = include_str!("ui/app.js");
const APP_CSS: &str = include_str!("ui/app.css");
const ICON_SVG: &str = include_str!("ui/icon.svg");

/// What a page may load and do: only ferry's own script and style, no frames, no plugins, forms
/// only to ferry.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
     connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// The client address of a request, put in its extensions by the server loop.
#[derive(Debug, Clone, Copy)]
pub(super) struct Peer(pub(super) SocketAddr);

fn peer_ip(request_extensions: &axum::http::Extensions) -> IpAddr {
    request_extensions.get::<Peer>().map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |p| p.0.ip())
}

#[derive(Debug)]
struct Session {
    key: String,
    expires: Instant,
}

/// The signed-in sessions, by the SHA-256 of their cookie (so the map's lookups reveal nothing
/// about a cookie's value), and the sign-ins per client address.
#[derive(Debug, Default)]
pub(super) struct Sessions {
    by_hash: Mutex<HashMap<[u8; 32], Session>>,
    failures: Mutex<HashMap<IpAddr, (Instant, u32)>>,
}

fn random_hex() -> String {
    let bits: [u8; 32] = rand::rng().random();
    hex::encode(bits)
}

fn hash(cookie: &str) -> [u8; 32] {
    Sha256::digest(cookie.as_bytes()).into()
}

impl Sessions {
    fn start(&self) -> (String, String) {
        let (cookie, key) = (random_hex(), random_hex());
        let mut sessions = self.by_hash.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        sessions.retain(|_, s| s.expires > now);
        if sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions.iter().min_by_key(|(_, s)| s.expires).map(|(k, _)| *k)
        {
            sessions.remove(&oldest);
        }
        sessions.insert(hash(&cookie), Session { key: key.clone(), expires: now + LIFETIME });
        (cookie, key)
    }

    /// Whether `cookie` names a live session whose key is `key`.
    fn holds(&self, cookie: &str, key: &str) -> bool {
        let sessions = self.by_hash.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        sessions
            .get(&hash(cookie))
            .is_some_and(|s| s.expires > Instant::now() && constant_time_eq(key.as_bytes(), s.key.as_bytes()))
    }

    fn live(&self, cookie: &str) -> bool {
        let sessions = self.by_hash.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        sessions.get(&hash(cookie)).is_some_and(|s| s.expires > Instant::now())
    }

    fn end(&self, cookie: &str) {
        self.by_hash.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).remove(&hash(cookie));
    }

    /// Takes one sign-in attempt for `ip`, checked and counted in one step (so concurrent
    /// attempts cannot all pass a check made before any was counted); `Err` says how long until
    /// the address may try again. A correct token gives its attempt back ([`Sessions::succeeded`]).
    fn attempt(&self, ip: IpAddr) -> Result<(), Duration> {
        let key = limiter_key(ip);
        let mut failures = self.failures.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if !failures.contains_key(&key) && failures.len() >= MAX_TRACKED {
            failures.retain(|_, (since, _)| since.elapsed() < FAILURE_WINDOW);
            // Still full: forget the address tracked longest, rather than pool new ones (which
            // would let many addresses lock out everyone who never mistyped).
            if failures.len() >= MAX_TRACKED
                && let Some(oldest) = failures.iter().min_by_key(|(_, (since, _))| *since).map(|(k, _)| *k)
            {
                failures.remove(&oldest);
            }
        }
        let entry = failures.entry(key).or_insert((Instant::now(), 0));
        if entry.0.elapsed() >= FAILURE_WINDOW {
            *entry = (Instant::now(), 0);
        }
        if entry.1 >= MAX_FAILURES {
            return Err(FAILURE_WINDOW.saturating_sub(entry.0.elapsed()));
        }
        entry.1 += 1;
        if entry.1 == MAX_FAILURES {
            tracing::warn!(address = %key, "dashboard sign-in: {MAX_FAILURES} attempts within a minute from one address; refusing it until the minute ends");
        }
        Ok(())
    }

    /// Gives back the attempt of a sign-in that had the right token.
    fn succeeded(&self, ip: IpAddr) {
        let mut failures = self.failures.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(entry) = failures.get_mut(&limiter_key(ip)) {
            entry.1 = entry.1.saturating_sub(1);
        }
    }
}

/// The key an address is counted under: IPv4 (also when mapped into IPv6) as it is, IPv6 by its
/// /64, the block one host usually holds.
fn limiter_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(std::net::Ipv6Addr::from(bits))
        }
        v4 => v4,
    }
}

/// The value of the session cookie in a request, if any.
pub(super) fn session_cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.trim())
}

/// How the API's check treats a request carrying a session cookie and no bearer token: allowed
/// when it also carries the session's key, whatever its method.
pub(super) fn check_session(admin: &Admin, request: &Request, cookie: &str) -> Result<(), ApiError> {
    let key = request.headers().get(KEY_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
    if admin.sessions.holds(cookie, key) {
        return Ok(());
    }
    let message = if !admin.sessions.live(cookie) {
        "the dashboard session has ended (signed out, expired after 12 hours, or ferry restarted): sign in again at /ui"
    } else {
        "the dashboard's cookie works only with the session key the dashboard page sends in X-Ferry-Session \
         (scripts should send \"Authorization: Bearer <admin token>\" instead)"
    };
    Err(ApiError::new(StatusCode::UNAUTHORIZED, message))
}

/// Headers every dashboard answer carries: no framing, no sniffing, no caching, no referrer to
/// other sites (`same-origin`: with `no-referrer`, browsers send `Origin: null` on the sign-in
/// post, which [`from_elsewhere`] must refuse).
fn guarded(mut response: Response, cache: bool) -> Response {
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    // The assets change with ferry's version and the page is `no-store`: revalidate each time.
    let cache = if cache { "no-cache" } else { "no-store" };
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    response
}

fn html(status: StatusCode, body: String) -> Response {
    guarded((status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response(), false)
}

fn sign_in_page(status: StatusCode, message: &str) -> Response {
    html(status, SIGN_IN_HTML.replace("{{message}}", message))
}

/// `GET /ui`: the dashboard's page for a browser with a live session cookie (the page asks for
/// the sign-in again when its origin holds no session key), the sign-in form otherwise.
pub(super) async fn page(State(admin): State<Admin>, headers: HeaderMap) -> Response {
    match session_cookie(&headers).is_some_and(|cookie| admin.sessions.live(cookie)) {
        true => html(StatusCode::OK, APP_HTML.to_string()),
        false => sign_in_page(StatusCode::OK, ""),
    }
}

#[derive(Debug, Deserialize)]
pub(super) struct SignIn {
    token: String,
}

/// Whether a browser says the request comes from another site. Browsers send `Origin` with every
/// form post and `Sec-Fetch-Site` with every request; other clients send neither, and are not a
/// cross-site threat.
fn from_elsewhere(headers: &HeaderMap) -> bool {
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let origin_elsewhere = headers
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|origin| origin.split_once("://").map(|(_, authority)| authority) != host);
    let fetch_elsewhere = headers
        .get("sec-fetch-site")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|site| site != "same-origin" && site != "none");
    origin_elsewhere || fetch_elsewhere
}

/// `POST /ui/session`: trades the admin token, posted by the sign-in form, for a session: the
/// cookie, and a page holding the key, which its script stores before going on to `/ui`.
pub(super) async fn sign_in(State(admin): State<Admin>, request: Request) -> Response {
    let ip = peer_ip(request.extensions());
    if from_elsewhere(request.headers()) {
        return sign_in_page(StatusCode::FORBIDDEN, "Sign-in refused: the form was posted from another site.");
    }
    // This is the one public endpoint with a body: it gets as long as the headers had, and little
    // room, so a client trickling a body cannot hold a connection.
    let within = admin.ops.settings().config.admin.header_timeout.0;
    let body = match tokio::time::timeout(within, axum::body::to_bytes(request.into_body(), MAX_FORM)).await {
        Ok(Ok(body)) => body,
        Ok(Err(_)) => return sign_in_page(StatusCode::PAYLOAD_TOO_LARGE, "The sign-in form was too large."),
        Err(_) => return sign_in_page(StatusCode::REQUEST_TIMEOUT, "The sign-in form took too long to arrive."),
    };
    let Ok(SignIn { token }) = serde_urlencoded::from_bytes::<SignIn>(&body) else {
        return sign_in_page(StatusCode::BAD_REQUEST, "Enter the admin token (admin.token or admin.token_file).");
    };
    if let Err(wait) = admin.sessions.attempt(ip) {
        let seconds = wait.as_secs() + 1;
        let message =
            format!("Too many sign-ins from this address ({MAX_FAILURES} a minute). Try again in {seconds} s.");
        let mut response = sign_in_page(StatusCode::TOO_MANY_REQUESTS, &message);
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        return response;
    }
    if !constant_time_eq(token.trim().as_bytes(), admin.token.as_bytes()) {
        tracing::warn!(%ip, "dashboard sign-in with a wrong token");
        return sign_in_page(
            StatusCode::UNAUTHORIZED,
            "Wrong token. Use the admin.token (or admin.token_file) of this ferry.",
        );
    }
    admin.sessions.succeeded(ip);
    let (cookie, key) = admin.sessions.start();
    // The key is hex, so it needs no escaping in the attribute.
    let mut response = html(StatusCode::OK, SIGNED_IN_HTML.replace("{{key}}", &key));
    let set = format!("{COOKIE}={cookie}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}", LIFETIME.as_secs());
    response.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_str(&set).expect("hex and ASCII"));
    response
}

/// `POST /ui/session/end`: signs out (behind the API's check, so it needs the session key).
pub(super) async fn sign_out(State(admin): State<Admin>, headers: HeaderMap) -> Response {
    if let Some(cookie) = session_cookie(&headers) {
        admin.sessions.end(cookie);
    }
    let mut response = StatusCode::NO_CONTENT.into_response();
    let clear = format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0");
    response.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_str(&clear).expect("ASCII"));
    guarded(response, false)
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    guarded(([(header::CONTENT_TYPE, content_type)], body).into_response(), true)
}

pub(super) async fn script() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

pub(super) async fn style() -> Response {
    asset("text/css; charset=utf-8", APP_CSS)
}

pub(super) async fn icon() -> Response {
    asset("image/svg+xml", ICON_SVG)
}
