//! YAML read the way kernelbot reads `task.yml`: PyYAML's `safe_load` (YAML 1.1 resolution of
//! plain scalars), then turned into the JSON its payload carries (`json.dumps`).
//!
//! The two YAML versions disagree on plain scalars that tasks do write: PyYAML reads `yes`,
//! `on`, `off` as booleans, `017` as octal 15, `1_000` as 1000 and `1:30` as 90 (base 60),
//! but `1e3` (no dot, no exponent sign) and `0o17` as strings. A YAML 1.2 loader gives the
//! other answer for each, and the cases file the harness reads would differ. So this loader
//! keeps each scalar's style from the parser and resolves plain ones with PyYAML's rules.
//! What PyYAML makes but JSON cannot carry (dates, `.inf`, `.nan`, binary) is refused with the
//! quoting that fixes it.

use std::collections::HashMap;
use std::sync::LazyLock;

use regex::Regex;
use serde_json::{Map, Number, Value};
use yaml_rust2::parser::{Event, Parser, Tag};
use yaml_rust2::scanner::{Marker, TScalarStyle};

/// Why a YAML document could not be read as kernelbot would read it.
#[derive(Debug, thiserror::Error)]
pub enum YamlError {
    /// Not YAML.
    #[error("{0}")]
    Syntax(#[from] yaml_rust2::ScanError),
    /// YAML that PyYAML reads into something kernelbot's JSON payload cannot carry, or that
    /// PyYAML's safe loader refuses.
    #[error("line {line}: {what}")]
    Unsupported {
        /// 1-based line of the node.
        line: usize,
        /// What is wrong and how to write it instead.
        what: String,
    },
    /// No document in the text.
    #[error("the file holds no YAML document")]
    Empty,
}

fn unsupported(mark: Marker, what: impl Into<String>) -> YamlError {
    YamlError::Unsupported {
        line: mark.line(),
        what: what.into(),
    }
}

/// The first document of `text`, as PyYAML's `safe_load` reads it and `json.dumps` writes it.
pub fn load(text: &str) -> Result<Value, YamlError> {
    let mut loader = Loader {
        parser: Parser::new_from_str(text),
        anchors: HashMap::new(),
    };
    loop {
        let (ev, mark) = loader.parser.next_token()?;
        match ev {
            Event::StreamStart => {}
            Event::DocumentStart => {
                let (ev, mark) = loader.parser.next_token()?;
                // `---` alone is a document holding null.
                if ev == Event::DocumentEnd {
                    return Ok(Value::Null);
                }
                return loader.node(ev, mark);
            }
            Event::StreamEnd => return Err(YamlError::Empty),
            _ => return Err(unsupported(mark, "unexpected YAML event")),
        }
    }
}

struct Loader<'a> {
    parser: Parser<std::str::Chars<'a>>,
    anchors: HashMap<usize, Value>,
}

