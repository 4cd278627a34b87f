//! The one place where the core's errors become HTTP answers: a status per kind, and the
//! JSON body `{"error": "<what is wrong and what to do>"}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::{Error, Unauthorized};
use crate::report::report;

/// The core's [`Error`] on its way out as an HTTP answer. The core names no HTTP type, so the
/// answer is made here, through this wrapper (the orphan rule keeps `IntoResponse` off a type
/// of another crate); handlers return it, and `?` wraps any error the core's converts from.
#[derive(Debug)]
pub struct ApiError(pub Error);

impl<E: Into<Error>> From<E> for ApiError {
    fn from(e: E) -> ApiError {
        ApiError(e.into())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let ApiError(e) = self;
        answer(e)
    }
}

/// The answer for `e`: its status, headers and JSON body.
fn answer(e: Error) -> Response {
    let status = match &e {
        Error::NotFound { .. } | Error::UnknownSlice(_) => StatusCode::NOT_FOUND,
        Error::BadRequest(_) => StatusCode::BAD_REQUEST,
        Error::Invalid(_) => StatusCode::UNPROCESSABLE_ENTITY,
        Error::Conflict { .. } | Error::KeyReused { .. } => StatusCode::CONFLICT,
        Error::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        Error::Unauthorized(_) => StatusCode::UNAUTHORIZED,
        Error::Forbidden => StatusCode::FORBIDDEN,
        Error::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        Error::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        Error::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
        Error::OverQuota(_) => StatusCode::TOO_MANY_REQUESTS,
    };
    let retry_after = match &e {
        Error::OverQuota(q) => Some(q.retry_after_s()),
        _ => None,
    };
    let bearer = matches!(e, Error::Unauthorized(Unauthorized::BearerToken));
    let message = elide(&report(&e));
    let mut r = (status, Json(json!({ "error": message }))).into_response();
    if bearer {
        // RFC 6750: a 401 for a bearer-token resource names the scheme.
        r.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    if let Some(s) = retry_after {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    if status == StatusCode::REQUEST_TIMEOUT {
        // The rest of the body may still be on its way: the connection cannot be reused.
        r.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    r
}

/// Longest run of a client's own text an error message repeats (a quoted value, an unknown
/// field's name), in characters.
pub(crate) const ECHO_MAX: usize = 200;
/// Longest error message, in characters, whatever it quotes.
pub(crate) const MESSAGE_MAX: usize = 1000;

/// An error message with every quoted run (between `"` or `` ` ``, how serde and `{:?}` quote
/// a client's values) cut to [`ECHO_MAX`] characters, and the whole to [`MESSAGE_MAX`]:
/// a refused request must not be echoed back whole (a 10 MiB queue name, a huge unknown key).
/// What was cut is said, so nobody mistakes the shortened value for what was sent.
pub(crate) fn elide(message: &str) -> String {
    if message.chars().count() <= ECHO_MAX {
        return message.to_string();
    }
    let mut out = String::with_capacity(MESSAGE_MAX + 64);
    let mut quoted = 0usize; // characters of the current quoted run written so far
    let mut dropped = 0usize; // characters of the current quoted run left out
    let mut inside = false;
    for c in message.chars() {
        let quote = c == '"' || c == '`';
        if inside && !quote {
            if quoted < ECHO_MAX {
                out.push(c);
                quoted += 1;
            } else {
                dropped += 1;
            }
            continue;
        }
        if inside && quote && dropped > 0 {
            out.push_str(&format!("…({dropped} more characters)"));
        }
        if quote {
            inside = !inside;
            quoted = 0;
            dropped = 0;
        }
        out.push(c);
    }
    if inside && dropped > 0 {
        out.push_str(&format!("…({dropped} more characters)"));
    }
    let total = out.chars().count();
    if total > MESSAGE_MAX {
        let cut: String = out.chars().take(MESSAGE_MAX).collect();
        return format!("{cut}…({} more characters)", total - MESSAGE_MAX);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buildkite::webhook::AuthError;
    use crate::error::{BadRequest, Invalid, Unavailable};
    use crate::submission::State;

    async fn answer_of(e: Error) -> (u16, Option<String>, serde_json::Value) {
        let r = ApiError(e).into_response();
        let status = r.status().as_u16();
        let auth = r
            .headers()
            .get(header::WWW_AUTHENTICATE)
            .map(|v| v.to_str().unwrap().to_string());
        let body = axum::body::to_bytes(r.into_body(), usize::MAX)
            .await
            .unwrap();
        (status, auth, serde_json::from_slice(&body).unwrap())
    }

    #[test]
    fn elide_cuts_quoted_values_and_long_messages() {
        let short = "queue \"h100\" must be 1-64 letters";
        assert_eq!(elide(short), short);
        let long = format!("queue \"{}\" must be 1-64 letters", "q".repeat(5000));
        let got = elide(&long);
        assert_eq!(
            got,
            format!(
                "queue \"{}…(4800 more characters)\" must be 1-64 letters",
                "q".repeat(ECHO_MAX)
            )
        );
        let serde = format!(
            "unknown field `{}`, expected one of `config`, `queue`",
            "k".repeat(300)
        );
        let got = elide(&serde);
        assert!(
            got.ends_with("…(100 more characters)`, expected one of `config`, `queue`"),
            "{got}"
        );
        // Many short quoted runs and no quotes at all: the whole is capped.
        let many = "\"ab\" ".repeat(2000);
        assert!(elide(&many).chars().count() < MESSAGE_MAX + 40);
        let bare = "x".repeat(5000);
        assert!(elide(&bare).ends_with("…(4000 more characters)"));
        // Multi-byte characters are cut on character boundaries.
        let wide = format!("queue \"{}\"", "é".repeat(500));
        assert!(elide(&wide).contains("…(300 more characters)"));
    }

    #[tokio::test]
    async fn each_kind_has_its_status_and_a_json_message() {
        let cases: Vec<(Error, u16, &str)> = vec![
            (
                Error::NotFound { id: "x".into() },
                404,
                "no submission x",
            ),
            (
                BadRequest::Wait.into(),
                400,
                "wait must be a non-negative number of seconds",
            ),
            (
                Invalid::RunId.into(),
                422,
                "run_id must be 1-256 characters without control characters",
            ),
            (
                Error::Conflict {
                    state: State::Succeeded,
                },
                409,
                "submission already ended: succeeded",
            ),
            (
                Error::PayloadTooLarge {
                    limit: 10,
                    setting: "KERNELKITE_MAX_SUBMISSION_BYTES",
                },
                413,
                "request body is over the 10 bytes allowed; send less, or raise KERNELKITE_MAX_SUBMISSION_BYTES",
            ),
            (
                Unauthorized::Webhook(crate::error::WebhookRefusal::new(AuthError::Missing)).into(),
                401,
                "missing X-Buildkite-Signature header",
            ),
            (
                Error::Forbidden,
                403,
                "KERNELKITE_API_TOKEN is not set, so only loopback clients are served",
            ),
            (
                Error::Internal {
                    what: "submission worker",
                    source: "it panicked".into(),
                },
                500,
                "submission worker failed; retry: it panicked",
            ),
            (
                Error::RequestTimeout {
                    seconds: 30,
                    setting: "KERNELKITE_BODY_READ_TIMEOUT_S",
                },
                408,
                "request body did not arrive within 30 s; send it faster, or raise KERNELKITE_BODY_READ_TIMEOUT_S",
            ),
            (
                Error::KeyReused { key: "k".into() },
                409,
                "Idempotency-Key \"k\" was already used for a different request; send the same request to get its submission, or use a new key for a new submission",
            ),
            (
                Error::from(Unavailable::Store {
                    what: "the submission could not be saved",
                    source: "disk full".into(),
                }),
                503,
                "the submission could not be saved; nothing was kept, retry later: disk full",
            ),
        ];
        for (e, status, message) in cases {
            let (got, auth, body) = answer_of(e).await;
            assert_eq!(
                (got, body),
                (status, serde_json::json!({ "error": message }))
            );
            assert_eq!(auth, None, "{message}");
        }
        let r = ApiError::from(Unavailable::ShuttingDown).into_response();
        assert_eq!(r.status().as_u16(), 503);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let (status, auth, body) = answer_of(Unauthorized::BearerToken.into()).await;
        assert_eq!((status, auth.as_deref()), (401, Some("Bearer")));
        assert_eq!(
            body["error"],
            "missing or wrong bearer token (Authorization: Bearer <KERNELKITE_API_TOKEN>)"
        );
    }
}
