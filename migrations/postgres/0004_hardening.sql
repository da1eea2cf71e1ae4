-- Rows are untrusted data: applications and operators insert them by hand. These checks refuse,
-- at INSERT, values ferry cannot represent (an infinite time, a negative attempt limit) instead of
-- leaving the relay to find them undecodable later. They are NOT VALID, so rows already stored are
-- not re-checked: the relay fails such a row alone, with reason invalid_event naming the column.
ALTER TABLE ferry_events ADD CONSTRAINT ferry_events_finite_times CHECK (
    isfinite(event_time) AND isfinite(created_at) AND isfinite(last_status_at) AND isfinite(next_attempt_at)
    AND (processed_at IS NULL OR isfinite(processed_at)) AND (lease_until IS NULL OR isfinite(lease_until))
) NOT VALID;

-- 'operator': an operator ended the event by hand (`ferry event fail`).
ALTER TABLE ferry_events DROP CONSTRAINT ferry_events_failure_reason_check;
ALTER TABLE ferry_events ADD CONSTRAINT ferry_events_failure_reason_check CHECK (failure_reason IN
    ('permanent', 'attempts_exhausted', 'no_transport', 'plugin_fault', 'invalid_event', 'operator'));
