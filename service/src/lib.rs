//! kernelkite-service: submissions in, builds out, the executor's events wake the waiters.
//!
//! Flow: `POST /v1/submissions` validates the run config with kernelbot's own types
//! (`kernelkite-kernelbot`), hands the executor (Buildkite) a job, which becomes a build
//! carrying the payload, and returns at once. Buildkite's signed `build.finished` webhook finds
//! the submission by build id, the service downloads `result.json` (checking its size and
//! SHA-1 and its shape), and every waiter (long-poll, SSE, callback) hears of it at once.
//!
//! Layout, from the edge in. No two modules import each other, and the core imports none of
//! the commands, the HTTP layer, the background work or the executors:
//! - [`cli`]: the commands; [`cli::serve`] is the composition root: it picks the executor and
//!   the store, builds the core around them and starts the background loops.
//! - [`http`]: routes, handlers, the client guard, the one error-to-status mapping, and the
//!   connection server (cap, timeouts, graceful shutdown); [`health`]: liveness and readiness.
//! - Background work beside the core, started by the composition root: [`recovery`]
//!   (recovery on start, the one place it happens), and two loops that hold the core weakly
//!   and own their state, [`reconcile`] (the reconciler for lost events) and [`callback`]
//!   (the signed callback outbox).
//! - [`app`]: the core: submit, cancel, time out, act on build events. No HTTP types, and it
//!   names no executor and no database: it holds an [`executor::Executor`] and a
//!   [`store::Durable`] it is given.
//! - [`executor`]: where builds run (the interface); [`buildkite`]: all the Buildkite code
//!   (the executor, REST client and rate budget, artifacts, signed webhooks, agents);
//!   [`local`]: the local executor (which picks up its own jobs on start through
//!   [`recovery`]).
//! - [`store`]: submissions in flight in memory with their waiters, every submission in the
//!   durable store behind them ([`store::sqlite`]); commit, then wake.
//! - [`submission`]: a submission's state machine, as a plain value; [`result`]: the checked
//!   `result.json`; [`error`]: the core's errors; [`report`]: errors with their causes, for
//!   people; [`config`]: flags and environment, in groups; [`metrics`]: what `GET /metrics` exports;
//!   [`queues`]: queue status (the store's counts, the executor's agent counts fetched at most
//!   once a minute); [`fairshare`]: who runs next on a queue (a pure policy); [`dispatch`]: the service's
//!   queue around it (slots, quotas, places).

#![deny(missing_docs)]

pub mod buildkite;
pub mod callback;
pub mod cli;
pub mod config;
pub mod http;
pub mod local;
pub mod store;
pub mod task;

// The core's modules, under the paths they had before the core became a crate of its own
// (`kernelkite-core`), so that `kernelkite_service::executor::Job` and the like still name
// what they named.
pub use kernelkite_core::{
    app, dispatch, error, events, executor, fairshare, health, metrics, queues, reconcile,
    recovery, report, result, submission,
};

pub use app::{App, SubmitRequest};
pub use config::Config;
pub use error::Error;
pub use http::{router, serve};
