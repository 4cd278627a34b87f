//! Where submissions live: the core's store (`kernelkite_core::store`: the interface, the
//! in-flight memory and its waiters), and the durable store behind it: [`sqlite`] (the
//! default, one file in the data directory, with its [`backup`]) or [`postgres`] (a database
//! server, for a service without a disk of its own), which share their statements (`store/sql.rs`).

pub mod backup;
pub mod postgres;
pub mod replicas;
mod sql;
pub mod sqlite;

pub use kernelkite_core::store::*;
pub use postgres::{PgSettings, Postgres};
pub use sqlite::{Sqlite, SyncMode};
