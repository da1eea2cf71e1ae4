//! Broker connections over TLS: a TCP connection made with wasi:sockets, handed to the host's
//! wasi:tls, which verifies the broker's certificate against the roots the operator granted (and
//! presents a client certificate if one is granted) and gives back a stream of plain bytes. The
//! plugin never holds a key. Reads and writes wait at most the request timeout.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use wasi::io::poll::{Pollable, poll};
use wasi::io::streams::{InputStream, OutputStream, StreamError};
use wasi::sockets::network::{
    ErrorCode, IpAddress, IpAddressFamily, IpSocketAddress, Ipv4SocketAddress, Ipv6SocketAddress,
};
use wasi::sockets::tcp::TcpSocket;

mod bindings {
    wit_bindgen::generate!({
        path: "wit",
        world: "ferry:kafka/tls",
        features: ["tls"],
        with: {
            "wasi:io/error@0.2.12": ::wasi::io::error,
            "wasi:io/poll@0.2.12": ::wasi::io::poll,
            "wasi:io/streams@0.2.12": ::wasi::io::streams,
            "wasi:tls/types@0.2.0-draft": generate,
        },
    });
}

use bindings::wasi::tls::types::{ClientConnection, ClientHandshake};

/// A TLS connection to one broker. Fields drop in order: the TLS streams before the connection
/// they belong to, the socket last.
pub struct TlsStream {
    input: InputStream,
    output: OutputStream,
    _connection: ClientConnection,
    _socket: TcpSocket,
    timeout: Duration,
}

impl TlsStream {
    /// Connects to `host:port` and does the TLS handshake for `server_name` (what the broker's
    /// certificate must be valid for). Errors say which step failed.
    pub fn connect(host: &str, port: u16, server_name: &str, timeout: Duration) -> Result<TlsStream, String> {
        let deadline = Instant::now() + timeout;
        let network = wasi::sockets::instance_network::instance_network();
        let mut last = format!("{host}:{port} resolves to no address");
        for address in resolve(&network, host, deadline)? {
            let family = match address {
                IpAddress::Ipv4(_) => IpAddressFamily::Ipv4,
                IpAddress::Ipv6(_) => IpAddressFamily::Ipv6,
            };
            let target = match address {
                IpAddress::Ipv4(address) => IpSocketAddress::Ipv4(Ipv4SocketAddress { port, address }),
                IpAddress::Ipv6(address) => {
                    IpSocketAddress::Ipv6(Ipv6SocketAddress { port, address, flow_info: 0, scope_id: 0 })
                }
            };
            let socket = wasi::sockets::tcp_create_socket::create_tcp_socket(family)
                .map_err(|e| format!("{host}:{port}: cannot make a socket: {}", code(e)))?;
            if let Err(e) = socket.start_connect(&network, target) {
                last = format!("cannot connect to {host}:{port}: {}", code(e));
                continue;
            }
            let streams = loop {
                match socket.finish_connect() {
                    Err(ErrorCode::WouldBlock) => {
                        wait(&socket.subscribe(), deadline).map_err(|_| format!("{host}:{port}: connect timed out"))?
                    }
                    other => break other,
                }
            };
            let (input, output) = match streams {
                Ok(streams) => streams,
                Err(e) => {
                    last = format!("cannot connect to {host}:{port}: {}", code(e));
                    continue;
                }
            };
            let handshake = ClientHandshake::new(server_name, input, output);
            let future = ClientHandshake::finish(handshake);
            let (connection, input, output) = loop {
                match future.get() {
                    None => wait(&future.subscribe(), deadline)
                        .map_err(|_| format!("{host}:{port}: TLS handshake timed out"))?,
                    Some(Ok(Ok(streams))) => break streams,
                    Some(Ok(Err(error))) => return Err(format!("{host}:{port}: {}", error.to_debug_string())),
                    Some(Err(())) => return Err(format!("{host}:{port}: TLS handshake result already taken")),
                }
            };
            return Ok(TlsStream { input, output, _connection: connection, _socket: socket, timeout });
        }
        Err(last)
    }
}

