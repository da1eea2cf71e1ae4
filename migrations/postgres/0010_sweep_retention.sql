-- Retention no longer reads an index of SENT rows: it sweeps the table along its primary key,
-- a window of events at a time (`Relay::purge`, ARCHITECTURE.md), going on where it stopped.
--
-- Why: every delivery entered the row it made SENT into ferry_events_sent, a write PostgreSQL
-- paid for in the common case only so that retention could find old rows. Measured with
-- benches/callgrind-pg (BENCHMARKS.md), it was about 8 900 of the 145 000 instructions PostgreSQL
-- spends per event on ferry's claim and completion. A housekeeping run of the sweep reads one
-- window of `relay.purge_batch` events when no event older than the cut-off is left, up to ten
-- when retention keeps some (FAILED ones).
--
-- DROP INDEX takes an exclusive lock on ferry_events for a moment, waiting for the transactions
-- using the table to end and holding off inserts meanwhile. On a busy outbox drop it beforehand
-- without that lock, `DROP INDEX CONCURRENTLY ferry_events_sent;` (outside a transaction), and
-- this migration finds it gone; or run `ferry migrate` with a lock timeout in the database URL
-- (`?options=-c%20lock_timeout%3D5s`), and again if it gives up.
DROP INDEX IF EXISTS ferry_events_sent;

-- Where the sweep goes on from, one row for every instance: a restarted ferry goes on where the
-- last run stopped instead of starting again from the lowest id, and instances take turns moving
-- it on.
CREATE TABLE IF NOT EXISTS ferry_sweep (
    one     BOOLEAN PRIMARY KEY DEFAULT true CHECK (one),
    next_id BIGINT  NOT NULL
);
INSERT INTO ferry_sweep (one, next_id) VALUES (true, -9223372036854775808) ON CONFLICT DO NOTHING;
