//! The kernel's CPU list format (`0-13,112-125`), as sysfs, `/proc/self/status` and the
//! cgroup files write it.
//!
//! Hand-written: the format is a few lines, and the crates that parse it either pull in a whole
//! procfs model or do not round-trip the kernel's own output.

/// Formats a CPU list the way the kernel and cgroups write it: `0-13,112-125`.
pub fn format_cpu_list(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = String::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        // checked: a CPU id of u32::MAX (from a hand-edited plan) must not overflow.
        while i + 1 < sorted.len() && end.checked_add(1) == Some(sorted[i + 1]) {
            i += 1;
            end = sorted[i];
        }
        if !out.is_empty() {
            out.push(',');
        }
        if start == end {
            out.push_str(&start.to_string());
        } else {
            out.push_str(&format!("{start}-{end}"));
        }
        i += 1;
    }
    out
}

/// Error from [`parse_cpu_list`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid CPU list {input:?}: {reason} (expected a list like \"0-13,112-125\")")]
pub struct CpuListError {
    /// The list as given.
    pub input: String,
    /// What is wrong with it.
    pub reason: String,
}

/// Parses the kernel's list format (`0-3,8,10-11`, blank = empty), as found in sysfs.
pub fn parse_cpu_list(input: &str) -> Result<Vec<u32>, CpuListError> {
    let err = |reason: &str| CpuListError {
        input: input.to_string(),
        reason: reason.to_string(),
    };
    let mut out = Vec::new();
    for part in input
        .trim()
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        match part.split_once('-') {
            Some((a, b)) => {
                let a: u32 = a.trim().parse().map_err(|_| err("not a number"))?;
                let b: u32 = b.trim().parse().map_err(|_| err("not a number"))?;
                if b < a {
                    return Err(err("range ends before it starts"));
                }
                if b - a > 1 << 20 {
                    return Err(err("range too large"));
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().map_err(|_| err("not a number"))?),
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn formats_ranges_like_the_kernel() {
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 112, 113, 5]), "0-3,5,112-113");
        assert_eq!(format_cpu_list(&[]), "");
        assert_eq!(format_cpu_list(&[7]), "7");
        assert_eq!(
            format_cpu_list(&[u32::MAX - 1, u32::MAX]),
            format!("{}-{}", u32::MAX - 1, u32::MAX)
        );
    }

    #[test]
    fn rejects_garbage_lists() {
        assert!(parse_cpu_list("3-1").is_err());
        assert!(parse_cpu_list("a").is_err());
        assert_eq!(parse_cpu_list("\n").unwrap(), Vec::<u32>::new());
    }

    proptest! {
        #[test]
        fn cpu_list_round_trips(mut cpus in proptest::collection::vec(0u32..4096, 0..300)) {
            cpus.sort_unstable();
            cpus.dedup();
            prop_assert_eq!(parse_cpu_list(&format_cpu_list(&cpus)).unwrap(), cpus);
        }
    }
}
