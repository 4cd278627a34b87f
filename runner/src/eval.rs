//! The evaluation: kernelbot's `run_config`, in process.
//!
//! Semantics follow kernelbot: `test`/`benchmark` run once, `leaderboard`/`private` run test
//! → benchmark → leaderboard and stop at the first run that did not pass, `profile` runs every
//! benchmark line under the profiler as `profile.0`, `profile.1`, ... Which cases each run
//! gets is [`select_cases`]. Python submissions get
//! the `python3 submission.py` "compile" pre-run; CUDA submissions are compiled with nvcc and
//! their sources removed before the binary runs.
//!
//! Where kernelbot would raise (no profiler, a missing include directory), the runner
//! returns a well-formed [`FullResult`] with `success: false` and a [`Failure`] that says
//! whether the job or the node is at fault. A missing nvcc is recorded as kernelbot records
//! it (a failed `which nvcc` compile, `success: true`, which kernelbot's report shows as "not
//! in your code"), and is still a [`Failure`] of the node, for the exit code.

use std::ffi::OsString;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use indexmap::IndexMap;

use crate::cuda;
use crate::guard::Guard;
use crate::process::{self, Outcome, Spec};
use crate::profile::{self, python_lines_keepends, python_splitlines, Profiler};
use crate::sysinfo::{self, Probe};
use crate::text::{limit_length, shell_join, MAX_OUTPUT_CHARS};
use crate::workdir::{self, WriteError};
use kernelkite_kernelbot::config::{
    cases_text, work_path, ConfigError, Lang, Mode, RankingBy, RunConfig, COMPILE_TIMEOUT_S,
};
use kernelkite_kernelbot::result::{
    exit_code, CompileResult, EvalResult, FullResult, ProfileResult, RunResult, SystemInfo,
    Timestamp,
};

/// How to evaluate. [`Options::new`] gives the defaults the CLI uses.
#[derive(Debug, Clone)]
pub struct Options {
    /// Existing directory the submission's files are written to and run in.
    pub workdir: PathBuf,
    /// The Python interpreter (`python3` on PATH by default).
    pub python: String,
    /// System probing; ignored when `system` is given.
    pub probe: Probe,
    /// Use this instead of probing (tests, callers that probed already).
    pub system: Option<SystemInfo>,
    /// Refuse to run when no GPU is detected (an infrastructure failure).
    pub require_gpu: bool,
    /// Kill descendants that escaped the process group (see [`process::Spec::reap_orphans`]).
    pub reap_orphans: bool,
    /// procfs the orphan reaping walks (`/proc`).
    pub proc_root: PathBuf,
    /// The evaluator's guard against the harness (`crate::guard`); `None` for library callers.
    pub guard: Option<crate::guard::Guard>,
    /// nvcc to use instead of searching.
    pub nvcc: Option<PathBuf>,
    /// CUDA installs searched for `bin/nvcc` after PATH, `$CUDA_HOME` and `$CUDA_PATH`.
    pub cuda_fallbacks: Vec<PathBuf>,
    /// How long nvcc may take.
    pub compile_timeout: Duration,
}

impl Options {
    /// The defaults the CLI uses, evaluating in `workdir`.
    pub fn new(workdir: impl Into<PathBuf>) -> Options {
        Options {
            workdir: workdir.into(),
            python: "python3".into(),
            probe: Probe::default(),
            system: None,
            require_gpu: false,
            reap_orphans: false,
            proc_root: PathBuf::from("/proc"),
            guard: None,
            nvcc: None,
            cuda_fallbacks: vec![PathBuf::from("/usr/local/cuda")],
            compile_timeout: Duration::from_secs(COMPILE_TIMEOUT_S),
        }
    }
}

/// Whose fault a failed evaluation is; the CLI maps these to exit codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The payload or config is wrong; retrying will not help.
    BadConfig,
    /// The node cannot run the job (no GPU, no nvcc, no profiler, no Python, disk); another
    /// node or a retry may.
    Infrastructure,
}

