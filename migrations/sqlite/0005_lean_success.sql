-- A delivery that succeeds is recorded on the event row itself instead of as a history row: the
-- common case, a batch delivered on its first attempt, then costs one UPDATE per batch and no
-- INSERT. ferry_attempts keeps what went wrong (retries and failures); `ferry show` lists the
-- successful delivery after them, from these columns and claimed_by (the instance that made it).
ALTER TABLE ferry_events ADD COLUMN sent_started_at INTEGER;
ALTER TABLE ferry_events ADD COLUMN sent_duration_ms INTEGER;
ALTER TABLE ferry_events ADD COLUMN sent_plugin TEXT;
ALTER TABLE ferry_events ADD COLUMN sent_plugin_hash TEXT;

-- Rows inserted by hand are checked for the new columns too (see 0004).
DROP TRIGGER IF EXISTS ferry_events_representable;
CREATE TRIGGER ferry_events_representable BEFORE INSERT ON ferry_events
WHEN typeof(NEW.event_time) <> 'integer' OR NEW.event_time NOT BETWEEN -62135596800000 AND 253402300799999
  OR typeof(NEW.created_at) <> 'integer' OR NEW.created_at NOT BETWEEN -62135596800000 AND 253402300799999
  OR typeof(NEW.last_status_at) <> 'integer' OR NEW.last_status_at NOT BETWEEN -62135596800000 AND 253402300799999
  OR typeof(NEW.next_attempt_at) <> 'integer' OR NEW.next_attempt_at NOT BETWEEN -62135596800000 AND 253402300799999
  OR typeof(NEW.attempts) <> 'integer' OR NEW.attempts > 2147483647
  OR (NEW.max_attempts IS NOT NULL AND (typeof(NEW.max_attempts) <> 'integer' OR NEW.max_attempts > 2147483647))
  OR (NEW.sent_started_at IS NOT NULL AND (typeof(NEW.sent_started_at) <> 'integer'
      OR NEW.sent_started_at NOT BETWEEN -62135596800000 AND 253402300799999))
  OR (NEW.sent_duration_ms IS NOT NULL AND (typeof(NEW.sent_duration_ms) <> 'integer' OR NEW.sent_duration_ms < 0))
BEGIN
    SELECT RAISE(ABORT, 'ferry_events: times must be integer milliseconds since the Unix epoch (years 1 to 9999), attempts and max_attempts integers from 0 to 2147483647, durations integers from 0');
END;

-- Serves the completion, which finds a claim's rows by its token, and stuck-claim recovery, which
-- reads every PROCESSING row (there are at most workers × batch size per instance).
DROP INDEX IF EXISTS ferry_events_processing;
CREATE INDEX IF NOT EXISTS ferry_events_claimed ON ferry_events (claim_token) WHERE status = 'PROCESSING';
