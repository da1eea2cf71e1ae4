//! The Rust plugin SDK's configuration helper (`plugins/sdk/src/config.rs`), compiled natively:
//! every error names the key, and keys nobody asked for are refused; and its time formatting.

#[path = "../plugins/sdk/src/config.rs"]
mod config;

#[path = "../plugins/sdk/src/time.rs"]
mod time;

use config::Config;

fn config(pairs: &[(&str, &str)]) -> Config {
    Config::new(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
}

#[test]
fn values_are_read_with_defaults_and_named_errors() {
    let mut c = config(&[("url", "http://x"), ("blank", " "), ("n", "12"), ("zero", "0"), ("word", "many")]);
    assert_eq!(c.required("url").unwrap(), "http://x");
    assert_eq!(c.required("missing").unwrap_err(), "missing: required");
    assert_eq!(c.required("blank").unwrap_err(), "blank: must not be empty");
    assert_eq!(c.optional("absent"), None);
    assert_eq!(c.positive_or("n", 5), Ok(12));
    assert_eq!(c.positive_or("unset", 5), Ok(5));
    assert_eq!(c.positive_or("zero", 5).unwrap_err(), "zero: not a positive number: \"0\"");
    assert_eq!(c.parse_or::<u16>("word", 1).unwrap_err(), "word: cannot read \"many\" as u16");
    assert_eq!(c.parse_or::<bool>("unset-flag", true), Ok(true));
    assert_eq!(c.finish(), Ok(()), "every key was asked for");
}

#[test]
fn prefixed_keys_are_collected() {
    let mut c = config(&[("header.x-api-key", "k"), ("header.tenant", "acme"), ("header.", "nameless")]);
    let mut headers = c.prefixed("header.");
    headers.sort();
    assert_eq!(headers, vec![("tenant".into(), "acme".into()), ("x-api-key".into(), "k".into())]);
    assert_eq!(c.finish().unwrap_err(), "unknown config key \"header.\" (known: header.NAME)");
}

#[test]
fn unknown_keys_are_refused_listing_the_known_ones() {
    let mut c = config(&[("topic", "t"), ("akcs", "1")]);
    c.required("topic").unwrap();
    c.optional("acks");
    c.optional("acks");
    assert_eq!(c.finish().unwrap_err(), "unknown config key \"akcs\" (known: topic, acks)");
}

/// The template plugin (`plugins/template`), built on the SDK: its outcomes reach the relay, and
/// the SDK refuses a misspelt config key for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_template_transport_delivers_through_ferry() {
    use ferry::NewEvent;
    use ferry::event::Status;

    use crate::common::{Backend, Stepped, TestDb, plugins_dir};

    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_transport_template"]);
    let text = format!(
        "[plugins]\ndir = {plugins:?}\n[route.t]\nplugin = \"template\"\nconfig = {{ prefix = \"audit: \" }}\n\
         [route.typo]\nplugin = \"template\"\nconfig = {{ prefx = \"audit: \" }}\n"
    );
    let s = Stepped::start(db, &text).await;
    let rows = s
        .deliver(&[
            NewEvent::new("t", "note", "hello"),
            NewEvent::new("t", "blob", vec![0xff, 0xfe]),
            NewEvent::new("typo", "note", "hi"),
        ])
        .await;
    assert_eq!(rows[0].status, Status::Sent, "{:?}", rows[0].last_error);
    assert_eq!((rows[1].status, rows[1].last_error.as_deref()), (Status::Failed, Some("payload is not UTF-8 text")));
    assert_ne!(rows[2].status, Status::Sent);
    let reason = rows[2].last_error.as_deref().unwrap();
    assert!(reason.contains("unknown config key \"prefx\" (known: prefix)"), "{reason}");
}

/// A copy of the template plugin that claims another version of the `ferry:transport` package:
/// every `ferry:transport/…@0.2.0` name in the component is rewritten to `@{version}` (same
/// length, so the binary stays well-formed).
fn template_built_for(version: &str) -> Vec<u8> {
    assert_eq!(version.len(), ferry::plugins::WIT_VERSION.len());
    let mut bytes = std::fs::read(crate::common::built_plugin("ferry_transport_template")).unwrap();
    let mut patched = 0;
    for interface in ["types", "logging", "transport"] {
        let from = format!("ferry:transport/{interface}@{}", ferry::plugins::WIT_VERSION);
        let to = format!("ferry:transport/{interface}@{version}");
        let mut at = 0;
        while let Some(i) = bytes[at..].windows(from.len()).position(|w| w == from.as_bytes()) {
            bytes[at + i..at + i + to.len()].copy_from_slice(to.as_bytes());
            at += i + to.len();
            patched += 1;
        }
    }
    assert!(patched >= 3, "the component names its interfaces with their version");
    bytes
}

#[test]
fn plugins_of_an_incompatible_contract_version_are_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let check = |version: &str| {
        let file = dir.path().join(format!("template-{version}.wasm"));
        std::fs::write(&file, template_built_for(version)).unwrap();
        std::process::Command::new(crate::common::ferry_bin()).args(["plugins", "check"]).arg(&file).output().unwrap()
    };
    let newer_major = check("0.3.0");
    assert_eq!(newer_major.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&newer_major.stderr);
    assert!(
        stderr.contains(
            "is built for ferry:transport@0.3.0, but this ferry implements ferry:transport@0.2.0 (and still loads \
             plugins built for @0.1.0)"
        ),
        "{stderr}"
    );
    // A 0.2 component that claims to be 0.1 is held to 0.1's types, whose outcome has no
    // `deferred`: refused, the mismatch named.
    let relabelled = check("0.1.0");
    assert_eq!(relabelled.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&relabelled.stderr);
    assert!(stderr.contains("cannot be instantiated") && stderr.contains("variant of 3 cases, found 4"), "{stderr}");
    let compatible = check("0.2.9");
    assert!(compatible.status.success(), "a compatible version loads: {}", String::from_utf8_lossy(&compatible.stderr));
    assert!(String::from_utf8_lossy(&compatible.stdout).contains("\"template\""));
}

/// The SDK builds from its own copy of the WIT package (the current version), so a transport crate outside this
/// repository needs only the SDK; the copy must be the contract itself, file for file.
#[test]
fn the_sdk_carries_the_wit_package_unchanged() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let files = |dir: &str| -> Vec<(String, String)> {
        let mut files: Vec<(String, String)> = std::fs::read_dir(root.join(dir))
            .unwrap_or_else(|e| panic!("{dir}: {e}"))
            .map(|entry| entry.unwrap().path())
            // wit/v0.1 is the previous version, which only the host carries.
            .filter(|path| path.is_file())
            .map(|path| {
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read_to_string(&path).unwrap())
            })
            .collect();
        files.sort();
        files
    };
    let (contract, copy) = (files("wit"), files("plugins/sdk/wit"));
    assert!(!contract.is_empty());
    let names = |f: &[(String, String)]| f.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&copy), names(&contract), "plugins/sdk/wit holds the same files as wit/");
    for ((name, ours), (_, theirs)) in copy.iter().zip(&contract) {
        assert!(ours == theirs, "plugins/sdk/wit/{name} differs from wit/{name}: copy wit/ over it");
    }
}
