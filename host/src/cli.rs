//! The `ferry` command line: parse arguments, load the configuration, run one command.

use std::io::Read as _;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, SystemClock};
use crate::config::{Config, parse_duration};
use crate::event::{AttemptRecord, Status};
use crate::event::{EventRecord, NewEvent};
use crate::plugins::{Registry, Runtime};
use crate::report;
use crate::service;
use crate::store::{self, BulkOp, FailedFilter, Stats, Store};

/// Delivers events from a transactional outbox through WebAssembly transport plugins.
#[derive(Debug, Parser)]
#[command(name = "ferry", version, about)]
pub struct Cli {
    /// Configuration file. Without it, ./ferry.toml is used if present, else the built-in defaults.
    #[arg(long, short, global = true, env = "FERRY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Overrides database.url from the configuration file.
    #[arg(long, global = true, env = "FERRY_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Print JSON instead of text (the shapes the admin API answers with).
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the relay until SIGTERM or Ctrl-C.
    Serve,
    /// Create or upgrade the outbox schema, then exit.
    Migrate,
    /// Insert one event into the outbox.
    Emit(EmitArgs),
    /// Make FAILED events PENDING again (attempts and error reset) so the relay delivers them.
    Resend {
        /// Ids of the FAILED events.
        #[arg(required = true)]
        ids: Vec<i64>,
    },
    /// Inspect transport plugins.
    #[command(subcommand)]
    Plugins(PluginsCommand),
    /// Count, list, resend or purge FAILED events, narrowed by route, type and creation time.
    #[command(subcommand)]
    Failed(FailedCommand),
    /// Show one event: its fields, last error and payload.
    Show { id: i64 },
    /// Show, open or close the per-route circuit breakers.
    #[command(subcommand)]
    Breaker(BreakerCommand),
    /// Show how many events are in each status.
    Status,
    /// Ask the running ferry (through its admin API, `admin.listen`) whether it is ready: exit 0
    /// if it is, 1 otherwise. For container health checks.
    Health {
        /// Only check that the process answers (liveness), not the database and plugins.
        #[arg(long)]
        live: bool,
    },
    /// Monitoring figures: events per route and status, oldest pending event, claim lag, stuck
    /// claims, events on their last attempt, and delivery latency percentiles.
    Stats {
        /// Measure latency over events delivered this long ago or less.
        #[arg(long, default_value = "1h", value_parser = parse_duration)]
        window: std::time::Duration,
    },
}

/// Which FAILED events a command applies to.
#[derive(Debug, clap::Args)]
pub struct FilterArgs {
    /// Only events of this route.
    #[arg(long)]
    route: Option<String>,
    /// Only events of this type.
    #[arg(long = "type", value_name = "TYPE")]
    event_type: Option<String>,
    /// Only events created at or after this time (RFC 3339, e.g. 2026-11-26T08:00:00Z).
    #[arg(long, value_parser = parse_time)]
    from: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events created before this time (RFC 3339).
    #[arg(long, value_parser = parse_time)]
    before: Option<chrono::DateTime<chrono::Utc>>,
}

impl FilterArgs {
    fn filter(self) -> anyhow::Result<FailedFilter> {
        if let (Some(from), Some(before)) = (self.from, self.before)
            && from >= before
        {
            bail!("--from ({from}) must be earlier than --before ({before})");
        }
        Ok(FailedFilter {
            route: self.route,
            event_type: self.event_type,
            from: self.from,
            before: self.before,
            after_id: None,
        })
    }
}

fn parse_time(text: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|e| format!("expected an RFC 3339 time such as 2026-11-26T08:00:00Z, got {text:?} ({e})"))
}

