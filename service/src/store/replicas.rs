//! What the replicas of one PostgreSQL schema share besides the submissions
//! (`KERNELKITE_REPLICA`, [`crate::replica`]): the notification channels that announce a
//! submission's changes and a relayed request's answer, and the table of requests a replica
//! hands to the one that holds the schema's lock (and so runs the queue).
//!
//! A notification is a hint, never the only way to learn something: a receiver reads the row
//! again, and re-reads what it waits for every [`RECHECK`] too, so a notification lost (a
//! listener's connection cut, the server restarted) costs latency, never a result.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use sqlx::Row;

pub use super::postgres::{channels, Channels};
use super::postgres::{connect_options, load, load_many, shown, PgSettings, Postgres};
use super::StoreError;
use crate::report::report;
use crate::submission::Submission;

/// How often what a replica waits for is read again whatever the notifications say.
pub const RECHECK: Duration = Duration::from_secs(1);

/// How long a relayed request waits to be claimed: longer than a take-over takes (6 s of
/// silence, then a start), so a request that arrives while the holder dies is answered by
/// the next.
pub const CLAIM_WAIT: Duration = Duration::from_secs(15);

/// A request as the replica that received it saw it, for the one that runs the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relayed {
    /// The method.
    pub method: String,
    /// Path and query.
    pub uri: String,
    /// The headers whose values are text.
    pub headers: Vec<(String, String)>,
    /// The client's address, as the receiving replica saw it (which the loopback rule reads).
    pub peer: String,
    /// The body.
    pub body: Vec<u8>,
}

/// What the replica running the queue answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The status.
    pub status: u16,
    /// The headers whose values are text.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Vec<u8>,
}

/// Where a relayed request stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RelayState {
    /// No replica took it yet.
    Waiting,
    /// Taken by the replica holding the lock; `orphaned` once that replica's lock session has
    /// ended (it died, or was taken over), so no answer will come.
    Claimed {
        /// The claimant's session is gone.
        orphaned: bool,
    },
    /// Answered ([`Replica::take_answer`] reads the answer).
    Answered,
    /// Not there (deleted).
    Gone,
}

/// The side of the replica holding the schema's lock: claims what the others relay, for its
/// lock session.
pub struct Holder {
    db: Postgres,
    replica: Replica,
    /// When the lock's session started (what a claim records with its pid).
    start: tokio::sync::OnceCell<String>,
}

impl Holder {
    /// The holder with the store `db`.
    pub fn new(db: Postgres) -> Holder {
        Holder {
            replica: Replica::of(&db),
            db,
            start: tokio::sync::OnceCell::new(),
        }
    }

    /// Its connections, as a replica's.
    pub fn replica(&self) -> &Replica {
        &self.replica
    }

    /// The backend pid of its lock session.
    pub fn pid(&self) -> i32 {
        self.db.holder()
    }

    /// Takes up to `limit` requests other replicas relayed, for its lock session. Checked as
    /// far as this process knows, not fenced in the database: a holder that lost the lock
    /// without knowing it yet can only answer what it claimed with a refusal (every write of the
    /// core is fenced) or with what it holds in memory, never with a change; and what it
    /// claimed is seen as orphaned once its session is ended.
    pub async fn claim(&self, limit: i64) -> Result<Vec<(i64, Relayed)>, StoreError> {
        self.db.held()?;
        let (pool, _, _) = self.db.connections();
        let mut c = pool
            .acquire()
            .await
            .map_err(|e| StoreError::Read(report(&e)))?;
        let pid = self.pid();
        let start = self
            .start
            .get_or_try_init(|| Replica::session_start(&mut c, pid))
            .await
            .map_err(|e| self.db.write_err(&e))?
            .clone();
        Replica::claim(&mut c, (pid, &start), limit)
            .await
            .map_err(|e| self.db.write_err(&e))
    }
}

/// What a listener heard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Heard {
    /// Listening (again): what was said before was not heard.
    Listening,
    /// A notification.
    Said {
        /// Its channel.
        channel: String,
        /// Its payload.
        payload: String,
    },
}

