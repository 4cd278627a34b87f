//! A load balancer in front of several `kernelkite-service` replicas, routing as haproxy does
//! with an HTTP health check (`option httpchk GET /readyz`, `inter 100ms`, `fall 1 rise 1`,
//! `on-marked-down shutdown-sessions`: deployment/service/haproxy.cfg): each new connection
//! goes to the first backend whose `/readyz` answered 200 at its last check, waiting up to a
//! second for one (as haproxy queues a request), else answered 503 (haproxy's "no server is
//! available"; closing at once instead had every client reconnect every few milliseconds
//! during a fail-over, and a reconnect landing on a port still in TIME_WAIT waits out SYN
//! retries for half a minute); a backend's open connections are cut when it is marked down. A standby
//! replica serves nothing, so it takes traffic only once it leads; a frozen one stops answering
//! its checks and is passed over, and the requests it holds fail at once instead of waiting for
//! it (the clients retry them elsewhere).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

/// How often each backend is checked, and how long a check may take.
const CHECK_EVERY: Duration = Duration::from_millis(100);
const CHECK_TIMEOUT: Duration = Duration::from_millis(500);

/// How long a connection waits for a backend to be up.
const QUEUE_FOR: Duration = Duration::from_secs(1);

/// The answer when none is.
const NO_SERVER: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

/// The balancer: `base` is where clients and webhooks go.
pub struct Balancer {
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Balancer {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn addr_of(base: &str) -> SocketAddr {
    base.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .expect("a backend's base is http://ip:port")
}

/// Returns once the backend's last check failed.
async fn marked_down(up: &AtomicBool) {
    while up.load(Ordering::SeqCst) {
        tokio::time::sleep(CHECK_EVERY / 2).await;
    }
}

impl Balancer {
    /// Listens on a free loopback port in front of `backends` (their `http://ip:port`
    /// bases), in order of preference.
    pub async fn start(backends: &[String]) -> Balancer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let backends: Arc<Vec<(SocketAddr, AtomicBool)>> = Arc::new(
            backends
                .iter()
                .map(|b| (addr_of(b), AtomicBool::new(false)))
                .collect(),
        );
        let mut tasks = Vec::new();
        for i in 0..backends.len() {
            let backends = backends.clone();
            tasks.push(tokio::spawn(async move {
                let http = reqwest::Client::builder()
                    .timeout(CHECK_TIMEOUT)
                    .pool_max_idle_per_host(0)
                    .build()
                    .expect("client");
                let (addr, up) = &backends[i];
                loop {
                    let ok = http
                        .get(format!("http://{addr}/readyz"))
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success());
                    up.store(ok, Ordering::SeqCst);
                    tokio::time::sleep(CHECK_EVERY).await;
                }
            }));
        }
        tasks.push(tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let backends = backends.clone();
                tokio::spawn(async move {
                    let deadline = tokio::time::Instant::now() + QUEUE_FOR;
                    loop {
                        for (addr, up) in backends.iter() {
                            if !up.load(Ordering::SeqCst) {
                                continue;
                            }
                            let connect = tokio::net::TcpStream::connect(addr);
                            if let Ok(Ok(mut outbound)) =
                                tokio::time::timeout(CHECK_TIMEOUT, connect).await
                            {
                                tokio::select! {
                                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                                    _ = marked_down(up) => {}
                                }
                                return;
                            }
                        }
                        if tokio::time::Instant::now() >= deadline {
                            let _ = inbound.write_all(NO_SERVER).await;
                            return;
                        }
                        tokio::time::sleep(CHECK_EVERY / 2).await;
                    }
                });
            }
        }));
        Balancer { base, tasks }
    }
}