/// Why an evaluation failed, and whose fault it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Whose fault.
    pub kind: FailureKind,
    /// What happened and what to do, as `result.json`'s `error` says it.
    pub message: String,
    /// Recorded in the runs the way kernelbot's evaluator records it, which then reports
    /// success (a missing nvcc): `result.json` says `success: true` with an empty `error`,
    /// like kernelbot's; the failure still sets the exit code and the summary.
    pub recorded: bool,
}

impl Failure {
    /// The payload or config is at fault.
    pub fn bad_config(message: impl Into<String>) -> Failure {
        Failure {
            kind: FailureKind::BadConfig,
            message: message.into(),
            recorded: false,
        }
    }
    /// The node is at fault.
    pub fn infrastructure(message: impl Into<String>) -> Failure {
        Failure {
            kind: FailureKind::Infrastructure,
            message: message.into(),
            recorded: false,
        }
    }
    /// The node is at fault, and the runs record it as kernelbot's evaluator would.
    fn recorded_infrastructure(message: impl Into<String>) -> Failure {
        Failure {
            recorded: true,
            ..Failure::infrastructure(message)
        }
    }
}

/// The result, and why it is a failure if it is one. `result.success` is false exactly when
/// `failure` is set and not [`Failure::recorded`], and then `result.error` is its message.
#[derive(Debug, Clone)]
pub struct Evaluation {
    /// `result.json`'s content.
    pub result: FullResult,
    /// Set when `result.success` is false, and for a failure the runs record.
    pub failure: Option<Failure>,
}

/// kernelbot's `run_config`: evaluates `cfg` and returns `result.json`'s content.
pub fn run_config(cfg: &RunConfig, opts: &Options) -> FullResult {
    evaluate(cfg, opts).result
}

/// [`run_config`] with the failure classified.
pub fn evaluate(cfg: &RunConfig, opts: &Options) -> Evaluation {
    let system = opts
        .system
        .clone()
        .unwrap_or_else(|| sysinfo::collect(&opts.probe));
    let mut runs = IndexMap::new();
    let failure = evaluate_into(cfg, opts, &system, &mut runs).err();
    let unrecorded = failure.as_ref().filter(|f| !f.recorded);
    Evaluation {
        result: FullResult {
            success: unrecorded.is_none(),
            error: unrecorded.map(|f| f.message.clone()).unwrap_or_default(),
            system,
            runs,
        },
        failure,
    }
}

// Long because the evaluation's steps in kernelbot's order: checks, compiler, each mode's runs.
fn evaluate_into(
    cfg: &RunConfig,
    opts: &Options,
    system: &SystemInfo,
    runs: &mut IndexMap<String, EvalResult>,
) -> Result<(), Failure> {
    cfg.validate()
        .map_err(|e| Failure::bad_config(e.to_string()))?;
    if opts.require_gpu && system.device_count == 0 {
        return Err(Failure::infrastructure(
            "no GPU found (NVML, nvidia-smi and rocm-smi saw none) but a GPU is required; check the node's driver and the job's device request",
        ));
    }
    if cfg.multi_gpu && system.device_count == 0 {
        return Err(Failure::infrastructure(
            "the config sets multi_gpu, which needs the GPU count for POPCORN_GPUS, but no GPU was found",
        ));
    }
    if cfg.mode == Mode::Profile && cfg.benchmarks.is_empty() {
        // kernelbot profiles each benchmark line; with none it runs nothing and needs
        // neither a compiler nor a profiler: success with no runs.
        return Ok(());
    }
    let profiler = match cfg.mode {
        Mode::Profile => Some(profile::select(&system.runtime).map_err(Failure::infrastructure)?),
        _ => None,
    };
    let job = Job {
        cfg,
        opts,
        system,
        profiler,
        nvcc: None,
    };
    let job = match cfg.lang {
        Lang::Cuda => {
            // kernelbot's compile_cuda_script checks the include directories before it looks
            // for nvcc: a node missing both fails as the node's fault (no result stored as
            // the contestant's run), not as kernelbot's recorded "NVCC not found".
            cuda::check_include_dirs(&cfg.include_dirs).map_err(Failure::infrastructure)?;
            let Some(nvcc) = cuda::find_nvcc(opts.nvcc.as_deref(), &opts.cuda_fallbacks) else {
                return Err(record_missing_nvcc(cfg, runs));
            };
            Job {
                nvcc: Some(nvcc),
                ..job
            }
        }
        Lang::Python => job,
    };

    let tests = cases_text(&cfg.tests);
    let benchmarks = cases_text(&cfg.benchmarks);
    let cases = |mode: &'static str, benchmarks: &str| {
        select_cases(mode, cfg.ranking_by, &tests, benchmarks)
            .ok_or_else(|| Failure::bad_config(ConfigError::LastOfNoBenchmarks(mode).to_string()))
    };
    match cfg.mode {
        Mode::Test | Mode::Benchmark => {
            let mode = cfg.mode.as_str();
            let r = job.run_mode(mode, &cases(mode, &benchmarks)?)?;
            runs.insert(mode.to_string(), r);
            check_cancelled()?;
        }
        Mode::Profile => {
            // Each run gets one line, without its line break.
            for (i, line) in python_splitlines(&benchmarks).into_iter().enumerate() {
                let cases =
                    select_cases("profile", cfg.ranking_by, &tests, line).ok_or_else(|| {
                        Failure::bad_config(ConfigError::LastOfEmptyProfileLine(i).to_string())
                    })?;
                let r = job.run_mode("profile", &cases)?;
                runs.insert(format!("profile.{i}"), r);
                check_cancelled()?;
            }
        }
        Mode::Leaderboard | Mode::Private => {
            for mode in ["test", "benchmark", "leaderboard"] {
                // A failure here keeps the runs made so far (kernelbot's GitHub runner writes
                // no result at all, its Modal runner one with no runs).
                let r = job.run_mode(mode, &cases(mode, &benchmarks)?)?;
                let passed = r.run.as_ref().is_some_and(|run| run.passed);
                runs.insert(mode.to_string(), r);
                check_cancelled()?;
                if !passed {
                    break;
                }
            }
        }
    }
    Ok(())
}

