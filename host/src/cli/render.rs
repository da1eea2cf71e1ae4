//! The CLI's text output: tables and blocks drawn from the same typed views `--json` prints, and
//! the progress bar of bulk operations.

use std::fmt::Write as _;
use std::io::IsTerminal as _;

use crate::breaker::BreakerState;
use crate::config::ConfigShown;
use crate::event::Status;
use crate::report::{
    BreakerView, ConfigCheck, EventView, FailedPage, FailedSummary, PluginsView, ReloadView, StatsView, StatusCounts,
};
use crate::store::{self, Percentiles};

/// How much of a payload `ferry show --payload head` prints.
pub const PAYLOAD_HEAD: usize = 1024;

/// A text table: each column as wide as its widest cell, numbers right-aligned, the last column
/// not padded (so a long error does not push every line wider).
pub(super) struct Table {
    columns: Vec<(&'static str, bool)>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// Columns by title; `true` right-aligns one (counts, ids).
    pub(super) fn new(columns: &[(&'static str, bool)]) -> Table {
        Table { columns: columns.to_vec(), rows: Vec::new() }
    }

    pub(super) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub(super) fn render(&self) -> String {
        let width = |i: usize| {
            let title = self.columns[i].0.chars().count();
            self.rows.iter().map(|r| r.get(i).map_or(0, |c| c.chars().count())).max().unwrap_or(0).max(title)
        };
        let widths: Vec<usize> = (0..self.columns.len()).map(width).collect();
        let line = |cells: &mut dyn Iterator<Item = &str>| {
            let mut out = String::new();
            for (i, cell) in cells.enumerate() {
                let last = i + 1 == self.columns.len();
                let (w, right) = (widths[i], self.columns[i].1);
                let pad = w.saturating_sub(cell.chars().count());
                if i > 0 {
                    out.push_str("  ");
                }
                match (right, last) {
                    (true, _) => out.push_str(&format!("{}{cell}", " ".repeat(pad))),
                    (false, true) => out.push_str(cell),
                    (false, false) => out.push_str(&format!("{cell}{}", " ".repeat(pad))),
                }
            }
            out.trim_end().to_string()
        };
        let mut out = line(&mut self.columns.iter().map(|(title, _)| *title));
        for row in &self.rows {
            out.push('\n');
            out.push_str(&line(&mut row.iter().map(String::as_str)));
        }
        out
    }
}

/// A span of time as a person reads it: the two largest units, such as `3h 12m`, `45s`, `2d 4h`.
pub fn human(d: std::time::Duration) -> String {
    let s = d.as_secs();
    if s == 0 {
        return format!("{}ms", d.as_millis());
    }
    let parts = [(s / 86_400, "d"), (s / 3_600 % 24, "h"), (s / 60 % 60, "m"), (s % 60, "s")];
    let first = parts.iter().position(|(n, _)| *n > 0).unwrap_or(3);
    parts[first..]
        .iter()
        .take(2)
        .filter(|(n, _)| *n > 0)
        .map(|(n, unit)| format!("{n}{unit}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// How long before now `t` was, as `3h 12m ago`; `-` for none.
fn ago(t: Option<chrono::DateTime<chrono::Utc>>) -> String {
    match t {
        None => "-".into(),
        Some(t) => match (chrono::Utc::now() - t).to_std() {
            Ok(d) => format!("{} ago", human(d)),
            Err(_) => format!("in {}", human((t - chrono::Utc::now()).to_std().unwrap_or_default())),
        },
    }
}

pub(super) fn untrusted(text: &str) -> String {
    crate::untrusted::clean(text, 64)
}

/// `ferry status`: events per status.
pub fn status(counts: &StatusCounts) -> String {
    let mut table = Table::new(&[("STATUS", false), ("EVENTS", true)]);
    for status in Status::ALL {
        table.row(vec![status.as_str().into(), counts.get(&status).copied().unwrap_or(0).to_string()]);
    }
    table.render()
}

/// `ferry stats`: the figures, latency over `window`.
pub fn stats(stats: &StatsView, window: std::time::Duration) -> String {
    let columns = [("ROUTE", false), ("PENDING", true), ("PROCESSING", true), ("SENT", true), ("FAILED", true)];
    let mut table = Table::new(&columns);
    for (route, counts) in &stats.routes {
        let n = |s: Status| counts.get(&s).copied().unwrap_or(0).to_string();
        table.row(vec![
            untrusted(route),
            n(Status::Pending),
            n(Status::Processing),
            n(Status::Sent),
            n(Status::Failed),
        ]);
    }
    let mut out = table.render();
    let seconds = |s: Option<f64>| s.map_or("-".to_string(), |s| human(std::time::Duration::from_secs_f64(s.max(0.0))));
    let window = human(window);
    let _ = write!(out, "\n\noldest pending event   {}", seconds(stats.oldest_pending_age_seconds));
    let _ = write!(out, "\nclaim lag              {}", seconds(stats.claim_lag_seconds));
    let _ = write!(out, "\nstuck in PROCESSING    {}", stats.stuck);
    let _ = write!(out, "\non their last attempt  {}", stats.last_attempt);
    match &stats.latency {
        Some(l) => {
            let line = |p: &Percentiles| {
                format!("p50 {} ms  p95 {} ms  p99 {} ms  max {} ms", p.p50_ms, p.p95_ms, p.p99_ms, p.max_ms)
            };
            let _ = write!(out, "\nlatency over the last {window} ({} events delivered):", l.samples);
            let _ = write!(out, "\n  from event time      {}", line(&l.from_event_time));
            let _ = write!(out, "\n  from creation        {}", line(&l.from_created));
        }
        None => {
            let _ = write!(out, "\nlatency                no events delivered in the last {window}");
        }
    }
    out
}

/// `ferry failed summary`: one line per group, the largest first.
pub fn failed_summary(summary: &FailedSummary) -> String {
    let columns = [
        ("EVENTS", true),
        ("ROUTE", false),
        ("TYPE", false),
        ("REASON", false),
        ("FIRST FAILED", false),
        ("LAST FAILED", false),
    ];
    let mut table = Table::new(&columns);
    for g in &summary.groups {
        table.row(vec![
            g.count.to_string(),
            untrusted(&g.route),
            untrusted(&g.event_type),
            untrusted(g.reason.as_deref().unwrap_or("-")),
            ago(g.first_failed_at),
            ago(g.last_failed_at),
        ]);
    }
    let mut out = table.render();
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
pub fn failed_page(page: &FailedPage, newest: bool) -> String {
    let columns = [
        ("ID", true),
        ("ROUTE", false),
        ("TYPE", false),
        ("CREATED", false),
        ("FAILED", false),
        ("ATTEMPTS", true),
        ("REASON", false),
        ("LAST ERROR", false),
    ];
    let mut table = Table::new(&columns);
    for e in &page.events {
        table.row(vec![
            e.id.to_string(),
            untrusted(&e.route),
            untrusted(&e.event_type),
            e.created_at.format("%Y-%m-%d %H:%M:%SZ").to_string(),
            ago(Some(e.last_status_at)),
            e.attempts.to_string(),
            e.failure_reason.map_or("-", |r| r.as_str()).to_string(),
            crate::untrusted::clean(e.last_error.as_deref().unwrap_or("-").lines().next().unwrap_or(""), 200),
        ]);
    }
    let mut out = table.render();
    if let Some(next) = page.next_after {
        let _ = write!(out, "\nmore: {}--after {next}", if newest { "--newest " } else { "" });
    }
    out
}

/// `ferry breaker list`.
pub fn breakers(breakers: &[BreakerView]) -> String {
    let mut table =
        Table::new(&[("ROUTE", false), ("STATE", false), ("FAILURES", true), ("OPENED", false), ("REASON", false)]);
    for view in breakers {
        let b = &view.breaker;
        let state = match view.state {
            BreakerState::Open if b.manual => "open (by hand)",
            state => state.as_str(),
        };
        table.row(vec![
            untrusted(&b.route),
            state.to_string(),
            b.consecutive_failures.to_string(),
            ago(b.opened_at),
            crate::untrusted::clean(b.reason.as_deref().unwrap_or("-"), 200),
        ]);
    }
    table.render()
}

/// `ferry plugins list`.
pub fn plugins(view: &PluginsView) -> String {
    let mut table = Table::new(&[
        ("NAME", false),
        ("VERSION", false),
        ("WIT", false),
        ("HASH", false),
        ("ROUTES", false),
        ("FILE", false),
    ]);
    for p in &view.plugins {
        let routes = if p.routes.is_empty() { "-".to_string() } else { p.routes.join(",") };
        table.row(vec![
            untrusted(&p.name),
            untrusted(&p.version),
            p.wit.clone(),
            p.hash[..p.hash.len().min(12)].to_string(),
            routes,
            p.file.display().to_string(),
        ]);
    }
    let mut out = table.render();
    for (path, error) in &view.errors {
        let _ = write!(out, "\nnot loaded: {}: {error}", path.display());
    }
    out
}

/// `ferry config show`: `key = value  # source`, aligned.
pub fn config(shown: &ConfigShown) -> String {
    let mut table = Table::new(&[("KEY", false), ("VALUE", false), ("SOURCE", false)]);
    for s in &shown.settings {
        table.row(vec![s.key.clone(), s.value.to_string(), s.source.clone()]);
    }
    table.render()
}

/// `ferry config check`: each route, the plugins, then errors and warnings, and a verdict.
pub fn config_check(check: &ConfigCheck) -> String {
    let mut table = Table::new(&[("ROUTE", false), ("PLUGIN", false), ("TRANSPORT", false)]);
    for r in &check.routes {
        let state = match &r.error {
            None => "ready".to_string(),
            Some(why) => format!("none: {}", crate::untrusted::clean(why, 300)),
        };
        table.row(vec![untrusted(&r.route), untrusted(&r.plugin), state]);
    }
    let mut out = format!("database      {} (not connected to)\n", check.database);
    let names: Vec<String> =
        check.plugins.plugins.iter().map(|p| format!("{} {}", untrusted(&p.name), untrusted(&p.version))).collect();
    let _ = writeln!(out, "plugins       {}", if names.is_empty() { "none".to_string() } else { names.join(", ") });
    out.push_str(&table.render());
    // Both may quote what a plugin said (its name, its init error).
    for warning in &check.warnings {
        let _ = write!(out, "\nwarning: {}", crate::untrusted::clean(warning, 1000));
    }
    for error in &check.errors {
        let _ = write!(out, "\nerror: {}", crate::untrusted::clean(error, 1000));
    }
    let verdict = if check.ok {
        "\nok: ferry serve would start with this configuration"
    } else {
        "\nnot ok: fix the errors above"
    };
    out.push_str(verdict);
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
    for (n, why) in view.waiting.iter().flatten().enumerate() {
        let _ = writeln!(out, "{:<13} {}", if n == 0 { "waiting" } else { "" }, text(why));
    }
    if let Some(deliveries) = &view.deliveries {
        let _ = writeln!(out, "handed on     as {} deliveries, one per destination", deliveries.len());
        for d in deliveries {
            let _ = writeln!(out, "  {:<10} {:<11} {} attempts  {}", d.id, d.status, d.attempts, text(&d.route));
        }
    }
    if let Some(parent) = event.parent_id {
        let _ = writeln!(out, "parent        event {parent}, handed on to destination {}", text(&event.route));
    }
    let attempts = view.attempts_history.as_deref().unwrap_or_default();
    let _ = writeln!(out, "history       {} attempts recorded", attempts.len());
    for a in attempts {
        let plugin = match (&a.plugin, &a.plugin_hash) {
            // As stored: a row edited by hand may hold any text here.
            (Some(name), Some(hash)) => format!("{}@{}", text(name), text(&hash.chars().take(12).collect::<String>())),
            (Some(name), None) => text(name),
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
    let size = event.payload.len();
    let text = view.payload.as_deref().or(view.payload_json.as_ref().map(|json| json.as_str()));
    match (text, view.payload_bytes) {
        (Some(payload), None) => {
            let _ = write!(out, "payload\n{}", crate::untrusted::printable(payload));
        }
        (Some(payload), Some(_)) => {
            let _ = write!(
                out,
                "payload       the first {} of {size} bytes (--payload full shows all)\n{}\n…",
                payload.len(),
                crate::untrusted::printable(payload)
            );
        }
        (None, _) if view.payload_base64.is_none() && view.payload_bytes.is_some() => {
            let _ = write!(out, "payload       {size} bytes, not shown");
        }
        (None, _) => {
            let _ = write!(out, "payload       {size} bytes, not UTF-8 text");
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
