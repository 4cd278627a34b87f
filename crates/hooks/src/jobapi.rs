//! A client for the agent's Job API: HTTP/1.1 over the unix socket
//! `$BUILDKITE_AGENT_JOB_API_SOCKET`, bearer `$BUILDKITE_AGENT_JOB_API_TOKEN`.
//!
//! Binary hooks cannot `export`; they change the job's environment here. The client is
//! blocking I/O on purpose: no async runtime in a hook that must start in a millisecond. The
//! status line, headers and chunk sizes are parsed by `httparse`; what is left by hand is
//! framing the one response of a `Connection: close` request (Content-Length, chunked or to
//! the end) under a size bound. HTTP client crates either need an async runtime (hyper,
//! reqwest) or cannot speak over a unix socket without a transport of our own (ureq), which
//! would be more code than this framing.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Path of the environment endpoint (the agent's, as `kernelkite-agent` serves it).
pub use kernelkite_agent::job_api::ENV_PATH;

/// Why a Job API request failed.
#[derive(Debug, thiserror::Error)]
pub enum JobApiError {
    /// The socket cannot be connected to.
    #[error(
        "cannot reach the Job API at {socket} (is the agent running with the Job API enabled?)"
    )]
    Connect {
        /// `BUILDKITE_AGENT_JOB_API_SOCKET`.
        socket: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Reading or writing the connection failed.
    #[error("I/O error talking to the Job API")]
    Io(#[from] std::io::Error),
    /// The agent answered with an error status.
    #[error("Job API answered {status} to {method} {path}: {body}")]
    Status {
        /// The HTTP status.
        status: u16,
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
        /// The start of the response body (the agent's error message).
        body: String,
    },
    /// The response is not HTTP/1.1 (status line, headers or chunk framing).
    #[error("Job API sent a malformed response")]
    Parse(#[source] httparse::Error),
    /// The response breaks a rule of its own framing or is too large.
    #[error("Job API sent a malformed response: {0}")]
    Malformed(String),
    /// The response body is not the JSON the endpoint documents.
    #[error("Job API sent a malformed response to {method} {path}")]
    Json {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
        /// Where the JSON goes wrong.
        #[source]
        source: serde_json::Error,
    },
    /// The agent refused the token.
    #[error("the Job API refused BUILDKITE_AGENT_JOB_API_TOKEN (401 to {method} {path}): the hook must run inside the job whose socket and token it was given; do not set or copy these variables by hand")]
    Unauthorized {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The token would break the request's headers.
    #[error("BUILDKITE_AGENT_JOB_API_TOKEN contains a control character; it must be the token the agent set for this job")]
    BadToken,
}

/// The most a Job API response may hold (the status line and headers together, each chunk
/// size line, and the body). The whole job environment comes back from GET; 64 MiB is far above
/// any real one, and keeps a broken or hostile peer from making the hook allocate without bound.
pub const MAX_RESPONSE_BYTES: u64 = 64 << 20;

/// Most headers a response may have; the agent sends a handful.
const MAX_HEADERS: usize = 64;

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
    /// The Job API at `socket`, authenticated with `token`; nothing is connected yet.
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
        let parsed: EnvBody =
            serde_json::from_slice(&body).map_err(|source| JobApiError::Json {
                method: "GET".into(),
                path: ENV_PATH.into(),
                source,
            })?;
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
            UnixStream::connect(&self.socket).map_err(|source| JobApiError::Connect {
                socket: self.socket.clone(),
                source,
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

/// Appends one line (up to and including its `\n`) to `buf`, reading at most what is left of
/// `budget` bytes; the line's length, 0 at the end of the input.
fn read_line_bounded(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
    budget: u64,
) -> Result<usize, JobApiError> {
    let n = r.by_ref().take(budget).read_until(b'\n', buf)?;
    if n as u64 >= budget && buf.last() != Some(&b'\n') {
        return Err(JobApiError::Malformed(format!(
            "a response head or line longer than {MAX_RESPONSE_BYTES} bytes"
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

/// How the body of a response is delimited.
enum Framing {
    Length(usize),
    Chunked,
    ToEnd,
}

/// Reads the status line and headers (up to the empty line) and parses them with `httparse`.
fn read_head(r: &mut impl BufRead) -> Result<(u16, Framing), JobApiError> {
    let mut head = Vec::new();
    loop {
        let start = head.len();
        let budget = MAX_RESPONSE_BYTES - start as u64;
        if read_line_bounded(r, &mut head, budget)? == 0 {
            return Err(JobApiError::Malformed("headers cut short".into()));
        }
        // The status line is never the end; an empty line (CRLF or a bare LF) is.
        if start > 0 && matches!(&head[start..], b"\r\n" | b"\n") {
            break;
        }
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    match response.parse(&head).map_err(JobApiError::Parse)? {
        httparse::Status::Complete(_) => {}
        httparse::Status::Partial => {
            return Err(JobApiError::Malformed("headers cut short".into()))
        }
    }
    let status = response
        .code
        .ok_or_else(|| JobApiError::Malformed("no status code".into()))?;
    let mut length = None;
    let mut chunked = false;
    for h in response.headers.iter() {
        let value = String::from_utf8_lossy(h.value);
        let value = value.trim();
        if h.name.eq_ignore_ascii_case("content-length") {
            let n: u64 = value
                .parse()
                .map_err(|_| JobApiError::Malformed(format!("Content-Length {value:?}")))?;
            length = Some(within_budget(n, 0)?);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding")
            && value.to_ascii_lowercase().contains("chunked")
        {
            chunked = true;
        }
    }
    let framing = match (chunked, length) {
        (true, _) => Framing::Chunked,
        (false, Some(n)) => Framing::Length(n),
        (false, None) => Framing::ToEnd,
    };
    Ok((status, framing))
}

/// Reads one HTTP/1.1 response: status and body (Content-Length, chunked, or to EOF), each
/// part bounded by [`MAX_RESPONSE_BYTES`].
pub fn read_response(mut r: impl BufRead) -> Result<(u16, Vec<u8>), JobApiError> {
    let (status, framing) = read_head(&mut r)?;
    let mut body = Vec::new();
    match framing {
        Framing::Chunked => loop {
            let mut size_line = Vec::new();
            if read_line_bounded(&mut r, &mut size_line, MAX_RESPONSE_BYTES)? == 0 {
                return Err(JobApiError::Malformed("chunked body cut short".into()));
            }
            let size = match httparse::parse_chunk_size(&size_line) {
                Ok(httparse::Status::Complete((_, size))) => size,
                Ok(httparse::Status::Partial) => {
                    return Err(JobApiError::Malformed("chunked body cut short".into()))
                }
                Err(_) => {
                    return Err(JobApiError::Malformed(format!(
                        "chunk size {:?}",
                        String::from_utf8_lossy(&size_line).trim()
                    )))
                }
            };
            if size == 0 {
                break;
            }
            let size = within_budget(size, body.len())?;
            let start = body.len();
            body.resize(start + size, 0);
            r.read_exact(&mut body[start..])?;
            let mut crlf = [0u8; 2];
            r.read_exact(&mut crlf)?;
        },
        Framing::Length(n) => {
            body.resize(n, 0);
            r.read_exact(&mut body)?;
        }
        Framing::ToEnd => {
            r.by_ref()
                .take(MAX_RESPONSE_BYTES + 1)
                .read_to_end(&mut body)?;
            within_budget(body.len() as u64, 0)?;
        }
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
        // The socket's error is kept as the cause.
        let cause = std::error::Error::source(&e)
            .and_then(|c| c.downcast_ref::<std::io::Error>())
            .map(std::io::Error::kind);
        assert_eq!(cause, Some(std::io::ErrorKind::NotFound), "{e:?}");
    }

    #[test]
    fn heads_are_parsed_by_httparse_with_its_error_kept() {
        // Bare LF line endings and a status line without a reason phrase are HTTP/1.1 too.
        let (s, b) = read_response(&b"HTTP/1.1 204\nContent-Length: 0\n\n"[..]).unwrap();
        assert_eq!((s, b.len()), (204, 0));
        // A header line without a colon is refused, and says why.
        let e = read_response(&b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"[..]).unwrap_err();
        let JobApiError::Parse(cause) = e else {
            panic!("{e}")
        };
        assert_eq!(cause, httparse::Error::HeaderName);
        // A stream that ends inside the head.
        let e = read_response(&b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n"[..]).unwrap_err();
        assert!(matches!(e, JobApiError::Malformed(_)), "{e}");
        // Chunked wins over a Content-Length sent beside it.
        let (_, b) = read_response(
            &b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"[..],
        )
        .unwrap();
        assert_eq!(b, b"ok");
    }

    #[test]
    fn the_hooks_client_patches_reads_and_deletes_through_it() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("api.sock");
        let env = BTreeMap::from([("A".to_string(), "1".to_string())]);
        let server = kernelkite_agent::job_api::JobApiServer::start(&sock, "t0k", env).unwrap();
        let api = JobApi::new(&sock, "t0k");
        api.patch_env(&BTreeMap::from([
            ("B".to_string(), "two words".to_string()),
            ("A".to_string(), "3".to_string()),
        ]))
        .unwrap();
        assert_eq!(api.get_env().unwrap()["B"], "two words");
        api.delete_env(&["A".to_string()]).unwrap();
        let seen = server.env();
        assert_eq!(seen.get("A"), None);
        assert_eq!(seen["B"], "two words");
        let wrong = JobApi::new(&sock, "other");
        assert!(matches!(
            wrong.get_env(),
            Err(JobApiError::Unauthorized { .. })
        ));
        drop(server);
        assert!(!sock.exists(), "the socket goes with the server");
    }
}
