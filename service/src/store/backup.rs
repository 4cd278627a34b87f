//! A consistent copy of the live store, taken while the service runs
//! (`kernelkite-service backup`).
//!
//! SQLite's `VACUUM INTO` writes a snapshot of the database as one transaction sees it (WAL
//! included) into a new file, without blocking the service's writer; a copy of the files
//! (`cp`, `tar`) of a database in WAL mode is not consistent. The copy is checked
//! (`PRAGMA integrity_check`) before it is given its name, and an existing file is never
//! overwritten. The data directory's lock is not taken: the service keeps it.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection};

use super::sqlite::DB_FILE;

/// What a backup made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backup {
    /// The copy.
    pub path: PathBuf,
    /// Its size, bytes.
    pub bytes: u64,
    /// The submissions it holds.
    pub submissions: i64,
}

/// Why a backup could not be made. Each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// There is no store in the data directory.
    #[error("there is no store at {}; give the service's KERNELKITE_DATA_DIR", .0.display())]
    NoStore(PathBuf),
    /// The target exists; a backup never replaces a file.
    #[error("{} exists; name a new file (a backup never replaces one)", .0.display())]
    Exists(PathBuf),
    /// SQLite failed.
    #[error("the backup of {} into {} failed: {cause}", .from.display(), .to.display())]
    Sqlite {
        /// The store.
        from: PathBuf,
        /// The copy.
        to: PathBuf,
        /// What SQLite said.
        cause: String,
    },
    /// The copy does not check out.
    #[error("the copy {} failed its integrity check ({why}); it was removed, try again", .path.display())]
    Damaged {
        /// What the check said.
        why: String,
        /// The copy.
        path: PathBuf,
    },
}

/// Copies the store of the data directory `dir` into the new file `to`.
pub async fn backup(dir: &Path, to: &Path) -> Result<Backup, BackupError> {
    let from = dir.join(DB_FILE);
    if !from.is_file() {
        return Err(BackupError::NoStore(from));
    }
    if to.exists() {
        return Err(BackupError::Exists(to.to_path_buf()));
    }
    // Written beside its final name, then renamed: a half-made copy never carries that name.
    let partial = PathBuf::from(format!("{}.partial", to.display()));
    let _ = std::fs::remove_file(&partial);
    let fail = |cause: String| BackupError::Sqlite {
        from: from.clone(),
        to: to.to_path_buf(),
        cause,
    };
    let mut conn = SqliteConnectOptions::new()
        .filename(&from)
        .busy_timeout(Duration::from_secs(30))
        .disable_statement_logging()
        .connect()
        .await
        .map_err(|e| fail(e.to_string()))?;
    let into = partial
        .to_str()
        .ok_or_else(|| fail("the target path is not UTF-8".into()))?;
    sqlx::query("VACUUM INTO ?")
        .bind(into)
        .execute(&mut conn)
        .await
        .map_err(|e| fail(e.to_string()))?;
    conn.close().await.map_err(|e| fail(e.to_string()))?;
    let checked = check(&partial).await;
    match checked {
        Ok(submissions) => {
            std::fs::rename(&partial, to).map_err(|e| fail(e.to_string()))?;
            let bytes = std::fs::metadata(to).map(|m| m.len()).unwrap_or(0);
            Ok(Backup {
                path: to.to_path_buf(),
                bytes,
                submissions,
            })
        }
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}

/// Checks a copy and counts its submissions.
async fn check(path: &Path) -> Result<i64, BackupError> {
    let damaged = |why: String| BackupError::Damaged {
        why,
        path: path.to_path_buf(),
    };
    let url = format!("sqlite://{}", path.display());
    let mut conn = SqliteConnectOptions::from_str(&url)
        .map_err(|e| damaged(e.to_string()))?
        .read_only(true)
        .disable_statement_logging()
        .connect()
        .await
        .map_err(|e| damaged(e.to_string()))?;
    let (verdict,): (String,) = sqlx::query_as("PRAGMA integrity_check")
        .fetch_one(&mut conn)
        .await
        .map_err(|e| damaged(e.to_string()))?;
    if verdict != "ok" {
        return Err(damaged(verdict));
    }
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM submissions")
        .fetch_one(&mut conn)
        .await
        .map_err(|e| damaged(e.to_string()))?;
    let _ = conn.close().await;
    Ok(n)
}
