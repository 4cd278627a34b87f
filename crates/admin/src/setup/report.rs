//! How setup says what it does: one line per directory, file and command, then notes, and with
//! `--dry-run` the contents of every file (the token redacted). Pure text from [`Actions`].

use std::fmt::Write as _;
use std::path::Path;

use super::apply::{Actions, FileAction, StaleAction, Step};
use super::paths::BACKUP_SUFFIX;
use super::render::{Content, Desired, File};
use kernelkite_hooks::job::exports::shell_quote;

/// How the in-process steps are shown: the commands a vendor can run again by hand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepNames {
    /// `doctor` with its arguments.
    pub doctor: String,
    /// The smoke job with its arguments.
    pub smoke: String,
}

/// A command line as a shell would read it back.
pub fn command_line(argv: &[String]) -> String {
    argv.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,@:%+".contains(c))
            {
                a.clone()
            } else {
                shell_quote(a)
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One step as printed.
pub fn step_line(step: &Step, names: &StepNames) -> String {
    match step {
        Step::Run(argv) => command_line(argv),
        Step::Doctor => names.doctor.clone(),
        Step::Smoke => names.smoke.clone(),
    }
}

fn mode_or_link(f: &File) -> String {
    match f.content {
        Content::Link(_) => "link".into(),
        _ => format!("{:04o}", f.mode),
    }
}

fn file_line(f: &File, action: FileAction) -> String {
    let verb = match action {
        FileAction::Create => "create",
        FileAction::Update => "update",
        FileAction::Same => "same",
        FileAction::Replace => "replace",
        FileAction::Conflict => "CONFLICT",
    };
    let mut line = format!("  {verb:<8} {:<5} {}", mode_or_link(f), f.path.display());
    match &f.content {
        Content::Link(target) => {
            let _ = write!(line, " -> {}", target.display());
        }
        Content::Copy(from) => {
            let _ = write!(line, " (copy of {})", from.display());
        }
        _ => {}
    }
    match action {
        FileAction::Replace => {
            let _ = write!(
                line,
                " (the earlier file is kept as {}{BACKUP_SUFFIX})",
                f.path.display()
            );
        }
        FileAction::Conflict => {
            line.push_str(" (exists and was not written by setup)");
        }
        _ => {}
    }
    line
}

/// The plan of actions: header lines, directories, files, commands, notes.
pub fn actions_text(
    header: &[String],
    actions: &Actions,
    notes: &[String],
    names: &StepNames,
) -> String {
    let mut s = String::new();
    for h in header {
        let _ = writeln!(s, "{h}");
    }
    if !actions.mkdirs.is_empty() || !actions.rmdirs.is_empty() {
        s.push_str("\ndirectories:\n");
        for d in &actions.mkdirs {
            let _ = writeln!(s, "  {:<8} {:04o}  {}", "create", d.mode, d.path.display());
        }
        for d in &actions.rmdirs {
            let _ = writeln!(
                s,
                "  {:<8} {:<5} {} (when empty)",
                "remove",
                "",
                d.display()
            );
        }
    }
    if !actions.files.is_empty() || !actions.stale.is_empty() || !actions.restore.is_empty() {
        s.push_str("\nfiles:\n");
        for (f, a) in &actions.files {
            let _ = writeln!(s, "{}", file_line(f, *a));
        }
        for (p, a) in &actions.stale {
            let line = match a {
                StaleAction::Remove => format!("  {:<8} {:<5} {}", "remove", "", p.display()),
                StaleAction::KeepChanged => format!(
                    "  {:<8} {:<5} {} (changed since setup wrote it: left in place)",
                    "keep",
                    "",
                    p.display()
                ),
            };
            let _ = writeln!(s, "{line}");
        }
        for b in &actions.restore {
            let _ = writeln!(
                s,
                "  {:<8} {:<5} {} (from {})",
                "restore",
                "",
                b.path.display(),
                b.moved_to.display()
            );
        }
    }
    let steps: Vec<&Step> = actions.before.iter().chain(actions.after.iter()).collect();
    if !steps.is_empty() {
        s.push_str("\ncommands:\n");
        for step in steps {
            let _ = writeln!(s, "  {}", step_line(step, names));
        }
    }
    if !notes.is_empty() {
        s.push_str("\nnotes:\n");
        for n in notes {
            let _ = writeln!(s, "  - {n}");
        }
    }
    s
}

/// Every text file's contents, as `--dry-run` prints them (the token redacted).
pub fn contents_text(desired: &Desired) -> String {
    let mut s = String::new();
    for f in &desired.files {
        let text = match &f.content {
            Content::Text(t) => t,
            Content::Secret { shown, .. } => shown,
            Content::Copy(_) | Content::Link(_) => continue,
        };
        let _ = writeln!(s, "\n=== {} ({:04o})", f.path.display(), f.mode);
        s.push_str(text);
        if !text.ends_with('\n') {
            s.push('\n');
        }
    }
    s
}

/// The first header line: what is set up, and how.
pub fn header(summary: &str, root: Option<&Path>, dry_run: bool, uninstall: bool) -> Vec<String> {
    let mut h = vec![if uninstall {
        format!("kernelkite-isolate setup --uninstall: {summary}")
    } else {
        format!("kernelkite-isolate setup: {summary}")
    }];
    if let Some(r) = root {
        h.push(format!(
            "under the root {} (commands are recorded, not run)",
            r.display()
        ));
    }
    if dry_run {
        h.push("dry run: nothing is written and no command is run".into());
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_quote_only_what_needs_it() {
        let argv: Vec<String> = ["useradd", "--comment", "kernelkite job sandbox", "it's"]
            .map(str::to_string)
            .to_vec();
        assert_eq!(
            command_line(&argv),
            r"useradd --comment 'kernelkite job sandbox' 'it'\''s'"
        );
        assert_eq!(
            command_line(&[
                "systemctl".into(),
                "enable".into(),
                "kernelkite-agent@gpu0.service".into()
            ]),
            "systemctl enable kernelkite-agent@gpu0.service"
        );
    }
}
