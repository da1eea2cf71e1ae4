//! The trace of one batch, for OpenTelemetry (`telemetry.rs` exports it): a root span for the
//! batch, with its claim, each plugin call and each write of its outcomes as children.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};

use super::{Outcomes, Relay};
use crate::event::{CallLog, ClaimedEvent, Completion, Disposition};
use crate::telemetry::{Attr, Span, SpanContext, SpanKind, Tracer};

/// The trace of one batch. Its claim span goes out when the batch is made; each part recorded
/// (the cycle's, and each delivery carried on past it) adds its plugin calls and its write; the
/// root span, the whole batch with its totals, goes out when the last part is done (the batch
/// is dropped), so a batch whose slow deliveries were set aside is still one trace.
pub(super) struct BatchTrace {
    tracer: Arc<Tracer>,
    root: SpanContext,
    /// The OpenTelemetry name of the database system.
    db: &'static str,
    instance: String,
    started: DateTime<Utc>,
    claimed: usize,
    /// What the parts recorded so far add up to, and when the last of them ended.
    recorded: Mutex<(Outcomes, DateTime<Utc>)>,
}

impl BatchTrace {
    /// Starts the trace of a batch of `claimed` events whose cycle started at `started` and whose
    /// claim ran over `claim`, and sends the claim's span.
    pub(super) fn start(
        relay: &Relay,
        tracer: Arc<Tracer>,
        started: DateTime<Utc>,
        claim: (DateTime<Utc>, DateTime<Utc>),
        claimed: usize,
    ) -> BatchTrace {
        let db = match relay.store.backend() {
            "postgres" => "postgresql",
            other => other,
        };
        let trace = BatchTrace {
            tracer,
            root: SpanContext::root(),
            db,
            instance: relay.instance.clone(),
            started,
            claimed,
            recorded: Mutex::new((Outcomes::default(), claim.1)),
        };
        let attributes = vec![("db.system", db.into()), ("ferry.claimed", claimed.into())];
        trace.tracer.record(trace.span("ferry.claim", SpanKind::Client, claim, attributes, Vec::new(), None));
        trace
    }

    fn span(
        &self,
        name: &'static str,
        kind: SpanKind,
        (start, end): (DateTime<Utc>, DateTime<Utc>),
        attributes: Vec<(&'static str, Attr)>,
        links: Vec<SpanContext>,
        error: Option<String>,
    ) -> Span {
        Span {
            context: self.root.child(),
            parent: Some(self.root.span_id),
            name,
            kind,
            start,
            end,
            attributes,
            links,
            error,
        }
    }

    /// Sends the spans of one recorded part of the batch: each plugin call of `completions` (of
    /// `events`) and the write of their outcomes over `record`, of which `fenced_off` were not.
    pub(super) fn part(
        &self,
        events: &[ClaimedEvent],
        completions: &[Completion],
        record: (DateTime<Utc>, DateTime<Utc>),
        totals: &Outcomes,
        fenced_off: usize,
    ) {
        let by_id: HashMap<i64, &ClaimedEvent> = events.iter().map(|e| (e.id, e)).collect();
        let mut calls: Vec<(&CallLog, Vec<&Completion>)> = Vec::new();
        for completion in completions {
            let call: &CallLog = &completion.attempt.call;
            match calls.iter_mut().find(|(c, _)| std::ptr::eq(*c, call)) {
                Some((_, items)) => items.push(completion),
                None => calls.push((call, vec![completion])),
            }
        }
        // The clock reads whole milliseconds, and a call's end is its start plus its duration:
        // a write taking less than a millisecond can seem to end before the call it follows.
        let mut ended = record.1;
        for (call, items) in calls {
            let outcomes = Outcomes::of(items.iter().copied());
            // Events that never reached a plugin (undecodable rows) have no call to show.
            let Some(plugin) = &call.plugin else { continue };
            let links = crate::telemetry::event_links(
                items.iter().filter_map(|c| by_id.get(&c.id)).map(|e| e.headers.as_slice()),
            );
            let error = items.iter().find_map(|c| match &c.disposition {
                Disposition::Retry { error, .. } | Disposition::Failed { error, .. } => Some(error.clone()),
                _ => None,
            });
            let end = crate::clock::later(call.started_at, call.duration);
            ended = ended.max(end);
            let mut attributes = vec![
                ("ferry.route", Attr::from(call.route.as_str())),
                ("ferry.plugin", plugin.as_str().into()),
                ("ferry.plugin.hash", call.plugin_hash.as_deref().unwrap_or_default().into()),
                ("messaging.batch.message_count", items.len().into()),
            ];
            attributes.extend(outcomes.attributes());
            let span = self.span("ferry.deliver", SpanKind::Producer, (call.started_at, end), attributes, links, error);
            self.tracer.record(span);
        }
        let attributes = vec![
            ("db.system", self.db.into()),
            ("ferry.written", completions.len().saturating_sub(fenced_off).into()),
            ("ferry.fenced_off", fenced_off.into()),
        ];
        self.tracer.record(self.span("ferry.record", SpanKind::Client, record, attributes, Vec::new(), None));
        let mut recorded = self.recorded.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        recorded.0.add(totals);
        recorded.1 = recorded.1.max(ended);
    }
}

impl Drop for BatchTrace {
    fn drop(&mut self) {
        let (totals, ended) = *self.recorded.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut attributes =
            vec![("ferry.instance", Attr::from(self.instance.as_str())), ("ferry.claimed", self.claimed.into())];
        attributes.extend(totals.attributes());
        self.tracer.record(Span {
            context: self.root,
            parent: None,
            name: "ferry.batch",
            kind: SpanKind::Internal,
            start: self.started,
            end: ended,
            attributes,
            links: Vec::new(),
            error: None,
        });
    }
}
