//! kernelkite-core: the service's core. A submission is accepted, waits its turn in the fair
//! queue, runs as a build on an [`executor::Executor`], and ends when the executor's events
//! say so; every change is committed to a [`store::Durable`] before anyone is told.
//!
//! The core names no adapter: no HTTP server or client, no database, no command line, no
//! Buildkite. `kernelkite-service` holds those (the HTTP API, the SQLite store, the
//! Buildkite and local executors, the callback sender, the flags) and hands the core what it
//! needs: an executor, a durable store and a plain [`config::Config`]. Executors speak to the
//! core through one handle ([`executor::Events`], made by [`events::for_executor`]); the
//! HTTP layer calls the [`App`]'s methods.
//!
//! Layout, from the top:
//! - [`app`]: the core: submit, cancel, time out, act on build events; [`health`]: liveness
//!   and readiness; [`events`]: the handle executors are given.
//! - Background work beside the core, started by the composition root: [`recovery`]
//!   (recovery on start, the one place it happens) and [`reconcile`] (the reconciler for
//!   lost events), which holds the core weakly and owns its state.
//! - [`executor`]: where builds run (the interface and the events handle's trait).
//! - [`store`]: submissions in flight in memory with their waiters, every submission in the
//!   durable store behind them; commit, then wake.
//! - [`submission`]: a submission's state machine, as a plain value; [`result`]: the checked
//!   `result.json`; [`error`]: the core's errors; [`report`]: errors with their causes, for
//!   people; [`config`]: the settings the core reads; [`metrics`]: what `GET /metrics`
//!   exports; [`queues`]: queue status (the store's counts, the executor's agent counts
//!   fetched at most once a minute); [`fairshare`]: who runs next on a queue (a pure policy);
//!   [`dispatch`]: the service's queue around it (slots, quotas, places).

#![deny(missing_docs)]

pub mod app;
pub mod canary;
pub mod config;
pub mod dispatch;
pub mod error;
pub mod events;
pub mod executor;
pub mod fairshare;
pub mod fleet;
pub mod health;
pub mod metrics;
pub mod overview;
pub mod pauses;
pub mod queues;
pub mod reconcile;
pub mod recovery;
pub mod report;
pub mod result;
pub mod store;
pub mod submission;
pub mod upkeep;

pub use app::{App, SubmitRequest};
pub use error::Error;
