-- Admits history outcome 'deferred': a plugin built for ferry:transport@0.2 may answer that the
-- receiver asked it to wait. The event goes back to PENDING without counting an attempt, and the
-- history keeps a row saying so.
--
-- SQLite cannot change a CHECK in place: ferry_attempts is renamed aside, created anew with the
-- wider CHECK, copied (ids kept, and the id sequence with them) and the old table dropped.
ALTER TABLE ferry_attempts RENAME TO ferry_attempts_0005;
DROP INDEX ferry_attempts_event;

CREATE TABLE ferry_attempts (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id    INTEGER NOT NULL REFERENCES ferry_events (id) ON DELETE CASCADE,
    attempt     INTEGER NOT NULL CHECK (attempt >= 0),
    started_at  INTEGER NOT NULL,
    duration_ms INTEGER NOT NULL CHECK (duration_ms >= 0),
    outcome     TEXT    NOT NULL CHECK (outcome IN ('sent', 'retry', 'failed', 'deferred')),
    reason      TEXT,
    error       TEXT,
    plugin      TEXT,
    plugin_hash TEXT,
    instance    TEXT
);
INSERT INTO ferry_attempts SELECT * FROM ferry_attempts_0005;
DELETE FROM sqlite_sequence WHERE name = 'ferry_attempts';
UPDATE sqlite_sequence SET name = 'ferry_attempts' WHERE name = 'ferry_attempts_0005';
DROP TABLE ferry_attempts_0005;

CREATE INDEX ferry_attempts_event ON ferry_attempts (event_id, id);
