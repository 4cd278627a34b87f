//! Requests that change something (a submission, a cancel, Buildkite's webhook, a queue's
//! figures) are answered by the replica that runs the queue, whichever replica received them:
//! the receiver writes the request to the database and waits for the answer there
//! ([`Relay`]); the holder of the schema's lock claims it, runs it through its own routes, and
//! writes the answer ([`serve_relayed`]). Through the database and not replica to replica,
//! because a Heroku-style platform's processes cannot reach one another; and one replica
//! decides, so idempotency keys, quotas and the fair order hold as they do in one process.
//!
//! A request is claimed by the holder's lock session. If that session ends before the answer
//! is written (the holder died or was taken over), the receiver answers 503 at once: the
//! request may or may not have taken effect, as with a reply lost on the network, and a retry
//! with the same `Idempotency-Key` gets the one submission either way. A request nobody
//! claims within [`CLAIM_WAIT`](crate::store::replicas::CLAIM_WAIT) (no replica holds the lock) is taken back and answered 503,
//! without effect.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Request, StatusCode};
use axum::response::Response;
use axum::Router;
use tokio::sync::Notify;
use tower_service::Service as _;

use crate::error::{Error, Unavailable};
use crate::http::text_headers;
use crate::store::replicas::{Answer, Holder, RelayState, Relayed, Replica, RECHECK};
use crate::store::Postgres;

/// How long a claimed request waits for its answer (the holder's own bounds are shorter:
/// store and Buildkite calls time out well within it).
pub const ANSWER_WAIT: Duration = Duration::from_secs(60);

/// Relayed requests older than this are deleted (their receivers died before reading them).
const KEEP: Duration = Duration::from_secs(600);

/// Relayed requests the holder answers at once, at most.
pub const IN_FLIGHT: usize = 256;

/// Relayed requests claimed in one statement, at most.
const BATCH: usize = 64;

/// The receiving side: requests relayed from here, each waiting for its answer.
pub struct Relay {
    db: Replica,
    waiting: Mutex<HashMap<i64, Arc<Notify>>>,
}

/// Takes a relayed request's waiter off the books however its wait ends, and its row out of
/// the table unless its answer was taken (a client that hung up leaves nothing behind).
struct Waiting<'a> {
    relay: &'a Relay,
    id: i64,
    taken: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.relay.lock().remove(&self.id);
        if !self.taken {
            self.relay.let_go(self.id);
        }
    }
}

