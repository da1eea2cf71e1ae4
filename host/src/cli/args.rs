//! The command line's grammar: every command, flag and help text, as clap derives them, and
//! where the configuration comes from. `mod.rs` runs what is parsed here.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::{Config, Sources, parse_duration};
use crate::ops::{self, FilterInput};

/// What `ferry --version` prints: the release, the commit it was built from and the transport
/// contract it implements (and the older one it still loads plugins of; both as in
/// `plugins::WIT_VERSION` and `plugins::OLDER_WIT_VERSIONS`, which a test compares).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("BUILT_FROM_COMMIT"),
    ", transport contract ferry:transport@",
    "0.2.0",
    ", also loads @",
    "0.1.0",
    ")"
);

const GLOBAL: &str = "Global options";

const EXAMPLES: &str = "\
Examples:
  ferry config check                      check ferry.toml, the plugins and each route's init
  ferry serve                             run the relay (and the admin API, if admin.listen is set)
  ferry emit orders order.paid '{\"id\": 7}'
  ferry failed summary                    what is failing, grouped by route, type and reason
  ferry failed resend --route orders      deliver a route's FAILED events again
  ferry show 42 --payload head            one event, its history and the start of its payload
  ferry --json status | jq .FAILED

Environment: FERRY_CONFIG, FERRY_DATABASE_URL, FERRY_LOG (a level such as debug, or directives
such as ferry=debug,sqlx=warn), FERRY_LOG_FORMAT (text or json), and FERRY_<TABLE>_<KEY> for any
key of the database, relay, retry, breaker, admin and plugins tables.";

