//! Buildkite webhooks: verifying them (before anything reads the body) and reading the
//! few fields the service acts on.
//!
//! Buildkite signs with `X-Buildkite-Signature: timestamp=<unix s>,signature=<hex>`, where the
//! signature is HMAC-SHA256, keyed by the webhook token, over `"<timestamp>." + body`. The MAC
//! is compared in constant time, then the timestamp must be within the window (replays).

use hmac::{Hmac, Mac};
use reqwest::header::HeaderMap;
use serde::Deserialize;
use sha2::Sha256;

use crate::config::{Config, Secret};
use crate::executor::{BuildEvent, BuildEventKind, BuildStatus};

/// Buildkite's signature header: `timestamp=<unix s>,signature=<hex HMAC-SHA256>`.
pub const HEADER_SIGNATURE: &str = "x-buildkite-signature";
/// Buildkite's plain-token header (the webhook's token in clear).
pub const HEADER_TOKEN: &str = "x-buildkite-token";
/// The event's name (`build.finished`, ...), also in the body.
pub const HEADER_EVENT: &str = "x-buildkite-event";

/// A parsed `X-Buildkite-Signature`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignatureHeader {
    /// Unix seconds the delivery was signed at.
    pub timestamp: i64,
    /// The HMAC-SHA256.
    pub signature: [u8; 32],
}

/// Why a webhook was refused. None of these reveal which part of a MAC was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// BUILDKITE_WEBHOOK_TOKEN is unset (or empty): nothing can be verified.
    #[error("no webhook token is configured; set BUILDKITE_WEBHOOK_TOKEN to accept webhooks")]
    NotConfigured,
    /// Neither a signature nor a token.
    #[error("missing X-Buildkite-Signature header")]
    Missing,
    /// The signature header does not parse.
    #[error("malformed X-Buildkite-Signature header: {0}")]
    Malformed(&'static str),
    /// The MAC is wrong (another key, or a changed body or timestamp).
    #[error("signature does not match")]
    BadSignature,
    /// Signed too long ago, or in the future: a replay.
    #[error("signature timestamp is outside the allowed window")]
    Stale,
    /// The plain token is wrong.
    #[error("X-Buildkite-Token does not match")]
    BadToken,
    /// A plain token, which is not accepted unless configured.
    #[error("plain X-Buildkite-Token webhooks are not accepted; configure the webhook to sign (or set KERNELKITE_ALLOW_PLAIN_WEBHOOK_TOKEN)")]
    PlainTokenRefused,
}

impl AuthError {
    /// The reason as a metric label: `not_configured`, `missing`, `malformed`,
    /// `bad_signature`, `stale`, `bad_token`, `plain_token_refused`.
    pub fn reason(&self) -> &'static str {
        match self {
            AuthError::NotConfigured => "not_configured",
            AuthError::Missing => "missing",
            AuthError::Malformed(_) => "malformed",
            AuthError::BadSignature => "bad_signature",
            AuthError::Stale => "stale",
            AuthError::BadToken => "bad_token",
            AuthError::PlainTokenRefused => "plain_token_refused",
        }
    }
}

