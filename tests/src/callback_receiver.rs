//! A backend's callback endpoint on loopback: records every delivery (headers and body), and
//! can be taken down (connection refused), answer with a failure or a redirect, or answer
//! slowly, to test the service's callback outbox.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// One delivery as received.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// `Idempotency-Key`.
    pub idempotency_key: Option<String>,
    /// `X-Kernelkite-Signature`.
    pub signature: Option<String>,
    /// The body.
    pub body: Bytes,
    /// When it arrived.
    pub at: Instant,
    /// What it was answered.
    pub status: u16,
}

/// How the receiver answers.
#[derive(Debug, Clone)]
pub enum Mode {
    /// `204`.
    Accept,
    /// This status.
    Status(u16),
    /// `307` to this URL.
    Redirect(String),
    /// `204` after this long.
    Slow(Duration),
}

#[derive(Clone)]
struct Shared {
    deliveries: Arc<Mutex<Vec<Delivery>>>,
    mode: Arc<Mutex<Mode>>,
}

/// The receiver; dropping it stops it.
pub struct CallbackReceiver {
    addr: SocketAddr,
    shared: Shared,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for CallbackReceiver {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.abort();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn receive(
    axum::extract::State(shared): axum::extract::State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mode = lock(&shared.mode).clone();
    let header = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let (status, response) = match mode {
        Mode::Accept => (204, StatusCode::NO_CONTENT.into_response()),
        Mode::Status(s) => (
            s,
            StatusCode::from_u16(s)
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
                .into_response(),
        ),
        Mode::Redirect(to) => (
            307,
            (StatusCode::TEMPORARY_REDIRECT, [("location", to)]).into_response(),
        ),
        Mode::Slow(d) => {
            tokio::time::sleep(d).await;
            (204, StatusCode::NO_CONTENT.into_response())
        }
    };
    lock(&shared.deliveries).push(Delivery {
        idempotency_key: header("idempotency-key"),
        signature: header("x-kernelkite-signature"),
        body,
        at: Instant::now(),
        status,
    });
    response
}

impl CallbackReceiver {
    /// Starts on a free loopback port, accepting.
    pub async fn start() -> CallbackReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("addr");
        let mut r = CallbackReceiver {
            addr,
            shared: Shared {
                deliveries: Arc::new(Mutex::new(Vec::new())),
                mode: Arc::new(Mutex::new(Mode::Accept)),
            },
            server: None,
        };
        r.serve(listener);
        r
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let app = axum::Router::new()
            .route("/{*path}", axum::routing::post(receive))
            .with_state(self.shared.clone());
        self.server = Some(tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        }));
    }

    /// The callback URL (`/done`).
    pub fn url(&self) -> String {
        format!("http://{}/done", self.addr)
    }

    /// Stops listening: deliveries are refused at connect.
    pub fn down(&mut self) {
        if let Some(s) = self.server.take() {
            s.abort();
        }
    }

    /// Listens again on the same port.
    pub async fn up(&mut self) {
        let mut tries = 0;
        let listener = loop {
            match tokio::net::TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(e) if tries < 100 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("cannot listen on {} again: {e}", self.addr),
            }
        };
        self.serve(listener);
    }

    /// How it answers from now on.
    pub fn set_mode(&self, mode: Mode) {
        *lock(&self.shared.mode) = mode;
    }

    /// Every delivery so far.
    pub fn deliveries(&self) -> Vec<Delivery> {
        lock(&self.shared.deliveries).clone()
    }

    /// Waits until `pred` holds for the deliveries, at most `within`.
    pub async fn wait_for(&self, within: Duration, pred: impl Fn(&[Delivery]) -> bool) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if pred(&self.deliveries()) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Checks `X-Kernelkite-Signature: timestamp=<t>,signature=<hex>` against `secret`: the HMAC
/// over `"<t>." + body`, and `t` within `window_s` of now.
pub fn signature_valid(secret: &str, header: &str, body: &[u8], window_s: i64) -> bool {
    let mut ts = None;
    let mut sig = None;
    for part in header.split(',') {
        match part.split_once('=') {
            Some(("timestamp", v)) => ts = v.parse::<i64>().ok(),
            Some(("signature", v)) => sig = hex::decode(v).ok(),
            _ => {}
        }
    }
    let (Some(ts), Some(sig)) = (ts, sig) else {
        return false;
    };
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret.as_bytes()) else {
        return false;
    };
    mac.update(format!("{ts}.").as_bytes());
    mac.update(body);
    mac.verify_slice(&sig).is_ok() && (crate::fake_buildkite::unix_now() - ts).abs() <= window_s
}
