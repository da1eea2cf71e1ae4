-- Rebuilds ferry_events and ferry_attempts with the same columns, rows, ids, indexes and trigger,
-- and the same CHECK constraints written without IN lists.
--
-- Why: SQLite evaluates `x IN ('a', 'b', 'c', ...)` of more than two constants by filling a
-- temporary index with the list, and a CHECK on a column an UPDATE changes does that for every
-- row written. Every claim and every outcome changes `status`, so each event paid for two such
-- indexes: measured under callgrind, a sixth of the instructions of ferry's own claim and
-- completion statements (BENCHMARKS.md), and more of an INSERT's. The same test written with `=` and `OR`
-- compares in place. PostgreSQL does not build anything for these lists; its schema is unchanged.
--
-- As in 0004 (which explains the steps): each table is renamed aside, created anew, copied and
-- the old one dropped, ferry_attempts along with ferry_events so its foreign key names the new
-- table, and the id sequences carried over so no id is handed out twice. Other writers wait for
-- the copy only up to their busy timeout (README, "Emitting events", on upgrading).
ALTER TABLE ferry_attempts RENAME TO ferry_attempts_0008;
ALTER TABLE ferry_events RENAME TO ferry_events_0008;

CREATE TABLE ferry_events (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    route            TEXT    NOT NULL CHECK (route <> ''),
    event_type       TEXT    NOT NULL CHECK (event_type <> ''),
    ordering_key     TEXT,
    payload          BLOB    NOT NULL,
    content_type     TEXT    NOT NULL DEFAULT 'application/json',
    headers          TEXT    NOT NULL DEFAULT '{}' CHECK (json_valid(headers) AND json_type(headers) = 'object'),
    status           TEXT    NOT NULL DEFAULT 'PENDING'
                             CHECK (status = 'PENDING' OR status = 'PROCESSING' OR status = 'SENT' OR status = 'FAILED'),
    attempts         INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts     INTEGER CHECK (max_attempts >= 0),
    -- Integer milliseconds since the Unix epoch, UTC.
    event_time       INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    created_at       INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    last_status_at   INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    next_attempt_at  INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    processed_at     INTEGER,
    last_error       TEXT,
    failure_reason   TEXT CHECK (failure_reason = 'permanent' OR failure_reason = 'attempts_exhausted'
                                 OR failure_reason = 'no_transport' OR failure_reason = 'plugin_fault'
                                 OR failure_reason = 'invalid_event' OR failure_reason = 'operator'),
    claimed_by       TEXT,
    claim_token      TEXT,
    lease_until      INTEGER,
    sent_started_at  INTEGER,
    sent_duration_ms INTEGER,
    sent_plugin      TEXT,
    sent_plugin_hash TEXT,
    parent_id        INTEGER
);
INSERT INTO ferry_events SELECT * FROM ferry_events_0008;
DELETE FROM sqlite_sequence WHERE name = 'ferry_events';
UPDATE sqlite_sequence SET name = 'ferry_events' WHERE name = 'ferry_events_0008';

CREATE TABLE ferry_attempts (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id    INTEGER NOT NULL REFERENCES ferry_events (id) ON DELETE CASCADE,
    attempt     INTEGER NOT NULL CHECK (attempt >= 0),
    started_at  INTEGER NOT NULL,
    duration_ms INTEGER NOT NULL CHECK (duration_ms >= 0),
    outcome     TEXT    NOT NULL
                        CHECK (outcome = 'sent' OR outcome = 'retry' OR outcome = 'failed' OR outcome = 'deferred'),
    reason      TEXT,
    error       TEXT,
    plugin      TEXT,
    plugin_hash TEXT,
    instance    TEXT
);
-- History rows whose event is gone (deleted on a connection without foreign keys, SQLite's
-- default) are what the cascade would have deleted; copying them would fail the foreign key.
INSERT INTO ferry_attempts SELECT * FROM ferry_attempts_0008 WHERE event_id IN (SELECT id FROM ferry_events);
DELETE FROM sqlite_sequence WHERE name = 'ferry_attempts';
UPDATE sqlite_sequence SET name = 'ferry_attempts' WHERE name = 'ferry_attempts_0008';
DROP TABLE ferry_attempts_0008;
DROP TABLE ferry_events_0008;

CREATE INDEX ferry_attempts_event ON ferry_attempts (event_id, id);
CREATE INDEX ferry_events_pending ON ferry_events (next_attempt_at, id) WHERE status = 'PENDING';
CREATE INDEX ferry_events_claimed ON ferry_events (claim_token) WHERE status = 'PROCESSING';
CREATE INDEX ferry_events_failed ON ferry_events (id) WHERE status = 'FAILED';
CREATE INDEX ferry_events_sent ON ferry_events (processed_at) WHERE status = 'SENT';
CREATE INDEX ferry_events_key ON ferry_events (route, ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status <> 'SENT';
CREATE INDEX ferry_events_parent ON ferry_events (parent_id) WHERE parent_id IS NOT NULL;

-- As in 0005: times are integer milliseconds between the years 1 and 9999, counts fit in 31 bits.
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
