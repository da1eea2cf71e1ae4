//! The `ferry` command line: parse arguments, load the configuration, run one command.

use std::io::Read as _;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, SystemClock};
use crate::config::{Config, parse_duration};
use crate::event::{EventRecord, NewEvent};
use crate::plugins::{Registry, Runtime};
use crate::service;
use crate::store::{FailedFilter, Store};

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
    Show {
        id: i64,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Show, open or close the per-route circuit breakers.
    #[command(subcommand)]
    Breaker(BreakerCommand),
    /// Show how many events are in each status.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
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
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
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
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
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
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
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
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
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
    match cli.command {
        Command::Serve => {
            let shutdown = CancellationToken::new();
            tokio::spawn(stop_on_signal(shutdown.clone()));
            service::serve(&config, shutdown).await
        }
        Command::Migrate => {
            service::open_store(&config).await?;
            println!("database is up to date");
            Ok(())
        }
        Command::Emit(args) => {
            let now = SystemClock.now();
            let event = args.into_event(now)?;
            let store = service::open_store(&config).await?;
            let id = store.insert(&event, now).await?;
            println!("{id}");
            Ok(())
        }
        Command::Plugins(PluginsCommand::List { json }) => plugins_list(&config, json).await,
        Command::Plugins(PluginsCommand::Check { file }) => plugins_check(&config, &file).await,
        Command::Resend { ids } => {
            let store = service::open_store(&config).await?;
            let resent = store.resend(&ids, SystemClock.now()).await?;
            println!("{resent} of {} events resent", ids.len());
            if resent < ids.len() as u64 {
                bail!("{} of the given events do not exist or are not FAILED", ids.len() as u64 - resent);
            }
            Ok(())
        }
        Command::Breaker(command) => breaker(&config, command).await,
        Command::Failed(command) => failed(&config, command).await,
        Command::Show { id, json } => {
            let store = service::open_store(&config).await?;
            let Some(event) = store.get(id).await? else { bail!("no event with id {id}") };
            show(&event, json);
            Ok(())
        }
        Command::Status { json } => {
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
    }
}

/// Rows changed per statement in bulk operations, so none holds locks for long.
const BULK_STEP: u32 = 1000;

async fn failed(config: &Config, command: FailedCommand) -> anyhow::Result<()> {
    let store = service::open_store(config).await?;
    match command {
        FailedCommand::Count { filter, json } => {
            let n = store.count_failed(&filter.filter()?).await?;
            if json { println!("{}", serde_json::json!({ "failed": n })) } else { println!("{n}") }
        }
        FailedCommand::List { filter, after, limit, json } => {
            let filter = FailedFilter { after_id: after, ..filter.filter()? };
            let events = store.list_failed(&filter, limit).await?;
            if json {
                let next = (events.len() == limit as usize).then(|| events.last().map(|e| e.id)).flatten();
                println!("{}", serde_json::json!({ "events": events, "next_after": next }));
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
        FailedCommand::Resend { filter, all } => bulk(store.as_ref(), filter.filter()?, all, Bulk::Resend).await?,
        FailedCommand::Purge { filter, all } => bulk(store.as_ref(), filter.filter()?, all, Bulk::Purge).await?,
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
enum Bulk {
    Resend,
    Purge,
}

/// Resends or purges every match in steps of [`BULK_STEP`], with a progress bar on a terminal.
async fn bulk(store: &dyn Store, filter: FailedFilter, all: bool, op: Bulk) -> anyhow::Result<()> {
    let verb = match op {
        Bulk::Resend => "resent",
        Bulk::Purge => "purged",
    };
    if filter.is_everything() && !all {
        bail!(
            "no filter given: this would affect every FAILED event; narrow it with --route, --type, --from or --before, or add --all"
        );
    }
    let total = store.count_failed(&filter).await?;
    let mut progress = Progress::new(total, verb);
    let mut done = 0;
    loop {
        let step = match op {
            Bulk::Resend => store.resend_failed(&filter, SystemClock.now(), BULK_STEP).await?,
            Bulk::Purge => store.purge_failed(&filter, BULK_STEP).await?,
        };
        if step == 0 {
            break;
        }
        done += step;
        progress.show(done);
    }
    progress.finish();
    println!("{done} events {verb}");
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
        Progress { total, verb, terminal: std::io::stderr().is_terminal() && total > u64::from(BULK_STEP) }
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

/// One event for `ferry show`: every field, and the payload as text when it is UTF-8.
fn show(event: &EventRecord, json: bool) {
    let text = std::str::from_utf8(&event.payload).ok();
    if json {
        let mut value = serde_json::to_value(event).expect("events serialize");
        match text {
            Some(text) => value["payload"] = text.into(),
            None => value["payload_bytes"] = event.payload.len().into(),
        }
        println!("{value}");
        return;
    }
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
    match text {
        Some(text) => println!("payload\n{text}"),
        None => println!("payload       {} bytes, not UTF-8 text", event.payload.len()),
    }
}

async fn breaker(config: &Config, command: BreakerCommand) -> anyhow::Result<()> {
    let store = service::open_store(config).await?;
    let now = SystemClock.now();
    let cooldown = config.breaker.cooldown.0;
    let changed = match command {
        BreakerCommand::List { json } => {
            let breakers = store.breakers().await?;
            if json {
                let rows: Vec<serde_json::Value> = breakers
                    .iter()
                    .map(|b| {
                        let mut row = serde_json::to_value(b).expect("breakers serialize");
                        row["state"] = b.state(now, cooldown).into();
                        row
                    })
                    .collect();
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
    println!("breaker of route {}: {state}", changed.route);
    Ok(())
}

async fn plugins_list(config: &Config, json: bool) -> anyhow::Result<()> {
    let runtime = Arc::new(Runtime::new(config)?);
    let registry = Registry::new(runtime, Arc::new(config.clone()));
    registry.load_dir().await?;
    let (plugins, errors) = registry.status();
    if json {
        let errors: serde_json::Map<String, serde_json::Value> =
            errors.iter().map(|(path, e)| (path.display().to_string(), e.clone().into())).collect();
        println!("{}", serde_json::json!({ "plugins": plugins, "errors": errors }));
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

async fn plugins_check(config: &Config, file: &std::path::Path) -> anyhow::Result<()> {
    let runtime = Runtime::new(config)?;
    let plugin = runtime.load(file).await?;
    println!(
        "ok: {} is the transport plugin {:?}, version {}, for ferry:transport (sha256 {})",
        file.display(),
        plugin.info.name,
        plugin.info.version,
        &plugin.hash[..12]
    );
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
