-- Webhook endpoints managed at run time. Each is a destination of its route: its deliveries
-- carry route `route/id`. `body` is the endpoint as JSON (URL, event types, headers, secrets,
-- enabled, times), read and checked by ferry; a row it cannot read is skipped and logged.
-- The signing secrets are kept as they are, since ferry signs with them: restrict who may read
-- this table as you restrict who may read the configuration file.
CREATE TABLE IF NOT EXISTS ferry_endpoints (
    id    TEXT PRIMARY KEY CHECK (id <> ''),
    route TEXT NOT NULL CHECK (route <> ''),
    body  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ferry_endpoints_route ON ferry_endpoints (route);
