//! kernelkite-service: submissions in, Buildkite builds out, signed webhooks wake the waiters.
//!
//! Flow: `POST /v1/submissions` validates the run config with the runner's own types, creates a
//! Buildkite build carrying the payload, and returns at once. Buildkite's signed `build.finished`
//! webhook finds the submission by build id, the service downloads `result.json` (checking its
//! size and SHA-1 and its shape), and every waiter (long-poll, SSE, callback) hears of it at once.

pub mod api;
pub mod app;
pub mod archive;
pub mod artifact;
pub mod buildkite;
pub mod config;
pub mod store;
pub mod submission;
pub mod webhook;

pub use app::{router, serve, App, SubmitRequest};
pub use config::Config;
