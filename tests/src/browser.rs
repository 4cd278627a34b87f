//! Headless chromium for tests and benchmarks of the service's web pages: Debian's
//! chromedriver on a free port, driven over the W3C WebDriver protocol (`POST /session`,
//! `/session/{id}/url`, `/execute/sync`, `/window/rect`, `GET /screenshot`, as the
//! specification names them; chromedriver's `goog:chromeOptions` carry the binary and its
//! flags), with plain HTTP calls.

use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// chromedriver on a free port, and a session of headless chromium (stopped when dropped).
pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
}

impl Drop for Browser {
    /// Stops chromedriver and every browser process it started: chromium's processes outlive
    /// a killed chromedriver (they once went on using the CPU through a whole test run), so
    /// the process group chromedriver leads is killed, after the session is ended (which makes
    /// chromedriver close the browser itself).
    fn drop(&mut self) {
        if !self.session.is_empty() {
            // Ending the session makes chromedriver close the browser, crash handlers included.
            let url = format!("{}/session/{}", self.base, self.session);
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                rt.block_on(async {
                    reqwest::Client::new()
                        .delete(url)
                        .timeout(Duration::from_secs(10))
                        .send()
                        .await
                        .ok()
                })
            })
            .join();
        }
        let group = format!("-{}", self.driver.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    /// chromedriver and a session, or why not (for a counted skip).
    pub async fn start() -> Result<Browser, String> {
        for bin in ["/usr/bin/chromedriver", "/usr/bin/chromium"] {
            if !std::path::Path::new(bin).exists() {
                return Err(format!(
                    "{bin} is not installed (Debian's chromium and chromium-driver: apt-get install chromium chromium-driver)"
                ));
            }
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let driver = Command::new("/usr/bin/chromedriver")
            .arg(format!("--port={port}"))
            // Its own process group, with the browser it starts: killed together when dropped.
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("chromedriver does not start: {e}"))?;
        let http = reqwest::Client::new();
        let base = format!("http://127.0.0.1:{port}");
        let start = Instant::now();
        while http.get(format!("{base}/status")).send().await.is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "chromedriver did not listen"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1440,1000"]
            }
        }}});
        let mut b = Browser {
            driver,
            base,
            session: String::new(),
            http,
        };
        let v = b.call("POST", "/session", Some(caps)).await;
        b.session = v["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {v}"))
            .to_string();
        Ok(b)
    }

    /// One WebDriver call: its `value`.
    pub async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = if path == "/session" {
            format!("{}{path}", self.base)
        } else {
            format!("{}/session/{}{path}", self.base, self.session)
        };
        let req = match method {
            "POST" => self.http.post(url).json(&body.unwrap_or(json!({}))),
            _ => self.http.get(url),
        };
        let v: Value = req.send().await.unwrap().json().await.unwrap();
        v["value"].clone()
    }

    /// Navigates to `url`.
    pub async fn open(&self, url: &str) {
        self.call("POST", "/url", Some(json!({"url": url}))).await;
    }

    /// Runs `script` in the page; what it returns.
    pub async fn js(&self, script: &str) -> Value {
        self.call(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
        .await
    }

    /// Waits until `script` returns something truthy; returns it.
    pub async fn until(&self, what: &str, script: &str, within: Duration) -> Value {
        let start = Instant::now();
        loop {
            let v = self.js(script).await;
            if !(v.is_null() || v == json!(false) || v == json!(0) || v == json!("")) {
                return v;
            }
            if start.elapsed() > within {
                let page = self
                    .js("return document.body.innerText.slice(0, 2000)")
                    .await;
                panic!("{what}: not within {within:?}; the page says: {page}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Resizes the window.
    pub async fn size(&self, w: u32, h: u32) {
        self.call(
            "POST",
            "/window/rect",
            Some(json!({"width": w, "height": h})),
        )
        .await;
    }

    /// Saves a screenshot under `target/test-output/<dir>/<name>`; its path.
    pub async fn screenshot(&self, dir: &str, name: &str) -> PathBuf {
        use base64::Engine as _;
        let v = self.call("GET", "/screenshot", None).await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap_or_default())
            .unwrap();
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../target/test-output")
            .join(dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, png).unwrap();
        println!("screenshot: {}", path.display());
        path
    }
}
