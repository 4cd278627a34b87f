//! `/proc/self/mountinfo`: the mounts the cgroup layer and `doctor` look for.
//!
//! Hand-written: the crates that parse mountinfo (`procfs`) read the live `/proc` of the
//! machine, while both callers read it under an injected root (a fake tree in tests), and
//! the four fields needed are one `split`.

/// One mount from `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Where it is mounted, unescaped (`/sys/fs/cgroup/cpuset`).
    pub mount_point: String,
    /// The file system type (`cgroup`, `cgroup2`, `tmpfs`, ...).
    pub fs_type: String,
    /// Whether the mount or its superblock is read-only (`ro` in either option list).
    pub read_only: bool,
    /// Super options (for cgroup v1, the controllers: `rw,cpuset`).
    pub super_options: Vec<String>,
}

/// Parses mountinfo lines: `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTS [TAGS...] - FSTYPE SOURCE SUPEROPTS`.
/// Lines that do not parse are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let l: Vec<&str> = left.split_whitespace().collect();
            let r: Vec<&str> = right.split_whitespace().collect();
            let opts = l.get(5)?;
            let super_options: Vec<String> = r
                .get(2)
                .map(|s| s.split(',').map(str::to_string).collect())
                .unwrap_or_default();
            let read_only =
                opts.split(',').any(|o| o == "ro") || super_options.iter().any(|o| o == "ro");
            Some(Mount {
                mount_point: unescape_octal(l.get(4)?),
                fs_type: r.first()?.to_string(),
                read_only,
                super_options,
            })
        })
        .collect()
}

/// mountinfo escapes spaces and friends as `\040` (three octal digits, one byte).
pub fn unescape_octal(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let byte = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        if let Some(v) = byte {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A hybrid (v1 + unified) machine; the cgroup detection tests use it too.
    pub(crate) const MOUNTINFO_V1: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn mountinfo_parses_types_and_controllers() {
        let m = parse_mountinfo(MOUNTINFO_V1);
        assert_eq!(m.len(), 7);
        assert_eq!(m[2].mount_point, "/sys/fs/cgroup/cpuset");
        assert_eq!(m[2].super_options, vec!["rw", "cpuset"]);
        assert_eq!(m[6].fs_type, "cgroup2");
        let esc = parse_mountinfo("1 2 0:1 / /mnt/a\\040b rw - ext4 /dev/x rw\n");
        assert_eq!(esc[0].mount_point, "/mnt/a b");
    }

    #[test]
    fn mountinfo_fields_and_escapes() {
        let m = parse_mountinfo(
            "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n\
             41 31 0:38 / /sys/fs/cgroup/un\\040ified ro,relatime shared:9 - cgroup2 cgroup2 rw\ngarbage\n",
        );
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].super_options, vec!["rw", "cpuset"]);
        assert!(!m[0].read_only);
        assert_eq!(m[1].mount_point, "/sys/fs/cgroup/un ified");
        assert!(m[1].read_only);
    }

    #[test]
    fn unescape_takes_only_three_octal_digits_that_fit_a_byte() {
        assert_eq!(unescape_octal("a\\040b\\134c"), "a b\\c");
        for kept in ["\\777", "\\+12", "\\08x", "end\\04"] {
            assert_eq!(unescape_octal(kept), kept);
        }
    }
}
