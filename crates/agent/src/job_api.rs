//! The agent's Job API for one job, served on a unix socket, as the agent serves it to the hooks
//! it executes (`GET|PATCH|DELETE /api/current-job/v0/env`, bearer token, 401 otherwise;
//! DESIGN.md, "Buildkite agent hooks"): the one emulation of it, for the smoke job, the hooks'
//! benchmark and the plugin's test harness. The hooks' client (`kernelkite_hooks::jobapi`) is
//! tested against it.
//!
//! Blocking I/O on one thread: a job's hooks make a handful of sequential requests. The
//! request line and headers are parsed by `httparse`, as the hooks' client parses responses.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};

/// The Job API's one resource: the job's environment.
pub const ENV_PATH: &str = "/api/current-job/v0/env";

/// The largest request head or body accepted; a job's environment is far smaller.
const MAX_REQUEST: usize = 16 << 20;

/// The Job API of one job, until dropped.
#[derive(Debug)]
pub struct JobApiServer {
    socket: PathBuf,
    env: Arc<Mutex<BTreeMap<String, String>>>,
    requests: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl JobApiServer {
    /// Serves `env` as the job's environment at `socket`, to requests bearing `token`.
    pub fn start(
        socket: &Path,
        token: &str,
        env: BTreeMap<String, String>,
    ) -> std::io::Result<JobApiServer> {
        let _ = std::fs::remove_file(socket);
        let listener = UnixListener::bind(socket)?;
        let env = Arc::new(Mutex::new(env));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        // A blocking accept answers a hook at once, as the agent does (a polling loop would add
        // its period to every request); `drop` wakes it with a connection of its own.
        let thread = {
            let (env, requests, stop, token) = (
                env.clone(),
                requests.clone(),
                stop.clone(),
                token.to_string(),
            );
            std::thread::spawn(move || loop {
                let accepted = listener.accept();
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                match accepted {
                    Ok((stream, _)) => serve(stream, &token, &env, &requests),
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            })
        };
        Ok(JobApiServer {
            socket: socket.to_path_buf(),
            env,
            requests,
            stop,
            thread: Some(thread),
        })
    }

    /// The socket's path (`BUILDKITE_AGENT_JOB_API_SOCKET`).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The job's environment as the hooks left it.
    pub fn env(&self) -> BTreeMap<String, String> {
        self.env.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// Replaces the job's environment, as the agent's own changes between hooks do.
    pub fn set_env(&self, env: BTreeMap<String, String>) {
        if let Ok(mut e) = self.env.lock() {
            *e = env;
        }
    }

    /// Sets one variable (`Some`) or removes it (`None`), as a step's `env` would.
    pub fn set(&self, key: &str, value: Option<&str>) {
        if let Ok(mut e) = self.env.lock() {
            match value {
                Some(v) => e.insert(key.to_string(), v.to_string()),
                None => e.remove(key),
            };
        }
    }

    /// The method of every request so far, in order, answered or refused.
    pub fn requests(&self) -> Vec<String> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

impl Drop for JobApiServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            // Only a thread that is surely woken is waited for.
            if UnixStream::connect(&self.socket).is_ok() {
                let _ = t.join();
            }
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// One request: method, path, `Authorization` header, body.
struct Request {
    method: String,
    path: String,
    authorization: Option<String>,
    body: Vec<u8>,
}

fn read_request(stream: &UnixStream) -> Option<Request> {
    let mut r = BufReader::new(stream);
    let mut head = Vec::new();
    loop {
        let start = head.len();
        let n = r
            .by_ref()
            .take((MAX_REQUEST - start.min(MAX_REQUEST)) as u64)
            .read_until(b'\n', &mut head)
            .ok()?;
        if n == 0 {
            return None;
        }
        if start > 0 && matches!(&head[start..], b"\r\n" | b"\n") {
            break;
        }
    }
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    if !req.parse(&head).ok()?.is_complete() {
        return None;
    }
    let header = |name: &str| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| String::from_utf8_lossy(h.value).trim().to_string())
    };
    let length: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if length > MAX_REQUEST {
        return None;
    }
    let mut body = vec![0; length];
    r.read_exact(&mut body).ok()?;
    Some(Request {
        method: req.method?.to_string(),
        path: req.path?.to_string(),
        authorization: header("authorization"),
        body,
    })
}

fn respond(mut stream: &UnixStream, status: u16, body: &Value) {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        _ => "Method Not Allowed",
    };
    let body = body.to_string();
    let _ = write!(
        stream,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

fn serve(
    stream: UnixStream,
    token: &str,
    env: &Mutex<BTreeMap<String, String>>,
    requests: &Mutex<Vec<String>>,
) {
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let Some(req) = read_request(&stream) else {
        respond(&stream, 400, &json!({"error": "malformed request"}));
        return;
    };
    if let Ok(mut r) = requests.lock() {
        r.push(req.method.clone());
    }
    if req.authorization.as_deref() != Some(&format!("Bearer {token}")) {
        respond(
            &stream,
            401,
            &json!({"error": "invalid Authorization header"}),
        );
        return;
    }
    if req.path != ENV_PATH {
        respond(&stream, 404, &json!({"error": "not found"}));
        return;
    }
    let Ok(mut env) = env.lock() else {
        return;
    };
    let body: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
    match req.method.as_str() {
        "GET" => respond(&stream, 200, &json!({ "env": *env })),
        "PATCH" => {
            let Some(map) = body.get("env").and_then(Value::as_object) else {
                respond(
                    &stream,
                    400,
                    &json!({"error": "the body must be {\"env\": {...}}"}),
                );
                return;
            };
            let mut added = Vec::new();
            let mut updated = Vec::new();
            for (k, v) in map {
                let Some(v) = v.as_str() else {
                    respond(&stream, 400, &json!({"error": "values must be strings"}));
                    return;
                };
                match env.insert(k.clone(), v.to_string()) {
                    Some(_) => updated.push(k.clone()),
                    None => added.push(k.clone()),
                }
            }
            respond(&stream, 200, &json!({"added": added, "updated": updated}));
        }
        "DELETE" => {
            let keys: Vec<String> = body
                .get("keys")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|k| k.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default();
            let deleted: Vec<&String> = keys.iter().filter(|k| env.remove(*k).is_some()).collect();
            respond(&stream, 200, &json!({ "deleted": deleted }));
        }
        _ => respond(&stream, 405, &json!({"error": "method not allowed"})),
    }
}
