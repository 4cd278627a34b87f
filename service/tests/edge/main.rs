//! The HTTP edge under attack: the real `kernelkite-service` binary on loopback, with the
//! fake Buildkite where a build is needed, attacked the way issue 11 found each weakness;
//! one file per concern. Every loop is bounded and every wait has a deadline.
//!
//! The attacks are sized as in the issue (96 bodies of 16 MiB, 1,100 idle connections under
//! a 1,024-file limit, 3,000 slow-header connections) but use short timeouts so each test
//! takes seconds. `KERNELKITE_SERVICE_BIN=<path>` points them at another build of the binary
//! (an older one: each attack then succeeds and its test fails).

mod connections;
mod memory;
mod refusals;
mod shutdown;
mod streams;

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kernelkite_testkit::fake_buildkite::{
    FakeBuildkite, Signing, FAKE_API_TOKEN, FAKE_ORG, FAKE_PIPELINE,
};
use kernelkite_testkit::harness::WEBHOOK_TOKEN;
use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// How to start the binary.
#[derive(Default)]
pub struct Options {
    /// Extra environment (`KERNELKITE_*`).
    pub env: Vec<(&'static str, String)>,
    /// `ulimit -n` for the child: `(soft, hard)`; `None` leaves this process's limits.
    pub nofile: Option<(u64, u64)>,
    /// Listen on `[::]` (dual stack) instead of `127.0.0.1`.
    pub dual_stack: bool,
    /// KERNELKITE_DATA_DIR (default: a fresh temporary directory).
    pub data_dir: Option<std::path::PathBuf>,
}

/// The binary, running, with its fake Buildkite.
pub struct Service {
    pub child: tokio::process::Child,
    pub pid: i32,
    pub port: u16,
    pub base: String,
    pub fake: FakeBuildkite,
    pub http: reqwest::Client,
    pub data: std::path::PathBuf,
    _data: Option<tempfile::TempDir>,
    stderr: Arc<Mutex<String>>,
    /// The task that drains stderr; it ends at the pipe's end of file.
    stderr_reader: Option<tokio::task::JoinHandle<()>>,
}

impl Service {
    /// The binary with the test webhook token, no API token (loopback clients only) and
    /// `env`.
    pub async fn start(env: &[(&'static str, &str)]) -> Service {
        Service::start_with(Options {
            env: env.iter().map(|(k, v)| (*k, v.to_string())).collect(),
            ..Options::default()
        })
        .await
    }

    pub async fn start_with(opts: Options) -> Service {
        let fake = FakeBuildkite::start().await;
        // Port 0: the service binds whatever the kernel picks and logs it, so no other test
        // can take the port between a probe and the bind.
        let host = if opts.dual_stack { "[::]" } else { "127.0.0.1" };
        let (data, tmp) = match opts.data_dir {
            Some(d) => (d, None),
            None => {
                let t = tempfile::tempdir().unwrap();
                (t.path().to_path_buf(), Some(t))
            }
        };
        let bin = service_binary();
        let mut cmd = match opts.nofile {
            // Through the shell, as systemd's LimitNOFILE= would set it; no unsafe pre_exec.
            Some((soft, hard)) => {
                let mut c = tokio::process::Command::new("sh");
                c.arg("-c")
                    .arg(format!(
                        "ulimit -S -n {soft} && ulimit -H -n {hard} && exec \"$0\""
                    ))
                    .arg(bin);
                c
            }
            None => tokio::process::Command::new(bin),
        };
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .env("KERNELKITE_LISTEN", format!("{host}:0"))
            .env("BUILDKITE_API_URL", fake.api_url())
            .env("BUILDKITE_ORG", FAKE_ORG)
            .env("BUILDKITE_PIPELINE", FAKE_PIPELINE)
            .env("BUILDKITE_API_TOKEN", FAKE_API_TOKEN)
            .env("BUILDKITE_WEBHOOK_TOKEN", WEBHOOK_TOKEN)
            .env("KERNELKITE_DATA_DIR", &data)
            .env("KERNELKITE_RETRY_BASE_MS", "5")
            // The fake lists no agents: builds are created at once (the queue is tested apart).
            .env("KERNELKITE_QUEUE_SLOTS", "*=none");
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let pid = child.id().unwrap() as i32;
        // Drained all along: a child blocked on a full stderr pipe would look hung.
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let sink = stderr.clone();
        let stderr_reader = tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let port = loop {
            let log = stderr.lock().unwrap().clone();
            if let Some(addr) = kernelkite_testkit::service_process::bound_addr(&log) {
                break addr.port();
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("the service exited ({status}) before listening: {log}");
            }
            assert!(
                Instant::now() < deadline,
                "the service did not start: {log}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = http.get(format!("{base}/healthz")).send().await {
                if r.status() == 200 {
                    break;
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "the service exited ({status}) before answering: {}",
                    stderr.lock().unwrap()
                );
            }
            assert!(
                Instant::now() < deadline,
                "the service did not start: {}",
                stderr.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        fake.set_webhook(
            format!("{base}/webhooks/buildkite"),
            Signing::Hmac(WEBHOOK_TOKEN.into()),
        );
        Service {
            child,
            pid,
            port,
            base,
            fake,
            http,
            data,
            _data: tmp,
            stderr,
            stderr_reader: Some(stderr_reader),
        }
    }

    /// Everything the service wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Waits up to `limit` for the child to exit, then for its last stderr lines: the
    /// child's exit and the reader's last line race, so a log read right after `wait()`
    /// can miss what the child wrote just before it exited.
    pub async fn exit_within(
        &mut self,
        limit: Duration,
    ) -> Result<std::process::ExitStatus, tokio::time::error::Elapsed> {
        let status = tokio::time::timeout(limit, self.child.wait()).await?;
        if let Some(reader) = self.stderr_reader.take() {
            // The pipe ends when the child (and anything it started) has closed it.
            let _ = tokio::time::timeout(Duration::from_secs(5), reader).await;
        }
        Ok(status.expect("waiting for the service's process"))
    }

    /// The child's resident memory, KiB.
    pub fn rss_kib(&self) -> u64 {
        rss_kib(self.pid)
    }

    /// The child's open files.
    pub fn open_files(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// `(soft, hard)` open-files limit of the child, from /proc.
    pub fn nofile_limits(&self) -> (String, String) {
        let text = std::fs::read_to_string(format!("/proc/{}/limits", self.pid)).unwrap();
        let line = text
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap()
            .to_string();
        let f: Vec<&str> = line.split_whitespace().collect();
        (f[3].to_string(), f[4].to_string())
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(self.pid).unwrap(),
            rustix::process::Signal::TERM,
        )
        .unwrap();
    }

    /// The counters of `/metrics` whose name starts with `family`, by their label text.
    pub async fn metrics(&self, family: &str) -> HashMap<String, f64> {
        let text = self
            .http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .filter(|l| l.starts_with(family))
            .filter_map(|l| {
                let (k, v) = l.rsplit_once(' ')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect()
    }

    /// A metric's value (0 when absent).
    pub async fn metric(&self, series: &str) -> f64 {
        let family = series.split('{').next().unwrap();
        self.metrics(family)
            .await
            .get(series)
            .copied()
            .unwrap_or(0.0)
    }
}

/// The binary under attack: this build's, or the one `KERNELKITE_SERVICE_BIN` names (to see
/// the attacks succeed against an older build).
pub fn service_binary() -> String {
    std::env::var("KERNELKITE_SERVICE_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_kernelkite-service").to_string())
}

/// Resident memory of `pid`, KiB (`VmRSS` of /proc/<pid>/status; 0 once it is gone).
pub fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// Samples a process's RSS every 5 ms on a thread of its own until stopped; the peak.
pub struct RssPeak {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl RssPeak {
    pub fn start(pid: i32) -> RssPeak {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = 0;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_kib(pid));
                std::thread::sleep(Duration::from_millis(5));
            }
            peak.max(rss_kib(pid))
        });
        RssPeak { stop, thread }
    }

    pub fn stop(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap()
    }
}

/// Raises this test process's soft open-files limit to its hard one (the attacks open
/// thousands of sockets); returns the soft limit now.
pub fn raise_own_nofile() -> u64 {
    let _ = kernelkite_service::http::server::raise_open_files_limit();
    kernelkite_service::http::server::open_files_limit().unwrap_or(u64::MAX)
}

/// A raw HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

/// Reads one HTTP/1.1 answer (head, then a `content-length` body, or up to the close).
pub async fn read_answer(stream: &mut TcpStream) -> std::io::Result<Answer> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "closed before a full answer: {:?}",
                    String::from_utf8_lossy(&buf)
                ),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let length = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(usize::MAX);
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Ok(Answer {
        status,
        head,
        body: String::from_utf8_lossy(&body).to_string(),
    })
}

/// Sends `request` on a new connection and reads the answer, within `within`.
pub async fn exchange(port: u16, request: &[u8], within: Duration) -> std::io::Result<Answer> {
    tokio::time::timeout(within, async {
        let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(request).await?;
        read_answer(&mut s).await
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer in time"))?
}

/// `GET /healthz` on a new connection: the status, within `within`.
pub async fn healthz(port: u16, within: Duration) -> std::io::Result<u16> {
    exchange(
        port,
        b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        within,
    )
    .await
    .map(|a| a.status)
}

/// A signed `ping` webhook request (a fresh timestamp), as raw bytes.
pub fn signed_ping() -> Vec<u8> {
    let body = br#"{"event":"ping"}"#;
    let sig = kernelkite_testkit::fake_buildkite::signature_header(
        WEBHOOK_TOKEN,
        kernelkite_testkit::fake_buildkite::unix_now(),
        body,
    );
    let mut r = format!(
        "POST /webhooks/buildkite HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\nx-buildkite-event: ping\r\nx-buildkite-signature: {sig}\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// A `POST /v1/submissions` of the sample config, as raw bytes.
pub fn submission_request(extra_headers: &str) -> Vec<u8> {
    let body = serde_json::json!({"config": kernelkite_testkit::sample_config(), "queue": "h100"})
        .to_string();
    format!(
        "POST /v1/submissions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n{extra_headers}content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A well-formed `X-Buildkite-Signature` with a fresh timestamp and a wrong MAC: it passes
/// every check that needs no body.
pub fn forged_signature() -> String {
    format!(
        "timestamp={},signature={}",
        kernelkite_testkit::fake_buildkite::unix_now(),
        "0".repeat(64)
    )
}
