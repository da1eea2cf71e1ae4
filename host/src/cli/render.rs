//! The CLI's text output: tables and blocks drawn from the same typed views `--json` prints, and
//! the progress bar of bulk operations.

use std::fmt::Write as _;
use std::io::IsTerminal as _;

use crate::breaker::BreakerState;
use crate::event::Status;
use crate::report::{
    BreakerView, EventView, FailedPage, FailedSummary, PluginsView, ReloadView, StatsView, StatusCounts,
};
use crate::store::{self, Percentiles};

/// `ferry status`: events per status.
pub fn status(counts: &StatusCounts) -> String {
    let mut out = format!("{:<12}{:>10}", "STATUS", "EVENTS");
    for status in Status::ALL {
        let _ = write!(out, "\n{:<12}{:>10}", status.as_str(), counts.get(&status).copied().unwrap_or(0));
    }
    out
}

/// `ferry stats`: the figures, latency over `window`.
pub fn stats(stats: &StatsView, window: std::time::Duration) -> String {
    let mut out = format!("{:<20} {:>10} {:>10} {:>10} {:>10}", "ROUTE", "PENDING", "PROCESSING", "SENT", "FAILED");
    for (route, counts) in &stats.routes {
        let n = |s: Status| counts.get(&s).copied().unwrap_or(0);
        let _ = write!(
            out,
            "\n{route:<20} {:>10} {:>10} {:>10} {:>10}",
            n(Status::Pending),
            n(Status::Processing),
            n(Status::Sent),
            n(Status::Failed)
        );
    }
    let seconds = |s: Option<f64>| s.map_or("-".to_string(), |s| format!("{s:.1}s"));
    let _ = write!(out, "\n\noldest pending event   {}", seconds(stats.oldest_pending_age_seconds));
    let _ = write!(out, "\nclaim lag              {}", seconds(stats.claim_lag_seconds));
    let _ = write!(out, "\nstuck in PROCESSING    {}", stats.stuck);
    let _ = write!(out, "\non their last attempt  {}", stats.last_attempt);
    match &stats.latency {
        Some(l) => {
            let line = |p: &Percentiles| {
                format!("p50 {} ms  p95 {} ms  p99 {} ms  max {} ms", p.p50_ms, p.p95_ms, p.p99_ms, p.max_ms)
            };
            let _ = write!(out, "\nlatency over the last {window:?} ({} events delivered):", l.samples);
            let _ = write!(out, "\n  from event time      {}", line(&l.from_event_time));
            let _ = write!(out, "\n  from creation        {}", line(&l.from_created));
        }
        None => {
            let _ = write!(out, "\nlatency                no events delivered in the last {window:?}");
        }
    }
    out
}

/// `ferry failed summary`: one line per group, the largest first.
pub fn failed_summary(summary: &FailedSummary) -> String {
    let mut out =
        format!("{:>8}  {:<16} {:<24} {:<18} {:<25} LAST FAILED", "EVENTS", "ROUTE", "TYPE", "REASON", "FIRST FAILED");
    let time = |t: Option<chrono::DateTime<chrono::Utc>>| t.map_or("-".to_string(), |t| t.to_rfc3339());
    for g in &summary.groups {
        let _ = write!(
            out,
            "\n{:>8}  {:<16} {:<24} {:<18} {:<25} {}",
            g.count,
            crate::untrusted::clean(&g.route, 64),
            crate::untrusted::clean(&g.event_type, 64),
            crate::untrusted::clean(g.reason.as_deref().unwrap_or("-"), 64),
            time(g.first_failed_at),
            time(g.last_failed_at),
        );
    }
    let _ = write!(out, "\n{} FAILED events in {} groups", summary.total, summary.groups.len());
    if summary.truncated {
        let _ = write!(
            out,
            " (the largest {}; narrow with --route, --type or --reason for the rest)",
            summary.groups.len()
        );
    }
    out
}

/// `ferry failed list`: one line per event, and how to get the next page.
pub fn failed_page(page: &FailedPage) -> String {
    let mut out = format!(
        "{:>10}  {:<16} {:<20} {:<25} {:>8}  {:<18} LAST ERROR",
        "ID", "ROUTE", "TYPE", "CREATED", "ATTEMPTS", "REASON"
    );
    for e in &page.events {
        let _ = write!(
            out,
            "\n{:>10}  {:<16} {:<20} {:<25} {:>8}  {:<18} {}",
            e.id,
            crate::untrusted::clean(&e.route, 64),
            crate::untrusted::clean(&e.event_type, 64),
            e.created_at.to_rfc3339(),
            e.attempts,
            e.failure_reason.map_or("-", |r| r.as_str()),
            crate::untrusted::clean(e.last_error.as_deref().unwrap_or("-").lines().next().unwrap_or(""), 200)
        );
    }
    if let Some(next) = page.next_after {
        let _ = write!(out, "\nmore: --after {next}");
    }
    out
}

