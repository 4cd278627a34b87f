//! `/etc/passwd` and `/etc/group` as glibc reads them: `:`-separated fields, and lines that are
//! blank or start with `#` are no entries (so a commented-out account names no uid, blocks no
//! reserved id and is no user).

/// One `/etc/passwd` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry<'a> {
    /// The user name.
    pub name: &'a str,
    /// The uid.
    pub uid: u32,
    /// The primary gid.
    pub gid: u32,
}

/// The lines that are entries: not blank, not comments.
fn records(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
}

/// The entries of `/etc/passwd` text; lines without a numeric uid and gid are skipped.
pub fn entries(passwd: &str) -> impl Iterator<Item = Entry<'_>> {
    records(passwd).filter_map(|line| {
        let mut f = line.split(':');
        let name = f.next()?;
        let _password = f.next()?;
        let uid = f.next()?.trim().parse().ok()?;
        let gid = f.next()?.trim().parse().ok()?;
        Some(Entry { name, uid, gid })
    })
}

/// Whether `/etc/passwd` text has an account named `user`.
pub fn has_user(passwd: &str, user: &str) -> bool {
    records(passwd).any(|l| l.split(':').next() == Some(user))
}

/// `(name, gid, members)` of each `/etc/group` entry.
pub fn groups(group: &str) -> Vec<(String, u32, Vec<String>)> {
    records(group)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            let gid = f.get(2)?.trim().parse().ok()?;
            let members = f
                .get(3)
                .map(|m| {
                    m.split(',')
                        .map(str::trim)
                        .filter(|m| !m.is_empty())
                        .map(str::to_string)
                        .collect()
                })
                .unwrap_or_default();
            Some((f.first()?.to_string(), gid, members))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comments_and_blank_lines_are_no_accounts() {
        let passwd = "root:x:0:0:root:/root:/bin/bash\n\n#old:x:1950000000:1950000000::/:/bin/false\n  # indented:x:7:7::/:/bin/false\nkernelkite-job:x:998:998::/nonexistent:/usr/sbin/nologin\nbroken:x:notanumber:1::/:/bin/false\n";
        let all: Vec<Entry> = entries(passwd).collect();
        assert_eq!(
            all,
            [
                Entry {
                    name: "root",
                    uid: 0,
                    gid: 0
                },
                Entry {
                    name: "kernelkite-job",
                    uid: 998,
                    gid: 998
                },
            ]
        );
        assert!(has_user(passwd, "kernelkite-job"));
        assert!(!has_user(passwd, "#old") && !has_user(passwd, "old"));
        let group = "# comment\nrender:x:109:kernelkite-job, other\nvideo:x:44:\n";
        assert_eq!(
            groups(group),
            [
                (
                    "render".to_string(),
                    109,
                    vec!["kernelkite-job".to_string(), "other".to_string()]
                ),
                ("video".to_string(), 44, vec![]),
            ]
        );
    }
}