/// kernelbot's record of a failed `which nvcc` (as the first run's compilation), and the
/// failure, with the reason for the node.
fn record_missing_nvcc(cfg: &RunConfig, runs: &mut IndexMap<String, EvalResult>) -> Failure {
    let first = match cfg.mode {
        Mode::Leaderboard | Mode::Private => "test".to_string(),
        Mode::Profile => "profile.0".to_string(),
        m => m.as_str().to_string(),
    };
    let now = Timestamp::now();
    runs.insert(
        first,
        EvalResult {
            start: now,
            end: now,
            compilation: Some(CompileResult {
                nvcc_found: false,
                nvcc_version: String::new(),
                success: false,
                command: "which nvcc".into(),
                stdout: String::new(),
                stderr: String::new(),
                exit_code: 1,
            }),
            run: None,
            profile: None,
        },
    );
    Failure::recorded_infrastructure(
        "nvcc not found (looked on PATH, in $CUDA_HOME/bin, $CUDA_PATH/bin and /usr/local/cuda/bin); install the CUDA toolkit on the node or pass --nvcc",
    )
}

/// A cancelled job stops after the run that was killed (kept in `runs` for the record).
fn check_cancelled() -> Result<(), Failure> {
    if process::cancelled() {
        Err(Failure::infrastructure(
            "cancelled: the runner received SIGTERM/SIGINT/SIGHUP and killed the running process group",
        ))
    } else {
        Ok(())
    }
}

struct Job<'a> {
    cfg: &'a RunConfig,
    opts: &'a Options,
    system: &'a SystemInfo,
    profiler: Option<Profiler>,
    nvcc: Option<PathBuf>,
}

/// The cases file of one run, as kernelbot's `run_single_evaluation` writes it: `test` gets
/// all of `tests`; `benchmark`, `leaderboard` and `profile` get all of `benchmarks`, or with
/// `ranking_by` `last` only its last line (line break kept). `None` where kernelbot fails:
/// `last` of no lines. Profile runs pass one benchmark line (without its break) as
/// `benchmarks`, so they get that line either way.
pub fn select_cases(
    mode: &str,
    ranking: RankingBy,
    tests: &str,
    benchmarks: &str,
) -> Option<String> {
    match (mode, ranking) {
        ("test", _) => Some(tests.to_string()),
        (_, RankingBy::Last) => python_lines_keepends(benchmarks)
            .last()
            .map(|l| l.to_string()),
        (_, RankingBy::Mean | RankingBy::Geom) => Some(benchmarks.to_string()),
    }
}

