//! The hooks' lines for the job log, on stderr.
//!
//! The agent streams a hook's stderr into the job log from a pty or a pipe, and every `write`
//! wakes its reader: on a node whose other CPUs are idle (or a VM, where waking an idle vCPU is
//! an interrupt through the hypervisor) each one costs far more than the bytes. `eprintln!`
//! writes every piece of its format string separately (stderr is unbuffered), which made 24
//! writes of one hook's few lines; these functions format first and write each block once.

use std::io::Write;

/// Writes each of `lines` as `kernelkite: <line>` with one `write` for all of them.
pub fn say_all<I, S>(lines: I)
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let text = block("kernelkite: ", lines);
    if !text.is_empty() {
        // The job log is best effort: a closed stderr must not fail the hook.
        let _ = std::io::stderr().lock().write_all(text.as_bytes());
    }
}

/// Writes one `kernelkite: <line>` with one `write`.
pub fn say(line: &str) {
    say_all([line]);
}

/// The lines, each with `prefix` and a newline.
pub fn block<I, S>(prefix: &str, lines: I) -> String
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let mut text = String::new();
    for l in lines {
        text.push_str(prefix);
        text.push_str(l.as_ref());
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_gets_the_prefix_and_a_newline() {
        assert_eq!(
            block("kernelkite: ", ["a", "b c"]),
            "kernelkite: a\nkernelkite: b c\n"
        );
        assert_eq!(block("kernelkite: ", Vec::<String>::new()), "");
    }
}