/// Delivers events from a transactional outbox through WebAssembly transport plugins.
#[derive(Debug, Parser)]
#[command(name = "ferry", version = VERSION, about, after_help = EXAMPLES)]
pub struct Cli {
    /// Configuration file. Without it, ./ferry.toml is used if present, else the built-in defaults.
    #[arg(long, short, global = true, env = "FERRY_CONFIG", help_heading = GLOBAL)]
    pub config: Option<PathBuf>,
    /// Overrides database.url from the configuration file.
    #[arg(long, global = true, env = "FERRY_DATABASE_URL", help_heading = GLOBAL, hide_env_values = true)]
    pub database_url: Option<String>,
    /// Print JSON instead of text (the shapes the admin API answers with); errors too, as
    /// {"error": {"code": …, "message": …}} on standard output with a non-zero exit code.
    #[arg(long, global = true, help_heading = GLOBAL)]
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
    /// Make a PENDING event due at another time, without counting an attempt (to hold it back
    /// while a receiver is down, or to send it sooner).
    #[command(
        after_help = "Examples:\n  ferry reschedule 42 --delay 2h\n  ferry reschedule 42 --at 2026-11-27T08:00:00Z"
    )]
    Reschedule {
        id: i64,
        /// When it becomes due (RFC 3339).
        #[arg(long, value_parser = parse_time, required_unless_present = "delay", conflicts_with = "delay")]
        at: Option<chrono::DateTime<chrono::Utc>>,
        /// How long from now it becomes due, e.g. 30s, 15m or 2h.
        #[arg(long, value_parser = parse_duration)]
        delay: Option<std::time::Duration>,
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
    /// Show one event: its fields, why it waits, its history and its payload.
    Show {
        id: i64,
        /// How much of the payload to show: all of it, its first 1 KiB, or none.
        #[arg(long, value_enum, default_value_t = PayloadShown::Full)]
        payload: PayloadShown,
    },
    /// Check or print the configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Print a shell completion script: `ferry completions bash > /etc/bash_completion.d/ferry`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff), or write one page per command into a directory.
    #[command(after_help = "Examples:\n  ferry man | man -l -\n  ferry man --dir /usr/local/share/man/man1")]
    Man {
        /// Write ferry.1 and a page for every subcommand (ferry-failed-purge.1, …) into DIR.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// Show, open or close the per-route circuit breakers.
    #[command(subcommand)]
    Breaker(BreakerCommand),
    /// Manage the webhook endpoints of routes that take them ([route.NAME.endpoints]).
    #[command(subcommand)]
    Endpoints(EndpointsCommand),
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

/// How much of an event's payload `ferry show` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PayloadShown {
    Full,
    Head,
    None,
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Check everything `serve` checks before it starts, without touching the database: the
    /// file and FERRY_* variables, the plugins directory, each route's plugin and its `init`.
    /// Exits 0 when ferry would start and every route has a working transport.
    Check,
    /// Print every setting in effect and where it came from (default, file, environment), with
    /// secrets masked.
    Show,
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
    /// Only events whose last error contains this text, letter case aside (e.g. "timed out").
    #[arg(long, value_name = "TEXT")]
    error: Option<String>,
    /// Only events created at or after this time (RFC 3339, e.g. 2026-11-26T08:00:00Z).
    #[arg(long, value_parser = parse_time)]
    from: Option<chrono::DateTime<chrono::Utc>>,
    /// Only events created before this time (RFC 3339).
    #[arg(long, value_parser = parse_time)]
    before: Option<chrono::DateTime<chrono::Utc>>,
}

impl FilterArgs {
    pub(super) fn input(self) -> FilterInput {
        FilterInput {
            route: self.route,
            event_type: self.event_type,
            reason: self.reason,
            through_id: None,
            error: self.error,
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
    /// FAILED events in id order (oldest first, or with --newest the most recently created), a page at
    /// a time.
    #[command(after_help = "Examples:\n  ferry failed list --newest --limit 20\n  \
        ferry failed list --route orders --error \"timed out\"")]
    List {
        #[command(flatten)]
        filter: FilterArgs,
        /// The most recently created events (highest ids) first.
        #[arg(long)]
        newest: bool,
        /// Start after this id in the listing's order (the last id of the previous page).
        #[arg(long)]
        after: Option<i64>,
        /// Events per page (default 50, at most 10000).
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Make the matching FAILED events PENDING again (attempts and error reset).
    #[command(after_help = "Examples:\n  ferry failed resend --route orders --reason attempts_exhausted\n  \
        ferry failed resend --all --dry-run")]
    Resend {
        #[command(flatten)]
        filter: FilterArgs,
        /// Required to resend every FAILED event when no filter is given.
        #[arg(long)]
        all: bool,
        /// Only say how many events would be resent.
        #[arg(long)]
        dry_run: bool,
    },
    /// Delete the matching FAILED events for good. On a terminal, asks first (say how many and
    /// wait for "y"); --yes skips the question, as does a non-interactive standard input.
    #[command(
        after_help = "Examples:\n  ferry failed purge --route orders --before 2026-11-01T00:00:00Z --dry-run\n  \
        ferry failed purge --type test.ping --yes"
    )]
    Purge {
        #[command(flatten)]
        filter: FilterArgs,
        /// Required to purge every FAILED event when no filter is given.
        #[arg(long)]
        all: bool,
        /// Only say how many events would be purged.
        #[arg(long)]
        dry_run: bool,
        /// Do not ask on a terminal.
        #[arg(long, short)]
        yes: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum EventCommand {
    /// Delete a PENDING or PROCESSING event (and its history); a delivery in flight is not recorded.
    Cancel { id: i64 },
    /// Make a PENDING or PROCESSING event FAILED (reason `operator`), kept for inspection and resend.
    Fail {
        id: i64,
        /// Why, kept as the event's last error (at most 2048 bytes).
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
        /// Why, shown in `breaker list` (at most 2048 bytes).
        #[arg(long, default_value = ops::OPENED_BY_HAND)]
        reason: String,
    },
    /// Close a route's breaker (by hand or not) and reset its failure count.
    Close { route: String },
}

const ENDPOINT_EXAMPLES: &str = "Examples:
  ferry endpoints create orders --url https://hooks.example.com/ferry --event-type 'order.*'
  ferry endpoints list orders
  ferry endpoints rotate-secret ep_0123456789abcdef0123 --keep-previous 24h
  ferry failed list --route orders/ep_0123456789abcdef0123";

/// An endpoint's fields as options; those not given are left as they are (on `update`).
#[derive(Debug, clap::Args)]
pub struct EndpointArgs {
    /// Where its requests go; must match one of the route's endpoints.origins.
    #[arg(long)]
    pub url: Option<String>,
    /// Free text for operators.
    #[arg(long)]
    pub description: Option<String>,
    /// An event type it receives, exact or with `*` (`order.*`); repeat for more. None: every type.
    #[arg(long = "event-type", value_name = "TYPE")]
    pub event_types: Vec<String>,
    /// Receive every event type again (on `update`: drop the filter).
    #[arg(long, conflicts_with = "event_types")]
    pub all_event_types: bool,
    /// A header sent with every request, as NAME=VALUE; repeat for more (on `update`: the new set).
    #[arg(long = "header", value_name = "NAME=VALUE")]
    pub headers: Vec<String>,
    /// Send no static headers any more (on `update`).
    #[arg(long, conflicts_with = "headers")]
    pub no_headers: bool,
}

#[derive(Debug, Subcommand)]
pub enum EndpointsCommand {
    /// Every endpoint of ROUTE (of every route when left out); secrets masked.
    List { route: Option<String> },
    /// Add an endpoint to ROUTE. Its signing secret is printed this once.
    #[command(after_help = ENDPOINT_EXAMPLES)]
    Create {
        route: String,
        #[command(flatten)]
        fields: EndpointArgs,
        /// A signing secret of your own (whsec_ and base64); ferry makes one when left out.
        #[arg(long)]
        secret: Option<String>,
        /// Create it disabled: it receives nothing until enabled.
        #[arg(long)]
        disabled: bool,
    },
    /// One endpoint, its secret masked.
    Show { id: String },
    /// Change the fields given.
    Update {
        id: String,
        #[command(flatten)]
        fields: EndpointArgs,
    },
    /// Deliver to it again, starting with the deliveries that waited while it was disabled.
    Enable { id: String },
    /// Stop delivering to it: new events are not handed to it, its pending deliveries wait.
    Disable { id: String },
    /// Give it a new signing secret, printed this once; the previous one keeps signing as well
    /// for --keep-previous.
    RotateSecret {
        id: String,
        /// The new secret (whsec_ and base64); ferry makes one when left out.
        #[arg(long)]
        secret: Option<String>,
        /// How long the previous secret keeps signing too.
        #[arg(long, value_parser = parse_duration, default_value = "24h")]
        keep_previous: std::time::Duration,
    },
    /// Delete it; its deliveries not yet made end FAILED (no_transport), kept for inspection.
    Delete { id: String },
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
        lang: super::scaffold::Lang,
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
    /// Where this invocation's configuration comes from: the file it names (or ./ferry.toml when
    /// present), the environment, and --database-url.
    pub fn sources(&self) -> anyhow::Result<Sources> {
        sources(self.config.as_deref(), self.database_url.clone())
    }

    /// Reads this invocation's configuration again, as `serve` does on SIGHUP: from the file
    /// found now (./ferry.toml included), which must still be there then.
    pub fn reread(&self) -> crate::service::Reread {
        let file = self.config.clone().or_else(|| Some(PathBuf::from("ferry.toml")).filter(|p| p.exists()));
        let database_url = self.database_url.clone();
        Box::new(move || Ok(sources(file.as_deref(), database_url.clone())?.load()?))
    }

    /// Loads the configuration this invocation names.
    pub fn load_config(&self) -> anyhow::Result<Config> {
        Ok(self.sources()?.load()?)
    }
}

/// The configuration's sources: the file `config` names (or ./ferry.toml when present), the
/// environment, and `database_url`.
fn sources(config: Option<&std::path::Path>, database_url: Option<String>) -> anyhow::Result<Sources> {
    let file = match config {
        Some(path) => Some(path.to_path_buf()),
        None if std::path::Path::new("ferry.toml").exists() => Some(PathBuf::from("ferry.toml")),
        None => None,
    };
    // Only what is UTF-8: ferry's variables are text, and another program's need not be.
    let env: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
        .collect();
    Sources::read(file, env, database_url).map_err(Into::into)
}
