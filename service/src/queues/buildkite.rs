//! Buildkite's agents, counted by queue: the REST agents list, or the agent API's metrics.
//!
//! - [`AgentsList`]: `GET /v2/organizations/{org}/agents?per_page=100`, following the `Link`
//!   header's `rel="next"` (at most [`MAX_PAGES`] pages, 100 agents each). Buildkite lists only
//!   connected agents; an agent's queue is its `queue=<q>` tag in `meta_data` (none: the
//!   `default` queue); it is busy when its `job` is not null. Needs `read_agents` on
//!   BUILDKITE_API_TOKEN.
//! - [`AgentMetrics`]: `GET <agent api>/metrics` with `Authorization: Token <agent token>`: idle,
//!   busy and total agents per queue of the token's cluster, in one call.
//!
//! One fetch is one snapshot for every queue; [`super::Queues`] decides when to fetch. These
//! calls are not retried: a failed fetch keeps the last counts until the next interval.

use std::time::Duration;

use serde::Deserialize;

use super::{AgentCounts, AgentSource, AgentsByQueue};
use crate::config::{Config, Secret};
use crate::executor::BoxFuture;
use crate::report::BoxError;

/// Most pages of the agents list read per fetch (100 agents each).
pub const MAX_PAGES: usize = 10;

fn http_client(cfg: &Config) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(Duration::from_secs(5).min(cfg.http_timeout()))
        .timeout(cfg.http_timeout())
        .build()
}

/// Why agent counts could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum AgentsError {
    /// No answer.
    #[error("could not reach Buildkite for {what}")]
    Transport {
        /// Which call.
        what: &'static str,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// Refused for the token.
    #[error("Buildkite answered {status} to {what}; {hint}")]
    Refused {
        /// Which call.
        what: &'static str,
        /// The answer's status.
        status: reqwest::StatusCode,
        /// What to do about it.
        hint: &'static str,
    },
    /// Another error status.
    #[error("Buildkite answered {status} to {what}")]
    Status {
        /// Which call.
        what: &'static str,
        /// The answer's status.
        status: reqwest::StatusCode,
    },
    /// An answer that is not the documented JSON.
    #[error("Buildkite's answer to {what} is not what its API documents")]
    Decode {
        /// Which call.
        what: &'static str,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// A `Link` to a page outside the API base URL.
    #[error("the agents list links to {0:?}, outside BUILDKITE_API_URL; not following it with the token")]
    ForeignLink(String),
}

/// An agent as the REST list shows it: the fields counted.
#[derive(Debug, Deserialize)]
struct ListedAgent {
    #[serde(default)]
    connection_state: Option<String>,
    #[serde(default)]
    meta_data: Vec<String>,
    #[serde(default)]
    job: Option<serde_json::Value>,
}

/// The queue an agent serves: its `queue=` tag, else Buildkite's `default`.
fn queue_of(meta_data: &[String]) -> &str {
    meta_data
        .iter()
        .find_map(|t| t.strip_prefix("queue="))
        .unwrap_or("default")
}

/// The `rel="next"` URL of a `Link` header.
pub fn next_link(link: &str) -> Option<&str> {
    link.split(',').find_map(|part| {
        let (url, params) = part.split_once(';')?;
        let is_next = params
            .split(';')
            .any(|p| matches!(p.trim(), "rel=\"next\"" | "rel=next"));
        let url = url.trim().strip_prefix('<')?.strip_suffix('>')?;
        is_next.then_some(url)
    })
}

fn count(agents: &[ListedAgent], into: &mut AgentsByQueue) {
    for a in agents {
        // The list holds connected agents only; a field saying otherwise wins.
        if a.connection_state
            .as_deref()
            .is_some_and(|s| s != "connected")
        {
            continue;
        }
        let c = into.entry(queue_of(&a.meta_data).to_string()).or_default();
        c.total += 1;
        match a.job {
            Some(ref j) if !j.is_null() => c.busy += 1,
            _ => c.idle += 1,
        }
    }
}

fn checked(
    what: &'static str,
    sent: Result<reqwest::Response, reqwest::Error>,
    hint: &'static str,
) -> Result<reqwest::Response, AgentsError> {
    let resp = sent.map_err(|e| AgentsError::Transport {
        what,
        source: e.without_url(),
    })?;
    match resp.status() {
        s if s.is_success() => Ok(resp),
        s @ (reqwest::StatusCode::UNAUTHORIZED | reqwest::StatusCode::FORBIDDEN) => {
            Err(AgentsError::Refused {
                what,
                status: s,
                hint,
            })
        }
        s => Err(AgentsError::Status { what, status: s }),
    }
}

/// Agent counts from the REST agents list.
#[derive(Debug)]
pub struct AgentsList {
    http: reqwest::Client,
    base: String,
    first_page: String,
    token: Secret,
}

impl AgentsList {
    /// For the configured organization, with BUILDKITE_API_TOKEN.
    pub fn new(cfg: &Config) -> Result<AgentsList, reqwest::Error> {
        let base = cfg.buildkite_api_url.trim_end_matches('/').to_string();
        Ok(AgentsList {
            http: http_client(cfg)?,
            first_page: format!(
                "{base}/organizations/{}/agents?per_page=100",
                cfg.buildkite_org
            ),
            base,
            token: cfg.buildkite_api_token.clone(),
        })
    }

    async fn fetch_all(&self) -> Result<AgentsByQueue, AgentsError> {
        const WHAT: &str = "GET .../agents";
        const HINT: &str = "give BUILDKITE_API_TOKEN the read_agents scope, or set BUILDKITE_AGENT_TOKEN to use the agent metrics endpoint";
        let mut counts = AgentsByQueue::new();
        let mut url = self.first_page.clone();
        for number in 1..=MAX_PAGES {
            let sent = self
                .http
                .get(&url)
                .bearer_auth(self.token.expose())
                .send()
                .await;
            let resp = checked(WHAT, sent, HINT)?;
            let next = resp
                .headers()
                .get(reqwest::header::LINK)
                .and_then(|v| v.to_str().ok())
                .and_then(next_link)
                .map(str::to_string);
            let agents: Vec<ListedAgent> = resp.json().await.map_err(|e| AgentsError::Decode {
                what: WHAT,
                source: e.without_url(),
            })?;
            count(&agents, &mut counts);
            match next {
                None => break,
                Some(_) if number == MAX_PAGES => {
                    tracing::warn!(
                        "more than {} agents: queue status counts the first {}",
                        MAX_PAGES * 100,
                        MAX_PAGES * 100
                    );
                }
                // The token goes only below the API base URL (as with artifact downloads).
                Some(n)
                    if n.strip_prefix(&self.base)
                        .is_some_and(|p| p.starts_with('/')) =>
                {
                    url = n
                }
                Some(n) => return Err(AgentsError::ForeignLink(n)),
            }
        }
        Ok(counts)
    }
}

impl AgentSource for AgentsList {
    fn name(&self) -> &'static str {
        "Buildkite agents list"
    }

    fn fetch(&self) -> BoxFuture<'_, Result<AgentsByQueue, BoxError>> {
        Box::pin(async move { self.fetch_all().await.map_err(Into::into) })
    }
}