impl Read for TlsStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match self.input.read(buf.len() as u64) {
                Ok(bytes) if !bytes.is_empty() => {
                    buf[..bytes.len()].copy_from_slice(&bytes);
                    return Ok(bytes.len());
                }
                Ok(_) => wait(&self.input.subscribe(), deadline)?,
                Err(StreamError::Closed) => return Ok(0),
                Err(StreamError::LastOperationFailed(e)) => return Err(std::io::Error::other(e.to_debug_string())),
            }
        }
    }
}

impl Write for TlsStream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let deadline = Instant::now() + self.timeout;
        loop {
            match self.output.check_write().map_err(stream_error)? {
                0 => wait(&self.output.subscribe(), deadline)?,
                room => {
                    let n = buf.len().min(usize::try_from(room).unwrap_or(usize::MAX));
                    self.output.write(&buf[..n]).map_err(stream_error)?;
                    return Ok(n);
                }
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let deadline = Instant::now() + self.timeout;
        self.output.flush().map_err(stream_error)?;
        // check-write answers 0 until the flush is done.
        while self.output.check_write().map_err(stream_error)? == 0 {
            wait(&self.output.subscribe(), deadline)?;
        }
        Ok(())
    }
}

/// The addresses of `host` (an IP address as it is, a name through the plugin's DNS grant), for
/// plain connections too. Errors say why a name has none, and what to grant when that is why.
pub(crate) fn resolve(
    network: &wasi::sockets::network::Network,
    host: &str,
    deadline: Instant,
) -> Result<Vec<IpAddress>, String> {
    // An address needs no lookup (and no dns grant).
    match host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V4(ip)) => {
            let [a, b, c, d] = ip.octets();
            return Ok(vec![IpAddress::Ipv4((a, b, c, d))]);
        }
        Ok(std::net::IpAddr::V6(ip)) => {
            let [a, b, c, d, e, f, g, h] = ip.segments();
            return Ok(vec![IpAddress::Ipv6((a, b, c, d, e, f, g, h))]);
        }
        Err(_) => {}
    }
    let lookup = wasi::sockets::ip_name_lookup::resolve_addresses(network, host)
        .map_err(|e| format!("cannot resolve {host}: {}", code(e)))?;
    let mut addresses = Vec::new();
    loop {
        match lookup.resolve_next_address() {
            Ok(Some(address)) => addresses.push(address),
            Ok(None) => return Ok(addresses),
            Err(ErrorCode::WouldBlock) => {
                wait(&lookup.subscribe(), deadline).map_err(|_| format!("resolving {host} timed out"))?
            }
            Err(e) => return Err(format!("cannot resolve {host}: {}", code(e))),
        }
    }
}

/// `address` as the standard library has it.
pub(crate) fn std_ip(address: IpAddress) -> std::net::IpAddr {
    match address {
        IpAddress::Ipv4((a, b, c, d)) => std::net::Ipv4Addr::new(a, b, c, d).into(),
        IpAddress::Ipv6((a, b, c, d, e, f, g, h)) => std::net::Ipv6Addr::new(a, b, c, d, e, f, g, h).into(),
    }
}

/// Waits until `pollable` is ready or `deadline` passes (a `TimedOut` error).
fn wait(pollable: &Pollable, deadline: Instant) -> std::io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    let timer = wasi::clocks::monotonic_clock::subscribe_duration(u64::try_from(left.as_nanos()).unwrap_or(u64::MAX));
    if poll(&[pollable, &timer]).contains(&0) { Ok(()) } else { Err(std::io::ErrorKind::TimedOut.into()) }
}

fn stream_error(error: StreamError) -> std::io::Error {
    match error {
        StreamError::Closed => std::io::ErrorKind::BrokenPipe.into(),
        StreamError::LastOperationFailed(e) => std::io::Error::other(e.to_debug_string()),
    }
}

fn code(error: ErrorCode) -> String {
    match error {
        ErrorCode::AccessDenied => "not on the plugin's tcp allowlist (access denied)".into(),
        ErrorCode::ConnectionRefused => "connection refused".into(),
        ErrorCode::NameUnresolvable => "the name does not resolve".into(),
        // What the host answers a plugin without a dns grant.
        ErrorCode::PermanentResolverFailure => {
            "the plugin may not look names up (its sandbox needs dns = true), or the resolver refused".into()
        }
        // What the host answers while the plugin has as many lookups running as it may.
        ErrorCode::TemporaryResolverFailure => "the resolver is busy or did not answer; tried again later".into(),
        other => format!("{other:?}"),
    }
}