impl Loader<'_> {
    fn node(&mut self, ev: Event, mark: Marker) -> Result<Value, YamlError> {
        match ev {
            Event::Alias(id) => self
                .anchors
                .get(&id)
                .cloned()
                .ok_or_else(|| unsupported(mark, "an alias to an unknown anchor")),
            Event::Scalar(text, style, anchor, tag) => {
                let v = scalar(&text, style, tag.as_ref(), mark)?;
                self.anchor(anchor, &v);
                Ok(v)
            }
            Event::SequenceStart(anchor, tag) => {
                check_collection_tag(tag.as_ref(), "seq", mark)?;
                let mut items = Vec::new();
                loop {
                    let (ev, mark) = self.parser.next_token()?;
                    if ev == Event::SequenceEnd {
                        break;
                    }
                    items.push(self.node(ev, mark)?);
                }
                let v = Value::Array(items);
                self.anchor(anchor, &v);
                Ok(v)
            }
            Event::MappingStart(anchor, tag) => {
                check_collection_tag(tag.as_ref(), "map", mark)?;
                let v = Value::Object(self.mapping()?);
                self.anchor(anchor, &v);
                Ok(v)
            }
            _ => Err(unsupported(mark, "unexpected YAML event")),
        }
    }

    fn anchor(&mut self, anchor: usize, v: &Value) {
        if anchor > 0 {
            self.anchors.insert(anchor, v.clone());
        }
    }

    /// A mapping's pairs, PyYAML's way: merge keys (`<<`) first, the mapping's own pairs after
    /// them; a repeated key keeps its first position and takes the last value, and keys equal
    /// in Python are one key (`1`, `1.0` and `true`), written as the first was (a Python dict
    /// dumped by `json.dumps`).
    fn mapping(&mut self) -> Result<Map<String, Value>, YamlError> {
        let mut own: Vec<(String, KeyEq, Value)> = Vec::new();
        let mut merges: Vec<Map<String, Value>> = Vec::new();
        loop {
            let (ev, mark) = self.parser.next_token()?;
            if ev == Event::MappingEnd {
                break;
            }
            let is_merge =
                matches!(&ev, Event::Scalar(t, TScalarStyle::Plain, _, None) if t == "<<");
            if is_merge {
                let (ev, vmark) = self.parser.next_token()?;
                let bad = || {
                    unsupported(
                        vmark,
                        "a merge key (<<) takes a mapping or a list of mappings",
                    )
                };
                match self.node(ev, vmark)? {
                    Value::Object(m) => merges.push(m),
                    Value::Array(items) => {
                        // PyYAML: with a list, earlier mappings win over later ones.
                        let mut maps = Vec::new();
                        for item in items {
                            match item {
                                Value::Object(m) => maps.push(m),
                                _ => return Err(bad()),
                            }
                        }
                        merges.extend(maps.into_iter().rev());
                    }
                    _ => return Err(bad()),
                }
                continue;
            }
            let (text, eq) = match self.node(ev, mark)? {
                Value::String(s) => (s.clone(), KeyEq::Str(s)),
                Value::Bool(b) => (
                    if b { "true" } else { "false" }.to_string(),
                    KeyEq::Num(u8::from(b).to_string()),
                ),
                Value::Null => ("null".to_string(), KeyEq::Null),
                Value::Number(n) => (n.to_string(), KeyEq::Num(numeric_key(&n))),
                _ => {
                    return Err(unsupported(
                        mark,
                        "a mapping key must be a scalar (PyYAML cannot hash a list or mapping)",
                    ))
                }
            };
            let (ev, vmark) = self.parser.next_token()?;
            let value = self.node(ev, vmark)?;
            own.push((text, eq, value));
        }
        let mut out = Map::new();
        let mut first: HashMap<KeyEq, String> = HashMap::new();
        let mut put = |text: String, eq: KeyEq, v: Value| {
            let text = first.entry(eq).or_insert(text).clone();
            out.insert(text, v);
        };
        for m in merges {
            for (k, v) in m {
                put(k.clone(), KeyEq::Str(k), v);
            }
        }
        for (text, eq, v) in own {
            put(text, eq, v);
        }
        Ok(out)
    }
}

/// A mapping key as Python compares it: `1 == 1.0 == True`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum KeyEq {
    Str(String),
    Num(String),
    Null,
}

/// An integral number as its integer text (`1.0` → `1`), others as written.
fn numeric_key(n: &Number) -> String {
    match n.as_f64() {
        Some(f)
            if f.fract() == 0.0 && f.abs() < 9e15 && n.to_string().contains(['.', 'e', 'E']) =>
        {
            format!("{}", f as i64)
        }
        _ => n.to_string(),
    }
}

/// PyYAML's tag prefix for its standard types (`!!str` once resolved).
fn std_tag(tag: &Tag) -> Option<&str> {
    match tag.handle.as_str() {
        "!!" | "tag:yaml.org,2002:" => Some(tag.suffix.as_str()),
        _ => None,
    }
}

fn check_collection_tag(tag: Option<&Tag>, want: &str, mark: Marker) -> Result<(), YamlError> {
    match tag {
        None => Ok(()),
        Some(t) if std_tag(t) == Some(want) => Ok(()),
        Some(t) => Err(unsupported(
            mark,
            format!(
                "the tag {}{} is not one PyYAML's safe loader constructs here",
                t.handle, t.suffix
            ),
        )),
    }
}

static BOOL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$")
        .expect("valid regex")
});
static INT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+)$",
    )
    .expect("valid regex")
});
static FLOAT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
    )
    .expect("valid regex")
});
static NULL: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(?:~|null|Null|NULL)?$").expect("valid regex"));
static TIMESTAMP: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"^(?:[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]|[0-9][0-9][0-9][0-9]-[0-9][0-9]?-[0-9][0-9]?(?:[Tt]|[ \t]+)[0-9][0-9]?:[0-9][0-9]:[0-9][0-9](?:\.[0-9]*)?(?:[ \t]*(?:Z|[-+][0-9][0-9]?(?::[0-9][0-9])?))?)$",
    )
    .expect("valid regex")
});

/// What a plain scalar resolves to under PyYAML's implicit resolvers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Null,
    Bool,
    Int,
    Float,
    Timestamp,
    Str,
}

