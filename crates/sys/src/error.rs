//! Errors as people read them: an error and its causes on one line.

use std::fmt;

/// An error followed by its causes, `": "`-separated: for a response body, a report line, a
/// log line, the CLI's last words. A cause whose text is already shown is not repeated (some
/// errors name their cause in their own message as well as in `source`, axum's rejections
/// among them). Display it, or [`report`] it to a `String`.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&report(self.0))
    }
}

/// [`Chain`] as a `String`.
pub fn report(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        let text = c.to_string();
        // Against what is printed, separators included: a cause is dropped only when its
        // text really is on the line already.
        if !text.is_empty() && !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{msg}")]
    struct E {
        msg: &'static str,
        #[source]
        source: Option<Box<E>>,
    }

    fn e(msg: &'static str, source: Option<E>) -> E {
        E {
            msg,
            source: source.map(Box::new),
        }
    }

    #[test]
    fn each_cause_once_and_only_when_not_already_shown() {
        let chain = e("cannot read x", Some(e("permission denied", None)));
        assert_eq!(report(&chain), "cannot read x: permission denied");
        assert_eq!(Chain(&chain).to_string(), report(&chain));
        let repeats = e("bad body: eof", Some(e("eof", None)));
        assert_eq!(report(&repeats), "bad body: eof");
        // A cause whose text only appears across two joined causes is still shown (the
        // plugin's copy compared against the causes glued together and dropped it).
        let split = e("ab", Some(e("cd", Some(e("bc", None)))));
        assert_eq!(report(&split), "ab: cd: bc");
    }
}
