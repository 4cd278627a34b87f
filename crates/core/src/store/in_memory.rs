//! A [`Durable`] store in memory: what the core's tests and an embedder that keeps nothing
//! across restarts run on, with the same answers as the service's SQLite store (which the
//! service's tests run against; `kernelkite_service::store::sqlite`). Nothing survives the
//! process ([`Durable::persistent`] is false). Each change is made when the method is called,
//! before its future is awaited (the SQLite store's, when it is awaited): the core awaits every
//! write before it goes on, so it cannot tell.

use std::collections::HashMap;
use std::sync::Mutex;

use futures_util::future::BoxFuture;

use super::{
    now_ms, Accepted, CacheQuery, CallbackState, DueCallback, Durable, Inserted, NewCallback,
    NewSubmission, Pending, StoreError,
};
use crate::executor::Job;
use crate::submission::{State, Submission};

/// A submission as kept.
struct Row {
    sub: Submission,
    /// Set by `finish` alone, as the SQLite store's `terminal` column: a `save` never ends a
    /// submission, whatever state it carries.
    terminal: bool,
    /// Until it ends (what its build is created from).
    job: Option<Job>,
    deadline_ms: i64,
    /// The idempotency key's request hash, when it came with a key.
    request_sha256: Option<String>,
    fair_tag: Option<u64>,
    cache_key: Option<String>,
}

/// A callback in the outbox.
struct Callback {
    url: String,
    /// `None`: the submission as kept, read when it is due.
    body: Option<String>,
    state: CallbackState,
    attempts: i64,
    next_at_ms: i64,
    give_up_at_ms: i64,
}

#[derive(Default)]
struct Tables {
    submissions: HashMap<String, Row>,
    /// Idempotency key → submission id.
    keys: HashMap<String, String>,
    /// Submission id → its callback.
    callbacks: HashMap<String, Callback>,
}

/// Every submission and the callback outbox, in memory.
#[derive(Default)]
pub struct InMemory {
    tables: Mutex<Tables>,
}

impl InMemory {
    /// An empty store.
    pub fn new() -> InMemory {
        InMemory::default()
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        // A test that panicked while holding the lock leaves whole rows behind: each change
        // below is made in one step.
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What an idempotency key's submission answers a request with the hash `hash`.
fn existing(row: &Row, hash: &str) -> Inserted {
    Inserted::Existing {
        sub: Box::new(row.sub.clone()),
        same_request: row.request_sha256.as_deref() == Some(hash),
    }
}

impl Tables {
    fn insert(&mut self, new: NewSubmission) -> Result<Inserted, StoreError> {
        let (key, hash) = match &new.idempotency {
            Some((k, h)) => (Some(k.clone()), Some(h.clone())),
            None => (None, None),
        };
        if let (Some(k), Some(h)) = (&key, &hash) {
            if let Some(row) = self.keys.get(k).and_then(|id| self.submissions.get(id)) {
                return Ok(existing(row, h));
            }
        }
        let id = new.sub.id.clone();
        if self.submissions.contains_key(&id) {
            // The SQLite store's primary key refuses it too.
            return Err(StoreError::Write(format!("submission {id} exists already")));
        }
        if let Some(k) = key {
            self.keys.insert(k, id.clone());
        }
        self.submissions.insert(
            id,
            Row {
                terminal: new.sub.state.is_terminal(),
                sub: new.sub,
                job: Some(new.job),
                deadline_ms: new.deadline_ms,
                request_sha256: hash,
                fair_tag: new.fair_tag,
                cache_key: new.cache_key,
            },
        );
        Ok(Inserted::Created)
    }

    /// A change of a submission that has not ended; false when it has (or is unknown).
    fn save(&mut self, sub: &Submission) -> bool {
        match self.submissions.get_mut(&sub.id) {
            Some(row) if !row.terminal => {
                // A waiting submission's place is told, never kept (as the SQLite store).
                let mut kept = sub.clone();
                kept.place = None;
                row.sub = kept;
                true
            }
            _ => false,
        }
    }

    fn finish(&mut self, sub: &Submission, callback: Option<NewCallback>) -> bool {
        let Some(row) = self.submissions.get_mut(&sub.id) else {
            return false;
        };
        if row.terminal {
            return false;
        }
        row.sub = sub.clone();
        row.terminal = true;
        row.job = None;
        if let Some(cb) = callback {
            self.callbacks.insert(
                sub.id.clone(),
                Callback {
                    url: cb.url,
                    body: cb.body,
                    state: CallbackState::Pending,
                    attempts: 0,
                    next_at_ms: now_ms(),
                    give_up_at_ms: cb.give_up_at_ms,
                },
            );
        }
        true
    }

    fn due(&self, now_ms: i64, limit: i64) -> Vec<DueCallback> {
        let mut due: Vec<(&String, &Callback)> = self
            .callbacks
            .iter()
            .filter(|(_, c)| c.state == CallbackState::Pending && c.next_at_ms <= now_ms)
            .collect();
        due.sort_by_key(|(_, c)| c.next_at_ms);
        let mut out = Vec::new();
        for (id, c) in due.into_iter().take(usize::try_from(limit).unwrap_or(0)) {
            let body = match &c.body {
                Some(b) => b.clone(),
                None => {
                    let Some(row) = self.submissions.get(id) else {
                        continue;
                    };
                    // One that cannot be encoded must not hold up every other callback (as
                    // the SQLite store leaves such a row out).
                    match serde_json::to_string(&row.sub) {
                        Ok(body) => body,
                        Err(e) => {
                            tracing::error!(id = %id, error = %e, "cannot build a callback's body from its submission; it is left out");
                            continue;
                        }
                    }
                }
            };
            out.push(DueCallback {
                submission_id: id.clone(),
                url: c.url.clone(),
                body,
                attempts: c.attempts,
                give_up_at_ms: c.give_up_at_ms,
            });
        }
        out
    }

    fn cached(&self, q: &CacheQuery) -> Option<Submission> {
        self.submissions
            .values()
            .filter(|r| r.cache_key.as_deref() == Some(q.key.as_str()))
            .filter(|r| r.sub.state == State::Succeeded)
            .filter(|r| r.sub.created_at.timestamp_millis() >= q.since_ms)
            // A submission's timeout is its deadline less its acceptance.
            .filter(|r| r.deadline_ms - r.sub.created_at.timestamp_millis() <= q.max_timeout_ms)
            .max_by_key(|r| r.sub.created_at)
            .map(|r| r.sub.clone())
    }
}

impl Durable for InMemory {
    fn insert(&self, new: NewSubmission) -> BoxFuture<'_, Result<Inserted, StoreError>> {
        let inserted = self.tables().insert(new);
        Box::pin(async move { inserted })
    }

    fn save<'a>(&'a self, sub: &'a Submission) -> BoxFuture<'a, Result<(), StoreError>> {
        self.tables().save(sub);
        Box::pin(async { Ok(()) })
    }

    fn finish<'a>(
        &'a self,
        sub: &'a Submission,
        callback: Option<NewCallback>,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let ended = self.tables().finish(sub, callback);
        Box::pin(async move { Ok(ended) })
    }