/// `ferry breaker list`.
pub fn breakers(breakers: &[BreakerView]) -> String {
    let mut out = format!("{:<20} {:<10} {:>8}  {:<25} REASON", "ROUTE", "STATE", "FAILURES", "OPENED AT");
    for view in breakers {
        let b = &view.breaker;
        let opened = b.opened_at.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into());
        let state = match view.state {
            BreakerState::Open if b.manual => "open (by hand)",
            state => state.as_str(),
        };
        let reason = b.reason.as_deref().unwrap_or("-");
        let _ = write!(out, "\n{:<20} {:<10} {:>8}  {:<25} {reason}", b.route, state, b.consecutive_failures, opened);
    }
    out
}

/// `ferry plugins list`.
pub fn plugins(view: &PluginsView) -> String {
    let mut out = format!("{:<16} {:<10} {:<14} {:<24} FILE", "NAME", "VERSION", "HASH", "ROUTES");
    for p in &view.plugins {
        let routes = if p.routes.is_empty() { "-".to_string() } else { p.routes.join(",") };
        let hash = &p.hash[..p.hash.len().min(12)];
        let _ = write!(out, "\n{:<16} {:<10} {:<14} {:<24} {}", p.name, p.version, hash, routes, p.file.display());
    }
    for (path, error) in &view.errors {
        let _ = write!(out, "\nnot loaded: {}: {error}", path.display());
    }
    out
}

/// `ferry plugins reload`: one line per file.
pub fn reload(view: &ReloadView) -> String {
    let lines: Vec<String> = view
        .files
        .iter()
        .map(|f| {
            let result = serde_json::to_value(f.result).ok().and_then(|v| v.as_str().map(str::to_string));
            let detail = f.error.as_deref().or(f.plugin.as_deref()).unwrap_or("");
            format!("{:<10} {} {detail}", result.unwrap_or_default(), f.file.display())
        })
        .collect();
    lines.join("\n")
}

/// `ferry show`: every field, the payload as text when it is UTF-8, and the delivery history.
pub fn event(view: &EventView) -> String {
    let mut out = String::new();
    let event = &view.event;
    let time = |t: Option<chrono::DateTime<chrono::Utc>>| t.map(|t| t.to_rfc3339()).unwrap_or_else(|| "-".into());
    let limit = match event.max_attempts {
        None => "the route's limit".to_string(),
        Some(0) => "unlimited".to_string(),
        Some(m) => m.to_string(),
    };
    let text = |t: &str| crate::untrusted::clean(t, 4096);
    let fields = [
        ("id", event.id.to_string()),
        ("status", event.status.to_string()),
        ("route", text(&event.route)),
        ("type", text(&event.event_type)),
        ("key", event.ordering_key.as_deref().map_or("-".into(), text)),
        ("attempts", format!("{} of {limit}", event.attempts)),
        ("event time", time(Some(event.event_time))),
        ("created", time(Some(event.created_at))),
        ("status since", time(Some(event.last_status_at))),
        ("next attempt", time(Some(event.next_attempt_at))),
        ("processed", time(event.processed_at)),
        ("failure", event.failure_reason.map_or("-".into(), |r| r.to_string())),
        ("last error", event.last_error.as_deref().map_or("-".into(), text)),
        ("claimed by", event.claimed_by.as_deref().map_or("-".into(), text)),
        ("content type", text(&event.content_type)),
        ("headers", text(&event.headers)),
        ("unreadable", event.defect.clone().unwrap_or_else(|| "-".into())),
    ];
    for (name, value) in fields {
        let _ = writeln!(out, "{name:<13} {value}");
    }
    let attempts = view.attempts_history.as_deref().unwrap_or_default();
    let _ = writeln!(out, "history       {} attempts recorded", attempts.len());
    for a in attempts {
        let plugin = match (&a.plugin, &a.plugin_hash) {
            (Some(name), Some(hash)) => format!("{name}@{}", &hash[..hash.len().min(12)]),
            (Some(name), None) => name.clone(),
            _ => "-".into(),
        };
        let outcome = match &a.reason {
            Some(reason) => format!("{} ({reason})", a.outcome),
            None => a.outcome.to_string(),
        };
        let error = text(a.error.as_deref().unwrap_or("").lines().next().unwrap_or(""));
        let _ = writeln!(
            out,
            "  #{:<3} {}  {:>6} ms  {outcome:<28} {plugin:<26} {error}",
            a.attempt,
            a.started_at.to_rfc3339(),
            a.duration_ms
        );
    }
    match &view.payload {
        Some(payload) => {
            let _ = write!(out, "payload\n{}", crate::untrusted::printable(payload));
        }
        None => {
            let _ = write!(out, "payload       {} bytes, not UTF-8 text", event.payload.len());
        }
    }
    out
}

