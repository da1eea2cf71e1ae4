//! The Kafka wire protocol over wasi:sockets TCP: one connection per broker, kept open across
//! calls; version negotiation; metadata; produce requests.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use kafka_protocol::messages::{
    ApiKey, ApiVersionsRequest, ApiVersionsResponse, InitProducerIdRequest, InitProducerIdResponse, MetadataRequest,
    MetadataResponse, ProduceRequest, ProduceResponse, RequestHeader, ResponseHeader, SaslAuthenticateRequest,
    SaslAuthenticateResponse, SaslHandshakeRequest, SaslHandshakeResponse,
};
use kafka_protocol::protocol::{Decodable, Encodable, StrBytes};

use crate::sasl::{self, Credentials, Mechanism, Scram};

/// Why talking to a broker failed. Always transient for the events concerned.
pub type NetError = String;

/// The newest request versions this client speaks. Produce v9 and Metadata v9 still name topics
/// (later versions move to topic ids); the broker's own maximum is used when it is lower.
const PRODUCE_MAX: i16 = 9;
const METADATA_MAX: i16 = 9;
/// InitProducerId v0 (Kafka 0.11) is enough for an idempotent, non-transactional producer.
const INIT_PRODUCER_ID_MAX: i16 = 4;

/// TLS to the brokers, done by the host (wasi:tls).
#[derive(Debug, Clone)]
pub struct Tls {
    /// The name the brokers' certificates must be valid for; each broker's own host name when
    /// `None`.
    pub server_name: Option<String>,
}

/// How a connection is made.
pub struct Connect<'a> {
    pub timeout: Duration,
    pub client_id: &'a str,
    pub auth: Option<&'a Auth>,
    pub tls: Option<&'a Tls>,
}

/// The byte stream to a broker: plain TCP, or TLS done by the host.
enum Stream {
    Plain(TcpStream),
    Tls(Box<crate::tls::TlsStream>),
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Plain(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        }
    }
}

/// How the transport authenticates to brokers.
#[derive(Debug, Clone)]
pub struct Auth {
    pub mechanism: Mechanism,
    pub credentials: Credentials,
}

/// One open connection to one broker.
pub struct Connection {
    address: String,
    stream: Stream,
    next_correlation: i32,
    produce_version: i16,
    metadata_version: i16,
    /// The InitProducerId version to use; `None` when the broker does not offer it.
    init_producer_id_version: Option<i16>,
    sasl_authenticate_version: i16,
    auth: Option<Auth>,
    /// When the broker's SASL session runs out, authenticate again before this.
    reauthenticate_at: Option<Instant>,
    /// Requests written and not yet answered.
    outstanding: usize,
}

