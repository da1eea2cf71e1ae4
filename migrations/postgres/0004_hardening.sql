-- Rows are untrusted data: applications and operators insert them by hand. This trigger refuses,
-- at INSERT, times ferry cannot represent (`infinity`, or outside the years 1 to 9999) instead of
-- leaving the relay to find them undecodable later. It is a trigger, not a CHECK, on purpose: a
-- CHECK also applies to UPDATEs, so a row stored before it (or edited by hand) would make the
-- claim's UPDATE fail for its whole batch; the relay instead fails such a row alone, with reason
-- invalid_event naming the column.
CREATE FUNCTION ferry_events_representable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT (NEW.event_time >= '0001-01-01 00:00:00+00' AND NEW.event_time < '10000-01-01 00:00:00+00'
        AND NEW.created_at >= '0001-01-01 00:00:00+00' AND NEW.created_at < '10000-01-01 00:00:00+00'
        AND NEW.last_status_at >= '0001-01-01 00:00:00+00' AND NEW.last_status_at < '10000-01-01 00:00:00+00'
        AND NEW.next_attempt_at >= '0001-01-01 00:00:00+00' AND NEW.next_attempt_at < '10000-01-01 00:00:00+00')
    THEN
        RAISE EXCEPTION 'ferry_events: times must lie between the years 1 and 9999 (not infinity)'
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER ferry_events_representable BEFORE INSERT ON ferry_events
    FOR EACH ROW EXECUTE FUNCTION ferry_events_representable();

-- 'operator': an operator ended the event by hand (`ferry event fail`).
ALTER TABLE ferry_events DROP CONSTRAINT ferry_events_failure_reason_check;
ALTER TABLE ferry_events ADD CONSTRAINT ferry_events_failure_reason_check CHECK (failure_reason IN
    ('permanent', 'attempts_exhausted', 'no_transport', 'plugin_fault', 'invalid_event', 'operator'));
