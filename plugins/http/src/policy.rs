//! The pure parts of the webhook transport: configuration, signing and the mapping from an HTTP
//! answer to an outcome. No I/O here, so it is unit-tested natively.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// How one answer is judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Success,
    /// Retry later; the receiver may have asked for a delay (milliseconds).
    Transient {
        reason: String,
        retry_after_ms: Option<u64>,
    },
    Permanent {
        reason: String,
    },
    /// 400, 413 or 422: permanent too, but an answer about the body, so for a batched request
    /// perhaps about one event in it (or its size) rather than all of them.
    Refused {
        reason: String,
    },
    /// HTTP 429: the receiver is up but asks to slow down, perhaps with a delay (milliseconds).
    RateLimited {
        reason: String,
        retry_after_ms: Option<u64>,
    },
}

/// Longest response-body excerpt kept in a failure reason.
pub const BODY_EXCERPT: usize = 200;

/// Whether a request sets header `name` itself, so that neither the event nor the route's
/// `header.NAME` may give it: the body's type and length, the Standard Webhooks headers, and with
/// `binary` CloudEvents the `ce-` attributes. A second `webhook-signature` or `content-length`
/// would leave the receiver to pick one.
pub fn set_by_request(name: &str, binary: bool) -> bool {
    let name = name.to_ascii_lowercase();
    name == "content-type"
        || name == "content-length"
        || name.starts_with("webhook-")
        || (binary && name.starts_with("ce-"))
}

/// 2xx → success; 429 → rate limited; 408, 425 and 5xx → transient (both honouring
/// `Retry-After` in seconds); 400, 413 and 422 → refused; anything else → permanent; with the
/// status and the start of the body in the reason.
pub fn judge(status: u16, retry_after: Option<&str>, body: &[u8]) -> Verdict {
    let excerpt = excerpt(body);
    let reason = if excerpt.is_empty() { format!("HTTP {status}") } else { format!("HTTP {status}: {excerpt}") };
    match status {
        200..=299 => Verdict::Success,
        429 => Verdict::RateLimited { reason, retry_after_ms: retry_after.and_then(parse_retry_after) },
        408 | 425 | 500..=599 => Verdict::Transient { reason, retry_after_ms: retry_after.and_then(parse_retry_after) },
        400 | 413 | 422 => Verdict::Refused { reason },
        _ => Verdict::Permanent { reason },
    }
}

/// `Retry-After` as delay-seconds. (The HTTP-date form is rare for webhooks and ignored: the
/// route's backoff applies then, or for a 429 the plugin's default wait.)
pub fn parse_retry_after(value: &str) -> Option<u64> {
    value.trim().parse::<u64>().ok().map(|s| s.saturating_mul(1000))
}

/// The body's first characters, as text, on one line.
pub fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut out: String = text.chars().take(BODY_EXCERPT).map(|c| if c.is_control() { ' ' } else { c }).collect();
    if text.chars().count() > BODY_EXCERPT {
        out.push('…');
    }
    out.trim().to_string()
}

/// A signing secret: `whsec_<base64>` as Standard Webhooks issues them, or raw text.
pub fn secret_bytes(secret: &str) -> Result<Vec<u8>, String> {
    match secret.strip_prefix("whsec_") {
        Some(encoded) => STANDARD.decode(encoded).map_err(|e| format!("secret: whsec_ value is not base64: {e}")),
        None => Ok(secret.as_bytes().to_vec()),
    }
}

/// One `v1,<base64 HMAC-SHA256>` signature over `{id}.{timestamp}.{body}`.
pub fn sign(secret: &[u8], id: &str, timestamp: u64, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", STANDARD.encode(mac.finalize().into_bytes()))
}

/// The `webhook-signature` header: one signature per secret, space-separated, so receivers can
/// rotate secrets without dropping deliveries.
pub fn signature_header(secrets: &[Vec<u8>], id: &str, timestamp: u64, body: &[u8]) -> String {
    secrets.iter().map(|s| sign(s, id, timestamp, body)).collect::<Vec<_>>().join(" ")
}

