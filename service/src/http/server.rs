//! Serving connections: the accept loop, the connection cap, the per-connection timeouts and
//! graceful shutdown, on hyper's HTTP/1 server with the axum router as the service.
//!
//! Why not `axum::serve`: it has no header or idle timeout, no connection cap, and on
//! `EMFILE` it sleeps a second per failed accept while every idle connection keeps its file,
//! so a few thousand idle or slow-header connections stop the service answering anyone.
//!
//! Each connection has a `Slot`: how many requests it has in the router, since when it has
//! been idle, and when the first byte of the request head now arriving came. One watchdog per
//! connection reads it and closes the connection when a head takes longer than
//! KERNELKITE_HEADER_READ_TIMEOUT_S (the first head: counted from the accept), or when it sat
//! idle between requests longer than KERNELKITE_IDLE_TIMEOUT_S. A request in the router is
//! never timed out here (long-polls and event streams are long responses, not idle
//! connections); the handlers bound their own body reads.
//!
//! Over the cap, the connection that has been idle the longest (or is only feeding an
//! unauthenticated body) is closed to make room: idle connections cost an attacker nothing,
//! so they must not be able to crowd out a request. When every connection is busy with real
//! work, a few more are accepted into a reserve that answers only the operational routes
//! (`/healthz`, `/readyz`, `/metrics`) and Buildkite's webhooks, and `503` for the rest; past
//! the reserve a connection is answered a fixed `503` and closed. The cap sits well under
//! RLIMIT_NOFILE, so `accept` itself never runs out of files.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, HttpBody};
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response};
use axum::response::IntoResponse as _;
use axum::Router;
use bytes::Bytes;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tower_service::Service as _;
use tracing::Instrument as _;

use super::edge::{Edge, Phase};
use crate::app::App;
use crate::metrics::Metrics;
use crate::metrics::Refusal;

/// Connections over the cap that are still served, for the operational routes only.
pub const OPS_RESERVE: usize = 16;
/// Connections answered the fixed `503` at once; past this they are closed unanswered.
const REFUSING_MAX: usize = 16;
/// Connections closed to make room whose tasks have not ended yet; past this, no more are
/// closed and new connections go to the reserve.
const EVICTING_MAX: usize = 32;
/// A connection idle for less than this, nothing of a request read, is closed to make room
/// only when no other will do (see `Slot::eviction_rank`).
const SETTLING_MS: u64 = 1000;
/// Largest request head, bytes; also the most a connection's read buffer grows to.
pub const MAX_HEAD_BYTES: usize = 32 * 1024;
/// The automatic cap's upper bound (each connection costs some memory as well as a file).
pub const AUTO_CAP_MAX: usize = 8192;
/// Files kept out of the automatic cap: the store, Buildkite and callback connections, the
/// reserve and the refusals. An eighth of the limit, at least this.
pub const FD_RESERVE_MIN: usize = 192;

/// The fixed answer of a connection past the cap and the reserve: the JSON error of
/// [`crate::error::Unavailable::Connections`], written without reading the request.
fn over_cap_answer() -> Vec<u8> {
    let body = serde_json::json!({
        "error": crate::report::report(&crate::Error::from(crate::error::Unavailable::Connections))
    })
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Raises the soft open-files limit to the hard one, so the connection cap can be as high as
/// the system allows (systemd gives services a soft limit of 1024 and a much higher hard
/// limit). Returns the soft limit before and after; `None` is unlimited.
pub fn raise_open_files_limit() -> io::Result<(Option<u64>, Option<u64>)> {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let before = getrlimit(Resource::Nofile);
    if before.current == before.maximum {
        return Ok((before.current, before.current));
    }
    setrlimit(
        Resource::Nofile,
        rustix::process::Rlimit {
            current: before.maximum,
            maximum: before.maximum,
        },
    )?;
    Ok((before.current, getrlimit(Resource::Nofile).current))
}

/// The soft open-files limit now (`None`: unlimited).
pub fn open_files_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// The connection cap for `configured` (KERNELKITE_MAX_CONNECTIONS, 0: automatic) under the
/// open-files limit `nofile`: the limit less its reserve, at most [`AUTO_CAP_MAX`] when
/// automatic; a configured cap above that room is lowered to it. Returns the cap and whether
/// a configured value was lowered.
pub fn connection_cap(configured: usize, nofile: Option<u64>) -> (usize, bool) {
    let nofile = nofile.map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX));
    let reserve = (nofile / 8).max(FD_RESERVE_MIN);
    // A limit too small for the reserve still serves a few connections.
    let room = nofile.saturating_sub(reserve).max(nofile / 2).max(1);
    match configured {
        0 => (room.min(AUTO_CAP_MAX), false),
        n if n > room => (room, true),
        n => (n, false),
    }
}

