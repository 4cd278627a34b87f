//! Captured process output as kernelbot reports it.
//!
//! kernelbot reads a child's output with `subprocess.run(text=True)` (UTF-8, universal
//! newlines) and then cuts it with `_limit_length`. The runner must not hold unbounded output
//! in memory, so [`Capture`] keeps only a prefix long enough for the cut and counts the lines
//! of the rest; [`Capture::finish`] then gives exactly what kernelbot's cut of the whole text
//! would give.

/// kernelbot's `max_len` for stdout and stderr, in characters.
pub const MAX_OUTPUT_CHARS: usize = 16384;

/// kernelbot's `_limit_length`: split on `"\n"`, add up `len(line) + 1` (characters), and at
/// the first line where that plus 100 exceeds `max_len`, keep the lines before it and a note
/// saying how many lines were left out.
pub fn limit_length(text: &str, max_len: usize) -> String {
    let lines: Vec<&str> = text.split('\n').collect();
    let mut size = 0usize;
    for (i, line) in lines.iter().enumerate() {
        size += line.chars().count() + 1;
        if size + 100 > max_len {
            let mut kept: Vec<String> = lines[..i].iter().map(|l| (*l).to_string()).collect();
            kept.push(format!("[...] {} lines omitted", lines.len() - i));
            return kept.join("\n");
        }
    }
    text.to_string()
}

/// Python's `shlex.quote`, for the `command` fields.
pub fn shell_quote(arg: &str) -> String {
    if arg.is_empty() {
        return "''".into();
    }
    let safe = arg
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "@%+=:,./-_".contains(c));
    if safe {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', "'\"'\"'"))
    }
}