    fn load<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Submission>, StoreError>> {
        let sub = self.tables().submissions.get(id).map(|r| r.sub.clone());
        Box::pin(async move { Ok(sub) })
    }

    fn pending(&self) -> BoxFuture<'_, Result<Vec<Pending>, StoreError>> {
        let mut pending: Vec<Pending> = self
            .tables()
            .submissions
            .values()
            .filter(|r| !r.terminal)
            .map(|r| Pending {
                sub: r.sub.clone(),
                job: r.job.clone(),
                deadline_ms: r.deadline_ms,
                fair_tag: r.fair_tag,
            })
            .collect();
        pending.sort_by_key(|p| p.sub.created_at);
        Box::pin(async move { Ok(pending) })
    }

    fn job<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Job>, StoreError>> {
        let job = self
            .tables()
            .submissions
            .get(id)
            .filter(|r| !r.terminal)
            .and_then(|r| r.job.clone());
        Box::pin(async move { Ok(job) })
    }

    fn keyed<'a>(
        &'a self,
        key: &'a str,
        hash: &'a str,
    ) -> BoxFuture<'a, Result<Option<Inserted>, StoreError>> {
        let t = self.tables();
        let found = t
            .keys
            .get(key)
            .and_then(|id| t.submissions.get(id))
            .map(|row| existing(row, hash));
        drop(t);
        Box::pin(async move { Ok(found) })
    }

    fn accepted_since(&self, since_ms: i64) -> BoxFuture<'_, Result<Vec<Accepted>, StoreError>> {
        let accepted = self
            .tables()
            .submissions
            .values()
            .filter(|r| r.sub.created_at.timestamp_millis() >= since_ms)
            .filter(|r| r.fair_tag.is_some() || r.sub.cached_from.is_some())
            .map(|r| Accepted {
                queue: r.sub.queue.clone(),
                user: r.sub.user.clone(),
                class: r.sub.priority,
                created_at_ms: r.sub.created_at.timestamp_millis(),
                cached: r.sub.cached_from.is_some(),
            })
            .collect();
        Box::pin(async move { Ok(accepted) })
    }

    fn cached<'a>(
        &'a self,
        q: &'a CacheQuery,
    ) -> BoxFuture<'a, Result<Option<Submission>, StoreError>> {
        let found = self.tables().cached(q);
        Box::pin(async move { Ok(found) })
    }

    fn due_callbacks(
        &self,
        now_ms: i64,
        limit: i64,
    ) -> BoxFuture<'_, Result<Vec<DueCallback>, StoreError>> {
        let due = self.tables().due(now_ms, limit);
        Box::pin(async move { Ok(due) })
    }

    fn next_callback_at(&self) -> BoxFuture<'_, Result<Option<i64>, StoreError>> {
        let next = self
            .tables()
            .callbacks
            .values()
            .filter(|c| c.state == CallbackState::Pending)
            .map(|c| c.next_at_ms)
            .min();
        Box::pin(async move { Ok(next) })
    }

    fn callback_attempted<'a>(
        &'a self,
        id: &'a str,
        state: CallbackState,
        attempts: i64,
        next_at_ms: i64,
        _error: Option<String>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        if let Some(c) = self.tables().callbacks.get_mut(id) {
            c.state = state;
            c.attempts = attempts;
            c.next_at_ms = next_at_ms;
        }
        Box::pin(async { Ok(()) })
    }

    fn health(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }

    fn persistent(&self) -> bool {
        false
    }
}
