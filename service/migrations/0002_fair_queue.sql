-- Issue 25's fair queue and result cache: what a submission is counted and found by.
--
-- queue, user_id and class: the per-user quotas (most queued at once, most per hour) are
-- counted from these after a restart; fair_tag: the submission's place on its class's
-- virtual clock, so a restart restores the queue's order exactly; cache_key: the hash of
-- (runner version, queue, run config) an identical submission is answered by.
-- Added columns only, so an older release's statements still work on the table (its INSERT
-- names its columns). Releases from this one on open a database a later release migrated
-- further; the release just before it refuses one with this migration recorded, so to roll
-- back to it, first run `DELETE FROM _sqlx_migrations WHERE version = 2` (the columns stay).
ALTER TABLE submissions ADD COLUMN queue TEXT;
ALTER TABLE submissions ADD COLUMN user_id TEXT;
ALTER TABLE submissions ADD COLUMN class TEXT;
ALTER TABLE submissions ADD COLUMN fair_tag BIGINT;
ALTER TABLE submissions ADD COLUMN cache_key TEXT;
CREATE INDEX IF NOT EXISTS submissions_created ON submissions (created_at_ms);
CREATE INDEX IF NOT EXISTS submissions_cache ON submissions (cache_key, created_at_ms);
