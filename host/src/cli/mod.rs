//! The `ferry` command line: parse arguments, load the configuration, run one command. Commands
//! are thin: each calls one operator operation (`crate::ops`) and prints its typed answer, as
//! JSON with `--json` or as text drawn by `render.rs`. `health` and `plugins reload` ask a running
//! ferry through its admin API (`client.rs`).

mod args;
mod client;
mod endpoints;
mod render;
mod scaffold;

pub use self::args::{
    BreakerCommand, Cli, Command, ConfigCommand, EmitArgs, EndpointArgs, EndpointsCommand, EventCommand, FailedCommand,
    FilterArgs, PayloadShown, PluginsCommand, TryArgs, VERSION,
};

use std::io::Read as _;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use tokio_util::sync::CancellationToken;

use crate::clock::SystemClock;
use crate::config::Config;
use crate::event::NewEvent;
use crate::ops::{self, FilterInput, FrontEnd, OpError, Ops};
use crate::plugins::{Registry, Runtime, trial};
use crate::report::{Cancelled, Created, FailedCount, Purged, ReloadResult, ReloadView, Resent};
use crate::service;
use crate::store::{BulkOp, EndEvent};

/// The operations over this invocation's database, answering as the CLI.
async fn ops(config: &Config) -> anyhow::Result<Ops> {
    let settings = Arc::new(config.settings()?);
    let store = service::open_existing_store(config).await?;
    Ok(Ops::new(settings, store, Arc::new(SystemClock), FrontEnd::Cli))
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

/// An operation's error as the CLI reports it: the message as it is, exit code 1; the kind is kept
/// for `--json` (see [`error_code`]).
fn failed(e: OpError) -> anyhow::Error {
    anyhow::Error::new(e)
}

/// A command that failed after printing its answer (a reload report with failed files, a trial
/// with failed events): `--json` prints no second object, the exit code says it failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Answered(pub String);

/// The `code` of a `--json` error, from what failed; the same words the admin API uses.
pub fn error_code(e: &anyhow::Error) -> &'static str {
    if let Some(op) = e.downcast_ref::<OpError>() {
        return match op {
            OpError::Invalid(_) => "bad_request",
            OpError::NotFound(_) => "not_found",
            OpError::Conflict(_) => "conflict",
            OpError::Store(_) => "unavailable",
        };
    }
    if e.downcast_ref::<crate::config::ConfigError>().is_some() {
        return "config";
    }
    if e.downcast_ref::<crate::store::StoreError>().is_some() || e.downcast_ref::<sqlx::Error>().is_some() {
        return "unavailable";
    }
    "failed"
}

/// The text of an error: its causes after it (`reading x.toml: permission denied`), except for an
/// operation's error, whose message already says everything (a database error quotes its cause).
pub fn error_message(e: &anyhow::Error) -> String {
    if e.downcast_ref::<OpError>().is_some() { e.to_string() } else { format!("{e:#}") }
}

/// Reports `e` the way the invocation asked: `{"error": {"code", "message"}}` on standard output
/// with `--json`, `error: …` on standard error otherwise. Exit code 1 either way.
pub fn report_error(json: bool, code: &str, message: &str) -> std::process::ExitCode {
    if json {
        let body = serde_json::json!({ "error": { "code": code, "message": message } });
        // Standard output may be closed as well; the exit code still tells.
        let _ = out(&body.to_string());
    } else {
        eprintln!("error: {message}");
    }
    std::process::ExitCode::FAILURE
}

