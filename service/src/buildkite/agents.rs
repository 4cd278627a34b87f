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
//! One fetch is one snapshot for every queue; `crate::queues::Queues` decides when to fetch.
//! Both go through the REST client's HTTP client; the agents list also spends the client's
//! shared rate budget (it counts against the same token as submissions), at the lowest
//! priority, and pages with the client's `Link` reader. These calls are not retried: a
//! failed fetch keeps the last counts until the next interval.

use serde::Deserialize;

use super::client::{next_link, BuildkiteClient};
use super::Priority;
use crate::config::Secret;
use futures_util::future::BoxFuture;

use crate::executor::{AgentCounts, AgentInfo, AgentSource, AgentsByQueue, AgentsUnavailable};

/// Most pages of the agents list read per fetch (100 agents each).
pub const MAX_PAGES: usize = 10;

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

impl AgentsError {
    /// A refusal for the token is an answer ([`AgentsUnavailable::Refused`]); the rest may
    /// pass.
    fn unavailable(self) -> AgentsUnavailable {
        match self {
            e @ AgentsError::Refused { .. } => AgentsUnavailable::Refused(e.into()),
            e => AgentsUnavailable::Failed(e.into()),
        }
    }
}

/// An agent as the REST list shows it: the fields counted, and those the fleet shows.
#[derive(Debug, Deserialize)]
struct ListedAgent {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    hostname: Option<String>,
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    paused: Option<bool>,
    #[serde(default)]
    paused_note: Option<String>,
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

fn count(agents: &[ListedAgent], into: &mut AgentsByQueue, roster: &mut Vec<AgentInfo>) {
    for a in agents {
        // The list holds connected agents only; a field saying otherwise wins.
        if a.connection_state
            .as_deref()
            .is_some_and(|s| s != "connected")
        {
            continue;
        }
        if let Some(name) = &a.name {
            roster.push(AgentInfo {
                name: name.clone(),
                queue: Some(queue_of(&a.meta_data).to_string()),
                node: a.hostname.clone(),
                busy: a.job.as_ref().is_some_and(|j| !j.is_null()),
                paused: a.paused.unwrap_or(false),
                paused_note: a.paused_note.clone(),
                version: a.version.clone(),
                tags: a.meta_data.clone(),
            });
        }
        let c = into.entry(queue_of(&a.meta_data).to_string()).or_default();
        match a.job {
            Some(ref j) if !j.is_null() => {
                c.total += 1;
                c.busy += 1;
            }
            // A paused agent takes no job (a quarantined slice's, an operator's maintenance):
            // no room for one.
            _ if a.paused == Some(true) => {}
            _ => {
                c.total += 1;
                c.idle += 1;
            }
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
    client: BuildkiteClient,
    first_page: String,
    /// The agents the last successful fetch listed.
    roster: std::sync::Mutex<Option<Vec<AgentInfo>>>,
}

impl AgentsList {
    /// For `org`, through `client` (its token, HTTP client and rate budget).
    pub fn new(client: BuildkiteClient, org: &str) -> AgentsList {
        AgentsList {
            client,
            first_page: format!("/organizations/{org}/agents?per_page=100"),
            roster: std::sync::Mutex::new(None),
        }
    }

    async fn fetch_all(&self) -> Result<AgentsByQueue, AgentsError> {
        const WHAT: &str = "GET .../agents";
        const HINT: &str = "give BUILDKITE_API_TOKEN the read_agents scope, or set BUILDKITE_AGENT_TOKEN to use the agent metrics endpoint";
        let mut counts = AgentsByQueue::new();
        let mut roster = Vec::new();
        let mut path = self.first_page.clone();
        for number in 1..=MAX_PAGES {
            // Queue status can wait: it yields to every other call in the budget.
            let sent = self
                .client
                .get_once("list_agents", Priority::Reconcile, &path)
                .await;
            let resp = checked(WHAT, sent, HINT)?;
            let next = next_link(resp.headers()).map(str::to_string);
            let agents: Vec<ListedAgent> = resp.json().await.map_err(|e| AgentsError::Decode {
                what: WHAT,
                source: e.without_url(),
            })?;
            count(&agents, &mut counts, &mut roster);
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
                Some(n) => match n.strip_prefix(self.client.base()) {
                    Some(p) if p.starts_with('/') => path = p.to_string(),
                    _ => return Err(AgentsError::ForeignLink(n)),
                },
            }
        }
        *self.roster.lock().unwrap_or_else(|e| e.into_inner()) = Some(roster);
        Ok(counts)
    }
}

impl AgentSource for AgentsList {
    fn name(&self) -> &'static str {
        "Buildkite agents list"
    }

    fn fetch(&self) -> BoxFuture<'_, Result<AgentsByQueue, AgentsUnavailable>> {
        Box::pin(async move { self.fetch_all().await.map_err(AgentsError::unavailable) })
    }

    fn roster(&self) -> Option<Vec<AgentInfo>> {
        self.roster
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
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
    /// For the agent API at `api_url` (BUILDKITE_AGENT_API_URL), with the agent token,
    /// through `http` (the REST client's: the agent API has limits of its own, so no budget).
    pub fn new(http: reqwest::Client, api_url: &str, token: Secret) -> AgentMetrics {
        AgentMetrics {
            http,
            url: format!("{}/metrics", api_url.trim_end_matches('/')),
            token,
        }
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

    fn fetch(&self) -> BoxFuture<'_, Result<AgentsByQueue, AgentsUnavailable>> {
        Box::pin(async move { self.fetch_all().await.map_err(AgentsError::unavailable) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agents_count_by_queue_tag_and_job() {
        let agents: Vec<ListedAgent> = serde_json::from_value(serde_json::json!([
            {"name": "dgx1-gpu0", "hostname": "dgx1", "version": "3.110.0", "paused": true, "connection_state": "connected", "meta_data": ["os=linux", "queue=h100"], "job": {"id": "j"}},
            {"connection_state": "connected", "meta_data": ["queue=h100"], "job": null},
            {"connection_state": "connected", "meta_data": ["queue=b200"]},
            {"connection_state": "connected", "paused": true, "meta_data": ["queue=b200"], "job": null},
            {"connection_state": "stopping", "meta_data": ["queue=h100"], "job": null},
            {"meta_data": []}
        ]))
        .unwrap();
        let mut counts = AgentsByQueue::new();
        let mut roster = Vec::new();
        count(&agents, &mut counts, &mut roster);
        // Listed one by one: those with a name, connected.
        assert_eq!(roster.len(), 1, "{roster:?}");
        let a = &roster[0];
        assert_eq!(a.name, "dgx1-gpu0");
        assert_eq!(
            (a.node.as_deref(), a.queue.as_deref()),
            (Some("dgx1"), Some("h100"))
        );
        assert!(a.busy && a.paused);
        assert_eq!(a.version.as_deref(), Some("3.110.0"));
        assert_eq!(
            counts["h100"],
            AgentCounts {
                idle: 1,
                busy: 1,
                total: 2
            }
        );
        // A paused idle agent has no room for a job.
        assert_eq!((counts["b200"].idle, counts["b200"].total), (1, 1));
        assert_eq!(counts["default"].total, 1);
        assert_eq!(counts.len(), 3);
    }
}
