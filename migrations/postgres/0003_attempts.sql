-- Delivery history: one row per delivery attempt of an event, written in the same transaction as
-- the outcome it led to. A resend starts the event's attempt count again but keeps these rows;
-- they go when their event is deleted (retention or purge).
CREATE TABLE ferry_attempts (
    id          BIGSERIAL   PRIMARY KEY,
    event_id    BIGINT      NOT NULL REFERENCES ferry_events (id) ON DELETE CASCADE,
    -- The event's attempt number at the time (1 = first delivery).
    attempt     INTEGER     NOT NULL CHECK (attempt >= 0),
    started_at  TIMESTAMPTZ NOT NULL,
    -- How long the plugin call took, in milliseconds.
    duration_ms BIGINT      NOT NULL CHECK (duration_ms >= 0),
    -- What was recorded: SENT, a retry, or FAILED.
    outcome     TEXT        NOT NULL CHECK (outcome IN ('sent', 'retry', 'failed')),
    -- For outcome 'failed': the failure reason, as in ferry_events.failure_reason.
    reason      TEXT,
    error       TEXT,
    -- The plugin that handled the attempt and the SHA-256 of its file (NULL when no plugin ran).
    plugin      TEXT,
    plugin_hash TEXT,
    -- The ferry instance that made the attempt.
    instance    TEXT
);

CREATE INDEX ferry_attempts_event ON ferry_attempts (event_id, id);
