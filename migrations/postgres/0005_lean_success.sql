-- A delivery that succeeds is recorded on the event row itself instead of as a history row: the
-- common case, a batch delivered on its first attempt, then costs one UPDATE per batch and no
-- INSERT. ferry_attempts keeps what went wrong (retries and failures); `ferry show` lists the
-- successful delivery after them, from these columns and claimed_by (the instance that made it).
-- Nullable columns without a default or a constraint: adding them rewrites and scans nothing.
ALTER TABLE ferry_events
    ADD COLUMN sent_started_at  TIMESTAMPTZ,
    ADD COLUMN sent_duration_ms BIGINT,
    ADD COLUMN sent_plugin      TEXT,
    ADD COLUMN sent_plugin_hash TEXT;

-- Rows inserted by hand are checked for the new columns too (see 0004).
CREATE OR REPLACE FUNCTION ferry_events_representable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT (NEW.event_time >= '0001-01-01 00:00:00+00' AND NEW.event_time < '10000-01-01 00:00:00+00'
        AND NEW.created_at >= '0001-01-01 00:00:00+00' AND NEW.created_at < '10000-01-01 00:00:00+00'
        AND NEW.last_status_at >= '0001-01-01 00:00:00+00' AND NEW.last_status_at < '10000-01-01 00:00:00+00'
        AND NEW.next_attempt_at >= '0001-01-01 00:00:00+00' AND NEW.next_attempt_at < '10000-01-01 00:00:00+00'
        AND (NEW.sent_started_at IS NULL OR (NEW.sent_started_at >= '0001-01-01 00:00:00+00'
                                             AND NEW.sent_started_at < '10000-01-01 00:00:00+00'))
        AND (NEW.sent_duration_ms IS NULL OR NEW.sent_duration_ms >= 0))
    THEN
        RAISE EXCEPTION 'ferry_events: times must lie between the years 1 and 9999 (not infinity), durations not be negative'
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

-- Serves the completion, which finds a claim's rows by its token, and stuck-claim recovery, which
-- reads every PROCESSING row (there are at most workers × batch size per instance). Building it
-- scans the table and holds off inserts meanwhile: on a large outbox, create it beforehand with
--   CREATE INDEX CONCURRENTLY ferry_events_claimed ON ferry_events (claim_token) WHERE status = 'PROCESSING';
-- and this migration keeps it.
CREATE INDEX IF NOT EXISTS ferry_events_claimed ON ferry_events (claim_token) WHERE status = 'PROCESSING';
DROP INDEX IF EXISTS ferry_events_processing;
