//! Python's text forms of JSON values: `str()`, `repr()`, `str.isspace()` / `str.strip()`.
//!
//! kernelbot loads the config with `json.loads` and writes each case as `f"{k}: {v}"`, i.e.
//! Python's `str()` of what `json.loads` gave: an integer of any size, a float's shortest
//! `repr`, `True`/`False`/`None`, a string as is, and lists and dicts as their `repr`, with
//! strings inside quoted and escaped the way Python does. Task harnesses parse that text, so
//! it is reproduced character for character here. The POPCORN reader strips keys and values
//! with `str.strip()`, whose idea of whitespace is Python's too.

use serde_json::{Number, Value};

mod printable;

pub use printable::UNICODE_VERSION;

/// Python's `str(v)` of the value `json.loads` gives for `v`.
pub fn str_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => repr_of(other),
    }
}

/// Python's `repr(v)` of the value `json.loads` gives for `v`.
pub fn repr_of(v: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, v);
    out
}

fn write_repr(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("None"),
        Value::Bool(true) => out.push_str("True"),
        Value::Bool(false) => out.push_str("False"),
        Value::Number(n) => out.push_str(&number_str(n)),
        Value::String(s) => write_str_repr(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_str_repr(out, k);
                out.push_str(": ");
                write_repr(out, item);
            }
            out.push('}');
        }
    }
}

/// What `json.loads` makes of a JSON number literal.
#[derive(Debug, Clone, PartialEq)]
pub enum PyNumber {
    /// An `int`, in decimal, of any size (no sign on zero: `-0` loads as `0`).
    Int(String),
    /// A `float` (a literal with `.`, `e` or `E`; too large a one is infinite).
    Float(f64),
}

/// Classifies a JSON number literal as `json.loads` does: a fraction or an exponent makes a
/// float, anything else is an int. `None` for text that is not a JSON number.
pub fn py_number(literal: &str) -> Option<PyNumber> {
    let digits = literal.strip_prefix('-').unwrap_or(literal);
    if digits.is_empty() {
        return None;
    }
    if digits.contains(['.', 'e', 'E']) {
        return literal.parse::<f64>().ok().map(PyNumber::Float);
    }
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let trimmed = digits.trim_start_matches('0');
    Some(PyNumber::Int(
        match (trimmed.is_empty(), literal.starts_with('-')) {
            (true, _) => "0".to_string(),
            (false, true) => format!("-{trimmed}"),
            (false, false) => trimmed.to_string(),
        },
    ))
}

/// Python's `str()` of a loaded JSON number. serde_json keeps the literal (the
/// `arbitrary_precision` feature), so integers beyond 64 bits stay exact, as in Python.
pub fn number_str(n: &Number) -> String {
    let literal = n.to_string();
    match py_number(&literal) {
        Some(PyNumber::Int(i)) => i,
        Some(PyNumber::Float(f)) => float_repr(f),
        None => literal,
    }
}

/// Python's `repr(float)` (which is also its `str()`): the shortest digits that round-trip,
/// in scientific notation when the decimal exponent is below -4 or at least 16, with a signed
/// two-digit exponent; `inf`, `-inf`, `nan`.
pub fn float_repr(v: f64) -> String {
    if v.is_nan() {
        return "nan".into();
    }
    if v.is_infinite() {
        return if v > 0.0 { "inf" } else { "-inf" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits, as Python's repr does; only the
    // layout differs.
    let sci = format!("{v:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mant) = mant.strip_prefix('-').map_or(("", mant), |m| ("-", m));
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    if point <= 0 {
        format!(
            "{sign}0.{}{digits}",
            "0".repeat(point.unsigned_abs() as usize)
        )
    } else if point as usize >= digits.len() {
        format!(
            "{sign}{digits}{}.0",
            "0".repeat(point as usize - digits.len())
        )
    } else {
        let (a, b) = digits.split_at(point as usize);
        format!("{sign}{a}.{b}")
    }
}

/// Python's `repr(s)` of a string.
pub fn str_repr(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    write_str_repr(&mut out, s);
    out
}

/// CPython's rule: single quotes unless the text has a single quote and no double quote;
/// the chosen quote and `\` escaped; `\t`, `\n`, `\r` by name; other ASCII controls and
/// non-printable characters as `\xhh`, `\uhhhh` or `\Uhhhhhhhh`; everything else as is.
fn write_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c if c.is_ascii() || is_printable(c) => out.push(c),
            c => {
                let cp = c as u32;
                if cp <= 0xff {
                    out.push_str(&format!("\\x{cp:02x}"));
                } else if cp <= 0xffff {
                    out.push_str(&format!("\\u{cp:04x}"));
                } else {
                    out.push_str(&format!("\\U{cp:08x}"));
                }
            }
        }
    }
    out.push(quote);
}

