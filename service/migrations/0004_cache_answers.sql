-- Issue 34: an answer from the result cache refers to the run that made the result instead of
-- storing a copy of it. cached_from names that run (the answer's doc then has no result; a
-- read takes the run's), and lets a restart count the last hour's cache answers for the
-- per-user limits. Added column only: the release before it ignores it (see 0002 on
-- rollbacks; that release would show such an answer without its result).
ALTER TABLE submissions ADD COLUMN cached_from TEXT;
