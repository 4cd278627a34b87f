//! `profile` mode: kernelbot's ncu (CUDA) and rocprofv3 (ROCm) wrappers.

use std::path::{Path, PathBuf};

use crate::sysinfo::find_on_path;

/// A profiler found on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Profiler {
    /// Nsight Compute (`ncu`), for CUDA.
    Ncu(PathBuf),
    /// `rocprofv3`, for ROCm.
    Rocprof(PathBuf),
}

/// The ncu report tables kernelbot shows.
pub const NCU_TABLES: [&str; 3] = [
    "GPU Throughput",
    "Pipe Utilization (% of active cycles)",
    "Warp State (All Cycles)",
];

impl Profiler {
    /// kernelbot's name in `ProfileResult.profiler`.
    pub fn name(&self) -> &'static str {
        match self {
            Profiler::Ncu(_) => "Nsight-Compute",
            Profiler::Rocprof(_) => "rocPROF",
        }
    }

    /// The profiler's arguments before `--` and the wrapped call; `out_dir` receives its files.
    pub fn wrap(
        &self,
        out_dir: &Path,
        call: &[String],
    ) -> (String, Vec<String>, Vec<(String, String)>) {
        let dir = out_dir.to_string_lossy().into_owned();
        let (program, mut args, env) = match self {
            Profiler::Ncu(p) => (
                p.to_string_lossy().into_owned(),
                vec![
                    "--set",
                    "full",
                    "--nvtx",
                    "--nvtx-include",
                    "custom_kernel/",
                    "--import-source",
                    "1",
                    "-c",
                    "10",
                    "-o",
                ]
                .into_iter()
                .map(String::from)
                .chain([format!("{dir}/profile.ncu-rep"), "--".into()])
                .collect::<Vec<_>>(),
                vec![("POPCORN_NCU".to_string(), "1".to_string())],
            ),
            Profiler::Rocprof(p) => (
                p.to_string_lossy().into_owned(),
                [
                    "--log-level",
                    "fatal",
                    "--hip-trace",
                    "--kernel-trace",
                    "--rccl-trace",
                    "--marker-trace",
                    "--hip-trace",
                    "--memory-copy-trace",
                    "--scratch-memory-trace",
                    "--output-format",
                    "pftrace",
                    "csv",
                    "-d",
                ]
                .into_iter()
                .map(String::from)
                .chain([dir, "-o".into(), "%pid%".into(), "--".into()])
                .collect::<Vec<_>>(),
                vec![("GPU_DUMP_CODE_OBJECT".to_string(), "1".to_string())],
            ),
        };
        args.extend(call.iter().cloned());
        (program, args, env)
    }
}

/// Picks the profiler for the runtime kernelbot would use (ncu for CUDA, rocprofv3 for
/// ROCm); with no GPU runtime known, whichever is installed. The error says what is missing.
pub fn select(runtime: &str) -> Result<Profiler, String> {
    let ncu = || find_on_path("ncu").map(Profiler::Ncu);
    let roc = || find_on_path("rocprofv3").map(Profiler::Rocprof);
    match runtime {
        "CUDA" => ncu().ok_or_else(|| "profile mode on CUDA needs Nsight Compute (`ncu`) on PATH, and it is not there".to_string()),
        "ROCm" => roc().ok_or_else(|| "profile mode on ROCm needs `rocprofv3` on PATH, and it is not there".to_string()),
        _ => ncu().or_else(roc).ok_or_else(|| {
            "profile mode needs a profiler: Nsight Compute (`ncu`) for CUDA or `rocprofv3` for ROCm on PATH; neither was found (and no GPU runtime was detected)".to_string()
        }),
    }
}

/// rocprofv3 writes one trace per process; kernelbot concatenates them into
/// `combined.pftrace` and moves code objects dumped into the work directory alongside.
///
/// The profiler ran as the submission, which could write both directories: only regular files
/// with one name are read (a link, FIFO or device there is refused, and nothing of the
/// submission is alive any more to swap one in), and `combined.pftrace` is made new, whatever
/// the submission left under that name.
pub fn merge_rocprof_traces(out_dir: &Path, workdir: &Path) -> std::io::Result<()> {
    let combined_path = out_dir.join("combined.pftrace");
    let mut traces: Vec<PathBuf> = Vec::new();
    for e in std::fs::read_dir(out_dir)?.flatten() {
        let path = e.path();
        if path.extension().is_some_and(|e| e == "pftrace") && path != combined_path {
            plain_file(&path)?;
            traces.push(path);
        }
    }
    traces.sort();
    match std::fs::remove_file(&combined_path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut combined = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&combined_path)?;
    for t in traces {
        std::io::copy(&mut std::fs::File::open(&t)?, &mut combined)?;
        std::fs::remove_file(&t)?;
    }
    for e in std::fs::read_dir(workdir)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("_code_object") && name.ends_with(".o") {
            // A link is moved as a link, and the archive never follows one.
            std::fs::rename(e.path(), out_dir.join(&name))?;
        }
    }
    Ok(())
}

/// Refuses anything at `path` but a regular file with one name (no link followed).
fn plain_file(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path)?;
    if m.file_type().is_file() && m.nlink() == 1 {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "{} is not a regular file with one name (a link, FIFO or device the submission left?); refused",
            path.display()
        )))
    }
}