/// Milliseconds on the edge's clock; never 0, which the slots use for "not set".
fn now_ms(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64 + 1
}

/// One connection's state, shared by its task, its IO, its requests and the cap.
pub(crate) struct Slot {
    epoch: Instant,
    /// Requests of this connection in the router (with HTTP/1, 0 or 1).
    inflight: AtomicU32,
    /// Of those, requests only reading a body nobody has authenticated yet.
    unauthenticated: AtomicU32,
    /// Requests answered so far.
    served: AtomicU64,
    /// When the connection last became idle (accepted, or its last response ended).
    idle_since: AtomicU64,
    /// When the first byte of the head now arriving came, while idle; 0: none yet.
    head_started: AtomicU64,
    /// Bytes read while idle: the head now arriving (see [`Watched`]).
    head_bytes: AtomicUsize,
    /// Since when the socket has refused every byte written (its buffers full: the client
    /// is not reading); 0: writes are going through.
    write_blocked_since: AtomicU64,
    /// Chosen to make room: close it unless it got busy meanwhile.
    evicted: AtomicBool,
    kill: tokio::sync::Notify,
}

impl Slot {
    fn new(epoch: Instant) -> Slot {
        Slot {
            epoch,
            inflight: AtomicU32::new(0),
            unauthenticated: AtomicU32::new(0),
            served: AtomicU64::new(0),
            idle_since: AtomicU64::new(now_ms(epoch)),
            head_started: AtomicU64::new(0),
            head_bytes: AtomicUsize::new(0),
            write_blocked_since: AtomicU64::new(0),
            evicted: AtomicBool::new(false),
            kill: tokio::sync::Notify::new(),
        }
    }

    /// No request, or only requests reading unauthenticated bodies: closing it loses nothing
    /// anybody proved a right to.
    fn evictable(&self) -> bool {
        self.inflight.load(Ordering::Acquire) == self.unauthenticated.load(Ordering::Acquire)
    }

    fn idle(&self) -> bool {
        self.inflight.load(Ordering::Acquire) == 0
    }

    /// Which evictable connection to close first (lowest first), at `now` on the edge's
    /// clock: a head arriving too slowly, then the longest idle, then unauthenticated body
    /// readers (they may yet be real), and last the connections idle for less than
    /// [`SETTLING_MS`] with nothing read: on a loaded machine the accept loop runs ahead of
    /// the connection tasks, and a request already in the socket's buffer looks idle until
    /// its task reads it. Ties: idle the longest first.
    fn eviction_rank(&self, now: u64) -> (u8, u64) {
        let since = self.idle_since.load(Ordering::Relaxed);
        let rank = if !self.idle() {
            2
        } else if self.head_started.load(Ordering::Relaxed) != 0 {
            0
        } else if now.saturating_sub(since) < SETTLING_MS {
            3
        } else {
            1
        };
        (rank, since)
    }

    /// Bytes arrived while no request was in the router: a head is starting.
    fn on_read(&self) {
        if self.head_started.load(Ordering::Relaxed) == 0 && self.idle() {
            self.head_started
                .store(now_ms(self.epoch), Ordering::Relaxed);
        }
    }
}

/// Marks a request as only reading an unauthenticated body until dropped: the connection
/// may then be closed to make room, like an idle one.
pub(crate) struct Unauthenticated(Option<Arc<Slot>>);

