-- Destinations: an event of a route with destinations is handed on as one new event per
-- destination that receives it (route `route/destination`), each delivered, retried, failed and
-- resent on its own. `parent_id` is the event it was handed on from; the event itself ends SENT.
-- No foreign key: retention purges the event handed on independently of its deliveries.
ALTER TABLE ferry_events ADD COLUMN parent_id INTEGER;
CREATE INDEX IF NOT EXISTS ferry_events_parent ON ferry_events (parent_id) WHERE parent_id IS NOT NULL;
