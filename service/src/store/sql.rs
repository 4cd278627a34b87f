//! What the SQLite and PostgreSQL stores share: every statement (portable SQL: `$n`
//! placeholders, `TEXT` and `BIGINT` columns, booleans as `0/1`, times as unix milliseconds, no
//! `INSERT OR ...`, no `RETURNING`) and how a submission is encoded into its `doc` column. One
//! home, so the two stores cannot drift apart in what they mean.

use crate::submission::Submission;

/// How far back a start reads each queue's runs (their estimated run time).
pub(crate) const RUNS_WINDOW_MS: i64 = 7 * 24 * crate::dispatch::HOUR_MS;

pub(crate) const INSERT_SUBMISSION: &str = "INSERT INTO submissions (id, state, terminal, created_at_ms, deadline_ms, build_id, build_number, idempotency_key, request_sha256, job, doc, queue, user_id, class, fair_tag, cache_key, cached_from)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)";

/// A change of a submission that has not ended (none once it has: its end is final).
pub(crate) const SAVE: &str =
    "UPDATE submissions SET state = $2, doc = $3, build_id = $4, build_number = $5
     WHERE id = $1 AND terminal = 0";

/// A submission's end, once: its job goes, its run time and end are kept for the estimates.
pub(crate) const FINISH: &str = "UPDATE submissions SET state = $2, terminal = 1, doc = $3, build_id = $4, build_number = $5, job = NULL,
         ran_ms = $6, ended_at_ms = $7
     WHERE id = $1 AND terminal = 0";

pub(crate) const INSERT_CALLBACK: &str = "INSERT INTO callbacks (submission_id, url, body, state, attempts, next_at_ms, give_up_at_ms, last_error)
     VALUES ($1, $2, $3, $4, 0, $5, $6, NULL)";

pub(crate) const CALLBACK_ATTEMPTED: &str =
    "UPDATE callbacks SET state = $2, attempts = $3, next_at_ms = $4, last_error = $5
     WHERE submission_id = $1";

/// A slice's fleet record, replaced whole (`crate::fleet`): portable upsert (SQLite 3.24+
/// and PostgreSQL read it alike).
pub(crate) const FLEET_SAVE: &str =
    "INSERT INTO fleet_slices (id, doc, updated_at_ms) VALUES ($1, $2, $3)
     ON CONFLICT (id) DO UPDATE SET doc = excluded.doc, updated_at_ms = excluded.updated_at_ms";

/// Every slice's fleet record.
pub(crate) const FLEET_LOAD: &str = "SELECT doc FROM fleet_slices ORDER BY id";

/// A retired slice's fleet record, gone.
pub(crate) const FLEET_FORGET: &str = "DELETE FROM fleet_slices WHERE id = $1";

/// The health probe's write.
pub(crate) const PROBE: &str = "UPDATE kernelkite_health SET checked_at_ms = $1 WHERE id = 1";

pub(crate) const PENDING: &str = "SELECT doc, job, deadline_ms, fair_tag FROM submissions WHERE terminal = 0 ORDER BY created_at_ms";

/// Queued or answered from the result cache since `$1`: what the quotas count.
pub(crate) const ACCEPTED: &str =
    "SELECT queue, user_id, class, created_at_ms, cached_from FROM submissions
     WHERE created_at_ms >= $1 AND (fair_tag IS NOT NULL OR cached_from IS NOT NULL)";

/// Per queue its last `$2` runs to end of the submissions accepted since `$1`, earliest end
/// first: the last runs to end, as the queue learned them before the restart (under fair
/// share they end in another order than they came). A window function keeps every queue's
/// own however busy the others are; the window of submissions (by the index on
/// created_at_ms) bounds what a start reads.
pub(crate) const RUNS: &str = "SELECT queue, ran_ms FROM (
         SELECT queue, ran_ms, ended_at_ms, id,
                ROW_NUMBER() OVER (PARTITION BY queue ORDER BY ended_at_ms DESC, id DESC) AS n
         FROM submissions
         WHERE created_at_ms >= $1 AND ran_ms IS NOT NULL AND queue IS NOT NULL
     ) AS recent
     WHERE n <= $2
     ORDER BY ended_at_ms, id";

pub(crate) const DOC: &str = "SELECT doc FROM submissions WHERE id = $1";

pub(crate) const KEYED: &str =
    "SELECT request_sha256, doc FROM submissions WHERE idempotency_key = $1";

