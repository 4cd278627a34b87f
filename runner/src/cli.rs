//! The `kernelkite-runner` command line.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;

use crate::eval::{self, Evaluation, Failure, FailureKind, Options};
use crate::sysinfo::{Probe, TorchProbe};
use crate::{example, process, provenance, sysinfo};
use kernelkite_kernelbot::config::{Mode, RunConfig};
use kernelkite_kernelbot::payload;
use kernelkite_kernelbot::result::{FullResult, RunResult};

/// The evaluation ran and `result.json` was written, whatever the tests said.
pub const EXIT_OK: u8 = 0;
/// Something unexpected (a bug in the runner); `result.json` says so when it can.
pub const EXIT_UNEXPECTED: u8 = 1;
/// The payload or config is wrong (not base64/zlib/JSON, invalid config, unsafe file
/// names). `result.json` was written with `success: false`. Retrying will not help.
pub const EXIT_BAD_PAYLOAD: u8 = 2;
/// The node could not do the job: no GPU when one is required, no nvcc for a CUDA job, no
/// profiler for profile mode, no Python, a missing include directory, a work directory or
/// `result.json` that cannot be written, or the job was cancelled by a signal. Retrying (on
/// another node) may help.
pub const EXIT_INFRASTRUCTURE: u8 = kernelkite_sys::node::EXIT_NODE_FAULT;

const AFTER_HELP: &str = "\
PAYLOAD CARRIERS (first found wins):
  1. --payload-file PATH: a file holding base64(zlib(JSON config)), as kernelbot makes it.
  2. KERNELBOT_PAYLOAD_CHUNKS=N with KERNELBOT_PAYLOAD_0 .. KERNELBOT_PAYLOAD_{N-1} and
     KERNELBOT_PAYLOAD_SHA256 (hex SHA-256 of the joined chunks), for payloads over Linux's
     128 KiB limit on one environment string.
  3. KERNELBOT_PAYLOAD: the whole payload in one variable.
  The payload variables and credentials (BUILDKITE_AGENT_ACCESS_TOKEN, the job API,
  *_TOKEN, *_SECRET, *_PASSWORD, *_API_KEY) are removed from the harness's environment,
  and neither the payload nor the seed is ever logged.

EXIT CODES:
  0  the evaluation ran and result.json was written (whatever the tests said)
  1  unexpected runner error (a bug); result.json says so when it can be written
  2  bad payload or config; result.json was written with success=false and the reason
  3  infrastructure failure (no GPU when required, no nvcc, no profiler, no python,
     work directory or result.json not writable, cancelled by SIGTERM/SIGINT/SIGHUP,
     a command-line or KERNELKITE_* usage error); safe to retry on another node

EXAMPLE:
  kernelkite-runner --example                 # evaluate the built-in prefix-sum task
  kernelkite-runner --example --print-payload > payload.txt
  kernelkite-runner --payload-file payload.txt --output result.json";

/// Evaluates a kernelbot submission (payload = base64(zlib(JSON run config))) over the
/// POPCORN protocol and writes kernelbot's result.json.
#[derive(Debug, Parser)]
#[command(name = "kernelkite-runner", version, after_help = AFTER_HELP)]
pub struct Args {
    /// Read the payload from this file instead of the environment.
    #[arg(long, env = "KERNELKITE_PAYLOAD_FILE", value_name = "PATH")]
    pub payload_file: Option<PathBuf>,
    /// Directory the submission is written to and run in; created if missing, should be
    /// empty. Default: a fresh temporary directory, removed afterwards.
    #[arg(long, env = "KERNELKITE_WORKDIR", value_name = "DIR")]
    pub workdir: Option<PathBuf>,
    /// Where to write result.json.
    #[arg(
        long,
        env = "KERNELKITE_OUTPUT",
        value_name = "PATH",
        default_value = "result.json"
    )]
    pub output: PathBuf,
    /// Where to write provenance.json (where and on what the run ran: node, agent, slice,
    /// GPUs with their clocks, power limit, temperature and ECC counts at start and end).
    /// Default: beside the result.
    #[arg(long, env = "KERNELKITE_PROVENANCE", value_name = "PATH")]
    pub provenance: Option<PathBuf>,
    /// Python interpreter for py submissions (kernelbot runs `python3`).
    #[arg(
        long,
        env = "KERNELKITE_PYTHON",
        value_name = "CMD",
        default_value = "python3"
    )]
    pub python: String,
    /// nvcc to use instead of searching PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin.
    #[arg(long, env = "KERNELKITE_NVCC", value_name = "PATH")]
    pub nvcc: Option<PathBuf>,
    /// Fail with exit code 3 when no GPU is detected (set this on GPU nodes).
    #[arg(long, env = "KERNELKITE_REQUIRE_GPU", value_parser = clap::builder::BoolishValueParser::new())]
    pub require_gpu: bool,
    /// How to find the torch version for system info.
    #[arg(
        long,
        env = "KERNELKITE_TORCH_PROBE",
        value_enum,
        default_value = "files"
    )]
    pub torch_probe: TorchProbe,
    /// Evaluate the built-in example task (examples/prefixsum_py: a prefix sum in plain
    /// Python, CPU only) instead of a payload.
    #[arg(long)]
    pub example: bool,
    /// Mode for --example.
    #[arg(long, value_enum, default_value = "leaderboard", requires = "example")]
    pub example_mode: Mode,
    /// With --example: print the example's payload (for --payload-file) and exit.
    #[arg(long, requires = "example")]
    pub print_payload: bool,
}

