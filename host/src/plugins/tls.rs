//! TLS for plugins, done by the host: the certificates a server is verified against (the public
//! roots, plus a plugin's `tls_ca` or `http_ca`) and the client certificate it may present are the
//! operator's grants, read by ferry; a plugin hands over its TCP stream and a server name and gets
//! a stream of plain bytes back (wasi:tls), never holding a key. The roots are shared with the
//! wasi:http pool.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use wasmtime_wasi_tls::{TlsProvider, TlsStream, TlsTransport};

use crate::config::Sandbox;

/// The public (webpki) roots, and the certificates of the PEM file `ca`. Errors name the file.
pub(super) fn roots(ca: Option<&Path>) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.into() };
    if let Some(ca) = ca {
        for cert in certificates(ca)? {
            roots.add(cert).map_err(|e| format!("{}: a certificate cannot be used as a root: {e}", ca.display()))?;
        }
    }
    Ok(roots)
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{} is not a PEM file of certificates: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{} holds no PEM certificate", path.display()));
    }
    Ok(certs)
}

/// Which plugin, CA file and client certificate files a configuration was made for.
type ConfigKey = (Arc<str>, Option<PathBuf>, Option<(PathBuf, PathBuf)>);

/// The client configurations of plugins' wasi:tls connections, made on first use and kept, as the
/// HTTP pool keeps its clients: the files are read once, and instances of a plugin share one
/// session cache (TLS sessions are resumed across instances). A changed file is read at restart.
#[derive(Default)]
pub(super) struct TlsConfigs(Mutex<HashMap<ConfigKey, Arc<rustls::ClientConfig>>>);

impl TlsConfigs {
    /// The configuration for `plugin` with the CA and client certificate its `sandbox` grants.
    pub(super) fn config(&self, plugin: &Arc<str>, sandbox: &Sandbox) -> Result<Arc<rustls::ClientConfig>, String> {
        let key = (plugin.clone(), sandbox.tls_ca.clone(), sandbox.tls_client.clone());
        let mut configs = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(config) = configs.get(&key) {
            return Ok(config.clone());
        }
        let client = sandbox.tls_client.as_ref().map(|(cert, key)| (cert.as_path(), key.as_path()));
        let config = client_config(sandbox.tls_ca.as_deref(), client)?;
        configs.insert(key, config.clone());
        Ok(config)
    }
}

/// The TLS client configuration of one plugin's wasi:tls connections: servers verified against
/// `roots(ca)`, and with `client` (a certificate chain and its key, PEM files) a client certificate
/// for servers that ask for one. Errors name the file and the grant.
fn client_config(ca: Option<&Path>, client: Option<(&Path, &Path)>) -> Result<Arc<rustls::ClientConfig>, String> {
    let builder =
        rustls::ClientConfig::builder().with_root_certificates(roots(ca).map_err(|e| format!("tls_ca: {e}"))?);
    let config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = certificates(cert).map_err(|e| format!("tls_client_cert: {e}"))?;
            let pem = std::fs::read(key).map_err(|e| format!("tls_client_key: cannot read {}: {e}", key.display()))?;
            let key_der = PrivateKeyDer::from_pem_slice(&pem)
                .map_err(|e| format!("tls_client_key: {} holds no usable PEM private key: {e}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| format!("tls_client_key: does not go with tls_client_cert: {e}"))?
        }
    };
    Ok(Arc::new(config))
}

/// What a plugin's wasi:tls handshakes run with.
pub(super) struct PluginTls {
    pub(super) config: Arc<rustls::ClientConfig>,
}

/// A TLS stream handed to the plugin.
struct Stream(tokio_rustls::client::TlsStream<Box<dyn TlsTransport>>);

impl TlsStream for Stream {}

impl tokio::io::AsyncRead for Stream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Stream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl TlsProvider for PluginTls {
    fn connect(
        &self,
        server_name: String,
        transport: Box<dyn TlsTransport>,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<Box<dyn TlsStream>, wasmtime_wasi_tls::Error>> + Send>> {
        let config = self.config.clone();
        Box::pin(async move {
            let fail = |why: String| wasmtime_wasi_tls::Error::msg(format!("TLS with {server_name}: {why}"));
            let name =
                ServerName::try_from(server_name.clone()).map_err(|e| fail(format!("not a server name: {e}")))?;
            let stream = tokio_rustls::TlsConnector::from(config).connect(name, transport).await.map_err(|e| {
                // A refused certificate comes as an I/O error wrapping rustls's reason.
                match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
                    Some(tls) => fail(tls.to_string()),
                    None => fail(e.to_string()),
                }
            })?;
            Ok(Box::new(Stream(stream)) as Box<dyn TlsStream>)
        })
    }
}