fn resolve(text: &str) -> Kind {
    // PyYAML's order of resolvers for a first character; the patterns do not overlap except
    // where it lists bool before float/int, which these patterns keep apart anyway.
    if BOOL.is_match(text) {
        Kind::Bool
    } else if NULL.is_match(text) {
        Kind::Null
    } else if INT.is_match(text) {
        Kind::Int
    } else if FLOAT.is_match(text) {
        Kind::Float
    } else if TIMESTAMP.is_match(text) {
        Kind::Timestamp
    } else if text == "=" {
        // PyYAML's `value` type, which its safe loader cannot construct.
        Kind::Timestamp
    } else {
        Kind::Str
    }
}

fn scalar(
    text: &str,
    style: TScalarStyle,
    tag: Option<&Tag>,
    mark: Marker,
) -> Result<Value, YamlError> {
    let kind = match tag {
        Some(t) => match std_tag(t) {
            Some("str") => Kind::Str,
            Some("int") => Kind::Int,
            Some("float") => Kind::Float,
            Some("bool") => Kind::Bool,
            Some("null") => Kind::Null,
            _ => {
                return Err(unsupported(
                    mark,
                    format!(
                        "the tag {}{} is not one PyYAML's safe loader turns into JSON",
                        t.handle, t.suffix
                    ),
                ))
            }
        },
        None if style == TScalarStyle::Plain => resolve(text),
        None => Kind::Str,
    };
    match kind {
        Kind::Str => Ok(Value::String(text.to_string())),
        Kind::Null => Ok(Value::Null),
        Kind::Bool => Ok(Value::Bool(matches!(
            text.to_ascii_lowercase().as_str(),
            "yes" | "true" | "on"
        ))),
        Kind::Int => int(text)
            .map(Value::Number)
            .ok_or_else(|| unsupported(mark, format!("{text:?} is not an integer"))),
        Kind::Float => float(text, mark).map(Value::Number),
        Kind::Timestamp => Err(unsupported(
            mark,
            format!(
                "PyYAML reads {text:?} as a date or time, which kernelbot's JSON payload cannot carry; quote it to keep it a string"
            ),
        )),
    }
}

/// PyYAML's `construct_yaml_int`: underscores dropped, `0b`, `0x`, a leading `0` (octal) and
/// `a:b:c` (base 60). Any size, as Python's int.
fn int(text: &str) -> Option<Number> {
    let cleaned: String = text.chars().filter(|c| *c != '_').collect();
    let (neg, digits) = match cleaned.as_bytes().first() {
        Some(b'-') => (true, &cleaned[1..]),
        Some(b'+') => (false, &cleaned[1..]),
        _ => (false, cleaned.as_str()),
    };
    let magnitude: Vec<u32> = if digits == "0" {
        vec![0]
    } else if let Some(b) = digits.strip_prefix("0b") {
        big_from_radix(b, 2)?
    } else if let Some(h) = digits.strip_prefix("0x") {
        big_from_radix(h, 16)?
    } else if digits.starts_with('0') {
        big_from_radix(digits, 8)?
    } else if digits.contains(':') {
        let mut acc = vec![0u32];
        for part in digits.split(':') {
            let d: u32 = part.parse().ok()?;
            mul_add(&mut acc, 60, d);
        }
        acc
    } else {
        big_from_radix(digits, 10)?
    };
    let mut s = to_decimal(&magnitude);
    if neg && s != "0" {
        s.insert(0, '-');
    }
    s.parse().ok()
}

/// Little-endian base-1e9 digits of `digits` in `radix`.
fn big_from_radix(digits: &str, radix: u32) -> Option<Vec<u32>> {
    if digits.is_empty() {
        return None;
    }
    let mut acc = vec![0u32];
    for c in digits.chars() {
        mul_add(&mut acc, radix, c.to_digit(radix)?);
    }
    Some(acc)
}

const LIMB: u64 = 1_000_000_000;

fn mul_add(acc: &mut Vec<u32>, mul: u32, add: u32) {
    let mut carry = u64::from(add);
    for limb in acc.iter_mut() {
        let v = u64::from(*limb) * u64::from(mul) + carry;
        *limb = (v % LIMB) as u32;
        carry = v / LIMB;
    }
    while carry > 0 {
        acc.push((carry % LIMB) as u32);
        carry /= LIMB;
    }
}

fn to_decimal(limbs: &[u32]) -> String {
    let mut parts = limbs.iter().rev().skip_while(|l| **l == 0).peekable();
    let Some(first) = parts.next() else {
        return "0".into();
    };
    let mut s = first.to_string();
    for l in parts {
        s.push_str(&format!("{l:09}"));
    }
    s
}

