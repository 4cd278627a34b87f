//! The job payload: `base64(zlib(JSON config))`, byte-compatible with kernelbot's Python
//! `base64.b64encode(zlib.compress(json.dumps(cfg).encode()))`.
//!
//! Byte compatibility matters in both directions: a payload made by Python decodes here, and a
//! payload made here is the very string Python would have made for the same (ordered) config,
//! so logs and dedup keys agree across the two implementations. That needs Python's JSON
//! layout (`", "`/`": "` separators, `ensure_ascii`, float `repr`) and zlib's own deflate at
//! level 6, which is why flate2 is built on zlib rather than miniz.
//!
//! # Carriers
//! Linux caps a single environment string at 128 KiB (`MAX_ARG_STRLEN`), so a large payload
//! cannot travel in one variable. Three carriers exist, tried in this order by [`from_env`]:
//! 1. chunked: `KERNELBOT_PAYLOAD_CHUNKS=N`, `KERNELBOT_PAYLOAD_0` .. `KERNELBOT_PAYLOAD_{N-1}`
//!    and `KERNELBOT_PAYLOAD_SHA256` (hex digest of the joined string, so a lost or reordered
//!    chunk is detected rather than decoded into garbage);
//! 2. single: `KERNELBOT_PAYLOAD`;
//! 3. file: `--payload-file PATH` holding the same base64 text (handled by the CLI).

use std::io::{Read, Write};

use base64::Engine as _;
use flate2::read::ZlibDecoder;
use flate2::write::ZlibEncoder;
use flate2::Compression;
use serde::Serialize;
use sha2::{Digest, Sha256};

/// Name of the single-variable carrier.
pub const ENV_PAYLOAD: &str = "KERNELBOT_PAYLOAD";
/// Number of chunks in the chunked carrier.
pub const ENV_CHUNKS: &str = "KERNELBOT_PAYLOAD_CHUNKS";
/// SHA-256 (hex) of the joined chunks.
pub const ENV_SHA256: &str = "KERNELBOT_PAYLOAD_SHA256";
/// Largest chunk, in bytes of base64 text. `MAX_ARG_STRLEN` is 131072 bytes for the whole
/// `NAME=value\0` string; this leaves ample room for the longest name.
pub const CHUNK_BYTES: usize = 120 * 1024;
/// Most chunks accepted when decoding; bounds the work a hostile environment can cause.
pub const MAX_CHUNKS: usize = 1024;
/// Largest decompressed config accepted (a zip bomb stops here, not in the allocator).
pub const MAX_DECODED_BYTES: u64 = 256 * 1024 * 1024;

/// What can be wrong with a payload. Each message says what to check.
#[derive(Debug, thiserror::Error)]
pub enum PayloadError {
    /// Not base64.
    #[error(
        "payload is not valid base64 ({0}); it must be base64(zlib(JSON)) as kernelbot writes it"
    )]
    Base64(#[from] base64::DecodeError),
    /// Not zlib data.
    #[error("payload is base64 but not zlib data ({0}); it must be base64(zlib(JSON))")]
    Zlib(std::io::Error),
    /// Decompresses past [`MAX_DECODED_BYTES`].
    #[error("payload decompresses to more than {MAX_DECODED_BYTES} bytes; refusing it")]
    TooLarge,
    /// Not JSON.
    #[error("payload is not valid JSON ({0}); it must be base64(zlib(JSON))")]
    Json(#[from] serde_json::Error),
    /// An empty payload.
    #[error("payload is empty; set {ENV_PAYLOAD} (or the chunked carrier) or pass --payload-file")]
    Empty,
    /// No carrier set.
    #[error("no payload found: set {ENV_PAYLOAD}, or {ENV_CHUNKS} with {ENV_PAYLOAD}_0.., or pass --payload-file")]
    Missing,
    /// The chunked carrier is inconsistent; says how.
    #[error("chunked payload is broken: {0}")]
    Chunks(String),
}

/// Serializes `value` exactly as Python's `json.dumps(value)` does (default arguments).
pub fn python_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
    value.serialize(&mut ser)?;
    Ok(out)
}

/// Encodes a config (any serializable value; a `serde_json::Value` keeps key order) into the
/// payload string.
pub fn encode<T: Serialize + ?Sized>(config: &T) -> Result<String, PayloadError> {
    let json = python_json(config)?;
    let mut z = ZlibEncoder::new(Vec::new(), Compression::new(6));
    z.write_all(&json).map_err(PayloadError::Zlib)?;
    let compressed = z.finish().map_err(PayloadError::Zlib)?;
    Ok(base64::engine::general_purpose::STANDARD.encode(compressed))
}

