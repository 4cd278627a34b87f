//! A client for the agent's Job API: HTTP/1.1 over the unix socket
//! `$BUILDKITE_AGENT_JOB_API_SOCKET`, bearer `$BUILDKITE_AGENT_JOB_API_TOKEN`.
//!
//! Binary hooks cannot `export`; they change the job's environment here. The client is a few
//! dozen lines of blocking I/O on purpose: no async runtime in a hook that must start in
//! a millisecond.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
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
    #[error("the Job API refused BUILDKITE_AGENT_JOB_API_TOKEN (401 to {method} {path}): the hook must run inside the job whose socket and token it was given; do not set or copy these variables by hand")]
    Unauthorized { method: String, path: String },
    #[error("BUILDKITE_AGENT_JOB_API_TOKEN contains a control character; it must be the token the agent set for this job")]
    BadToken,
}

/// The most a Job API response may hold (status line, each header line, and the body). The
/// whole job environment comes back from GET; 64 MiB is far above any real one, and keeps a
/// broken or hostile peer from making the hook allocate without bound.
pub const MAX_RESPONSE_BYTES: u64 = 64 << 20;

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
        // A CR or LF would end the header early and inject others.
        if self.token.chars().any(char::is_control) {
            return Err(JobApiError::BadToken);
        }
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
        if status == 401 {
            return Err(JobApiError::Unauthorized {
                method: method.into(),
                path: path.into(),
            });
        }
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

/// Reads one line of at most [`MAX_RESPONSE_BYTES`].
fn read_line_bounded(r: &mut impl BufRead, line: &mut String) -> Result<usize, JobApiError> {
    let n = r.by_ref().take(MAX_RESPONSE_BYTES).read_line(line)?;
    if n as u64 >= MAX_RESPONSE_BYTES {
        return Err(JobApiError::Malformed(format!(
            "a line longer than {MAX_RESPONSE_BYTES} bytes"
        )));
    }
    Ok(n)
}

/// Checks a declared body or chunk size against what is left of the response budget.
fn within_budget(size: u64, used: usize) -> Result<usize, JobApiError> {
    match usize::try_from(size) {
        Ok(n) if (used as u64).saturating_add(size) <= MAX_RESPONSE_BYTES => Ok(n),
        _ => Err(JobApiError::Malformed(format!(
            "a body of {size} bytes (the limit is {MAX_RESPONSE_BYTES})"
        ))),
    }
}

/// Reads one HTTP/1.1 response: status and body (Content-Length, chunked, or to EOF), each
/// part bounded by [`MAX_RESPONSE_BYTES`].
pub fn read_response(mut r: impl BufRead) -> Result<(u16, Vec<u8>), JobApiError> {
    let mut line = String::new();
    read_line_bounded(&mut r, &mut line)?;
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| JobApiError::Malformed(format!("status line {:?}", line.trim())))?;
    let mut length: Option<usize> = None;
    let mut chunked = false;
    loop {
        let mut h = String::new();
        if read_line_bounded(&mut r, &mut h)? == 0 {
            return Err(JobApiError::Malformed("headers cut short".into()));
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((name, value)) = h.split_once(':') {
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                let n: u64 = value
                    .parse()
                    .map_err(|_| JobApiError::Malformed(format!("Content-Length {value:?}")))?;
                length = Some(within_budget(n, 0)?);
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
            if read_line_bounded(&mut r, &mut size_line)? == 0 {
                return Err(JobApiError::Malformed("chunked body cut short".into()));
            }
            let size_hex = size_line.trim().split(';').next().unwrap_or("");
            let size = u64::from_str_radix(size_hex, 16)
                .map_err(|_| JobApiError::Malformed(format!("chunk size {size_hex:?}")))?;
            if size == 0 {
                break;
            }
            let size = within_budget(size, body.len())?;
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
        r.by_ref()
            .take(MAX_RESPONSE_BYTES + 1)
            .read_to_end(&mut body)?;
        within_budget(body.len() as u64, 0)?;
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
    fn oversized_or_endless_responses_are_refused_without_allocating() {
        // A Content-Length or chunk size near usize::MAX must not be allocated (or overflow).
        let huge = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{{}}",
            u64::MAX
        );
        let e = read_response(huge.as_bytes()).unwrap_err();
        assert!(matches!(e, JobApiError::Malformed(_)), "{e}");
        let chunk = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nab";
        let e = read_response(chunk.as_bytes()).unwrap_err();
        assert!(matches!(e, JobApiError::Malformed(_)), "{e}");
        // A body without a length that never ends is cut at the limit.
        let endless =
            std::io::BufReader::new((&b"HTTP/1.1 200 OK\r\n\r\n"[..]).chain(std::io::repeat(b'x')));
        let e = read_response(endless).unwrap_err();
        assert!(matches!(e, JobApiError::Malformed(_)), "{e}");
        // So is a header line that never ends.
        let endless =
            std::io::BufReader::new((&b"HTTP/1.1 200 OK\r\nX: "[..]).chain(std::io::repeat(b'x')));
        assert!(read_response(endless).is_err());
    }

    #[test]
    fn a_token_that_would_inject_headers_is_refused() {
        let api = JobApi::new(Path::new("/nonexistent/job-api.sock"), "t\r\nX-Evil: 1");
        assert!(matches!(api.get_env(), Err(JobApiError::BadToken)));
    }

    #[test]
    fn missing_socket_is_a_clear_error() {
        let api = JobApi::new(Path::new("/nonexistent/job-api.sock"), "t");
        let e = api.get_env().unwrap_err();
        assert!(e.to_string().contains("cannot reach the Job API"), "{e}");
    }
}
