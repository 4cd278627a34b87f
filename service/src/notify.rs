//! Vendors' alerts: the fleet's notices (a slice quarantined or released, offline for the
//! limit or back; `kernelkite_core::fleet::Notice`) posted to Slack-compatible incoming
//! webhooks (`{"text": …}`; Mattermost and Discord's `/slack` endpoints take the same), one
//! per vendor or node group, chosen by a pattern on the node's name.
//!
//! Never in the queue's way: the core hands notices over a broadcast channel that never blocks
//! (a notifier that falls behind loses the oldest, counted), and one task here sends them,
//! each POST bounded in time and retried a few times, then given up (logged, counted).
//! Notices that arrive together are sent together (one message per webhook, grouped by
//! node); news a webhook already had (the same kind for the same slice as the last it was
//! sent) is not sent again; and each webhook gets at most `max_per_minute` messages, what
//! comes beyond that waiting for the next minute as one digest. A webhook's URL is a secret (Slack's carry their token in the
//! path): it is never logged; log lines name the webhook by its pattern.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kernelkite_core::fleet::{Notice, NoticeKind};
use kernelkite_core::metrics::OutcomeLabel;
use tokio::sync::broadcast;

use crate::app::App;
use secrecy::{ExposeSecret as _, SecretString};

/// Notices arriving within this long of the first go out in one message.
const BATCH: Duration = Duration::from_secs(1);
/// One POST's limit.
const POST_TIMEOUT: Duration = Duration::from_secs(5);
/// Tries of one message before it is given up.
const TRIES: u32 = 3;
/// Lines in one message at most; the rest are counted.
const MAX_LINES: usize = 20;

/// One webhook and the nodes whose notices it gets.
#[derive(Clone)]
pub struct Route {
    /// A node name pattern: `*` matches any run of characters (`dgx-*`, `*`).
    pub pattern: String,
    /// The incoming webhook.
    pub url: SecretString,
}

/// Every webhook, as `KERNELKITE_ALERT_WEBHOOKS` lists them.
#[derive(Clone, Default)]
pub struct Routes(pub Vec<Route>);

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URLs are secrets: only the patterns are shown.
        f.debug_list()
            .entries(self.0.iter().map(|r| &r.pattern))
            .finish()
    }
}

impl Routes {
    /// `PATTERN=URL` pairs separated by `;`, spaces or new lines (empty: none). A URL must be
    /// http(s), and a pattern holds no `:` or `/` (so a URL given without its pattern is
    /// refused, not read as one). Errors name an item by its position, never by its text:
    /// it may hold a webhook's secret.
    pub fn parse(text: &str) -> Result<Routes, String> {
        let mut out = Vec::new();
        for (i, item) in text
            .split(|c: char| c == ';' || c.is_whitespace())
            .filter(|s| !s.is_empty())
            .enumerate()
        {
            let n = i + 1;
            let (pattern, url) = match item.split_once('=') {
                Some((p, u)) if !p.is_empty() && !p.contains([':', '/']) => (p, u),
                _ => {
                    return Err(format!(
                        "item {n} is not PATTERN=URL (a node name pattern, `*` for every node, `=`, then the incoming webhook's URL); items are separated by `;` (the value is not shown: it holds secrets)"
                    ))
                }
            };
            let parsed = url::Url::parse(url).map_err(|_| {
                format!("item {n}: the webhook is not a URL (it is not shown: it is a secret)")
            })?;
            if !matches!(parsed.scheme(), "http" | "https") {
                return Err(format!("item {n}: the webhook must be an http(s) URL"));
            }
            out.push(Route {
                pattern: pattern.to_string(),
                url: SecretString::from(url.to_string()),
            });
        }
        Ok(Routes(out))
    }
}

