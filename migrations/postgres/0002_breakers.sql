-- Circuit breakers, one row per route that has failed at least once (or was switched by hand),
-- shared by every ferry instance on this database.
CREATE TABLE ferry_breakers (
    route                TEXT        PRIMARY KEY CHECK (route <> ''),
    -- Transient failures since the last success.
    consecutive_failures INTEGER     NOT NULL DEFAULT 0 CHECK (consecutive_failures >= 0),
    -- Set while the breaker is open: the route's events are not claimed. After the cooldown one
    -- probe delivery is let through (half-open).
    opened_at            TIMESTAMPTZ,
    reason               TEXT,
    -- Opened by an operator: stays open until closed by hand, no probes.
    manual               BOOLEAN     NOT NULL DEFAULT false,
    -- While half-open, the probe delivery in flight holds the route until this time.
    probe_until          TIMESTAMPTZ,
    updated_at           TIMESTAMPTZ NOT NULL DEFAULT now()
);