/// kernelbot's `_make_cmd`: the arguments quoted and joined by spaces.
pub fn shell_join<S: AsRef<str>>(args: &[S]) -> String {
    args.iter()
        .map(|a| shell_quote(a.as_ref()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Bytes kept verbatim. Any text whose prefix of this many bytes is complete is already long
/// enough to be cut: a character is at most 4 bytes (an invalid byte decodes to one U+FFFD, a
/// `\r\n` to one `\n`), so the prefix holds at least `max_chars` characters and the cut falls
/// inside it.
fn prefix_bytes(max_chars: usize) -> usize {
    max_chars * 4 + 8
}

/// A bounded sink for one output stream.
#[derive(Debug, Clone)]
pub struct Capture {
    max_chars: usize,
    keep: usize,
    head: Vec<u8>,
    /// Bytes seen beyond `head`.
    dropped: u64,
    /// Line breaks (after universal-newline translation) seen beyond `head`.
    dropped_breaks: u64,
    /// `\n` bytes seen beyond `head` (the breaks of the untranslated text).
    dropped_lf: u64,
    /// The last byte seen was `\r` (a following `\n` belongs to the same break).
    after_cr: bool,
}

impl Capture {
    /// An empty capture keeping at most `max_chars` characters.
    pub fn new(max_chars: usize) -> Capture {
        Capture {
            max_chars,
            keep: prefix_bytes(max_chars),
            head: Vec::new(),
            dropped: 0,
            dropped_breaks: 0,
            dropped_lf: 0,
            after_cr: false,
        }
    }

    /// Adds bytes as they arrive.
    pub fn push(&mut self, mut data: &[u8]) {
        if self.head.len() < self.keep {
            let take = data.len().min(self.keep - self.head.len());
            self.head.extend_from_slice(&data[..take]);
            if take > 0 {
                self.after_cr = self.head.last() == Some(&b'\r');
            }
            data = &data[take..];
        }
        self.dropped += data.len() as u64;
        for &b in data {
            self.dropped_lf += u64::from(b == b'\n');
            match b {
                b'\n' if self.after_cr => {}
                b'\n' | b'\r' => self.dropped_breaks += 1,
                _ => {}
            }
            self.after_cr = b == b'\r';
        }
    }

    /// Total bytes pushed.
    pub fn total_bytes(&self) -> u64 {
        self.head.len() as u64 + self.dropped
    }

    /// The text kernelbot would report for a finished process: decoded, newlines
    /// translated (`subprocess.run(text=True)`), cut.
    pub fn finish(&self) -> String {
        self.finish_with(true)
    }

    /// The text kernelbot reports for a timed-out process: `TimeoutExpired` carries the raw
    /// bytes, which `_limit_length` decodes without translating `\r` or `\r\n`.
    pub fn finish_raw(&self) -> String {
        self.finish_with(false)
    }

    fn finish_with(&self, translate: bool) -> String {
        let decoded = String::from_utf8_lossy(&self.head);
        let text = if translate {
            universal_newlines(&decoded)
        } else {
            decoded.into_owned()
        };
        if self.dropped == 0 {
            return limit_length(&text, self.max_chars);
        }
        // The cut falls inside the prefix; only the number of lines after it needs the rest.
        // Translated, a `\r` ending the prefix and a `\n` starting the rest are one break,
        // counted once (in the prefix), which `push` arranges through `after_cr`.
        let cut = limit_length(&text, self.max_chars);
        let prefix_lines = text.split('\n').count() as u64;
        let rest_breaks = if translate {
            self.dropped_breaks
        } else {
            self.dropped_lf
        };
        let total_lines = prefix_lines + rest_breaks;
        match cut.rfind("[...] ") {
            Some(at) if cut[at..].ends_with(" lines omitted") => {
                let kept_lines = cut[..at].matches('\n').count() as u64;
                format!(
                    "{}[...] {} lines omitted",
                    &cut[..at],
                    total_lines - kept_lines
                )
            }
            // Unreachable by the prefix-length argument above; keep the cut text regardless.
            _ => cut,
        }
    }
}

/// Python's universal newlines on read: `\r\n` and lone `\r` become `\n`.
pub fn universal_newlines(text: &str) -> String {
    if !text.contains('\r') {
        return text.to_string();
    }
    text.replace("\r\n", "\n").replace('\r', "\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn short_text_is_untouched() {
        assert_eq!(limit_length("a\nb\n", 16384), "a\nb\n");
    }

    #[test]
    fn cut_follows_kernelbot_rule() {
        // 300 lines of 99 chars: each costs 100; line i is cut when (i+1)*100 + 100 > 16384.
        let text: String = (0..300).map(|_| "x".repeat(99) + "\n").collect();
        let out = limit_length(&text, 16384);
        let kept = 162; // (162+1)*100+100 = 16400 > 16384 → cut at i = 162
        let lines: Vec<&str> = out.split('\n').collect();
        assert_eq!(lines.len(), kept + 1);
        assert_eq!(lines[kept], format!("[...] {} lines omitted", 301 - kept));
    }

    #[test]
    fn cut_boundary_is_exact() {
        // One line of n characters costs n + 1; it stays while n + 1 + 100 <= 16384.
        let fits = "x".repeat(16283);
        assert_eq!(limit_length(&fits, 16384), fits);
        assert_eq!(
            limit_length(&"x".repeat(16284), 16384),
            "[...] 1 lines omitted"
        );
        // The same boundary on a later line: the lines before it are kept.
        let text = format!("ab\n{}\ntail", "y".repeat(16281));
        assert_eq!(limit_length(&text, 16384), "ab\n[...] 2 lines omitted");
        let text = format!("ab\n{}", "y".repeat(16280));
        assert_eq!(limit_length(&text, 16384), text);
    }

    #[test]
    fn lengths_are_characters_not_bytes() {
        let text = "é".repeat(16000);
        assert_eq!(limit_length(&text, 16384), text);
        assert_eq!(
            limit_length(&"é".repeat(16300), 16384),
            "[...] 1 lines omitted"
        );
    }

    #[test]
    fn shell_quoting_matches_shlex() {
        assert_eq!(
            shell_join(&["python3", "eval.py", "test", "/tmp/x y", "it's", ""]),
            "python3 eval.py test '/tmp/x y' 'it'\"'\"'s' ''"
        );
    }

    #[test]
    fn a_timed_out_stream_keeps_its_carriage_returns() {
        let mut c = Capture::new(16384);
        c.push(b"10%\r20%\r\ndone\n");
        assert_eq!(c.finish(), "10%\n20%\ndone\n");
        assert_eq!(c.finish_raw(), "10%\r20%\r\ndone\n");
        // Progress bars redrawn with `\r` are one long line to kernelbot after a timeout.
        let mut c = Capture::new(16384);
        for i in 0..20_000 {
            c.push(format!("{i:05}\r").as_bytes());
        }
        c.push(b"\nend");
        assert_eq!(c.finish_raw(), "[...] 2 lines omitted");
        assert!(
            c.finish().ends_with("\n02713\n[...] 17287 lines omitted"),
            "{}",
            &c.finish()[16000..]
        );
    }

    #[test]
    fn huge_stream_is_bounded_and_counted() {
        let mut c = Capture::new(16384);
        let line = "y".repeat(49) + "\n";
        for _ in 0..100_000 {
            c.push(line.as_bytes());
        }
        assert!(c.head.len() <= prefix_bytes(16384));
        let whole = line.repeat(100_000);
        assert_eq!(c.finish(), limit_length(&whole, 16384));
    }

    fn python_view(bytes: &[u8]) -> String {
        universal_newlines(&String::from_utf8_lossy(bytes))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn capture_equals_cut_of_whole(
            chunks in proptest::collection::vec(
                proptest::collection::vec(prop_oneof![Just(b'\n'), Just(b'\r'), Just(b'a'), Just(0xC3u8), Just(0xA9u8)], 0..200), 0..20),
            max in 30usize..200,
        ) {
            let mut c = Capture::new(max);
            let mut all = Vec::new();
            for ch in &chunks {
                c.push(ch);
                all.extend_from_slice(ch);
            }
            prop_assert_eq!(c.finish(), limit_length(&python_view(&all), max));
            let raw = String::from_utf8_lossy(&all);
            prop_assert_eq!(c.finish_raw(), limit_length(&raw, max));
        }
    }
}
