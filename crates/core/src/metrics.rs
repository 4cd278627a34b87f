//! The service's metrics, served as Prometheus text at `GET /metrics`.
//!
//! One [`Metrics`] value per service, owned by the [`App`](crate::App) (not a process-global
//! registry), so several services in one test process count apart. Each family is created
//! here, once; the code that observes something increments the field.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A submission state, as a label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// A submission state (`queued`, ..., `timed_out`).
    pub state: String,
}

/// One slice of the fleet, as a label set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SliceLabel {
    /// The slice (its agent's name).
    pub slice: String,
    /// Its node.
    pub node: String,
    /// Its queue.
    pub queue: String,
}

/// Why a webhook was refused before its body was trusted.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `missing`, `malformed`, `bad_signature`, `stale`, `not_configured`, `too_large`, ...
    pub reason: String,
}

/// Which Buildkite API call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabel {
    /// `create_build`, `cancel_build`, `list_builds`, `list_artifacts`, `download`, ...
    pub call: String,
}

/// How something ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `delivered`, `retried`, `given_up`, ...
    pub outcome: String,
}

/// A wait in the service's queue: the queue, the class, and the user's bucket (how many of
/// that user's submissions were open when it started: `1`, `2-5`, `6-20`, `21+`; never the
/// user id, whose values are unbounded).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WaitLabel {
    /// The queue.
    pub queue: String,
    /// `admin`, `ranked` or `test`.
    pub class: String,
    /// `1`, `2-5`, `6-20`, `21+`.
    pub user_bucket: String,
}

impl WaitLabel {
    /// The bucket of a user with `open` submissions open.
    pub fn bucket(open: u64) -> &'static str {
        match open {
            0 | 1 => "1",
            2..=5 => "2-5",
            6..=20 => "6-20",
            _ => "21+",
        }
    }
}

/// A queue, and a quota's name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QuotaLabel {
    /// The queue.
    pub queue: String,
    /// `queued` or `hourly`.
    pub limit: String,
}

/// A queue.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabel {
    /// The queue.
    pub queue: String,
}

/// Queue waits: 100 ms to about 3 hours.
fn wait_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.1, 2.8, 11))
}

/// Which store operation.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    /// `insert`, `update`, `load`, ...
    pub op: String,
}

/// A label value for the HTTP edge's refusals.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub enum Refusal {
    /// Over the connection cap, every connection busy: answered `503`.
    ConnectionCap,
    /// Over the connection cap: the longest-idle connection was closed to make room.
    Evicted,
    /// A request head or body over its timeout.
    Timeout,
    /// Unauthenticated bodies over their memory bound: answered `503`.
    BodyBudget,
    /// The client took no byte of a response for KERNELKITE_WRITE_STALL_S: closed.
    WriteStall,
}

impl Refusal {
    /// The label value: `connection_cap`, `evicted`, `timeout`, `body_budget`, `write_stall`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Refusal::ConnectionCap => "connection_cap",
            Refusal::Evicted => "evicted",
            Refusal::Timeout => "timeout",
            Refusal::BodyBudget => "body_budget",
            Refusal::WriteStall => "write_stall",
        }
    }
}

impl EncodeLabelValue for Refusal {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder,
    ) -> Result<(), std::fmt::Error> {
        std::fmt::Write::write_str(encoder, self.as_str())
    }
}

/// Every metric the service exports.
pub struct Metrics {
    registry: Registry,
    /// Submissions in each state right now (in flight, and finished since start).
    pub submissions: Family<StateLabel, Gauge>,
    /// Webhooks refused, by reason.
    pub webhook_rejections: Family<ReasonLabel, Counter>,
    /// Buildkite API requests sent, by call.
    pub buildkite_calls: Family<CallLabel, Counter>,
    /// Buildkite API answers `429`, by call.
    pub buildkite_rate_limited: Family<CallLabel, Counter>,
    /// Seconds from the event that a build finished to the checked result being stored.
    pub wake_to_result_seconds: Histogram,
    /// Finished builds found by the reconciler (their webhook was lost).
    pub reconciler_finds: Counter,
    /// Callback POSTs, by outcome.
    pub callbacks: Family<OutcomeLabel, Counter>,
    /// Seconds per store operation.
    pub store_seconds: Family<OpLabel, Histogram>,
    /// Connections and requests the HTTP edge refused, by why.
    pub http_refusals: Family<RefusalLabel, Counter>,
    /// Client connections open now.
    pub connections: Gauge,
    /// The connection cap in force (KERNELKITE_MAX_CONNECTIONS, or the automatic one).
    pub connection_cap: Gauge,
    /// Time submissions waited in the service's queue before their build was created.
    pub queue_wait_seconds: Family<WaitLabel, Histogram>,
    /// Submissions refused by a per-user quota.
    pub quota_refusals: Family<QuotaLabel, Counter>,
    /// Submissions answered from the result cache.
    pub cache_hits: Family<QueueLabel, Counter>,
    /// The fleet's slices by state (`busy`, `idle`, `offline`, `quarantined`, `unknown`).
    pub fleet_slices: Family<StateLabel, Gauge>,
    /// 1 for each quarantined slice.
    pub slice_quarantined: Family<SliceLabel, Gauge>,
    /// Each slice's GPU temperature at the end of its last run, °C.
    pub slice_gpu_temperature: Family<SliceLabel, Gauge>,
    /// Each slice's last canary over its GPU model's median, in thousandths (1000: the median).
    pub slice_canary_permille: Family<SliceLabel, Gauge>,
    /// Vendors' alerts, by outcome (`sent`, `given_up`, `suppressed`, `dropped`).
    pub alerts: Family<OutcomeLabel, Counter>,
}

