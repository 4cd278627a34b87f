//! The real `kernelkite-service` binary as a child process on a fixed loopback port, against
//! the fake Buildkite: started, killed with SIGKILL, and started again on the same data dir,
//! as an operator (or a crash) would. Its stderr goes to a file that outlives each run.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::fake_buildkite::{FakeBuildkite, Signing, FAKE_API_TOKEN, FAKE_ORG, FAKE_PIPELINE};
use crate::harness::{CALLBACK_SECRET, WEBHOOK_TOKEN};

/// How the child is confined when it starts.
#[derive(Debug, Clone, Copy, Default)]
pub struct Limits {
    /// RLIMIT_FSIZE in bytes (with SIGXFSZ ignored, so a write past it fails with EFBIG,
    /// as on a full disk).
    pub file_size: Option<u64>,
    /// Run as this uid and gid (root only).
    pub user: Option<u32>,
}

/// The service binary, restartable on one port and one data dir.
pub struct ServiceProcess {
    exe: PathBuf,
    /// Its command line.
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// Its stderr, every run appended.
    pub log: PathBuf,
    child: Option<tokio::process::Child>,
    /// Confinement of the next start.
    pub limits: Limits,
}

/// The address a `kernelkite-service` bound, from its log (the `kernelkite-service listening
/// addr=...` line), once it is there: with `--listen 127.0.0.1:0` the only way to learn the port
/// without racing other processes for a probed one.
pub fn bound_addr(log: &str) -> Option<std::net::SocketAddr> {
    log.lines()
        .filter(|l| l.contains("kernelkite-service listening"))
        .find_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("addr=")))
        .and_then(|a| a.parse().ok())
}

/// A free loopback port.
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    l.local_addr().expect("addr").port()
}