impl Connection {
    /// Connects to `host:port` (over TLS if configured), negotiates request versions and, with
    /// SASL configured, authenticates.
    pub fn open(host: &str, port: u16, how: &Connect<'_>) -> Result<Connection, NetError> {
        let address = format!("{host}:{port}");
        let stream = match how.tls {
            Some(tls) => {
                let server_name = tls.server_name.as_deref().unwrap_or(host);
                Stream::Tls(Box::new(crate::tls::TlsStream::connect(host, port, server_name, how.timeout)?))
            }
            None => Stream::Plain(plain(host, port, how.timeout)?),
        };
        let mut connection = Connection {
            address,
            stream,
            next_correlation: 1,
            produce_version: 3,
            metadata_version: 4,
            init_producer_id_version: None,
            sasl_authenticate_version: 0,
            auth: how.auth.cloned(),
            reauthenticate_at: None,
            outstanding: 0,
        };
        // A refused connection can surface only at the first write (wasi-libc's non-blocking
        // connect), so a failed negotiation counts as a failed connect.
        connection.negotiate(how.client_id).map_err(|e| format!("cannot connect: {e}"))?;
        connection.authenticate(how.client_id)?;
        Ok(connection)
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    fn negotiate(&mut self, client_id: &str) -> Result<(), NetError> {
        let correlation = self.send(ApiKey::ApiVersions, 0, &ApiVersionsRequest::default(), client_id)?;
        let response: ApiVersionsResponse = self.receive(ApiKey::ApiVersions, 0, correlation)?;
        if response.error_code != 0 {
            return Err(format!("{}: ApiVersions failed with error code {}", self.address, response.error_code));
        }
        let range = |key: ApiKey| response.api_keys.iter().find(|k| k.api_key == key as i16);
        let pick = |key: ApiKey, min: i16, max: i16| -> Result<i16, NetError> {
            let Some(broker) = range(key) else {
                return Err(format!("{}: broker does not support {key:?} requests", self.address));
            };
            let version = broker.max_version.min(max);
            if version < min.max(broker.min_version) {
                return Err(format!(
                    "{}: broker supports {key:?} versions {}..={}, this client needs {min}..={max}",
                    self.address, broker.min_version, broker.max_version
                ));
            }
            Ok(version)
        };
        self.produce_version = pick(ApiKey::Produce, 3, PRODUCE_MAX)?;
        self.metadata_version = pick(ApiKey::Metadata, 4, METADATA_MAX)?;
        self.init_producer_id_version = pick(ApiKey::InitProducerId, 0, INIT_PRODUCER_ID_MAX).ok();
        if self.auth.is_some() {
            // SaslHandshake v1 frames the exchange in SaslAuthenticate requests; v1 of those
            // carries the session lifetime, after which the broker wants a new authentication.
            pick(ApiKey::SaslHandshake, 1, 1)?;
            self.sasl_authenticate_version = pick(ApiKey::SaslAuthenticate, 0, 2)?;
        }
        Ok(())
    }

    /// Authenticates with the configured mechanism, if any. Errors name the broker and the
    /// mechanism, never the credentials.
    fn authenticate(&mut self, client_id: &str) -> Result<(), NetError> {
        let Some(auth) = self.auth.clone() else { return Ok(()) };
        self.reauthenticate_at = None;
        let mechanism = auth.mechanism.name();
        let mut handshake = SaslHandshakeRequest::default();
        handshake.mechanism = StrBytes::from_static_str(mechanism);
        let correlation = self.send(ApiKey::SaslHandshake, 1, &handshake, client_id)?;
        let answer: SaslHandshakeResponse = self.receive(ApiKey::SaslHandshake, 1, correlation)?;
        if answer.error_code != 0 {
            let offered: Vec<&str> = answer.mechanisms.iter().map(|m| m.as_str()).collect();
            return Err(format!(
                "{}: UNSUPPORTED_SASL_MECHANISM: the broker does not offer SASL {mechanism} (it offers: {})",
                self.address,
                if offered.is_empty() { "none".to_string() } else { offered.join(", ") }
            ));
        }
        let failed = |address: &str, why: String| {
            format!(
                "{address}: SASL_AUTHENTICATION_FAILED: {mechanism} authentication refused: {why} (check the credentials)"
            )
        };
        let lifetime_ms = match auth.mechanism {
            Mechanism::Plain => self.sasl_step(sasl::plain(&auth.credentials), client_id)?.1,
            scram => {
                let mut conversation = Scram::new(scram, &auth.credentials, &nonce());
                let (server_first, _) = self.sasl_step(conversation.client_first(), client_id)?;
                let client_final = conversation.client_final(&server_first).map_err(|e| failed(&self.address, e))?;
                let (server_final, lifetime_ms) = self.sasl_step(client_final, client_id)?;
                conversation.verify_server_final(&server_final).map_err(|e| failed(&self.address, e))?;
                lifetime_ms
            }
        };
        if lifetime_ms > 0 {
            // Well before the broker's deadline, as the Java client does (85% of the lifetime).
            self.reauthenticate_at = Some(Instant::now() + Duration::from_millis(lifetime_ms as u64 * 85 / 100));
        }
        Ok(())
    }

    /// One SaslAuthenticate round trip: the server's bytes and the session lifetime it states.
    fn sasl_step(&mut self, auth_bytes: Vec<u8>, client_id: &str) -> Result<(Vec<u8>, i64), NetError> {
        let version = self.sasl_authenticate_version;
        let mut request = SaslAuthenticateRequest::default();
        request.auth_bytes = Bytes::from(auth_bytes);
        let correlation = self.send(ApiKey::SaslAuthenticate, version, &request, client_id)?;
        let answer: SaslAuthenticateResponse = self.receive(ApiKey::SaslAuthenticate, version, correlation)?;
        if answer.error_code != 0 {
            let name = if answer.error_code == 58 { "SASL_AUTHENTICATION_FAILED" } else { "SASL error" };
            let detail = answer.error_message.as_ref().map(|m| m.as_str().to_string()).unwrap_or_default();
            let mechanism = self.auth.as_ref().map_or("", |a| a.mechanism.name());
            return Err(format!(
                "{}: {name} (code {}): {mechanism} authentication refused{}{detail} (check the credentials)",
                self.address,
                answer.error_code,
                if detail.is_empty() { "" } else { ": " }
            ));
        }
        Ok((answer.auth_bytes.to_vec(), answer.session_lifetime_ms))
    }

    /// Authenticates again when the broker's session is about to run out and nothing is in flight.
    fn refresh(&mut self, client_id: &str) -> Result<(), NetError> {
        if self.outstanding == 0 && self.reauthenticate_at.is_some_and(|at| Instant::now() >= at) {
            self.authenticate(client_id)?;
        }
        Ok(())
    }

    /// Writes one request and returns its correlation id.
    fn send<R: Encodable>(&mut self, key: ApiKey, version: i16, body: &R, client_id: &str) -> Result<i32, NetError> {
        let correlation = self.next_correlation;
        self.next_correlation = self.next_correlation.wrapping_add(1);
        let mut header = RequestHeader::default();
        header.request_api_key = key as i16;
        header.request_api_version = version;
        header.correlation_id = correlation;
        header.client_id = Some(StrBytes::from_string(client_id.to_string()));
        let mut frame = BytesMut::with_capacity(4 + 64);
        frame.extend_from_slice(&[0; 4]);
        let encode = |frame: &mut BytesMut| -> anyhow::Result<()> {
            header.encode(frame, key.request_header_version(version))?;
            body.encode(frame, version)
        };
        encode(&mut frame).map_err(|e| format!("encoding {key:?} request: {e}"))?;
        let size = i32::try_from(frame.len() - 4).map_err(|_| format!("{key:?} request too large"))?;
        frame[..4].copy_from_slice(&size.to_be_bytes());
        self.stream
            .write_all(&frame)
            .and_then(|()| self.stream.flush())
            .map_err(|e| format!("{}: sending {key:?}: {e}", self.address))?;
        self.outstanding += 1;
        Ok(correlation)
    }

    /// Reads the answer to the request with `correlation`.
    fn receive<R: Decodable>(&mut self, key: ApiKey, version: i16, correlation: i32) -> Result<R, NetError> {
        self.outstanding = self.outstanding.saturating_sub(1);
        let mut size = [0u8; 4];
        self.stream.read_exact(&mut size).map_err(|e| read_error(&self.address, key, &e))?;
        let size = i32::from_be_bytes(size);
        if !(0..=256 * 1024 * 1024).contains(&size) {
            return Err(format!("{}: implausible {key:?} response size {size}", self.address));
        }
        let mut frame = vec![0u8; size as usize];
        self.stream.read_exact(&mut frame).map_err(|e| read_error(&self.address, key, &e))?;
        let mut buf = Bytes::from(frame);
        let header = ResponseHeader::decode(&mut buf, key.response_header_version(version))
            .map_err(|e| format!("{}: decoding {key:?} response header: {e}", self.address))?;
        if header.correlation_id != correlation {
            return Err(format!(
                "{}: {key:?} response for request {} while waiting for {correlation}",
                self.address, header.correlation_id
            ));
        }
        let response = R::decode(&mut buf, version).map_err(|e| format!("{}: decoding {key:?}: {e}", self.address))?;
        if buf.has_remaining() {
            return Err(format!("{}: {} unexpected bytes after the {key:?} response", self.address, buf.remaining()));
        }
        Ok(response)
    }

    /// Fetches metadata for `topic` without creating it.
    pub fn metadata(&mut self, topic: &str, client_id: &str) -> Result<MetadataResponse, NetError> {
        let mut request = MetadataRequest::default();
        let mut wanted = kafka_protocol::messages::metadata_request::MetadataRequestTopic::default();
        wanted.name = Some(StrBytes::from_string(topic.to_string()).into());
        request.topics = Some(vec![wanted]);
        request.allow_auto_topic_creation = false;
        self.refresh(client_id)?;
        let version = self.metadata_version;
        let correlation = self.send(ApiKey::Metadata, version, &request, client_id)?;
        self.receive(ApiKey::Metadata, version, correlation)
    }

    /// Writes a produce request; with `acks = 0` the broker sends no answer, so `None` is returned
    /// in place of a correlation id to wait for.
    pub fn send_produce(&mut self, request: &ProduceRequest, client_id: &str) -> Result<Option<i32>, NetError> {
        self.refresh(client_id)?;
        let correlation = self.send(ApiKey::Produce, self.produce_version, request, client_id)?;
        if request.acks == 0 {
            // No answer will come.
            self.outstanding = self.outstanding.saturating_sub(1);
        }
        Ok((request.acks != 0).then_some(correlation))
    }

    pub fn receive_produce(&mut self, correlation: i32) -> Result<ProduceResponse, NetError> {
        self.receive(ApiKey::Produce, self.produce_version, correlation)
    }

    /// Asks for a producer id and epoch for an idempotent (not transactional) producer. The
    /// answer's error code is the caller's to judge.
    pub fn init_producer_id(&mut self, timeout: Duration, client_id: &str) -> Result<InitProducerIdResponse, NetError> {
        let Some(version) = self.init_producer_id_version else {
            return Err(format!(
                "{}: the broker does not support InitProducerId, which idempotence needs (set idempotence = false)",
                self.address
            ));
        };
        let mut request = InitProducerIdRequest::default();
        request.transactional_id = None;
        request.transaction_timeout_ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        self.refresh(client_id)?;
        let correlation = self.send(ApiKey::InitProducerId, version, &request, client_id)?;
        self.receive(ApiKey::InitProducerId, version, correlation)
    }
}

/// A plain TCP connection to `host:port`, with read and write timeouts.
fn plain(host: &str, port: u16, timeout: Duration) -> Result<TcpStream, NetError> {
    let address = format!("{host}:{port}");
    let network = wasi::sockets::instance_network::instance_network();
    let ips = crate::tls::resolve(&network, host, Instant::now() + timeout)?;
    let mut last = format!("{address} resolves to no address");
    for ip in ips {
        let addr = SocketAddr::new(crate::tls::std_ip(ip), port);
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                stream.set_read_timeout(Some(timeout)).map_err(|e| format!("{address}: {e}"))?;
                stream.set_write_timeout(Some(timeout)).map_err(|e| format!("{address}: {e}"))?;
                return Ok(stream);
            }
            Err(e) => last = format!("cannot connect to {address} ({addr}): {e}"),
        }
    }
    Err(last)
}

/// A fresh SCRAM client nonce: 18 random bytes from the host, as base64.
fn nonce() -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(wasi::random::random::get_random_bytes(18))
}

fn read_error(address: &str, key: ApiKey, error: &std::io::Error) -> NetError {
    match error.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("{address}: REQUEST_TIMED_OUT: no {key:?} response within the request timeout")
        }
        _ => format!("{address}: reading {key:?} response: {error}"),
    }
}

/// Open connections by broker id, plus the bootstrap connection used before ids are known.
#[derive(Default)]
pub struct Connections {
    pub by_broker: HashMap<i32, Connection>,
    pub bootstrap: Option<Connection>,
}
