//! Granted directories as a way out: grants that overlap each other or ferry's own files are
//! refused when the config is loaded; a grant that is (or lies under) a symbolic link is refused
//! when an instance pre-opens it; and a plugin cannot make symbolic links that lead out of its
//! grant, nor hard links at all. Each attack runs through the real runtime with the `scripted`
//! plugin, next to a healthy route that keeps flowing.

use std::path::Path;
use std::process::Command;

use ferry::NewEvent;
use ferry::event::{EventRecord, Status};
use tracing::instrument::WithSubscriber as _;

use crate::common::{Backend, Captured, Stepped, TestDb, plugins_dir};

/// Ferry with the scripted plugin on route `s`, granted `dirs` (TOML inline table), and the log
/// plugin on route `ok` writing into a directory of its own.
async fn start(dirs: &str) -> Stepped {
    let db = TestDb::new(Backend::Sqlite).await;
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted", "ferry_transport_log"]);
    let out = db.dir.path().join("out");
    let config = format!(
        r#"
        [plugins]
        dir = {plugins:?}
        [sandbox.scripted]
        dirs = {dirs}
        [sandbox.log]
        dirs = {{ "/out" = {out:?} }}
        [route.s]
        plugin = "scripted"
        [route.ok]
        plugin = "log"
        config = {{ output = "/out/ok.jsonl" }}
        "#
    );
    Stepped::start(db, &config).await
}

/// Delivers `event` (route `s`) beside an event on route `ok`, checks the latter was delivered,
/// and returns the former's row.
async fn beside_a_healthy_route(s: &Stepped, event: NewEvent) -> EventRecord {
    let rows = s.deliver(&[event, NewEvent::new("ok", "fine", "{}")]).await;
    assert_eq!(rows[1].status, Status::Sent, "other routes keep flowing: {:?}", rows[1].last_error);
    rows[0].clone()
}