pub(crate) const DUE_CALLBACKS: &str =
    "SELECT submission_id, url, body, attempts, give_up_at_ms FROM callbacks
     WHERE state = $1 AND next_at_ms <= $2 ORDER BY next_at_ms LIMIT $3";

pub(crate) const NEXT_CALLBACK_AT: &str = "SELECT MIN(next_at_ms) FROM callbacks WHERE state = $1";

pub(crate) const JOB: &str = "SELECT job FROM submissions WHERE id = $1 AND terminal = 0";

/// The newest success under a cache key since `$2` whose own timeout (its deadline less its
/// acceptance) was at most `$4`.
pub(crate) const CACHED: &str =
    "SELECT doc FROM submissions WHERE cache_key = $1 AND created_at_ms >= $2 AND state = $3
         AND deadline_ms - created_at_ms <= $4
     ORDER BY created_at_ms DESC LIMIT 1";

/// A callback row's body when it is the submission as stored (`NewCallback::body` `None`).
pub(crate) const BODY_FROM_SUBMISSION: &str = "";

pub(crate) fn encode<T: serde::Serialize>(v: &T) -> Result<String, sqlx::Error> {
    serde_json::to_string(v).map_err(|e| sqlx::Error::Encode(e.into()))
}

pub(crate) fn decode<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, sqlx::Error> {
    serde_json::from_str(text).map_err(|e| sqlx::Error::Decode(e.into()))
}

/// A submission as kept: without its place in the queue, which is derived from the queue and
/// told to its waiters only (a restart rebuilds the queue).
pub(crate) fn encode_kept(s: &Submission) -> Result<String, sqlx::Error> {
    if s.place.is_none() {
        return encode(s);
    }
    let mut kept = s.clone();
    kept.place = None;
    encode(&kept)
}

/// An ended submission as kept: an answer from the result cache without the result, which
/// the run it names keeps (one copy, however many answers repeat it; [`needs_result_of`]
/// says when a reader must fetch it back).
pub(crate) fn encode_ended(s: &Submission) -> Result<String, sqlx::Error> {
    if s.cached_from.is_none() || s.result.is_none() {
        return encode(s);
    }
    let mut kept = s.clone();
    kept.result = None;
    encode(&kept)
}

/// The run whose result a submission read from the store shows: an answer from the result
/// cache that ended `succeeded` without a result of its own (one that was canceled before its
/// end was written has none).
pub(crate) fn needs_result_of(sub: &Submission) -> Option<&str> {
    let from = sub.cached_from.as_deref()?;
    (sub.result.is_none() && sub.state == crate::submission::State::Succeeded).then_some(from)
}

/// A stored fair tag (a start tag on the fair queue's virtual clock) as the column keeps it.
pub(crate) fn tag_column(tag: Option<u64>) -> Option<i64> {
    tag.map(|t| i64::try_from(t).unwrap_or(i64::MAX))
}

/// A run's length as the column keeps it, ms.
pub(crate) fn ran_column(sub: &Submission) -> Option<i64> {
    sub.ran()
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

// The row decoders both stores share, generic over the driver's row: columns by index,
// `TEXT` as `String` and `BIGINT` as `i64` (each possibly NULL).

/// A row of [`PENDING`].
pub(crate) fn pending_row<'r, R>(r: &'r R) -> Result<crate::store::Pending, sqlx::Error>
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let job: Option<String> = r.try_get(1)?;
    Ok(crate::store::Pending {
        sub: decode(&r.try_get::<String, _>(0)?)?,
        job: job.map(|j| decode(&j)).transpose()?,
        deadline_ms: r.try_get(2)?,
        fair_tag: r
            .try_get::<Option<i64>, _>(3)?
            .and_then(|t| u64::try_from(t).ok()),
    })
}

/// A row of [`ACCEPTED`].
pub(crate) fn accepted_row<'r, R>(r: &'r R) -> Result<crate::store::Accepted, sqlx::Error>
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let class: Option<String> = r.try_get(2)?;
    Ok(crate::store::Accepted {
        queue: r.try_get(0)?,
        user: r.try_get(1)?,
        class: class
            .as_deref()
            .and_then(crate::fairshare::Class::parse)
            .unwrap_or_default(),
        created_at_ms: r.try_get(3)?,
        cached: r.try_get::<Option<String>, _>(4)?.is_some(),
    })
}

/// A row of [`RUNS`].
pub(crate) fn ran_row<'r, R>(r: &'r R) -> Result<crate::store::Ran, sqlx::Error>
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let ms: i64 = r.try_get(1)?;
    Ok(crate::store::Ran {
        queue: r.try_get(0)?,
        took: std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
    })
}
