//! The web dashboard under `/ui`: a sign-in form that trades the admin token for a session
//! cookie, and one page (HTML, CSS and script compiled into the binary, no CDN) that draws itself
//! from the JSON API with that cookie.
//!
//! The token never travels in a URL and never reaches the page's script: the form posts it once,
//! and the answer sets `ferry_session` (random, HttpOnly, SameSite=Strict). The API accepts that
//! cookie in place of the bearer token, but a request that changes something must also carry the
//! session's CSRF token in `X-Ferry-CSRF`, which only a page served by ferry to that session
//! knows (it is written into the page's HTML). Sessions live in this process's memory: a restart,
//! or another instance behind a load balancer, asks to sign in again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use rand::Rng as _;
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use super::Admin;
use super::extract::{ApiError, constant_time_eq};

/// The session cookie's name.
pub(super) const COOKIE: &str = "ferry_session";

/// The header a cookie-authenticated request that changes something must carry.
pub(super) const CSRF_HEADER: &str = "x-ferry-csrf";

/// How long a session lasts from sign-in.
const LIFETIME: Duration = Duration::from_secs(12 * 3600);

/// Sessions kept at once; signing in beyond this ends the oldest.
const MAX_SESSIONS: usize = 256;

/// How long a wrong token is answered after. Sign-ins are checked one at a time, so this bounds
/// guessing to a few tries a second per instance, whatever the number of connections.
const WRONG_TOKEN_DELAY: Duration = Duration::from_millis(500);

const APP_HTML: &str = include_str!("ui/app.html");
const SIGN_IN_HTML: &str = include_str!("ui/sign-in.html");
const APP_JS: &str = include_str!("ui/app.js");
const APP_CSS: &str = include_str!("ui/app.css");
const ICON_SVG: &str = include_str!("ui/icon.svg");

/// What a page may load and do: only ferry's own script and style, no frames, no plugins, forms
/// only to ferry.
const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
     connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

#[derive(Debug)]
struct Session {
    csrf: String,
    expires: Instant,
}

/// The signed-in sessions, by the SHA-256 of their cookie (so the map's lookups reveal nothing
/// about a cookie's value).
#[derive(Debug, Default)]
pub(super) struct Sessions {
    by_hash: Mutex<HashMap<[u8; 32], Session>>,
    /// Held while a sign-in's token is checked (and, when wrong, for [`WRONG_TOKEN_DELAY`]).
    sign_in: tokio::sync::Mutex<()>,
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
        let (cookie, csrf) = (random_hex(), random_hex());
        let mut sessions = self.by_hash.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        sessions.retain(|_, s| s.expires > now);
        if sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions.iter().min_by_key(|(_, s)| s.expires).map(|(k, _)| *k)
        {
            sessions.remove(&oldest);
        }
        sessions.insert(hash(&cookie), Session { csrf: csrf.clone(), expires: now + LIFETIME });
        (cookie, csrf)
    }

    /// The CSRF token of the live session `cookie` names.
    pub(super) fn csrf(&self, cookie: &str) -> Option<String> {
        let sessions = self.by_hash.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        sessions.get(&hash(cookie)).filter(|s| s.expires > Instant::now()).map(|s| s.csrf.clone())
    }

    fn end(&self, cookie: &str) {
        self.by_hash.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).remove(&hash(cookie));
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

/// How the API's check treats a request carrying a session cookie and no bearer token: allowed,
/// or the error to answer.
pub(super) fn check_session(admin: &Admin, request: &Request, cookie: &str) -> Result<(), ApiError> {
    let Some(csrf) = admin.sessions.csrf(cookie) else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "the dashboard session has ended (signed out, expired after 12 hours, or ferry restarted): sign in again at /ui",
        ));
    };
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return Ok(());
    }
    let given = request.headers().get(CSRF_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
    if constant_time_eq(given.as_bytes(), csrf.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "a request authenticated by the dashboard's cookie must carry the session's X-Ferry-CSRF header \
             (scripts should send \"Authorization: Bearer <admin token>\" instead)",
        ))
    }
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
    let cache = if cache { "private, max-age=300" } else { "no-store" };
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static(cache));
    response
}

fn html(status: StatusCode, body: String) -> Response {
    guarded((status, [(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response(), false)
}

fn sign_in_page(status: StatusCode, message: &str) -> Response {
    html(status, SIGN_IN_HTML.replace("{{message}}", message))
}

/// `GET /ui`: the dashboard for a signed-in browser, the sign-in form otherwise.
pub(super) async fn page(State(admin): State<Admin>, headers: HeaderMap) -> Response {
    match session_cookie(&headers).and_then(|cookie| admin.sessions.csrf(cookie)) {
        // The CSRF token is hex, so it needs no escaping in the attribute.
        Some(csrf) => html(StatusCode::OK, APP_HTML.replace("{{csrf}}", &csrf)),
        None => sign_in_page(StatusCode::OK, ""),
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

/// `POST /ui/session`: trades the admin token, posted by the sign-in form, for a session cookie.
pub(super) async fn sign_in(State(admin): State<Admin>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    if from_elsewhere(&headers) {
        return sign_in_page(StatusCode::FORBIDDEN, "Sign-in refused: the form was posted from another site.");
    }
    let form: Option<SignIn> = serde_urlencoded::from_bytes(&body).ok();
    let Some(SignIn { token }) = form else {
        return sign_in_page(StatusCode::BAD_REQUEST, "Enter the admin token (admin.token or admin.token_file).");
    };
    let _one_at_a_time = admin.sessions.sign_in.lock().await;
    if !constant_time_eq(token.trim().as_bytes(), admin.token.as_bytes()) {
        tokio::time::sleep(WRONG_TOKEN_DELAY).await;
        tracing::warn!("dashboard sign-in with a wrong token");
        return sign_in_page(
            StatusCode::UNAUTHORIZED,
            "Wrong token. Use the admin.token (or admin.token_file) of this ferry.",
        );
    }
    let (cookie, _) = admin.sessions.start();
    let mut response = Redirect::to("/ui").into_response();
    let set = format!("{COOKIE}={cookie}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}", LIFETIME.as_secs());
    response.headers_mut().insert(header::SET_COOKIE, HeaderValue::from_str(&set).expect("hex and ASCII"));
    guarded(response, false)
}

/// `POST /ui/session/end`: signs out (behind the API's check, so it needs the CSRF header).
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
