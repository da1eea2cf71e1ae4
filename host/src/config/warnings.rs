//! What is probably a mistake in a valid configuration: nothing breaks, so ferry starts, and
//! `serve` and `ferry config check` say what to change.

use std::time::Duration;

use super::{Config, format_duration};

/// What [`Config::lease_warnings`] asks of `relay.lease` beyond twice a plugin's timeout: room
/// for the claim itself and the few clock ticks the lease check keeps spare (`plugins::pool`).
pub const LEASE_MARGIN: Duration = Duration::from_secs(1);

impl Config {
    /// A warning when, on PostgreSQL, `database.max_connections` leaves no connection spare: LISTEN
    /// holds one for good, and the relay's statements that do not run on its own connections
    /// (`database.relay_connections`: claims, hand-ons, outcome writes) need one: breaker reads and
    /// counts, hand-backs, probes, the endpoint table. With fewer, those and the admin API
    /// and readiness probe wait for each other. Nothing breaks, so it is not an error. On SQLite
    /// the relay writes through a connection of its own, so it needs none.
    pub fn pool_warning(&self) -> Option<String> {
        let (pool, listen) = (self.database.max_connections, u32::from(self.relay.listen));
        let needed = listen + 2;
        if !self.on_postgres() || pool >= needed {
            return None;
        }
        Some(format!(
            "database.max_connections ({pool}) leaves no connection spare on PostgreSQL: {}the relay's other \
             statements (breakers, hand-backs, probes, the endpoint table) take one, and the admin API and \
             readiness need one; with fewer, they wait for each other under load. Set database.max_connections \
             (FERRY_DATABASE_MAX_CONNECTIONS) to at least {needed}",
            if listen == 1 { "LISTEN holds one for good (relay.listen), " } else { "" },
        ))
    }

    /// Warnings for plugin tables whose `timeout` leaves too little of `relay.lease` for a call
    /// that waits for an instance. Such a call is begun only while its whole timeout still fits
    /// in the lease, counted from the claim; so with a lease under twice the timeout (and
    /// [`LEASE_MARGIN`] for the claim and the clock's ticks), a call that waits for one running to
    /// its timeout is deferred instead, every time (`ferry_events_held`, reason `lease`). Valid,
    /// so not an error: a plugin that answers well within its timeout never meets it.
    pub fn lease_warnings(&self) -> Vec<String> {
        let lease = self.relay.lease.0;
        self.plugin_tables()
            .filter(|(_, limits)| lease < limits.timeout * 2 + LEASE_MARGIN)
            .map(|(table, limits)| {
                let timeout = limits.timeout;
                format!(
                    "relay.lease ({}) leaves {table}.timeout ({}) too little room: a call that waits more than about {} \
                     for one of the plugin's instances (one call running to its timeout, say) is not begun and its \
                     events are deferred (ferry_events_held, reason \"lease\"); set relay.lease to at least {}, or \
                     raise {table}.instances so calls wait less",
                    format_duration(lease),
                    format_duration(timeout),
                    format_duration(lease.saturating_sub(timeout + LEASE_MARGIN)),
                    format_duration(timeout * 2 + LEASE_MARGIN),
                )
            })
            .collect()
    }
}