/// Whether `name` matches `pattern` (`*`: any run of characters, anything else itself).
pub fn matches(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// What a message looks like: one line per notice, grouped by node.
pub fn compose(notices: &[Notice], dashboard: Option<&str>) -> String {
    let mut by_node: BTreeMap<&str, Vec<&Notice>> = BTreeMap::new();
    for n in notices {
        by_node
            .entry(n.node.as_deref().unwrap_or("unknown node"))
            .or_default()
            .push(n);
    }
    let mut lines = Vec::new();
    for (node, ns) in by_node {
        for n in ns {
            let mark = match n.kind {
                NoticeKind::Quarantined => "🚫",
                NoticeKind::Released | NoticeKind::Online | NoticeKind::UpToDate => "✅",
                NoticeKind::Offline => "📴",
                NoticeKind::Outdated => "⚠️",
            };
            lines.push(format!(
                "{mark} {}: {}",
                slack_text(node, 64),
                slack_text(&n.text, 300)
            ));
        }
    }
    let more = lines.len().saturating_sub(MAX_LINES);
    lines.truncate(MAX_LINES);
    let mut text = format!("kernelkite fleet\n{}", lines.join("\n"));
    if more > 0 {
        text.push_str(&format!("\n… and {more} more"));
    }
    if let Some(d) = dashboard {
        text.push_str(&format!("\n{d}"));
    }
    text
}

/// A node-given string as Slack message text: its control characters dropped, cut at `most`
/// characters, and `&`, `<`, `>` escaped as Slack asks, so no mention (`<!channel>`), link or
/// formatting of a node's or an operator's making goes out.
fn slack_text(s: &str, most: usize) -> String {
    let mut out = String::new();
    for c in s.chars().filter(|c| !c.is_control()).take(most) {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            c => out.push(c),
        }
    }
    out
}

/// One webhook's state: what waits, what was sent.
pub struct Channel {
    route: Route,
    waiting: Vec<Notice>,
    sent_at: VecDeque<Instant>,
    /// The last news sent for each slice: the same news again is not sent.
    last: HashMap<String, NoticeKind>,
}

impl Channel {
    /// A webhook with nothing sent yet.
    pub fn new(route: Route) -> Channel {
        Channel {
            route,
            waiting: Vec::new(),
            sent_at: VecDeque::new(),
            last: HashMap::new(),
        }
    }

    /// Takes `n` when its node (or slice) matches the webhook's pattern; `false` when it is
    /// news the webhook already had (the last notice sent for the slice was of its kind, and
    /// none waits), which is dropped.
    pub fn offer(&mut self, n: &Notice) -> Option<bool> {
        let node = n.node.as_deref().unwrap_or("");
        if !(matches(&self.route.pattern, node) || matches(&self.route.pattern, &n.slice)) {
            return None;
        }
        let pending = self.waiting.iter().any(|w| w.slice == n.slice);
        if !pending && self.last.get(&n.slice) == Some(&n.kind) {
            return Some(false);
        }
        self.waiting.push(n.clone());
        Some(true)
    }

    /// What to send now: everything waiting, unless `per_window` messages went out in the
    /// last `window` (then it keeps waiting, to go out as one digest when one may).
    pub fn due(
        &mut self,
        now: Instant,
        per_window: usize,
        window: Duration,
    ) -> Option<Vec<Notice>> {
        if self.waiting.is_empty() {
            return None;
        }
        while self
            .sent_at
            .front()
            .is_some_and(|t| now.duration_since(*t) >= window)
        {
            self.sent_at.pop_front();
        }
        if self.sent_at.len() >= per_window {
            return None;
        }
        self.sent_at.push_back(now);
        let out = std::mem::take(&mut self.waiting);
        for n in &out {
            self.last.insert(n.slice.clone(), n.kind);
        }
        Some(out)
    }
}

/// Sends the core's notices to the webhooks until the core is dropped.
pub fn spawn(app: &Arc<App>, routes: Routes, max_per_minute: u32, public_url: Option<String>) {
    if routes.0.is_empty() {
        return;
    }
    let rx = app.notices();
    let metrics = app.metrics().clone();
    // Every outcome's series from the start, at zero: a rate over it sees the first one.
    for outcome in ["sent", "given_up", "suppressed", "dropped"] {
        metrics
            .alerts
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc_by(0);
    }
    let dashboard = public_url.map(|u| format!("{}/dashboard", u.trim_end_matches('/')));
    let http = match reqwest::Client::builder()
        .timeout(POST_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "alerts are off: no HTTP client");
            return;
        }
    };
    tracing::info!(webhooks = ?routes, "vendor alerts on");
    let channels = routes.0.into_iter().map(Channel::new).collect();
    tokio::spawn(run(
        rx,
        channels,
        max_per_minute.max(1) as usize,
        dashboard,
        http,
        metrics,
    ));
}