/// A parsed `http://` or `https://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub https: bool,
    pub authority: String,
    pub path_and_query: String,
}

pub fn parse_url(url: &str) -> Result<Target, String> {
    let (https, rest) = if let Some(rest) = url.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = url.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err(format!("url: {url:?} must start with http:// or https://"));
    };
    let (authority, path) = match rest.find(['/', '?']) {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if authority.is_empty() {
        return Err(format!("url: {url:?} has no host"));
    }
    let path = if path.starts_with('?') { format!("/{path}") } else { path.to_string() };
    Ok(Target { https, authority: authority.to_string(), path_and_query: path })
}

/// Whether `content_type` says JSON: `application/json`, or a `+json` type such as
/// `application/cloudevents+json`, parameters aside.
pub fn is_json_type(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// A CloudEvents attribute as an HTTP header value (the HTTP binding's binary mode): space, `"`,
/// `%` and everything outside printable ASCII percent-encoded, byte by byte of its UTF-8.
pub fn header_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        match byte {
            b' ' | b'"' | b'%' => out.push_str(&format!("%{byte:02X}")),
            0x21..=0x7E => out.push(char::from(byte)),
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

/// A CloudEvents structured-mode body: one JSON object with the context `attributes`, the
/// payload's `datacontenttype`, and the payload as `data` — the JSON itself when its content type
/// is JSON and it parses, a string when its content type is `text/*` — or else base64 in
/// `data_base64` (binary data, and JSON that does not parse, which a string would misstate).
pub fn structured(attributes: &[(&str, String)], content_type: &str, payload: &[u8]) -> Vec<u8> {
    let mut envelope = serde_json::Map::new();
    for (name, value) in attributes {
        envelope.insert((*name).to_string(), serde_json::Value::String(value.clone()));
    }
    if !content_type.is_empty() {
        envelope.insert("datacontenttype".into(), serde_json::Value::String(content_type.to_string()));
    }
    let mut out = serde_json::to_vec(&envelope).unwrap_or_default();
    // The payload goes in as it is (not re-encoded), so large numbers keep every digit.
    let is_text = content_type.trim_start().to_ascii_lowercase().starts_with("text/");
    let data = match std::str::from_utf8(payload) {
        Ok(text)
            if is_json_type(content_type) && serde_json::from_str::<&serde_json::value::RawValue>(text).is_ok() =>
        {
            format!("\"data\":{}", text.trim())
        }
        Ok(text) if is_text => format!("\"data\":{}", serde_json::Value::String(text.to_string())),
        _ => format!("\"data_base64\":\"{}\"", STANDARD.encode(payload)),
    };
    out.pop(); // the closing brace
    if out.len() > 1 {
        out.push(b',');
    }
    out.extend_from_slice(data.as_bytes());
    out.push(b'}');
    out
}

/// How much one batched request may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    pub events: usize,
    pub bytes: usize,
}

impl BatchLimits {
    pub const DEFAULT_EVENTS: usize = 100;
    pub const MAX_EVENTS: usize = 10_000;
    pub const DEFAULT_BYTES: usize = 1 << 20;
    /// A quarter of a plugin's default memory (`plugins.memory`, 64 MiB), which also holds the
    /// batch's events and the requests in flight.
    pub const MAX_BYTES: usize = 16 << 20;
    /// Below this a request would hold hardly more than one envelope's attributes.
    pub const MIN_BYTES: usize = 1024;

    /// `batch_size` and `batch_bytes` as a route gives them (unset: the defaults).
    pub fn parse(events: Option<&str>, bytes: Option<&str>) -> Result<BatchLimits, String> {
        let number = |key: &str, value: Option<&str>, default: usize, range: std::ops::RangeInclusive<usize>| {
            let Some(value) = value else { return Ok(default) };
            value.trim().parse::<usize>().ok().filter(|n| range.contains(n)).ok_or_else(|| {
                format!("{key}: {value:?} is not a whole number from {} to {}", range.start(), range.end())
            })
        };
        Ok(BatchLimits {
            events: number("batch_size", events, Self::DEFAULT_EVENTS, 1..=Self::MAX_EVENTS)?,
            bytes: number("batch_bytes", bytes, Self::DEFAULT_BYTES, Self::MIN_BYTES..=Self::MAX_BYTES)?,
        })
    }
}

/// Builds the bodies of batched requests from envelopes added in order: JSON arrays of at most
/// `events` envelopes and `bytes` bytes, except that an array of one envelope holds it whatever
/// its length. Every envelope goes in exactly one array, in order.
#[derive(Debug)]
pub struct Batcher {
    limits: BatchLimits,
    body: Vec<u8>,
    count: usize,
}

impl Batcher {
    pub fn new(limits: BatchLimits) -> Batcher {
        Batcher { limits, body: Vec::new(), count: 0 }
    }

    /// Adds `envelope` (a JSON object). When it does not fit the array being built, that array
    /// is returned, with how many envelopes it holds, and the next one starts with `envelope`.
    pub fn add(&mut self, envelope: &[u8]) -> Option<(Vec<u8>, usize)> {
        // The array so far, a comma, the envelope and the closing bracket.
        let longer = self.body.len() + 1 + envelope.len() + 1;
        let full = self.count > 0 && (self.count == self.limits.events || longer > self.limits.bytes);
        let done = if full { self.finish() } else { None };
        self.body.push(if self.count == 0 { b'[' } else { b',' });
        self.body.extend_from_slice(envelope);
        self.count += 1;
        done
    }

    /// The array being built, if it holds any envelope.
    pub fn finish(&mut self) -> Option<(Vec<u8>, usize)> {
        if self.count == 0 {
            return None;
        }
        let mut body = std::mem::take(&mut self.body);
        body.push(b']');
        Some((body, std::mem::replace(&mut self.count, 0)))
    }
}

/// The `webhook-id` of a batched request: a digest of the ids of the events it carries, in any
/// order (a retry's claim may order them differently), so a retry of the same events is
/// recognisably the same message.
pub fn batch_id(ids: impl IntoIterator<Item = String>) -> String {
    use sha2::Digest as _;
    let mut ids: Vec<String> = ids.into_iter().collect();
    ids.sort_unstable();
    let mut digest = Sha256::new();
    for id in ids {
        // Length-prefixed, so no two lists of ids make the same input.
        digest.update((id.len() as u64).to_le_bytes());
        digest.update(id.as_bytes());
    }
    let hash = digest.finalize();
    let hex: String = hash[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("batch_{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_outcomes() {
        let transient = |s| matches!(judge(s, None, b""), Verdict::Transient { .. });
        let permanent = |s| matches!(judge(s, None, b""), Verdict::Permanent { .. });
        for s in [200, 201, 204, 299] {
            assert_eq!(judge(s, None, b""), Verdict::Success, "{s}");
        }
        for s in [408, 425, 500, 502, 503, 504, 599] {
            assert!(transient(s), "{s} is transient");
        }
        assert!(matches!(judge(429, None, b""), Verdict::RateLimited { retry_after_ms: None, .. }));
        for s in [100, 301, 304, 401, 403, 404, 405, 409, 410, 451] {
            assert!(permanent(s), "{s} is permanent");
        }
        for s in [400, 413, 422] {
            assert!(matches!(judge(s, None, b""), Verdict::Refused { .. }), "{s} refuses the body");
        }
    }

    #[test]
    fn retry_after_and_body_reach_the_reason() {
        assert_eq!(
            judge(429, Some("7"), b"slow down"),
            Verdict::RateLimited { reason: "HTTP 429: slow down".into(), retry_after_ms: Some(7000) }
        );
        assert_eq!(
            judge(503, Some("Wed, 21 Oct 2015 07:28:00 GMT"), b""),
            Verdict::Transient { reason: "HTTP 503".into(), retry_after_ms: None }
        );
        let long = "x".repeat(500);
        let Verdict::Refused { reason } = judge(400, None, long.as_bytes()) else { panic!() };
        assert_eq!(reason.chars().count(), "HTTP 400: ".len() + BODY_EXCERPT + 1);
        assert!(reason.ends_with('…'));
        assert_eq!(excerpt(b"line\nbreak"), "line break");
    }

    #[test]
    fn signatures_follow_standard_webhooks() {
        // The example from the Standard Webhooks specification.
        let secret = secret_bytes("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            sign(&secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
        let both = signature_header(&[secret.clone(), b"old".to_vec()], "id", 1, b"");
        assert_eq!(both.split(' ').count(), 2);
        assert!(secret_bytes("whsec_%%%").unwrap_err().contains("base64"));
        assert_eq!(secret_bytes("plain").unwrap(), b"plain");
    }

    #[test]
    fn urls_are_split_for_wasi_http() {
        assert_eq!(
            parse_url("https://hooks.example.com/in?x=1").unwrap(),
            Target { https: true, authority: "hooks.example.com".into(), path_and_query: "/in?x=1".into() }
        );
        assert_eq!(parse_url("http://127.0.0.1:8080").unwrap().path_and_query, "/");
        assert_eq!(parse_url("http://h?q").unwrap().path_and_query, "/?q");
        assert!(parse_url("ftp://h").is_err());
        assert!(parse_url("http:///x").is_err());
    }

    #[test]
    fn structured_cloudevents_embed_the_payload_as_it_is() {
        let attributes = [("specversion", "1.0".to_string()), ("id", "7".to_string())];
        let big = r#"{"amount": 123456789012345678901234567890}"#;
        let body = String::from_utf8(structured(&attributes, "application/json", big.as_bytes())).unwrap();
        assert_eq!(
            body,
            format!(r#"{{"datacontenttype":"application/json","id":"7","specversion":"1.0","data":{big}}}"#)
        );
        let text = String::from_utf8(structured(&attributes, "text/plain", b"say \"hi\"")).unwrap();
        assert!(text.ends_with(r#""data":"say \"hi\""}"#), "{text}");
        let broken = String::from_utf8(structured(&attributes, "application/json", b"{oops")).unwrap();
        assert!(broken.ends_with(r#""data_base64":"e29vcHM="}"#), "JSON that does not parse is bytes: {broken}");
        let binary = String::from_utf8(structured(&attributes, "application/octet-stream", &[0, 255])).unwrap();
        assert!(binary.ends_with(r#""data_base64":"AP8="}"#), "{binary}");
        let utf8 = String::from_utf8(structured(&attributes, "application/x-protobuf", b"abc")).unwrap();
        assert!(utf8.ends_with(r#""data_base64":"YWJj"}"#), "only text/* is a string: {utf8}");
        assert_eq!(header_value("order.paid"), "order.paid");
        assert_eq!(header_value("50% off \"now\" – é"), "50%25%20off%20%22now%22%20%E2%80%93%20%C3%A9");
        let value: serde_json::Value = serde_json::from_str(&binary).unwrap();
        assert_eq!(value["id"], "7");
    }

    /// The arrays a batcher makes of envelopes of these sizes (`{`, `x`s, `}`), checked to hold
    /// every envelope once, in order, each array valid JSON with the count the batcher gave.
    fn batched(limits: BatchLimits, sizes: &[usize]) -> Vec<Vec<u8>> {
        let envelope = |n: &usize| format!("{{{}}}", "x".repeat(n - 2)).into_bytes();
        let mut batcher = Batcher::new(limits);
        let mut arrays: Vec<(Vec<u8>, usize)> = sizes.iter().filter_map(|n| batcher.add(&envelope(n))).collect();
        arrays.extend(batcher.finish());
        assert!(batcher.finish().is_none(), "a finished batcher is empty");
        let mut carried = Vec::new();
        for (body, count) in &arrays {
            let text = String::from_utf8(body.clone()).unwrap();
            let parsed: Vec<serde_json::Value> = serde_json::from_str(&text.replace('x', "")).unwrap();
            assert_eq!(parsed.len(), *count, "{text}");
            carried.extend(text[1..text.len() - 1].split(',').map(|e| e.as_bytes().to_vec()));
        }
        assert_eq!(carried, sizes.iter().map(envelope).collect::<Vec<_>>(), "{sizes:?}: each once, in order");
        arrays.into_iter().map(|(body, _)| body).collect()
    }

    #[test]
    fn batches_keep_to_their_limits_and_lose_nothing() {
        let limits = BatchLimits { events: 3, bytes: 30 };
        let count = |array: &Vec<u8>| array.iter().filter(|b| **b == b'{').count();
        let counts = |sizes: &[usize]| batched(limits, sizes).iter().map(count).collect::<Vec<_>>();
        // By count: runs of three.
        assert_eq!(counts(&[5; 7]), [3, 3, 1]);
        // By bytes: [a,b] is 1 + 10 + 1 + 10 + 1 = 23; a third of 10 would make 34 > 30.
        assert_eq!(counts(&[10; 4]), [2, 2]);
        // Exactly at the limit stays in: 1 + 14 + 1 + 13 + 1 = 30.
        assert_eq!(counts(&[14, 13, 2]), [2, 1]);
        // An envelope longer than the limit goes alone, and what follows starts afresh.
        assert_eq!(counts(&[4, 100, 4, 4]), [1, 1, 2]);
        assert!(counts(&[]).is_empty());
        for sizes in [vec![2; 50], vec![29, 2, 28, 2, 31, 2], vec![40; 5]] {
            for array in batched(limits, &sizes) {
                let text = String::from_utf8_lossy(&array);
                assert!(count(&array) <= 3 && (array.len() <= 30 || count(&array) == 1), "{sizes:?}: {text}");
            }
        }
    }

    #[test]
    fn batch_settings_are_checked() {
        assert_eq!(BatchLimits::parse(None, None), Ok(BatchLimits { events: 100, bytes: 1 << 20 }));
        assert_eq!(BatchLimits::parse(Some(" 500 "), Some("65536")), Ok(BatchLimits { events: 500, bytes: 65536 }));
        for (events, bytes, key) in [
            (Some("0"), None, "batch_size"),
            (Some("10001"), None, "batch_size"),
            (Some("many"), None, "batch_size"),
            (None, Some("100"), "batch_bytes"),
            (None, Some("-1"), "batch_bytes"),
        ] {
            let error = BatchLimits::parse(events, bytes).unwrap_err();
            assert!(error.starts_with(key) && error.contains("whole number"), "{error}");
        }
    }

    #[test]
    fn a_batch_id_is_the_same_for_the_same_events_only() {
        let ids = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let one = batch_id(ids(&["a", "b"]));
        assert_eq!(one, batch_id(ids(&["a", "b"])));
        assert_eq!(one, batch_id(ids(&["b", "a"])), "the same events in another order");
        assert!(one.starts_with("batch_") && one.len() == "batch_".len() + 32, "{one}");
        for other in [&["a"][..], &["ab"], &["a", "b", "c"], &["a,b"]] {
            assert_ne!(one, batch_id(ids(other)), "{other:?}");
        }
    }

    #[test]
    fn the_headers_a_request_sets_itself() {
        for own in ["Content-Type", "content-length", "webhook-id", "Webhook-Signature", "webhook-anything"] {
            assert!(set_by_request(own, false), "{own}");
        }
        assert!(set_by_request("ce-id", true) && !set_by_request("ce-id", false), "ce- only in binary mode");
        for other in ["traceparent", "x-api-key", "content-encoding", "webhooks"] {
            assert!(!set_by_request(other, true), "{other}");
        }
    }
}
