//! The `ferry` binary: parses the command line, sets up logging, and runs the command.

use std::io::IsTerminal as _;
use std::process::ExitCode;

use ferry::cli::{self, Answered, Cli};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let cli = match <Cli as clap::Parser>::try_parse_from(&args) {
        Ok(cli) => cli,
        // `--json` wants its errors as JSON too, a wrong command line included (exit code 2, as
        // clap's). Help and --version are answers, not errors.
        Err(e) if e.use_stderr() && args.iter().skip(1).take_while(|a| *a != "--").any(|a| a == "--json") => {
            let text = e.render().to_string();
            let message = text.trim().strip_prefix("error: ").unwrap_or(text.trim());
            let first = message.split("\n\n").next().unwrap_or(message);
            cli::report_error(true, "usage", first.trim());
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    if let Err(message) = logging() {
        return cli::report_error(cli.json, "config", &message);
    }
    let json = cli.json;
    match cli::run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of our output went away (`ferry failed list | head`): nothing left to say.
        Err(e) if e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) => {
            ExitCode::SUCCESS
        }
        // The answer, already printed, says what failed; JSON gets no second object.
        Err(e) if json && e.downcast_ref::<Answered>().is_some() => ExitCode::FAILURE,
        Err(e) => cli::report_error(json, cli::error_code(&e), &cli::error_message(&e)),
    }
}

/// Logs to standard error as `FERRY_LOG` (default `info`) and `FERRY_LOG_FORMAT` (`text`, the
/// default, or `json`) say; a value ferry cannot use is an error naming the variable.
fn logging() -> Result<(), String> {
    let filter = match std::env::var("FERRY_LOG") {
        // Set but empty (a line left in an environment file): the default.
        Ok(spec) if spec.trim().is_empty() => EnvFilter::new(DEFAULT_LOG),
        Ok(spec) => log_filter(&spec)?,
        Err(std::env::VarError::NotPresent) => EnvFilter::new(DEFAULT_LOG),
        Err(std::env::VarError::NotUnicode(_)) => return Err("environment variable FERRY_LOG is not UTF-8".into()),
    };
    let json = match std::env::var("FERRY_LOG_FORMAT").as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("text") => false,
        Ok("json") => true,
        Ok(other) => {
            return Err(format!(
                "environment variable FERRY_LOG_FORMAT: {other:?} is not a log format; use text or json"
            ));
        }
        Err(std::env::VarError::NotUnicode(_)) => {
            return Err("environment variable FERRY_LOG_FORMAT is not UTF-8".into());
        }
    };
    let ansi = std::io::stderr().is_terminal();
    let subscriber = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    if json {
        subscriber.json().init();
    } else {
        subscriber.init();
    }
    Ok(())
}

/// ferry's own lines at info; PostgreSQL's notices (such as "relation already exists, skipping"
/// while migrating) only when they are warnings.
const DEFAULT_LOG: &str = "info,sqlx::postgres::notice=warn";

/// `FERRY_LOG` as a filter. Each comma-separated directive is a level (`debug`) or
/// `TARGET=LEVEL` (`ferry=debug`, `sqlx=warn`); a bare word that is not a level would silently
/// mean "everything of a module named so", so it is refused.
fn log_filter(spec: &str) -> Result<EnvFilter, String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let bad = |why: String| {
        format!(
            "environment variable FERRY_LOG: {spec:?} {why}; use a level (off, error, warn, info, debug, trace) \
             or directives such as ferry=debug,sqlx=warn"
        )
    };
    for directive in spec.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let level = directive.rsplit_once('=').map_or(directive, |(_, level)| level);
        if !LEVELS.contains(&level.to_ascii_lowercase().as_str()) {
            return Err(bad(format!("has {directive:?}, which is not a level or TARGET=LEVEL")));
        }
    }
    EnvFilter::try_new(spec).map_err(|e| bad(format!("is not a log filter ({e})")))
}
