//! What a plugin author does, with the real tools: `ferry plugins new` writes a project outside
//! the repository in each language, the language's own toolchain builds it, `ferry plugins check`
//! accepts it, and `ferry plugins try` runs it on the sample events it came with. Then `try`
//! itself: the sandbox and limits it applies, and what it reports when a plugin misbehaves.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crate::common::{Receiver, built_plugin, ferry_bin, target_dir};

/// Runs `ferry ARGS` in `dir`, with `stdin` as standard input.
fn ferry(dir: &Path, args: &[&str], stdin: &str) -> Output {
    use std::io::Write as _;
    let mut child = Command::new(ferry_bin())
        .args(args)
        .current_dir(dir)
        .env_remove("FERRY_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("ferry runs");
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A ferry.toml that keeps compiled plugin code where the other tests keep theirs, so a component
/// is compiled once for `check` and `try`.
fn cached_config(dir: &Path) -> PathBuf {
    let path = dir.join("ferry.toml");
    let cache = target_dir().join("test-plugin-cache");
    std::fs::write(&path, format!("[plugins]\ncache_dir = {cache:?}\ntimeout = \"20s\"\n")).unwrap();
    path
}

/// `ferry --config CONFIG plugins try PLUGIN REST…`'s arguments.
fn try_args(config: &Path, plugin: &Path, rest: &[&str]) -> Vec<String> {
    let head = ["--config", config.to_str().unwrap(), "plugins", "try", plugin.to_str().unwrap()];
    head.iter().chain(rest).map(|a| a.to_string()).collect()
}

/// Runs a build command the scaffold printed, in `dir`.
fn build(dir: &Path, program: &str, args: &[&str], envs: &[(&str, &Path)]) {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .envs(envs.iter().map(|(k, v)| (*k, *v)))
        .output()
        .unwrap_or_else(|e| panic!("{program} could not run: {e}"));
    assert!(out.status.success(), "{program} {args:?} failed in {}:\n{}", dir.display(), text(&out));
}

/// Scaffolds plugin `name` in `lang` into a new directory outside the repository, checks what
/// `new` printed, and returns the project directory.
fn scaffold(outside: &Path, name: &str, lang: &str, build_command: &str) -> PathBuf {
    let dir = outside.join(name);
    let out = ferry(outside, &["plugins", "new", name, "--lang", lang, dir.to_str().unwrap()], "");
    assert!(out.status.success(), "{}", text(&out));
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(printed.contains(build_command), "the build command is printed: {printed}");
    assert!(dir.join("README.md").is_file() && dir.join("events.jsonl").is_file(), "{printed}");
    let again = ferry(outside, &["plugins", "new", name, "--lang", lang, dir.to_str().unwrap()], "");
    assert_eq!(again.status.code(), Some(1), "a project is not written over another");
    assert!(text(&again).contains("already exists and is not empty"), "{}", text(&again));
    dir
}

/// `check` accepts the component as plugin `name` of `version`, and `try` on the project's sample
/// events delivers the text ones and refuses the bytes that are not UTF-8, saying so.
fn check_and_try(project: &Path, component: &Path, name: &str, version: &str) {
    let config = cached_config(project);
    let config = config.to_str().unwrap();
    let wasm = component.to_str().unwrap();
    let out = ferry(project, &["--config", config, "plugins", "check", "--json", wasm], "");
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((report["name"].as_str(), report["version"].as_str()), (Some(name), Some(version)), "{report}");

    let out = ferry(project, &["--config", config, "plugins", "try", wasm, "--events", "events.jsonl"], "");
    let printed = text(&out);
    assert_eq!(out.status.code(), Some(1), "one sample event is refused, so not every event succeeded: {printed}");
    for line in [
        format!("plugin {name} {version}"),
        "init: ok, route \"try\"".into(),
        "call 1: 3 events in".into(),
        "event 1 order.created: success".into(),
        "event 2 note: success".into(),
        "event 3 blob: permanent: payload is not UTF-8 text".into(),
        "log info  2 note: hello from ferry plugins try".into(),
        "2 of 3 events succeeded".into(),
    ] {
        assert!(printed.contains(&line), "missing {line:?} in:\n{printed}");
    }

    // The route's config, events from standard input, JSON out: every event succeeds, exit 0.
    let events = "{\"type\": \"note\", \"payload\": \"hi\"}\n{\"id\": 9, \"payload\": {\"n\": 1}}\n";
    let out = ferry(
        project,
        &["--config", config, "--json", "plugins", "try", wasm, "--set", "prefix=audit: ", "--events", "-"],
        events,
    );
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((report["succeeded"].as_u64(), report["events"].as_u64()), (Some(2), Some(2)), "{report}");
    let logs: Vec<&str> =
        report["calls"][0]["logs"].as_array().unwrap().iter().filter_map(|l| l["message"].as_str()).collect();
    assert_eq!(logs, ["audit: 1 note: hi", "audit: 9 ferry.try: {\"n\":1}"], "{report}");

    // A key the plugin does not know: init refuses the route, naming it.
    let out = ferry(project, &["--config", config, "plugins", "try", wasm, "--set", "prefx=1"], "");
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("init: failed") && text(&out).contains("unknown config key"), "{}", text(&out));
}

#[test]
fn a_rust_transport_starts_from_plugins_new_and_runs_with_plugins_try() {
    let outside = tempfile::tempdir().unwrap();
    let project = scaffold(outside.path(), "audit-log", "rust", "cargo build --release");
    let readme = std::fs::read_to_string(project.join("README.md")).unwrap();
    assert!(readme.contains("target/wasm32-wasip2/release/audit_log.wasm"), "the README names the component: {readme}");
    // The author's own version reaches `metadata` (`transport!` reads CARGO_PKG_VERSION).
    let manifest = std::fs::read_to_string(project.join("Cargo.toml")).unwrap();
    std::fs::write(project.join("Cargo.toml"), manifest.replace("version = \"0.1.0\"", "version = \"3.4.5\"")).unwrap();
    // A target directory of its own, kept between runs: the build is cached after the first.
    let target = target_dir().join("outside-sdk");
    build(&project, env!("CARGO"), &["build", "--release", "--quiet"], &[("CARGO_TARGET_DIR", &target)]);
    check_and_try(&project, &target.join("wasm32-wasip2/release/audit_log.wasm"), "audit-log", "3.4.5");
}

#[test]
fn a_javascript_transport_starts_from_plugins_new_and_runs_with_plugins_try() {
    let outside = tempfile::tempdir().unwrap();
    let project = scaffold(outside.path(), "hook", "javascript", "npm install && npm run build");
    // npm's cache already holds componentize-js: scripts/build-plugins installed the same
    // version for plugins/webhook-js.
    build(&project, "npm", &["install", "--prefer-offline", "--no-audit", "--no-fund", "--loglevel=error"], &[]);
    build(&project, "npm", &["run", "--silent", "build"], &[]);
    check_and_try(&project, &project.join("hook.wasm"), "hook", "0.1.0");
}

#[test]
fn a_python_transport_starts_from_plugins_new_and_runs_with_plugins_try() {
    let outside = tempfile::tempdir().unwrap();
    let project = scaffold(outside.path(), "spooler", "python", "componentize-py -d wit -w transport-plugin");
    // The build command exactly as printed: a virtualenv of the project's own, componentize-py
    // from requirements.txt (pip's cache has it from scripts/build-plugins).
    let readme = std::fs::read_to_string(project.join("README.md")).unwrap();
    let command = readme.lines().map(str::trim).find(|l| l.starts_with("python3 -m venv")).expect("build command");
    build(&project, "sh", &["-c", command], &[]);
    check_and_try(&project, &project.join("spooler.wasm"), "spooler", "0.1.0");
}

/// `try` runs the plugin in the sandbox `--sandbox-toml` describes, with its limits: a granted
/// directory can be read and everything else is refused and reported; a call that traps or runs
/// past the timeout is a fault of its whole call, as `serve` would record it.
#[test]
fn plugins_try_applies_the_sandbox_and_reports_refusals_and_faults() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::write(data.join("greeting"), "hello").unwrap();
    // Relative to the sandbox file, as in ferry.toml.
    // Long enough for five quick events on a loaded machine; the spinning event waits it out.
    std::fs::write(dir.path().join("sandbox.toml"), "dirs = { \"/data\" = \"data\" }\ntimeout = \"2s\"\n").unwrap();
    let config = cached_config(dir.path());
    let events = [
        r#"{"type": "read", "headers": {"path": "/data/greeting"}}"#,
        r#"{"type": "read", "headers": {"path": "/data/../../etc/hostname"}}"#,
        r#"{"type": "connect", "headers": {"addr": "127.0.0.1:9"}}"#,
        r#"{"type": "transient", "headers": {"retry-after-ms": "1500"}}"#,
        r#"{"type": "log", "headers": {"message": "line\nforged"}}"#,
        r#"{"type": "trap"}"#,
        r#"{"type": "spin"}"#,
    ]
    .join("\n");
    let plugin = built_plugin("ferry_test_scripted");
    let args = try_args(&config, &plugin, &["--sandbox-toml", "sandbox.toml", "--events", "-", "--batch-size", "5"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = ferry(dir.path(), &args, &events);
    let printed = text(&out);
    assert_eq!(out.status.code(), Some(1), "{printed}");
    for line in [
        "call 1: 5 events in",
        "event 1 read: success",
        "event 2 read: permanent",
        "event 3 connect: permanent",
        "event 4 transient: transient: ",
        "(retry after 1500 ms)",
        "event 5 log: success",
        // A plugin's line cannot forge another: the newline is escaped.
        "log warn  line\\nforged",
        "refused   plugin denied access to a path outside its directories (path=",
        "refused   plugin denied network access to an address not on its tcp allowlist (addr=127.0.0.1:9",
        "call 2: 2 events in",
        "plugin trapped",
        "event 6 trap: transient: plugin trapped",
        "2 of 7 events succeeded",
    ] {
        assert!(printed.contains(line), "missing {line:?} in:\n{printed}");
    }

    // Limits `serve` would refuse are refused here too, naming the key.
    std::fs::write(dir.path().join("zero.toml"), "instances = 0\n").unwrap();
    let zero: Vec<&str> = args.iter().map(|a| if *a == "sandbox.toml" { "zero.toml" } else { a }).collect();
    let out = ferry(dir.path(), &zero, "{}");
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("instances"), "{}", text(&out));

    // The spinning event alone, so the timeout from the sandbox file is what ends the call.
    let args_spin: Vec<&str> = args.iter().copied().filter(|a| *a != "--batch-size" && *a != "5").collect();
    let out = ferry(dir.path(), &args_spin, r#"{"type": "spin"}"#);
    assert!(text(&out).contains("plugin timed out after 2s"), "{}", text(&out));
}

/// A plugin granted an origin reaches it through `try`, and one that is not is refused: the
/// shipped `http` transport against a local receiver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plugins_try_sends_http_only_to_granted_origins() {
    let receiver = Receiver::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = cached_config(dir.path());
    let plugin = built_plugin("ferry_transport_http");
    let url = receiver.url("/in");
    let run = |grant: String| {
        std::fs::write(dir.path().join("sandbox.toml"), format!("[sandbox.http]\nhttp = [{grant:?}]\n")).unwrap();
        let args = try_args(&config, &plugin, &["--set", &format!("url={url}"), "--sandbox-toml", "sandbox.toml"]);
        ferry(dir.path(), &args.iter().map(String::as_str).collect::<Vec<_>>(), "")
    };
    let granted = tokio::task::block_in_place(|| run(format!("http://{}", receiver.addr)));
    assert!(granted.status.success(), "{}", text(&granted));
    let requests = receiver.requests();
    assert_eq!(requests.len(), 1, "the sample event reached the receiver");
    assert_eq!(requests[0].body, br#"{"hello":"from ferry plugins try"}"#, "the sample event's JSON payload");

    let refused = tokio::task::block_in_place(|| run("http://127.0.0.1:1".into()));
    let printed = text(&refused);
    assert_eq!(refused.status.code(), Some(1), "{printed}");
    assert!(
        printed.contains("refused   plugin denied an HTTP request to an origin not on its http allowlist"),
        "{printed}"
    );
    assert_eq!(receiver.requests().len(), 1, "nothing more reached the receiver");
}