/// Parses `timestamp=<digits>,signature=<64 hex>` (order free, surrounding spaces allowed).
///
/// Written by hand: the format is Buildkite's own (not RFC 9421 or any header grammar a crate
/// parses), and verifying it needs exactly these checks (one of each key, bounded lengths,
/// digits only) before any MAC is computed.
pub fn parse_signature_header(value: &str) -> Result<SignatureHeader, AuthError> {
    if value.len() > 256 {
        return Err(AuthError::Malformed("too long"));
    }
    let mut timestamp = None;
    let mut signature = None;
    for part in value.split(',') {
        let (k, v) = part
            .split_once('=')
            .ok_or(AuthError::Malformed("expected key=value pairs"))?;
        match k.trim() {
            "timestamp" => {
                let v = v.trim();
                if timestamp.is_some() {
                    return Err(AuthError::Malformed("timestamp given twice"));
                }
                if v.is_empty() || v.len() > 12 || !v.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(AuthError::Malformed("timestamp must be unix seconds"));
                }
                timestamp = Some(
                    v.parse::<i64>()
                        .map_err(|_| AuthError::Malformed("timestamp must be unix seconds"))?,
                );
            }
            "signature" => {
                if signature.is_some() {
                    return Err(AuthError::Malformed("signature given twice"));
                }
                let mut out = [0u8; 32];
                hex::decode_to_slice(v.trim(), &mut out)
                    .map_err(|_| AuthError::Malformed("signature must be 64 hex digits"))?;
                signature = Some(out);
            }
            _ => {} // Unknown keys are tolerated, as Buildkite may add some.
        }
    }
    Ok(SignatureHeader {
        timestamp: timestamp.ok_or(AuthError::Malformed("no timestamp"))?,
        signature: signature.ok_or(AuthError::Malformed("no signature"))?,
    })
}

/// How webhooks are authenticated.
#[derive(Clone, Debug)]
pub struct WebhookAuth {
    /// The webhook's token (the HMAC key). `None`: every webhook is refused.
    pub token: Option<Secret>,
    /// Also accept the token in clear (`X-Buildkite-Token`).
    pub allow_plain_token: bool,
    /// Largest age (either way) of a signed delivery, seconds.
    pub window_s: u64,
}

impl WebhookAuth {
    /// Everything that can be checked before the body is read: a token is configured, a
    /// signature header is present and well-formed and its timestamp inside the window (or
    /// a plain token, when allowed, is right). A delivery that fails here is refused without
    /// reading its body; one that passes still needs [`WebhookAuth::verify`] on the body.
    pub fn precheck(&self, headers: &HeaderMap, now: i64) -> Result<(), AuthError> {
        self.check(headers, None, now)
    }

    /// Verifies a delivery. `now` is unix seconds (injected so tests can move the clock).
    pub fn verify(&self, headers: &HeaderMap, body: &[u8], now: i64) -> Result<(), AuthError> {
        self.check(headers, Some(body), now)
    }

    /// [`WebhookAuth::verify`], or [`WebhookAuth::precheck`] when there is no body yet (the
    /// MAC is then left for later).
    fn check(&self, headers: &HeaderMap, body: Option<&[u8]>, now: i64) -> Result<(), AuthError> {
        // An empty key is public: anyone could sign with it. Treated as no key (fail closed).
        let token = self
            .token
            .as_ref()
            .filter(|t| !t.expose().is_empty())
            .ok_or(AuthError::NotConfigured)?;
        if let Some(sig) = headers.get(HEADER_SIGNATURE) {
            let sig = sig
                .to_str()
                .map_err(|_| AuthError::Malformed("not ASCII"))?;
            let parsed = parse_signature_header(sig)?;
            // The MAC before the age: a forged delivery is called forged, however old.
            if let Some(body) = body {
                let mut mac = Hmac::<Sha256>::new_from_slice(token.expose().as_bytes())
                    .map_err(|_| AuthError::NotConfigured)?;
                mac.update(parsed.timestamp.to_string().as_bytes());
                mac.update(b".");
                mac.update(body);
                mac.verify_slice(&parsed.signature)
                    .map_err(|_| AuthError::BadSignature)?;
            }
            if now.abs_diff(parsed.timestamp) > self.window_s {
                return Err(AuthError::Stale);
            }
            return Ok(());
        }
        if let Some(plain) = headers.get(HEADER_TOKEN) {
            if !self.allow_plain_token {
                return Err(AuthError::PlainTokenRefused);
            }
            return if token.matches(plain.as_bytes()) {
                Ok(())
            } else {
                Err(AuthError::BadToken)
            };
        }
        Err(AuthError::Missing)
    }
}