/// Decodes a payload string into JSON. Surrounding whitespace (a trailing newline in a
/// payload file, say) is ignored.
pub fn decode(payload: &str) -> Result<serde_json::Value, PayloadError> {
    let text = payload.trim();
    if text.is_empty() {
        return Err(PayloadError::Empty);
    }
    let compressed = base64::engine::general_purpose::STANDARD.decode(text)?;
    let mut json = Vec::new();
    ZlibDecoder::new(compressed.as_slice())
        .take(MAX_DECODED_BYTES + 1)
        .read_to_end(&mut json)
        .map_err(PayloadError::Zlib)?;
    if json.len() as u64 > MAX_DECODED_BYTES {
        return Err(PayloadError::TooLarge);
    }
    Ok(serde_json::from_slice(&json)?)
}

/// The environment variables that carry `payload`: the single variable when it fits, else
/// the chunked carrier.
pub fn to_env(payload: &str) -> Vec<(String, String)> {
    if payload.len() <= CHUNK_BYTES {
        return vec![(ENV_PAYLOAD.to_string(), payload.to_string())];
    }
    // base64 is ASCII, so byte chunks are char boundaries.
    let chunks: Vec<&str> = payload
        .as_bytes()
        .chunks(CHUNK_BYTES)
        .map(|c| std::str::from_utf8(c).unwrap_or_default())
        .collect();
    let mut vars = vec![
        (ENV_CHUNKS.to_string(), chunks.len().to_string()),
        (
            ENV_SHA256.to_string(),
            hex::encode(Sha256::digest(payload.as_bytes())),
        ),
    ];
    for (i, c) in chunks.iter().enumerate() {
        vars.push((format!("{ENV_PAYLOAD}_{i}"), (*c).to_string()));
    }
    vars
}

/// Reassembles the payload string from an environment lookup (chunked first, then single).
pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<String, PayloadError> {
    if let Some(n) = get(ENV_CHUNKS) {
        let n: usize = n
            .trim()
            .parse()
            .map_err(|_| PayloadError::Chunks(format!("{ENV_CHUNKS}={n:?} is not a number")))?;
        if n == 0 || n > MAX_CHUNKS {
            return Err(PayloadError::Chunks(format!(
                "{ENV_CHUNKS}={n} is out of range 1..={MAX_CHUNKS}"
            )));
        }
        let mut joined = String::new();
        for i in 0..n {
            let part = get(&format!("{ENV_PAYLOAD}_{i}")).ok_or_else(|| {
                PayloadError::Chunks(format!(
                    "{ENV_PAYLOAD}_{i} is missing ({n} chunks announced)"
                ))
            })?;
            joined.push_str(part.trim());
        }
        let want = get(ENV_SHA256)
            .ok_or_else(|| PayloadError::Chunks(format!("{ENV_SHA256} is missing")))?;
        let got = hex::encode(Sha256::digest(joined.as_bytes()));
        if !got.eq_ignore_ascii_case(want.trim()) {
            return Err(PayloadError::Chunks(format!(
                "SHA-256 of the joined chunks is {got}, but {ENV_SHA256} says {}; a chunk is missing, reordered or truncated",
                want.trim()
            )));
        }
        return Ok(joined);
    }
    match get(ENV_PAYLOAD) {
        Some(p) if p.trim().is_empty() => Err(PayloadError::Empty),
        Some(p) => Ok(p),
        None => Err(PayloadError::Missing),
    }
}

/// serde_json formatter that reproduces Python's `json.dumps` defaults.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
    fn write_string_fragment<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        // ensure_ascii: everything outside printable ASCII is \uXXXX (UTF-16 units, lower hex).
        let mut start = 0;
        for (i, ch) in fragment.char_indices() {
            if (' '..='~').contains(&ch) {
                continue;
            }
            w.write_all(&fragment.as_bytes()[start..i])?;
            let mut units = [0u16; 2];
            for u in ch.encode_utf16(&mut units) {
                write!(w, "\\u{:04x}", u)?;
            }
            start = i + ch.len_utf8();
        }
        w.write_all(&fragment.as_bytes()[start..])
    }
    fn write_f64<W: ?Sized + Write>(&mut self, w: &mut W, value: f64) -> std::io::Result<()> {
        w.write_all(python_json_float(value).as_bytes())
    }
    /// A `Value`'s number, which keeps its literal (serde_json's `arbitrary_precision`):
    /// written as `json.dumps(json.loads(literal))` would, an int exactly, a float as its
    /// `repr`.
    fn write_number_str<W: ?Sized + Write>(
        &mut self,
        w: &mut W,
        value: &str,
    ) -> std::io::Result<()> {
        match crate::pyrepr::py_number(value) {
            Some(crate::pyrepr::PyNumber::Int(i)) => w.write_all(i.as_bytes()),
            Some(crate::pyrepr::PyNumber::Float(f)) => w.write_all(python_json_float(f).as_bytes()),
            None => w.write_all(value.as_bytes()),
        }
    }
    fn write_f32<W: ?Sized + Write>(&mut self, w: &mut W, value: f32) -> std::io::Result<()> {
        self.write_f64(w, f64::from(value))
    }
}

