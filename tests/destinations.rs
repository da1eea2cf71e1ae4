//! Routes with several destinations: each event is handed on as one delivery per destination
//! whose event types match, and each delivery has its own status, attempts, history, breaker
//! and resend. Real `scripted` plugins record what they deliver; every test runs on both backends.

use std::sync::Arc;
use std::time::Duration;

use chrono::{TimeZone, Utc};
use ferry::NewEvent;
use ferry::clock::{Clock, ManualClock};
use ferry::event::{AttemptOutcome, FailureReason, Status};
use ferry::ops::{FilterInput, FrontEnd, Ops};
use ferry::service::Ferry;
use ferry::store::BulkOp;
use tokio_util::sync::CancellationToken;

use crate::common::{TestDb, plugins_dir};

struct Setup {
    db: TestDb,
    clock: Arc<ManualClock>,
    ferry: Ferry,
}

/// Ferry with `routes` (TOML) over the scripted plugin, which may write to `<dir>/out`; at most 3
/// attempts from 1 s without jitter, and breakers that open after 2 transient failures in a row
/// and probe after a minute.
async fn setup(db: TestDb, routes: &str) -> Setup {
    let plugins = plugins_dir(db.dir.path(), &["ferry_test_scripted"]);
    let out = db.dir.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let config = db.config(&format!(
        r#"
        [relay]
        lease = "10s"
        [plugins]
        dir = {plugins:?}
        timeout = "1s"
        [retry]
        max_attempts = 3
        jitter = "none"
        [breaker]
        threshold = 2
        cooldown = "1m"
        [sandbox.scripted]
        dirs = {{ "/out" = {out:?} }}
        {routes}
        "#
    ));
    let clock = Arc::new(ManualClock::new(Utc.with_ymd_and_hms(2026, 5, 1, 8, 0, 0).unwrap()));
    let ferry = Ferry::start(&config, clock.clone()).await.expect("ferry starts");
    Setup { db, clock, ferry }
}

impl Setup {
    async fn emit(&self, route: &str, event_type: &str) -> i64 {
        self.db.store.insert(&NewEvent::new(route, event_type, "{}"), self.clock.now()).await.unwrap()
    }

    async fn cycle(&self) -> ferry::relay::CycleStats {
        self.ferry.relay.cycle(&CancellationToken::new()).await.unwrap()
    }

    async fn row(&self, id: i64) -> ferry::event::EventRecord {
        self.db.store.get(id).await.unwrap().unwrap()
    }

    /// The event ids a destination's plugin recorded as delivered, in the order it delivered them.
    fn delivered(&self, file: &str) -> Vec<i64> {
        let text = std::fs::read_to_string(self.db.dir.path().join("out").join(file)).unwrap_or_default();
        text.lines().map(|line| line.split(' ').next().unwrap().parse().unwrap()).collect()
    }

    /// The deliveries event `id` was handed on as: (route, id), by route.
    async fn deliveries(&self, id: i64) -> Vec<(String, i64)> {
        let mut found: Vec<(String, i64)> =
            self.db.store.deliveries(id).await.unwrap().into_iter().map(|d| (d.route, d.id)).collect();
        found.sort();
        found
    }

    fn ops(&self) -> Ops {
        Ops::new(self.ferry.settings.get(), self.db.store.clone(), self.clock.clone(), FrontEnd::Cli)
    }
}

const THREE_DESTINATIONS: &str = r#"
    [route.orders.destinations.a]
    plugin = "scripted"
    config = { record = "/out/a.log" }
    [route.orders.destinations.b]
    plugin = "scripted"
    config = { record = "/out/b.log" }
    [route.orders.destinations.c]
    plugin = "scripted"
    config = { answer = "transient-then-permanent", record = "/out/c.log" }
    retry = { max_attempts = 5 }
"#;