/// A one-line progress bar on standard error, drawn only when it is a terminal.
pub struct Progress {
    verb: &'static str,
    terminal: bool,
    drawn: bool,
}

impl Progress {
    pub fn new(verb: &'static str) -> Progress {
        Progress { verb, terminal: std::io::stderr().is_terminal(), drawn: false }
    }

    /// Draws the bar, for operations of more than one step.
    pub fn show(&mut self, done: u64, total: u64) {
        if self.terminal && total > u64::from(store::BULK_STEP) {
            self.drawn = true;
            let width = 30;
            let filled = (done.min(total) * width / total.max(1)) as usize;
            eprint!("\r{} [{}{}] {done}/{}", self.verb, "#".repeat(filled), " ".repeat(width as usize - filled), total);
        }
    }

    pub fn finish(&self) {
        if self.drawn {
            eprintln!();
        }
    }
}

/// `ferry plugins new`: what was written and what to run next.
pub fn scaffold(project: &super::scaffold::Scaffold) -> String {
    let dir = project.dir.display();
    let mut out = format!("wrote the {} transport {:?} in {dir}:", project.lang.label(), project.name);
    for file in &project.files {
        let _ = write!(out, "\n  {file}");
    }
    let _ = write!(out, "\n\nbuild it:\n  cd {} && {}", shell_word(&dir.to_string()), project.build);
    let _ = write!(out, "\ntry it on the sample events:\n  {}", project.try_command);
    out
}

/// `ferry plugins try`: the plugin, how `init` went, then per call its outcomes and what was
/// heard, and a count.
pub fn trial(report: &crate::plugins::trial::TrialReport) -> String {
    use crate::plugins::trial::Heard;
    let text = |s: &str| crate::untrusted::clean(s, crate::untrusted::MAX_LOG_LINE);
    let heard = |out: &mut String, heard: &Heard| {
        for line in &heard.logs {
            let _ = write!(out, "\n  log {:<5} {}", line.level, text(&line.message));
        }
        for refusal in &heard.refused {
            let _ = write!(out, "\n  refused   {}", text(refusal));
        }
        for warning in &heard.warnings {
            let _ = write!(out, "\n  warning   {}", text(warning));
        }
        if heard.left_out > 0 {
            let _ = write!(out, "\n  … {} more lines not shown", heard.left_out);
        }
    };
    let p = &report.plugin;
    let mut out = format!(
        "plugin {} {} (sha256 {}) from {}",
        text(&p.name),
        text(&p.version),
        p.hash.get(..12).unwrap_or(&p.hash),
        p.file.display()
    );
    match &report.init.error {
        None => {
            let _ = write!(out, "\ninit: ok, route {:?} ({} ms)", report.route, report.init.duration_ms);
        }
        Some(error) => {
            let _ = write!(out, "\ninit: failed ({} ms): {}", report.init.duration_ms, text(error));
        }
    }
    heard(&mut out, &report.init.heard);
    for (n, call) in report.calls.iter().enumerate() {
        let events = call.outcomes.len();
        let plural = if events == 1 { "" } else { "s" };
        let _ = write!(out, "\ncall {}: {events} event{plural} in {} ms", n + 1, call.duration_ms);
        if let Some(fault) = &call.fault {
            let _ = write!(out, " — {}", text(fault));
        }
        for o in &call.outcomes {
            let _ = write!(out, "\n  event {} {}: {}", o.id, text(&o.event_type), o.outcome);
            if let Some(reason) = &o.reason {
                let _ = write!(out, ": {}", text(reason));
            }
            if let Some(ms) = o.retry_after_ms {
                let _ = write!(out, " (retry after {ms} ms)");
            }
        }
        heard(&mut out, &call.heard);
    }
    if report.init.error.is_none() {
        let _ = write!(out, "\n{} of {} events succeeded", report.succeeded, report.events);
    }
    out
}

/// `word` as one shell word: as it is when it is plain, else in single quotes.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c));
    if plain { word.to_string() } else { format!("'{}'", word.replace('\'', "'\\''")) }
}