/// Runs the parsed command.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let json = cli.json;
    // Writing a project needs no configuration: a broken ferry.toml where it runs is no obstacle.
    // These need no configuration: a broken ferry.toml where they run is no obstacle.
    match &cli.command {
        Command::Plugins(PluginsCommand::New { name, lang, dir }) => {
            return plugins_new(name, *lang, dir.as_deref(), json);
        }
        Command::Completions { shell } => {
            let mut command = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(*shell, &mut command, "ferry", &mut std::io::stdout());
            return Ok(());
        }
        Command::Man { dir } => return manual(dir.as_deref()),
        Command::Config(ConfigCommand::Show) => {
            let shown = cli.sources()?.show()?;
            return say(json, &shown, render::config);
        }
        _ => {}
    }
    let config = cli.load_config()?;
    let reread = cli.reread();
    match cli.command {
        Command::Plugins(PluginsCommand::New { .. })
        | Command::Completions { .. }
        | Command::Man { .. }
        | Command::Config(ConfigCommand::Show) => Ok(()),
        Command::Serve => {
            let shutdown = CancellationToken::new();
            tokio::spawn(stop_on_signal(shutdown.clone()));
            service::serve(&config, shutdown, Some(reread)).await
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
            if errors.is_empty() {
                return say(json, &Resent { resent }, |_| format!("{resent} of {} events resent", ids.len()));
            }
            // One answer: with --json the error alone, which says what was done.
            if !json {
                out(&format!("{resent} of {} events resent", ids.len()))?;
            }
            match ids.len() {
                1 => bail!("{}", errors.join("; ")),
                n => bail!("{resent} of {n} events resent; {}", errors.join("; ")),
            }
        }
        Command::Event(EventCommand::Cancel { id }) => {
            ops(&config).await?.end_event(id, EndEvent::Cancel).await.map_err(failed)?;
            say(json, &Cancelled { cancelled: 1 }, |_| format!("event {id} cancelled"))
        }
        Command::Event(EventCommand::Fail { id, reason }) => {
            let view = ops(&config).await?.end_event(id, EndEvent::Fail { note: &reason }).await.map_err(failed)?;
            say(json, &view, |_| format!("event {id} failed by hand"))
        }
        Command::Reschedule { id, at, delay } => {
            let ops = ops(&config).await?;
            let at = match (at, delay) {
                (Some(at), _) => at,
                (None, delay) => ops.deliver_after(ops.now(), delay.unwrap_or_default()).map_err(failed)?,
            };
            let view = ops.reschedule(id, at).await.map_err(failed)?;
            say(json, &view, |v| format!("event {id} is due at {}", v.event.next_attempt_at.to_rfc3339()))
        }
        Command::Breaker(command) => breaker(&config, command, json).await,
        Command::Endpoints(command) => endpoints::run(&config, command, json).await,
        Command::Failed(command) => failed_command(&config, command, json).await,
        Command::Show { id, payload } => {
            let mut view = ops(&config).await?.show(id).await.map_err(failed)?;
            view.shorten_payload(match payload {
                PayloadShown::Full => None,
                PayloadShown::Head => Some(render::PAYLOAD_HEAD),
                PayloadShown::None => Some(0),
            });
            say(json, &view, render::event)
        }
        Command::Config(ConfigCommand::Check) => config_check(&config, json).await,
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
        FailedCommand::List { filter, newest, after, limit } => {
            let page = ops::Page { after, limit, newest_first: newest };
            let page = ops.failed_list(filter.input(), page).await.map_err(failed)?;
            say(json, &page, |page| render::failed_page(page, newest))
        }
        FailedCommand::Resend { filter, all, dry_run } => {
            let filter = filter.input();
            if dry_run {
                return dry_run_count(&ops, filter, all, "resent", json).await;
            }
            let resent = bulk(&ops, filter, all, BulkOp::Resend).await?;
            say(json, &Resent { resent }, |r| format!("{} events resent", r.resent))
        }
        FailedCommand::Purge { filter, all, dry_run, yes } => {
            let mut filter = filter.input();
            if dry_run {
                return dry_run_count(&ops, filter, all, "purged", json).await;
            }
            ops.bulk_scope(filter.clone(), all).map_err(failed)?;
            let count = ops.failed_count(filter.clone()).await.map_err(failed)?;
            if count.failed == 0 {
                return say(json, &Purged { purged: 0 }, |_| "no FAILED event matches; nothing purged".into());
            }
            if !yes && interactive() && !confirm(&format!("Purge {} FAILED events for good?", count.failed))? {
                bail!("not confirmed; nothing was purged");
            }
            // What was counted and confirmed, not what fails after.
            filter.through_id = count.last_id;
            let purged = bulk(&ops, filter, all, BulkOp::Purge).await?;
            say(json, &Purged { purged }, |p| format!("{} events purged", p.purged))
        }
    }
}

/// `--dry-run`: how many FAILED events a resend or purge would touch, as `failed count` answers.
async fn dry_run_count(ops: &Ops, filter: FilterInput, all: bool, verb: &str, json: bool) -> anyhow::Result<()> {
    ops.bulk_scope(filter.clone(), all).map_err(failed)?;
    let count = ops.failed_count(filter).await.map_err(failed)?;
    say(json, &count, |c| format!("{} FAILED events would be {verb} (dry run: nothing changed)", c.failed))
}

/// Whether a person is at the keyboard: standard input is a terminal. (The question goes to
/// standard error, even when that is redirected.)
fn interactive() -> bool {
    use std::io::IsTerminal as _;
    std::io::stdin().is_terminal()
}

/// Asks `question` on standard error; true only for an answer of y or yes.
fn confirm(question: &str) -> anyhow::Result<bool> {
    use std::io::Write as _;
    eprint!("{question} [y/N] ");
    std::io::stderr().flush()?;
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer).context("reading the answer")?;
    Ok(matches!(answer.trim().to_ascii_lowercase().as_str(), "y" | "yes"))
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

/// `ferry config check`: what `serve` would start with, exit 1 when it would not start or a route
/// has no working transport.
async fn config_check(config: &Config, json: bool) -> anyhow::Result<()> {
    let check = service::check(config).await?;
    say(json, &check, render::config_check)?;
    if !check.ok {
        let errors = check.errors.iter().map(|e| crate::untrusted::clean(e, 1000)).collect::<Vec<_>>();
        return Err(Answered(errors.join("; ")).into());
    }
    Ok(())
}

/// `ferry man`: the top page on standard output, or every page into `dir`.
fn manual(dir: Option<&std::path::Path>) -> anyhow::Result<()> {
    let command = <Cli as clap::CommandFactory>::command();
    match dir {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            clap_mangen::generate_to(command, dir)
                .with_context(|| format!("writing manual pages into {}", dir.display()))?;
            Ok(())
        }
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(command).render(&mut page)?;
            use std::io::Write as _;
            let mut stdout = std::io::stdout().lock();
            stdout.write_all(&page).and_then(|()| stdout.flush())?;
            Ok(())
        }
    }
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
        "wit": plugin.contract.version(),
        "hash": plugin.hash,
    });
    say(json, &value, |_| {
        format!(
            "ok: {} is the transport plugin {:?}, version {}, for ferry:transport@{} (sha256 {})",
            file.display(),
            plugin.info.name,
            plugin.info.version,
            plugin.contract.version(),
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
        return Err(Answered(format!("init failed: {}", crate::untrusted::clean(error, 1000))).into());
    }
    if report.succeeded < report.events {
        return Err(Answered(format!(
            "{} of {} events did not succeed",
            report.events - report.succeeded,
            report.events
        ))
        .into());
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
        return Err(Answered(format!("ferry at {address} is not {}", if live { "live" } else { "ready" })).into());
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
        return Err(
            Answered(format!("{failed} plugin files failed to load; the versions already active stay in use")).into()
        );
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
