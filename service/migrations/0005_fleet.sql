-- The fleet's records (issue 39, `kernelkite_core::fleet`): one JSON document per slice (an
-- agent), with its canary history, its quarantine and its last run's readings, so a restart
-- keeps them. Added table only: the release before it ignores it.
CREATE TABLE IF NOT EXISTS fleet_slices (
    id TEXT PRIMARY KEY,
    doc TEXT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);
