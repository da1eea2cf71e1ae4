//! Just enough of an HTTP/1.1 client for the CLI to call the admin API of a ferry on this host
//! (`health`, `plugins reload`), so the binary needs no HTTP client library.
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// How long the CLI waits for the admin API (a reload compiles plugins, so not too short).
const TIMEOUT: Duration = Duration::from_secs(120);

/// Sends `METHOD path` with an empty body, and the bearer token if given; returns the status
/// code and the body.
pub async fn request(
    method: &str,
    address: SocketAddr,
    path: &str,
    token: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(address)
            .await
            .with_context(|| format!("cannot reach the admin API at {address} (is ferry serving?)"))?;
        let authorization = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {address}\r\n{authorization}\
             Content-Length: 0\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        anyhow::Ok(response)
    };
    let response = tokio::time::timeout(TIMEOUT, exchange)
        .await
        .with_context(|| format!("the admin API at {address} did not answer within {TIMEOUT:?}"))??;
    let Some(split) = response.windows(4).position(|w| w == b"\r\n\r\n") else {
        bail!("the admin API at {address} sent an incomplete answer");
    };
    let head = String::from_utf8_lossy(&response[..split]);
    let body = &response[split + 4..];
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("the admin API at {address} sent no HTTP status line"))?;
    let chunked = head.lines().any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding: chunked"));
    let body = if chunked { dechunk(body) } else { body.to_vec() };
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Joins the chunks of a chunked body (bytes, so a chunk may end inside a character).
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = body.windows(2).position(|w| w == b"\r\n") {
        let size_line = String::from_utf8_lossy(&body[..line_end]);
        let size = usize::from_str_radix(size_line.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        let rest = &body[line_end + 2..];
        let Some(chunk) = rest.get(..size).filter(|_| size > 0) else { break };
        out.extend_from_slice(chunk);
        body = rest[size..].strip_prefix(b"\r\n").unwrap_or(&rest[size..]);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn chunked_bodies_are_joined() {
        assert_eq!(super::dechunk(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"), b"hello world");
        assert_eq!(super::dechunk(b"0\r\n\r\n"), b"");
        assert_eq!(super::dechunk(b"1\r\n\xc3\r\n1\r\n\xa9\r\n0\r\n\r\n"), "é".as_bytes(), "split characters");
        assert_eq!(super::dechunk(b"ff\r\nshort"), b"", "a chunk longer than the body");
    }
}
