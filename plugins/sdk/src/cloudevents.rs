//! CloudEvents 1.0 for transports that offer it: which mode a route asked for, and an event's
//! context attributes (`specversion`, `id`, `source`, `type`, `time`) as the spec names them. A
//! transport puts them where its protocol binding says: HTTP binary mode as `ce-` headers, Kafka
//! as `ce_` headers, structured mode as members of a JSON envelope, batched mode as one JSON array
//! of such envelopes.

use crate::time::rfc3339_millis;
use crate::{Config, Event};

/// How events go out as CloudEvents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The payload stays the body (or value); the attributes travel as headers.
    Binary,
    /// One JSON envelope holds the attributes and the payload (`data` or `data_base64`).
    Structured,
    /// One message carries several events, a JSON array of structured envelopes (the HTTP
    /// binding's batched content mode).
    Batched,
}

impl Mode {
    /// The mode's name in a route's `cloudevents` setting.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Binary => "binary",
            Mode::Structured => "structured",
            Mode::Batched => "batched",
        }
    }
}

/// A route's CloudEvents settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEvents {
    pub mode: Mode,
    /// The `source` attribute; by default `/ferry/ROUTE`.
    source: Option<String>,
}

impl CloudEvents {
    /// Reads `cloudevents` (one of the modes in `offers`; absent: no CloudEvents) and
    /// `cloudevents_source` (a URI reference naming where events come from).
    pub fn from_config(config: &mut Config, offers: &[Mode]) -> Result<Option<CloudEvents>, String> {
        let source = config.optional("cloudevents_source");
        let Some(mode) = config.optional("cloudevents") else {
            return match source {
                Some(_) => Err("cloudevents_source: needs cloudevents set as well".into()),
                None => Ok(None),
            };
        };
        let Some(mode) = offers.iter().copied().find(|offered| offered.name() == mode) else {
            let names: Vec<&str> = offers.iter().map(|m| m.name()).collect();
            let listed = match names.split_last() {
                Some((last, [])) => (*last).to_string(),
                Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
                None => "nothing: this transport offers no CloudEvents".to_string(),
            };
            return Err(format!("cloudevents: {mode:?} is not a mode; use {listed}"));
        };
        if source.as_deref().is_some_and(|s| s.trim().is_empty() || s.chars().any(char::is_control)) {
            return Err("cloudevents_source: must be a non-empty URI reference".into());
        }
        Ok(Some(CloudEvents { mode, source }))
    }

    /// The event's context attributes, in the spec's order: `specversion`, `id` (the event id,
    /// the same on every attempt), `source`, `type`, and `time` (left out, as the spec allows,
    /// for a time RFC 3339 cannot write).
    pub fn attributes(&self, event: &Event) -> Vec<(&'static str, String)> {
        let source = self.source.clone().unwrap_or_else(|| format!("/ferry/{}", event.route));
        let mut attributes = vec![
            ("specversion", "1.0".to_string()),
            ("id", event.id.to_string()),
            ("source", source),
            ("type", event.event_type.clone()),
        ];
        attributes.extend(rfc3339_millis(event.event_time).map(|time| ("time", time)));
        attributes
    }
}