/// kernelbot's `_filter_ncu_report`: the kernel headers and the chosen tables of the first
/// two kernels, short enough for one chat message.
pub fn filter_ncu_report(report: &str, tables: &[&str]) -> String {
    let mut result = String::new();
    let mut n_kernels = 0;
    let mut collect = false;
    let mut length = 0;
    for line in python_splitlines(report) {
        let chars: Vec<char> = line.chars().take(3).collect();
        if chars.len() >= 3 && chars[1] == ' ' && chars[2] != ' ' {
            if n_kernels != 0 {
                result.push('\n');
            }
            n_kernels += 1;
            if n_kernels == 3 {
                result.push_str("\nAdditional kernel launches follow. Please check the .ncu-rep file for more details.\n");
            }
            result.push_str(line);
            result.push('\n');
        }
        if n_kernels > 2 {
            continue;
        }
        if let Some(at) = line.find("Table Name : ") {
            let table = kernelkite_kernelbot::pyrepr::strip(&line[at + "Table Name :".len()..]);
            if tables.contains(&table) {
                result.push('\n');
                collect = true;
            } else {
                collect = false;
            }
        }
        if kernelkite_kernelbot::pyrepr::strip(line).is_empty() {
            collect = false;
        }
        if collect {
            result.push_str(line);
            result.push('\n');
            length += 1;
            if length > 100 {
                result.push_str("\n[...]\nReport has been truncated. Please check the .ncu-rep file for more details.\n");
                break;
            }
        }
    }
    result
}

/// Python's `str.splitlines()`: splits on every line boundary Python knows, drops them.
pub fn python_splitlines(text: &str) -> Vec<&str> {
    split_lines(text, false)
}

/// Python's `str.splitlines(keepends=True)`: the same lines, each with its line break.
pub fn python_lines_keepends(text: &str) -> Vec<&str> {
    split_lines(text, true)
}

fn split_lines(text: &str, keepends: bool) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut iter = text.char_indices().peekable();
    while let Some((i, c)) = iter.next() {
        let is_break = kernelkite_kernelbot::pyrepr::is_line_break(c);
        if is_break {
            let mut end = i + c.len_utf8();
            if c == '\r' {
                if let Some(&(j, '\n')) = iter.peek() {
                    iter.next();
                    end = j + 1;
                }
            }
            out.push(&text[start..if keepends { end } else { i }]);
            start = end;
        }
    }
    if start < text.len() {
        out.push(&text[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the submission (which ran the profiler) left in the output directory is read
    /// without following a link: a planted `combined.pftrace` link does not redirect the
    /// runner's write, and a trace that is a link fails the merge.
    #[test]
    fn planted_links_are_neither_written_through_nor_read() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("profile_data");
        std::fs::create_dir(&out).unwrap();
        let victim = dir.path().join("result.json");
        std::fs::write(&victim, "the runner's").unwrap();
        std::fs::write(out.join("1.pftrace"), "a").unwrap();
        std::fs::write(out.join("2.pftrace"), "b").unwrap();
        std::os::unix::fs::symlink(&victim, out.join("combined.pftrace")).unwrap();
        merge_rocprof_traces(&out, dir.path()).unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "the runner's");
        let combined = out.join("combined.pftrace");
        assert!(std::fs::symlink_metadata(&combined).unwrap().is_file());
        assert_eq!(std::fs::read_to_string(&combined).unwrap(), "ab");

        std::os::unix::fs::symlink(&victim, out.join("3.pftrace")).unwrap();
        let e = merge_rocprof_traces(&out, dir.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    #[test]
    fn splitlines_matches_python() {
        assert_eq!(
            python_splitlines("a\nb\r\nc\rd\x0be\u{2028}f\n"),
            ["a", "b", "c", "d", "e", "f"]
        );
        assert_eq!(python_splitlines(""), Vec::<&str>::new());
        assert_eq!(python_splitlines("\n\nx"), ["", "", "x"]);
        assert_eq!(
            python_lines_keepends("a\nb\r\nc\rd\x0be\u{2028}f\n\ng"),
            [
                "a\n",
                "b\r\n",
                "c\r",
                "d\x0b",
                "e\u{2028}",
                "f\n",
                "\n",
                "g"
            ]
        );
        assert_eq!(python_lines_keepends(""), Vec::<&str>::new());
    }

    #[test]
    fn ncu_filter_keeps_chosen_tables_of_two_kernels() {
        let mut report = String::new();
        for k in 0..3 {
            report.push_str(&format!("  kernel_{k}(float*) (1, 1, 1)x(128, 1, 1)\n"));
            report.push_str(
                "    Section: x\n    ---- Table Name : GPU Throughput\n    DRAM  %  12\n\n",
            );
            report.push_str("    ---- Table Name : Other\n    junk 1\n\n");
        }
        let f = filter_ncu_report(&report, &NCU_TABLES);
        assert!(f.contains("kernel_0") && f.contains("kernel_1") && f.contains("kernel_2"));
        assert_eq!(f.matches("DRAM  %  12").count(), 2);
        assert!(!f.contains("junk"));
        assert!(f.contains("Additional kernel launches follow"));
    }

    #[test]
    fn ncu_wrapping_follows_kernelbot() {
        let (prog, args, env) = Profiler::Ncu("/x/ncu".into())
            .wrap(Path::new("/w/p"), &["./eval.out".into(), "profile".into()]);
        assert_eq!(prog, "/x/ncu");
        assert_eq!(
            args[args.len() - 4..],
            ["/w/p/profile.ncu-rep", "--", "./eval.out", "profile"]
        );
        assert_eq!(env, [("POPCORN_NCU".to_string(), "1".to_string())]);
    }
}
