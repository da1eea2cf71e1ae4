-- Rebuilds ferry_events (with ferry_attempts) and ferry_breakers with column defaults that work on every SQLite an
-- application may link: `unixepoch('subsec')` needs 3.42 and yields NULL before it (Debian 12 and
-- Python's sqlite3 module ship 3.40), so a plain INSERT failed there. `julianday('now')` works on
-- all versions. Also admits failure reason 'operator' (`ferry event fail`), and adds triggers that
-- refuse, at INSERT, values ferry cannot represent. Rows already stored are copied as they are;
-- the relay fails a row it cannot decode alone, with reason invalid_event naming the column.
--
-- SQLite cannot change a column default or a CHECK in place: each table is renamed aside, created
-- anew and copied, and the old one dropped. ferry_attempts is rebuilt as well, so its foreign key
-- names the new ferry_events and no history is deleted with the old one (migrations run in a
-- transaction, where foreign keys cannot be switched off).
ALTER TABLE ferry_attempts RENAME TO ferry_attempts_0003;
ALTER TABLE ferry_events RENAME TO ferry_events_0003;

CREATE TABLE ferry_events (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    route           TEXT    NOT NULL CHECK (route <> ''),
    event_type      TEXT    NOT NULL CHECK (event_type <> ''),
    ordering_key    TEXT,
    payload         BLOB    NOT NULL,
    content_type    TEXT    NOT NULL DEFAULT 'application/json',
    headers         TEXT    NOT NULL DEFAULT '{}' CHECK (json_valid(headers) AND json_type(headers) = 'object'),
    status          TEXT    NOT NULL DEFAULT 'PENDING'
                            CHECK (status IN ('PENDING', 'PROCESSING', 'SENT', 'FAILED')),
    attempts        INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts    INTEGER CHECK (max_attempts >= 0),
    -- Integer milliseconds since the Unix epoch, UTC.
    event_time      INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    created_at      INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    last_status_at  INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    next_attempt_at INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)),
    processed_at    INTEGER,
    last_error      TEXT,
    failure_reason  TEXT CHECK (failure_reason IN
                        ('permanent', 'attempts_exhausted', 'no_transport', 'plugin_fault', 'invalid_event', 'operator')),
    claimed_by      TEXT,
    claim_token     TEXT,
    lease_until     INTEGER
);
INSERT INTO ferry_events SELECT * FROM ferry_events_0003;
-- Ids are never reused, even those of events purged before this migration.
DELETE FROM sqlite_sequence WHERE name = 'ferry_events';
UPDATE sqlite_sequence SET name = 'ferry_events' WHERE name = 'ferry_events_0003';

CREATE TABLE ferry_attempts (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id    INTEGER NOT NULL REFERENCES ferry_events (id) ON DELETE CASCADE,
    attempt     INTEGER NOT NULL CHECK (attempt >= 0),
    started_at  INTEGER NOT NULL,
    duration_ms INTEGER NOT NULL CHECK (duration_ms >= 0),
    outcome     TEXT    NOT NULL CHECK (outcome IN ('sent', 'retry', 'failed')),
    reason      TEXT,
    error       TEXT,
    plugin      TEXT,
    plugin_hash TEXT,
    instance    TEXT
);
INSERT INTO ferry_attempts SELECT * FROM ferry_attempts_0003;
DELETE FROM sqlite_sequence WHERE name = 'ferry_attempts';
UPDATE sqlite_sequence SET name = 'ferry_attempts' WHERE name = 'ferry_attempts_0003';
DROP TABLE ferry_attempts_0003;
DROP TABLE ferry_events_0003;
CREATE INDEX ferry_attempts_event ON ferry_attempts (event_id, id);
CREATE INDEX ferry_events_pending ON ferry_events (next_attempt_at, id) WHERE status = 'PENDING';
CREATE INDEX ferry_events_processing ON ferry_events (lease_until) WHERE status = 'PROCESSING';
CREATE INDEX ferry_events_failed ON ferry_events (id) WHERE status = 'FAILED';
CREATE INDEX ferry_events_sent ON ferry_events (processed_at) WHERE status = 'SENT';
CREATE INDEX ferry_events_key ON ferry_events (route, ordering_key, id)
    WHERE ordering_key IS NOT NULL AND status <> 'SENT';

-- Times are integer milliseconds between the years 1 and 9999; counts fit in 31 bits.
CREATE TRIGGER ferry_events_representable BEFORE INSERT ON ferry_events
WHEN typeof(NEW.event_time) <> 'integer' OR NEW.event_time NOT BETWEEN -62135596800000 AND 253402300799999
  OR typeof(NEW.created_at) <> 'integer' OR NEW.created_at NOT BETWEEN -62135596800000 AND 253402300799999
  OR typeof(NEW.last_status_at) <> 'integer' OR NEW.last_status_at NOT BETWEEN -62135596800000 AND 253402300799999
  OR typeof(NEW.next_attempt_at) <> 'integer' OR NEW.next_attempt_at NOT BETWEEN -62135596800000 AND 253402300799999
  OR typeof(NEW.attempts) <> 'integer' OR NEW.attempts > 2147483647
  OR (NEW.max_attempts IS NOT NULL AND (typeof(NEW.max_attempts) <> 'integer' OR NEW.max_attempts > 2147483647))
BEGIN
    SELECT RAISE(ABORT, 'ferry_events: times must be integer milliseconds since the Unix epoch (years 1 to 9999), attempts and max_attempts integers from 0 to 2147483647');
END;

ALTER TABLE ferry_breakers RENAME TO ferry_breakers_0003;
CREATE TABLE ferry_breakers (
    route                TEXT    PRIMARY KEY CHECK (route <> ''),
    consecutive_failures INTEGER NOT NULL DEFAULT 0 CHECK (consecutive_failures >= 0),
    opened_at            INTEGER,
    reason               TEXT,
    manual               INTEGER NOT NULL DEFAULT 0 CHECK (manual IN (0, 1)),
    probe_until          INTEGER,
    updated_at           INTEGER NOT NULL DEFAULT (CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER))
);
INSERT INTO ferry_breakers SELECT * FROM ferry_breakers_0003;
DROP TABLE ferry_breakers_0003;
