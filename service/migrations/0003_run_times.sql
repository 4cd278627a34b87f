-- The queue's estimates across a restart: ran_ms, how long a submission ran (from `running`
-- to its end; none when it never ran), and ended_at_ms, when it ended, written with its end.
-- On start the service reads each queue's last runs to end back, so its estimated run time
-- (and every place's wait) starts from the queue's own runs, not the default.
-- Added columns only: the release before it ignores them (see 0002 on rollbacks).
ALTER TABLE submissions ADD COLUMN ran_ms BIGINT;
ALTER TABLE submissions ADD COLUMN ended_at_ms BIGINT;