/// The binary's entry: logs to stderr, parses the command line, runs, and maps the outcome to an exit code.
pub fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .init();
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => return usage_error(&e),
    };
    match run(&args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::from(EXIT_UNEXPECTED)
        }
    }
}

/// `--help`/`--version` print and exit 0. A real usage error (an unknown flag, a bad
/// `KERNELKITE_*` value in the agent's environment) is the node's or pipeline's fault, not
/// the payload's, and may be specific to this node: exit 3 so it is retried elsewhere, and
/// still leave kernelbot a `result.json` saying what is wrong, at the `--output` the
/// command line or environment names (clap's own exit code 2 would read as "bad payload").
fn usage_error(e: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        let _ = e.print();
        return ExitCode::from(EXIT_OK);
    }
    let raw: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let message = format!(
        "the runner was invoked wrongly (a pipeline or node configuration error): {}; see kernelkite-runner --help",
        usage_problem(e, &raw)
    );
    tracing::error!("{message}");
    let output = output_from_raw(&raw, std::env::var_os("KERNELKITE_OUTPUT"));
    let system = sysinfo::collect(&Probe::default());
    if let Err(err) = write_result(&output, &FullResult::failure(message, system)) {
        tracing::error!(
            "cannot write {}: {err}; check the path and permissions",
            output.display()
        );
    }
    ExitCode::from(EXIT_INFRASTRUCTURE)
}

/// clap's one-line description of a usage error. It quotes the offending argument; a long
/// one may be a payload passed by mistake (even a minimal payload is over 64 characters),
/// which must not reach the log, so then only the kind of error is given.
fn usage_problem(e: &clap::Error, raw: &[std::ffi::OsString]) -> String {
    let rendered = e.to_string();
    let first = rendered.lines().next().unwrap_or_default();
    let first = first.strip_prefix("error: ").unwrap_or(first);
    let quotes_long_arg = raw
        .iter()
        .map(|a| a.to_string_lossy())
        .any(|a| a.len() > 64 && first.contains(a.as_ref()));
    if first.is_empty() || quotes_long_arg {
        e.kind().to_string()
    } else {
        first.to_string()
    }
}

/// Where `--output` points, read from raw arguments that clap refused: the last
/// `--output X` / `--output=X` before `--`, else `$KERNELKITE_OUTPUT`, else the default.
fn output_from_raw(args: &[std::ffi::OsString], env: Option<std::ffi::OsString>) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    let mut found: Option<PathBuf> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let bytes = a.as_bytes();
        if bytes == b"--" {
            break;
        }
        if bytes == b"--output" {
            if let Some(v) = it.next() {
                found = Some(PathBuf::from(v));
            }
        } else if let Some(v) = bytes.strip_prefix(b"--output=") {
            found = Some(PathBuf::from(std::ffi::OsStr::from_bytes(v)));
        }
    }
    found
        .or_else(|| env.filter(|v| !v.is_empty()).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("result.json"))
}

