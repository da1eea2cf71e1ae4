-- The checks on route, event_type and headers move from CHECK constraints to the INSERT trigger
-- of 0004, and to a trigger that runs the same function after an UPDATE that sets one of those
-- columns.
--
-- Why: PostgreSQL evaluates every CHECK constraint of a table on every row an UPDATE writes,
-- whichever columns the UPDATE sets. Ferry writes each event twice (its claim and its outcome)
-- and never sets these three columns, yet paid for their checks both times, `jsonb_typeof` of the
-- headers included. Measured with benches/callgrind-pg (BENCHMARKS.md), PostgreSQL spends about
-- 1 600 fewer instructions per event on ferry's claim and completion (of 147 000), and about 400
-- more on an application's INSERT (of 44 000). Triggers run only when an INSERT writes a row or
-- an UPDATE names one of the columns; the same values as before are refused, where applications
-- and operators write them. The checks on status, attempts, max_attempts and failure_reason stay
-- constraints: ferry's own writes set those columns.
--
-- Rows that reach the table without triggers firing are no longer checked for these three:
-- those logical replication writes (session_replication_role = replica), and those a pg_dump
-- restore loads (it creates triggers after the data; CHECK constraints came before it). The relay
-- fails such a row alone, as invalid_event naming the column, as it does a hand-edited one.
--
-- Only the catalog changes: no row is read or rewritten. ALTER TABLE takes an exclusive lock on
-- ferry_events, which waits for the transactions using the table to end and holds off inserts
-- meanwhile. On a busy outbox run `ferry migrate` with a lock timeout in the database URL
-- (`?options=-c%20lock_timeout%3D5s`), and again if it gives up.
CREATE OR REPLACE FUNCTION ferry_events_representable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- One condition for the common case, a well-formed row: PL/pgSQL evaluates each IF as an
    -- expression of its own, so which check failed is worked out only once one has.
    IF NEW.route = '' OR NEW.event_type = '' OR jsonb_typeof(NEW.headers) <> 'object' OR (TG_OP = 'INSERT' AND NOT (
            NEW.event_time >= '0001-01-01 00:00:00+00' AND NEW.event_time < '10000-01-01 00:00:00+00'
        AND NEW.created_at >= '0001-01-01 00:00:00+00' AND NEW.created_at < '10000-01-01 00:00:00+00'
        AND NEW.last_status_at >= '0001-01-01 00:00:00+00' AND NEW.last_status_at < '10000-01-01 00:00:00+00'
        AND NEW.next_attempt_at >= '0001-01-01 00:00:00+00' AND NEW.next_attempt_at < '10000-01-01 00:00:00+00'
        AND (NEW.sent_started_at IS NULL OR (NEW.sent_started_at >= '0001-01-01 00:00:00+00'
                                             AND NEW.sent_started_at < '10000-01-01 00:00:00+00'))
        AND (NEW.sent_duration_ms IS NULL OR NEW.sent_duration_ms >= 0)))
    THEN
        IF NEW.route = '' THEN
            RAISE EXCEPTION 'ferry_events: route must not be empty' USING ERRCODE = 'check_violation';
        ELSIF NEW.event_type = '' THEN
            RAISE EXCEPTION 'ferry_events: event_type must not be empty' USING ERRCODE = 'check_violation';
        ELSIF jsonb_typeof(NEW.headers) <> 'object' THEN
            RAISE EXCEPTION 'ferry_events: headers must be a JSON object, not %', jsonb_typeof(NEW.headers)
                USING ERRCODE = 'check_violation';
        END IF;
        -- Times and durations are checked where rows are inserted only (see 0004 for why).
        RAISE EXCEPTION 'ferry_events: times must lie between the years 1 and 9999 (not infinity), durations not be negative'
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
-- An UPDATE that sets one of the three columns is checked after the row is written (and undone
-- with the statement when refused). Not before: a BEFORE UPDATE trigger, even one limited to
-- columns ferry never sets, makes PostgreSQL fetch and lock every row ferry updates first, which
-- costs more than the constraints did. An AFTER trigger reads the old row only if one is already
-- read, which ferry_events_resent (0001) does.
CREATE TRIGGER ferry_events_edited AFTER UPDATE OF route, event_type, headers ON ferry_events
    FOR EACH ROW EXECUTE FUNCTION ferry_events_representable();
ALTER TABLE ferry_events
    DROP CONSTRAINT ferry_events_route_check,
    DROP CONSTRAINT ferry_events_event_type_check,
    DROP CONSTRAINT ferry_events_headers_check;
