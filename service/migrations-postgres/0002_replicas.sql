-- Replicas (KERNELKITE_REPLICA): every replica serves every request; the one holding the
-- schema's lock runs the queue. Only additions (expand), so the release before this one runs
-- beside it during a rolling upgrade (it never writes here, and its connections do not name
-- the channel, so the trigger stays quiet for them).

-- Requests a replica hands to the one that runs the queue, and their answers: written by the
-- replica that received the request (times by the database's clock), claimed (`claimed_by` and
-- `claimed_start`: the claimant's lock session, its pid and start (epoch seconds, as text), since
-- a pid is reused after
-- a server restart; the body is dropped then) and answered by the holder, read back and deleted
-- by the receiver.
CREATE TABLE relayed (
    id BIGINT PRIMARY KEY,
    created_at_ms BIGINT NOT NULL,
    method TEXT NOT NULL,
    uri TEXT NOT NULL,
    headers TEXT NOT NULL,
    peer TEXT NOT NULL,
    body BYTEA NOT NULL,
    claimed_by INTEGER,
    claimed_start TEXT,
    status INTEGER,
    answer_headers TEXT,
    answer_body BYTEA
);
CREATE INDEX relayed_unclaimed ON relayed (created_at_ms) WHERE claimed_by IS NULL;

-- Every committed change of a submission is announced on the channel the connection names
-- (the setting `kernelkite.changed`, which the service sets on its connections), so the long-
-- polls and event streams held by every replica wake. A notification is only a hint: the
-- receiver reads the row again, and also re-reads what it waits for every second.
CREATE FUNCTION submission_changed() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    channel TEXT := current_setting('kernelkite.changed', true);
BEGIN
    IF channel IS NOT NULL AND channel <> '' THEN
        PERFORM pg_notify(channel, NEW.id);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER submissions_changed AFTER INSERT OR UPDATE ON submissions
    FOR EACH ROW EXECUTE FUNCTION submission_changed();
