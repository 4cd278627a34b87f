//! Finished submissions on disk: `<data dir>/submissions/<id>.json`, one file each, written
//! atomically so a crash never leaves half a file: the JSON goes to a temporary file in the
//! same directory, which is fsynced, renamed over the final name, and then the directory is
//! fsynced so the rename itself survives a crash.
//!
//! This is enough for GET to answer after a restart; recovering unfinished submissions is
//! the durable store's job (a later issue).

use std::io::Write as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use super::Durable;
use crate::executor::BoxFuture;
use crate::report::BoxError;
use crate::submission::Submission;

/// The directory of finished submissions.
#[derive(Debug, Clone)]
pub struct Archive {
    dir: PathBuf,
}

impl Archive {
    /// Creates `<root>/submissions` when missing.
    pub fn open(root: &Path) -> std::io::Result<Archive> {
        let dir = root.join("submissions");
        std::fs::create_dir_all(&dir)?;
        Ok(Archive { dir })
    }

    /// Only canonical UUIDs name files, so an id can never walk out of the directory.
    fn path(&self, id: &str) -> Option<PathBuf> {
        let u = uuid::Uuid::parse_str(id).ok()?;
        (u.hyphenated().to_string() == id).then(|| self.dir.join(format!("{id}.json")))
    }

    /// Writes (or replaces) the submission's file, atomically and durably.
    pub async fn write(&self, sub: &Submission) -> std::io::Result<()> {
        let Some(path) = self.path(&sub.id) else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "submission id is not a UUID",
            ));
        };
        let json = serde_json::to_vec_pretty(sub).map_err(std::io::Error::other)?;
        let dir = self.dir.clone();
        tokio::task::spawn_blocking(move || write_atomic(&dir, &path, &json))
            .await
            .map_err(std::io::Error::other)?
    }

    /// The submission's file, if there is one.
    pub async fn read(&self, id: &str) -> std::io::Result<Option<Submission>> {
        let Some(path) = self.path(id) else {
            return Ok(None);
        };
        match tokio::fs::read(&path).await {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(std::io::Error::other),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl Durable for Archive {
    fn save<'a>(&'a self, sub: &'a Submission) -> BoxFuture<'a, Result<(), BoxError>> {
        Box::pin(async move { Ok(self.write(sub).await?) })
    }

    fn load<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<Submission>, BoxError>> {
        Box::pin(async move { Ok(self.read(id).await?) })
    }
}

/// Replaces `path` (in `dir`) with `bytes`: a crash leaves the old file or the new one, whole.
/// On an error the temporary file is removed.
fn write_atomic(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = tempfile::Builder::new()
        .prefix(".")
        .suffix(".json.tmp")
        // What `std::fs::write` gives (tempfile's default is 0600); the umask still applies.
        .permissions(std::fs::Permissions::from_mode(0o644))
        .tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    // The bytes must be on disk before a name points at them: after a crash, a renamed but
    // unsynced file can be empty.
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    // The rename is an entry in the directory; syncing the directory keeps it.
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[tokio::test]
    async fn round_trips_and_refuses_odd_ids() {
        let dir = tempfile::tempdir().unwrap();
        let a = Archive::open(dir.path()).unwrap();
        let id = uuid::Uuid::new_v4().to_string();
        let s = Submission::new(id.clone(), "q".into(), None, None, 5, chrono::Utc::now());
        a.write(&s).await.unwrap();
        assert_eq!(a.read(&id).await.unwrap(), Some(s));
        assert_eq!(a.read("../../etc/passwd").await.unwrap(), None);
        assert_eq!(a.read(&id.to_uppercase()).await.unwrap(), None);
        assert_eq!(
            a.read(&uuid::Uuid::new_v4().to_string()).await.unwrap(),
            None
        );
    }

    #[tokio::test]
    async fn a_write_replaces_the_file_whole_and_leaves_nothing_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let a = Archive::open(dir.path()).unwrap();
        let id = uuid::Uuid::new_v4().to_string();
        let mut s = Submission::new(id.clone(), "q".into(), None, None, 5, chrono::Utc::now());
        a.write(&s).await.unwrap();
        s.finish(
            crate::submission::Outcome::Failed("x".into()),
            chrono::Utc::now(),
        );
        a.write(&s).await.unwrap();
        assert_eq!(a.read(&id).await.unwrap(), Some(s));
        let sub_dir = dir.path().join("submissions");
        assert_eq!(entries(&sub_dir), [format!("{id}.json")]);
        let mode = std::fs::metadata(sub_dir.join(format!("{id}.json")))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o600, 0o600, "{mode:o}");
    }

    #[tokio::test]
    async fn a_failed_write_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let a = Archive::open(dir.path()).unwrap();
        let id = uuid::Uuid::new_v4().to_string();
        // A directory where the file should go: the rename fails.
        let sub_dir = dir.path().join("submissions");
        std::fs::create_dir(sub_dir.join(format!("{id}.json"))).unwrap();
        std::fs::write(sub_dir.join(format!("{id}.json")).join("keep"), b"x").unwrap();
        let s = Submission::new(id.clone(), "q".into(), None, None, 5, chrono::Utc::now());
        assert!(a.write(&s).await.is_err());
        assert_eq!(entries(&sub_dir), [format!("{id}.json")]);
    }
}
