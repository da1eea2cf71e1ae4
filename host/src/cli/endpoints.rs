//! `ferry endpoints`: the webhook endpoints of routes that take them, over the same operations
//! as the admin API.

use std::collections::BTreeMap;

use super::args::{EndpointArgs, EndpointsCommand};
use super::render::{Table, untrusted};
use super::{failed, ops, say};
use crate::config::Config;
use crate::endpoints::{EndpointInput, EndpointView};
use crate::ops::OpError;

pub(super) async fn run(config: &Config, command: EndpointsCommand, json: bool) -> anyhow::Result<()> {
    let ops = ops(config).await?;
    let (view, done) = match command {
        EndpointsCommand::List { route } => {
            let views = ops.list_endpoints(route.as_deref()).await.map_err(failed)?;
            return say(json, &views, |v| list(v));
        }
        EndpointsCommand::Create { route, fields, secret, disabled } => {
            let mut input = input(fields, false).map_err(failed)?;
            input.secret = secret;
            input.enabled = Some(!disabled);
            (ops.create_endpoint(&route, input).await, "created; its signing secret is shown this once")
        }
        EndpointsCommand::Show { id } => (ops.show_endpoint(&id).await, ""),
        EndpointsCommand::Update { id, fields } => {
            (ops.update_endpoint(&id, input(fields, true).map_err(failed)?).await, "updated")
        }
        EndpointsCommand::Enable { id } => (ops.set_endpoint_enabled(&id, true).await, "enabled"),
        EndpointsCommand::Disable { id } => {
            (ops.set_endpoint_enabled(&id, false).await, "disabled: its deliveries wait until it is enabled")
        }
        EndpointsCommand::RotateSecret { id, secret, keep_previous } => (
            ops.rotate_endpoint_secret(&id, secret, keep_previous).await,
            "secret rotated; the new one is shown this once",
        ),
        EndpointsCommand::Delete { id } => {
            let deleted = ops.delete_endpoint(&id).await.map_err(failed)?;
            return say(json, &deleted, |d| {
                format!(
                    "endpoint {} of route {} deleted; its deliveries not yet made end FAILED",
                    d.id,
                    untrusted(&d.route)
                )
            });
        }
    };
    let view = view.map_err(failed)?;
    say(json, &view, |v| {
        let shown = show(v);
        if done.is_empty() { shown } else { format!("endpoint {} {done}\n{shown}", v.id) }
    })
}

/// The options of `create` or `update` as an operation's input; `update` sends only what was given.
fn input(fields: EndpointArgs, update: bool) -> Result<EndpointInput, OpError> {
    let mut headers = BTreeMap::new();
    for pair in &fields.headers {
        let (name, value) =
            pair.split_once('=').ok_or_else(|| OpError::Invalid(format!("--header {pair:?} must be NAME=VALUE")))?;
        headers.insert(name.to_string(), value.to_string());
    }
    let given = |some: bool| some || !update;
    Ok(EndpointInput {
        url: fields.url,
        description: fields.description,
        event_types: given(!fields.event_types.is_empty() || fields.all_event_types).then_some(fields.event_types),
        headers: given(!headers.is_empty() || fields.no_headers).then_some(headers),
        secret: None,
        enabled: None,
    })
}

fn list(views: &[EndpointView]) -> String {
    let mut table =
        Table::new(&[("ID", false), ("ROUTE", false), ("STATE", false), ("EVENT TYPES", false), ("URL", false)]);
    for v in views {
        table.row(vec![
            v.id.clone(),
            untrusted(&v.route),
            if v.enabled { "enabled" } else { "disabled" }.to_string(),
            if v.event_types.is_empty() { "*".to_string() } else { untrusted(&v.event_types.join(", ")) },
            untrusted(&v.url),
        ]);
    }
    table.render()
}

fn show(v: &EndpointView) -> String {
    let mut lines = vec![
        format!("id:             {}", v.id),
        format!("route:          {} (deliveries: {})", untrusted(&v.route), untrusted(&v.delivery_route)),
        format!("url:            {}", untrusted(&v.url)),
        format!("state:          {}", if v.enabled { "enabled" } else { "disabled" }),
        format!(
            "event types:    {}",
            if v.event_types.is_empty() { "all".to_string() } else { untrusted(&v.event_types.join(", ")) }
        ),
        format!("secret:         {}", v.secret),
    ];
    if let Some(until) = v.previous_secret_until {
        lines.push(format!("previous secret signs too until {}", until.to_rfc3339()));
    }
    for (name, value) in &v.headers {
        lines.push(format!("header:         {}: {}", untrusted(name), untrusted(value)));
    }
    if !v.description.is_empty() {
        lines.push(format!("description:    {}", untrusted(&v.description)));
    }
    lines.push(format!("created:        {}", v.created_at.to_rfc3339()));
    lines.push(format!("updated:        {}", v.updated_at.to_rfc3339()));
    lines.join("\n")
}
