-- The queue's estimates across a restart: ran_ms, how long a submission ran (from `running`
-- to its end; none when it never ran), written when it ends. On start the service reads each
-- queue's last runs back, so its estimated run time (and every place's wait) starts from the
-- queue's own runs, not the default.
-- An added column only: the release before it ignores it (see 0002 on rollbacks).
ALTER TABLE submissions ADD COLUMN ran_ms BIGINT;
