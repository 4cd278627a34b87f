//! kernelbot's formats, defined once for the runner, the service and the tests.
//!
//! - [`config`]: the run config kernelbot's backend sends, typed and validated, and the cases
//!   file it implies;
//! - [`payload`]: the `KERNELBOT_PAYLOAD` codec, byte-compatible with Python's
//!   `base64(zlib(json.dumps(config)))`, and the chunked carrier for large payloads;
//! - [`result`]: `FullResult`, the `result.json` kernelbot rebuilds with `Dataclass(**dict)`;
//! - [`pyrepr`]: Python's `str()`/`repr()` and `str.strip()`, which those formats follow.

#![deny(missing_docs)]

pub mod config;
pub mod integral;
pub mod payload;
pub mod pyrepr;
pub mod result;