impl Drop for Unauthenticated {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            s.unauthenticated.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The connection a request came on (a request extension).
#[derive(Clone)]
pub(crate) struct ConnSlot(Arc<Slot>);

impl ConnSlot {
    /// See [`Unauthenticated`].
    pub(crate) fn unauthenticated(&self) -> Unauthenticated {
        self.0.unauthenticated.fetch_add(1, Ordering::AcqRel);
        Unauthenticated(Some(self.0.clone()))
    }
}

/// [`ConnSlot::unauthenticated`] for a request that may have no connection (the router
/// called in process).
pub(crate) fn unauthenticated(slot: Option<&ConnSlot>) -> Unauthenticated {
    slot.map_or(Unauthenticated(None), ConnSlot::unauthenticated)
}

/// A request in the router, until its response body is dropped (sent, or the connection
/// ended).
struct Busy(Arc<Slot>);

impl Busy {
    fn enter(slot: &Arc<Slot>) -> Busy {
        slot.inflight.fetch_add(1, Ordering::AcqRel);
        slot.head_started.store(0, Ordering::Relaxed);
        slot.head_bytes.store(0, Ordering::Relaxed);
        Busy(slot.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let s = &self.0;
        s.served.fetch_add(1, Ordering::Relaxed);
        s.idle_since.store(now_ms(s.epoch), Ordering::Relaxed);
        s.head_started.store(0, Ordering::Relaxed);
        s.head_bytes.store(0, Ordering::Relaxed);
        s.inflight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The socket, noting when a head starts to arrive and how writes go.
///
/// While a head arrives, at most [`MAX_HEAD_BYTES`] of it are read: hyper refuses a head
/// (`431`) only once its buffer holds `max_buf_size` bytes without a complete head, and its
/// reads grow (8, 16, 32 KiB...), so a head of up to about twice the limit that arrived in
/// one read used to parse. Handing it no more than the limit makes "over 32 KiB gets 431"
/// exact. (Bytes of a pipelined head read together with the previous request are not
/// counted.)
struct Watched {
    stream: TcpStream,
    slot: Arc<Slot>,
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.slot.idle() {
            return Pin::new(&mut this.stream).poll_read(cx, buf);
        }
        // At least one byte: a read of none would be taken for the end of the stream.
        let room = MAX_HEAD_BYTES
            .saturating_sub(this.slot.head_bytes.load(Ordering::Relaxed))
            .max(1);
        let n = if buf.remaining() > room {
            // Initialised first, so the bytes the smaller buffer fills count as filled here
            // without `unsafe`.
            buf.initialize_unfilled_to(room);
            let mut part = buf.take(room);
            ready!(Pin::new(&mut this.stream).poll_read(cx, &mut part))?;
            let n = part.filled().len();
            buf.advance(n);
            n
        } else {
            let before = buf.filled().len();
            ready!(Pin::new(&mut this.stream).poll_read(cx, buf))?;
            buf.filled().len() - before
        };
        if n > 0 {
            this.slot.head_bytes.fetch_add(n, Ordering::Relaxed);
            this.slot.on_read();
        }
        Poll::Ready(Ok(()))
    }
}

impl Slot {
    /// Notes how a write went: `Pending` starts the stall clock (if not running), progress
    /// stops it.
    fn on_write(&self, r: &Poll<io::Result<usize>>) {
        match r {
            Poll::Pending => {
                if self.write_blocked_since.load(Ordering::Relaxed) == 0 {
                    self.write_blocked_since
                        .store(now_ms(self.epoch), Ordering::Relaxed);
                }
            }
            Poll::Ready(Ok(n)) if *n > 0 => {
                self.write_blocked_since.store(0, Ordering::Relaxed);
            }
            Poll::Ready(_) => {}
        }
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.slot.on_write(&r);
        r
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.slot.on_write(&r);
        r
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// A response body that keeps its request counted as in flight until it is dropped.
pub(crate) struct TrackedBody {
    inner: Body,
    _busy: Option<Busy>,
}

impl HttpBody for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The request id a client sent (`X-Request-Id`, when short and plain) or a fresh one; it is
/// in every log line of the request and echoed in the response.
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

fn request_id(given: Option<&HeaderValue>) -> String {
    given
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
        })
        .map_or_else(|| format!("{:016x}", fastrand::u64(..)), str::to_string)
}

/// The router as one connection's hyper service: tags each request with the peer, the
/// connection and a request id, and counts it in flight until its response body is done.
#[derive(Clone)]
struct ConnService {
    router: Router,
    peer: SocketAddr,
    slot: Arc<Slot>,
    /// Over the cap: only the operational routes are served.
    ops_only: bool,
    edge: Arc<Edge>,
}

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<TrackedBody>, Infallible>> + Send>>;

    fn call(&self, mut req: Request<Incoming>) -> Self::Future {
        let busy = Busy::enter(&self.slot);
        let id = request_id(req.headers().get("x-request-id"));
        if self.ops_only && !is_ops_route(req.uri().path()) {
            self.edge.refused(
                Refusal::ConnectionCap,
                Some(self.peer),
                "every connection is busy; answered 503 on a reserve connection",
            );
            let mut r = super::error::ApiError::from(crate::error::Unavailable::Connections)
                .into_response();
            set_request_id(&mut r, &id);
            return Box::pin(std::future::ready(Ok(r.map(|inner| TrackedBody {
                inner,
                _busy: Some(busy),
            }))));
        }
        let (method, uri) = (req.method().clone(), req.uri().clone());
        let peer = self.peer;
        req.extensions_mut().insert(ConnectInfo(peer));
        req.extensions_mut().insert(ConnSlot(self.slot.clone()));
        req.extensions_mut().insert(RequestId(id.clone()));
        let span = tracing::info_span!("request", %peer, request_id = %id);
        let mut router = self.router.clone();
        Box::pin(
            async move {
                let started = Instant::now();
                let Ok(mut r) = router.call(req).await;
                tracing::debug!(%method, path = uri.path(), status = r.status().as_u16(), ms = started.elapsed().as_secs_f64() * 1e3, "answered");
                set_request_id(&mut r, &id);
                Ok(r.map(|inner| TrackedBody {
                    inner,
                    _busy: Some(busy),
                }))
            }
            .instrument(span),
        )
    }
}

fn set_request_id<B>(r: &mut Response<B>, id: &str) {
    if let Ok(v) = HeaderValue::from_str(id) {
        r.headers_mut().insert("x-request-id", v);
    }
}

/// The routes a reserve connection serves: the ones an orchestrator probes.
fn is_ops_route(path: &str) -> bool {
    // Buildkite's webhooks too: they end submissions, and a client that fills the cap with
    // its own long requests must not keep them out.
    matches!(
        path,
        "/healthz" | "/readyz" | "/metrics" | "/webhooks/buildkite"
    )
}

/// Why a connection's watchdog closed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expired {
    /// A request head took too long.
    Header,
    /// Idle between requests too long.
    Idle,
    /// The client took no byte of the response for too long.
    WriteStall,
}

/// Resolves when the connection has overstayed: a head arriving for longer than `header`
/// (the first head counted from the accept), idle for longer than `idle`, or its writes
/// refused for longer than `stall` (idle or busy: a response hyper is still flushing after
/// its request ended counts too). Sleeps until the nearest deadline and looks again, so a
/// busy connection costs one timer per the shortest of the three; a stall is noticed within
/// twice `stall`.
async fn watchdog(slot: &Slot, header: Duration, idle: Duration, stall: Duration) -> Expired {
    let (header_ms, idle_ms) = (header.as_millis() as u64, idle.as_millis() as u64);
    let stall_ms = stall.as_millis() as u64;
    loop {
        let now = now_ms(slot.epoch);
        let blocked = slot.write_blocked_since.load(Ordering::Relaxed);
        if blocked != 0 && now >= blocked + stall_ms {
            return Expired::WriteStall;
        }
        let stall_wait = if blocked != 0 {
            blocked + stall_ms - now
        } else {
            stall_ms
        };
        let wait = if !slot.idle() {
            // Looked at again within the idle and header timeouts too: when the request ends,
            // the connection turns idle and its idle deadline counts from then.
            stall_wait.min(idle_ms.min(header_ms))
        } else {
            let head = slot.head_started.load(Ordering::Relaxed);
            let since = slot.idle_since.load(Ordering::Relaxed);
            let (deadline, why) = if head != 0 {
                (head + header_ms, Expired::Header)
            } else if slot.served.load(Ordering::Relaxed) == 0 {
                (since + header_ms, Expired::Header)
            } else {
                (since + idle_ms, Expired::Idle)
            };
            if now >= deadline {
                return why;
            }
            (deadline - now).min(stall_wait)
        };
        tokio::time::sleep(Duration::from_millis(wait.max(1))).await;
    }
}

/// The open connections, for the cap and for shutdown.
struct Conns {
    slots: Mutex<std::collections::HashMap<u64, Arc<Slot>>>,
    next: AtomicU64,
    /// Connections in the reserve (over the cap, operational routes only).
    reserve: AtomicUsize,
    /// Connections being answered the fixed 503.
    refusing: AtomicUsize,
    /// Connections chosen to make room whose task has not ended.
    evicting: AtomicUsize,
    /// Notified whenever a connection ends.
    ended: tokio::sync::Notify,
    /// The edge's clock, which the slots' times count from.
    epoch: Instant,
}

impl Conns {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, Arc<Slot>>> {
        // A panic while holding this lock leaves a plain map behind: keep using it.
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn open(&self) -> usize {
        self.lock().len() + self.reserve.load(Ordering::Relaxed)
    }