/// A float as Python's `json.dumps` writes it: its `repr`, and `NaN` / `Infinity` /
/// `-Infinity` for the values JSON has no literal for.
fn python_json_float(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        crate::pyrepr::float_repr(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn python_layout_of_json() {
        let v = json!({"lang": "py", "x": [1, 2.5, "é😀\u{7f}"], "n": null, "t": true});
        assert_eq!(
            String::from_utf8(python_json(&v).unwrap()).unwrap(),
            r#"{"lang": "py", "x": [1, 2.5, "\u00e9\ud83d\ude00\u007f"], "n": null, "t": true}"#
        );
    }

    #[test]
    fn numbers_are_written_as_json_dumps_of_json_loads() {
        let v: serde_json::Value = serde_json::from_str(
            "[1180591620717411303424, -0, 1E5, 1e-05, 0.10, 1e400, -1e400, 2.0, 3]",
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(python_json(&v).unwrap()).unwrap(),
            "[1180591620717411303424, 0, 100000.0, 1e-05, 0.1, Infinity, -Infinity, 2.0, 3]"
        );
        assert_eq!(python_json_float(f64::NAN), "NaN");
    }

    #[test]
    fn bad_payloads_say_what_is_wrong() {
        assert!(matches!(decode("%%%"), Err(PayloadError::Base64(_))));
        assert!(matches!(decode("aGVsbG8="), Err(PayloadError::Zlib(_))));
        let not_json = {
            let mut z = ZlibEncoder::new(Vec::new(), Compression::default());
            z.write_all(b"{nope").unwrap();
            base64::engine::general_purpose::STANDARD.encode(z.finish().unwrap())
        };
        assert!(matches!(decode(&not_json), Err(PayloadError::Json(_))));
        assert!(matches!(decode("  \n"), Err(PayloadError::Empty)));
    }

    #[test]
    fn zip_bomb_is_refused() {
        let mut z = ZlibEncoder::new(Vec::new(), Compression::best());
        let zeros = vec![b' '; 1 << 20];
        for _ in 0..(MAX_DECODED_BYTES >> 20) + 1 {
            z.write_all(&zeros).unwrap();
        }
        let p = base64::engine::general_purpose::STANDARD.encode(z.finish().unwrap());
        assert!(matches!(decode(&p), Err(PayloadError::TooLarge)));
    }

    #[test]
    fn chunked_carrier_detects_missing_and_reordered_chunks() {
        let big: String = (0..300_000)
            .map(|i| char::from(b'A' + (i % 26) as u8))
            .collect();
        let vars = to_env(&big);
        assert!(vars.iter().all(|(k, v)| k.len() + v.len() + 2 <= 131_072));
        let map: std::collections::HashMap<_, _> = vars.into_iter().collect();
        assert_eq!(from_env(|k| map.get(k).cloned()).unwrap(), big);

        let mut swapped = map.clone();
        let a = swapped[&format!("{ENV_PAYLOAD}_0")].clone();
        let b = swapped[&format!("{ENV_PAYLOAD}_1")].clone();
        swapped.insert(format!("{ENV_PAYLOAD}_0"), b);
        swapped.insert(format!("{ENV_PAYLOAD}_1"), a);
        assert!(matches!(
            from_env(|k| swapped.get(k).cloned()),
            Err(PayloadError::Chunks(_))
        ));

        let mut missing = map.clone();
        missing.remove(&format!("{ENV_PAYLOAD}_2"));
        let err = from_env(|k| missing.get(k).cloned())
            .unwrap_err()
            .to_string();
        assert!(err.contains("KERNELBOT_PAYLOAD_2 is missing"), "{err}");

        assert!(matches!(from_env(|_| None), Err(PayloadError::Missing)));
    }

    #[test]
    fn small_payload_uses_single_variable() {
        assert_eq!(
            to_env("abc"),
            vec![(ENV_PAYLOAD.to_string(), "abc".to_string())]
        );
    }

    fn arb_json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            any::<i64>().prop_map(|i| json!(i)),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| json!(f)),
            any::<String>().prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                proptest::collection::vec((any::<String>(), inner), 0..6)
                    .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        // Numbers keep their literal (`arbitrary_precision`), and a float built in Rust
        // (`0.00001`) is spelled differently from Python's (`1e-05`), so the round trip is
        // checked on the Python-layout JSON, which is what byte compatibility means.
        #[test]
        fn payload_round_trips(v in arb_json()) {
            let p = encode(&v).unwrap();
            let back = decode(&p).unwrap();
            prop_assert_eq!(python_json(&back).unwrap(), python_json(&v).unwrap());
            prop_assert_eq!(encode(&back).unwrap(), p);
        }

        #[test]
        fn env_carrier_round_trips(len in 0usize..400_000) {
            let s: String = "x".repeat(len.max(1));
            let map: std::collections::HashMap<_, _> = to_env(&s).into_iter().collect();
            prop_assert_eq!(from_env(|k| map.get(k).cloned()).unwrap(), s);
        }

        #[test]
        fn decode_never_panics(s in ".{0,200}") {
            let _ = decode(&s);
        }
    }
}
