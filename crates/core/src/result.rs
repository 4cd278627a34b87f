//! A build's `result.json`, checked before anyone trusts it and then kept as the runner's own
//! JSON text ([`ResultJson`]), never re-encoded: when kernelbot adds a field and the nodes'
//! runners write it before this service knows it, or a runner writes naive timestamps, the
//! backend still gets exactly what the runner wrote.
//!
//! Any executor's result goes through here; where the bytes come from (a Buildkite artifact,
//! a file on this machine) is the executor's business.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::report::BoxError;

/// Bytes that are not a kernelbot `FullResult`.
#[derive(Debug, thiserror::Error)]
#[error("result.json is not a kernelbot FullResult")]
pub struct NotAResult(#[source] BoxError);

/// A verified `result.json`, as the artifact's JSON text: serialized, it is written out
/// verbatim, so GET, SSE, callbacks and the archive carry the runner's bytes unchanged.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ResultJson(Box<RawValue>);

impl ResultJson {
    /// Parses `bytes` and checks the fields the service and kernelbot rely on; every other
    /// field, known or not, is kept as it is.
    pub fn parse(bytes: &[u8]) -> Result<ResultJson, NotAResult> {
        let text = std::str::from_utf8(bytes).map_err(|e| NotAResult(e.into()))?;
        let raw: Box<RawValue> = serde_json::from_str(text).map_err(|e| NotAResult(e.into()))?;
        serde_json::from_str::<ResultShape>(raw.get()).map_err(|e| NotAResult(e.into()))?;
        Ok(ResultJson(raw))
    }

    /// The JSON text, exactly as the runner wrote it (without surrounding whitespace).
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// The runner's own `success`: did the evaluation run (not: did the tests pass).
    pub fn success(&self) -> bool {
        serde_json::from_str::<ResultShape>(self.get()).is_ok_and(|r| r.success)
    }
}

impl PartialEq for ResultJson {
    fn eq(&self, other: &ResultJson) -> bool {
        self.get() == other.get()
    }
}

/// The part of `FullResult` a result must have: what kernelbot's `FullResult(**dict)` needs at
/// the top level and in each run. Unknown fields are allowed at every depth (a newer runner may
/// write them), and values are not reinterpreted (a naive timestamp is still a timestamp).
#[derive(Deserialize)]
struct ResultShape {
    success: bool,
    #[allow(dead_code)] // Checked for its type only.
    error: String,
    #[allow(dead_code)]
    system: serde_json::Map<String, serde_json::Value>,
    #[allow(dead_code)]
    runs: BTreeMap<String, RunShape>,
}

#[derive(Deserialize)]
#[allow(dead_code)] // Checked for its shape only.
struct RunShape {
    start: String,
    end: String,
    compilation: Option<serde_json::Map<String, serde_json::Value>>,
    run: Option<serde_json::Map<String, serde_json::Value>>,
    profile: Option<serde_json::Map<String, serde_json::Value>>,
}