/// What a verified delivery says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// Buildkite checking the endpoint.
    Ping,
    /// A build event of this pipeline.
    Build(BuildEvent),
    /// An event the service does not act on (`job.*`, `build.failing`, ...).
    Ignored(String),
}

/// A verified body that is not a usable event.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// Not the JSON of an event.
    #[error("webhook body is not a Buildkite event")]
    Json(#[from] serde_json::Error),
    /// A build event without the build's id, number and state.
    #[error("webhook event {0:?} has no build object with id, number and state")]
    NoBuild(String),
    /// The header and the body name different events.
    #[error("X-Buildkite-Event {header:?} disagrees with the body's event {body:?}")]
    Mismatch {
        /// `X-Buildkite-Event`.
        header: String,
        /// The body's `event`.
        body: String,
    },
}

/// Why a delivery was not taken.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// Not from Buildkite (or not verifiable).
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// From Buildkite, but not an event.
    #[error(transparent)]
    Parse(#[from] ParseError),
}

/// The receiving end of the pipeline's webhook: verifies a delivery, then reads it.
#[derive(Clone, Debug)]
pub struct WebhookReceiver {
    /// How deliveries are authenticated.
    pub auth: WebhookAuth,
    /// The pipeline whose build events are acted on.
    pub pipeline: String,
}

impl WebhookReceiver {
    /// The receiver the configuration describes: BUILDKITE_WEBHOOK_TOKEN,
    /// KERNELKITE_ALLOW_PLAIN_WEBHOOK_TOKEN, KERNELKITE_WEBHOOK_WINDOW_S, BUILDKITE_PIPELINE.
    pub fn from_config(cfg: &Config) -> WebhookReceiver {
        WebhookReceiver {
            auth: WebhookAuth {
                token: cfg.buildkite.buildkite_webhook_token.clone(),
                allow_plain_token: cfg.buildkite.allow_plain_webhook_token,
                window_s: cfg.buildkite.webhook_window_s,
            },
            pipeline: cfg.buildkite.buildkite_pipeline.clone(),
        }
    }

    /// Verifies (before reading anything) and reads one delivery; `now` is unix seconds.
    /// Returns the build event to act on, if the delivery is one. A refusal is not logged
    /// here: the caller knows the peer, counts it and rate-limits the log.
    pub fn receive(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: i64,
    ) -> Result<Option<BuildEvent>, WebhookError> {
        self.auth.verify(headers, body, now)?;
        self.read(headers, body)
    }