impl Job<'_> {
    /// One kernelbot runner call (`run_pytorch_script` / `run_cuda_script`) for `mode`, the
    /// harness getting `cases`.
    fn run_mode(&self, mode: &str, cases: &str) -> Result<EvalResult, Failure> {
        check_cancelled()?;
        let start = Timestamp::now();
        let (compilation, call) = match self.cfg.lang {
            Lang::Python => {
                self.write_files(self.cfg.sources.iter())?;
                let outcome = self.python_eval(mode, cases);
                self.remove_files(self.cfg.sources.keys());
                let (compilation, run, profile) = outcome?;
                return Ok(EvalResult {
                    start,
                    end: Timestamp::now(),
                    compilation,
                    run: Some(run),
                    profile,
                });
            }
            Lang::Cuda => {
                self.write_files(self.cfg.sources.iter().chain(self.cfg.headers.iter()))?;
                let compiled = self.compile();
                // kernelbot removes the sources before the user's binary runs, whatever happened.
                self.remove_files(self.cfg.sources.keys().chain(self.cfg.headers.keys()));
                let compiled = compiled?;
                if !compiled.success {
                    return Ok(EvalResult {
                        start,
                        end: Timestamp::now(),
                        compilation: Some(compiled),
                        run: None,
                        profile: None,
                    });
                }
                (Some(compiled), vec![format!("./{}", cuda::OUTPUT_BINARY)])
            }
        };
        let (run, profile) = self.single_evaluation(call, mode, cases)?;
        Ok(EvalResult {
            start,
            end: Timestamp::now(),
            compilation,
            run: Some(run),
            profile,
        })
    }

    fn python_eval(
        &self,
        mode: &str,
        cases: &str,
    ) -> Result<(Option<CompileResult>, RunResult, Option<ProfileResult>), Failure> {
        // kernelbot's "compile" step: run the submission once to fill load_inline's cache. It
        // names `submission.py`; without such a file there is nothing to warm up.
        let has_submission = self
            .cfg
            .sources
            .keys()
            .any(|k| work_path("sources", k).is_ok_and(|p| p == "submission.py"));
        let compilation = if has_submission {
            let call = vec![self.opts.python.clone(), "submission.py".into()];
            // kernelbot's pre-run passes seed 1 and nothing else: no POPCORN_GPUS.
            let pre = self.run_program(&call, Some(1), false, self.opts.compile_timeout, &[])?;
            pre.stdout
                .contains("-DTORCH_EXTENSION_NAME")
                .then(|| CompileResult {
                    nvcc_found: true,
                    nvcc_version: String::new(),
                    success: true,
                    command: pre.command.clone(),
                    stdout: pre.stdout.clone(),
                    stderr: pre.stderr.clone(),
                    exit_code: pre.exit_code,
                })
        } else {
            None
        };
        let main = self.cfg.main.clone().unwrap_or_default();
        let (run, profile) =
            self.single_evaluation(vec![self.opts.python.clone(), main], mode, cases)?;
        Ok((compilation, run, profile))
    }

    fn write_files<'b>(
        &self,
        files: impl Iterator<Item = (&'b String, &'b String)>,
    ) -> Result<(), Failure> {
        let mut written: Vec<&String> = Vec::new();
        for (name, content) in files {
            // A previous mode's run may have left a file of that name; kernelbot overwrites.
            let result = workdir::remove_file(&self.opts.workdir, name)
                .and_then(|()| workdir::write_file(&self.opts.workdir, name, content.as_bytes()));
            if let Err(e) = result {
                // Leave no half-written submission behind.
                self.remove_files(written.into_iter());
                return Err(write_failure(e));
            }
            written.push(name);
        }
        Ok(())
    }

    fn remove_files<'b>(&self, names: impl Iterator<Item = &'b String>) {
        for name in names {
            if let Err(e) = workdir::remove_file(&self.opts.workdir, name) {
                tracing::warn!("could not remove {name:?} from the work directory: {e}");
            }
        }
    }

    fn compile(&self) -> Result<CompileResult, Failure> {
        let nvcc = self.nvcc.clone().unwrap_or_default();
        let nvcc_str = nvcc.to_string_lossy().into_owned();
        let version = self.tool(
            &nvcc_str,
            &["--version".to_string()],
            Duration::from_secs(30),
        )?;
        if version.exit_code != 0 || version.timed_out {
            return Ok(CompileResult {
                nvcc_found: false,
                nvcc_version: String::new(),
                success: false,
                command: shell_join(&["nvcc", "--version"]),
                stdout: version.stdout.finish(),
                stderr: version.stderr.finish(),
                exit_code: version.exit_code,
            });
        }
        // kernelbot keeps the whole `nvcc --version` text.
        let nvcc_version = version.stdout.finish();
        let mut command = vec![nvcc_str.clone()];
        command.extend(cuda::compile_args(self.cfg));
        tracing::info!("compiling with nvcc ({} sources)", self.cfg.sources.len());
        let out = self.tool(&nvcc_str, &command[1..], self.opts.compile_timeout)?;
        let mut stderr = out.stderr.finish();
        if out.timed_out {
            stderr.push_str(&format!(
                "\nnvcc did not finish within {} s and was killed",
                self.opts.compile_timeout.as_secs()
            ));
            stderr = limit_length(&stderr, MAX_OUTPUT_CHARS);
        }
        Ok(CompileResult {
            nvcc_found: true,
            nvcc_version,
            success: out.exit_code == 0 && !out.timed_out,
            command: shell_join(&command),
            stdout: out.stdout.finish(),
            stderr,
            exit_code: if out.timed_out {
                exit_code::TIMEOUT_EXPIRED
            } else {
                out.exit_code
            },
        })
    }

    /// Runs a tool (nvcc, ncu) in the work directory without the POPCORN pipe.
    fn tool(&self, program: &str, args: &[String], timeout: Duration) -> Result<Outcome, Failure> {
        let spec = Spec {
            program: program.into(),
            args: args.iter().map(OsString::from).collect(),
            cwd: self.opts.workdir.clone(),
            env: vec![],
            env_remove: payload_vars(),
            timeout,
            popcorn: false,
            reap_orphans: self.opts.reap_orphans,
            proc_root: self.opts.proc_root.clone(),
            guard: self.opts.guard.clone(),
        };
        process::run(&spec)
            .map_err(|e| Failure::infrastructure(format!("could not start {program}: {e}")))
    }

    /// kernelbot's `run_single_evaluation`: the cases file (see [`select_cases`]), the
    /// timeout, the mode argument.
    fn single_evaluation(
        &self,
        mut call: Vec<String>,
        mode: &str,
        cases: &str,
    ) -> Result<(RunResult, Option<ProfileResult>), Failure> {
        let timeout = match mode {
            "test" => self.cfg.test_timeout,
            "leaderboard" => self.cfg.ranked_timeout,
            _ => self.cfg.benchmark_timeout,
        };
        // Readable by the harness when it runs as the submission's uid; the runner's alone
        // otherwise.
        let file_mode = if Guard::runs_apart(self.opts.guard.as_ref()) {
            0o644
        } else {
            0o600
        };
        let mut file = tempfile::Builder::new()
            .prefix("kernelkite-cases-")
            .permissions(std::fs::Permissions::from_mode(file_mode))
            .tempfile()
            .map_err(|e| {
                Failure::infrastructure(format!(
                    "cannot create the cases file in {}: {e}",
                    std::env::temp_dir().display()
                ))
            })?;
        std::io::Write::write_all(&mut file, cases.as_bytes())
            .map_err(|e| Failure::infrastructure(format!("cannot write the cases file: {e}")))?;
        call.push(mode.to_string());
        call.push(file.path().to_string_lossy().into_owned());
        let timeout = Duration::from_secs(timeout);
        match (&self.profiler, mode) {
            (Some(p), "profile") => self.profile_run(p, &call, timeout),
            _ => Ok((
                self.run_program(&call, self.cfg.seed, self.cfg.multi_gpu, timeout, &[])?,
                None,
            )),
        }
    }

    fn profile_run(
        &self,
        profiler: &Profiler,
        call: &[String],
        timeout: Duration,
    ) -> Result<(RunResult, Option<ProfileResult>), Failure> {
        let tmp = tempfile::Builder::new()
            .prefix("kernelkite-profile-")
            .tempdir_in(&self.opts.workdir)
            .map_err(|e| {
                Failure::infrastructure(format!("cannot create the profile directory: {e}"))
            })?;
        let out_dir = tmp.path().join("profile_data");
        std::fs::create_dir(&out_dir).map_err(|e| {
            Failure::infrastructure(format!("cannot create {}: {e}", out_dir.display()))
        })?;
        if Guard::runs_apart(self.opts.guard.as_ref()) {
            // The profiler runs as the submission's uid and writes into `profile_data` (sticky:
            // it cannot rename or remove what the runner made); the directory above stays the
            // runner's, so `profile_data` itself cannot be swapped for a link.
            std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755))
                .and_then(|()| crate::guard::open_to_submission(&out_dir))
                .map_err(|e| {
                    Failure::infrastructure(format!(
                        "cannot open {} to the submission: {e}",
                        out_dir.display()
                    ))
                })?;
        }
        let (program, args, env) = profiler.wrap(&out_dir, call);
        let mut full = vec![program];
        full.extend(args);
        let mut run = self.run_program(&full, self.cfg.seed, self.cfg.multi_gpu, timeout, &env)?;
        if let Profiler::Ncu(ncu) = profiler {
            let rep = format!("{}/profile.ncu-rep", out_dir.display());
            let args = [
                "--import".to_string(),
                rep,
                "--print-details".into(),
                "body".into(),
            ];
            if let Ok(o) = self.tool(&ncu.to_string_lossy(), &args, timeout) {
                if o.exit_code == 0 && !o.timed_out {
                    let report =
                        profile::filter_ncu_report(&o.stdout.finish(), &profile::NCU_TABLES);
                    let encoded =
                        base64::engine::general_purpose::STANDARD.encode(report.as_bytes());
                    run.result.insert("benchmark.0.report".into(), encoded);
                }
            }
        }
        if !run.success {
            return Ok((run, None));
        }
        if let Profiler::Rocprof(_) = profiler {
            if let Err(e) = profile::merge_rocprof_traces(&out_dir, &self.opts.workdir) {
                tracing::warn!("could not merge rocprofv3 traces: {e}");
            }
        }
        let zip = crate::ziparchive::zip_dir(&out_dir).map_err(|e| {
            Failure::infrastructure(format!("cannot archive the profile data: {e}"))
        })?;
        Ok((
            run,
            Some(ProfileResult {
                profiler: profiler.name().to_string(),
                trace: Some(base64::engine::general_purpose::STANDARD.encode(zip)),
                download_url: None,
            }),
        ))
    }

    /// kernelbot's `run_program`.
    fn run_program(
        &self,
        call: &[String],
        seed: Option<i64>,
        multi_gpu: bool,
        timeout: Duration,
        extra_env: &[(String, String)],
    ) -> Result<RunResult, Failure> {
        let mut env: Vec<(OsString, OsString)> = extra_env
            .iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        if let Some(s) = seed {
            env.push(("POPCORN_SEED".into(), s.to_string().into()));
        }
        if multi_gpu {
            env.push((
                "POPCORN_GPUS".into(),
                self.system.device_count.to_string().into(),
            ));
        }
        let spec = Spec {
            program: call[0].clone().into(),
            args: call[1..].iter().map(OsString::from).collect(),
            cwd: self.opts.workdir.clone(),
            env,
            env_remove: payload_vars(),
            timeout,
            popcorn: true,
            reap_orphans: self.opts.reap_orphans,
            proc_root: self.opts.proc_root.clone(),
            guard: self.opts.guard.clone(),
        };
        let out = process::run(&spec).map_err(|e| spawn_failure(&call[0], e))?;
        if out.popcorn_truncated {
            tracing::warn!(
                "the POPCORN pipe carried more than {} bytes; the rest was dropped",
                process::MAX_POPCORN_BYTES
            );
        }
        Ok(run_result(call, &out, timeout))
    }
}

