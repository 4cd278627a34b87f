//! kernelkite-service: submissions in, builds out, the executor's events wake the waiters.
//!
//! Flow: `POST /v1/submissions` validates the run config with kernelbot's own types
//! (`kernelkite-kernelbot`), hands the executor (Buildkite) a job, which becomes a build
//! carrying the payload, and returns at once. Buildkite's signed `build.finished` webhook finds
//! the submission by build id, the service downloads `result.json` (checking its size and
//! SHA-1 and its shape), and every waiter (long-poll, SSE, callback) hears of it at once.
//!
//! Layout. The core (the App, submissions, the queue, recovery, the reconciler, the executor
//! and store interfaces) is the crate `kernelkite-core`, which names none of this crate's
//! modules; its modules are re-exported here under the paths they had before (`app`,
//! `dispatch`, `error`, `events`, `executor`, `fairshare`, `health`, `metrics`, `queues`,
//! `reconcile`, `recovery`, `report`, `result`, `submission`). This crate is its adapters:
//! - [`cli`]: the commands; [`cli::serve`] is the composition root: it picks the executor and
//!   the store, builds the core around them (with [`Config::core`]) and starts the background
//!   loops.
//! - [`http`]: routes, handlers, the client guard, the one error-to-status mapping, and the
//!   connection server (cap, timeouts, graceful shutdown); Buildkite's webhooks reach the core
//!   through its events handle, as the local executor's events do.
//! - [`callback`]: the signed callback outbox, a loop that holds the core weakly and owns its
//!   state.
//! - [`buildkite`]: all the Buildkite code (the executor, REST client and rate budget,
//!   artifacts, signed webhooks, agents); [`local`]: the local executor, handed the core's
//!   events handle at start.
//! - [`store`]: the core's store, and the durable store behind it ([`store::sqlite`], or
//!   [`store::postgres`] with what its replicas share, [`store::replicas`]).
//! - [`replica`]: several processes on one PostgreSQL schema, each serving every request;
//!   the one holding the schema's lock runs the queue.
//! - [`task`]: kernelbot task directories; [`config`]: flags and environment, in groups.

#![deny(missing_docs)]

pub mod buildkite;
pub mod callback;
pub mod cli;
pub mod config;
pub mod http;
pub mod local;
pub mod notify;
pub mod replica;
pub mod store;
pub mod task;

// The core's modules, under the paths they had before the core became a crate of its own
// (`kernelkite-core`), so that `kernelkite_service::executor::Job` and the like still name
// what they named.
pub use kernelkite_core::{
    app, canary, dispatch, error, events, executor, fairshare, fleet, health, metrics, overview,
    queues, reconcile, recovery, report, result, submission,
};

pub use app::{App, SubmitRequest};
pub use config::Config;
pub use error::Error;
pub use http::{router, serve};
