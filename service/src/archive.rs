//! Finished submissions on disk: `<data dir>/submissions/<id>.json`, one file each, written
//! atomically (temporary file, then rename) so a crash never leaves half a file.
//!
//! This is enough for GET to answer after a restart; recovering unfinished submissions is
//! the durable store's job (a later issue).

use std::path::{Path, PathBuf};

use crate::submission::Submission;

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

    pub async fn write(&self, sub: &Submission) -> std::io::Result<()> {
        let Some(path) = self.path(&sub.id) else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "submission id is not a UUID",
            ));
        };
        let json = serde_json::to_vec_pretty(sub).map_err(std::io::Error::other)?;
        tokio::task::spawn_blocking(move || {
            let tmp = path.with_extension("json.tmp");
            std::fs::write(&tmp, &json)?;
            std::fs::rename(&tmp, &path)
        })
        .await
        .map_err(std::io::Error::other)?
    }

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
