//! A client of the service's HTTP API, as a backend uses it: `POST /v1/submissions`, then
//! `GET /v1/submissions/{id}/events` (server-sent events, one per state change, resumed with
//! `Last-Event-ID` after a dropped connection) until the submission ends.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;

/// What went wrong talking to the service.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No answer.
    #[error("cannot reach the service at {url}")]
    Connect {
        /// What was asked.
        url: String,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// An answer that is not the expected one.
    #[error("{url} answered {status}: {message}")]
    Status {
        /// What was asked.
        url: String,
        /// The status.
        status: u16,
        /// The service's `error`, or the body.
        message: String,
    },
    /// The event stream ended without the submission ending, again and again.
    #[error("the event stream of submission {0} keeps ending before the submission does")]
    Stream(String),
}

/// One state change, as the event stream tells it.
#[derive(Debug, Clone, PartialEq)]
pub struct StateEvent {
    /// Its index in the submission's history.
    pub seq: usize,
    /// The state entered.
    pub state: String,
    /// When the service says it happened.
    pub at: Option<DateTime<Utc>>,
    /// When this client received it.
    pub received: DateTime<Utc>,
    /// The whole submission, on the terminal event.
    pub submission: Option<Value>,
}

/// A client of one service.
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    /// A client of the service at `base` (`http://127.0.0.1:8080`), with a bearer token when
    /// the service asks for one.
    pub fn new(base: &str, token: Option<String>) -> Client {
        Client {
            base: base.trim_end_matches('/').to_string(),
            token,
            http: reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(10))
                .build()
                .unwrap_or_default(),
        }
    }

    fn auth(&self, r: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    async fn check(url: &str, r: reqwest::Response) -> Result<reqwest::Response, ClientError> {
        if r.status().is_success() {
            return Ok(r);
        }
        let status = r.status().as_u16();
        let body = r.text().await.unwrap_or_default();
        let message = serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or(body);
        Err(ClientError::Status {
            url: url.to_string(),
            status,
            message,
        })
    }

    /// Submits `body` (`{"config": ..., "queue": ...}`); the new submission's id.
    pub async fn submit(&self, body: &Value) -> Result<String, ClientError> {
        let url = format!("{}/v1/submissions", self.base);
        let r = self
            .auth(self.http.post(&url).json(body))
            .send()
            .await
            .map_err(|source| ClientError::Connect {
                url: url.clone(),
                source,
            })?;
        let v: Value = Client::check(&url, r)
            .await?
            .json()
            .await
            .map_err(|source| ClientError::Connect {
                url: url.clone(),
                source,
            })?;
        v["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| ClientError::Status {
                url,
                status: 202,
                message: format!("no submission id in {v}"),
            })
    }

    /// `GET /v1/submissions/{id}`.
    pub async fn get(&self, id: &str) -> Result<Value, ClientError> {
        let url = format!("{}/v1/submissions/{id}", self.base);
        let r = self
            .auth(self.http.get(&url))
            .send()
            .await
            .map_err(|source| ClientError::Connect {
                url: url.clone(),
                source,
            })?;
        Client::check(&url, r)
            .await?
            .json()
            .await
            .map_err(|source| ClientError::Connect { url, source })
    }

    /// Follows the submission's events until it ends, calling `on_event` for each state change
    /// as it arrives; the final submission. A dropped stream is resumed where it stopped.
    pub async fn follow(
        &self,
        id: &str,
        mut on_event: impl FnMut(&StateEvent),
    ) -> Result<Value, ClientError> {
        let url = format!("{}/v1/submissions/{id}/events", self.base);
        let mut last: Option<usize> = None;
        for attempt in 0..5u32 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
            }
            let mut req = self.auth(self.http.get(&url));
            if let Some(n) = last {
                req = req.header("Last-Event-ID", n.to_string());
            }
            let r = match req.send().await {
                Ok(r) => Client::check(&url, r).await?,
                Err(_) if attempt < 4 => continue,
                Err(source) => return Err(ClientError::Connect { url, source }),
            };
            let mut r = r;
            let mut buf = String::new();
            loop {
                let chunk = match r.chunk().await {
                    Ok(Some(c)) => c,
                    Ok(None) | Err(_) => break,
                };
                buf.push_str(&String::from_utf8_lossy(&chunk));
                while let Some(end) = buf.find("\n\n") {
                    let block: String = buf.drain(..end + 2).collect();
                    if let Some(ev) = parse_event(&block) {
                        last = Some(ev.seq);
                        on_event(&ev);
                        if let Some(s) = ev.submission {
                            return Ok(s);
                        }
                    }
                }
            }
        }
        Err(ClientError::Stream(id.to_string()))
    }
}

/// One server-sent event block (`event:`, `id:`, `data:` lines; comments ignored).
fn parse_event(block: &str) -> Option<StateEvent> {
    let mut data = String::new();
    for line in block.lines() {
        if let Some(d) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(d.strip_prefix(' ').unwrap_or(d));
        }
    }
    if data.is_empty() {
        return None;
    }
    let v: Value = serde_json::from_str(&data).ok()?;
    Some(StateEvent {
        seq: v["seq"].as_u64()? as usize,
        state: v["state"].as_str()?.to_string(),
        at: v["at"]
            .as_str()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&Utc)),
        received: Utc::now(),
        submission: v.get("submission").cloned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_read_from_sse_blocks() {
        let e = parse_event(
            "event: running\nid: 2\ndata: {\"id\":\"x\",\"seq\":2,\"state\":\"running\",\"at\":\"2026-01-01T00:00:00.000001Z\"}\n\n",
        )
        .unwrap();
        assert_eq!((e.seq, e.state.as_str()), (2, "running"));
        assert!(e.at.is_some() && e.submission.is_none());
        assert!(parse_event(": keep-alive\n\n").is_none());
        // A result with line breaks comes as several data lines, joined back.
        let e = parse_event("event: succeeded\nid: 4\ndata: {\"seq\":4,\"state\":\"succeeded\",\ndata: \"submission\":{\"a\":1}}\n\n").unwrap();
        assert_eq!(e.submission, Some(serde_json::json!({"a": 1})));
    }
}
