-- The outbox table. Applications insert rows (in their own transactions); ferry claims, delivers
-- and records them. Every column but route, event_type and payload has a default, so a plain
-- INSERT from any language is enough to emit an event.
CREATE TABLE ferry_events (
    id              BIGSERIAL PRIMARY KEY,
    route           TEXT        NOT NULL CHECK (route <> ''),
    event_type      TEXT        NOT NULL CHECK (event_type <> ''),
    ordering_key    TEXT,
    payload         BYTEA       NOT NULL,
    content_type    TEXT        NOT NULL DEFAULT 'application/json',
    headers         JSONB       NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(headers) = 'object'),
    status          TEXT        NOT NULL DEFAULT 'PENDING'
                                CHECK (status IN ('PENDING', 'PROCESSING', 'SENT', 'FAILED')),
    -- Attempts started so far; incremented when a relay claims the event.
    attempts        INTEGER     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    -- Attempt limit; NULL until pinned from the route's policy on first claim, 0 = unlimited.
    max_attempts    INTEGER     CHECK (max_attempts >= 0),
    -- When the business event happened (immutable).
    event_time      TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- When the row was written (immutable).
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- When status last changed.
    last_status_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Not claimed before this time: deferred delivery and retry backoff.
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- When the event reached SENT or FAILED.
    processed_at    TIMESTAMPTZ,
    last_error      TEXT,
    failure_reason  TEXT CHECK (failure_reason IN
                        ('permanent', 'attempts_exhausted', 'no_transport', 'plugin_fault', 'invalid_event')),
    -- The claim: which instance holds it, the token that fences its writes, and when it expires.
    claimed_by      TEXT,
    claim_token     TEXT,
    lease_until     TIMESTAMPTZ
);

-- Serves the claim: only PENDING rows, in claim order.
CREATE INDEX ferry_events_pending ON ferry_events (next_attempt_at, id) WHERE status = 'PENDING';
-- Serves stuck-claim recovery.
CREATE INDEX ferry_events_processing ON ferry_events (lease_until) WHERE status = 'PROCESSING';
-- Serves counting, listing and resending failed events.
CREATE INDEX ferry_events_failed ON ferry_events (id) WHERE status = 'FAILED';