async fn run(
    mut rx: broadcast::Receiver<Notice>,
    mut channels: Vec<Channel>,
    per_minute: usize,
    dashboard: Option<String>,
    http: reqwest::Client,
    metrics: Arc<kernelkite_core::metrics::Metrics>,
) {
    let count = |outcome: &str, n: u64| {
        metrics
            .alerts
            .get_or_create(&OutcomeLabel {
                outcome: outcome.into(),
            })
            .inc_by(n);
    };
    loop {
        // Wait for a notice, or (while a digest is held) look again each second.
        let held = channels.iter().any(|c| !c.waiting.is_empty());
        let first = if held {
            tokio::time::timeout(Duration::from_secs(1), rx.recv())
                .await
                .ok()
        } else {
            Some(rx.recv().await)
        };
        let mut batch = Vec::new();
        match first {
            Some(Ok(n)) => batch.push(n),
            Some(Err(broadcast::error::RecvError::Lagged(k))) => {
                tracing::warn!(
                    lost = k,
                    "alerts fell behind the fleet; the oldest were not sent"
                );
                count("dropped", k);
            }
            Some(Err(broadcast::error::RecvError::Closed)) => return,
            None => {}
        }
        if !batch.is_empty() {
            let until = tokio::time::Instant::now() + BATCH;
            while let Ok(Ok(n)) = tokio::time::timeout_at(until, rx.recv()).await {
                batch.push(n);
            }
        }
        for ch in &mut channels {
            for n in &batch {
                if ch.offer(n) == Some(false) {
                    count("suppressed", 1);
                }
            }
            let Some(notices) = ch.due(Instant::now(), per_minute, Duration::from_secs(60)) else {
                continue;
            };
            let text = compose(&notices, dashboard.as_deref());
            match post(&http, &ch.route, &text).await {
                Ok(()) => count("sent", 1),
                Err(why) => {
                    tracing::warn!(webhook = %ch.route.pattern, %why, "could not post an alert; given up");
                    count("given_up", 1);
                }
            }
        }
    }
}

/// Posts `text`, tried [`TRIES`] times (a 4xx other than 429 is not tried again).
async fn post(http: &reqwest::Client, route: &Route, text: &str) -> Result<(), String> {
    let body = serde_json::json!({ "text": text });
    let mut last = String::new();
    for attempt in 0..TRIES {
        if attempt > 0 {
            tokio::time::sleep(Duration::from_millis(500 << attempt)).await;
        }
        match http
            .post(route.url.expose_secret())
            .json(&body)
            .send()
            .await
        {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => {
                last = format!("the webhook answered {}", r.status());
                if r.status().is_client_error() && r.status().as_u16() != 429 {
                    return Err(last);
                }
            }
            // Without the URL: reqwest's errors name it.
            Err(e) => last = format!("no answer ({})", error_kind(&e)),
        }
    }
    Err(last)
}

