//! The trace of one batch, for OpenTelemetry (`telemetry.rs` exports it): a root span for the
//! round, with its claim, each plugin call and the write of its outcomes as children.

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use super::{Outcomes, Relay};
use crate::event::{CallLog, ClaimedEvent, Completion, Disposition};
use crate::telemetry::{Attr, Span, SpanContext, SpanKind, Tracer};

/// When a batch's cycle started, and its claim and the write of its outcomes started and ended.
pub(super) struct BatchTimes {
    pub(super) started: DateTime<Utc>,
    pub(super) claim: (DateTime<Utc>, DateTime<Utc>),
    pub(super) record: (DateTime<Utc>, DateTime<Utc>),
}

impl Relay {
    /// Sends the trace of one batch: the batch, its claim, each plugin call, the write of its
    /// outcomes.
    pub(super) fn trace(
        &self,
        tracer: &Tracer,
        events: &[ClaimedEvent],
        completions: &[Completion],
        times: &BatchTimes,
        totals: &Outcomes,
        fenced_off: usize,
    ) {
        let root = SpanContext::root();
        // The OpenTelemetry name of the database system.
        let db = match self.store.backend() {
            "postgres" => "postgresql",
            other => other,
        };
        let span = |name, kind, (start, end): (DateTime<Utc>, DateTime<Utc>), attributes, links, error| Span {
            context: root.child(),
            parent: Some(root.span_id),
            name,
            kind,
            start,
            end,
            attributes,
            links,
            error,
        };
        tracer.record(span(
            "ferry.claim",
            SpanKind::Client,
            times.claim,
            vec![("db.system", db.into()), ("ferry.claimed", events.len().into())],
            Vec::new(),
            None,
        ));
        let by_id: HashMap<i64, &ClaimedEvent> = events.iter().map(|e| (e.id, e)).collect();
        let mut calls: Vec<(&CallLog, Vec<&Completion>)> = Vec::new();
        for completion in completions {
            let call: &CallLog = &completion.attempt.call;
            match calls.iter_mut().find(|(c, _)| std::ptr::eq(*c, call)) {
                Some((_, items)) => items.push(completion),
                None => calls.push((call, vec![completion])),
            }
        }
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
            let mut attributes = vec![
                ("ferry.route", Attr::from(call.route.as_str())),
                ("ferry.plugin", plugin.as_str().into()),
                ("ferry.plugin.hash", call.plugin_hash.as_deref().unwrap_or_default().into()),
                ("messaging.batch.message_count", items.len().into()),
            ];
            attributes.extend(outcomes.attributes());
            tracer.record(span("ferry.deliver", SpanKind::Producer, (call.started_at, end), attributes, links, error));
        }
        tracer.record(span(
            "ferry.record",
            SpanKind::Client,
            times.record,
            vec![
                ("db.system", db.into()),
                ("ferry.written", completions.len().saturating_sub(fenced_off).into()),
                ("ferry.fenced_off", fenced_off.into()),
            ],
            Vec::new(),
            None,
        ));
        let mut attributes =
            vec![("ferry.instance", Attr::from(self.instance.as_str())), ("ferry.claimed", events.len().into())];
        attributes.extend(totals.attributes());
        tracer.record(Span {
            context: root,
            parent: None,
            name: "ferry.batch",
            kind: SpanKind::Internal,
            start: times.started,
            end: times.record.1,
            attributes,
            links: Vec::new(),
            error: None,
        });
    }
}