    /// Chooses the connection that has been idle (or only reading an unauthenticated body)
    /// the longest and tells it to close. Returns whether one was found.
    fn evict_one(&self) -> bool {
        if self.evicting.load(Ordering::Relaxed) >= EVICTING_MAX {
            return false;
        }
        let now = now_ms(self.epoch);
        let victim = {
            let slots = self.lock();
            slots
                .values()
                .filter(|s| !s.evicted.load(Ordering::Relaxed) && s.evictable())
                .min_by_key(|s| s.eviction_rank(now))
                .cloned()
        };
        match victim {
            Some(s) => {
                s.evicted.store(true, Ordering::Relaxed);
                self.evicting.fetch_add(1, Ordering::Relaxed);
                s.kill.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Closes an idle connection to make room. When many were just chosen and have not closed
/// yet (a burst of new connections outpaces their tasks), waits a moment for them first.
async fn make_room(conns: &Conns) -> bool {
    if conns.evict_one() {
        return true;
    }
    if conns.evicting.load(Ordering::Relaxed) < EVICTING_MAX {
        return false; // nothing evictable: every connection is busy
    }
    let _ = tokio::time::timeout(Duration::from_millis(20), conns.ended.notified()).await;
    conns.evict_one()
}

/// Settings of the connection layer.
#[derive(Clone, Copy, Debug)]
struct Limits {
    header: Duration,
    idle: Duration,
    cap: usize,
    grace: Duration,
    stall: Duration,
}

/// What a server counts into, and the core whose result fetches its drain waits for: set
/// once the process serves one (a replica's is set when it takes the schema's lock, see
/// [`crate::replica`]).
#[derive(Clone)]
pub(crate) struct Served {
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) app: Arc<std::sync::OnceLock<Arc<App>>>,
}

impl Served {
    /// A server of `app`.
    pub(crate) fn by(app: Arc<App>) -> Served {
        let metrics = app.metrics().clone();
        let cell = std::sync::OnceLock::new();
        let _ = cell.set(app);
        Served {
            metrics,
            app: Arc::new(cell),
        }
    }
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains: stops listening,
/// answers long-polls and ends event streams (both resumable), lets requests in flight finish
/// for up to KERNELKITE_SHUTDOWN_GRACE_S, and returns. Dropping the future stops every
/// connection at once.
pub(crate) async fn run(
    app: Served,
    edge: Arc<Edge>,
    router: Router,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let limits = limits(&app.metrics, &edge);
    let conns = Arc::new(Conns {
        slots: Mutex::new(std::collections::HashMap::new()),
        next: AtomicU64::new(1),
        reserve: AtomicUsize::new(0),
        refusing: AtomicUsize::new(0),
        evicting: AtomicUsize::new(0),
        ended: tokio::sync::Notify::new(),
        epoch: Instant::now(),
    });
    // Dropping `run` (a test aborting its server) stops every connection task too.
    let _stop = StopOnDrop(edge.clone());
    let mut normal = hyper::server::conn::http1::Builder::new();
    // The watchdog enforces the header and idle timeouts; hyper's own would need a timer per
    // request.
    normal.header_read_timeout(None);
    // Bounds a request head (and the read buffer): hyper's default, 400 KiB, times the cap
    // would let slow headers alone hold gigabytes. Larger heads are answered 431.
    normal.max_buf_size(MAX_HEAD_BYTES);
    let mut reserve = normal.clone();
    reserve.keep_alive(false);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    accept_failed(&edge, e).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let mut ops_only = false;
        if conns.open() >= limits.cap && !make_room(&conns).await {
            if conns.reserve.load(Ordering::Relaxed) < OPS_RESERVE {
                ops_only = true;
            } else {
                edge.refused(
                    Refusal::ConnectionCap,
                    Some(peer),
                    "every connection is busy and the reserve is full; answered 503",
                );
                refuse(&conns, stream);
                continue;
            }
        }
        let builder = if ops_only { &reserve } else { &normal };
        let conn = Accepted {
            stream,
            peer,
            ops_only,
        };
        spawn_connection(&app, &edge, &router, &conns, builder, limits, conn);
    }

    drop(listener);
    drain(&app, &edge, &conns, limits).await;
    Ok(())
}

/// Draining: no new connections (the listening socket is closed, so clients are refused and
/// go elsewhere), long-polls and streams answer, idle connections close; then what is left of
/// the grace period for connections and result fetches to finish.
async fn drain(app: &Served, edge: &Edge, conns: &Conns, limits: Limits) {
    let open = conns.open();
    tracing::info!(
        open_connections = open,
        grace_s = limits.grace.as_secs(),
        "stopped listening; draining"
    );
    edge.set_phase(Phase::Draining);
    let deadline = tokio::time::Instant::now() + limits.grace;
    loop {
        let ended = conns.ended.notified();
        if conns.open() == 0 {
            break;
        }
        if tokio::time::timeout_at(deadline, ended).await.is_err() {
            tracing::warn!(
                open_connections = conns.open(),
                "shutdown grace period over; closing the remaining connections"
            );
            break;
        }
    }
    // In-flight result fetches write what clients will read: give them what is left of the
    // grace period too.
    let Some(app) = app.app.get() else {
        return;
    };
    let slots = app.cfg().fetch_concurrency.min(u32::MAX as usize) as u32;
    if tokio::time::timeout_at(deadline, app.fetch_slots().acquire_many(slots))
        .await
        .is_err()
    {
        tracing::warn!("shutdown grace period over with result fetches still running");
    }
}

/// The connection layer's settings, from the edge's configuration and the open-files limit
/// (which may lower the connection cap); logged, and the cap exported.
fn limits(metrics: &Metrics, edge: &Edge) -> Limits {
    let cfg = &edge.cfg.edge;
    let nofile = open_files_limit();
    let (cap, lowered) = connection_cap(cfg.max_connections, nofile);
    if lowered {
        tracing::warn!(
            configured = cfg.max_connections,
            cap,
            open_files_limit = ?nofile,
            "KERNELKITE_MAX_CONNECTIONS is above what the open-files limit leaves room for; using the lower cap (raise LimitNOFILE= or `ulimit -n`)"
        );
    }
    metrics.connection_cap.set(cap as i64);
    let limits = Limits {
        header: cfg.header_read_timeout(),
        idle: cfg.idle_timeout(),
        cap,
        grace: cfg.shutdown_grace(),
        stall: cfg.write_stall(),
    };
    tracing::info!(
        cap,
        open_files_limit = ?nofile,
        header_read_timeout_s = limits.header.as_secs(),
        idle_timeout_s = limits.idle.as_secs(),
        write_stall_s = limits.stall.as_secs(),
        "accepting connections"
    );
    limits
}

/// A connection just accepted, and whether it is one of the reserve's (operational routes
/// only, no keep-alive).
struct Accepted {
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    ops_only: bool,
}

/// Registers an accepted connection and serves it in a task of its own.
fn spawn_connection(
    app: &Served,
    edge: &Arc<Edge>,
    router: &Router,
    conns: &Arc<Conns>,
    builder: &hyper::server::conn::http1::Builder,
    limits: Limits,
    accepted: Accepted,
) {
    let Accepted {
        stream,
        peer,
        ops_only,
    } = accepted;
    let slot = Arc::new(Slot::new(conns.epoch));
    let id = conns.next.fetch_add(1, Ordering::Relaxed);
    if ops_only {
        conns.reserve.fetch_add(1, Ordering::Relaxed);
    } else {
        conns.lock().insert(id, slot.clone());
    }
    app.metrics.connections.inc();
    let service = ConnService {
        router: router.clone(),
        peer,
        slot: slot.clone(),
        ops_only,
        edge: edge.clone(),
    };
    let conn = builder.serve_connection(
        TokioIo::new(Watched {
            stream,
            slot: slot.clone(),
        }),
        service,
    );
    let ended = Ended {
        conns: conns.clone(),
        metrics: app.metrics.clone(),
        slot,
        id,
        ops_only,
    };
    let edge = edge.clone();
    tokio::spawn(async move {
        drive(
            conn,
            &ended.slot,
            &ended.conns.evicting,
            &edge,
            limits,
            peer,
        )
        .await;
    });
}

/// Serves one connection until it ends, its watchdog fires, it is chosen to make room, or
/// shutdown ends it.
async fn drive<S>(
    conn: hyper::server::conn::http1::Connection<TokioIo<Watched>, S>,
    slot: &Slot,
    evicting: &AtomicUsize,
    edge: &Edge,
    limits: Limits,
    peer: SocketAddr,
) where
    S: hyper::service::HttpService<Incoming, ResBody = TrackedBody>,
{
    tokio::pin!(conn);
    let mut phase = edge.phase_receiver();
    let mut graceful = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                }
                return;
            }
            _ = slot.kill.notified() => {
                if slot.evictable() {
                    edge.refused(
                        Refusal::Evicted,
                        Some(peer),
                        "connection cap reached; closed the longest-idle connection to make room",
                    );
                    return;
                }
                // It got busy with real work since it was chosen: keep it, and let it be
                // chosen again once idle.
                if slot.evicted.swap(false, Ordering::Relaxed) {
                    evicting.fetch_sub(1, Ordering::Relaxed);
                }
            }
            expired = watchdog(slot, limits.header, limits.idle, limits.stall) => {
                match expired {
                    Expired::Header => edge.refused(
                        Refusal::Timeout,
                        Some(peer),
                        "request head not received within KERNELKITE_HEADER_READ_TIMEOUT_S; closed the connection",
                    ),
                    Expired::WriteStall => edge.refused(
                        Refusal::WriteStall,
                        Some(peer),
                        "the client took no byte of its response within KERNELKITE_WRITE_STALL_S; closed the connection",
                    ),
                    Expired::Idle => {}
                }
                return;
            }
            r = phase.changed() => {
                // The sender lives as long as the edge: an error cannot happen while serving.
                let now = if r.is_ok() { *phase.borrow_and_update() } else { Phase::Stopped };
                match now {
                    Phase::Serving => {}
                    Phase::Draining if !graceful => {
                        graceful = true;
                        if slot.idle() {
                            return;
                        }
                        // Finish the request in flight (long-polls and streams end
                        // themselves), then close.
                        conn.as_mut().graceful_shutdown();
                    }
                    Phase::Draining => {}
                    Phase::Stopped => return,
                }
            }
        }
    }
}

/// Takes a connection off the books when its task ends, however it ends (a panic in a
/// handler included): a slot left behind would count against the cap for good.
struct Ended {
    conns: Arc<Conns>,
    metrics: Arc<Metrics>,
    slot: Arc<Slot>,
    id: u64,
    ops_only: bool,
}

impl Drop for Ended {
    fn drop(&mut self) {
        let c = &self.conns;
        if self.ops_only {
            c.reserve.fetch_sub(1, Ordering::Relaxed);
        } else {
            c.lock().remove(&self.id);
        }
        if self.slot.evicted.load(Ordering::Relaxed) {
            c.evicting.fetch_sub(1, Ordering::Relaxed);
        }
        self.metrics.connections.dec();
        c.ended.notify_waiters();
    }
}

/// Sends the phase `Stopped` when dropped, ending every connection task.
struct StopOnDrop(Arc<Edge>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.set_phase(Phase::Stopped);
    }
}

