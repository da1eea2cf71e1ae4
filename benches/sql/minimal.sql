-- The minimal outbox floor: a fenced outbox at its leanest, independent of ferry's schema and
-- statements. Only the outbox columns, two partial indexes (pending by due time and id; claimed
-- by token), a claim that is one UPDATE of a SKIP LOCKED sub-select, and a completion that is one
-- UPDATE by claim token. No history, no ordering, no breakers: what any fenced outbox must pay.
CREATE TABLE floor_events (
    id              BIGSERIAL PRIMARY KEY,
    route           TEXT        NOT NULL,
    event_type      TEXT        NOT NULL,
    payload         BYTEA       NOT NULL,
    headers         JSONB       NOT NULL DEFAULT '{}',
    status          TEXT        NOT NULL DEFAULT 'PENDING',
    attempts        INTEGER     NOT NULL DEFAULT 0,
    next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    claim_token     TEXT,
    lease_until     TIMESTAMPTZ
);
CREATE INDEX floor_events_pending ON floor_events (next_attempt_at, id) WHERE status = 'PENDING';
CREATE INDEX floor_events_claimed ON floor_events (claim_token) WHERE status = 'PROCESSING';
