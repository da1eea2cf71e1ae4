//! Unit tests of configuration loading: defaults, overrides, environment variables, errors that
//! name the key, units and resolution.

use super::*;
use crate::backoff::{Backoff, Jitter};

fn err(text: &str) -> String {
    Config::from_toml_str(text, "test.toml").unwrap_err().to_string()
}

fn with_env(text: &str, env: &[(&str, &str)]) -> Result<Config, String> {
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    Config::from_sources(text, "ferry.toml", env).map_err(|e| e.to_string())
}

#[test]
fn environment_variables_override_the_file() {
    let c = with_env(
        "[relay]\nbatch_size = 10\n",
        &[
            ("FERRY_RELAY_BATCH_SIZE", "500"),
            ("FERRY_RELAY_LEASE", "2m"),
            ("FERRY_RETRY_MAX_ATTEMPTS", "unlimited"),
            ("FERRY_RETRY_SCHEDULE", "[\"1s\", \"1m\"]"),
            ("FERRY_PLUGINS_WATCH", "false"),
            ("FERRY_RELAY_INSTANCE_ID", "42"),
            // Read elsewhere, not config keys; and variables of other programs.
            ("FERRY_LOG", "debug"),
            ("FERRY_DATABASE_URL", "postgres://elsewhere"),
            ("PATH", "/usr/bin"),
        ],
    )
    .unwrap();
    assert_eq!(c.relay.batch_size, 500, "the environment beats the file");
    assert_eq!(c.relay.lease.0, std::time::Duration::from_secs(120));
    assert_eq!(c.retry.max_attempts.0, 0, "unlimited");
    assert_eq!(c.retry.schedule.len(), 2);
    assert!(!c.plugins.watch);
    assert_eq!(c.relay.instance_id, "42", "text settings stay text");
    assert_eq!(c.database.url, "sqlite://ferry.db", "FERRY_DATABASE_URL is the CLI's business");
}

#[test]
fn bad_environment_variables_are_named() {
    let unknown = with_env("", &[("FERRY_RELAY_BATCHSIZE", "5")]).unwrap_err();
    assert!(
        unknown.starts_with(
            "invalid config in environment variable FERRY_RELAY_BATCHSIZE: FERRY_RELAY_BATCHSIZE is not a setting"
        ),
        "{unknown}"
    );
    assert!(unknown.contains("FERRY_RELAY_BATCH_SIZE"), "the message lists the real names: {unknown}");
    let bad = with_env("", &[("FERRY_RELAY_BATCH_SIZE", "lots")]).unwrap_err();
    assert!(
        bad.starts_with("invalid config in environment variable FERRY_RELAY_BATCH_SIZE: relay.batch_size:"),
        "{bad}"
    );
    let bad = with_env("", &[("FERRY_RELAY_LEASE", "soon")]).unwrap_err();
    assert!(bad.contains("FERRY_RELAY_LEASE") && bad.contains("soon"), "{bad}");
}

#[test]
fn defaults_are_valid_and_match_the_documented_values() {
    let c = Config::defaults();
    assert_eq!(c.database.url, "sqlite://ferry.db");
    assert_eq!(c.relay.batch_size, 100);
    assert_eq!(c.relay.lease.0, Duration::from_secs(300));
    assert_eq!(c.relay.retain_sent, Retention(Some(Duration::from_secs(7 * 86_400))));
    let p = c.retry_policy_for(None).unwrap();
    assert_eq!(p.max_attempts, 6);
    assert_eq!(p.backoff, Backoff::Exponential { initial: Duration::from_secs(1), max: Duration::from_secs(3600) });
    assert_eq!(p.jitter, Jitter::Symmetric { percent: 10 });
    assert!(!SandboxConfig::default().stdio, "a plugin's raw output is off unless granted");
}

#[test]
fn route_overrides_inherit_the_rest() {
    let c = Config::from_toml_str(
        r#"
        [route.hooks]
        plugin = "http"
        config = { url = "http://x", retries = 3, verbose = true }
        retry = { backoff = "schedule", max_attempts = "unlimited" }
        "#,
        "t",
    )
    .unwrap();
    let p = c.retry_policy_for(Some("hooks")).unwrap();
    assert_eq!(p.max_attempts, 0);
    assert_eq!(p.backoff.base_delay(2), Duration::from_secs(300));
    assert_eq!(p.jitter, Jitter::Symmetric { percent: 10 }, "inherited");
    let cfg = &c.route["hooks"].config;
    assert_eq!(cfg["retries"], ConfigValue("3".into()));
    assert_eq!(cfg["verbose"], ConfigValue("true".into()));
}