#[derive(Debug, Subcommand)]
pub enum FailedCommand {
    /// How many FAILED events match.
    Count {
        #[command(flatten)]
        filter: FilterArgs,
    },
    /// FAILED events in id order, a page at a time.
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// Start after this id (the last id of the previous page).
        #[arg(long)]
        after: Option<i64>,
        /// Events per page.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
    },
    /// Make the matching FAILED events PENDING again (attempts and error reset).
    Resend {
        #[command(flatten)]
        filter: FilterArgs,
        /// Required to resend every FAILED event when no filter is given.
        #[arg(long)]
        all: bool,
    },
    /// Delete the matching FAILED events for good.
    Purge {
        #[command(flatten)]
        filter: FilterArgs,
        /// Required to purge every FAILED event when no filter is given.
        #[arg(long)]
        all: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum BreakerCommand {
    /// Every route whose breaker has a history: state, consecutive failures, since when, why.
    List,
    /// Open a route's breaker by hand: its events wait until it is closed by hand.
    Open {
        route: String,
        /// Why, shown in `breaker list`.
        #[arg(long, default_value = "opened by an operator")]
        reason: String,
    },
    /// Close a route's breaker (by hand or not) and reset its failure count.
    Close { route: String },
}

#[derive(Debug, Subcommand)]
pub enum PluginsCommand {
    /// Load every plugin in the plugins directory and show what each is and which routes use it.
    List,
    /// Make the running ferry (through its admin API, `admin.listen`) reload every plugin file now.
    Reload,
    /// Check that FILE is a transport ferry can load: a component of the transport world, with imports
    /// ferry provides, built for a compatible contract version.
    Check {
        /// The component to check.
        file: PathBuf,
    },
}

#[derive(Debug, clap::Args)]
pub struct EmitArgs {
    /// Route to deliver through (a [route.NAME] table in the config).
    pub route: String,
    /// Event type, e.g. order.created.
    pub event_type: String,
    /// Payload text; `-` reads standard input. Use --file for a file.
    #[arg(conflicts_with = "file")]
    pub payload: Option<String>,
    /// Read the payload from this file.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Ordering key.
    #[arg(long)]
    pub key: Option<String>,
    /// Header as NAME=VALUE; may be repeated.
    #[arg(long = "header", value_name = "NAME=VALUE")]
    pub headers: Vec<String>,
    /// MIME type of the payload.
    #[arg(long, default_value = "application/json")]
    pub content_type: String,
    /// Deliver no sooner than this long from now, e.g. 30s or 5m.
    #[arg(long, value_parser = parse_duration)]
    pub delay: Option<std::time::Duration>,
}

impl Cli {
    /// Loads the configuration this invocation names.
    pub fn load_config(&self) -> anyhow::Result<Config> {
        let mut config = match &self.config {
            Some(path) => Config::load_with_env(path, std::env::vars())?,
            None if std::path::Path::new("ferry.toml").exists() => {
                Config::load_with_env("ferry.toml".as_ref(), std::env::vars())?
            }
            None => Config::from_sources("", "defaults", std::env::vars())?,
        };
        if let Some(url) = &self.database_url {
            config.database.url = url.clone();
            config
                .validate()
                .map_err(|message| anyhow::anyhow!("invalid --database-url / FERRY_DATABASE_URL: {message}"))?;
        }
        Ok(config)
    }
}

/// Runs the parsed command.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let config = cli.load_config()?;
    let json = cli.json;
    match cli.command {
        Command::Serve => {
            let shutdown = CancellationToken::new();
            tokio::spawn(stop_on_signal(shutdown.clone()));
            service::serve(&config, shutdown).await
        }
        Command::Migrate => {
            service::open_store(&config).await?;
            say(json, serde_json::json!({ "migrated": true }), || "database is up to date".into());
            Ok(())
        }
        Command::Emit(args) => {
            let now = SystemClock.now();
            let event = args.into_event(now)?;
            let store = service::open_store(&config).await?;
            let id = store.insert(&event, now).await?;
            say(json, serde_json::json!({ "id": id }), || id.to_string());
            Ok(())
        }
        Command::Plugins(PluginsCommand::List) => plugins_list(&config, json).await,
        Command::Plugins(PluginsCommand::Check { file }) => plugins_check(&config, &file, json).await,
        Command::Plugins(PluginsCommand::Reload) => plugins_reload(&config, json).await,
        Command::Resend { ids } => {
            let store = service::open_store(&config).await?;
            let resent = store.resend(&ids, SystemClock.now()).await?;
            say(json, serde_json::json!({ "resent": resent, "requested": ids.len() }), || {
                format!("{resent} of {} events resent", ids.len())
            });
            if resent < ids.len() as u64 {
                bail!("{} of the given events do not exist or are not FAILED", ids.len() as u64 - resent);
            }
            Ok(())
        }
        Command::Breaker(command) => breaker(&config, command, json).await,
        Command::Failed(command) => failed(&config, command, json).await,
        Command::Show { id } => {
            let store = service::open_store(&config).await?;
            let Some(event) = store.get(id).await? else { bail!("no event with id {id}") };
            let attempts = store.attempts(id).await?;
            if json {
                println!("{}", report::event(&event, Some(&attempts)));
            } else {
                show(&event, &attempts);
            }
            Ok(())
        }
        Command::Status => {
            let store = service::open_store(&config).await?;
            let counts = store.counts().await?;
            if json {
                let map: serde_json::Map<String, serde_json::Value> =
                    counts.iter().map(|(s, n)| (s.to_string(), (*n).into())).collect();
                println!("{}", serde_json::Value::Object(map));
            } else {
                println!("{:<12}{:>10}", "STATUS", "EVENTS");
                for (status, n) in &counts {
                    println!("{:<12}{:>10}", status.as_str(), n);
                }
            }
            Ok(())
        }
        Command::Health { live } => health(&config, live, json).await,
        Command::Stats { window } => {
            let store = service::open_store(&config).await?;
            let now = SystemClock.now();
            let since = now - chrono::Duration::from_std(window).context("--window is too long")?;
            let stats = store.stats(now, Some(since)).await?;
            if json {
                println!("{}", report::stats(&stats));
            } else {
                print_stats(&stats, window);
            }
            Ok(())
        }
    }
}