/// Answers a connection past the cap and the reserve with the fixed 503 and closes it. The
/// request is drained a moment after the answer: closing a socket with unread bytes resets
/// it, and the client might never read the answer.
fn refuse(conns: &Arc<Conns>, mut stream: TcpStream) {
    if conns.refusing.fetch_add(1, Ordering::Relaxed) >= REFUSING_MAX {
        conns.refusing.fetch_sub(1, Ordering::Relaxed);
        return; // dropped: closed unanswered
    }
    let conns = conns.clone();
    tokio::spawn(async move {
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            stream.write_all(&over_cap_answer()).await?;
            stream.shutdown().await?;
            let mut sink = [0u8; 4096];
            let mut left = 64 * 1024usize;
            while left > 0 {
                let n = stream.read(&mut sink).await?;
                if n == 0 {
                    break;
                }
                left = left.saturating_sub(n);
            }
            io::Result::Ok(())
        })
        .await;
        conns.refusing.fetch_sub(1, Ordering::Relaxed);
    });
}

/// An `accept` that failed. Per-connection errors (the client gave up) are skipped; running
/// out of files or memory waits a moment (the cap should prevent it; something else in the
/// process may hold files) instead of spinning.
async fn accept_failed(edge: &Edge, e: io::Error) {
    if matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
    ) {
        return;
    }
    if let Some(suppressed) = edge.log.allow("accept error") {
        tracing::error!(error = %e, suppressed, "accept failed; retrying in 50 ms");
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fixed_503_is_json_with_the_right_length() {
        let answer = String::from_utf8(over_cap_answer()).unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 503 "), "{head}");
        assert!(
            head.contains(&format!("content-length: {}\r\n", body.len())),
            "{head}"
        );
        assert!(head.contains("retry-after: 1"), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert!(v["error"].as_str().unwrap().contains("connection"), "{v}");
    }

    #[test]
    fn slow_heads_go_first_and_connections_just_accepted_last() {
        let epoch = Instant::now();
        let at = |idle_since: u64| {
            let s = Slot::new(epoch);
            s.idle_since.store(idle_since, Ordering::Relaxed);
            s
        };
        let now = 10_000;
        let slow_head = at(9_900);
        slow_head.head_started.store(9_950, Ordering::Relaxed);
        let idle_long = at(2_000);
        let idle = at(5_000);
        let unauthenticated = at(1_000);
        unauthenticated.inflight.store(1, Ordering::Relaxed);
        unauthenticated.unauthenticated.store(1, Ordering::Relaxed);
        let just_accepted = at(9_990);
        let mut order = [
            ("just accepted", &just_accepted),
            ("unauthenticated", &unauthenticated),
            ("idle", &idle),
            ("slow head", &slow_head),
            ("idle long", &idle_long),
        ];
        order.sort_by_key(|(_, s)| s.eviction_rank(now));
        let names: Vec<&str> = order.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            [
                "slow head",
                "idle long",
                "idle",
                "unauthenticated",
                "just accepted"
            ]
        );
        // Settled: an ordinary idle connection.
        assert_eq!(
            just_accepted.eviction_rank(9_990 + SETTLING_MS).0,
            idle.eviction_rank(now).0
        );
    }

    #[test]
    fn the_cap_leaves_room_under_the_open_files_limit() {
        // systemd's default soft limit: 192 files kept back.
        assert_eq!(connection_cap(0, Some(1024)), (832, false));
        assert_eq!(connection_cap(0, Some(524_288)), (AUTO_CAP_MAX, false));
        assert_eq!(connection_cap(0, None), (AUTO_CAP_MAX, false));
        assert_eq!(connection_cap(100, Some(1024)), (100, false));
        assert_eq!(connection_cap(5000, Some(1024)), (832, true));
        // Tiny limits still serve something.
        assert_eq!(connection_cap(0, Some(200)), (100, false));
        assert_eq!(connection_cap(0, Some(1)), (1, false));
    }

    #[test]
    fn request_ids_are_taken_only_when_plain() {
        let given = |v: &str| request_id(Some(&HeaderValue::from_str(v).unwrap()));
        assert_eq!(given("abc-123"), "abc-123");
        for bad in ["a b", "x\"y", &"a".repeat(65), ""] {
            let id = given(bad);
            assert_ne!(id, bad);
            assert_eq!(id.len(), 16, "{id}");
        }
        assert_ne!(request_id(None), request_id(None));
    }

    /// Longer than any wait in the tests that do not stall a write.
    const STALL: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn the_watchdog_times_out_heads_and_idle_connections() {
        let header = Duration::from_millis(50);
        let idle = Duration::from_millis(200);
        let slot = Slot::new(Instant::now());
        // A fresh connection gets the header timeout from its accept.
        let t = Instant::now();
        assert_eq!(watchdog(&slot, header, idle, STALL).await, Expired::Header);
        assert!(t.elapsed() >= header);
        // After a request, idle time is counted against the idle timeout...
        let slot = Arc::new(Slot::new(Instant::now()));
        drop(Busy::enter(&slot));
        let t = Instant::now();
        assert_eq!(watchdog(&slot, header, idle, STALL).await, Expired::Idle);
        assert!(t.elapsed() >= idle - Duration::from_millis(5));
        // ...until a byte of the next head arrives.
        let slot = Arc::new(Slot::new(Instant::now()));
        drop(Busy::enter(&slot));
        slot.on_read();
        let t = Instant::now();
        assert_eq!(watchdog(&slot, header, idle, STALL).await, Expired::Header);
        assert!(t.elapsed() < idle);
        // A request in flight is never timed out while its writes go through.
        let slot = Arc::new(Slot::new(Instant::now()));
        let busy = Busy::enter(&slot);
        assert!(
            tokio::time::timeout(idle * 2, watchdog(&slot, header, idle, STALL))
                .await
                .is_err()
        );
        drop(busy);
    }

    #[tokio::test]
    async fn a_request_that_ends_is_timed_as_idle_from_then_not_after_the_stall_limit() {
        // The watchdog was asleep for the busy connection's whole stall limit (30 s by
        // default) and missed the 2 s idle timeout that began when the answer went out.
        let (header, idle) = (Duration::from_secs(5), Duration::from_millis(200));
        let slot = Arc::new(Slot::new(Instant::now()));
        drop(Busy::enter(&slot)); // served once: the idle timeout applies, not the header's
        let busy = Busy::enter(&slot);
        let ends = {
            let slot = slot.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(50)).await;
                drop(busy);
                drop(slot);
            })
        };
        let t = Instant::now();
        let expired =
            tokio::time::timeout(Duration::from_secs(3), watchdog(&slot, header, idle, STALL))
                .await
                .expect("the idle timeout fired");
        assert_eq!(expired, Expired::Idle);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        ends.await.unwrap();
    }

    #[tokio::test]
    async fn the_watchdog_closes_a_response_the_client_stopped_reading() {
        let (header, idle) = (Duration::from_secs(5), Duration::from_secs(5));
        let stall = Duration::from_millis(100);
        let slot = Arc::new(Slot::new(Instant::now()));
        let _busy = Busy::enter(&slot);
        // A refused write starts the clock; progress stops it, so a slow reader that keeps
        // taking bytes is never closed.
        slot.on_write(&Poll::Pending);
        tokio::time::sleep(stall / 2).await;
        slot.on_write(&Poll::Ready(Ok(10)));
        assert!(
            tokio::time::timeout(stall * 2, watchdog(&slot, header, idle, stall))
                .await
                .is_err(),
            "a response making progress was closed"
        );
        // Refused for `stall`: closed, within twice `stall`.
        slot.on_write(&Poll::Pending);
        let t = Instant::now();
        assert_eq!(
            watchdog(&slot, header, idle, stall).await,
            Expired::WriteStall
        );
        assert!(t.elapsed() >= stall - Duration::from_millis(5));
        assert!(t.elapsed() < stall * 2 + Duration::from_millis(50));
        // A refused `Pending` keeps the first time, not the latest.
        let slot = Arc::new(Slot::new(Instant::now()));
        slot.on_write(&Poll::Pending);
        let first = slot.write_blocked_since.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(5));
        slot.on_write(&Poll::Pending);
        assert_eq!(slot.write_blocked_since.load(Ordering::Relaxed), first);
    }
}
