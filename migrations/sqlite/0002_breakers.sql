-- Circuit breakers, one row per route that has failed at least once (or was switched by hand).
-- Timestamps are integer milliseconds since the Unix epoch, UTC.
CREATE TABLE ferry_breakers (
    route                TEXT    PRIMARY KEY CHECK (route <> ''),
    -- Transient failures since the last success.
    consecutive_failures INTEGER NOT NULL DEFAULT 0 CHECK (consecutive_failures >= 0),
    -- Set while the breaker is open: the route's events are not claimed. After the cooldown one
    -- probe delivery is let through (half-open).
    opened_at            INTEGER,
    reason               TEXT,
    -- Opened by an operator: stays open until closed by hand, no probes.
    manual               INTEGER NOT NULL DEFAULT 0 CHECK (manual IN (0, 1)),
    -- While half-open, the probe delivery in flight holds the route until this time.
    probe_until          INTEGER,
    updated_at           INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER))
);