/// Prints `value` as JSON, or the text `human` makes.
fn say(json: bool, value: serde_json::Value, human: impl FnOnce() -> String) {
    if json {
        println!("{value}");
    } else {
        println!("{}", human());
    }
}

fn print_stats(stats: &Stats, window: std::time::Duration) {
    let report = report::stats(stats);
    println!("{:<20} {:>10} {:>10} {:>10} {:>10}", "ROUTE", "PENDING", "PROCESSING", "SENT", "FAILED");
    for (route, counts) in &stats.routes {
        let n = |s: Status| counts.get(&s).copied().unwrap_or(0);
        println!(
            "{route:<20} {:>10} {:>10} {:>10} {:>10}",
            n(Status::Pending),
            n(Status::Processing),
            n(Status::Sent),
            n(Status::Failed)
        );
    }
    let seconds = |key: &str| report[key].as_f64().map_or("-".to_string(), |s| format!("{s:.1}s"));
    println!();
    println!("oldest pending event   {}", seconds("oldest_pending_age_seconds"));
    println!("claim lag              {}", seconds("claim_lag_seconds"));
    println!("stuck in PROCESSING    {}", stats.stuck);
    println!("on their last attempt  {}", stats.last_attempt);
    match &stats.latency {
        Some(l) => {
            let line = |p: &crate::store::Percentiles| {
                format!("p50 {} ms  p95 {} ms  p99 {} ms  max {} ms", p.p50_ms, p.p95_ms, p.p99_ms, p.max_ms)
            };
            println!("latency over the last {window:?} ({} events delivered):", l.samples);
            println!("  from event time      {}", line(&l.from_event_time));
            println!("  from creation        {}", line(&l.from_created));
        }
        None => println!("latency                no events delivered in the last {window:?}"),
    }
}