/// Python's `str.isprintable()` for one character (its Unicode database, see
/// [`UNICODE_VERSION`]): false for categories Cc, Cf, Cs, Co, Cn, Zl, Zp and Zs but space.
pub fn is_printable(c: char) -> bool {
    let cp = c as u32;
    let table = printable::NOT_PRINTABLE;
    // The last range starting at or before cp is the only one that can hold it.
    let i = table.partition_point(|&(start, _)| start <= cp);
    !(i > 0 && cp <= table[i - 1].1)
}

/// Python's `str.isspace()` for one character: the ASCII whitespace including the
/// information separators `\x1c`..`\x1f`, and the characters of bidirectional class WS, B
/// or S or category Zs (no other Unicode version changed this set since Python 3.3).
pub fn is_space(c: char) -> bool {
    matches!(
        c,
        '\t' | '\n'
            | '\x0b'
            | '\x0c'
            | '\r'
            | '\x1c'..='\x1f'
            | ' '
            | '\u{85}'
            | '\u{a0}'
            | '\u{1680}'
            | '\u{2000}'..='\u{200a}'
            | '\u{2028}'
            | '\u{2029}'
            | '\u{202f}'
            | '\u{205f}'
            | '\u{3000}'
    )
}

/// Python's `str.strip()` without arguments.
pub fn strip(s: &str) -> &str {
    s.trim_matches(is_space)
}

/// A line boundary of Python's `str.splitlines()`.
pub fn is_line_break(c: char) -> bool {
    matches!(
        c,
        '\n' | '\r'
            | '\x0b'
            | '\x0c'
            | '\x1c'
            | '\x1d'
            | '\x1e'
            | '\u{85}'
            | '\u{2028}'
            | '\u{2029}'
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parsed(text: &str) -> Value {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn str_of_each_json_type() {
        for (text, want) in [
            (r#""a b""#, "a b"),
            ("true", "True"),
            ("null", "None"),
            ("1180591620717411303424", "1180591620717411303424"),
            ("-0", "0"),
            ("-0.0", "-0.0"),
            ("1e-07", "1e-07"),
            ("1E16", "1e+16"),
            ("2.0", "2.0"),
            ("1e400", "inf"),
            (r#"["a", "b"]"#, "['a', 'b']"),
            ("[true, null, 1.5, []]", "[True, None, 1.5, []]"),
            (r#"{"k": "v", "n": 1}"#, "{'k': 'v', 'n': 1}"),
            ("{}", "{}"),
            (
                r#"["it's", "say \"hi\"", "both ' \""]"#,
                r#"["it's", 'say "hi"', 'both \' "']"#,
            ),
            (
                r#"["a\\b\n\t\r\u0001\u007f\u0085\u00e9\u00ad\u2028\ud83d\ude00\udb40\udc01"]"#,
                r"['a\\b\n\t\r\x01\x7f\x85é\xad\u2028😀\U000e0001']",
            ),
        ] {
            assert_eq!(str_of(&parsed(text)), want, "{text}");
        }
    }

    #[test]
    fn numbers_made_in_rust_are_floats_or_ints_as_in_python() {
        assert_eq!(str_of(&json!(1e16)), "1e+16");
        assert_eq!(str_of(&json!(100.0)), "100.0");
        assert_eq!(str_of(&json!(0.00001)), "1e-05");
        assert_eq!(str_of(&json!(-7)), "-7");
        assert_eq!(str_of(&json!(u64::MAX)), "18446744073709551615");
    }

    #[test]
    fn float_reprs() {
        for (v, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (100.0, "100.0"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
        ] {
            assert_eq!(float_repr(v), want, "{v}");
        }
    }

    #[test]
    fn strip_uses_pythons_whitespace() {
        assert_eq!(strip("\x1f\u{85} a b\u{3000}\x1c"), "a b");
        assert_eq!(strip("\u{200b}x\u{180e}"), "\u{200b}x\u{180e}");
        assert!(is_printable(' ') && !is_printable('\u{a0}') && is_printable('é'));
    }
}
