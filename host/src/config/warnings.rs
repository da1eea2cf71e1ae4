//! What is probably a mistake in a valid configuration: nothing breaks, so ferry starts, and
//! `serve` and `ferry config check` say what to change.

use std::time::Duration;

use super::{Config, format_duration};

/// What [`Config::lease_warnings`] asks of `relay.lease` beyond twice a plugin's timeout: room
/// for the claim itself and the few clock ticks the lease check keeps spare (`plugins::pool`).
pub const LEASE_MARGIN: Duration = Duration::from_secs(1);

impl Config {
    /// A warning when, on PostgreSQL, `database.max_connections` leaves no connection spare beside
    /// the relay's: each busy worker holds one for its statements and LISTEN holds one for good.
    /// With fewer, workers wait for each other's connections, and the admin API and readiness
    /// probe wait behind them under load. Nothing breaks, so it is not an error: a config that ran
    /// with two workers keeps running with the default four. On SQLite the relay's writes take
    /// turns on a connection of their own, so it needs none.
    pub fn pool_warning(&self) -> Option<String> {
        let (pool, workers, listen) = (self.database.max_connections, self.relay.workers, u32::from(self.relay.listen));
        let needed = workers + listen + 1;
        if !self.on_postgres() || pool >= needed {
            return None;
        }
        let lower = match pool.checked_sub(listen + 1) {
            Some(most) if most >= 1 => format!(", or relay.workers to at most {most}"),
            _ => String::new(),
        };
        Some(format!(
            "database.max_connections ({pool}) is below the {needed} connections relay.workers ({workers}) need on PostgreSQL: \
             one per busy worker{}, and one spare for the admin API and readiness; with fewer, {} under load. \
             Set database.max_connections (FERRY_DATABASE_MAX_CONNECTIONS) to at least {needed}{lower}",
            if listen == 1 { ", one that LISTEN holds (relay.listen)" } else { "" },
            if pool < workers + listen {
                "workers wait for each other's connections and the admin API and readiness wait behind them"
            } else {
                "the admin API and readiness wait for a worker's connection"
            },
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