async fn failed(config: &Config, command: FailedCommand, json: bool) -> anyhow::Result<()> {
    let store = service::open_store(config).await?;
    match command {
        FailedCommand::Count { filter } => {
            let n = store.count_failed(&filter.filter()?).await?;
            say(json, serde_json::json!({ "failed": n }), || n.to_string());
        }
        FailedCommand::List { filter, after, limit } => {
            let filter = FailedFilter { after_id: after, ..filter.filter()? };
            let events = store.list_failed(&filter, limit).await?;
            if json {
                println!("{}", report::failed_page(&events, limit));
            } else {
                println!(
                    "{:>10}  {:<16} {:<20} {:<25} {:>8}  {:<18} LAST ERROR",
                    "ID", "ROUTE", "TYPE", "CREATED", "ATTEMPTS", "REASON"
                );
                for e in &events {
                    println!(
                        "{:>10}  {:<16} {:<20} {:<25} {:>8}  {:<18} {}",
                        e.id,
                        e.route,
                        e.event_type,
                        e.created_at.to_rfc3339(),
                        e.attempts,
                        e.failure_reason.as_deref().unwrap_or("-"),
                        e.last_error.as_deref().unwrap_or("-").lines().next().unwrap_or("")
                    );
                }
                if events.len() == limit as usize
                    && let Some(last) = events.last()
                {
                    println!("more: --after {}", last.id);
                }
            }
        }
        FailedCommand::Resend { filter, all } => {
            bulk(store.as_ref(), filter.filter()?, all, BulkOp::Resend, json).await?
        }
        FailedCommand::Purge { filter, all } => {
            bulk(store.as_ref(), filter.filter()?, all, BulkOp::Purge, json).await?
        }
    }
    Ok(())
}

/// Resends or purges every match, with a progress bar on a terminal.
async fn bulk(store: &dyn Store, filter: FailedFilter, all: bool, op: BulkOp, json: bool) -> anyhow::Result<()> {
    if filter.is_everything() && !all {
        bail!(
            "no filter given: this would affect every FAILED event; narrow it with --route, --type, --from or --before, or add --all"
        );
    }
    let total = store.count_failed(&filter).await?;
    let mut progress = Progress::new(total, op.past_tense());
    let done = store::bulk(store, &filter, op, || SystemClock.now(), |done| progress.show(done)).await?;
    progress.finish();
    say(json, serde_json::json!({ op.past_tense(): done }), || format!("{done} events {}", op.past_tense()));
    Ok(())
}

/// A one-line progress bar on standard error, drawn only when it is a terminal.
struct Progress {
    total: u64,
    verb: &'static str,
    terminal: bool,
}

impl Progress {
    fn new(total: u64, verb: &'static str) -> Progress {
        use std::io::IsTerminal as _;
        Progress { total, verb, terminal: std::io::stderr().is_terminal() && total > u64::from(store::BULK_STEP) }
    }

    fn show(&mut self, done: u64) {
        if self.terminal {
            let width = 30;
            let filled = (done.min(self.total) * width / self.total.max(1)) as usize;
            eprint!(
                "\r{} [{}{}] {done}/{}",
                self.verb,
                "#".repeat(filled),
                " ".repeat(width as usize - filled),
                self.total
            );
        }
    }

    fn finish(&self) {
        if self.terminal {
            eprintln!();
        }
    }
}

/// One event for `ferry show`: every field, the payload as text when it is UTF-8, and the
/// delivery history.
fn show(event: &EventRecord, attempts: &[AttemptRecord]) {
    let time = |t: Option<chrono::DateTime<chrono::Utc>>| t.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into());
    let fields = [
        ("id", event.id.to_string()),
        ("status", event.status.to_string()),
        ("route", event.route.clone()),
        ("type", event.event_type.clone()),
        ("key", event.ordering_key.clone().unwrap_or_else(|| "-".into())),
        (
            "attempts",
            format!(
                "{} of {}",
                event.attempts,
                event.max_attempts.map_or("the route's limit".into(), |m| if m == 0 {
                    "unlimited".into()
                } else {
                    m.to_string()
                })
            ),
        ),
        ("event time", time(Some(event.event_time))),
        ("created", time(Some(event.created_at))),
        ("status since", time(Some(event.last_status_at))),
        ("next attempt", time(Some(event.next_attempt_at))),
        ("processed", time(event.processed_at)),
        ("failure", event.failure_reason.clone().unwrap_or_else(|| "-".into())),
        ("last error", event.last_error.clone().unwrap_or_else(|| "-".into())),
        ("claimed by", event.claimed_by.clone().unwrap_or_else(|| "-".into())),
        ("content type", event.content_type.clone()),
        ("headers", event.headers.clone()),
    ];
    for (name, value) in fields {
        println!("{name:<13} {value}");
    }
    println!("history       {} attempts recorded", attempts.len());
    for a in attempts {
        let plugin = match (&a.plugin, &a.plugin_hash) {
            (Some(name), Some(hash)) => format!("{name}@{}", &hash[..hash.len().min(12)]),
            (Some(name), None) => name.clone(),
            _ => "-".into(),
        };
        let outcome = match &a.reason {
            Some(reason) => format!("{} ({reason})", a.outcome),
            None => a.outcome.clone(),
        };
        let error = a.error.as_deref().unwrap_or("").lines().next().unwrap_or("");
        println!(
            "  #{:<3} {}  {:>6} ms  {outcome:<28} {plugin:<26} {error}",
            a.attempt,
            a.started_at.to_rfc3339(),
            a.duration_ms
        );
    }
    match std::str::from_utf8(&event.payload) {
        Ok(text) => println!("payload\n{text}"),
        Err(_) => println!("payload       {} bytes, not UTF-8 text", event.payload.len()),
    }
}

