-- Admits history outcome 'deferred': a plugin built for ferry:transport@0.2 may answer that the
-- receiver asked it to wait. The event goes back to PENDING without counting an attempt, and the
-- history keeps a row saying so. The new CHECK admits everything the old one did, so the rows
-- already stored need no scan (NOT VALID): only new rows are checked.
ALTER TABLE ferry_attempts DROP CONSTRAINT ferry_attempts_outcome_check;
ALTER TABLE ferry_attempts
    ADD CONSTRAINT ferry_attempts_outcome_check CHECK (outcome IN ('sent', 'retry', 'failed', 'deferred')) NOT VALID;
