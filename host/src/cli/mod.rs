//! The `ferry` command line: parse arguments, load the configuration, run one command. Commands
//! are thin: each calls one operator operation (`crate::ops`) and prints its typed answer, as
//! JSON with `--json` or as text drawn by `render.rs`. `health` and `plugins reload` ask a running
//! ferry through its admin API (`client.rs`).

mod client;
mod render;
mod scaffold;

use std::io::Read as _;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::clock::SystemClock;
use crate::config::{Config, parse_duration};
use crate::event::NewEvent;
use crate::ops::{self, FilterInput, FrontEnd, OpError, Ops};
use crate::plugins::{Registry, Runtime, trial};
use crate::report::{Cancelled, Created, FailedCount, Purged, ReloadResult, ReloadView, Resent};
use crate::service;
use crate::store::{BulkOp, EndEvent};

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
    /// End an event that is not finished: cancel (delete) it, or fail it by hand.
    #[command(subcommand)]
    Event(EventCommand),
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
        /// Measure latency over events delivered this long ago or less (default 1h).
        #[arg(long, value_parser = parse_duration)]
        window: Option<std::time::Duration>,
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
    /// Only events that failed for this reason: permanent, attempts_exhausted, no_transport,
    /// plugin_fault, invalid_event, operator, or none (no reason recorded).
    #[arg(long)]
    reason: Option<String>,
    /// Only events created at or after this time (RFC 3339, e.g. 2026-11-26T08:00:00Z).
    #[arg(long, value_parser = parse_time)]
    from: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events created before this time (RFC 3339).
    #[arg(long, value_parser = parse_time)]
    before: Option<chrono::DateTime<chrono::Utc>>,
}

