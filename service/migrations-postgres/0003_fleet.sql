-- The fleet's records (issue 39, `kernelkite_core::fleet`): one JSON document per slice (an
-- agent), with its canary history, its quarantine and its last run's readings; the replica
-- running the queue writes them, and one taking over reads them. Added table only (expand):
-- the release before it ignores it.
CREATE TABLE fleet_slices (
    id TEXT PRIMARY KEY,
    doc TEXT NOT NULL,
    updated_at_ms BIGINT NOT NULL
);