/// The whole command; returns the exit code.
pub fn run(args: &Args) -> anyhow::Result<u8> {
    if args.example && args.print_payload {
        let text = payload::encode(&example::config(args.example_mode))?;
        let mut stdout = std::io::stdout().lock();
        return match writeln!(stdout, "{text}").and_then(|()| stdout.flush()) {
            Ok(()) => Ok(EXIT_OK),
            // A reader that has seen enough (`| head -c 10`) closed the pipe: nothing is
            // wrong, and nothing is left to say.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(EXIT_OK),
            Err(e) => Err(anyhow::anyhow!("cannot print the payload: {e}")),
        };
    }
    if let Some(why) = nothing_to_evaluate(args, |k| std::env::var_os(k).is_some()) {
        eprintln!("kernelkite-runner: {why}");
        return Ok(EXIT_BAD_PAYLOAD);
    }
    let probe = Probe {
        python: args.python.clone(),
        torch: args.torch_probe,
        ..Probe::default()
    };
    let system = sysinfo::collect(&probe);
    let started = provenance::start(&probe, &provenance::ProcessEnv);
    let provenance_path = args
        .provenance
        .clone()
        .unwrap_or_else(|| provenance::default_path(&args.output));
    // Written whatever the evaluation's fate (a result saying it failed still ran somewhere);
    // a provenance that cannot be written costs the run nothing.
    let record = move || {
        if let Err(e) = provenance::write(&provenance_path, &started.finish()) {
            tracing::warn!("cannot write {}: {e}", provenance_path.display());
        }
    };

    let (evaluation, secrets) = match load_config(args) {
        Err((failure, secrets)) => (
            Evaluation {
                result: FullResult::failure(failure.message.clone(), system),
                failure: Some(failure),
            },
            secrets,
        ),
        Ok((cfg, secrets)) => {
            for w in cfg.validate().unwrap_or_default() {
                tracing::warn!("{w}");
            }
            // A bug in the runner must still leave kernelbot a result.json saying so.
            let fallback = system.clone();
            let evaluated = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                evaluate_in_workdir(args, &cfg, system)
            }));
            match evaluated {
                Ok(ev) => (ev, secrets),
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".into());
                    let message = format!("internal runner error (a bug, please report): {what}");
                    let result = FullResult::failure(message, fallback);
                    let _ = write_result(&args.output, &result);
                    record();
                    return Ok(EXIT_UNEXPECTED);
                }
            }
        }
    };
    let redact = |s: &str| {
        secrets.iter().fold(s.to_string(), |acc, sec| {
            acc.replace(sec.as_str(), "<redacted>")
        })
    };

    // The result first: reading the GPUs again may wait on a driver the run left unwell.
    let written = write_result(&args.output, &evaluation.result);
    record();
    // A closed stdout must not turn a finished evaluation into a panic.
    let mut stdout = std::io::stdout().lock();
    let _ = write!(stdout, "{}", redact(&summary(&evaluation, &args.output)));
    let _ = stdout.flush();
    if let Err(e) = written {
        tracing::error!(
            "cannot write {}: {e}; check the path and permissions",
            args.output.display()
        );
        return Ok(EXIT_INFRASTRUCTURE);
    }
    Ok(match evaluation.failure.map(|f| f.kind) {
        None => EXIT_OK,
        Some(FailureKind::BadConfig) => EXIT_BAD_PAYLOAD,
        Some(FailureKind::Infrastructure) => EXIT_INFRASTRUCTURE,
    })
}

/// The config, and the strings that must never be printed (the seed, in every spelling the
/// config gives it; seeds under three characters would redact ordinary numbers and are no
/// secret anyway).
/// Why nothing is evaluated and nothing written, outside a job: no payload from anywhere (run
/// by hand with no arguments, the runner would otherwise write a failed result.json into
/// the current directory). In a job (`BUILDKITE` set, by the agent or local mode) a missing
/// payload is the build's fault, and kernelbot is told so in result.json as before.
fn nothing_to_evaluate(args: &Args, is_set: impl Fn(&str) -> bool) -> Option<String> {
    let any_payload = args.example
        || args.payload_file.is_some()
        || ["KERNELBOT_PAYLOAD", "KERNELBOT_PAYLOAD_CHUNKS"]
            .iter()
            .any(|k| is_set(k));
    (!any_payload && !is_set("BUILDKITE")).then(|| {
        "no run config to evaluate: pass --payload-file FILE or set KERNELBOT_PAYLOAD (a build's env carries it), or try --example; nothing was written (--help says more)".to_string()
    })
}

fn load_config(args: &Args) -> Result<(RunConfig, Vec<String>), (Failure, Vec<String>)> {
    let json = if args.example {
        example::config(args.example_mode)
    } else {
        let text = match &args.payload_file {
            Some(path) => std::fs::read_to_string(path).map_err(|e| {
                Failure::bad_config(format!(
                    "cannot read the payload file {}: {e}",
                    path.display()
                ))
            }),
            None => payload::from_env(|k| std::env::var(k).ok())
                .map_err(|e| Failure::bad_config(e.to_string())),
        };
        let decoded =
            text.and_then(|t| payload::decode(&t).map_err(|e| Failure::bad_config(e.to_string())));
        decoded.map_err(|f| (f, Vec::new()))?
    };
    let secrets = secrets_of(&json);
    match RunConfig::from_json(json) {
        Ok(cfg) => {
            let secrets = with_parsed_seed(secrets, &cfg);
            Ok((cfg, secrets))
        }
        Err(e) => Err((Failure::bad_config(e.to_string()), secrets)),
    }
}