#[test]
fn overlapping_grants_are_refused_when_the_config_is_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let check = |name: &str, text: &str| {
        let file = dir.path().join(name);
        std::fs::write(&file, text).unwrap();
        let out = Command::new(crate::common::ferry_bin())
            .arg("--config")
            .arg(&file)
            .args(["plugins", "list"])
            .env_remove("FERRY_DATABASE_URL")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{name} must be refused");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let root = dir.path().display();

    // The attack: "/b" inside "/a", so a plugin could swap the inner directory for a symbolic link.
    let nested = check(
        "nested.toml",
        "[sandbox.one]\ndirs = { \"/a\" = \"x\" }\n[sandbox.two]\ndirs = { \"/b\" = \"x/inner\" }\n",
    );
    assert!(
        nested.contains(&format!(
            r#"sandbox.two.dirs."/b" ({root}/x/inner) lies inside sandbox.one.dirs."/a" ({root}/x)"#
        )),
        "both keys and both paths, resolved against the config file: {nested}"
    );
    assert!(nested.contains("neither inside the other"), "the message says how to fix it: {nested}");

    let plugins =
        check("plugins.toml", "[plugins]\ndir = \"srv/plugins\"\n[sandbox.one]\ndirs = { \"/a\" = \"srv\" }\n");
    assert!(
        plugins.contains(&format!(r#"sandbox.one.dirs."/a" ({root}/srv) contains plugins.dir ({root}/srv/plugins)"#)),
        "{plugins}"
    );

    let database = check(
        "database.toml",
        "[database]\nurl = \"sqlite://data/ferry.db\"\n[sandbox.one]\ndirs = { \"/a\" = \"data\" }\n",
    );
    assert!(
        database
            .contains(&format!(r#"sandbox.one.dirs."/a" ({root}/data) contains database.url ({root}/data/ferry.db)"#)),
        "{database}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symbolic_links_out_of_a_grant_and_hard_links_are_refused_and_logged() {
    let outside = tempfile::tempdir().unwrap();
    let secret = outside.path().join("secret.txt");
    std::fs::write(&secret, "not for plugins").unwrap();
    let granted = tempfile::tempdir().unwrap();
    let data = granted.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("granted.txt"), "yes").unwrap();
    let s = start(&format!("{{ \"/data\" = {data:?} }}")).await;
    let symlink = |target: &str, link: &str| {
        NewEvent::new("s", "symlink", "{}").with_header("target", target).with_header("link", link)
    };

    let log = Captured::default();
    let climbing = format!("../..{}", secret.display());
    for (target, link) in [
        (secret.display().to_string(), "abs"),
        ("/etc/passwd".to_string(), "passwd"),
        (climbing.clone(), "up"),
        ("sub/../../escape".to_string(), "sub-up"),
    ] {
        let row = beside_a_healthy_route(&s, symlink(&target, &format!("/data/{link}")))
            .with_subscriber(log.subscriber())
            .await;
        assert_eq!(row.status, Status::Failed, "a link to {target} must be refused");
        let error = row.last_error.unwrap();
        assert_eq!(error, format!("symlink /data/{link} -> {target}: not-permitted"));
        assert!(std::fs::symlink_metadata(data.join(link)).is_err(), "nothing was created for {target}");
    }
    let hard = NewEvent::new("s", "hardlink", "{}")
        .with_header("from", "/data/granted.txt")
        .with_header("to", "/data/hard.txt");
    let row = beside_a_healthy_route(&s, hard).with_subscriber(log.subscriber()).await;
    assert_eq!(row.status, Status::Failed, "hard links are refused");
    let error = row.last_error.unwrap();
    assert!(error.starts_with("hardlink /data/hard.txt -> /data/granted.txt: "), "{error}");
    assert!(!data.join("hard.txt").exists(), "no hard link was made");

    let log = log.text();
    assert!(log.contains("plugin denied a symbolic link to a target outside its directories"), "{log}");
    assert!(log.contains("plugin denied a hard link"), "{log}");
    // Paths reach the host relative to the granted directory they were resolved in.
    for target in [secret.display().to_string(), "/etc/passwd".into(), climbing, "granted.txt".into()] {
        assert!(log.contains(&format!("target={target}")), "the warning names the target {target}: {log}");
    }
    assert!(log.contains("plugin=scripted"), "the warnings name the plugin: {log}");

    // A relative link within the grant is an ordinary thing to make, and works.
    let row = beside_a_healthy_route(&s, symlink("granted.txt", "/data/alias")).await;
    assert_eq!(row.status, Status::Sent, "{:?}", row.last_error);
    assert_eq!(std::fs::read_link(data.join("alias")).unwrap(), Path::new("granted.txt"));
    let read = beside_a_healthy_route(&s, NewEvent::new("s", "read", "{}").with_header("path", "/data/alias")).await;
    assert_eq!(read.status, Status::Sent, "{:?}", read.last_error);
    assert_eq!(std::fs::read_to_string(&secret).unwrap(), "not for plugins");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_is_or_lies_under_a_symbolic_link_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::write(elsewhere.join("secret.txt"), "not granted").unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&elsewhere, &link).unwrap();

    for (grant, message) in [
        (
            link.clone(),
            format!("granted directory {} (sandbox.scripted.dirs.\"/data\") is a symbolic link", link.display()),
        ),
        (
            link.join("sub"),
            format!(
                "granted directory {} (sandbox.scripted.dirs.\"/data\") lies under {}, which is a symbolic link",
                link.join("sub").display(),
                link.display()
            ),
        ),
    ] {
        let s = start(&format!("{{ \"/data\" = {grant:?} }}")).await;
        let row =
            beside_a_healthy_route(&s, NewEvent::new("s", "read", "{}").with_header("path", "/data/secret.txt")).await;
        assert_eq!(
            (row.status, row.failure_reason.map(|r| r.as_str())),
            (Status::Failed, Some("no_transport")),
            "the route has no usable instance: {:?}",
            row.last_error
        );
        let error = row.last_error.unwrap();
        assert!(error.contains("plugin scripted: ") && error.contains(&message), "{error}");
        assert!(!elsewhere.join("sub").exists(), "nothing was created through the link");
    }
}
