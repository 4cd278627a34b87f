//! A replica's read side: submissions read from the database, and the long-polls and event
//! streams held here woken by the database's change notifications (or, should one be lost, by
//! the re-read every [`RECHECK`](crate::store::replicas::RECHECK)).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::watch;

use crate::app::Watch;
use crate::error::{Error, Unavailable};
use crate::http::Reader;
use crate::store::replicas::Replica;
use crate::submission::Submission;

/// The submissions followed here, each a channel holding its last read.
pub struct Mirror {
    db: Replica,
    followed: Mutex<HashMap<String, watch::Sender<Submission>>>,
}

impl Mirror {
    /// A mirror reading through `db`.
    pub fn new(db: Replica) -> Arc<Mirror> {
        Arc::new(Mirror {
            db,
            followed: Mutex::new(HashMap::new()),
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
    /// finish out of order).
    fn offer(&self, s: Submission) {
        if let Some(tx) = self.lock().get(&s.id) {
            tx.send_if_modified(|cur| {
                let later = s.history.len() > cur.history.len()
                    || (s.history.len() == cur.history.len() && *cur != s);
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

    /// Reads every followed submission again (what a lost notification would have said), and
    /// stops following those nobody waits for any more.
    pub async fn recheck(&self) {
        let ids: Vec<String> = {
            let mut map = self.lock();
            map.retain(|_, tx| tx.receiver_count() > 0);
            map.keys().cloned().collect()
        };
        for id in ids {
            self.changed(&id).await;
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
                return self.read(id).await;
            }
            match self.follow(id).await? {
                Watch::Done(s) => Ok(*s),
                Watch::Live(mut rx) => {
                    let _ =
                        tokio::time::timeout(wait, rx.wait_for(|s| s.state.is_terminal())).await;
                    let s = rx.borrow().clone();
                    Ok(s)
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
            exit_on_lost: false,
        };
        Mirror::new(Replica::connect(&settings).unwrap())
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
        // Nobody waits: the next re-check forgets it.
        drop(rx);
        m.lock().retain(|_, tx| tx.receiver_count() > 0);
        assert_eq!(m.followed(), 0);
    }
}
