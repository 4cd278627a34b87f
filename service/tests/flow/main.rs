//! The service against the fake Buildkite, over real loopback HTTP, one file per concern.
//! One test binary (its modules below), so the suite links once; the shared set-up (the
//! service on loopback, its fake Buildkite, request helpers) is `kernelkite_testkit::harness`.

mod alerts;
mod artifacts;
mod auth;
mod binary;
mod callbacks;
mod cancel_timeout;
mod docs_promises;
mod executor;
mod fair_queue;
mod faults;
mod hardening;
mod idempotency;
mod persistence;
mod queues;
mod sse_longpoll;
mod submit;
mod webhooks;
