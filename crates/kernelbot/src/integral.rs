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
    // The literal itself, exactly: through a float, `9007199254740993.0` would read as
    // `...992`, and a whole float of 2^53 or more (schema-valid) would be refused.
    match literal(&n.to_string()) {
        Some(Literal::Whole(v)) => i64::try_from(v)
            .ok()
            .and_then(|i| T::try_from(i).ok())
            .or_else(|| u64::try_from(v).ok().and_then(|u| T::try_from(u).ok()))
            .ok_or_else(|| refused(Unexpected::Float(f))),
        _ => Err(refused(Unexpected::Float(f))),
    }
}

/// What a JSON number literal stands for.
#[derive(Debug, PartialEq, Eq)]
enum Literal {
    /// A whole number, exactly.
    Whole(i128),
    /// A number with a fraction, or too large for an `i128`.
    Other,
}

/// Reads a JSON number literal (`-`, digits, an optional fraction and exponent) exactly, as
/// decimal digits; `None` for text that is not one.
fn literal(text: &str) -> Option<Literal> {
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match text.find(['e', 'E']) {
        Some(i) => (&text[..i], text[i + 1..].parse::<i64>().ok()?),
        None => (text, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digit = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if int.is_empty() || !digit(int) || !digit(frac) {
        return None;
    }
    let digits = format!("{int}{frac}");
    // The value is `digits` x 10^shift.
    let shift = exponent.checked_sub(i64::try_from(frac.len()).ok()?)?;
    let whole = if shift < 0 {
        let cut = usize::try_from(shift.unsigned_abs())
            .ok()?
            .min(digits.len());
        let (kept, dropped) = digits.split_at(digits.len() - cut);
        if !dropped.bytes().all(|b| b == b'0') {
            return Some(Literal::Other);
        }
        kept.to_string()
    } else {
        let significant = digits.trim_start_matches('0');
        if significant.is_empty() {
            return Some(Literal::Whole(0));
        }
        // 39 digits and more are past an i128.
        if i64::try_from(significant.len()).ok()?.saturating_add(shift) > 38 {
            return Some(Literal::Other);
        }
        format!("{significant}{}", "0".repeat(usize::try_from(shift).ok()?))
    };
    let whole = whole.trim_start_matches('0');
    let value: i128 = if whole.is_empty() {
        0
    } else {
        match whole.parse() {
            Ok(v) => v,
            Err(_) => return Some(Literal::Other),
        }
    };
    Some(Literal::Whole(if negative { -value } else { value }))
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

    /// What schemathesis sent (a whole float of 2^53, schema-valid for an integer field), and
    /// the exact reading of literals a float would round.
    #[test]
    fn a_whole_literal_is_read_exactly_whatever_its_size() {
        let seed = |text: &str| -> Result<Option<i64>, String> {
            serde_json::from_str::<T>(&format!(r#"{{"n": 1, "seed": {text}}}"#))
                .map(|t| t.seed)
                .map_err(|e| e.to_string())
        };
        assert_eq!(seed("9007199254740992.0"), Ok(Some(9_007_199_254_740_992)));
        assert_eq!(seed("9007199254740993.0"), Ok(Some(9_007_199_254_740_993)));
        assert_eq!(seed("-9223372036854775808.00"), Ok(Some(i64::MIN)));
        assert_eq!(seed("9.223372036854775807e18"), Ok(Some(i64::MAX)));
        assert_eq!(seed("1e3"), Ok(Some(1000)));
        assert_eq!(seed("1.5E1"), Ok(Some(15)));
        assert_eq!(seed("-0.0"), Ok(Some(0)));
        assert_eq!(seed("120e-1"), Ok(Some(12)));
        assert_eq!(seed("0.000e5"), Ok(Some(0)));
        for bad in [
            "1.25e1",
            "9223372036854775808.0",
            "1e19",
            "1e400",
            "0.1e0",
            "5e-1",
        ] {
            let e = seed(bad).unwrap_err();
            assert!(e.contains("whole number"), "{bad}: {e}");
        }
        assert_eq!(super::literal("1e-400"), Some(super::Literal::Other));
        assert_eq!(super::literal("0e-400"), Some(super::Literal::Whole(0)));
        assert_eq!(super::literal("abc"), None);
    }
}
