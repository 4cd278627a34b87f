//! Errors as people read them, and the error that crosses interfaces.
//!
//! [`report`] writes an error with its causes (the service keeps causes as
//! [`std::error::Error::source`], not in the message); [`BoxError`] is what the executor and
//! store interfaces return, as each implementation has its own error types.

/// Any error, boxed: what crosses the executor and store interfaces, whose implementations
/// each have their own error types.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The error and its causes, joined by `": "`, for a person to read: a response body, a
/// submission's `error`, a log line (`kernelkite_sys::error`, shared with the hooks).
pub use kernelkite_sys::error::report;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{BadRequest, Error};

    #[test]
    fn report_walks_the_causes_once_each() {
        let body = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let cause = body.to_string();
        let e = Error::from(BadRequest::NotJson(body));
        assert_eq!(
            report(&e),
            format!("request body is not a submission: {cause}")
        );

        let e = Error::Internal {
            what: "submission worker",
            source: "the task panicked".into(),
        };
        assert_eq!(
            report(&e),
            "submission worker failed; retry: the task panicked"
        );

        // A cause that already wrote its own cause into its message: shown once.
        #[derive(Debug, thiserror::Error)]
        #[error("outer: {0}")]
        struct Loud(#[source] std::io::Error);
        let loud = Loud(std::io::Error::other("disk on fire"));
        assert_eq!(report(&loud), "outer: disk on fire");
    }
}