async fn breaker(config: &Config, command: BreakerCommand, json: bool) -> anyhow::Result<()> {
    let store = service::open_store(config).await?;
    let now = SystemClock.now();
    let cooldown = config.breaker.cooldown.0;
    let changed = match command {
        BreakerCommand::List => {
            let breakers = store.breakers().await?;
            if json {
                let rows: Vec<serde_json::Value> = breakers.iter().map(|b| report::breaker(b, now, cooldown)).collect();
                println!("{}", serde_json::Value::Array(rows));
            } else {
                println!("{:<20} {:<10} {:>8}  {:<25} REASON", "ROUTE", "STATE", "FAILURES", "OPENED AT");
                for b in &breakers {
                    let opened = b.opened_at.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into());
                    let state = if b.manual { "open (by hand)" } else { b.state(now, cooldown) };
                    let reason = b.reason.as_deref().unwrap_or("-");
                    println!("{:<20} {:<10} {:>8}  {:<25} {reason}", b.route, state, b.consecutive_failures, opened);
                }
            }
            return Ok(());
        }
        BreakerCommand::Open { route, .. } | BreakerCommand::Close { route } if route.trim().is_empty() => {
            bail!("the route name must not be empty")
        }
        BreakerCommand::Open { route, reason } => store.set_breaker(&route, true, &reason, now).await?,
        BreakerCommand::Close { route } => store.set_breaker(&route, false, "", now).await?,
    };
    if !config.route.contains_key(&changed.route) {
        tracing::warn!(route = %changed.route, "no [route.{}] is configured; the breaker is stored anyway", changed.route);
    }
    let state = if changed.opened_at.is_some() { "open until closed by hand" } else { "closed" };
    say(json, report::breaker(&changed, now, cooldown), || format!("breaker of route {}: {state}", changed.route));
    Ok(())
}

async fn plugins_list(config: &Config, json: bool) -> anyhow::Result<()> {
    let runtime = Arc::new(Runtime::new(config)?);
    let registry = Registry::new(runtime, Arc::new(config.clone()), Arc::default());
    registry.load_dir().await?;
    let (plugins, errors) = registry.status();
    if json {
        println!("{}", report::plugins(&plugins, &errors));
        return Ok(());
    }
    println!("{:<16} {:<10} {:<14} {:<24} FILE", "NAME", "VERSION", "HASH", "ROUTES");
    for p in &plugins {
        let routes = if p.routes.is_empty() { "-".to_string() } else { p.routes.join(",") };
        println!("{:<16} {:<10} {:<14} {:<24} {}", p.name, p.version, &p.hash[..12], routes, p.file.display());
    }
    for (path, error) in &errors {
        println!("not loaded: {}: {error}", path.display());
    }
    Ok(())
}