#[test]
fn errors_name_the_file_and_key() {
    let e = err("[relay]\nbatch_size = 0");
    assert!(e.contains("test.toml") && e.contains("relay.batch_size"), "{e}");
    // Sizes the pool's bookkeeping up front: four billion slots would abort the process.
    let e = err("[database]\nmax_connections = 4294967295");
    assert!(e.contains("database.max_connections must be between 1 and 10000, got 4294967295"), "{e}");
    assert!(err("[database]\nmax_connections = 0").contains("database.max_connections"));
    // A file is read whole, and the cap plus one must not wrap to a read of nothing.
    let e = err("[plugins]\nmax_file_size = \"18446744073709551615\"");
    assert!(e.contains("plugins.max_file_size must be between 1B and 1024MiB"), "{e}");
    let e = err("[relay]\nbatchsize = 5");
    assert!(e.contains("batchsize"), "{e}");
    let e = err("[relay]\npoll_interval = \"soon\"");
    assert!(e.contains("soon"), "{e}");
    let e = err("[relay]\nlease = \"10s\"");
    assert!(e.contains("relay.lease"), "{e}");
    let e = err("[relay]\nlease = \"25h\"");
    assert!(e.contains("relay.lease (90000s) must be at most 24h"), "{e}");
    // Written into every claim and logged: a line break would forge log lines.
    let e = err(&format!("[relay]\ninstance_id = \"{}\"", "i".repeat(1025)));
    assert!(
        e.contains("relay.instance_id must be at most 1024 bytes without control characters, got 1025 bytes"),
        "{e}"
    );
    let e = err("[relay]\ninstance_id = \"a\\nb\"");
    assert!(e.contains("relay.instance_id") && e.contains("starting \"a\\nb\""), "{e}");
    assert!(Config::from_toml_str(&format!("[relay]\ninstance_id = \"{}\"", "i".repeat(1024)), "t").is_ok());
    let e = err("[route.a]\nplugin = \"log\"\nretry = { max_attempts = 0 }");
    assert!(e.contains("max_attempts"), "{e}");
    let e = err("[route.a]\nplugin = \"log\"\nretry = { jitter_percent = 150 }");
    assert!(e.contains("route.a.retry.jitter_percent"), "{e}");
    let e = err("[route.a]\nplugin = \"log\"\nconfig = { nested = { x = 1 } }");
    assert!(e.contains("table"), "{e}");
    let e = err("[database]\nurl = \"mysql://u:secret@h/db\"");
    assert!(e.contains("database.url") && !e.contains("secret"), "{e}");
    let e = err("[sandbox.log]\ndirs = { \"out\" = \"/tmp\" }");
    assert!(e.contains("sandbox.log.dirs"), "{e}");
    let e = err("[relay]\nretain_sent = \"always\"");
    assert!(e.contains("forever"), "{e}");
    let e = err("[relay]\nidle_poll_max = \"10ms\"");
    assert!(e.contains("relay.idle_poll_max"), "{e}");
    let e = err("[route.a]\nplugin = \"log\"\nordered = true\nordered_after_failure = \"wait\"");
    assert!(e.contains("wait"), "{e}");
    let e = err("[sandbox.kafka]\ntcp = [\"localhost\"]");
    assert!(e.contains("sandbox.kafka.tcp") && e.contains("host:port"), "{e}");
    let e = err("[sandbox.web]\nhttp = [\"ftp://x\"]");
    assert!(e.contains("sandbox.web.http") && e.contains("ftp"), "{e}");
    for key in ["http_connections", "http_open_connections"] {
        let e = err(&format!("[sandbox.web]\n{key} = 0"));
        assert!(e.contains(&format!("sandbox.web.{key}: must be at least 1")), "{e}");
        let e = err(&format!("[sandbox.web]\n{key} = 4000000000"));
        assert!(e.contains(&format!("sandbox.web.{key}: 4000000000 is more than the 1048576 allowed")), "{e}");
    }
    let e = err("[sandbox.slow]\ntimeout = \"10m\"");
    assert!(e.contains("sandbox.slow.timeout") && e.contains("relay.lease"), "{e}");
    let e = err("[plugins]\nmemory = \"lots\"");
    assert!(e.contains("lots"), "{e}");
    let e = err("not toml at all [");
    assert!(e.contains("test.toml"), "{e}");
}

