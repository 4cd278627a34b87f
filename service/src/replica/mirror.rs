//! A replica's read side: submissions read from the database, and the long-polls and event
//! streams held here woken by the database's change notifications (or, should one be lost, by
//! the re-read every [`RECHECK`](crate::store::replicas::RECHECK)).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::watch;

use super::relay::Relay;
use crate::app::Watch;
use crate::error::{Error, Unavailable};
use crate::http::Reader;
use crate::store::replicas::{Relayed, Replica};
use crate::submission::Submission;

/// How long a read waits for the replica running the queue to give a waiting submission's
/// place, before answering with what the database holds (no place).
const PLACE_WAIT: Duration = Duration::from_secs(2);

/// The submissions followed here, each a channel holding its last read.
pub struct Mirror {
    db: Replica,
    /// Where a waiting submission's place is asked for (it lives in the queue's memory).
    relay: Arc<Relay>,
    followed: Mutex<HashMap<String, watch::Sender<Submission>>>,
    /// A re-check is running (they never overlap).
    rechecking: std::sync::atomic::AtomicBool,
}

impl Mirror {
    /// A mirror reading through `db`, asking through `relay` for places.
    pub fn new(db: Replica, relay: Arc<Relay>) -> Arc<Mirror> {
        Arc::new(Mirror {
            db,
            relay,
            followed: Mutex::new(HashMap::new()),
            rechecking: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<Submission>>> {
        // A plain map: a panic elsewhere while holding it leaves nothing half-done.
        self.followed.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn read(&self, id: &str) -> Result<Submission, Error> {
        match self.db.load(id).await {
            Ok(Some(s)) => Ok(s),
            Ok(None) => Err(Error::NotFound { id: id.to_string() }),
            Err(e) => Err(Error::from(Unavailable::Store {
                what: "the store could not be read",
                source: e.into(),
            })),
        }
    }

    /// Hands a fresh read to the channel following it (only a later one: reads of one row can
    /// finish out of order; every saved change moves its history or its `updated_at` on).
    fn offer(&self, s: Submission) {
        if let Some(tx) = self.lock().get(&s.id) {
            tx.send_if_modified(|cur| {
                let later = (s.history.len(), s.updated_at) > (cur.history.len(), cur.updated_at);
                if later {
                    *cur = s;
                }
                later
            });
        }
    }

    /// Submission `id` changed (a notification said so): read it again if it is followed.
    pub async fn changed(&self, id: &str) {
        if !self.lock().contains_key(id) {
            return;
        }
        match self.db.load(id).await {
            Ok(Some(s)) => self.offer(s),
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(error = %crate::report::report(&e), "a followed submission could not be read again")
            }
        }
    }

    /// Reads every followed submission again, in one query (what a lost notification would
    /// have said), and stops following those nobody waits for any more. A re-check asked for
    /// while one runs is skipped: the running one reads everything.
    pub async fn recheck(&self) {
        use std::sync::atomic::Ordering;
        if self.rechecking.swap(true, Ordering::AcqRel) {
            return;
        }
        let ids: Vec<String> = {
            let mut map = self.lock();
            map.retain(|_, tx| tx.receiver_count() > 0);
            map.keys().cloned().collect()
        };
        if !ids.is_empty() {
            match self.db.load_many(&ids).await {
                Ok(subs) => subs.into_iter().for_each(|s| self.offer(s)),
                Err(e) => {
                    tracing::debug!(error = %crate::report::report(&e), "the followed submissions could not be read again")
                }
            }
        }
        self.rechecking.store(false, Ordering::Release);
    }

    /// The submission as the replica running the queue shows it (with its place), if it
    /// answers within [`PLACE_WAIT`].
    async fn shown_by_the_queue(&self, id: &str) -> Option<Submission> {
        let ask = Relayed {
            method: "GET".into(),
            uri: format!("/v1/submissions/{id}"),
            headers: Vec::new(),
            peer: String::new(),
            body: Vec::new(),
        };
        let r = self.relay.send(ask, PLACE_WAIT).await.ok()?;
        if r.status() != axum::http::StatusCode::OK {
            return None;
        }
        let body = axum::body::to_bytes(r.into_body(), usize::MAX).await.ok()?;
        serde_json::from_slice(&body).ok()
    }

    /// What a read answers: an ended submission as stored (final); one not ended as the
    /// replica running the queue shows it, with its place, else as stored.
    async fn answer(&self, s: Submission) -> Submission {
        if s.state.is_terminal() {
            return s;
        }
        match self.shown_by_the_queue(&s.id).await {
            Some(shown) => shown,
            None => s,
        }
    }

    /// How many submissions are followed.
    pub fn followed(&self) -> usize {
        self.lock().len()
    }

    async fn follow(&self, id: &str) -> Result<Watch, Error> {
        let s = self.read(id).await?;
        if s.state.is_terminal() {
            return Ok(Watch::Done(Box::new(s)));
        }
        let rx = {
            let mut map = self.lock();
            let tx = map
                .entry(s.id.clone())
                .or_insert_with(|| watch::channel(s.clone()).0);
            tx.subscribe()
        };
        // An entry older than this read gets it.
        self.offer(s);
        Ok(Watch::Live(rx))
    }
}

impl Reader for Mirror {
    fn get<'a>(&'a self, id: &'a str, wait: Duration) -> BoxFuture<'a, Result<Submission, Error>> {
        Box::pin(async move {
            if wait.is_zero() {
                let s = self.read(id).await?;
                return Ok(self.answer(s).await);
            }
            match self.follow(id).await? {
                Watch::Done(s) => Ok(*s),
                Watch::Live(mut rx) => {
                    let _ =
                        tokio::time::timeout(wait, rx.wait_for(|s| s.state.is_terminal())).await;
                    let s = rx.borrow().clone();
                    Ok(self.answer(s).await)
                }
            }
        })
    }

    fn watch<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Watch, Error>> {
        Box::pin(self.follow(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::submission::State;

    fn mirror() -> Arc<Mirror> {
        // Never connected: these tests do not read the database.
        let settings = crate::store::PgSettings {
            url: "postgres://kk@127.0.0.1:9/kk".into(),
            schema: "kernelkite".into(),
            max_connections: 1,
            lock_wait: Duration::from_secs(1),
            standby: false,
            replica: true,
            exit_on_lost: false,
        };
        let db = Replica::connect(&settings).unwrap();
        Mirror::new(db.clone(), Relay::new(db))
    }

    fn sub(states: &[State]) -> Submission {
        let now = chrono::Utc::now();
        let mut s = Submission::new("s-1".into(), "h100".into(), None, None, 60, now);
        for st in states {
            s.advance(*st, now);
        }
        s
    }

    #[tokio::test]
    async fn a_followed_submission_only_moves_forward() {
        let m = mirror();
        let queued = sub(&[]);
        let mut rx = {
            let mut map = m.lock();
            let tx = map
                .entry(queued.id.clone())
                .or_insert_with(|| watch::channel(queued.clone()).0);
            tx.subscribe()
        };
        let running = sub(&[State::Running]);
        m.offer(running.clone());
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().state, State::Running);
        // A read that finished late, from before the change, is not taken.
        m.offer(queued);
        assert!(!rx.has_changed().unwrap());
        assert_eq!(rx.borrow().state, State::Running);
        // A change without a state change (a build attached) is taken; the read before it,
        // arriving late with the same history, is not.
        let mut built = running.clone();
        built.updated_at += chrono::Duration::milliseconds(5);
        built.run_id = Some("r-1".into());
        m.offer(built.clone());
        assert_eq!(rx.borrow_and_update().run_id.as_deref(), Some("r-1"));
        m.offer(running);
        assert!(!rx.has_changed().unwrap());
        // Nobody waits: the next re-check forgets it.
        drop(rx);
        m.lock().retain(|_, tx| tx.receiver_count() > 0);
        assert_eq!(m.followed(), 0);
    }
}