async fn plugins_check(config: &Config, file: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let runtime = Runtime::new(config)?;
    let plugin = runtime.load(file).await?;
    let value = serde_json::json!({
        "file": file.display().to_string(),
        "name": plugin.info.name,
        "version": plugin.info.version,
        "hash": plugin.hash,
    });
    say(json, value, || {
        format!(
            "ok: {} is the transport plugin {:?}, version {}, for ferry:transport (sha256 {})",
            file.display(),
            plugin.info.name,
            plugin.info.version,
            &plugin.hash[..12]
        )
    });
    Ok(())
}

/// Asks the running ferry whether it is live or ready, through the admin API.
async fn health(config: &Config, live: bool, json: bool) -> anyhow::Result<()> {
    let Some(address) = config.admin.address() else {
        bail!("admin.listen is not set: `health` asks a running ferry through its admin API");
    };
    let path = if live { "/health/live" } else { "/health/ready" };
    let (status, body) = crate::admin::client::request("GET", address, path, None).await?;
    if json {
        println!("{}", body.trim());
    } else {
        println!("{status} {}", body.trim());
    }
    if status != 200 {
        bail!("ferry at {address} is not {}", if live { "live" } else { "ready" });
    }
    Ok(())
}

/// Asks the running ferry to reload its plugins, through the admin API.
async fn plugins_reload(config: &Config, json: bool) -> anyhow::Result<()> {
    let Some(address) = config.admin.address() else {
        bail!("admin.listen is not set: `plugins reload` asks a running ferry through its admin API");
    };
    let token = config.admin.bearer_token().map_err(anyhow::Error::msg)?;
    let (status, body) = crate::admin::client::request("POST", address, "/v1/plugins/reload", Some(&token)).await?;
    let value: serde_json::Value = serde_json::from_str(&body)
        .with_context(|| format!("the admin API at {address} answered {status} with something that is not JSON"))?;
    if status != 200 {
        bail!("the admin API at {address} answered {status}: {}", value["error"]["message"].as_str().unwrap_or(&body));
    }
    if json {
        println!("{value}");
        return Ok(());
    }
    let files = value["files"].as_array().cloned().unwrap_or_default();
    let mut failed = 0;
    for file in &files {
        let result = file["result"].as_str().unwrap_or("?");
        failed += usize::from(result == "failed");
        let detail = file["error"].as_str().or(file["plugin"].as_str()).unwrap_or("");
        println!("{:<10} {} {detail}", result, file["file"].as_str().unwrap_or("?"));
    }
    if failed > 0 {
        bail!("{failed} plugin files failed to load; the versions already active stay in use");
    }
    Ok(())
}

impl EmitArgs {
    /// The event to emit at `now` (deferral is counted from it).
    fn into_event(self, now: chrono::DateTime<chrono::Utc>) -> anyhow::Result<NewEvent> {
        let payload = match (&self.payload, &self.file) {
            (_, Some(path)) => {
                std::fs::read(path).with_context(|| format!("reading payload file {}", path.display()))?
            }
            (Some(text), None) if text == "-" => {
                let mut buf = Vec::new();
                std::io::stdin().read_to_end(&mut buf).context("reading payload from standard input")?;
                buf
            }
            (Some(text), None) => text.clone().into_bytes(),
            (None, None) => bail!("no payload: give it as an argument, `-` for standard input, or --file PATH"),
        };
        let mut event = NewEvent::new(self.route, self.event_type, payload).with_content_type(self.content_type);
        event.ordering_key = self.key;
        for header in &self.headers {
            let Some((name, value)) = header.split_once('=') else {
                bail!("--header {header:?} must be NAME=VALUE");
            };
            event = event.with_header(name, value);
        }
        if let Some(delay) = self.delay {
            let delay = chrono::Duration::from_std(delay).context("--delay is too long")?;
            event = event.not_before(now + delay);
        }
        event.validate().map_err(anyhow::Error::msg)?;
        Ok(event)
    }
}

/// Cancels `shutdown` on SIGTERM, SIGINT or Ctrl-C.
async fn stop_on_signal(shutdown: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                let _ = ctrl_c.await;
                shutdown.cancel();
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
    tracing::info!("shutdown requested; finishing in-flight deliveries");
    shutdown.cancel();
}
