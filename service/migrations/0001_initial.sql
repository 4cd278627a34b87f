-- The store's first schema: submissions (with their jobs and idempotency keys), the callback
-- outbox, and the row the health probe writes.
--
-- Idempotent on purpose: databases made before sqlx's migrator kept this schema already (as
-- version 1 of their own `kernelkite_schema` table) but have no `_sqlx_migrations`, so the
-- migrator runs this on them too; it must leave them as they are and record it as applied.
-- Portable SQL (Postgres reads it as it is), like the rest of the store's.
CREATE TABLE IF NOT EXISTS submissions (
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
    doc TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS submissions_open ON submissions (terminal);
CREATE TABLE IF NOT EXISTS callbacks (
    submission_id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    attempts BIGINT NOT NULL,
    next_at_ms BIGINT NOT NULL,
    give_up_at_ms BIGINT NOT NULL,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS callbacks_due ON callbacks (state, next_at_ms);
CREATE TABLE IF NOT EXISTS kernelkite_health (id BIGINT PRIMARY KEY, checked_at_ms BIGINT NOT NULL);
INSERT INTO kernelkite_health (id, checked_at_ms)
    SELECT 1, 0 WHERE NOT EXISTS (SELECT 1 FROM kernelkite_health WHERE id = 1);
-- The release before sqlx's migrator reads its own version table, and would run its first
-- schema again (and fail on the tables above) on a database without it: recording version 1
-- there keeps a rollback to that release possible.
CREATE TABLE IF NOT EXISTS kernelkite_schema (version BIGINT PRIMARY KEY, applied_at_ms BIGINT NOT NULL);
INSERT INTO kernelkite_schema (version, applied_at_ms)
    SELECT 1, 0 WHERE NOT EXISTS (SELECT 1 FROM kernelkite_schema WHERE version = 1);
