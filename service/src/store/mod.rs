//! Where submissions live: the core's store (`kernelkite_core::store`: the interface, the
//! in-flight memory and its waiters), and the durable store behind it, [`sqlite`], with its
//! [`backup`].

pub mod backup;
pub mod sqlite;

pub use kernelkite_core::store::*;
pub use sqlite::{Sqlite, SyncMode};
