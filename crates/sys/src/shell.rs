//! The hooks' `export` format: how `kernelkite-isolate environment --export shell` writes a
//! job's variables, and how local mode reads them back. Both sides import this one module, so
//! the format and its parser cannot drift apart.

use std::collections::BTreeMap;

/// Single-quotes `v` for a POSIX shell: every byte but `'` is literal inside single quotes,
/// so this one replacement is the whole job (a quoting crate would pick among styles and make
/// the output harder to predict).
pub fn quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', r"'\''"))
}

/// `export NAME='value'` lines, one per variable, in name order: what `kernelkite-isolate
/// environment --export shell` prints, and what [`parse_exports`] reads back.
pub fn export_lines(env: &BTreeMap<String, String>) -> String {
    env.iter()
        .map(|(k, v)| format!("export {k}={}\n", quote(v)))
        .collect()
}

/// The variables in `export NAME='value'` lines, as `kernelkite-isolate environment --export
/// shell` prints them and the local executor evaluates them. Strict: anything else is an error,
/// since a job must not run without the variables that tell it its slice.
pub fn parse_exports(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut out = BTreeMap::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(['\n', ' ', '\t']);
        if rest.is_empty() {
            return Ok(out);
        }
        let Some(after) = rest.strip_prefix("export ") else {
            return Err(format!("not an export line: {:?}", first_line(rest)));
        };
        let Some(eq) = after.find('=') else {
            return Err(format!("export without '=': {:?}", first_line(rest)));
        };
        let name = &after[..eq];
        let valid = name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(format!("not a variable name: {name:?}"));
        }
        // The value: single-quoted runs and `\'`, up to the end of the line.
        let mut value = String::new();
        let mut s = &after[eq + 1..];
        loop {
            if let Some(q) = s.strip_prefix('\'') {
                let Some(end) = q.find('\'') else {
                    return Err(format!("unterminated quote in the value of {name}"));
                };
                value.push_str(&q[..end]);
                s = &q[end + 1..];
            } else if let Some(q) = s.strip_prefix("\\'") {
                value.push('\'');
                s = q;
            } else if s.is_empty() || s.starts_with('\n') {
                break;
            } else {
                return Err(format!(
                    "unquoted text in the value of {name}: {:?}",
                    first_line(s)
                ));
            }
        }
        out.insert(name.to_string(), value);
        rest = s;
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_round_trip_the_plugins_quoting() {
        let text =
            "export A='plain'\nexport B='it'\\''s'\nexport C='{\"cpus\":[0,1]}'\nexport D=''\n";
        let e = parse_exports(text).unwrap();
        assert_eq!(e["A"], "plain");
        assert_eq!(e["B"], "it's");
        assert_eq!(e["C"], r#"{"cpus":[0,1]}"#);
        assert_eq!(e["D"], "");
        // A value with a line break stays one value.
        let e = parse_exports("export M='a\nb'\n").unwrap();
        assert_eq!(e["M"], "a\nb");
        for v in ["a", "b c d", "'", "''", "x'y'z", "\\'"] {
            let line = format!("export V={}\n", quote(v));
            assert_eq!(parse_exports(&line).unwrap()["V"], v, "{line}");
        }
        for bad in [
            "echo hi\n",
            "export 1A='x'\n",
            "export A=x\n",
            "export A='x\n",
            "export A\n",
        ] {
            assert!(parse_exports(bad).is_err(), "{bad}");
        }
        assert!(parse_exports("").unwrap().is_empty());
    }

    #[test]
    fn what_is_written_reads_back() {
        let env: BTreeMap<String, String> = [("K", "v w"), ("J", "{\"x\":1}"), ("Q", "a'b")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let lines = export_lines(&env);
        assert_eq!(
            lines,
            "export J='{\"x\":1}'\nexport K='v w'\nexport Q='a'\\''b'\n"
        );
        assert_eq!(parse_exports(&lines).unwrap(), env);
    }
}