/// PyYAML's `construct_yaml_float`; infinities and NaN are refused (JSON has none).
fn float(text: &str, mark: Marker) -> Result<Number, YamlError> {
    let cleaned: String = text
        .chars()
        .filter(|c| *c != '_')
        .collect::<String>()
        .to_ascii_lowercase();
    let (sign, body) = match cleaned.as_bytes().first() {
        Some(b'-') => (-1.0, &cleaned[1..]),
        Some(b'+') => (1.0, &cleaned[1..]),
        _ => (1.0, cleaned.as_str()),
    };
    if body == ".inf" || body == ".nan" {
        return Err(unsupported(
            mark,
            format!("{text:?} is not a finite number, which kernelbot's JSON payload cannot carry; quote it to keep it a string"),
        ));
    }
    let value: f64 = if body.contains(':') {
        let mut acc = 0.0;
        for part in body.split(':') {
            let d: f64 = part
                .parse()
                .map_err(|_| unsupported(mark, format!("{text:?} is not a number")))?;
            acc = acc * 60.0 + d;
        }
        acc
    } else {
        body.parse()
            .map_err(|_| unsupported(mark, format!("{text:?} is not a number")))?
    };
    let v = sign * value;
    if !v.is_finite() {
        return Err(unsupported(
            mark,
            format!("{text:?} overflows a float, which kernelbot's JSON payload cannot carry"),
        ));
    }
    // `{:?}` always marks a float (`1000.0`, `1e16`), so Python reads a float back.
    format!("{v:?}")
        .parse()
        .map_err(|_| unsupported(mark, format!("{text:?} is not a number")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn j(text: &str) -> String {
        serde_json::to_string(&load(text).unwrap()).unwrap()
    }

    #[test]
    fn plain_scalars_resolve_as_pyyaml_does() {
        assert_eq!(
            j("[yes, No, ON, off, 'yes', true, ~, null, '', 17]"),
            r#"[true,false,true,false,"yes",true,null,null,"",17]"#
        );
        // YAML 1.1 numbers: octal, underscores, base 60, binary, hex; `1e3` and `0o17` are
        // strings there.
        assert_eq!(
            j("[017, 1_000, '1_000', 1:30, 0b101, 0x1F, -0x10, 1e3, 0o17, 1.0e+3, 1.5, .5, -2.]"),
            r#"[15,1000,"1_000",90,5,31,-16,"1e3","0o17",1000.0,1.5,0.5,-2.0]"#
        );
        assert_eq!(
            j("big: 123456789012345678901234567890"),
            r#"{"big":123456789012345678901234567890}"#
        );
        assert_eq!(
            j("a: !!str 12\nb: !!int '7'\nc: \"12\"\nd: |\n  12\n"),
            r#"{"a":"12","b":7,"c":"12","d":"12\n"}"#
        );
        // Checked against PyYAML 6: signs only where its patterns allow them, octal only
        // with octal digits, base 60 floats.
        assert_eq!(
            j("[-.NaN, 1.e+3, 190:20:30.15, 0_7, +0, -0, 08, 09.5, 1_2.3_4e+5]"),
            r#"["-.NaN",1000.0,685230.15,7,0,0,"08",9.5,1234000.0]"#
        );
    }

    #[test]
    fn mappings_keep_order_and_python_dict_semantics() {
        assert_eq!(j("b: 1\na: 2\nb: 3\n"), r#"{"b":3,"a":2}"#);
        // `1` and `true` are one key in a Python dict; the first spelling stays.
        assert_eq!(
            j("1: x\ntrue: y\n~: z\n1.5: w\n2.0: v\n2: u\n"),
            r#"{"1":"y","null":"z","1.5":"w","2.0":"u"}"#
        );
        let merged = j("base: &b {size: 1, seed: 2}\nt: {<<: *b, seed: 3, n: 4}\n");
        assert_eq!(
            merged,
            r#"{"base":{"size":1,"seed":2},"t":{"size":1,"seed":3,"n":4}}"#
        );
        assert_eq!(
            j("x: {<<: [{a: 1}, {a: 2, b: 2}]}"),
            r#"{"x":{"a":1,"b":2}}"#
        );
    }

    #[test]
    fn what_json_cannot_carry_is_refused_with_the_fix() {
        for bad in ["d: 2024-01-02", "x: .inf", "y: .NaN", "t: !foo bar"] {
            let e = load(bad).unwrap_err().to_string();
            assert!(e.starts_with("line 1: "), "{bad}: {e}");
        }
        assert!(load("d: 2024-01-02")
            .unwrap_err()
            .to_string()
            .contains("quote it"));
        assert!(matches!(load(""), Err(YamlError::Empty)));
        assert!(matches!(load("a: [1"), Err(YamlError::Syntax(_))));
        assert_eq!(j("'2024-01-02'"), r#""2024-01-02""#);
    }
}