fn error_kind(e: &reqwest::Error) -> &'static str {
    if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else {
        "failed"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notice(slice: &str, kind: NoticeKind) -> Notice {
        Notice {
            slice: slice.into(),
            node: Some(format!("node-{}", &slice[..1])),
            kind,
            text: format!("{slice} {kind:?}"),
        }
    }

    #[test]
    fn news_a_webhook_had_is_dropped_and_other_nodes_are_not_its() {
        let mut ch = Channel::new(Route {
            pattern: "node-a".into(),
            url: SecretString::from("http://127.0.0.1:9/x".to_string()),
        });
        let t0 = Instant::now();
        assert_eq!(ch.offer(&notice("a1", NoticeKind::Quarantined)), Some(true));
        assert_eq!(ch.offer(&notice("b1", NoticeKind::Quarantined)), None);
        assert_eq!(
            ch.due(t0, 6, Duration::from_secs(60)).map(|v| v.len()),
            Some(1)
        );
        // The same news again: dropped; other news for the slice: taken.
        assert_eq!(
            ch.offer(&notice("a1", NoticeKind::Quarantined)),
            Some(false)
        );
        assert_eq!(ch.offer(&notice("a1", NoticeKind::Released)), Some(true));
        // While a change waits, the one after it is taken too (the vendor hears both).
        assert_eq!(ch.offer(&notice("a1", NoticeKind::Quarantined)), Some(true));
        assert_eq!(
            ch.due(t0, 6, Duration::from_secs(60)).map(|v| v.len()),
            Some(2)
        );
    }

    #[test]
    fn over_the_limit_notices_wait_and_go_out_as_one_digest() {
        let mut ch = Channel::new(Route {
            pattern: "*".into(),
            url: SecretString::from("http://127.0.0.1:9/x".to_string()),
        });
        let t0 = Instant::now();
        let minute = Duration::from_secs(60);
        for (i, s) in ["a1", "a2"].iter().enumerate() {
            ch.offer(&notice(s, NoticeKind::Offline));
            assert!(ch
                .due(t0 + Duration::from_secs(i as u64), 2, minute)
                .is_some());
        }
        for s in ["a3", "a4", "a5"] {
            ch.offer(&notice(s, NoticeKind::Offline));
            assert!(
                ch.due(t0 + Duration::from_secs(10), 2, minute).is_none(),
                "held"
            );
        }
        // The first message's minute passed: the held three go out together.
        let digest = ch.due(t0 + Duration::from_secs(60), 2, minute).unwrap();
        assert_eq!(digest.len(), 3);
        assert!(
            ch.due(t0 + Duration::from_secs(61), 2, minute).is_none(),
            "nothing waits"
        );
    }

    #[test]
    fn node_given_text_cannot_mention_link_or_flood() {
        let n = Notice {
            slice: "s".into(),
            node: Some("<!channel>".into()),
            kind: NoticeKind::Offline,
            text: format!("<https://x.example|click> & more\n{}", "x".repeat(1000)),
        };
        let text = compose(&[n], None);
        assert!(!text.contains('<') && !text.contains("|click>"), "{text}");
        assert!(
            text.contains("&lt;!channel&gt;") && text.contains("&amp; more"),
            "{text}"
        );
        assert!(text.len() < 500, "cut: {}", text.len());
    }

    #[test]
    fn patterns_match_node_names() {
        assert!(matches("*", "anything"));
        assert!(matches("dgx-*", "dgx-01"));
        assert!(!matches("dgx-*", "mi300-01"));
        assert!(matches("*-amd", "node7-amd"));
        assert!(matches("a*b*c", "axxbyyc"));
        assert!(!matches("a*b*c", "axxc"));
        assert!(matches("exact", "exact"));
        assert!(!matches("exact", "exactly"));
    }

    #[test]
    fn routes_parse_and_never_show_their_urls() {
        let r = Routes::parse("dgx-*=https://hooks.slack.test/T/B/secret; *=http://127.0.0.1:9/x")
            .unwrap();
        assert_eq!(r.0.len(), 2);
        assert_eq!(r.0[0].pattern, "dgx-*");
        let shown = format!("{r:?}");
        assert!(
            !shown.contains("secret") && shown.contains("dgx-*"),
            "{shown}"
        );
        for bad in [
            "nourl",
            "x=ftp://a/T0KEN",
            "=https://a/T0KEN",
            "x=T0KEN-not-a-url",
            // A URL without its pattern, whose query has an `=`: not read as a pattern.
            "https://discord.example/api/webhooks/1/T0KEN/slack?wait=true",
        ] {
            let e = Routes::parse(bad).unwrap_err();
            assert!(!e.contains("T0KEN"), "the URL is not repeated: {e}");
        }
        assert!(Routes::parse("").unwrap().0.is_empty());
    }

    #[test]
    fn a_message_groups_by_node_and_counts_what_it_leaves_out() {
        let n = |node: &str, slice: &str, kind| Notice {
            slice: slice.into(),
            node: Some(node.into()),
            kind,
            text: format!("{slice} changed"),
        };
        let text = compose(
            &[
                n("b", "b-1", NoticeKind::Offline),
                n("a", "a-1", NoticeKind::Quarantined),
            ],
            Some("https://k.example/dashboard"),
        );
        assert_eq!(
            text,
            "kernelkite fleet\n🚫 a: a-1 changed\n📴 b: b-1 changed\nhttps://k.example/dashboard"
        );
        let many: Vec<Notice> = (0..25)
            .map(|i| n("a", &format!("a-{i:02}"), NoticeKind::Offline))
            .collect();
        assert!(compose(&many, None).ends_with("… and 5 more"));
    }
}
