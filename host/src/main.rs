//! The `ferry` binary: parses the command line, sets up logging, and runs the command.

use std::io::IsTerminal as _;
use std::process::ExitCode;

use clap::Parser as _;
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = ferry::cli::Cli::parse();
    let filter = EnvFilter::try_from_env("FERRY_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("FERRY_LOG_FORMAT").is_ok_and(|f| f == "json");
    let ansi = std::io::stderr().is_terminal();
    let subscriber = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    if json {
        subscriber.json().init();
    } else {
        subscriber.init();
    }
    match ferry::cli::run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of our output went away (`ferry failed list | head`): nothing left to say.
        Err(e) if e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) => {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
