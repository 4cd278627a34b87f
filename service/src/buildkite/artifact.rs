//! Fetching a build's `result.json` from Buildkite and checking it before anyone trusts it:
//! the listed artifact must be `finished`, the bytes must have the listed size and SHA-1, and
//! they must have the shape of kernelbot's `FullResult` ([`ResultJson::parse`]).

use sha1::{Digest, Sha1};

use super::client::{Artifact, BuildkiteClient, BuildkiteError};
use crate::result::{NotAResult, ResultJson};
use kernelkite_sys::provenance::{self, Provenance};

/// The artifact path the pipeline uploads the runner's result under.
pub const RESULT_PATH: &str = "result.json";

/// Why a build's result could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    /// No `finished` result.json is listed.
    #[error("the build has no finished {RESULT_PATH} artifact{}", listed_states(.listed))]
    Missing {
        /// The states of the result.json artifacts that are listed (none: none is).
        listed: Vec<String>,
    },
    /// A Buildkite call failed.
    #[error(transparent)]
    Buildkite(#[from] BuildkiteError),
    /// The download's length is not the listed size.
    #[error("{RESULT_PATH} is {got} bytes but Buildkite lists {want}; the download is truncated or corrupt")]
    SizeMismatch {
        /// Listed size.
        want: u64,
        /// Downloaded size.
        got: u64,
    },
    /// The download's SHA-1 is not the listed one.
    #[error("{RESULT_PATH} has SHA-1 {got} but Buildkite lists {want}; the download is corrupt")]
    Sha1Mismatch {
        /// Listed SHA-1.
        want: String,
        /// Downloaded SHA-1.
        got: String,
    },
    /// The bytes are not a result.
    #[error(transparent)]
    Parse(#[from] NotAResult),
}

/// `" (listed, but in state error, new)"`, or nothing when none is listed.
pub(crate) fn listed_states(states: &[String]) -> String {
    if states.is_empty() {
        String::new()
    } else {
        format!(" (listed, but in state {})", states.join(", "))
    }
}

/// Picks the artifact to use: a `finished` `result.json`; when a retried job uploaded more
/// than one, the last listed (Buildkite lists newest last within a build's jobs).
pub fn choose(artifacts: &[Artifact]) -> Result<&Artifact, ArtifactError> {
    let candidates: Vec<&Artifact> = artifacts.iter().filter(|a| a.path == RESULT_PATH).collect();
    if let Some(a) = candidates.iter().rev().find(|a| a.state == "finished") {
        return Ok(a);
    }
    Err(ArtifactError::Missing {
        listed: candidates.iter().map(|a| a.state.clone()).collect(),
    })
}

/// The `provenance.json` uploaded by the same job as `result`: a retried build's provenance
/// must be the run's whose result is used, never an earlier attempt's.
pub fn choose_provenance<'a>(artifacts: &'a [Artifact], result: &Artifact) -> Option<&'a Artifact> {
    artifacts
        .iter()
        .rev()
        .find(|a| a.path == provenance::FILE && a.state == "finished" && a.job_id == result.job_id)
}

/// Checks a downloaded provenance against the listing, as the result is checked.
pub fn verify_provenance(artifact: &Artifact, bytes: &[u8]) -> Result<Provenance, String> {
    if bytes.len() as u64 != artifact.file_size {
        return Err(format!(
            "{} bytes but Buildkite lists {}",
            bytes.len(),
            artifact.file_size
        ));
    }
    let got = hex::encode(Sha1::digest(bytes));
    if !got.eq_ignore_ascii_case(artifact.sha1sum.trim()) {
        return Err(format!(
            "SHA-1 {got} but Buildkite lists {}",
            artifact.sha1sum
        ));
    }
    Provenance::parse(bytes).map_err(|e| e.to_string())
}

/// Checks downloaded bytes against the listing and parses them.
pub fn verify(artifact: &Artifact, bytes: &[u8]) -> Result<ResultJson, ArtifactError> {
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
    Ok(ResultJson::parse(bytes)?)
}

