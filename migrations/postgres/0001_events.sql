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
-- Serves retention: SENT rows by age.
CREATE INDEX ferry_events_sent ON ferry_events (processed_at) WHERE status = 'SENT';
-- Serves per-key ordering: the unfinished events of one key, oldest first.
CREATE INDEX ferry_events_key ON ferry_events (route, ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status <> 'SENT';

-- Wakes idle relays (LISTEN ferry_events) when events are committed or resent, so delivery does
-- not wait for the next poll. Notifications are sent at commit, and duplicates within one
-- transaction are folded into one.
CREATE FUNCTION ferry_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('ferry_events', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER ferry_events_inserted AFTER INSERT ON ferry_events
    FOR EACH STATEMENT EXECUTE FUNCTION ferry_events_notify();
CREATE TRIGGER ferry_events_resent AFTER UPDATE OF status ON ferry_events
    FOR EACH ROW WHEN (OLD.status = 'FAILED' AND NEW.status = 'PENDING')
    EXECUTE FUNCTION ferry_events_notify();
