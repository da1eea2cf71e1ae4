-- Retention no longer reads an index of SENT rows: it sweeps the table along its primary key,
-- a window of events at a time (`Relay::purge`, ARCHITECTURE.md), and the latency figures of
-- `ferry stats` walk the primary key down from the newest event. Every delivery entered the row
-- it made SENT into ferry_events_sent, a write paid for in the common case only so that retention
-- could find old rows (BENCHMARKS.md). Dropping an index rewrites no row.
DROP INDEX IF EXISTS ferry_events_sent;