/// Lists the build's artifacts once, downloads and checks its result.json (two API calls plus
/// the blob fetch) and, when the job uploaded one, its provenance.json (one call and a blob
/// fetch more). The provenance is best effort: one that is missing, cannot be fetched or is
/// not in its format is left out (and logged), and never costs the result.
pub async fn fetch_result(
    client: &BuildkiteClient,
    build_number: u64,
) -> Result<(ResultJson, Option<Provenance>), ArtifactError> {
    let listed = client.list_artifacts(build_number).await?;
    let artifact = choose(&listed)?;
    let bytes = client.download(&artifact.download_url).await?;
    let result = verify(artifact, &bytes)?;
    let Some(p) = choose_provenance(&listed, artifact) else {
        return Ok((result, None));
    };
    if p.file_size > provenance::MAX_BYTES {
        tracing::warn!(
            build = build_number,
            bytes = p.file_size,
            "the build's provenance.json is over its limit; not fetched"
        );
        return Ok((result, None));
    }
    let provenance = match client.download(&p.download_url).await {
        Ok(bytes) => verify_provenance(p, &bytes),
        Err(e) => Err(crate::report::report(&e).to_string()),
    };
    Ok((
        result,
        provenance
            .map_err(|why| {
                tracing::warn!(build = build_number, %why, "the build's provenance.json is not used")
            })
            .ok(),
    ))
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
        assert!(matches!(choose(&[]), Err(ArtifactError::Missing { .. })));
        let mut other = art("finished", b"");
        other.path = "logs/result.json".into();
        assert!(choose(&[other]).is_err());
    }

    #[test]
    fn size_sha1_and_shape_are_checked() {
        let good = art("finished", RESULT.as_bytes());
        assert!(verify(&good, RESULT.as_bytes()).unwrap().success());
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
        for not_a_result in [
            "[]",
            "{\"success\": true}",
            &RESULT.replace("\"success\": true", "\"success\": \"yes\""),
            &RESULT.replace("\"runs\": {}", "\"runs\": {\"test\": 1}"),
            &RESULT.replace("\"runs\": {}", "\"runs\": {\"test\": {\"start\": \"t\"}}"),
            "{\"success\": tru",
        ] {
            assert!(
                matches!(
                    verify(
                        &art("finished", not_a_result.as_bytes()),
                        not_a_result.as_bytes()
                    ),
                    Err(ArtifactError::Parse(_))
                ),
                "{not_a_result}"
            );
        }
    }

    #[test]
    fn the_result_is_kept_byte_for_byte() {
        // A field this service does not know, at several depths, a naive timestamp, a float
        // and an integer serde would write differently, and the runner's own spacing.
        let text = r#"{"success": false, "error": "e", "new_top": {"a": [1.50, 1e400000]},
  "system": {"gpu": "", "device_count": 1, "cpu": "", "runtime": "", "platform": "", "torch": "", "hostname": "h", "numa": 0},
  "runs": {"test": {"start": "2026-11-22T10:40:00.123456", "end": "2026-11-22T10:40:03", "compilation": null,
    "run": {"success": true, "passed": true, "command": "c", "stdout": "", "stderr": "", "exit_code": 0, "duration": 1.0,
            "result": {"check": "pass"}, "new_in_run": 123456789012345678901234567890}, "profile": null, "new_in_eval": true}}}"#;
        let r = verify(&art("finished", text.as_bytes()), text.as_bytes()).unwrap();
        assert_eq!(r.get(), text);
        assert!(!r.success());
        // Serialized inside another document, the text is embedded verbatim.
        let outer = serde_json::to_string(&serde_json::json!({"k": 1})).unwrap();
        let embedded = serde_json::to_string(&(outer, &r)).unwrap();
        assert!(embedded.contains(text), "{embedded}");
    }
}
