//! Whole numbers as JSON Schema counts them: `3` and `3.0` are the same integer there (a
//! number with a zero fraction; draft 2020-12, which `service/openapi.json` follows), so a field
//! the document calls an integer takes both. serde's integer types refuse `3.0`; these
//! deserializers take it as `3`, and refuse a fraction, a value out of range, and anything
//! that is not a number, naming what they expected.

use serde::de::{Deserialize, Deserializer, Error, Unexpected};

/// The whole number `n` stands for, as a `T`. Through the number's own type: this crate reads
/// JSON with `arbitrary_precision`, under which a number that is not an integer literal
/// reaches a deserializer as its literal, not as a float.
fn whole<T, E>(n: &serde_json::Number) -> Result<T, E>
where
    T: TryFrom<i64> + TryFrom<u64>,
    E: Error,
{
    let expected = || format!("a whole number in range for {}", std::any::type_name::<T>());
    let refused = |what: Unexpected| E::invalid_value(what, &expected().as_str());
    if let Some(u) = n.as_u64() {
        return T::try_from(u).map_err(|_| refused(Unexpected::Unsigned(u)));
    }
    if let Some(i) = n.as_i64() {
        return T::try_from(i).map_err(|_| refused(Unexpected::Signed(i)));
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    // Exactly representable whole floats only (below 2^53): beyond, a float is not a count
    // anyone meant, and the cast below would not be exact.
    if f.fract() != 0.0 || !f.is_finite() || f.abs() >= 9_007_199_254_740_992.0 {
        return Err(refused(Unexpected::Float(f)));
    }
    // Whole and below 2^53 in size (checked above): the cast is exact.
    let i = f as i64;
    T::try_from(i).map_err(|_| refused(Unexpected::Float(f)))
}

/// A `u64` from `3` or `3.0`.
pub fn u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    whole(&serde_json::Number::deserialize(d)?)
}

/// A `u32` from `3` or `3.0`.
pub fn u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    whole(&serde_json::Number::deserialize(d)?)
}

/// An optional `u64` (`null` is `None`).
pub fn opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    Option::<serde_json::Number>::deserialize(d)?
        .map(|n| whole(&n))
        .transpose()
}

/// An optional `i64` (`null` is `None`).
pub fn opt_i64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    Option::<serde_json::Number>::deserialize(d)?
        .map(|n| whole(&n))
        .transpose()
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, Deserialize, PartialEq)]
    struct T {
        #[serde(deserialize_with = "super::u64")]
        n: u64,
        #[serde(default, deserialize_with = "super::opt_i64")]
        seed: Option<i64>,
    }

    /// Both ways a config is read: from text (the service's request) and from a value.
    fn read(v: serde_json::Value) -> Result<T, String> {
        let text: Result<T, String> =
            serde_json::from_str(&v.to_string()).map_err(|e| e.to_string());
        let value: Result<T, String> = serde_json::from_value(v).map_err(|e| e.to_string());
        // The same answer (the text's error adds where it was).
        assert_eq!(text.is_ok(), value.is_ok(), "{text:?} {value:?}");
        if let (Ok(a), Ok(b)) = (&text, &value) {
            assert_eq!(a, b);
        }
        text
    }

    #[test]
    fn a_whole_float_is_the_integer_and_anything_else_is_refused() {
        assert_eq!(read(json!({"n": 3})).unwrap().n, 3);
        assert_eq!(read(json!({"n": 3.0})).unwrap().n, 3);
        assert_eq!(read(json!({"n": 3, "seed": -2.0})).unwrap().seed, Some(-2));
        assert_eq!(read(json!({"n": 3, "seed": null})).unwrap().seed, None);
        assert_eq!(read(json!({"n": 3})).unwrap().seed, None);
        for bad in [
            json!(3.5),
            json!(-1),
            json!(-1.0),
            json!("3"),
            json!(null),
            json!(1e300),
        ] {
            let e = read(json!({ "n": bad })).unwrap_err();
            assert!(
                e.contains("whole number") || e.contains("invalid type"),
                "{bad}: {e}"
            );
        }
        assert!(read(json!({"n": 1, "seed": u64::MAX})).is_err());
        assert!(read(json!({"n": 1, "seed": 0.5})).is_err());
    }
}