/// [`Refusal`] as a label set.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabel {
    /// Why.
    pub reason: Refusal,
}

fn latency_histogram() -> Histogram {
    // 50 µs .. ~26 s, doubling.
    Histogram::new(exponential_buckets(50e-6, 2.0, 20))
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    /// Creates every family and registers it under the `kernelkite` prefix.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("kernelkite");
        let m = Metrics {
            submissions: Family::default(),
            webhook_rejections: Family::default(),
            buildkite_calls: Family::default(),
            buildkite_rate_limited: Family::default(),
            wake_to_result_seconds: latency_histogram(),
            reconciler_finds: Counter::default(),
            callbacks: Family::default(),
            store_seconds: Family::new_with_constructor(latency_histogram),
            http_refusals: Family::default(),
            connections: Gauge::default(),
            connection_cap: Gauge::default(),
            queue_wait_seconds: Family::new_with_constructor(wait_histogram),
            quota_refusals: Family::default(),
            cache_hits: Family::default(),
            fleet_slices: Family::default(),
            slice_quarantined: Family::default(),
            slice_gpu_temperature: Family::default(),
            slice_canary_permille: Family::default(),
            alerts: Family::default(),
            registry: Registry::default(),
        };
        registry.register("submissions", "Submissions by state", m.submissions.clone());
        registry.register(
            "webhook_rejections",
            "Webhooks refused before their body was trusted, by reason",
            m.webhook_rejections.clone(),
        );
        registry.register(
            "buildkite_calls",
            "Buildkite API requests, by call",
            m.buildkite_calls.clone(),
        );
        registry.register(
            "buildkite_rate_limited",
            "Buildkite API 429 answers, by call",
            m.buildkite_rate_limited.clone(),
        );
        registry.register(
            "wake_to_result_seconds",
            "From a build's finish event to its checked result being stored",
            m.wake_to_result_seconds.clone(),
        );
        registry.register(
            "reconciler_finds",
            "Finished builds the reconciler found (their webhook was lost)",
            m.reconciler_finds.clone(),
        );
        registry.register(
            "callbacks",
            "Callback POSTs, by outcome",
            m.callbacks.clone(),
        );
        registry.register(
            "fleet_slices",
            "The fleet's slices by state (busy, idle, offline, quarantined, unknown)",
            m.fleet_slices.clone(),
        );
        registry.register(
            "slice_quarantined",
            "1 for each slice that ranks no run (quarantined)",
            m.slice_quarantined.clone(),
        );
        registry.register(
            "slice_gpu_temperature_celsius",
            "Each slice's GPU temperature at the end of its last run",
            m.slice_gpu_temperature.clone(),
        );
        registry.register(
            "slice_canary_permille",
            "Each slice's last canary over its GPU model's median, in thousandths",
            m.slice_canary_permille.clone(),
        );
        registry.register("alerts", "Vendors' alerts, by outcome", m.alerts.clone());
        registry.register(
            "store_seconds",
            "Store operation latency, by operation",
            m.store_seconds.clone(),
        );
        registry.register(
            "http_refusals",
            "Connections and requests refused by the HTTP edge, by reason",
            m.http_refusals.clone(),
        );
        registry.register(
            "http_connections",
            "Client connections open now",
            m.connections.clone(),
        );
        registry.register(
            "http_connection_cap",
            "Most client connections held at once",
            m.connection_cap.clone(),
        );
        registry.register(
            "queue_wait_seconds",
            "Time submissions waited in the service's queue, by queue, class and user bucket",
            m.queue_wait_seconds.clone(),
        );
        registry.register(
            "quota_refusals",
            "Submissions refused by a per-user quota (429), by queue and limit",
            m.quota_refusals.clone(),
        );
        registry.register(
            "cache_hits",
            "Submissions answered from the result cache, by queue",
            m.cache_hits.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The Prometheus text exposition of every family.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// The gauge of submissions in `state`.
    pub fn state(&self, state: &str) -> Gauge {
        self.submissions
            .get_or_create(&StateLabel {
                state: state.to_string(),
            })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_render_as_prometheus_text() {
        let m = Metrics::new();
        m.state("queued").set(3);
        m.reconciler_finds.inc();
        m.webhook_rejections
            .get_or_create(&ReasonLabel {
                reason: "bad_signature".into(),
            })
            .inc();
        m.wake_to_result_seconds.observe(0.0004);
        m.http_refusals
            .get_or_create(&RefusalLabel {
                reason: Refusal::ConnectionCap,
            })
            .inc();
        m.connections.set(7);
        let text = m.render();
        assert!(
            text.contains("kernelkite_http_refusals_total{reason=\"connection_cap\"} 1"),
            "{text}"
        );
        assert!(text.contains("kernelkite_http_connections 7"), "{text}");
        assert!(
            text.contains("kernelkite_submissions{state=\"queued\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("kernelkite_reconciler_finds_total 1"),
            "{text}"
        );
        assert!(
            text.contains("kernelkite_webhook_rejections_total{reason=\"bad_signature\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kernelkite_wake_to_result_seconds_count 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