#[test]
fn ordered_routes_and_their_failure_mode() {
    let c = Config::from_toml_str(
        r#"
        [route.a]
        plugin = "p"
        ordered = true
        [route.b]
        plugin = "p"
        ordered = true
        ordered_after_failure = "skip"
        [route.c]
        plugin = "p"
        "#,
        "t",
    )
    .unwrap();
    assert_eq!(c.settings().unwrap().ordered_routes(), (vec!["a".to_string(), "b".to_string()], vec!["a".to_string()]));
    assert_eq!(
        Config::from_toml_str("[relay]\nretain_sent = \"forever\"", "t").unwrap().relay.retain_sent,
        Retention(None)
    );
}

#[test]
fn origins_are_normalized() {
    assert_eq!(normalize_origin("https://Hooks.Example.com").unwrap(), "https://hooks.example.com:443");
    assert_eq!(normalize_origin("http://127.0.0.1:8080/").unwrap(), "http://127.0.0.1:8080");
    assert_eq!(normalize_origin("http://h").unwrap(), "http://h:80");
    for bad in ["h:80", "ftp://h", "https://h/path", "https://", "https://h:", "https://h:65536", "https://u@h"] {
        assert!(normalize_origin(bad).is_err(), "{bad} accepted");
    }
}

#[test]
fn origin_patterns_allow_subdomains_and_nothing_wider() {
    let pattern = normalize_origin_pattern("https://*.Example.com").unwrap();
    assert_eq!(pattern, "https://*.example.com:443");
    let allows = |origin: &str| origin_matches(&pattern, &normalize_origin(origin).unwrap());
    assert!(allows("https://hooks.example.com") && allows("https://a.b.example.com:443"));
    assert!(!allows("https://example.com"), "the wildcard stands for at least one label");
    assert!(!allows("https://evilexample.com") && !allows("https://example.com.evil.net"));
    assert!(!allows("http://hooks.example.com") && !allows("https://hooks.example.com:8443"));
    let numeric = normalize_origin_pattern("http://*.example.com:8080").unwrap();
    assert!(origin_matches(&numeric, "http://x.example.com:8080"));
    assert!(!origin_matches("http://*.0.0.1:80", "http://127.0.0.1:80"), "no wildcard over addresses");
    assert!(!origin_matches("http://*.1:80", "http://[::1]:80"), "no wildcard over addresses");
    assert_eq!(normalize_origin_pattern("http://127.0.0.1:9").unwrap(), "http://127.0.0.1:9");
    for bad in [
        "https://*.com",
        "https://*",
        "https://a.*.example.com",
        "https://*.*.example.com",
        "https://*.10.0.0",
        "https://x*.example.com",
    ] {
        let e = normalize_origin_pattern(bad).unwrap_err();
        assert!(e.contains("wildcard"), "{bad}: {e}");
    }
    let e = err("[sandbox.http]\nhttp = [\"https://*.com\"]\n");
    assert!(e.contains("sandbox.http.http:") && e.contains("subdomains of a domain name"), "{e}");
}

#[test]
fn plugin_limits_take_per_plugin_overrides() {
    let c = Config::from_toml_str("[sandbox.big]\nmemory = \"256MiB\"\ninstances = 4", "t").unwrap();
    let big = c.plugin_limits("big");
    assert_eq!((big.memory, big.instances, big.timeout), (256 << 20, 4, Duration::from_secs(30)));
    assert_eq!(c.plugin_limits("other").memory, 64 << 20);
    assert_eq!(parse_size("512KiB"), Ok(512 << 10));
    assert_eq!(parse_size("1GiB"), Ok(1 << 30));
    assert_eq!(parse_size("100"), Ok(100));
    assert!(parse_size("1.5GiB").is_err() && parse_size("64MB").is_err());
}

#[test]
fn durations_parse_every_unit_and_reject_the_rest() {
    let ok = [("250ms", 250), ("30s", 30_000), ("5m", 300_000), ("2h", 7_200_000), ("1d", 86_400_000)];
    for (text, ms) in ok {
        assert_eq!(parse_duration(text), Ok(Duration::from_millis(ms)), "{text}");
        assert_eq!(format_duration(Duration::from_millis(ms)), text, "written back as configured");
    }
    assert_eq!(format_duration(Duration::from_millis(90_000)), "90s");
    assert_eq!(format_duration(Duration::from_micros(1500)), "1ms");
    assert_eq!(format_duration(Duration::ZERO), "0ms");
    for bad in ["", "5", "m", "1.5s", "-1s", "5 weeks", "99999999999999999999d"] {
        assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
    }
    assert_eq!(parse_duration("36500d"), Ok(Duration::from_secs(36_500 * 86_400)));
    let long = parse_duration("36501d").unwrap_err();
    assert!(long.contains("longer than 36500d (100 years)"), "{long}");
}