async fn a_failing_destination_never_resends_to_the_others(db: TestDb) {
    let s = setup(db, THREE_DESTINATIONS).await;
    let events = [s.emit("orders", "order.created").await, s.emit("orders", "order.paid").await];

    // The first claim hands each event on, once per destination, and ends it SENT.
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.sent), (2, 0), "handing on delivers nothing yet");
    let mut copies = Vec::new();
    for id in events {
        let row = s.row(id).await;
        assert_eq!(row.status, Status::Sent, "{row:?}");
        let deliveries = s.deliveries(id).await;
        let routes: Vec<&str> = deliveries.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(routes, ["orders/a", "orders/b", "orders/c"]);
        for (route, copy) in &deliveries {
            let copy_row = s.row(*copy).await;
            assert_eq!((copy_row.parent_id, copy_row.status), (Some(id), Status::Pending), "{route}");
            assert_eq!(copy_row.event_type, row.event_type);
        }
        copies.push(deliveries);
    }
    let of =
        |route: &str| -> Vec<i64> { copies.iter().map(|d| d.iter().find(|(r, _)| r == route).unwrap().1).collect() };
    let (a, b, c) = (of("orders/a"), of("orders/b"), of("orders/c"));
    let orders = ferry::metrics::RouteOnly { route: "orders".into() };
    let metrics = &s.ferry.metrics;
    assert_eq!(metrics.handed_on.get_or_create(&orders).get(), 2);
    assert_eq!(metrics.deliveries_made.get_or_create(&orders).get(), 6);

    // a and b deliver; c fails transiently, which opens its breaker (2 in a row) and no other.
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.sent, stats.retried), (6, 4, 2));
    assert_eq!((s.delivered("a.log"), s.delivered("b.log")), (a.clone(), b.clone()));
    let breakers = s.db.store.breakers().await.unwrap();
    let open: Vec<&str> = breakers.iter().filter(|b| b.is_open()).map(|b| b.route.as_str()).collect();
    assert_eq!(open, ["orders/c"], "only the failing destination's breaker opens: {breakers:?}");

    // After the cooldown, probes try c again one event at a time: it fails permanently now.
    for _ in 0..6 {
        s.clock.advance(Duration::from_secs(61));
        s.cycle().await;
    }
    for id in &c {
        let row = s.row(*id).await;
        assert_eq!((row.status, row.failure_reason, row.attempts), (Status::Failed, Some(FailureReason::Permanent), 2));
        let history = s.db.store.attempts(*id).await.unwrap();
        let outcomes: Vec<AttemptOutcome> = history.iter().map(|h| h.outcome).collect();
        assert_eq!(outcomes, [AttemptOutcome::Retry, AttemptOutcome::Failed], "{history:?}");
        assert_eq!(history[0].plugin.as_deref(), Some("scripted"));
    }
    assert_eq!((s.delivered("a.log"), s.delivered("b.log")), (a.clone(), b.clone()), "nothing sent twice");
    assert!(s.delivered("c.log").is_empty());

    // The failed-event operations see c's deliveries by their route: count, resend.
    let ops = s.ops();
    let only_c = || FilterInput { route: Some("orders/c".into()), ..FilterInput::default() };
    assert_eq!(ops.failed_count(only_c()).await.unwrap().failed, 2);
    let everything = ops.failed_count(FilterInput::default()).await.unwrap().failed;
    assert_eq!(everything, 2, "a and b have nothing FAILED, nor the events handed on");
    assert_eq!(ops.failed_bulk(only_c(), false, BulkOp::Resend, |_, _| {}).await.unwrap(), 2);
    for id in &c {
        let row = s.row(*id).await;
        assert_eq!((row.status, row.attempts), (Status::Pending, 0), "resent: {row:?}");
    }
    // c's breaker is still open (permanent failures say nothing of the endpoint): after the
    // cooldown one probe takes the oldest, which fails transiently as on a first attempt.
    s.clock.advance(Duration::from_secs(61));
    assert_eq!(s.cycle().await.retried, 1);
    assert_eq!(s.db.store.attempts(c[0]).await.unwrap().len(), 3, "the resend's attempt joins the history");
    assert_eq!(s.row(c[1]).await.attempts, 0, "the other waits for the breaker");
    assert_eq!((s.delivered("a.log"), s.delivered("b.log")), (a, b), "a resend to c sends nothing to a or b");

    // `ferry show` of an event lists its deliveries; of a delivery, where it came from.
    let shown = ops.show(events[0]).await.unwrap();
    let deliveries = shown.deliveries.expect("the deliveries are shown");
    assert_eq!(deliveries.iter().map(|d| d.route.as_str()).collect::<Vec<_>>(), ["orders/a", "orders/b", "orders/c"]);
    assert_eq!(deliveries[0].status, "SENT");
    assert_eq!(ops.show(c[0]).await.unwrap().event.parent_id, Some(events[0]));
    assert!(ops.show(c[0]).await.unwrap().deliveries.is_none());
}