/// The seed as the harness gets it, besides the config's spelling (`4242.0` is `4242` there).
fn with_parsed_seed(mut secrets: Vec<String>, cfg: &RunConfig) -> Vec<String> {
    if let Some(s) = cfg.seed.and_then(|s| redactable(s.to_string())) {
        if !secrets.contains(&s) {
            secrets.push(s);
        }
    }
    secrets
}

fn secrets_of(json: &serde_json::Value) -> Vec<String> {
    match json.get("seed") {
        Some(serde_json::Value::Null) | None => None,
        Some(serde_json::Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(v) => Some(v.to_string()),
    }
    .and_then(redactable)
    .into_iter()
    .collect()
}

/// A seed spelling worth redacting: under three characters it would redact ordinary numbers.
fn redactable(s: String) -> Option<String> {
    (s.len() >= 3).then_some(s)
}

// Long because a linear set-up (work directory, handlers, subreaper, guard), each failure a result.
fn evaluate_in_workdir(
    args: &Args,
    cfg: &RunConfig,
    system: kernelkite_kernelbot::result::SystemInfo,
) -> Evaluation {
    let fail = |f: Failure, system| Evaluation {
        result: FullResult::failure(f.message.clone(), system),
        failure: Some(f),
    };
    // The temporary directory lives until the evaluation is over.
    let (dir, _guard) = match &args.workdir {
        Some(d) => {
            if let Err(e) = std::fs::create_dir_all(d) {
                return fail(
                    Failure::infrastructure(format!(
                        "cannot create work directory {}: {e}",
                        d.display()
                    )),
                    system,
                );
            }
            (d.clone(), None)
        }
        None => match tempfile::Builder::new().prefix("kernelkite-").tempdir() {
            Ok(t) => (t.path().to_path_buf(), Some(t)),
            Err(e) => {
                return fail(
                    Failure::infrastructure(format!(
                        "cannot create a temporary work directory in {}: {e}",
                        std::env::temp_dir().display()
                    )),
                    system,
                )
            }
        },
    };
    if let Err(f) = eval::check_workdir(&dir) {
        return fail(f, system);
    }
    process::install_cancel_handlers();
    let reap_orphans = match process::become_subreaper() {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!("cannot become a child subreaper ({e}); descendants that escape the process group may outlive the job");
            false
        }
    };
    let named = std::env::var(kernelkite_sys::identity::SUBMISSION_USER_ENV).ok();
    let guard = match crate::guard::Guard::for_this_process(
        std::path::Path::new("/proc"),
        named.as_deref(),
    ) {
        Ok(g) => Some(g),
        Err(crate::guard::GuardError::Unprotected(e)) => {
            tracing::warn!("{e}; the submission can signal the runner");
            None
        }
        Err(crate::guard::GuardError::Identity(e)) => {
            return fail(Failure::infrastructure(e), system);
        }
    };
    let (dir, _fresh) = if crate::guard::Guard::runs_apart(guard.as_ref()) {
        match crate::guard::submission_workdir(dir.clone(), args.workdir.is_some()) {
            Ok(made) => made,
            Err(e) => {
                return fail(
                    Failure::infrastructure(format!(
                        "cannot make a work directory in {} open to the submission's uid: {e}",
                        dir.display()
                    )),
                    system,
                )
            }
        }
    } else {
        (dir, None)
    };
    let opts = Options {
        python: args.python.clone(),
        system: Some(system),
        require_gpu: args.require_gpu,
        reap_orphans,
        guard,
        nvcc: args.nvcc.clone(),
        ..Options::new(dir)
    };
    eval::evaluate(cfg, &opts)
}

/// Writes `result.json` atomically and durably: a reader never sees half a file, and a crash
/// after the runner said it wrote the result never leaves a truncated one (the file and its
/// directory are fsynced). It is `0644`: a result is meant to be read by whoever uploads or
/// inspects it, often another user than the one the job ran as.
pub fn write_result(path: &Path, result: &FullResult) -> std::io::Result<()> {
    let mut json = serde_json::to_vec_pretty(result)?;
    json.push(b'\n');
    kernelkite_sys::fs::write_atomic(path, &json, 0o644)
}

