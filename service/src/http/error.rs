//! The one place where the core's errors become HTTP answers: a status per kind, and the
//! JSON body `{"error": "<what is wrong and what to do>"}`.

use axum::extract::rejection::BytesRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::{BadRequest, Error, Unauthorized};
use crate::report::report;

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = match &self {
            Error::NotFound { .. } => StatusCode::NOT_FOUND,
            Error::BadRequest(_) => StatusCode::BAD_REQUEST,
            Error::Invalid(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Error::Conflict { .. } | Error::KeyReused { .. } => StatusCode::CONFLICT,
            Error::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Error::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Error::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Error::Forbidden => StatusCode::FORBIDDEN,
            Error::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let bearer = matches!(self, Error::Unauthorized(Unauthorized::BearerToken));
        let mut r = (status, Json(json!({ "error": report(&self) }))).into_response();
        if bearer {
            // RFC 6750: a 401 for a bearer-token resource names the scheme.
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

/// A body that could not be received: over `limit` (the body-limit layer's refusal), or cut
/// off. `setting` is the variable that sets the limit.
pub(super) fn body_error(rejection: BytesRejection, limit: usize, setting: &'static str) -> Error {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        Error::PayloadTooLarge { limit, setting }
    } else {
        BadRequest::Body(rejection.into()).into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Invalid;
    use crate::submission::State;
    use crate::webhook::AuthError;

    async fn answer(e: Error) -> (u16, Option<String>, serde_json::Value) {
        let r = e.into_response();
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
                Unauthorized::Webhook(AuthError::Missing).into(),
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
                Error::KeyReused { key: "k".into() },
                409,
                "Idempotency-Key \"k\" was already used for a different request; send the same request to get its submission, or use a new key for a new submission",
            ),
            (
                Error::Unavailable {
                    what: "the submission could not be saved",
                    source: "disk full".into(),
                },
                503,
                "the submission could not be saved; nothing was kept, retry later: disk full",
            ),
        ];
        for (e, status, message) in cases {
            let (got, auth, body) = answer(e).await;
            assert_eq!(
                (got, body),
                (status, serde_json::json!({ "error": message }))
            );
            assert_eq!(auth, None, "{message}");
        }
        let (status, auth, body) = answer(Unauthorized::BearerToken.into()).await;
        assert_eq!((status, auth.as_deref()), (401, Some("Bearer")));
        assert_eq!(
            body["error"],
            "missing or wrong bearer token (Authorization: Bearer <KERNELKITE_API_TOKEN>)"
        );
    }
}