/// `RunResult` from a finished (or timed-out) process, as kernelbot builds it.
pub fn run_result(call: &[String], out: &Outcome, timeout: Duration) -> RunResult {
    if out.timed_out {
        return RunResult {
            success: false,
            passed: false,
            command: shell_join(call),
            stdout: out.stdout.finish_raw(),
            stderr: out.stderr.finish_raw(),
            exit_code: exit_code::TIMEOUT_EXPIRED,
            duration: timeout.as_secs_f64(),
            result: IndexMap::new(),
        };
    }
    let result = parse_popcorn(&out.popcorn);
    RunResult {
        success: out.exit_code == exit_code::SUCCESS || out.exit_code == exit_code::VALIDATE_FAIL,
        passed: result.get("check").is_some_and(|v| v == "pass"),
        command: shell_join(call),
        stdout: out.stdout.finish(),
        stderr: out.stderr.finish(),
        exit_code: out.exit_code,
        duration: out.duration.as_secs_f64(),
        result,
    }
}

/// kernelbot's reading of the POPCORN pipe: every line is `key: value` (split at the first
/// colon, both stripped by Python's `str.strip()`); a line that is empty on both sides is
/// skipped; a repeated key keeps its first position and its last value.
pub fn parse_popcorn(raw: &[u8]) -> IndexMap<String, String> {
    let text = crate::text::universal_newlines(&String::from_utf8_lossy(raw));
    let mut out = IndexMap::new();
    for line in python_splitlines(&text) {
        let (k, v) = line.split_once(':').unwrap_or((line, ""));
        if !k.is_empty() || !v.is_empty() {
            out.insert(
                kernelkite_kernelbot::pyrepr::strip(k).to_string(),
                kernelkite_kernelbot::pyrepr::strip(v).to_string(),
            );
        }
    }
    out
}

