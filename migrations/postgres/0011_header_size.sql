-- Headers are refused at INSERT (and at an UPDATE that sets them) when PostgreSQL would print
-- them in more than 131 072 bytes, twice what ferry's emit accepts as compact JSON (PostgreSQL
-- prints a space after each `:` and `,`).
--
-- Why here and not only in the claim: the claim reads headers as text, and the size of that text
-- cannot be known from the stored value. A jsonb number keeps its significant digits and prints
-- every digit of its exponent (`1e131071` is a few bytes stored, 131 072 printed), and compression
-- shrinks repeated values further, so a value stored in 256 bytes can print as hundreds of
-- megabytes. The claim still measures headers stored compressed or in more than 256 bytes and returns none over
-- the limit (the event fails alone as invalid_event); this check stops the rest where they are
-- written. Rows that reach the table without triggers (logical replication, a restore that
-- creates triggers after the data) are not checked here; see 0009.
--
-- The stored size is looked at first: an uncompressed jsonb value (as NEW holds it, before
-- TOAST) prints in no fewer bytes than its strings and keys take, so one over the limit is refused
-- without printing it.
--
-- Only the function changes: no lock on ferry_events, no row read.
CREATE OR REPLACE FUNCTION ferry_events_representable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- One condition for the common case, a well-formed row: PL/pgSQL evaluates each IF as an
    -- expression of its own, so which check failed is worked out only once one has.
    IF NEW.route = '' OR NEW.event_type = '' OR jsonb_typeof(NEW.headers) <> 'object'
        OR pg_column_size(NEW.headers) > 131072 OR octet_length(NEW.headers::text) > 131072
        OR (TG_OP = 'INSERT' AND NOT (
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
        ELSIF pg_column_size(NEW.headers) > 131072 OR octet_length(NEW.headers::text) > 131072 THEN
            RAISE EXCEPTION 'ferry_events: headers must print in at most 131072 bytes; put large values in the payload'
                USING ERRCODE = 'check_violation';
        END IF;
        -- Times and durations are checked where rows are inserted only (see 0004 for why).
        RAISE EXCEPTION 'ferry_events: times must lie between the years 1 and 9999 (not infinity), durations not be negative'
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;

-- Headers as ferry shows them in `ferry show` and `ferry failed list`: the printed text when it is
-- at most `cap` bytes, else a note of its size. A value PostgreSQL cannot print at all (its
-- strings end at 1 GB) is noted as such instead of failing the list it is in. Not used by the
-- claim: the exception block costs a subtransaction per call.
CREATE FUNCTION ferry_headers_text(headers jsonb, cap integer) RETURNS text LANGUAGE plpgsql STABLE AS $$
DECLARE
    printed text;
BEGIN
    printed := headers::text;
    IF octet_length(printed) <= cap THEN
        RETURN printed;
    END IF;
    RETURN '(' || octet_length(printed) || ' bytes, not loaded)';
EXCEPTION WHEN program_limit_exceeded THEN
    RETURN '(over 1 GB as text, not loaded)';
END
$$;
