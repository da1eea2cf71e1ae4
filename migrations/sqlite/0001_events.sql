-- The outbox table (SQLite). Timestamps are integer milliseconds since the Unix epoch, UTC.
-- Every column but route, event_type and payload has a default, so a plain INSERT is enough to
-- emit an event.
CREATE TABLE ferry_events (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    route           TEXT    NOT NULL CHECK (route <> ''),
    event_type      TEXT    NOT NULL CHECK (event_type <> ''),
    ordering_key    TEXT,
    payload         BLOB    NOT NULL,
    content_type    TEXT    NOT NULL DEFAULT 'application/json',
    headers         TEXT    NOT NULL DEFAULT '{}' CHECK (json_valid(headers) AND json_type(headers) = 'object'),
    status          TEXT    NOT NULL DEFAULT 'PENDING'
                            CHECK (status IN ('PENDING', 'PROCESSING', 'SENT', 'FAILED')),
    -- Attempts started so far; incremented when a relay claims the event.
    attempts        INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- Attempt limit; NULL until pinned from the route's policy on first claim, 0 = unlimited.
    max_attempts    INTEGER CHECK (max_attempts >= 0),
    event_time      INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    created_at      INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    last_status_at  INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    next_attempt_at INTEGER NOT NULL DEFAULT (CAST(unixepoch('subsec') * 1000 AS INTEGER)),
    processed_at    INTEGER,
    last_error      TEXT,
    failure_reason  TEXT CHECK (failure_reason IN
                        ('permanent', 'attempts_exhausted', 'no_transport', 'plugin_fault', 'invalid_event')),
    claimed_by      TEXT,
    claim_token     TEXT,
    lease_until     INTEGER
);

CREATE INDEX ferry_events_pending ON ferry_events (next_attempt_at, id) WHERE status = 'PENDING';
CREATE INDEX ferry_events_processing ON ferry_events (lease_until) WHERE status = 'PROCESSING';
CREATE INDEX ferry_events_failed ON ferry_events (id) WHERE status = 'FAILED';
CREATE INDEX ferry_events_sent ON ferry_events (processed_at) WHERE status = 'SENT';
CREATE INDEX ferry_events_key ON ferry_events (route, ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status <> 'SENT';
