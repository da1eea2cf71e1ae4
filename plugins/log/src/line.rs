//! One event as one line of JSON, written straight into the batch's buffer. Pure (no WIT types),
//! so the host's tests compile it too.
//!
//! The keys come in alphabetical order, as they always have. A payload that is JSON is embedded as
//! the application wrote it, checked but not rebuilt (numbers keep every digit), unless it spans
//! lines: then it is embedded compacted, so the event stays on one line. Other UTF-8 text is
//! embedded as a string, and anything else as base64 under `payload_base64`.

use serde_json::value::RawValue;

/// What a line says about one event.
pub struct Line<'a> {
    pub id: u64,
    pub route: &'a str,
    pub event_type: &'a str,
    pub key: Option<&'a str>,
    pub attempt: u32,
    pub event_time_ms: i64,
    pub content_type: &'a str,
    pub headers: &'a [(String, String)],
    pub payload: &'a [u8],
}

/// Appends `line` to `out` as JSON, ending with a newline.
pub fn write(out: &mut Vec<u8>, line: &Line) {
    out.extend_from_slice(b"{\"attempt\":");
    out.extend_from_slice(line.attempt.to_string().as_bytes());
    out.extend_from_slice(b",\"content_type\":");
    string(out, line.content_type);
    out.extend_from_slice(b",\"event_time_ms\":");
    out.extend_from_slice(line.event_time_ms.to_string().as_bytes());
    out.extend_from_slice(b",\"headers\":{");
    // A name given twice keeps its last value, as a JSON object can hold it once.
    let headers: std::collections::BTreeMap<&str, &str> =
        line.headers.iter().map(|(name, value)| (name.as_str(), value.as_str())).collect();
    for (i, (name, value)) in headers.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        string(out, name);
        out.push(b':');
        string(out, value);
    }
    out.extend_from_slice(b"},\"id\":");
    out.extend_from_slice(line.id.to_string().as_bytes());
    out.extend_from_slice(b",\"key\":");
    match line.key {
        Some(key) => string(out, key),
        None => out.extend_from_slice(b"null"),
    }
    match std::str::from_utf8(line.payload) {
        Ok(text) => {
            out.extend_from_slice(b",\"payload\":");
            payload(out, text);
        }
        Err(_) => {
            out.extend_from_slice(b",\"payload_base64\":\"");
            base64(out, line.payload);
            out.push(b'"');
        }
    }
    out.extend_from_slice(b",\"route\":");
    string(out, line.route);
    out.extend_from_slice(b",\"type\":");
    string(out, line.event_type);
    out.extend_from_slice(b"}\n");
}

/// A UTF-8 payload: its JSON as written when it is JSON on one line, compacted when it is JSON
/// over several, else a string.
fn payload(out: &mut Vec<u8>, text: &str) {
    if let Ok(raw) = serde_json::from_str::<&RawValue>(text) {
        // The value without the whitespace around it.
        let value = raw.get();
        if !value.contains(['\n', '\r']) {
            out.extend_from_slice(value.as_bytes());
            return;
        }
        if let Ok(value) = serde_json::from_str::<serde_json::Value>(value) {
            out.extend_from_slice(value.to_string().as_bytes());
            return;
        }
    }
    string(out, text);
}

/// `text` as a JSON string: quoted, with `"`, `\` and the control characters escaped.
fn string(out: &mut Vec<u8>, text: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    let bytes = text.as_bytes();
    let mut plain = 0;
    for (i, &byte) in bytes.iter().enumerate() {
        let escaped: &[u8] = match byte {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0x00..=0x1f => &[b'\\', b'u', b'0', b'0', HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 15)]],
            _ => continue,
        };
        out.extend_from_slice(&bytes[plain..i]);
        out.extend_from_slice(escaped);
        plain = i + 1;
    }
    out.extend_from_slice(&bytes[plain..]);
    out.push(b'"');
}

/// Standard base64 with padding; small enough not to warrant a dependency.
fn base64(out: &mut Vec<u8>, bytes: &[u8]) {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]);
            } else {
                out.push(b'=');
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(payload: &[u8], headers: &[(String, String)]) -> String {
        let mut out = Vec::new();
        let event = Line {
            id: 7,
            route: "orders",
            event_type: "order.created",
            key: Some("k\"1"),
            attempt: 2,
            event_time_ms: -5,
            content_type: "application/json",
            headers,
            payload,
        };
        write(&mut out, &event);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn a_line_holds_the_event_its_keys_in_order() {
        let headers = [("b".to_string(), "2".to_string()), ("a".to_string(), "x\u{1}\n".to_string())];
        let text = line(br#"{"z":1,"a":[true,null]}"#, &headers);
        assert_eq!(
            text,
            "{\"attempt\":2,\"content_type\":\"application/json\",\"event_time_ms\":-5,\
             \"headers\":{\"a\":\"x\\u0001\\n\",\"b\":\"2\"},\"id\":7,\"key\":\"k\\\"1\",\
             \"payload\":{\"z\":1,\"a\":[true,null]},\"route\":\"orders\",\"type\":\"order.created\"}\n"
        );
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(parsed["headers"]["a"], "x\u{1}\n");
    }

    #[test]
    fn a_json_payload_keeps_every_digit_and_stays_on_one_line() {
        let big = line(b" 123456789012345678901234567890 ", &[]);
        assert!(big.contains("\"payload\":123456789012345678901234567890,"), "{big}");
        let spread = line(b"{\n  \"a\": 1\n}", &[]);
        assert!(spread.contains("\"payload\":{\"a\":1},"), "{spread}");
        assert_eq!(spread.matches('\n').count(), 1, "{spread}");
    }

    #[test]
    fn text_and_bytes_that_are_not_json() {
        let text = line(b"not json\n", &[]);
        assert!(text.contains("\"payload\":\"not json\\n\","), "{text}");
        let bytes = line(&[0xff, 0, 1, 2], &[]);
        assert!(bytes.contains("\"payload_base64\":\"/wABAg==\","), "{bytes}");
        let last = line(b"1", &[("h".to_string(), "1".to_string()), ("h".to_string(), "2".to_string())]);
        assert!(last.contains("\"headers\":{\"h\":\"2\"}"), "the last value of a name given twice: {last}");
    }
}
