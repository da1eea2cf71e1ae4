//! SASL for the Kafka transport: PLAIN (RFC 4616) and SCRAM-SHA-256/512 (RFC 5802, RFC 7677),
//! the client side only. Pure: the nonce comes from the caller, so the host's test suite compiles
//! this file natively and checks it against the RFCs' examples. Nothing here puts a password into
//! an error message.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac as _};
use sha2::{Digest as _, Sha256, Sha512};

/// The mechanisms the transport speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    Plain,
    ScramSha256,
    ScramSha512,
}

impl Mechanism {
    /// Parses the `sasl_mechanism` setting (case does not matter).
    pub fn parse(value: &str) -> Result<Mechanism, String> {
        match value.trim().to_ascii_uppercase().as_str() {
            "PLAIN" => Ok(Mechanism::Plain),
            "SCRAM-SHA-256" => Ok(Mechanism::ScramSha256),
            "SCRAM-SHA-512" => Ok(Mechanism::ScramSha512),
            _ => Err(format!("sasl_mechanism: expected PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512, got {value:?}")),
        }
    }

    /// The name the broker knows it by.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Plain => "PLAIN",
            Mechanism::ScramSha256 => "SCRAM-SHA-256",
            Mechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }

    fn hmac(self, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        fn run<M: hmac::Mac>(mut mac: M, parts: &[&[u8]]) -> Vec<u8> {
            for part in parts {
                mac.update(part);
            }
            mac.finalize().into_bytes().to_vec()
        }
        // HMAC takes keys of any length, so making one cannot fail.
        match self {
            Mechanism::ScramSha512 => {
                run(Hmac::<Sha512>::new_from_slice(key).unwrap_or_else(|_| unreachable!()), parts)
            }
            _ => run(Hmac::<Sha256>::new_from_slice(key).unwrap_or_else(|_| unreachable!()), parts),
        }
    }

    fn hash(self, data: &[u8]) -> Vec<u8> {
        match self {
            Mechanism::ScramSha512 => Sha512::digest(data).to_vec(),
            _ => Sha256::digest(data).to_vec(),
        }
    }
}

/// A user name and password.
#[derive(Clone)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials").field("username", &self.username).finish_non_exhaustive()
    }
}

/// The single PLAIN message: no authorization identity, the user name and the password.
pub fn plain(credentials: &Credentials) -> Vec<u8> {
    format!("\0{}\0{}", credentials.username, credentials.password).into_bytes()
}

/// Iterations a server may ask for: RFC 7677 wants at least 4096, and Kafka allows at most
/// 16384; the ceiling keeps a hostile server from making the plugin spin.
const ITERATIONS: std::ops::RangeInclusive<u32> = 4096..=16_384;

/// One SCRAM conversation, from the client's first message to the check of the server's proof.
pub struct Scram {
    mechanism: Mechanism,
    password: String,
    nonce: String,
    first_bare: String,
    server_signature: Option<Vec<u8>>,
}

impl Scram {
    /// Starts a conversation; `nonce` must be fresh and random, printable and without commas.
    pub fn new(mechanism: Mechanism, credentials: &Credentials, nonce: &str) -> Scram {
        let user = credentials.username.replace('=', "=3D").replace(',', "=2C");
        Scram {
            mechanism,
            password: credentials.password.clone(),
            nonce: nonce.to_string(),
            first_bare: format!("n={user},r={nonce}"),
            server_signature: None,
        }
    }

    /// The client's first message.
    pub fn client_first(&self) -> Vec<u8> {
        format!("n,,{}", self.first_bare).into_bytes()
    }

    /// The client's final message, answering the server's first, whose nonce, salt and iteration
    /// count are checked.
    pub fn client_final(&mut self, server_first: &[u8]) -> Result<Vec<u8>, String> {
        let server_first = std::str::from_utf8(server_first)
            .map_err(|_| "the server's first SCRAM message is not UTF-8".to_string())?;
        let attribute = |name: char| {
            server_first.split(',').find_map(|part| part.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')))
        };
        if server_first.starts_with("m=") {
            return Err("the server asks for a SCRAM extension this client does not know".into());
        }
        let nonce = attribute('r').ok_or("the server's first SCRAM message has no nonce")?;
        if !nonce.starts_with(&self.nonce) || nonce.len() == self.nonce.len() {
            return Err("the server's SCRAM nonce does not extend the client's".into());
        }
        let salt = attribute('s')
            .and_then(|s| BASE64.decode(s).ok())
            .ok_or("the server's first SCRAM message has no valid salt")?;
        let iterations: u32 = attribute('i')
            .and_then(|i| i.parse().ok())
            .ok_or("the server's first SCRAM message has no iteration count")?;
        if !ITERATIONS.contains(&iterations) {
            return Err(format!(
                "the server asks for {iterations} SCRAM iterations, outside {}..={}",
                ITERATIONS.start(),
                ITERATIONS.end()
            ));
        }
        let salted = self.salted_password(&salt, iterations);
        let client_key = self.mechanism.hmac(&salted, &[b"Client Key"]);
        let stored_key = self.mechanism.hash(&client_key);
        let without_proof = format!("c=biws,r={nonce}");
        let auth_message = format!("{},{server_first},{without_proof}", self.first_bare);
        let signature = self.mechanism.hmac(&stored_key, &[auth_message.as_bytes()]);
        let proof: Vec<u8> = client_key.iter().zip(&signature).map(|(k, s)| k ^ s).collect();
        let server_key = self.mechanism.hmac(&salted, &[b"Server Key"]);
        self.server_signature = Some(self.mechanism.hmac(&server_key, &[auth_message.as_bytes()]));
        Ok(format!("{without_proof},p={}", BASE64.encode(proof)).into_bytes())
    }

    /// Checks the server's final message: it proves the server knows the password too.
    pub fn verify_server_final(&self, server_final: &[u8]) -> Result<(), String> {
        let text = std::str::from_utf8(server_final).unwrap_or_default();
        if let Some(error) = text.strip_prefix("e=") {
            return Err(format!("the server refused the SCRAM proof: {error}"));
        }
        let expected = self.server_signature.as_ref().ok_or("no SCRAM proof was sent")?;
        match text.strip_prefix("v=").and_then(|v| BASE64.decode(v).ok()) {
            Some(signature) if &signature == expected => Ok(()),
            _ => Err("the server's SCRAM signature is wrong: it does not know the password".into()),
        }
    }

    /// Hi(password, salt, iterations): PBKDF2 with the mechanism's HMAC, one block.
    fn salted_password(&self, salt: &[u8], iterations: u32) -> Vec<u8> {
        let password = self.password.as_bytes();
        let mut block = self.mechanism.hmac(password, &[salt, &1u32.to_be_bytes()]);
        let mut result = block.clone();
        for _ in 1..iterations {
            block = self.mechanism.hmac(password, &[&block]);
            for (r, b) in result.iter_mut().zip(&block) {
                *r ^= b;
            }
        }
        result
    }
}