/// Agent counts from the agent API's metrics endpoint.
#[derive(Debug)]
pub struct AgentMetrics {
    http: reqwest::Client,
    url: String,
    token: Secret,
}

#[derive(Debug, Deserialize)]
struct MetricsBody {
    agents: MetricsAgents,
}

#[derive(Debug, Deserialize)]
struct MetricsAgents {
    #[serde(default)]
    queues: std::collections::HashMap<String, QueueAgents>,
}

#[derive(Debug, Deserialize)]
struct QueueAgents {
    #[serde(default)]
    idle: u64,
    #[serde(default)]
    busy: u64,
    #[serde(default)]
    total: u64,
}

impl AgentMetrics {
    /// For BUILDKITE_AGENT_API_URL, with the agent token.
    pub fn new(cfg: &Config, token: Secret) -> Result<AgentMetrics, reqwest::Error> {
        Ok(AgentMetrics {
            http: http_client(cfg)?,
            url: format!(
                "{}/metrics",
                cfg.queues.buildkite_agent_api_url.trim_end_matches('/')
            ),
            token,
        })
    }

    async fn fetch_all(&self) -> Result<AgentsByQueue, AgentsError> {
        const WHAT: &str = "GET <agent api>/metrics";
        let sent = self
            .http
            .get(&self.url)
            .header(
                reqwest::header::AUTHORIZATION,
                format!("Token {}", self.token.expose()),
            )
            .send()
            .await;
        let resp = checked(
            WHAT,
            sent,
            "check BUILDKITE_AGENT_TOKEN (an agent token of the cluster that serves the queues)",
        )?;
        let body: MetricsBody = resp.json().await.map_err(|e| AgentsError::Decode {
            what: WHAT,
            source: e.without_url(),
        })?;
        Ok(body
            .agents
            .queues
            .into_iter()
            .map(|(q, a)| {
                let counts = AgentCounts {
                    idle: a.idle,
                    busy: a.busy,
                    total: a.total.max(a.idle + a.busy),
                };
                (q, counts)
            })
            .collect())
    }
}

impl AgentSource for AgentMetrics {
    fn name(&self) -> &'static str {
        "Buildkite agent metrics"
    }

    fn fetch(&self) -> BoxFuture<'_, Result<AgentsByQueue, BoxError>> {
        Box::pin(async move { self.fetch_all().await.map_err(Into::into) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_link_reads_rel_next_only() {
        let h = r#"<https://api.buildkite.com/v2/organizations/o/agents?page=2&per_page=100>; rel="next", <https://api.buildkite.com/v2/organizations/o/agents?page=9&per_page=100>; rel="last""#;
        assert_eq!(
            next_link(h),
            Some("https://api.buildkite.com/v2/organizations/o/agents?page=2&per_page=100")
        );
        let last_page =
            r#"<https://x/v2/a?page=1>; rel="first", <https://x/v2/a?page=8>; rel="prev""#;
        assert_eq!(next_link(last_page), None);
        assert_eq!(next_link(""), None);
        assert_eq!(next_link("garbage; rel=\"next\""), None);
    }

    #[test]
    fn agents_count_by_queue_tag_and_job() {
        let agents: Vec<ListedAgent> = serde_json::from_value(serde_json::json!([
            {"connection_state": "connected", "meta_data": ["os=linux", "queue=h100"], "job": {"id": "j"}},
            {"connection_state": "connected", "meta_data": ["queue=h100"], "job": null},
            {"connection_state": "connected", "meta_data": ["queue=b200"]},
            {"connection_state": "stopping", "meta_data": ["queue=h100"], "job": null},
            {"meta_data": []}
        ]))
        .unwrap();
        let mut counts = AgentsByQueue::new();
        count(&agents, &mut counts);
        assert_eq!(
            counts["h100"],
            AgentCounts {
                idle: 1,
                busy: 1,
                total: 2
            }
        );
        assert_eq!(counts["b200"].idle, 1);
        assert_eq!(counts["default"].total, 1);
        assert_eq!(counts.len(), 3);
    }
}