async fn listen(pool: &PgPool, channels: &[String]) -> Result<PgListener, sqlx::Error> {
    let mut l = PgListener::connect_with(pool).await?;
    l.listen_all(channels.iter().map(String::as_str)).await?;
    Ok(l)
}

/// A replica's connections to the schema, without its lock: reads submissions, relays
/// requests, listens. Cloning is cheap.
#[derive(Clone)]
pub struct Replica {
    pool: PgPool,
    channels: Arc<Channels>,
    target: Arc<str>,
}

impl Replica {
    /// Connections to the schema `settings` name (opened when first used: a replica starts
    /// while the database may still be down).
    pub fn connect(settings: &PgSettings) -> Result<Replica, StoreError> {
        let opts = connect_options(settings)?;
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections.max(1))
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(opts.clone());
        Ok(Replica::over(pool, &opts, &settings.schema))
    }

    /// On the connections of the store `db` (the replica holding the lock).
    pub fn of(db: &Postgres) -> Replica {
        let (pool, opts, schema) = db.connections();
        Replica::over(pool.clone(), opts, schema)
    }

    /// Over an open pool.
    fn over(pool: PgPool, opts: &PgConnectOptions, schema: &str) -> Replica {
        Replica {
            target: format!("{} (schema {schema})", shown(opts)).into(),
            channels: Arc::new(channels(schema)),
            pool,
        }
    }

    /// The schema's channels.
    pub fn channels(&self) -> &Channels {
        &self.channels
    }

    /// Where: the URL without its password, and the schema.
    pub fn target(&self) -> &str {
        &self.target
    }

    fn read_err(e: &sqlx::Error) -> StoreError {
        StoreError::Read(report(e))
    }

    /// The submissions kept under `ids` (those there are), in one query.
    pub async fn load_many(&self, ids: &[String]) -> Result<Vec<Submission>, StoreError> {
        let mut c = self.pool.acquire().await.map_err(|e| Self::read_err(&e))?;
        load_many(&mut c, ids).await.map_err(|e| Self::read_err(&e))
    }

    /// How full PostgreSQL's notification queue is (0 to 1): a listener that stopped reading
    /// (a replica frozen with its session open) holds it; full, every commit that notifies
    /// fails.
    pub async fn notification_queue_usage(&self) -> Result<f64, StoreError> {
        sqlx::query_scalar("SELECT pg_notification_queue_usage()")
            .fetch_one(&self.pool)
            .await
            .map_err(|e| Self::read_err(&e))
    }

    /// The submission kept under `id`.
    pub async fn load(&self, id: &str) -> Result<Option<Submission>, StoreError> {
        let mut c = self.pool.acquire().await.map_err(|e| Self::read_err(&e))?;
        load(&mut c, id).await.map_err(|e| Self::read_err(&e))
    }

    /// Whether the database answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|e| Self::read_err(&e))
    }

    /// What the database says on `channels`, heard on a connection of its own (made again
    /// whenever it is lost) by a task that ends when the receiver is dropped.
    /// [`Heard::Listening`] comes first and after every reconnection: whatever was said while
    /// not listening was missed.
    pub fn hear(&self, channels: Vec<String>) -> tokio::sync::mpsc::UnboundedReceiver<Heard> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let pool = self.pool.clone();
        tokio::spawn(async move {
            let mut warned = false;
            while !tx.is_closed() {
                let mut l = match listen(&pool, &channels).await {
                    Ok(l) => l,
                    Err(e) => {
                        if !warned {
                            tracing::warn!(error = %report(&e), "cannot listen to the database's notifications; trying again every second");
                            warned = true;
                        }
                        tokio::time::sleep(RECHECK).await;
                        continue;
                    }
                };
                warned = false;
                if tx.send(Heard::Listening).is_err() {
                    return;
                }
                loop {
                    let heard = tokio::select! {
                        () = tx.closed() => return,
                        n = l.try_recv() => n,
                    };
                    let sent = match heard {
                        Ok(Some(n)) => tx.send(Heard::Said {
                            channel: n.channel().to_string(),
                            payload: n.payload().to_string(),
                        }),
                        // Lost and made again on the next call: some may have been missed.
                        Ok(None) => tx.send(Heard::Listening),
                        Err(e) => {
                            tracing::debug!(error = %report(&e), "the database's notifications stopped; listening again");
                            break;
                        }
                    };
                    if sent.is_err() {
                        return;
                    }
                }
                tokio::time::sleep(RECHECK / 4).await;
            }
        });
        rx
    }

    /// Hands `r` (under `id`, the caller's, so it can wait for the answer before asking) to
    /// the replica that runs the queue, and tells it.
    pub async fn relay(&self, id: i64, r: &Relayed) -> Result<(), StoreError> {
        let headers = serde_json::to_string(&r.headers).unwrap_or_else(|_| "[]".into());
        sqlx::query(
            "WITH r AS (INSERT INTO relayed (id, created_at_ms, method, uri, headers, peer, body) \
             VALUES ($1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint, $2, $3, $4, $5, $6) \
             RETURNING id) \
             SELECT pg_notify($7, r.id::text) FROM r",
        )
        .bind(id)
        .bind(&r.method)
        .bind(&r.uri)
        .bind(headers)
        .bind(&r.peer)
        .bind(&r.body)
        .bind(&self.channels.relayed)
        .execute(&self.pool)
        .await
        .map(drop)
        .map_err(|e| StoreError::DatabaseWrite(report(&e)))
    }

    /// Where relayed request `id` stands.
    pub async fn relay_state(&self, id: i64) -> Result<RelayState, StoreError> {
        let row = sqlx::query(
            "SELECT claimed_by, status IS NOT NULL, \
             (claimed_by IS NOT NULL AND status IS NULL AND NOT EXISTS \
              (SELECT 1 FROM pg_stat_activity \
               WHERE pid = claimed_by \
               AND extract(epoch FROM backend_start)::text IS NOT DISTINCT FROM claimed_start)) \
             AS orphaned \
             FROM relayed WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| Self::read_err(&e))?;
        let Some(row) = row else {
            return Ok(RelayState::Gone);
        };
        let claimed: Option<i32> = row.try_get(0).map_err(|e| Self::read_err(&e))?;
        let answered: bool = row.try_get(1).map_err(|e| Self::read_err(&e))?;
        Ok(match (claimed, answered) {
            (_, true) => RelayState::Answered,
            (Some(_), false) => RelayState::Claimed {
                orphaned: row.try_get(2).map_err(|e| Self::read_err(&e))?,
            },
            (None, false) => RelayState::Waiting,
        })
    }

    /// The answer to relayed request `id`, taken (the row deleted) if it is there.
    pub async fn take_answer(&self, id: i64) -> Result<Option<Answer>, StoreError> {
        let row = sqlx::query(
            "DELETE FROM relayed WHERE id = $1 AND status IS NOT NULL \
             RETURNING status, answer_headers, answer_body",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| StoreError::DatabaseWrite(report(&e)))?;
        let Some(row) = row else {
            return Ok(None);
        };
        let status: i32 = row.try_get(0).map_err(|e| Self::read_err(&e))?;
        let headers: Option<String> = row.try_get(1).map_err(|e| Self::read_err(&e))?;
        let body: Option<Vec<u8>> = row.try_get(2).map_err(|e| Self::read_err(&e))?;
        Ok(Some(Answer {
            status: u16::try_from(status).unwrap_or(500),
            headers: headers
                .and_then(|h| serde_json::from_str(&h).ok())
                .unwrap_or_default(),
            body: body.unwrap_or_default(),
        }))
    }

    /// Takes back relayed request `id` if no replica took it yet; false when one did.
    pub async fn withdraw(&self, id: i64) -> Result<bool, StoreError> {
        sqlx::query("DELETE FROM relayed WHERE id = $1 AND claimed_by IS NULL")
            .bind(id)
            .execute(&self.pool)
            .await
            .map(|r| r.rows_affected() == 1)
            .map_err(|e| StoreError::DatabaseWrite(report(&e)))
    }

    /// Deletes relayed request `id` (its answer was read, or will never come).
    pub async fn forget(&self, id: i64) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM relayed WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|e| StoreError::DatabaseWrite(report(&e)))
    }

    /// When session `pid` started, as [`Replica::claim`] records it.
    async fn session_start(c: &mut sqlx::PgConnection, pid: i32) -> Result<String, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT extract(epoch FROM backend_start)::text FROM pg_stat_activity WHERE pid = $1",
        )
        .bind(pid)
        .fetch_one(c)
        .await
    }

    /// Takes up to `limit` waiting requests for the session `holder` (pid and start; the lock's: a request
    /// is the claimant's for as long as that session lives), dropping their bodies from the
    /// table. The caller checks it holds the lock ([`Holder::claim`]).
    async fn claim(
        c: &mut sqlx::PgConnection,
        holder: (i32, &str),
        limit: i64,
    ) -> Result<Vec<(i64, Relayed)>, sqlx::Error> {
        let rows = sqlx::query(
            "WITH taken AS (SELECT id, method, uri, headers, peer, body, created_at_ms \
               FROM relayed WHERE claimed_by IS NULL ORDER BY created_at_ms LIMIT $2 \
               FOR UPDATE SKIP LOCKED), \
             marked AS (UPDATE relayed r SET claimed_by = $1, body = ''::bytea, \
               claimed_start = $3 \
               FROM taken WHERE r.id = taken.id) \
             SELECT id, method, uri, headers, peer, body FROM taken ORDER BY created_at_ms",
        )
        .bind(holder.0)
        .bind(limit)
        .bind(holder.1)
        .fetch_all(c)
        .await?;
        rows.into_iter()
            .map(|row| {
                let headers: String = row.try_get(3)?;
                Ok((
                    row.try_get(0)?,
                    Relayed {
                        method: row.try_get(1)?,
                        uri: row.try_get(2)?,
                        headers: serde_json::from_str(&headers).unwrap_or_default(),
                        peer: row.try_get(4)?,
                        body: row.try_get(5)?,
                    },
                ))
            })
            .collect()
    }

    /// Writes the answer to relayed request `id` (claimed by session `holder`) and tells its
    /// receiver.
    pub async fn answer(&self, id: i64, holder: i32, a: &Answer) -> Result<(), StoreError> {
        let headers = serde_json::to_string(&a.headers).unwrap_or_else(|_| "[]".into());
        sqlx::query(
            "WITH r AS (UPDATE relayed SET status = $3, answer_headers = $4, answer_body = $5 \
             WHERE id = $1 AND claimed_by = $2 RETURNING id) \
             SELECT pg_notify($6, r.id::text) FROM r",
        )
        .bind(id)
        .bind(holder)
        .bind(i32::from(a.status))
        .bind(headers)
        .bind(&a.body)
        .bind(&self.channels.answered)
        .execute(&self.pool)
        .await
        .map(drop)
        .map_err(|e| StoreError::DatabaseWrite(report(&e)))
    }

    /// Deletes relayed requests older than `keep` by the database's clock (their receivers
    /// died before reading the answer).
    pub async fn prune(&self, keep: Duration) -> Result<u64, StoreError> {
        sqlx::query(
            "DELETE FROM relayed \
             WHERE created_at_ms < (extract(epoch FROM clock_timestamp()) * 1000)::bigint - $1",
        )
        .bind(keep.as_millis() as i64)
        .execute(&self.pool)
        .await
        .map(|r| r.rows_affected())
        .map_err(|e| StoreError::DatabaseWrite(report(&e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_schema_has_its_own_channels_within_postgres_limit() {
        let long = "s".repeat(63);
        let (a, b, c) = (channels("kernelkite"), channels("other"), channels(&long));
        assert_ne!(a, b);
        for ch in [&a, &b, &c] {
            for name in [&ch.changed, &ch.relayed, &ch.answered] {
                assert!(name.len() < 64, "{name}");
            }
            assert_ne!(ch.changed, ch.relayed);
            assert_ne!(ch.relayed, ch.answered);
        }
    }
}