impl ServiceProcess {
    /// The binary `exe` (a test's `env!("CARGO_BIN_EXE_kernelkite-service")`) configured for
    /// `fake`, with `data_dir` as KERNELKITE_DATA_DIR and the test settings (fast retries,
    /// callbacks signed with [`CALLBACK_SECRET`]); `fake`'s webhooks are pointed at it.
    pub fn new(exe: &str, fake: &FakeBuildkite, data_dir: &Path, log: PathBuf) -> ServiceProcess {
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        fake.set_webhook(
            format!("{base}/webhooks/buildkite"),
            Signing::Hmac(WEBHOOK_TOKEN.into()),
        );
        let env = [
            ("KERNELKITE_LISTEN", format!("127.0.0.1:{port}")),
            ("BUILDKITE_API_URL", fake.api_url()),
            ("BUILDKITE_ORG", FAKE_ORG.into()),
            ("BUILDKITE_PIPELINE", FAKE_PIPELINE.into()),
            ("BUILDKITE_API_TOKEN", FAKE_API_TOKEN.into()),
            ("BUILDKITE_WEBHOOK_TOKEN", WEBHOOK_TOKEN.into()),
            ("KERNELKITE_CALLBACK_SECRET", CALLBACK_SECRET.into()),
            ("KERNELKITE_DATA_DIR", data_dir.display().to_string()),
            ("KERNELKITE_RETRY_BASE_MS", "10".into()),
            // The tests submit the same fixture config again on purpose, to run it again.
            ("KERNELKITE_CACHE", "false".into()),
            // The fake's agents list is empty unless a test fills it: builds are created at once,
            // as they were before the service held queues (`fair_queue` tests the queue).
            ("KERNELKITE_QUEUE_SLOTS", "*=none".into()),
            ("KERNELKITE_CALLBACK_BACKOFF_MS", "50".into()),
            ("KERNELKITE_CREATE_LOOKUP_DELAY_MS", "100".into()),
            ("RUST_LOG", "info".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        ServiceProcess {
            exe: PathBuf::from(exe),
            args: Vec::new(),
            env,
            base,
            log,
            child: None,
            limits: Limits::default(),
        }
    }

    /// Keeps the store in PostgreSQL at `url`, in `schema`, instead of the data dir, named as
    /// a Heroku-style platform names its database: `DATABASE_URL`, and no data dir.
    pub fn use_postgres(&mut self, url: &str, schema: &str) {
        self.env.retain(|(k, _)| k != "KERNELKITE_DATA_DIR");
        self.set_env("DATABASE_URL", url);
        self.set_env("KERNELKITE_DATABASE_SCHEMA", schema);
    }

    /// The command line of the next start (none: `kernelkite-service` alone, which serves).
    pub fn set_args(&mut self, args: &[&str]) {
        self.args = args.iter().map(|a| a.to_string()).collect();
    }

    /// Sets (or replaces) an environment variable of the next start.
    pub fn set_env(&mut self, key: &str, value: impl Into<String>) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_string(), value.into()));
    }

    /// Starts the binary; returns once `/healthz` answers, or the exit status and log when
    /// it ends first.
    pub async fn start(&mut self) -> Result<(), String> {
        self.spawn()?;
        self.ready(Duration::from_secs(20)).await
    }

    /// Starts the binary without waiting for it to serve (a standby serves nothing until it
    /// takes over).
    pub fn spawn(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| e.to_string())?;
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.args(&self.args)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        if let Some(uid) = self.limits.user {
            cmd.uid(uid).gid(uid);
        }
        if let Some(bytes) = self.limits.file_size {
            // SAFETY: only async-signal-safe calls (signal, setrlimit) between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                    let lim = libc::rlimit {
                        rlim_cur: bytes as libc::rlim_t,
                        rlim_max: bytes as libc::rlim_t,
                    };
                    if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        self.child = Some(cmd.spawn().map_err(|e| e.to_string())?);
        Ok(())
    }

    /// Waits until the running process answers `/healthz` (within `within`); the exit status
    /// and log when it ends first or never answers.
    pub async fn ready(&mut self, within: Duration) -> Result<(), String> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + within;
        loop {
            let Some(child) = self.child.as_mut() else {
                return Err("not started".into());
            };
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(format!("exited with {status}: {}", self.log_text()));
            }
            if let Ok(r) = http.get(format!("{}/healthz", self.base)).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                return Err(format!("did not answer /healthz: {}", self.log_text()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits (30 s at most) for its log to say it stands by (`KERNELKITE_STANDBY`: waiting for
    /// the schema's lock, serving nothing).
    pub async fn standing_by(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.log_text().contains("standing by") {
            assert!(
                Instant::now() < deadline,
                "it never stood by: {}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends `signal` to the running process (SIGSTOP freezes it, SIGCONT lets it go on).
    pub fn signal(&self, signal: i32) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) on our own child's pid; no memory is involved.
            unsafe {
                libc::kill(pid as libc::pid_t, signal);
            }
        }
    }

    /// Waits up to `within` for the running process to exit on its own; its exit code.
    pub async fn exited(&mut self, within: Duration) -> Option<i32> {
        let child = self.child.as_mut()?;
        match tokio::time::timeout(within, child.wait()).await {
            Ok(Ok(status)) => {
                self.child = None;
                status.code()
            }
            _ => None,
        }
    }

    /// Runs the binary to its exit (for configurations it must refuse); the status and log.
    pub async fn run_to_exit(&mut self, within: Duration) -> (Option<i32>, String) {
        let log = match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
        {
            Ok(f) => f,
            Err(e) => return (None, e.to_string()),
        };
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.args(&self.args)
            .env_clear()
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        if let Some(uid) = self.limits.user {
            cmd.uid(uid).gid(uid);
        }
        let Ok(mut child) = cmd.spawn() else {
            return (None, "spawn failed".into());
        };
        let code = match tokio::time::timeout(within, child.wait()).await {
            Ok(Ok(s)) => s.code(),
            _ => {
                let _ = child.start_kill();
                None
            }
        };
        (code, self.log_text())
    }

    /// SIGKILL, and waits for the process to be gone.
    pub async fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.start_kill();
            let _ = c.wait().await;
        }
    }

    /// The running process's pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(|c| c.id())
    }

    /// Whether a process is running.
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Everything it wrote to stderr so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}
