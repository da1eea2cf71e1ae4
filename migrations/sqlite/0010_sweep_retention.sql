-- Retention no longer reads an index of SENT rows: it sweeps the table along its primary key,
-- a window of events at a time (`Relay::purge`, ARCHITECTURE.md), going on where it stopped.
-- Every delivery entered the row it made SENT into ferry_events_sent, a write paid for in the
-- common case only so that retention could find old rows (BENCHMARKS.md). Dropping an index
-- rewrites no row.
DROP INDEX IF EXISTS ferry_events_sent;

-- Where the sweep goes on from: a restarted ferry goes on where the last run stopped instead of
-- starting again from the lowest id.
CREATE TABLE IF NOT EXISTS ferry_sweep (
    one     INTEGER PRIMARY KEY CHECK (one = 1),
    next_id INTEGER NOT NULL
);
INSERT OR IGNORE INTO ferry_sweep (one, next_id) VALUES (1, -9223372036854775808);
