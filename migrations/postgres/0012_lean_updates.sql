-- Ferry rewrites each event's row twice, at its claim and at its outcome. Everything PostgreSQL
-- runs for each row an UPDATE writes is therefore paid twice per event, whichever columns the
-- UPDATE sets. This migration removes the per-row work that served rare cases:
--
-- - The two AFTER UPDATE row triggers (`ferry_events_resent`, which woke relays when an event
--   was resent, and `ferry_events_edited`, which checked hand-edited names and headers) and the
--   foreign key from ferry_attempts to ferry_events. While any AFTER UPDATE row trigger exists,
--   the foreign key's own included, PostgreSQL fetches the old version of every row an UPDATE
--   writes to hand to it, even when the trigger then does nothing.
-- - The CHECK constraints on attempts, max_attempts and failure_reason: PostgreSQL evaluates
--   every CHECK on every row an UPDATE writes. Ferry's own writes set these columns to values it
--   chose; the INSERT trigger now checks them where applications write them, as it already checks
--   the names, headers and times (0009). The CHECK on status stays, at about 1 000 instructions
--   per event: a row edited into a status ferry does not know would be claimed by no one and
--   counted nowhere, where a wrong count or reason makes its event fail alone, visibly.
--
-- Measured with benches/callgrind-pg (BENCHMARKS.md, "Where PostgreSQL's work goes"): PostgreSQL
-- spends about 6 700 fewer instructions per event (of about 137 000) on the minimal floor's
-- statements run on ferry's table, the change's cost apart from ferry's own statements.
--
-- What changes for applications and operators:
-- - Resending an event by SQL (`UPDATE ferry_events SET status = 'PENDING' ...`) no longer wakes
--   idle relays at once: they find it at their next poll (within `relay.idle_poll_max`, 1 s by
--   default). `ferry resend`, `ferry failed resend` and the admin API wake them themselves.
-- - Deleting events by SQL no longer deletes their history rows in the same statement: retention's
--   sweep deletes history rows whose event is gone as it passes their ids. Ferry's own deletes
--   (retention, `ferry event cancel`, `ferry failed purge`) delete both together.
-- - An UPDATE by hand is checked only for its status: a row edited into something else ferry
--   cannot deliver (a negative count, an empty route, headers too large) is failed alone by the
--   relay as invalid_event naming the column, as one restored without triggers always was.
--
-- Only the catalog changes: no row is read or rewritten. ALTER TABLE takes an exclusive lock on
-- ferry_events and ferry_attempts for a moment, waiting for the transactions using them to end
-- and holding off inserts meanwhile; on a busy outbox run `ferry migrate` with a lock timeout in
-- the database URL (`?options=-c%20lock_timeout%3D5s`), and again if it gives up.
DROP TRIGGER IF EXISTS ferry_events_resent ON ferry_events;
DROP TRIGGER IF EXISTS ferry_events_edited ON ferry_events;
ALTER TABLE ferry_attempts DROP CONSTRAINT IF EXISTS ferry_attempts_event_id_fkey;
ALTER TABLE ferry_events
    DROP CONSTRAINT IF EXISTS ferry_events_attempts_check,
    DROP CONSTRAINT IF EXISTS ferry_events_max_attempts_check,
    DROP CONSTRAINT IF EXISTS ferry_events_failure_reason_check;

-- The INSERT trigger of 0004, now run by INSERTs alone, with the checks the dropped constraints made.
CREATE OR REPLACE FUNCTION ferry_events_representable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- One condition for the common case, a well-formed row: PL/pgSQL evaluates each IF as an
    -- expression of its own, so which check failed is worked out only once one has.
    IF NEW.route = '' OR NEW.event_type = '' OR jsonb_typeof(NEW.headers) <> 'object'
        OR pg_column_size(NEW.headers) > 131072 OR octet_length(NEW.headers::text) > 131072
        OR NEW.attempts < 0 OR NEW.max_attempts < 0
        OR NEW.failure_reason NOT IN ('permanent', 'attempts_exhausted', 'no_transport', 'plugin_fault',
                                      'invalid_event', 'operator')
        OR NOT (
            NEW.event_time >= '0001-01-01 00:00:00+00' AND NEW.event_time < '10000-01-01 00:00:00+00'
        AND NEW.created_at >= '0001-01-01 00:00:00+00' AND NEW.created_at < '10000-01-01 00:00:00+00'
        AND NEW.last_status_at >= '0001-01-01 00:00:00+00' AND NEW.last_status_at < '10000-01-01 00:00:00+00'
        AND NEW.next_attempt_at >= '0001-01-01 00:00:00+00' AND NEW.next_attempt_at < '10000-01-01 00:00:00+00'
        AND (NEW.sent_started_at IS NULL OR (NEW.sent_started_at >= '0001-01-01 00:00:00+00'
                                             AND NEW.sent_started_at < '10000-01-01 00:00:00+00'))
        AND (NEW.sent_duration_ms IS NULL OR NEW.sent_duration_ms >= 0))
    THEN
        IF NEW.route = '' THEN
            RAISE EXCEPTION 'ferry_events: route must not be empty' USING ERRCODE = 'check_violation';
        ELSIF NEW.event_type = '' THEN
            RAISE EXCEPTION 'ferry_events: event_type must not be empty' USING ERRCODE = 'check_violation';
        ELSIF jsonb_typeof(NEW.headers) <> 'object' THEN
            RAISE EXCEPTION 'ferry_events: headers must be a JSON object, not %', jsonb_typeof(NEW.headers)
                USING ERRCODE = 'check_violation';
        ELSIF pg_column_size(NEW.headers) > 131072 OR octet_length(NEW.headers::text) > 131072 THEN
            RAISE EXCEPTION 'ferry_events: headers must print in at most 131072 bytes; put large values in the payload'
                USING ERRCODE = 'check_violation';
        ELSIF NEW.attempts < 0 OR NEW.max_attempts < 0 THEN
            RAISE EXCEPTION 'ferry_events: attempts and max_attempts must not be negative'
                USING ERRCODE = 'check_violation';
        ELSIF NEW.failure_reason NOT IN ('permanent', 'attempts_exhausted', 'no_transport', 'plugin_fault',
                                         'invalid_event', 'operator') THEN
            RAISE EXCEPTION 'ferry_events: failure_reason % is not one ferry writes', NEW.failure_reason
                USING ERRCODE = 'check_violation';
        END IF;
        RAISE EXCEPTION 'ferry_events: times must lie between the years 1 and 9999 (not infinity), durations not be negative'
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