/// Variables never passed to the submission or the tools: the payload carriers (the config
/// holds the seed of secret leaderboard runs) and credentials, above all the Buildkite
/// agent's, with which a submission could upload a forged `result.json` artifact.
fn payload_vars() -> Vec<OsString> {
    scrubbed_vars(std::env::vars_os().map(|(k, _)| k))
}

/// Which of `names` `payload_vars` removes. Inherited `POPCORN_*` variables go too: the
/// protocol's variables are the runner's to set, so a `POPCORN_SEED` or `POPCORN_GPUS` in
/// the agent's environment must not reach a run whose config sets no seed or no multi_gpu.
pub fn scrubbed_vars(names: impl Iterator<Item = OsString>) -> Vec<OsString> {
    names
        .filter(|k| {
            let k = k.to_string_lossy();
            is_sensitive(&k) || k.starts_with("POPCORN_")
        })
        .collect()
}

fn is_sensitive(name: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    upper == kernelkite_kernelbot::payload::ENV_PAYLOAD
        || upper.starts_with("KERNELBOT_PAYLOAD_")
        || upper.starts_with("BUILDKITE_AGENT_ACCESS_TOKEN")
        || upper.starts_with("BUILDKITE_AGENT_JOB_API_")
        || ["TOKEN", "SECRET", "PASSWORD", "API_KEY", "PRIVATE_KEY"]
            .iter()
            .any(|w| upper.ends_with(w))
}