impl Relay {
    /// Relays through `db`.
    pub fn new(db: Replica) -> Arc<Relay> {
        Arc::new(Relay {
            db,
            waiting: Mutex::new(HashMap::new()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Arc<Notify>>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Relayed request `id` was answered (a notification said so).
    pub fn answered(&self, id: i64) {
        if let Some(n) = self.lock().get(&id) {
            n.notify_one();
        }
    }

    /// Every waiter looks again (notifications may have been lost).
    pub fn recheck(&self) {
        for n in self.lock().values() {
            n.notify_one();
        }
    }

    /// Has `r` answered by the replica that runs the queue, waiting at most `claim_wait` for
    /// one to take it.
    pub async fn send(&self, r: Relayed, claim_wait: Duration) -> Result<Response, Error> {
        let id = fastrand::i64(1..i64::MAX);
        let woken = Arc::new(Notify::new());
        self.lock().insert(id, woken.clone());
        let mut waiting = Waiting {
            relay: self,
            id,
            taken: false,
        };
        self.db.relay(id, &r).await.map_err(|e| {
            Error::from(Unavailable::Store {
                what: "the request could not be handed to the replica that runs the queue",
                source: e.into(),
            })
        })?;
        let began = Instant::now();
        loop {
            // The answer cannot be there before the holder heard of the request: wait first.
            tokio::select! {
                () = woken.notified() => {}
                () = tokio::time::sleep(RECHECK.min(claim_wait)) => {}
            }
            if let Ok(Some(a)) = self.db.take_answer(id).await {
                waiting.taken = true;
                return Ok(response(a));
            }
            match self.db.relay_state(id).await {
                Ok(RelayState::Waiting) if began.elapsed() >= claim_wait => {
                    if self.db.withdraw(id).await.unwrap_or(false) {
                        waiting.taken = true;
                        return Err(Unavailable::Relay(
                            "no replica runs the queue right now (one takes over within seconds); nothing was done, retry in a moment",
                        )
                        .into());
                    }
                }
                Ok(RelayState::Claimed { orphaned: true }) => {
                    return Err(Unavailable::Relay(
                        "the replica running the queue ended while answering; retry (with the same Idempotency-Key a submission is made once)",
                    )
                    .into());
                }
                Ok(RelayState::Gone) => {
                    waiting.taken = true;
                    return Err(Unavailable::Relay(
                        "the relayed request was lost; retry (with the same Idempotency-Key a submission is made once)",
                    )
                    .into());
                }
                // Answered between the two reads (taken on the next turn), still waiting, or a
                // database that does not answer for a moment: the loop's bound holds.
                Ok(_) | Err(_) => {}
            }
            if began.elapsed() > ANSWER_WAIT {
                return Err(Unavailable::Relay(
                    "the replica running the queue did not answer within 60 s; retry (with the same Idempotency-Key a submission is made once)",
                )
                .into());
            }
        }
    }

    /// Deletes relayed request `id`, in the background.
    fn let_go(&self, id: i64) {
        let db = self.db.clone();
        tokio::spawn(async move {
            let _ = db.forget(id).await;
        });
    }
}

impl crate::http::Relayer for Relay {
    fn send(
        &self,
        r: Relayed,
        claim_wait: Duration,
    ) -> futures_util::future::BoxFuture<'_, Result<Response, Error>> {
        Box::pin(Relay::send(self, r, claim_wait))
    }
}

/// The answer as the client gets it.
fn response(a: Answer) -> Response {
    let mut r = Response::new(Body::from(a.body));
    *r.status_mut() = StatusCode::from_u16(a.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = r.headers_mut();
    for (k, v) in a.headers {
        if let (Ok(k), Ok(v)) = (HeaderName::try_from(k), HeaderValue::try_from(v)) {
            headers.append(k, v);
        }
    }
    r
}

/// The holding side: while this process holds the schema's lock, claims what the replicas
/// relay and answers it through `routes` (the core's own), at most [`IN_FLIGHT`] at once (the
/// connection cap does not see them). Runs until the store refuses (the lock lost: the process
/// exits then) or `stopping` resolves (the process drains: what is relayed from then on waits
/// for the next holder, which takes over once this one has exited).
pub async fn serve_relayed(
    db: Postgres,
    routes: Router,
    stopping: impl std::future::Future<Output = ()> + Send,
) {
    let holder = Holder::new(db);
    let replica = holder.replica().clone();
    let mut heard = replica.hear(vec![replica.channels().relayed.clone()]);
    let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut pruned = Instant::now();
    tokio::pin!(stopping);
    loop {
        let free = slots.available_permits().min(BATCH);
        let mut full = false;
        if free > 0 {
            match holder.claim(free as i64).await {
                Ok(claimed) => {
                    full = claimed.len() == free;
                    for (id, r) in claimed {
                        let Ok(slot) = slots.clone().try_acquire_owned() else {
                            break;
                        };
                        let (routes, replica, holder) =
                            (routes.clone(), replica.clone(), holder.pid());
                        tokio::spawn(async move {
                            let a = answer(routes, r).await;
                            if let Err(e) = replica.answer(id, holder, &a).await {
                                tracing::warn!(error = %crate::report::report(&e), "the answer to a relayed request could not be written; its replica answers 503 within a minute");
                            }
                            drop(slot);
                        });
                    }
                }
                Err(crate::store::StoreError::DatabaseLost { .. }) => return,
                Err(e) => {
                    tracing::warn!(error = %crate::report::report(&e), "relayed requests could not be claimed");
                }
            }
        }
        if pruned.elapsed() > RECHECK * 60 {
            pruned = Instant::now();
            let _ = replica.prune(KEEP).await;
            if let Ok(usage) = replica.notification_queue_usage().await {
                if usage > 0.1 {
                    tracing::error!(usage, "PostgreSQL's notification queue is filling: a listening session stopped reading (a replica frozen with its session open?); once full, every change of a submission fails. End that session (pg_terminate_backend) or let its process run");
                }
            }
        }
        if full {
            // More may wait: claim again at once.
            continue;
        }
        // Woken by a notification, or after a second whatever happened to them.
        tokio::select! {
            () = &mut stopping => return,
            h = tokio::time::timeout(RECHECK, heard.recv()) => {
                if let Ok(Some(_)) = h {
                    // Whatever else arrived meanwhile is claimed by the same pass.
                    while heard.try_recv().is_ok() {}
                }
            }
        }
    }
}

/// Runs relayed request `r` through `routes`.
async fn answer(routes: Router, r: Relayed) -> Answer {
    let mut req = Request::new(Body::from(r.body));
    *req.method_mut() = r.method.parse().unwrap_or(axum::http::Method::GET);
    *req.uri_mut() = r.uri.parse().unwrap_or_default();
    for (k, v) in r.headers {
        if let (Ok(k), Ok(v)) = (HeaderName::try_from(k), HeaderValue::try_from(v)) {
            req.headers_mut().append(k, v);
        }
    }
    if let Ok(peer) = r.peer.parse::<std::net::SocketAddr>() {
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(peer));
    }
    // The receiving replica checked the client (or the webhook's signature).
    req.extensions_mut().insert(crate::http::Vouched);
    let Ok(resp) = routes.clone().call(req).await;
    let status = resp.status().as_u16();
    let headers = text_headers(resp.headers());
    match axum::body::to_bytes(resp.into_body(), usize::MAX).await {
        Ok(body) => Answer {
            status,
            headers,
            body: body.to_vec(),
        },
        Err(e) => {
            tracing::warn!(error = %e, "the answer to a relayed request could not be read");
            Answer {
                status: 500,
                headers: vec![("content-type".into(), "application/json".into())],
                body: br#"{"error":"the answer could not be read; retry"}"#.to_vec(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_relayed_request_carries_its_own_headers_not_its_connections_nor_credentials() {
        let mut h = axum::http::HeaderMap::new();
        h.insert(
            "authorization",
            HeaderValue::from_static("Bearer kk-secret"),
        );
        h.insert("x-buildkite-token", HeaderValue::from_static("bk-secret"));
        h.insert(
            "x-buildkite-signature",
            HeaderValue::from_static("timestamp=1,signature=ab"),
        );
        h.insert("cookie", HeaderValue::from_static("s=1"));
        h.insert("content-type", HeaderValue::from_static("application/json"));
        h.insert("idempotency-key", HeaderValue::from_static("k-1"));
        h.insert("connection", HeaderValue::from_static("keep-alive"));
        h.insert("content-length", HeaderValue::from_static("12"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("x-binary", HeaderValue::from_bytes(b"\xff\xfe").unwrap());
        let mut got = text_headers(&h);
        got.sort();
        assert_eq!(
            got,
            [
                ("content-type".to_string(), "application/json".to_string()),
                ("idempotency-key".to_string(), "k-1".to_string()),
            ]
        );
    }

    #[tokio::test]
    async fn an_answer_is_given_back_as_it_was_given() {
        let r = response(Answer {
            status: 429,
            headers: vec![
                ("retry-after".into(), "7".into()),
                ("content-type".into(), "application/json".into()),
                ("bad name".into(), "dropped".into()),
            ],
            body: br#"{"error":"over quota"}"#.to_vec(),
        });
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["retry-after"], "7");
        assert_eq!(r.headers().len(), 2);
        let body = axum::body::to_bytes(r.into_body(), 1 << 10).await.unwrap();
        assert_eq!(&body[..], br#"{"error":"over quota"}"#);
        let odd = response(Answer {
            status: 1000,
            headers: vec![],
            body: vec![],
        });
        assert_eq!(
            odd.status(),
            500,
            "a status that is none is an error, not a panic"
        );
    }

    /// The relayed request reaches the core's routes with the receiving replica's verdict: a
    /// route guarded as `/v1` is, without any credential in the request.
    #[tokio::test]
    async fn a_relayed_request_reaches_the_routes_as_it_was_received() {
        use axum::routing::post;
        let routes = Router::new().route(
            "/v1/echo",
            post(
                |axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<
                    std::net::SocketAddr,
                >,
                 axum::Extension(crate::http::Vouched): axum::Extension<crate::http::Vouched>,
                 headers: axum::http::HeaderMap,
                 uri: axum::http::Uri,
                 body: String| async move {
                    (
                        StatusCode::ACCEPTED,
                        [("x-peer", peer.to_string())],
                        format!(
                            "{} {} {}",
                            uri,
                            headers["idempotency-key"].to_str().unwrap(),
                            body
                        ),
                    )
                },
            ),
        );
        let a = answer(
            routes,
            Relayed {
                method: "POST".into(),
                uri: "/v1/echo?wait=1".into(),
                headers: vec![("idempotency-key".into(), "k-9".into())],
                peer: "127.0.0.1:4242".into(),
                body: b"hello".to_vec(),
            },
        )
        .await;
        assert_eq!(a.status, 202);
        assert_eq!(a.body, b"/v1/echo?wait=1 k-9 hello");
        assert!(a
            .headers
            .contains(&("x-peer".to_string(), "127.0.0.1:4242".to_string())));
    }
}
