//! The scale scenario of webhook endpoints, shared by the test and the benchmark: one route,
//! `hooks`, with 1,000 endpoints of different filters at one receiver (`/ep/I`), and 10,000
//! events of 1,000 types.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use ferry::NewEvent;
use ferry::endpoints::EndpointInput;
use ferry::ops::Ops;
use ferry::store::Store;

pub const ENDPOINTS: usize = 1000;
pub const EVENTS: usize = 10_000;

/// The event types endpoint `i` subscribes to, and whether it receives type `t.K`: most take one
/// exact type, every hundredth (from the 8th) a wildcard matching 111 types, every hundredth
/// (from the 100th) a type never emitted.
pub fn subscription(i: usize) -> (Vec<String>, Box<dyn Fn(usize) -> bool>) {
    match i % 100 {
        7 => (vec!["t.1*".to_string()], Box::new(|k: usize| k.to_string().starts_with('1'))),
        99 => (vec!["never.*".to_string()], Box::new(|_| false)),
        _ => (vec![format!("t.{i}")], Box::new(move |k| k == i)),
    }
}

/// Creates the endpoints of route `hooks`, each at `origin/ep/I`, and inserts the events (event
/// `n` has type `t.{n % 1000}`); returns how many events each endpoint should receive.
pub async fn populate(ops: &Ops, store: &Arc<dyn Store>, origin: &str, now: DateTime<Utc>) -> Vec<usize> {
    for i in 0..ENDPOINTS {
        let input = EndpointInput {
            url: Some(format!("{origin}/ep/{i}")),
            event_types: Some(subscription(i).0),
            ..EndpointInput::default()
        };
        ops.create_endpoint("hooks", input).await.expect("endpoint created");
    }
    let receives: Vec<_> = (0..ENDPOINTS).map(|i| subscription(i).1).collect();
    let mut expected = vec![0usize; ENDPOINTS];
    for n in 0..EVENTS {
        let kind = n % ENDPOINTS;
        let event = NewEvent::new("hooks", format!("t.{kind}"), format!(r#"{{"n":{n}}}"#));
        store.insert(&event, now).await.expect("event inserted");
        for (count, receives) in expected.iter_mut().zip(&receives) {
            *count += usize::from(receives(kind));
        }
    }
    expected
}