#[test]
fn relative_paths_follow_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ferry.toml");
    std::fs::write(
        &file,
        "[database]\nurl = \"sqlite://data/f.db?mode=rwc\"\n[sandbox.log]\ndirs = { \"/out\" = \"out\" }",
    )
    .unwrap();
    let c = Config::load(&file).unwrap();
    assert_eq!(c.database.url, format!("sqlite://{}/data/f.db?mode=rwc", dir.path().display()));
    assert_eq!(c.plugins.dir, dir.path().join("plugins"));
    assert_eq!(c.sandbox["log"].dirs["/out"], dir.path().join("out"));
    let missing = Config::load(&dir.path().join("nope.toml")).unwrap_err().to_string();
    assert!(missing.contains("nope.toml"), "{missing}");
}

#[test]
fn the_admin_api_needs_an_address_and_a_long_token() {
    assert!(Config::defaults().admin.address().is_none(), "off by default");
    let missing = err("[admin]\nlisten = \"127.0.0.1:9464\"");
    assert!(missing.contains("admin.token") && missing.contains("test.toml"), "{missing}");
    let short = err("[admin]\nlisten = \"127.0.0.1:9464\"\ntoken = \"secret\"");
    assert!(short.contains("admin.token must be at least 16 characters"), "{short}");
    let bad = err("[admin]\nlisten = \"localhost\"\ntoken = \"0123456789abcdef\"");
    assert!(bad.contains("admin.listen") && bad.contains("localhost"), "{bad}");
    let env = [("FERRY_ADMIN_TOKEN".to_string(), "0123456789abcdef".to_string())];
    let c = Config::from_sources("[admin]\nlisten = \"127.0.0.1:0\"", "t", env).unwrap();
    assert_eq!(c.admin.bearer_token().unwrap(), "0123456789abcdef");
    assert!(!format!("{c:?}").contains("0123456789abcdef"), "Debug output hides the token");
}

#[test]
fn a_lease_under_twice_a_plugin_timeout_is_warned_about() {
    let warnings =
        |text: &str| Config::from_toml_str(text, "t").expect("valid: a warning, not an error").lease_warnings();
    assert_eq!(warnings(""), Vec::<String>::new(), "the defaults: 5m lease, 30s timeout");
    assert_eq!(warnings("[relay]\nlease = \"61s\"\n"), Vec::<String>::new(), "twice the timeout and a second");
    assert_eq!(warnings("[relay]\nlease = \"60s\"\n").len(), 1, "exactly twice leaves no room for the claim");
    let tight = warnings("[relay]\nlease = \"50s\"\n[sandbox.slow]\ntimeout = \"10s\"\n");
    assert_eq!(tight.len(), 1, "only the default 30s timeout is over half of 50s: {tight:?}");
    for part in
        ["relay.lease (50s)", "plugins.timeout (30s)", "more than about 19s", "at least 61s", "plugins.instances"]
    {
        assert!(tight[0].contains(part), "{part:?} missing: {}", tight[0]);
    }
    let slow = warnings("[relay]\nlease = \"5m\"\n[sandbox.slow]\ntimeout = \"150s\"\n");
    assert_eq!(slow.len(), 1, "{slow:?}");
    assert!(slow[0].contains("sandbox.slow.timeout (150s)") && slow[0].contains("at least 301s"), "{}", slow[0]);
    // What the warning names parses back as a setting.
    let fixed = "[relay]\nlease = \"301s\"\n[sandbox.slow]\ntimeout = \"150s\"\n";
    assert_eq!(warnings(fixed), Vec::<String>::new());
}

#[test]
fn a_postgres_pool_without_a_spare_connection_is_warned_about() {
    let warning = |database: &str, relay: &str| {
        let text = format!("[database]\nurl = \"postgres://ferry@db.internal/outbox\"\n{database}[relay]\n{relay}");
        Config::from_toml_str(&text, "test.toml")
            .expect("valid: a small pool is a warning, not an error")
            .pool_warning()
    };
    assert_eq!(warning("", ""), None, "the defaults (LISTEN, 8 connections) leave room");
    // The relay's claims and outcome writes run on its own connections: workers take none.
    assert_eq!(warning("max_connections = 3\n", "workers = 64\n"), None, "LISTEN, the relay's others, one spare");
    let tight = warning("max_connections = 2\n", "").expect("no spare");
    for part in ["database.max_connections (2)", "LISTEN holds one", "the admin API", "to at least 3"] {
        assert!(tight.contains(part), "{part:?} missing: {tight}");
    }
    assert_eq!(warning("max_connections = 2\n", "listen = false\n"), None, "without LISTEN one fewer is needed");
    let quiet = warning("max_connections = 1\n", "listen = false\n").expect("no spare without LISTEN either");
    assert!(quiet.ends_with("to at least 2") && !quiet.contains("LISTEN"), "{quiet}");
    let postgresql = "[database]\nurl = \"postgresql://db.internal/outbox\"\nmax_connections = 2\n";
    assert!(Config::from_toml_str(postgresql, "t").unwrap().pool_warning().is_some(), "either URL scheme");
    // SQLite's relay writes take turns on a connection of their own.
    let sqlite = "[database]\nmax_connections = 1\n[relay]\nworkers = 16\n";
    assert_eq!(Config::from_toml_str(sqlite, "t").unwrap().pool_warning(), None);
}