async fn event_types_choose_the_destinations(db: TestDb) {
    let routes = r#"
        [route.hooks.destinations.all]
        plugin = "scripted"
        [route.hooks.destinations.orders]
        plugin = "scripted"
        event_types = ["order.*"]
        [route.hooks.destinations.paid]
        plugin = "scripted"
        event_types = ["invoice.paid", "*.refunded"]
        [route.narrow.destinations.only]
        plugin = "scripted"
        event_types = ["a.*"]
    "#;
    let s = setup(db, routes).await;
    let created = s.emit("hooks", "order.created").await;
    let paid = s.emit("hooks", "invoice.paid").await;
    let refunded = s.emit("hooks", "order.refunded").await;
    let other = s.emit("hooks", "user.signed_up").await;
    let nowhere = s.emit("narrow", "b.c").await;
    assert_eq!(s.cycle().await.claimed, 5);
    let routes_of = |deliveries: Vec<(String, i64)>| deliveries.into_iter().map(|(r, _)| r).collect::<Vec<_>>();
    assert_eq!(routes_of(s.deliveries(created).await), ["hooks/all", "hooks/orders"]);
    assert_eq!(routes_of(s.deliveries(paid).await), ["hooks/all", "hooks/paid"]);
    assert_eq!(routes_of(s.deliveries(refunded).await), ["hooks/all", "hooks/orders", "hooks/paid"]);
    assert_eq!(routes_of(s.deliveries(other).await), ["hooks/all"]);
    assert!(s.deliveries(nowhere).await.is_empty(), "no destination receives b.c");
    assert_eq!(s.row(nowhere).await.status, Status::Sent, "an event no destination receives is done");
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.sent), (8, 8));
}

async fn each_destination_delivers_a_key_in_order(db: TestDb) {
    // y fails the key's first event once (`flaky`); the later ones succeed at once, so unordered
    // they would overtake it. x answers every event with success.
    let routes = r#"
        [route.ledger]
        ordered = true
        [route.ledger.destinations.x]
        plugin = "scripted"
        config = { record = "/out/x.log", answer = "ok" }
        [route.ledger.destinations.y]
        plugin = "scripted"
        config = { record = "/out/y.log" }
    "#;
    let s = setup(db, routes).await;
    let mut events = Vec::new();
    for event_type in ["flaky", "ok", "ok"] {
        let event = NewEvent::new("ledger", event_type, "{}").with_key("account-1");
        events.push(s.db.store.insert(&event, s.clock.now()).await.unwrap());
    }
    for _ in 0..12 {
        s.cycle().await;
        s.clock.advance(Duration::from_secs(5));
    }
    let copies_for = |route: &'static str| {
        let s = &s;
        let events = events.clone();
        async move {
            let mut ids = Vec::new();
            for id in events {
                ids.push(s.deliveries(id).await.into_iter().find(|(r, _)| r == route).unwrap().1);
            }
            ids
        }
    };
    let (x, y) = (copies_for("ledger/x").await, copies_for("ledger/y").await);
    assert_eq!(s.delivered("x.log"), x, "x delivers the key in order");
    assert_eq!(s.delivered("y.log"), y, "y holds the key while its first event waits for a retry");
    assert_eq!(s.row(y[0]).await.attempts, 2);
}