    /// Reads a delivery another replica already verified ([`WebhookReceiver::receive`] less
    /// the verification: the replica relays the verdict, not the signature).
    pub fn read(
        &self,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<Option<BuildEvent>, WebhookError> {
        let header_event = headers.get(HEADER_EVENT).and_then(|v| v.to_str().ok());
        match parse_delivery(header_event, &self.pipeline, body) {
            Ok(Delivery::Build(ev)) => Ok(Some(ev)),
            Ok(Delivery::Ping) => {
                tracing::info!("webhook ping");
                Ok(None)
            }
            Ok(Delivery::Ignored(event)) => {
                tracing::debug!(%event, "webhook event ignored");
                Ok(None)
            }
            Err(e) => {
                tracing::warn!(error = %crate::report::report(&e), "verified webhook has an unreadable body");
                Err(e.into())
            }
        }
    }
}

#[derive(Deserialize)]
struct Body {
    event: String,
    #[serde(default)]
    build: Option<LooseBuild>,
    #[serde(default)]
    pipeline: Option<LoosePipeline>,
}

#[derive(Deserialize)]
struct LoosePipeline {
    #[serde(default)]
    slug: Option<String>,
}

/// The build object read leniently, so a `job.*` event with a partial build still parses;
/// only the events acted on require the fields.
#[derive(Deserialize)]
struct LooseBuild {
    id: Option<String>,
    number: Option<u64>,
    state: Option<String>,
    #[serde(default)]
    web_url: Option<String>,
    #[serde(default)]
    blocked: Option<bool>,
}

/// Reads a verified body. `header_event` is `X-Buildkite-Event`, when sent. Build events of
/// another pipeline than `pipeline` (an organization-wide webhook sends them all) are
/// `Ignored`, so they never fill the early-event buffer.
pub fn parse_delivery(
    header_event: Option<&str>,
    pipeline: &str,
    body: &[u8],
) -> Result<Delivery, ParseError> {
    let b: Body = serde_json::from_slice(body)?;
    if let Some(h) = header_event {
        if h != b.event {
            return Err(ParseError::Mismatch {
                header: h.to_string(),
                body: b.event,
            });
        }
    }
    let kind = match b.event.as_str() {
        "ping" => return Ok(Delivery::Ping),
        "build.scheduled" => BuildEventKind::Scheduled,
        "build.running" => BuildEventKind::Running,
        "build.finished" => BuildEventKind::Finished,
        "build.skipped" => BuildEventKind::Skipped,
        _ => return Ok(Delivery::Ignored(b.event)),
    };
    if let Some(slug) = b.pipeline.and_then(|p| p.slug) {
        if slug != pipeline {
            return Ok(Delivery::Ignored(format!("{} of pipeline {slug}", b.event)));
        }
    }
    let build = match b.build {
        Some(LooseBuild {
            id: Some(id),
            number: Some(number),
            state: Some(state),
            web_url,
            blocked,
        }) => BuildStatus {
            id,
            number,
            state,
            web_url: web_url.unwrap_or_default(),
            blocked: blocked.unwrap_or(false),
        },
        _ => return Err(ParseError::NoBuild(b.event)),
    };
    Ok(Delivery::Build(BuildEvent { kind, build }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sign(token: &str, ts: i64, body: &[u8]) -> String {
        let mut mac = Hmac::<Sha256>::new_from_slice(token.as_bytes()).unwrap();
        mac.update(format!("{ts}.").as_bytes());
        mac.update(body);
        format!(
            "timestamp={ts},signature={}",
            hex::encode(mac.finalize().into_bytes())
        )
    }

    fn auth(plain: bool) -> WebhookAuth {
        WebhookAuth {
            token: Some(Secret::new("k")),
            allow_plain_token: plain,
            window_s: 300,
        }
    }

    fn headers(name: &'static str, v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, v.parse().unwrap());
        h
    }

    #[test]
    fn good_signature_passes_and_every_forgery_fails() {
        let body = br#"{"event":"ping"}"#;
        let now = 1_700_000_000;
        let a = auth(false);
        assert_eq!(
            a.verify(&headers(HEADER_SIGNATURE, &sign("k", now, body)), body, now),
            Ok(())
        );
        assert_eq!(
            a.verify(
                &headers(HEADER_SIGNATURE, &sign("k", now - 299, body)),
                body,
                now
            ),
            Ok(())
        );
        assert_eq!(
            a.verify(&headers(HEADER_SIGNATURE, &sign("x", now, body)), body, now),
            Err(AuthError::BadSignature)
        );
        assert_eq!(
            a.verify(
                &headers(HEADER_SIGNATURE, &sign("k", now, body)),
                b"{}",
                now
            ),
            Err(AuthError::BadSignature)
        );
        assert_eq!(
            a.verify(
                &headers(HEADER_SIGNATURE, &sign("k", now - 301, body)),
                body,
                now
            ),
            Err(AuthError::Stale)
        );
        assert_eq!(
            a.verify(
                &headers(HEADER_SIGNATURE, &sign("k", now + 301, body)),
                body,
                now
            ),
            Err(AuthError::Stale)
        );
        assert_eq!(
            a.verify(&HeaderMap::new(), body, now),
            Err(AuthError::Missing)
        );
        assert!(matches!(
            a.verify(&headers(HEADER_SIGNATURE, "garbage"), body, now),
            Err(AuthError::Malformed(_))
        ));
        // Signature of the same body at another timestamp, with the timestamp swapped: refused.
        let other = sign("k", now - 10, body);
        let swapped = other.replace(
            &format!("timestamp={}", now - 10),
            &format!("timestamp={now}"),
        );
        assert_eq!(
            a.verify(&headers(HEADER_SIGNATURE, &swapped), body, now),
            Err(AuthError::BadSignature)
        );
    }

    #[test]
    fn precheck_refuses_all_but_the_mac_without_the_body() {
        let body = br#"{"event":"ping"}"#;
        let now = 1_700_000_000;
        let a = auth(false);
        let sig = |ts: i64| headers(HEADER_SIGNATURE, &sign("k", ts, body));
        assert_eq!(a.precheck(&sig(now), now), Ok(()));
        // The MAC needs the body: a wrong key passes the precheck, and only verify refuses it.
        let forged = headers(HEADER_SIGNATURE, &sign("x", now, body));
        assert_eq!(a.precheck(&forged, now), Ok(()));
        assert_eq!(a.verify(&forged, body, now), Err(AuthError::BadSignature));
        for (h, want) in [
            (sig(now - 301), AuthError::Stale),
            (sig(now + 301), AuthError::Stale),
            (HeaderMap::new(), AuthError::Missing),
            (
                headers(HEADER_SIGNATURE, "garbage"),
                AuthError::Malformed("expected key=value pairs"),
            ),
            (headers(HEADER_TOKEN, "k"), AuthError::PlainTokenRefused),
        ] {
            assert_eq!(a.precheck(&h, now), Err(want.clone()));
            assert_eq!(a.verify(&h, body, now), Err(want));
        }
        assert_eq!(
            auth(true).precheck(&headers(HEADER_TOKEN, "k"), now),
            Ok(())
        );
        assert_eq!(
            auth(true).precheck(&headers(HEADER_TOKEN, "kk"), now),
            Err(AuthError::BadToken)
        );
        let none = WebhookAuth {
            token: None,
            ..auth(true)
        };
        assert_eq!(none.precheck(&sig(now), now), Err(AuthError::NotConfigured));
        assert_eq!(AuthError::BadSignature.reason(), "bad_signature");
    }

    #[test]
    fn fails_closed_without_a_token() {
        let a = WebhookAuth {
            token: None,
            allow_plain_token: true,
            window_s: 300,
        };
        let body = b"{}";
        assert_eq!(
            a.verify(&headers(HEADER_SIGNATURE, &sign("", 1, body)), body, 1),
            Err(AuthError::NotConfigured)
        );
        assert_eq!(
            a.verify(&headers(HEADER_TOKEN, ""), body, 1),
            Err(AuthError::NotConfigured)
        );
        let empty = WebhookAuth {
            token: Some(Secret::new("")),
            ..a
        };
        assert_eq!(
            empty.verify(&headers(HEADER_SIGNATURE, &sign("", 1, body)), body, 1),
            Err(AuthError::NotConfigured)
        );
        assert_eq!(
            empty.verify(&headers(HEADER_TOKEN, ""), body, 1),
            Err(AuthError::NotConfigured)
        );
    }

    #[test]
    fn plain_token_only_when_allowed() {
        assert_eq!(
            auth(false).verify(&headers(HEADER_TOKEN, "k"), b"", 0),
            Err(AuthError::PlainTokenRefused)
        );
        assert_eq!(
            auth(true).verify(&headers(HEADER_TOKEN, "k"), b"", 0),
            Ok(())
        );
        assert_eq!(
            auth(true).verify(&headers(HEADER_TOKEN, "kk"), b"", 0),
            Err(AuthError::BadToken)
        );
        assert_eq!(
            auth(true).verify(&headers(HEADER_TOKEN, ""), b"", 0),
            Err(AuthError::BadToken)
        );
    }

    #[test]
    fn header_parser_accepts_buildkite_layout_and_refuses_junk() {
        let sig = "ab".repeat(32);
        let ok = parse_signature_header(&format!("timestamp=1619071700,signature={sig}")).unwrap();
        assert_eq!(ok.timestamp, 1619071700);
        assert!(parse_signature_header(&format!(" signature={sig} , timestamp=1 ")).is_ok());
        for bad in [
            String::new(),
            "timestamp=1".into(),
            format!("signature={sig}"),
            format!("timestamp=-1,signature={sig}"),
            format!("timestamp=1,signature={}", &sig[..62]),
            format!("timestamp=1,signature={}zz", &sig[..62]),
            format!("timestamp=1,timestamp=2,signature={sig}"),
            format!("timestamp=99999999999999,signature={sig}"),
            format!("timestamp=1;signature={sig}"),
        ] {
            assert!(parse_signature_header(&bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn deliveries_are_read() {
        let body = br#"{"event":"build.finished","build":{"id":"b","number":3,"state":"passed","web_url":"w","blocked":false,"env":{}},"pipeline":{},"sender":{}}"#;
        let d = parse_delivery(Some("build.finished"), "p", body).unwrap();
        let Delivery::Build(ev) = d else {
            panic!("{d:?}")
        };
        assert_eq!(
            (ev.kind, ev.build.number, ev.build.state.as_str()),
            (BuildEventKind::Finished, 3, "passed")
        );
        assert_eq!(
            parse_delivery(None, "p", br#"{"event":"ping","service":{}}"#).unwrap(),
            Delivery::Ping
        );
        assert!(matches!(
            parse_delivery(None, "p", br#"{"event":"job.started","build":{}}"#).unwrap(),
            Delivery::Ignored(_)
        ));
        assert!(matches!(
            parse_delivery(Some("ping"), "p", body),
            Err(ParseError::Mismatch { .. })
        ));
        assert!(matches!(
            parse_delivery(None, "p", br#"{"event":"build.finished"}"#),
            Err(ParseError::NoBuild(_))
        ));
        assert!(parse_delivery(None, "p", b"not json").is_err());
        let ours = body_with_slug("p");
        assert!(matches!(
            parse_delivery(None, "p", &ours).unwrap(),
            Delivery::Build(_)
        ));
        let theirs = body_with_slug("other");
        assert_eq!(
            parse_delivery(None, "p", &theirs).unwrap(),
            Delivery::Ignored("build.finished of pipeline other".into())
        );
    }

    fn body_with_slug(slug: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "event": "build.finished",
            "build": {"id": "b", "number": 1, "state": "passed"},
            "pipeline": {"slug": slug},
        }))
        .unwrap()
    }

    proptest! {
        #[test]
        fn header_parser_never_panics(s in ".{0,300}") {
            let _ = parse_signature_header(&s);
        }

        #[test]
        fn header_parser_never_panics_on_near_misses(ts in "[0-9-]{0,14}", sig in "[0-9a-fA-FxZ]{0,70}", sep in "[,; =]{1,3}") {
            let _ = parse_signature_header(&format!("timestamp={ts}{sep}signature={sig}"));
        }

        #[test]
        fn verify_never_panics(sig in ".{0,200}", body in proptest::collection::vec(any::<u8>(), 0..200), now in any::<i64>()) {
            let mut h = HeaderMap::new();
            if let Ok(v) = sig.parse() { h.insert(HEADER_SIGNATURE, v); }
            let _ = auth(true).verify(&h, &body, now);
        }

        #[test]
        fn delivery_parser_never_panics(body in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = parse_delivery(None, "p", &body);
        }

        #[test]
        fn payload_decoder_never_panics(s in ".{0,300}") {
            let _ = kernelkite_kernelbot::payload::decode(&s);
        }
    }
}
