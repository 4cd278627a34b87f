//! Fetching a build's `result.json` and checking it before anyone trusts it: the listed
//! artifact must be `finished`, the bytes must have the listed size and SHA-1, and they must
//! parse as kernelbot's `FullResult` (no missing or extra fields).

use kernelkite_runner::result::FullResult;
use sha1::{Digest, Sha1};

use crate::buildkite::{Artifact, BuildkiteClient, BuildkiteError};

pub const RESULT_PATH: &str = "result.json";

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("the build has no finished {RESULT_PATH} artifact{0}")]
    Missing(String),
    #[error(transparent)]
    Buildkite(#[from] BuildkiteError),
    #[error("{RESULT_PATH} is {got} bytes but Buildkite lists {want}; the download is truncated or corrupt")]
    SizeMismatch { want: u64, got: u64 },
    #[error("{RESULT_PATH} has SHA-1 {got} but Buildkite lists {want}; the download is corrupt")]
    Sha1Mismatch { want: String, got: String },
    #[error("{RESULT_PATH} is not a kernelbot FullResult: {0}")]
    Parse(String),
}

/// Picks the artifact to use: a `finished` `result.json`; when a retried job uploaded more
/// than one, the last listed (Buildkite lists newest last within a build's jobs).
pub fn choose(artifacts: &[Artifact]) -> Result<&Artifact, ArtifactError> {
    let candidates: Vec<&Artifact> = artifacts.iter().filter(|a| a.path == RESULT_PATH).collect();
    if let Some(a) = candidates.iter().rev().find(|a| a.state == "finished") {
        return Ok(a);
    }
    let states: Vec<&str> = candidates.iter().map(|a| a.state.as_str()).collect();
    Err(ArtifactError::Missing(if states.is_empty() {
        String::new()
    } else {
        format!(" (listed, but in state {})", states.join(", "))
    }))
}

/// Checks downloaded bytes against the listing and parses them.
pub fn verify(artifact: &Artifact, bytes: &[u8]) -> Result<FullResult, ArtifactError> {
    if bytes.len() as u64 != artifact.file_size {
        return Err(ArtifactError::SizeMismatch {
            want: artifact.file_size,
            got: bytes.len() as u64,
        });
    }
    let got = hex::encode(Sha1::digest(bytes));
    if !got.eq_ignore_ascii_case(artifact.sha1sum.trim()) {
        return Err(ArtifactError::Sha1Mismatch {
            want: artifact.sha1sum.clone(),
            got,
        });
    }
    serde_json::from_slice(bytes).map_err(|e| ArtifactError::Parse(e.to_string()))
}

/// Lists, downloads and checks the build's result.json: two API calls plus the blob fetch.
pub async fn fetch_result(
    client: &BuildkiteClient,
    build_number: u64,
) -> Result<FullResult, ArtifactError> {
    let listed = client.list_artifacts(build_number, RESULT_PATH).await?;
    let artifact = choose(&listed)?;
    let bytes = client.download(&artifact.download_url).await?;
    verify(artifact, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn art(state: &str, bytes: &[u8]) -> Artifact {
        Artifact {
            id: "a".into(),
            job_id: None,
            url: String::new(),
            download_url: String::new(),
            state: state.into(),
            path: RESULT_PATH.into(),
            filename: RESULT_PATH.into(),
            mime_type: None,
            file_size: bytes.len() as u64,
            sha1sum: hex::encode(Sha1::digest(bytes)),
        }
    }

    const RESULT: &str = r#"{"success": true, "error": "", "runs": {}, "system": {"gpu": "H100", "device_count": 1, "cpu": "", "runtime": "CUDA", "platform": "", "torch": "", "hostname": "h"}}"#;

    #[test]
    fn only_finished_artifacts_are_chosen() {
        let list = vec![art("error", b""), art("new", b"")];
        let err = choose(&list).unwrap_err().to_string();
        assert!(err.contains("error, new"), "{err}");
        assert!(matches!(choose(&[]), Err(ArtifactError::Missing(_))));
        let mut other = art("finished", b"");
        other.path = "logs/result.json".into();
        assert!(choose(&[other]).is_err());
    }

    #[test]
    fn size_sha1_and_shape_are_checked() {
        let good = art("finished", RESULT.as_bytes());
        assert!(verify(&good, RESULT.as_bytes()).unwrap().success);
        let mut short = good.clone();
        short.file_size -= 1;
        assert!(matches!(
            verify(&short, RESULT.as_bytes()),
            Err(ArtifactError::SizeMismatch { .. })
        ));
        let mut bad_sha = good.clone();
        bad_sha.sha1sum = "0".repeat(40);
        assert!(matches!(
            verify(&bad_sha, RESULT.as_bytes()),
            Err(ArtifactError::Sha1Mismatch { .. })
        ));
        let extra = RESULT.replace("\"error\"", "\"extra\": 1, \"error\"");
        assert!(matches!(
            verify(&art("finished", extra.as_bytes()), extra.as_bytes()),
            Err(ArtifactError::Parse(_))
        ));
    }
}