/// The handing on is fenced by the claim: a claim that lost its events (the lease ran out and
/// another instance took them) hands nothing on and inserts no copy.
async fn a_stale_claim_hands_nothing_on(db: TestDb) {
    let s = setup(db, THREE_DESTINATIONS).await;
    let id = s.emit("orders", "order.created").await;
    let handed = s.db.store.fan_out("not-the-claim", s.clock.now(), &[(id, vec!["orders/a".into()])]).await.unwrap();
    assert!(handed.is_empty());
    assert_eq!(s.row(id).await.status, Status::Pending);
    assert!(s.deliveries(id).await.is_empty(), "no copy without the claim");
    assert_eq!(s.cycle().await.claimed, 1);
    assert_eq!(s.deliveries(id).await.len(), 3);
}

async fn emitting_to_a_route_with_destinations_is_accepted(db: TestDb) {
    let s = setup(db, THREE_DESTINATIONS).await;
    let ops = s.ops();
    let created = ops.emit(NewEvent::new("orders", "order.created", "{}"), s.clock.now()).await.unwrap();
    assert_eq!(s.row(created.id).await.route, "orders");
    let unknown = ops.emit(NewEvent::new("nowhere", "x", "{}"), s.clock.now()).await.unwrap_err().to_string();
    assert!(unknown.contains("orders, orders/a, orders/b, orders/c"), "{unknown}");
}

async fn copies_the_database_refuses_fail_only_their_event(db: TestDb) {
    let s = setup(db, THREE_DESTINATIONS).await;
    // The database refuses one event's copy for c, as a constraint an operator added might.
    s.db.refuse_inserts_when("NEW.route = 'orders/c' AND NEW.event_type = 'poison'", "no poison for c").await;
    let before = s.emit("orders", "fine").await;
    let poison = s.emit("orders", "poison").await;
    let after = s.emit("orders", "fine").await;
    assert_eq!(s.cycle().await.claimed, 3);
    let row = s.row(poison).await;
    assert_eq!((row.status, row.failure_reason), (Status::Failed, Some(FailureReason::InvalidEvent)));
    assert!(row.last_error.as_deref().unwrap_or("").contains("no poison for c"), "{row:?}");
    assert!(s.deliveries(poison).await.is_empty(), "none of its copies is kept: all or nothing per event");
    for id in [before, after] {
        assert_eq!(s.row(id).await.status, Status::Sent);
        assert_eq!(s.deliveries(id).await.len(), 3, "the other events are handed on");
    }
    let stats = s.cycle().await;
    assert_eq!((stats.claimed, stats.sent), (6, 4), "and delivered (c fails transiently)");
}

/// A route that had a plugin, and a breaker its failures opened, and now has destinations: the
/// breaker would never see a probe, so the relay closes it and the events are handed on.
async fn an_automatic_breaker_left_on_a_route_with_destinations_is_closed(db: TestDb) {
    let s = setup(db, THREE_DESTINATIONS).await;
    let opened = s.db.store.record_breaker("orders", 2, "from its plugin days", 2, s.clock.now()).await.unwrap();
    assert!(opened.is_open());
    let id = s.emit("orders", "order.created").await;
    assert_eq!(s.cycle().await.claimed, 1);
    assert_eq!(s.deliveries(id).await.len(), 3);
    let breakers = s.db.store.breakers().await.unwrap();
    assert!(breakers.iter().all(|b| !b.is_open()), "{breakers:?}");
}

crate::both_backends!(
    a_failing_destination_never_resends_to_the_others,
    event_types_choose_the_destinations,
    each_destination_delivers_a_key_in_order,
    emitting_to_a_route_with_destinations_is_accepted,
    copies_the_database_refuses_fail_only_their_event,
    a_stale_claim_hands_nothing_on,
    an_automatic_breaker_left_on_a_route_with_destinations_is_closed,
);