#[test]
fn relay_connections_are_bounded() {
    let e = err("[database]\nrelay_connections = 0");
    assert!(e.contains("database.relay_connections must be between 1 and 10000, got 0"), "{e}");
    assert!(err("[database]\nrelay_connections = 10001").contains("database.relay_connections"));
    let ok = Config::from_toml_str("[database]\nrelay_connections = 4", "t").unwrap();
    assert_eq!(ok.database.relay_connections, 4);
}

#[test]
fn the_admin_token_can_come_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ferry.toml");
    std::fs::write(&file, "[admin]\nlisten = \"127.0.0.1:0\"\ntoken_file = \"token\"").unwrap();
    let c = Config::load(&file).unwrap();
    let unreadable = c.admin.bearer_token().unwrap_err();
    assert!(unreadable.contains("admin.token_file") && unreadable.contains("token"), "{unreadable}");
    std::fs::write(dir.path().join("token"), "short\n").unwrap();
    assert!(c.admin.bearer_token().unwrap_err().contains("at least 16"));
    std::fs::write(dir.path().join("token"), "  0123456789abcdefXYZ\n").unwrap();
    assert_eq!(c.admin.bearer_token().unwrap(), "0123456789abcdefXYZ");
    // Given inline (FERRY_ADMIN_TOKEN=$(cat file) keeps no newline, a heredoc does), the same.
    let mut inline = c.admin.clone();
    inline.token = "0123456789abcdefXYZ\n".into();
    assert_eq!(inline.bearer_token().unwrap(), "0123456789abcdefXYZ");
}

#[test]
fn the_container_config_is_valid_with_a_token_from_the_environment() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/container.toml");
    let no_token = Config::load(&path).unwrap_err().to_string();
    assert!(no_token.contains("admin.token"), "{no_token}");
    let env = [("FERRY_ADMIN_TOKEN".to_string(), "0123456789abcdef".to_string())];
    let c = Config::load_with_env(&path, env).unwrap();
    assert_eq!(c.admin.address(), Some("0.0.0.0:9464".parse().unwrap()));
    assert_eq!(c.plugins.dir, Path::new("/var/lib/ferry/plugins"));
    // Every file the image copies from the build context exists.
    let containerfile = std::fs::read_to_string(path.with_file_name("Containerfile")).unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for line in containerfile.lines().filter(|l| l.starts_with("COPY ") && !l.contains("--from")) {
        let source = line.split_whitespace().nth(1).unwrap();
        assert!(source == "." || root.join(source).exists(), "{line}: {source} is missing");
    }
}

