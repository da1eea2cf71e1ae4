-- A delivery that succeeds is recorded on the event row itself instead of as a history row: the
-- common case, a batch delivered on its first attempt, then costs one UPDATE per batch and no
-- INSERT. ferry_attempts keeps what went wrong (retries and failures); `ferry show` lists the
-- successful delivery after them, from these columns and claimed_by (the instance that made it).
ALTER TABLE ferry_events
    ADD COLUMN sent_started_at  TIMESTAMPTZ,
    ADD COLUMN sent_duration_ms BIGINT CHECK (sent_duration_ms >= 0),
    ADD COLUMN sent_plugin      TEXT,
    ADD COLUMN sent_plugin_hash TEXT;

-- Serves the completion, which finds a claim's rows by its token, and stuck-claim recovery, which
-- reads every PROCESSING row (there are at most workers × batch size per instance).
DROP INDEX ferry_events_processing;
CREATE INDEX ferry_events_claimed ON ferry_events (claim_token) WHERE status = 'PROCESSING';
