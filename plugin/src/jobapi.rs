//! A client for the agent's Job API: HTTP/1.1 over the unix socket
//! `$BUILDKITE_AGENT_JOB_API_SOCKET`, bearer `$BUILDKITE_AGENT_JOB_API_TOKEN`.
//!
//! Binary hooks cannot `export`; they change the job's environment here. The client is a few
//! dozen lines of blocking I/O on purpose: no async runtime in a hook that must start in
//! a millisecond.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Path of the environment endpoint.
pub const ENV_PATH: &str = "/api/current-job/v0/env";

#[derive(Debug, thiserror::Error)]
pub enum JobApiError {
    #[error("cannot reach the Job API at {socket}: {error} (is the agent running with the Job API enabled?)")]
    Connect {
        socket: PathBuf,
        error: std::io::Error,
    },
    #[error("Job API I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("Job API answered {status} to {method} {path}: {body}")]
    Status {
        status: u16,
        method: String,
        path: String,
        body: String,
    },
    #[error("Job API sent a malformed response: {0}")]
    Malformed(String),
}

/// A connection target: socket path and token.
#[derive(Debug, Clone)]
pub struct JobApi {
    socket: PathBuf,
    token: String,
    timeout: Duration,
}

#[derive(serde::Deserialize)]
struct EnvBody {
    env: BTreeMap<String, String>,
}

impl JobApi {
    pub fn new(socket: &Path, token: &str) -> JobApi {
        JobApi {
            socket: socket.to_path_buf(),
            token: token.to_string(),
            timeout: Duration::from_secs(10),
        }
    }

    /// The job's whole environment.
    pub fn get_env(&self) -> Result<BTreeMap<String, String>, JobApiError> {
        let body = self.request("GET", ENV_PATH, None)?;
        let parsed: EnvBody = serde_json::from_slice(&body)
            .map_err(|e| JobApiError::Malformed(format!("GET {ENV_PATH}: {e}")))?;
        Ok(parsed.env)
    }

    /// Adds or replaces variables in the job's environment.
    pub fn patch_env(&self, env: &BTreeMap<String, String>) -> Result<(), JobApiError> {
        let body = serde_json::json!({ "env": env }).to_string();
        self.request("PATCH", ENV_PATH, Some(&body)).map(drop)
    }

    /// Removes variables from the job's environment.
    pub fn delete_env(&self, keys: &[String]) -> Result<(), JobApiError> {
        let body = serde_json::json!({ "keys": keys }).to_string();
        self.request("DELETE", ENV_PATH, Some(&body)).map(drop)
    }

    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<Vec<u8>, JobApiError> {
        let mut stream =
            UnixStream::connect(&self.socket).map_err(|error| JobApiError::Connect {
                socket: self.socket.clone(),
                error,
            })?;
        stream.set_read_timeout(Some(self.timeout))?;
        stream.set_write_timeout(Some(self.timeout))?;
        let body = body.unwrap_or("");
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: job-api\r\nAuthorization: Bearer {}\r\nConnection: close\r\nAccept: application/json\r\n",
            self.token
        );
        if !body.is_empty() || method != "GET" {
            req.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            ));
        }
        req.push_str("\r\n");
        req.push_str(body);
        stream.write_all(req.as_bytes())?;
        let (status, resp) = read_response(BufReader::new(stream))?;
        if !(200..300).contains(&status) {
            return Err(JobApiError::Status {
                status,
                method: method.into(),
                path: path.into(),
                body: String::from_utf8_lossy(&resp)
                    .trim()
                    .chars()
                    .take(500)
                    .collect(),
            });
        }
        Ok(resp)
    }
}

/// Reads one HTTP/1.1 response: status and body (Content-Length, chunked, or to EOF).
pub fn read_response(mut r: impl BufRead) -> Result<(u16, Vec<u8>), JobApiError> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| JobApiError::Malformed(format!("status line {:?}", line.trim())))?;
    let mut length: Option<usize> = None;
    let mut chunked = false;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 {
            return Err(JobApiError::Malformed("headers cut short".into()));
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((name, value)) = h.split_once(':') {
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length =
                    Some(value.parse().map_err(|_| {
                        JobApiError::Malformed(format!("Content-Length {value:?}"))
                    })?);
            } else if name.eq_ignore_ascii_case("transfer-encoding")
                && value.to_ascii_lowercase().contains("chunked")
            {
                chunked = true;
            }
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size_line = String::new();
            r.read_line(&mut size_line)?;
            let size_hex = size_line.trim().split(';').next().unwrap_or("");
            let size = usize::from_str_radix(size_hex, 16)
                .map_err(|_| JobApiError::Malformed(format!("chunk size {size_hex:?}")))?;
            if size == 0 {
                break;
            }
            let start = body.len();
            body.resize(start + size, 0);
            r.read_exact(&mut body[start..])?;
            let mut crlf = [0u8; 2];
            r.read_exact(&mut crlf)?;
        }
    } else if let Some(n) = length {
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else {
        r.read_to_end(&mut body)?;
    }
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_content_length_and_chunked_bodies() {
        let (s, b) =
            read_response(&b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}extra"[..]).unwrap();
        assert_eq!((s, b.as_slice()), (200, &b"{}"[..]));
        let (s, b) = read_response(
            &b"HTTP/1.1 401 Unauthorized\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"[..],
        )
        .unwrap();
        assert_eq!((s, b.as_slice()), (401, &b"abcde"[..]));
        assert!(read_response(&b"garbage\r\n\r\n"[..]).is_err());
        assert!(
            read_response(&b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"[..])
                .is_err()
        );
    }

    #[test]
    fn missing_socket_is_a_clear_error() {
        let api = JobApi::new(Path::new("/nonexistent/job-api.sock"), "t");
        let e = api.get_env().unwrap_err();
        assert!(e.to_string().contains("cannot reach the Job API"), "{e}");
    }
}
