-- The PostgreSQL store's schema: the SQLite store's as its migrations 0001-0004 left it, in one
-- step (this store starts there). Created in kernelkite's own schema (KERNELKITE_DATABASE_SCHEMA,
-- the connections' search_path), beside whatever else the database holds (kernelbot's tables).
-- Later migrations only add (expand, then contract in a later release), so a release and the
-- one before it can run on one database during a rolling upgrade.
CREATE TABLE submissions (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    terminal BIGINT NOT NULL,
    created_at_ms BIGINT NOT NULL,
    deadline_ms BIGINT NOT NULL,
    build_id TEXT,
    build_number BIGINT,
    idempotency_key TEXT UNIQUE,
    request_sha256 TEXT,
    job TEXT,
    doc TEXT NOT NULL,
    queue TEXT,
    user_id TEXT,
    class TEXT,
    fair_tag BIGINT,
    cache_key TEXT,
    ran_ms BIGINT,
    ended_at_ms BIGINT,
    cached_from TEXT
);
CREATE INDEX submissions_open ON submissions (terminal);
CREATE INDEX submissions_created ON submissions (created_at_ms);
CREATE INDEX submissions_cache ON submissions (cache_key, created_at_ms);
CREATE TABLE callbacks (
    submission_id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts BIGINT NOT NULL,
    next_at_ms BIGINT NOT NULL,
    give_up_at_ms BIGINT NOT NULL,
    last_error TEXT
);
CREATE INDEX callbacks_due ON callbacks (state, next_at_ms);
CREATE TABLE kernelkite_health (id BIGINT PRIMARY KEY, checked_at_ms BIGINT NOT NULL);
INSERT INTO kernelkite_health (id, checked_at_ms) VALUES (1, 0);