fn spawn_failure(program: &str, e: std::io::Error) -> Failure {
    if e.kind() == std::io::ErrorKind::NotFound {
        Failure::infrastructure(format!("cannot run {program:?}: not found; install it on the node or point the runner at it (--python)"))
    } else {
        Failure::infrastructure(format!("cannot run {program:?}: {e}"))
    }
}

fn write_failure(e: WriteError) -> Failure {
    match e {
        WriteError::Refused { .. } => Failure::bad_config(e.to_string()),
        WriteError::Io { .. } => Failure::infrastructure(e.to_string()),
    }
}

/// Checks that `dir` can serve as a work directory.
pub fn check_workdir(dir: &Path) -> Result<(), Failure> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Failure::infrastructure(format!(
            "work directory {} is not a directory",
            dir.display()
        ))),
        Err(e) => Err(Failure::infrastructure(format!(
            "work directory {} is not usable: {e}",
            dir.display()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn popcorn_lines_parse_like_kernelbot() {
        let r = parse_popcorn(
            b"check: pass\ngarbage line\n\n: \nk: a: b\ncheck: fail\n  spaced  :  v  \r\nx:1",
        );
        let got: Vec<(&str, &str)> = r.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            got,
            [
                ("check", "fail"),
                ("garbage line", ""),
                ("", ""),
                ("k", "a: b"),
                ("spaced", "v"),
                ("x", "1")
            ]
        );
    }

    #[test]
    fn credentials_and_payload_are_scrubbed() {
        let names = [
            "KERNELBOT_PAYLOAD",
            "KERNELBOT_PAYLOAD_0",
            "KERNELBOT_PAYLOAD_SHA256",
            "BUILDKITE_AGENT_ACCESS_TOKEN",
            "BUILDKITE_AGENT_JOB_API_SOCKET",
            "GITHUB_TOKEN",
            "aws_secret",
            "POPCORN_SEED",
            "POPCORN_GPUS",
            "PATH",
            "KERNELBOT_RUN_ID",
            "BUILDKITE_JOB_ID",
            "CUDA_VISIBLE_DEVICES",
            "HOME",
        ];
        let kept: Vec<OsString> = scrubbed_vars(names.iter().map(OsString::from));
        assert_eq!(
            kept,
            names[..9].iter().map(OsString::from).collect::<Vec<_>>()
        );
    }

    #[test]
    fn timed_out_output_is_reported_untranslated_like_kernelbot() {
        let mut stdout = crate::text::Capture::new(MAX_OUTPUT_CHARS);
        stdout.push(b"50%\r100%\r\n");
        let mut out = Outcome {
            exit_code: -9,
            timed_out: true,
            duration: Duration::from_secs(3),
            stdout,
            stderr: crate::text::Capture::new(MAX_OUTPUT_CHARS),
            popcorn: b"check: pass\n".to_vec(),
            popcorn_truncated: false,
        };
        let call = ["python3".to_string(), "eval.py".to_string()];
        let r = run_result(&call, &out, Duration::from_secs(2));
        assert_eq!(r.stdout, "50%\r100%\r\n");
        assert_eq!((r.exit_code, r.success, r.passed), (114, false, false));
        assert_eq!(r.duration, 2.0);
        assert!(r.result.is_empty());
        out.timed_out = false;
        out.exit_code = 0;
        let r = run_result(&call, &out, Duration::from_secs(2));
        assert_eq!(r.stdout, "50%\n100%\n");
        assert!(r.passed && r.success);
    }

    #[test]
    fn cases_are_selected_like_run_single_evaluation() {
        let (t, b) = ("t: 1\n", "a: 1\nb: 2\n");
        for mode in ["benchmark", "leaderboard", "profile"] {
            assert_eq!(select_cases(mode, RankingBy::Last, t, b).unwrap(), "b: 2\n");
            assert_eq!(select_cases(mode, RankingBy::Mean, t, b).unwrap(), b);
            assert_eq!(select_cases(mode, RankingBy::Geom, t, b).unwrap(), b);
            assert_eq!(select_cases(mode, RankingBy::Last, t, ""), None);
            assert_eq!(select_cases(mode, RankingBy::Mean, t, "").unwrap(), "");
        }
        for r in RankingBy::ALL {
            assert_eq!(select_cases("test", r, t, b).unwrap(), t);
            assert_eq!(select_cases("test", r, "", b).unwrap(), "");
            // A profile run's single line has no break, and keeps none.
            assert_eq!(select_cases("profile", r, t, "b: 2").unwrap(), "b: 2");
        }
        // A case with no keys is an empty line; `last` of it is its break alone.
        assert_eq!(
            select_cases("benchmark", RankingBy::Last, t, "a: 1\n\n").unwrap(),
            "\n"
        );
        assert_eq!(select_cases("profile", RankingBy::Last, t, ""), None);
    }

    #[test]
    fn popcorn_keys_and_values_are_stripped_of_pythons_whitespace() {
        let r = parse_popcorn("\x1f\u{a0}key\u{3000}:\u{2003} value\x1f\n".as_bytes());
        assert_eq!(r.get("key").map(String::as_str), Some("value"));
    }
}