#[test]
fn granted_directories_must_not_overlap_each_other_or_ferrys_own_files() {
    let base = "[database]\nurl = \"sqlite:///srv/ferry/ferry.db\"\n[plugins]\ndir = \"/srv/ferry/plugins\"\n\
                cache_dir = \"/srv/ferry/cache\"\n[admin]\ntoken_file = \"/etc/ferry/token\"\n";
    let load = |grants: &str| Config::from_toml_str(&format!("{base}{grants}"), "test.toml").map_err(|e| e.to_string());
    // Side by side is fine, even with a common prefix that is not a whole component.
    load("[sandbox.a]\ndirs = { \"/a\" = \"/srv/out/a\" }\n[sandbox.b]\ndirs = { \"/b\" = \"/srv/out/b\", \"/c\" = \"/srv/out/ab\" }")
        .unwrap();

    let nested =
        load("[sandbox.a]\ndirs = { \"/a\" = \"/tmp/x\" }\n[sandbox.b]\ndirs = { \"/b\" = \"/tmp/y/../x/./inner\" }")
            .unwrap_err();
    assert!(
        nested.contains(r#"sandbox.b.dirs."/b" (/tmp/x/inner) lies inside sandbox.a.dirs."/a" (/tmp/x)"#),
        "both keys and the normalized paths are named: {nested}"
    );
    assert!(nested.contains("side by side"), "the message says how to fix it: {nested}");
    let outer = load("[sandbox.a]\ndirs = { \"/a\" = \"/tmp/x/inner\" }\n[sandbox.b]\ndirs = { \"/b\" = \"/tmp/x\" }")
        .unwrap_err();
    assert!(outer.contains(r#"sandbox.b.dirs."/b" (/tmp/x) contains sandbox.a.dirs."/a" (/tmp/x/inner)"#), "{outer}");
    let twice = load("[sandbox.a]\ndirs = { \"/a\" = \"/tmp/x\", \"/b\" = \"/tmp/x/\" }").unwrap_err();
    assert!(twice.contains(r#"sandbox.a.dirs."/b" (/tmp/x) is the same path as sandbox.a.dirs."/a""#), "{twice}");

    for (grant, key, path) in [
        ("/srv/ferry", "plugins.dir", "/srv/ferry/plugins"),
        ("/srv/ferry/plugins/drop", "plugins.dir", "/srv/ferry/plugins"),
        ("/srv/ferry/cache", "plugins.cache_dir", "/srv/ferry/cache"),
        ("/etc/ferry", "admin.token_file", "/etc/ferry/token"),
    ] {
        let e = load(&format!("[sandbox.log]\ndirs = {{ \"/out\" = {grant:?} }}")).unwrap_err();
        assert!(
            e.contains(&format!("sandbox.log.dirs.\"/out\" ({grant})")) && e.contains(&format!("{key} ({path})")),
            "{e}"
        );
    }
    let db = Config::from_toml_str(
        "[database]\nurl = \"sqlite:///srv/db/ferry.db?mode=rwc\"\n[sandbox.log]\ndirs = { \"/out\" = \"/srv/db\" }",
        "test.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(db.contains(r#"sandbox.log.dirs."/out" (/srv/db) contains database.url (/srv/db/ferry.db)"#), "{db}");
    assert!(db.contains("outbox database"), "{db}");
    // No cache, no check against it; PostgreSQL has no file to protect.
    Config::from_toml_str(
        "[database]\nurl = \"postgres://u@h/db\"\n[plugins]\ncache_dir = \"\"\n[sandbox.log]\ndirs = { \"/out\" = \"/srv/x\" }",
        "test.toml",
    )
    .unwrap();
}

#[test]
fn grants_are_compared_after_paths_follow_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ferry.toml");
    let db = dir.path().join("ferry.db");
    std::fs::write(
        &file,
        format!("[database]\nurl = \"sqlite://{}\"\n[sandbox.log]\ndirs = {{ \"/out\" = \".\" }}", db.display()),
    )
    .unwrap();
    let e = Config::load(&file).unwrap_err().to_string();
    assert!(e.contains("ferry.toml") && e.contains("contains plugins.dir"), "relative paths are resolved first: {e}");
}

#[test]
fn dead_letters_name_another_route_and_do_not_chain() {
    let settings = |routes: &str| {
        Config::from_toml_str(routes, "test.toml")
            .map_err(|e| e.to_string())
            .and_then(|c| c.settings().map_err(|e| e.to_string()))
    };
    let ok = settings("[route.a]\nplugin = \"http\"\ndead_letter = \"b\"\n[route.b]\nplugin = \"log\"\n").unwrap();
    assert_eq!(ok.route("a").unwrap().dead_letter.as_deref(), Some("b"));
    for (routes, expected) in [
        ("[route.a]\nplugin = \"http\"\ndead_letter = \"nowhere\"\n", "route.a.dead_letter: no route \"nowhere\""),
        ("[route.a]\nplugin = \"http\"\ndead_letter = \"a\"\n", "its own dead letter"),
        (
            "[route.a]\nplugin = \"http\"\ndead_letter = \"b\"\n[route.b]\nplugin = \"log\"\ndead_letter = \"c\"\n\
             [route.c]\nplugin = \"log\"\n",
            "dead letters do not chain",
        ),
    ] {
        let e = settings(routes).unwrap_err();
        assert!(e.contains(expected), "{e}");
    }
}

#[test]
fn destinations_become_routes_of_their_own_with_inherited_settings() {
    let text = r#"
        [retry]
        max_attempts = 9
        [route.orders]
        ordered = true
        dead_letter = "dlq"
        retry = { max_attempts = 4, backoff = "fixed", initial = "2s" }
        [route.orders.destinations.crm]
        plugin = "http"
        config = { url = "https://crm.example/hook" }
        event_types = ["order.*"]
        [route.orders.destinations.audit]
        plugin = "log"
        retry = { max_attempts = 7 }
        [route.dlq]
        plugin = "log"
    "#;
    let settings = Config::from_toml_str(text, "t").unwrap().settings().unwrap();
    assert!(settings.route("orders").is_none(), "the route itself has no plugin");
    assert!(settings.is_configured("orders") && settings.is_configured("orders/crm"));
    assert_eq!(settings.route_names(), ["dlq", "orders", "orders/audit", "orders/crm"]);
    let crm = settings.route("orders/crm").unwrap();
    assert_eq!((crm.plugin.as_str(), crm.destination_of.as_deref()), ("http", Some("orders")));
    assert_eq!(crm.plugin_config, [("url".to_string(), "https://crm.example/hook".to_string())]);
    assert_eq!(crm.retry.max_attempts, 4, "the route's retry overrides reach its destinations");
    assert_eq!(crm.retry.backoff, Backoff::Fixed { delay: std::time::Duration::from_secs(2) });
    assert_eq!(crm.dead_letter.as_deref(), Some("dlq"));
    assert_eq!(crm.ordering, settings::Ordering::Ordered { failed_blocks_key: true });
    let audit = settings.route("orders/audit").unwrap();
    assert_eq!(audit.retry.max_attempts, 7, "a destination's own overrides come first");
    assert_eq!(audit.retry.backoff, Backoff::Fixed { delay: std::time::Duration::from_secs(2) });
    let (ordered, _) = settings.ordered_routes();
    assert_eq!(ordered, ["orders/audit", "orders/crm", "orders"], "the route hands its events on in order too");
    let fan_out = &settings.fan_outs["orders"];
    assert_eq!(fan_out.routes_for("order.created").collect::<Vec<_>>(), ["orders/audit", "orders/crm"]);
    assert_eq!(fan_out.routes_for("invoice.paid").collect::<Vec<_>>(), ["orders/audit"]);
}

#[test]
fn destinations_are_checked_with_the_key_named() {
    let settings = |text: &str| {
        Config::from_toml_str(text, "t")
            .map_err(|e| e.to_string())
            .and_then(|c| c.settings().map_err(|e| e.to_string()))
    };
    for (text, expected) in [
        (
            "[route.o]\nplugin = \"log\"\n[route.o.destinations.a]\nplugin = \"http\"\n",
            "route.o: a route with destinations or endpoints has no plugin or config of its own",
        ),
        ("[route.o.destinations.a]\nconfig = { x = \"1\" }\n", "route.o.destinations.a: missing field `plugin`"),
        ("[route.o.destinations.a]\nplugin = \" \"\n", "route.o.destinations.a.plugin must name a plugin"),
        ("[route.\"o/p\"]\nplugin = \"log\"\n", "must not be empty or contain '/'"),
        ("[route.\"(not configured)\"]\nplugin = \"log\"\n", "the metrics use this name for routes not configured"),
        ("[route.\"(not claimed)\"]\nplugin = \"log\"\n", "the metrics use this name for routes not configured"),
        ("[route.o.destinations.\"a/b\"]\nplugin = \"log\"\n", "route.o.destinations.a/b: a destination's name"),
        ("[route.o.destinations.a]\nplugin = \"log\"\nevent_types = [\"\"]\n", "route.o.destinations.a.event_types"),
        ("[route.o.destinations.a]\nplugin = \"log\"\nretry = { initial = \"0s\" }\n", "route.o.destinations.a.retry."),
        ("[route.o.destinations.a]\nplugin = \"log\"\nfilter = [\"x\"]\n", "unknown field `filter`"),
        ("[route.o]\n", "route.o.plugin must name a plugin (or give the route destinations)"),
    ] {
        let e = settings(text).unwrap_err();
        assert!(e.contains(expected), "{text}: {e}");
    }
}

#[test]
fn endpoints_resolve_to_a_template_route() {
    let text = r#"
        [route.hooks]
        ordered = true
        retry = { max_attempts = 4 }
        [route.hooks.endpoints]
        origins = ["https://*.example.com", "HTTP://127.0.0.1:8080"]
        config = { timeout_ms = "500" }
        retry = { backoff = "fixed", initial = "2s" }
        [route.hooks.destinations.audit]
        plugin = "log"
    "#;
    let settings = Config::from_toml_str(text, "t").unwrap().settings().unwrap();
    let endpoints = settings.fan_outs["hooks"].endpoints.clone().expect("the route takes endpoints");
    assert_eq!(endpoints.template, "hooks/*");
    assert_eq!(endpoints.origins, ["https://*.example.com:443", "http://127.0.0.1:8080"]);
    let template = settings.route("hooks/*").unwrap();
    assert_eq!((template.plugin.as_str(), template.destination_of.as_deref()), ("http", Some("hooks")));
    assert!(template.plugin_config.contains(&("url".to_string(), settings::TEMPLATE_URL.to_string())));
    assert!(template.plugin_config.contains(&("timeout_ms".to_string(), "500".to_string())));
    assert_eq!(template.retry.max_attempts, 4, "the route's retry reaches its endpoints");
    assert_eq!(template.retry.backoff, Backoff::Fixed { delay: std::time::Duration::from_secs(2) });
    // An endpoint's deliveries are the template's; other names under the route are not.
    let delivery = "hooks/ep_0123456789abcdef0123";
    assert_eq!(settings.route(delivery).map(|r| r.name.as_str()), Some("hooks/*"));
    assert!(settings.is_configured(delivery) && !settings.is_configured("hooks/other"));
    assert!(settings.route("plain/ep_0123456789abcdef0123").is_none());
    assert_eq!(settings.retry(delivery).max_attempts, 4);
    // Only ids as ferry makes them: a row cannot name endless endpoint deliveries.
    for forged in ["hooks/ep_0123", "hooks/ep_0123456789abcdef012\"", "hooks/ep_0123456789ABCDEF0123"] {
        assert!(!settings.is_configured(forged) && settings.route(forged).is_none(), "{forged}");
    }
}

#[test]
fn endpoints_are_checked_with_the_key_named() {
    let settings = |text: &str| {
        Config::from_toml_str(text, "t")
            .map_err(|e| e.to_string())
            .and_then(|c| c.settings().map_err(|e| e.to_string()))
    };
    for (text, expected) in [
        (
            "[route.o.endpoints]
",
            "route.o.endpoints.origins must list the origins",
        ),
        (
            "[route.o.endpoints]
origins = [\"https://*.com\"]
",
            "route.o.endpoints.origins: \"https://*.com\"",
        ),
        (
            "[route.o.endpoints]
origins = [\"https://a.example\"]
config = { url = \"https://x\" }
",
            "route.o.endpoints.config.url: each endpoint sets its own",
        ),
        (
            "[route.o.endpoints]
origins = [\"https://a.example\"]
config = { \"header.x\" = \"1\" }
",
            "route.o.endpoints.config.header.x",
        ),
        (
            "[route.o.endpoints]
origins = [\"https://a.example\"]
plugin = \"\"
",
            "route.o.endpoints.plugin",
        ),
        (
            "[route.o.endpoints]
origins = [\"https://a.example\"]
[route.o.destinations.ep_x]
plugin = \"log\"
",
            "kept for the route's endpoints",
        ),
        (
            "[route.o.destinations.\"*\"]
plugin = \"log\"
",
            "kept for the route's endpoints",
        ),
    ] {
        let e = settings(text).unwrap_err();
        assert!(e.contains(expected), "{text}: {e}");
    }
}

#[test]
fn event_type_patterns_match_runs_of_characters() {
    let types = |patterns: &[&str]| {
        settings::EventTypes::new(&patterns.iter().map(|p| p.to_string()).collect::<Vec<_>>()).unwrap()
    };
    let order = types(&["order.*"]);
    assert!(order.matches("order.created") && order.matches("order.line.added") && order.matches("order."));
    assert!(!order.matches("order") && !order.matches("orders.created") && !order.matches("x.order.created"));
    let mixed = types(&["invoice.paid", "*.refunded", "a*b*c"]);
    assert!(mixed.matches("invoice.paid") && !mixed.matches("invoice.paid.late"));
    assert!(mixed.matches("order.refunded") && mixed.matches(".refunded") && !mixed.matches("refunded"));
    assert!(mixed.matches("abc") && mixed.matches("aXbYbZc") && !mixed.matches("acb"));
    assert!(types(&[]).matches("anything") && types(&["*"]).matches(""));
    assert!(types(&["é.*"]).matches("é.x") && !types(&["é.*"]).matches("e.x"));
    assert!(types(&["a*a"]).matches("aa") && !types(&["a*a"]).matches("a") && types(&["**"]).matches("x"));
    assert!(types(&["*ab*ab*"]).matches("abab") && !types(&["*ab*ab*"]).matches("aba"));
    // Long patterns against a long type of near misses: 100 patterns of 200 bytes, as many as an
    // endpoint may have, against a megabyte. A glob that tries each star's every end (ferry's did)
    // takes 2·10^10 steps for this one endpoint, minutes here; looking for each piece once, 10^8.
    let long = "a".repeat(1 << 20);
    let near_misses: Vec<String> = (0..100).map(|i| format!("*{}b{i}*", "a".repeat(190))).collect();
    assert!(!types(&near_misses.iter().map(String::as_str).collect::<Vec<_>>()).matches(&long));
    assert!(!types(&["*a*a*a*a*a*a*a*a*b"]).matches(&long));
}