fn describe_run(run: &RunResult) -> String {
    let verdict = if run.exit_code == kernelkite_kernelbot::result::exit_code::TIMEOUT_EXPIRED
        && !run.success
    {
        "timed out".to_string()
    } else if run.passed {
        "passed".to_string()
    } else if run.success {
        "did not pass".to_string()
    } else {
        "crashed".to_string()
    };
    format!(
        "{verdict} (exit {}, {:.3} s, {} result lines)",
        run.exit_code,
        run.duration,
        run.result.len()
    )
}

/// The human summary for the build log, in Buildkite sections. Never includes the payload,
/// the seed or the submission's output.
pub fn summary(ev: &Evaluation, output: &Path) -> String {
    let r = &ev.result;
    let s = &r.system;
    let mut out = String::new();
    out.push_str("--- kernelkite-runner: system\n");
    out.push_str(&format!(
        "gpu: {} x{} ({}), cpu: {}, torch: {}, host: {}\n",
        if s.gpu.is_empty() { "none" } else { &s.gpu },
        s.device_count,
        if s.runtime.is_empty() {
            "no GPU runtime"
        } else {
            &s.runtime
        },
        s.cpu,
        if s.torch.is_empty() { "-" } else { &s.torch },
        s.hostname
    ));
    for (name, run) in &r.runs {
        let mut line = String::new();
        if let Some(c) = &run.compilation {
            line.push_str(&format!(
                "compile: {} (exit {}){}; ",
                if c.success { "ok" } else { "failed" },
                c.exit_code,
                if c.nvcc_found { "" } else { ", nvcc not found" }
            ));
        }
        match &run.run {
            Some(x) => line.push_str(&format!("run: {}", describe_run(x))),
            None => line.push_str("run: not started"),
        }
        if let Some(p) = &run.profile {
            line.push_str(&format!("; profile: {}", p.profiler));
        }
        out.push_str(&format!("--- {name}: {line}\n"));
    }
    match &ev.failure {
        None => out.push_str(&format!(
            "--- result: evaluation complete, written to {}\n",
            output.display()
        )),
        Some(f) => {
            let what = match f.kind {
                FailureKind::BadConfig => "bad payload or config",
                FailureKind::Infrastructure => "infrastructure failure",
            };
            out.push_str(&format!("+++ result: {what}: {}\n", f.message));
            let success = if f.recorded {
                "success=true (recorded in the runs, as kernelbot's evaluator records it)"
            } else {
                "success=false"
            };
            out.push_str(&format!(
                "result.json written to {} with {success}\n",
                output.display()
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn help_documents_carriers_and_exit_codes() {
        let help = Args::command().render_long_help().to_string();
        for want in [
            "KERNELBOT_PAYLOAD_CHUNKS",
            "--payload-file",
            "EXIT CODES",
            "infrastructure failure",
            "KERNELKITE_PYTHON",
        ] {
            assert!(help.contains(want), "{want} missing from --help");
        }
    }

    #[test]
    fn output_is_found_in_refused_arguments() {
        let os = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert_eq!(
            output_from_raw(&os(&["--bogus", "--output", "/o/r.json"]), None),
            PathBuf::from("/o/r.json")
        );
        assert_eq!(
            output_from_raw(&os(&["--output=/a.json", "--output", "/b.json"]), None),
            PathBuf::from("/b.json")
        );
        assert_eq!(
            output_from_raw(
                &os(&["--", "--output", "/x.json"]),
                Some("/env.json".into())
            ),
            PathBuf::from("/env.json")
        );
        assert_eq!(
            output_from_raw(&os(&["--output"]), None),
            PathBuf::from("result.json")
        );
    }

    #[test]
    fn seeds_are_collected_for_redaction() {
        assert_eq!(secrets_of(&serde_json::json!({"seed": 123})), ["123"]);
        assert_eq!(secrets_of(&serde_json::json!({"seed": "7777"})), ["7777"]);
        assert!(secrets_of(&serde_json::json!({"seed": null})).is_empty());
        // A whole float is the integer the harness gets: both spellings are redacted.
        let json = serde_json::json!({"lang": "py", "mode": "test", "main": "a.py",
            "sources": {"a.py": ""}, "seed": 918273645.0});
        let cfg = RunConfig::from_json(json.clone()).unwrap();
        assert_eq!(
            with_parsed_seed(secrets_of(&json), &cfg),
            ["918273645.0", "918273645"]
        );
        let json = serde_json::json!({"lang": "py", "mode": "test", "main": "a.py",
            "sources": {"a.py": ""}, "seed": 918273645});
        let cfg = RunConfig::from_json(json.clone()).unwrap();
        assert_eq!(with_parsed_seed(secrets_of(&json), &cfg), ["918273645"]);
    }
}