impl FilterArgs {
    fn input(self) -> FilterInput {
        FilterInput {
            route: self.route,
            event_type: self.event_type,
            reason: self.reason,
            through_id: None,
            from: self.from,
            before: self.before,
        }
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
    /// The matching FAILED events grouped by route, type and failure reason, with counts and when
    /// the first and last of each group failed; the largest groups first.
    Summary {
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
        /// Events per page (default 50, at most 10000).
        #[arg(long)]
        limit: Option<u32>,
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
pub enum EventCommand {
    /// Delete a PENDING or PROCESSING event (and its history); a delivery in flight is not recorded.
    Cancel { id: i64 },
    /// Make a PENDING or PROCESSING event FAILED (reason `operator`), kept for inspection and resend.
    Fail {
        id: i64,
        /// Why, kept as the event's last error.
        #[arg(long, default_value = ops::FAILED_BY_HAND)]
        reason: String,
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
        #[arg(long, default_value = ops::OPENED_BY_HAND)]
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
    /// Write a new transport project, in Rust, JavaScript or Python, that builds where it is
    /// written: sources, the WIT package, sample events and a README. Prints the build command.
    #[command(after_help = NEW_HELP)]
    New {
        /// The plugin's name, what routes put in `plugin = "…"`: lowercase letters, digits and '-'.
        name: String,
        /// The language to write it in.
        #[arg(long, value_enum)]
        lang: scaffold::Lang,
        /// Where to write the project (default ./NAME); must not exist, or be empty.
        dir: Option<PathBuf>,
    },
    /// Run a transport the way `serve` does (same runtime, sandbox and limits) on events given
    /// as JSON lines, without a database: prints each outcome, what the plugin logged, the time
    /// per call and what the sandbox refused. Exits 0 when every event succeeded.
    #[command(after_help = TRY_HELP)]
    Try(TryArgs),
}

const NEW_HELP: &str = "\
Examples:
  ferry plugins new audit-log --lang rust
  ferry plugins new hook --lang javascript ~/src/hook-transport";

const TRY_HELP: &str = "\
Events are JSON lines, one object per event:
  {\"type\": \"order.paid\", \"payload\": {\"total\": 3}}
  {\"type\": \"note\", \"payload\": \"plain text\", \"content_type\": \"text/plain\"}
  {\"type\": \"blob\", \"payload_base64\": \"//79\", \"key\": \"k1\", \"headers\": {\"tenant\": \"acme\"}}
Also: id (default: the event's place in the file, 1 for the first), attempt (default 1),
time (RFC 3339, default now).
The plugin's sandbox and limits are those of [sandbox.NAME] and [plugins] in the configuration
file, unless --sandbox-toml gives the sandbox; `--route NAME` starts from that route's config.

Examples:
  ferry plugins try target/wasm32-wasip2/release/audit_log.wasm --events events.jsonl
  echo '{\"payload\": \"hi\"}' | ferry plugins try hook.wasm --set url=http://127.0.0.1:8080/in \\
      --sandbox-toml sandbox.toml --events -";

#[derive(Debug, clap::Args)]
pub struct TryArgs {
    /// The component to run.
    pub file: PathBuf,
    /// A key of the route's `config` table, as `init` receives it; may be repeated. (`--config`
    /// names ferry's configuration file, as for every command.)
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// A TOML file with the plugin's sandbox: the keys of a [sandbox.NAME] table (http, dirs,
    /// tcp, dns, env, memory, timeout, …), or a file holding one such table.
    #[arg(long, value_name = "FILE")]
    pub sandbox_toml: Option<PathBuf>,
    /// JSON lines of events to deliver; `-` reads standard input. Without it, one sample event.
    #[arg(long, value_name = "FILE|-")]
    pub events: Option<PathBuf>,
    /// The route the events belong to; a route of that name in the configuration file gives its
    /// config, which --set adds to.
    #[arg(long, default_value = "try")]
    pub route: String,
    /// Events per deliver-batch call, 1 to 10000 (default: relay.batch_size).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch_size: Option<u32>,
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

/// The operations over this invocation's database, answering as the CLI.
async fn ops(config: &Config) -> anyhow::Result<Ops> {
    let settings = Arc::new(config.settings()?);
    let store = service::open_existing_store(config).await?;
    Ok(Ops { settings, store, clock: Arc::new(SystemClock), wake: None, front: FrontEnd::Cli })
}

/// Prints `value` as JSON, or the text `human` makes of it.
fn say<T: serde::Serialize>(json: bool, value: &T, human: impl FnOnce(&T) -> String) -> anyhow::Result<()> {
    if json { out(&serde_json::to_string(value)?) } else { out(&human(value)) }
}

/// Writes one line to standard output. A reader that went away (`ferry show 1 | head`) is an
/// `io::Error` of kind `BrokenPipe`, which `main` turns into a quiet exit.
pub fn out(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{text}").and_then(|()| stdout.flush())?;
    Ok(())
}

/// An operation's error as the CLI reports it (exit code 1, the message as it is).
fn failed(e: OpError) -> anyhow::Error {
    anyhow::Error::msg(e.to_string())
}

/// Runs the parsed command.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let json = cli.json;
    // Writing a project needs no configuration: a broken ferry.toml where it runs is no obstacle.
    if let Command::Plugins(PluginsCommand::New { name, lang, dir }) = &cli.command {
        return plugins_new(name, *lang, dir.as_deref(), json);
    }
    let config = cli.load_config()?;
    match cli.command {
        Command::Serve => {
            let shutdown = CancellationToken::new();
            tokio::spawn(stop_on_signal(shutdown.clone()));
            service::serve(&config, shutdown).await
        }
        Command::Migrate => {
            service::open_store(&config).await?;
            say(json, &serde_json::json!({ "migrated": true }), |_| "database is up to date".into())
        }
        Command::Emit(args) => {
            let ops = ops(&config).await?;
            let now = ops.now();
            let event = args.into_event(&ops, now, config.relay.max_payload.0)?;
            let created: Created = ops.emit(event, now).await.map_err(failed)?;
            say(json, &created, |c| c.id.to_string())
        }
        Command::Plugins(PluginsCommand::List) => plugins_list(&config, json).await,
        Command::Plugins(PluginsCommand::Check { file }) => plugins_check(&config, &file, json).await,
        Command::Plugins(PluginsCommand::Reload) => plugins_reload(&config, json).await,
        Command::Plugins(PluginsCommand::New { name, lang, dir }) => plugins_new(&name, lang, dir.as_deref(), json),
        Command::Plugins(PluginsCommand::Try(args)) => plugins_try(&config, args, json).await,
        Command::Resend { ids } => {
            let ops = ops(&config).await?;
            let mut errors = Vec::new();
            for id in &ids {
                if let Err(e) = ops.resend(*id).await {
                    errors.push(e.to_string());
                }
            }
            let resent = (ids.len() - errors.len()) as u64;
            say(json, &Resent { resent }, |_| format!("{resent} of {} events resent", ids.len()))?;
            if !errors.is_empty() {
                bail!("{}", errors.join("; "));
            }
            Ok(())
        }
        Command::Event(EventCommand::Cancel { id }) => {
            ops(&config).await?.end_event(id, EndEvent::Cancel).await.map_err(failed)?;
            say(json, &Cancelled { cancelled: 1 }, |_| format!("event {id} cancelled"))
        }
        Command::Event(EventCommand::Fail { id, reason }) => {
            let view = ops(&config).await?.end_event(id, EndEvent::Fail { note: &reason }).await.map_err(failed)?;
            say(json, &view, |_| format!("event {id} failed by hand"))
        }
        Command::Breaker(command) => breaker(&config, command, json).await,
        Command::Failed(command) => failed_command(&config, command, json).await,
        Command::Show { id } => {
            let view = ops(&config).await?.show(id).await.map_err(failed)?;
            say(json, &view, render::event)
        }
        Command::Status => {
            let counts = ops(&config).await?.status().await.map_err(failed)?;
            say(json, &counts, render::status)
        }
        Command::Health { live } => health(&config, live, json).await,
        Command::Stats { window } => {
            let stats = ops(&config).await?.stats(window).await.map_err(failed)?;
            say(json, &stats, |s| render::stats(s, window.unwrap_or(ops::DEFAULT_WINDOW)))
        }
    }
}

async fn failed_command(config: &Config, command: FailedCommand, json: bool) -> anyhow::Result<()> {
    let ops = ops(config).await?;
    match command {
        FailedCommand::Count { filter } => {
            let count: FailedCount = ops.failed_count(filter.input()).await.map_err(failed)?;
            say(json, &count, |c| c.failed.to_string())
        }
        FailedCommand::Summary { filter } => {
            let summary = ops.failed_summary(filter.input()).await.map_err(failed)?;
            say(json, &summary, render::failed_summary)
        }
        FailedCommand::List { filter, after, limit } => {
            let page = ops.failed_list(filter.input(), after, limit).await.map_err(failed)?;
            say(json, &page, render::failed_page)
        }
        FailedCommand::Resend { filter, all } => {
            let resent = bulk(&ops, filter.input(), all, BulkOp::Resend).await?;
            say(json, &Resent { resent }, |r| format!("{} events resent", r.resent))
        }
        FailedCommand::Purge { filter, all } => {
            let purged = bulk(&ops, filter.input(), all, BulkOp::Purge).await?;
            say(json, &Purged { purged }, |p| format!("{} events purged", p.purged))
        }
    }
}

/// Resends or purges every match, with a progress bar on a terminal.
async fn bulk(ops: &Ops, filter: FilterInput, all: bool, op: BulkOp) -> anyhow::Result<u64> {
    let mut progress = render::Progress::new(op.past_tense());
    let done = ops.failed_bulk(filter, all, op, |done, total| progress.show(done, total)).await.map_err(failed)?;
    progress.finish();
    Ok(done)
}

async fn breaker(config: &Config, command: BreakerCommand, json: bool) -> anyhow::Result<()> {
    let ops = ops(config).await?;
    let changed = match command {
        BreakerCommand::List => {
            let breakers = ops.breakers().await.map_err(failed)?;
            return say(json, &breakers, |b| render::breakers(b));
        }
        BreakerCommand::Open { route, reason } => ops.set_breaker(&route, true, &reason).await.map_err(failed)?,
        BreakerCommand::Close { route } => ops.set_breaker(&route, false, "").await.map_err(failed)?,
    };
    say(json, &changed, |b| {
        let state = if b.breaker.is_open() { "open until closed by hand" } else { "closed" };
        format!("breaker of route {}: {state}", b.breaker.route)
    })
}

async fn plugins_list(config: &Config, json: bool) -> anyhow::Result<()> {
    let settings = Arc::new(config.settings()?);
    let runtime = Arc::new(Runtime::new(&settings)?.inspecting());
    let registry = Registry::new(runtime, settings, Arc::default());
    registry.load_dir().await?;
    say(json, &ops::plugins(&registry), render::plugins)
}

async fn plugins_check(config: &Config, file: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let settings = config.settings()?;
    let runtime = Runtime::new(&settings)?.inspecting();
    let plugin = runtime.load(file, &settings).await?;
    let value = serde_json::json!({
        "file": file.display().to_string(),
        "name": plugin.info.name,
        "version": plugin.info.version,
        "hash": plugin.hash,
    });
    say(json, &value, |_| {
        format!(
            "ok: {} is the transport plugin {:?}, version {}, for ferry:transport (sha256 {})",
            file.display(),
            plugin.info.name,
            plugin.info.version,
            &plugin.hash[..12]
        )
    })
}

/// Writes a new transport project into `dir` (default ./NAME).
fn plugins_new(name: &str, lang: scaffold::Lang, dir: Option<&std::path::Path>, json: bool) -> anyhow::Result<()> {
    let dir = dir.map_or_else(|| PathBuf::from(name), std::path::Path::to_path_buf);
    let project = scaffold::write(name, lang, &dir)?;
    say(json, &project, render::scaffold)
}

async fn plugins_try(config: &Config, args: TryArgs, json: bool) -> anyhow::Result<()> {
    let mut route_config = std::collections::BTreeMap::new();
    for pair in &args.set {
        let Some((key, value)) = pair.split_once('=') else {
            bail!("--set {pair:?} must be KEY=VALUE");
        };
        route_config.insert(key.to_string(), value.to_string());
    }
    let sandbox = args.sandbox_toml.as_deref().map(trial::read_sandbox).transpose()?;
    let max_payload = config.relay.max_payload.0;
    let text = match &args.events {
        None => trial::SAMPLE_EVENT.to_string(),
        Some(path) if path.as_os_str() == "-" => {
            let mut text = String::new();
            std::io::stdin().read_to_string(&mut text).context("reading events from standard input")?;
            text
        }
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("reading events file {}", path.display()))?
        }
    };
    let events = trial::parse_events(&text, &args.route, max_payload, chrono::Utc::now())?;
    if events.is_empty() {
        bail!("no events to deliver: the events file holds no JSON line");
    }
    let batch_size = args.batch_size.unwrap_or(config.relay.batch_size).max(1) as usize;
    let setup = trial::TrialSetup { file: args.file, route: args.route, route_config, sandbox, batch_size };
    let report = trial::run(config, &setup, &events).await?;
    say(json, &report, render::trial)?;
    if let Some(error) = &report.init.error {
        bail!("init failed: {error}");
    }
    if report.succeeded < report.events {
        bail!("{} of {} events did not succeed", report.events - report.succeeded, report.events);
    }
    Ok(())
}

/// Asks the running ferry whether it is live or ready, through the admin API.
async fn health(config: &Config, live: bool, json: bool) -> anyhow::Result<()> {
    let Some(address) = config.admin.address() else {
        bail!("admin.listen is not set: `health` asks a running ferry through its admin API");
    };
    let path = if live { "/health/live" } else { "/health/ready" };
    let (status, body) = client::request("GET", address, path, None).await?;
    if json {
        out(body.trim())?
    } else {
        out(&format!("{status} {}", body.trim()))?
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
    let (status, body) = client::request("POST", address, "/v1/plugins/reload", Some(&token)).await?;
    if status != 200 {
        let message = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(body);
        bail!("the admin API at {address} answered {status}: {message}");
    }
    let view: ReloadView = serde_json::from_str(&body).with_context(|| {
        format!("the admin API at {address} answered {status} with something that is not a reload report")
    })?;
    say(json, &view, render::reload)?;
    let failed = view.files.iter().filter(|f| f.result == ReloadResult::Failed).count();
    if failed > 0 {
        bail!("{failed} plugin files failed to load; the versions already active stay in use");
    }
    Ok(())
}

impl EmitArgs {
    /// The event to emit at `now` (deferral is counted from it). A file or standard input is read
    /// only up to one byte past `max_payload`, so an oversized payload is refused (by the
    /// operation, which names the limit) without reading all of it.
    fn into_event(self, ops: &Ops, now: chrono::DateTime<chrono::Utc>, max_payload: usize) -> anyhow::Result<NewEvent> {
        let read = |source: &mut dyn std::io::Read| -> std::io::Result<Vec<u8>> {
            let mut buf = Vec::new();
            source.take(max_payload as u64 + 1).read_to_end(&mut buf)?;
            Ok(buf)
        };
        let payload = match (&self.payload, &self.file) {
            (_, Some(path)) => {
                let mut file =
                    std::fs::File::open(path).with_context(|| format!("reading payload file {}", path.display()))?;
                let size = file.metadata().map(|m| m.len()).unwrap_or(0);
                if size > max_payload as u64 {
                    bail!("{}: {}", path.display(), ferry_outbox::payload_too_large(size, max_payload));
                }
                read(&mut file).with_context(|| format!("reading payload file {}", path.display()))?
            }
            (Some(text), None) if text == "-" => {
                read(&mut std::io::stdin().lock()).context("reading payload from standard input")?
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
            event = event.not_before(ops.deliver_after(now, delay).map_err(failed)?);
        }
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
