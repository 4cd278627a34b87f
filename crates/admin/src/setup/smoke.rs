//! The smoke job: one job per slice through the installed agent-level hooks, with nothing but
//! this machine. It plays the agent (the job's `BUILDKITE_*` variables, the Job API on a unix
//! socket, `environment` → `command` → `pre-exit`, bound to the slice by its `gpu-index` tag),
//! runs a short command that reports what the job sees, and judges it against the plan: one
//! GPU (the slice's) or none on a CPU-only slice, the slice's CPUs as the job's cpuset and
//! affinity, the job's own cgroup, a working `kernelkite-runner --example`, and nothing left
//! behind.
//!
//! [`judge`] is pure (the plan, the slice and what the command printed in, checks out), so
//! what the smoke job concludes is tested on its own; [`run_slice`] does the playing.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use kernelkite_topology::cpulist::{format_cpu_list, parse_cpu_list};
use kernelkite_topology::plan::{Plan, Slice, Vendor};
use kernelkite_topology::planner::format_bytes;
use serde_json::Value;

use super::SetupError;
use kernelkite_agent::job_api::JobApiServer;
use kernelkite_agent::job_env::JobEnv;
use kernelkite_hooks::config::{parse_config, Mode};
use kernelkite_hooks::job::devices::device_indices;
use kernelkite_hooks::job::exports::shell_quote;
use kernelkite_sys::node::{COMMAND_HOOK, ENVIRONMENT_HOOK, PRE_EXIT_HOOK};

/// The prefix of every line the smoke command reports.
pub const MARK: &str = "kk-smoke";

/// How long a smoke job waits for a slice a real job holds (seconds).
pub const LEASE_WAIT_SECS: u64 = 30;

/// Parses a systemd `EnvironmentFile=` as setup writes it: `KEY=VALUE` lines, `#` and `;`
/// comments, values optionally in single quotes (literal) or double quotes (`\"`, `\\`).
pub fn parse_env_file(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut env = BTreeMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        let (k, v) = line
            .split_once('=')
            .ok_or_else(|| format!("line {}: not KEY=VALUE", n + 1))?;
        let k = k.trim();
        if k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("line {}: {k:?} is not a variable name", n + 1));
        }
        let v = v.trim();
        let value = if let Some(inner) = v.strip_prefix('\'').and_then(|s| s.strip_suffix('\'')) {
            inner.to_string()
        } else if let Some(inner) = v.strip_prefix('"').and_then(|s| s.strip_suffix('"')) {
            inner.replace("\\\"", "\"").replace("\\\\", "\\")
        } else {
            v.to_string()
        };
        env.insert(k.to_string(), value);
    }
    Ok(env)
}

/// The command the smoke job runs: POSIX `sh` (docker images may have no bash), safe under
/// `-e`, each report line starting with [`MARK`].
pub fn command(runner: Option<&str>) -> String {
    let mut s = format!(
        "for v in CUDA_VISIBLE_DEVICES NVIDIA_VISIBLE_DEVICES ROCR_VISIBLE_DEVICES HIP_VISIBLE_DEVICES KERNELBOT_GPU_INDEX KERNELBOT_CPUSET KERNELKITE_SLICE; do\n  if val=$(printenv \"$v\"); then printf '{MARK} env %s=%s\\n' \"$v\" \"$val\"; fi\ndone\n\
while IFS= read -r l; do case \"$l\" in Cpus_allowed_list:*|Mems_allowed_list:*) printf '{MARK} status %s\\n' \"$l\";; esac; done < /proc/self/status\n\
while IFS= read -r l; do printf '{MARK} cgroup %s\\n' \"$l\"; done < /proc/self/cgroup\n\
printf '{MARK} uid %s\\n' \"$(id -u)\"\n"
    );
    if let Some(r) = runner {
        s.push_str(&format!(
            "out=\"${{TMPDIR:-/tmp}}/kernelkite-smoke.$$\"\n\
if {} --example --output \"$out.json\" >\"$out.log\" 2>&1; then printf '{MARK} runner 0\\n'; c=$(tr -d ' \\n\\t' < \"$out.json\" | sed -n 's/.*\"device_count\":\\([0-9][0-9]*\\).*/\\1/p'); if [ -n \"$c\" ]; then printf '{MARK} runner-gpus %s\\n' \"$c\"; fi; else s=$?; printf '{MARK} runner %s\\n' \"$s\"; tail -n 20 \"$out.log\" | sed 's/^/{MARK} runner-log /'; fi\n\
rm -f \"$out.json\" \"$out.log\"\n",
            shell_quote(r)
        ));
    }
    s
}

/// What the smoke command reported.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// The variables it printed.
    pub env: BTreeMap<String, String>,
    /// `Cpus_allowed_list` of its shell.
    pub cpus_allowed: Option<String>,
    /// `Mems_allowed_list` of its shell.
    pub mems_allowed: Option<String>,
    /// Its `/proc/self/cgroup` lines.
    pub cgroups: Vec<String>,
    /// Its user id.
    pub uid: Option<u32>,
    /// `kernelkite-runner --example`'s exit status, when it ran.
    pub runner: Option<i32>,
    /// The end of the runner's log, when it failed.
    pub runner_log: Vec<String>,
    /// The GPUs the runner counted inside the job (`system.device_count` of its result): as
    /// CUDA and ROCm enumerate them there, not what the variables say.
    pub runner_gpus: Option<u32>,
}

/// Reads the report lines out of the command's output.
pub fn parse_seen(stdout: &str) -> Seen {
    let mut seen = Seen::default();
    for line in stdout.lines() {
        let Some(rest) = line.strip_prefix(MARK).and_then(|r| r.strip_prefix(' ')) else {
            continue;
        };
        let (kind, value) = rest.split_once(' ').unwrap_or((rest, ""));
        match kind {
            "env" => {
                if let Some((k, v)) = value.split_once('=') {
                    seen.env.insert(k.to_string(), v.to_string());
                }
            }
            "status" => {
                if let Some((k, v)) = value.split_once(':') {
                    let v = v.trim().to_string();
                    match k {
                        "Cpus_allowed_list" => seen.cpus_allowed = Some(v),
                        "Mems_allowed_list" => seen.mems_allowed = Some(v),
                        _ => {}
                    }
                }
            }
            "cgroup" => seen.cgroups.push(value.to_string()),
            "uid" => seen.uid = value.trim().parse().ok(),
            "runner" => seen.runner = value.trim().parse().ok(),
            "runner-log" => seen.runner_log.push(value.to_string()),
            "runner-gpus" => seen.runner_gpus = value.trim().parse().ok(),
            _ => {}
        }
    }
    seen
}

/// One verdict of the smoke job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// What was checked: `hooks`, `gpu`, `gpu-count`, `cpuset`, `affinity`, `cgroup`, `runner`,
    /// `clean-up`.
    pub name: &'static str,
    /// Whether it held.
    pub ok: bool,
    /// What was seen, and on failure what to look at.
    pub detail: String,
}

fn check(name: &'static str, ok: bool, detail: String) -> Check {
    Check { name, ok, detail }
}

/// The hooks' exit statuses and what was left after `pre-exit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookResults {
    /// `environment`'s exit status and the end of its stderr.
    pub environment: (i32, String),
    /// `command`'s, when it ran.
    pub command: Option<(i32, String)>,
    /// `pre-exit`'s.
    pub pre_exit: (i32, String),
    /// Whether the job's state file was still there after `pre-exit`.
    pub state_left: bool,
}

fn cpus_of(list: &str) -> Option<Vec<u32>> {
    parse_cpu_list(list.trim()).ok()
}

/// What the smoke job concludes about `slice`, from what its hooks and command did.
pub fn judge(
    plan: &Plan,
    slice: &Slice,
    mode: Mode,
    job_id: &str,
    hooks: &HookResults,
    seen: &Seen,
) -> Vec<Check> {
    let mut out = check_hooks(hooks);
    // Without its environment the job did not run: nothing else can be judged.
    if hooks.environment.0 != 0 {
        return out;
    }
    out.push(check_gpu(plan, slice, mode, seen));
    out.extend(check_gpu_count(slice, seen));
    let (want_cpus, want_mems) = job_cpus_and_mems(slice, seen);
    out.push(check_cpuset(slice, seen, &want_cpus));
    out.push(check_affinity(seen, &want_cpus, &want_mems));
    if mode == Mode::Host {
        out.push(check_cgroup(job_id, seen));
    }
    if let Some(code) = seen.runner {
        out.push(check_runner(code, seen));
    }
    out.push(check_clean_up(hooks));
    out
}

/// `hooks`: each hook that failed, or one verdict that all exited 0. Only `environment`'s
/// failure when it failed, since then the others did not run for real.
fn check_hooks(hooks: &HookResults) -> Vec<Check> {
    let mut out = Vec::new();
    let (env_code, env_err) = &hooks.environment;
    if *env_code != 0 {
        out.push(check(
            "hooks",
            false,
            format!("environment exited {env_code}: {}", env_err.trim()),
        ));
        return out;
    }
    match &hooks.command {
        Some((0, _)) => {}
        Some((code, err)) => out.push(check(
            "hooks",
            false,
            format!("command exited {code}: {}", err.trim()),
        )),
        None => out.push(check("hooks", false, "command did not run".into())),
    }
    if hooks.pre_exit.0 != 0 {
        out.push(check(
            "hooks",
            false,
            format!(
                "pre-exit exited {}: {}",
                hooks.pre_exit.0,
                hooks.pre_exit.1.trim()
            ),
        ));
    }
    if out.is_empty() {
        out.push(check(
            "hooks",
            true,
            "environment, command and pre-exit exited 0".into(),
        ));
    }
    out
}

/// The non-empty comma-separated items of the job's variable `name`.
fn env_items(seen: &Seen, name: &str) -> Vec<String> {
    seen.env
        .get(name)
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// `gpu`: the slice's GPUs, and no other, in the variables the job's CUDA/ROCm read.
fn check_gpu(plan: &Plan, slice: &Slice, mode: Mode, seen: &Seen) -> Check {
    let gpus = slice.gpus();
    if gpus.is_empty() {
        let visible: Vec<String> = ["CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"]
            .iter()
            .filter(|v| !env_items(seen, v).is_empty())
            .map(|v| format!("{v}={}", seen.env[*v]))
            .collect();
        return check(
            "gpu",
            visible.is_empty(),
            if visible.is_empty() {
                "a CPU-only slice: no GPU is visible".into()
            } else {
                format!("a CPU-only slice, yet the job sees {}", visible.join(" "))
            },
        );
    }
    let vendor = gpus[0].vendor;
    let name = match vendor {
        Vendor::Nvidia => "CUDA_VISIBLE_DEVICES",
        Vendor::Amd => "ROCR_VISIBLE_DEVICES",
    };
    let got = env_items(seen, name);
    // In docker mode the container numbers its devices from 0; UUIDs stay. An AMD job in
    // host mode is numbered from 0 in the sandbox's private /dev, in host order with the
    // sandbox off (kernelkite_sys::kfd): either is right for its /dev, and `gpu-count`
    // checks what the job can really use.
    let local: Vec<String> = gpus
        .iter()
        .enumerate()
        .map(|(i, g)| g.uuid.clone().unwrap_or_else(|| i.to_string()))
        .collect();
    let host: Vec<String> = gpus
        .iter()
        .zip(device_indices(plan, slice))
        .map(|(g, i)| g.uuid.clone().unwrap_or_else(|| i.to_string()))
        .collect();
    let wanted = match (mode, vendor) {
        (Mode::Docker, _) => local.clone(),
        (Mode::Host, Vendor::Nvidia) => host.clone(),
        (Mode::Host, Vendor::Amd) if got == local => local.clone(),
        (Mode::Host, Vendor::Amd) => host.clone(),
    };
    let ok = got == wanted;
    check(
        "gpu",
        ok,
        if ok {
            format!(
                "{name}={} ({} GPU(s): {})",
                got.join(","),
                got.len(),
                gpus.iter()
                    .map(|g| g.pci_bus_id.as_str())
                    .collect::<Vec<_>>()
                    .join(",")
            )
        } else {
            format!(
                "{name} is {:?}, not the slice's {}",
                seen.env.get(name).map(String::as_str).unwrap_or("<unset>"),
                wanted.join(",")
            )
        },
    )
}

/// `gpu-count`: how many GPUs the job can use, counted inside it the way CUDA and ROCm
/// enumerate them (the runner: NVML and CUDA_VISIBLE_DEVICES; AMD's KFD topology, the render
/// nodes the job's /dev holds, ROCR_VISIBLE_DEVICES then HIP_VISIBLE_DEVICES): variables that
/// name the right GPUs are not enough if the job cannot reach them. `None` when the runner
/// did not count.
fn check_gpu_count(slice: &Slice, seen: &Seen) -> Option<Check> {
    if seen.runner == Some(0) && seen.runner_gpus.is_none() {
        return Some(check(
            "gpu-count",
            false,
            "the runner evaluated the example but its result.json gave no system.device_count"
                .into(),
        ));
    }
    let n = seen.runner_gpus?;
    let want = slice.gpus().len() as u32;
    Some(check(
        "gpu-count",
        n == want,
        if n == want {
            format!("the runner in the job counts {n} GPU(s), as CUDA/ROCm enumerate them there")
        } else {
            format!("the runner in the job counts {n} GPU(s), the slice has {want}: the job cannot use the GPUs planned for it (its device nodes, and CUDA_VISIBLE_DEVICES or ROCR_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES)")
        },
    ))
}

/// The CPUs and memory nodes the job should have: those of the slice the hooks exported
/// (`KERNELKITE_SLICE`), else the plan's.
fn job_cpus_and_mems(slice: &Slice, seen: &Seen) -> (Vec<u32>, Vec<u32>) {
    let job_slice: Option<Slice> = seen
        .env
        .get("KERNELKITE_SLICE")
        .and_then(|s| serde_json::from_str(s).ok());
    let want_cpus = job_slice
        .as_ref()
        .map(|s| s.cpus.clone())
        .unwrap_or_else(|| slice.cpus.clone());
    let want_mems = job_slice
        .as_ref()
        .map(|s| s.mems.clone())
        .unwrap_or_else(|| slice.mems.clone());
    (want_cpus, want_mems)
}

/// `cpuset`: the job's slice, as the hooks exported it, against the plan.
fn check_cpuset(slice: &Slice, seen: &Seen, want_cpus: &[u32]) -> Check {
    let in_plan = want_cpus.iter().all(|c| slice.cpus.contains(c));
    let exported = seen.env.get("KERNELBOT_CPUSET").map(String::as_str);
    let cpuset_ok = in_plan && exported == Some(format_cpu_list(want_cpus).as_str());
    check(
        "cpuset",
        cpuset_ok,
        if cpuset_ok {
            format!(
                "KERNELBOT_CPUSET={} (the plan's slice {}: {})",
                format_cpu_list(want_cpus),
                slice.index,
                format_cpu_list(&slice.cpus)
            )
        } else {
            format!(
                "KERNELBOT_CPUSET is {:?}, the plan's slice {} has CPUs {}",
                exported.unwrap_or("<unset>"),
                slice.index,
                format_cpu_list(&slice.cpus)
            )
        },
    )
}

/// `affinity`: where the command really ran, its affinity and memory nodes.
fn check_affinity(seen: &Seen, want_cpus: &[u32], want_mems: &[u32]) -> Check {
    let cpus = seen.cpus_allowed.as_deref().and_then(cpus_of);
    let mems = seen.mems_allowed.as_deref().and_then(cpus_of);
    let affinity_ok = cpus.as_deref() == Some(want_cpus) && mems.as_deref() == Some(want_mems);
    check(
        "affinity",
        affinity_ok,
        if affinity_ok {
            format!(
                "the command ran on CPUs {} and memory node(s) {}",
                format_cpu_list(want_cpus),
                format_cpu_list(want_mems)
            )
        } else {
            format!(
                "the command could run on CPUs {} and memory node(s) {}, not the slice's {} and {} (is it in its cgroup? see `kernelkite-isolate doctor`)",
                seen.cpus_allowed.as_deref().unwrap_or("?"),
                seen.mems_allowed.as_deref().unwrap_or("?"),
                format_cpu_list(want_cpus),
                format_cpu_list(want_mems)
            )
        },
    )
}

/// `cgroup` (host mode): the command ran in its job's cgroup.
fn check_cgroup(job_id: &str, seen: &Seen) -> Check {
    let suffix = format!("/{}/{job_id}", kernelkite_hooks::cgroup::PARENT);
    let inside = seen.cgroups.iter().any(|l| l.trim_end().ends_with(&suffix));
    check(
        "cgroup",
        inside,
        if inside {
            format!("the command ran in its job cgroup (…{suffix})")
        } else {
            format!(
                "the command was not in …{suffix}: its /proc/self/cgroup says {}",
                seen.cgroups.join("; ")
            )
        },
    )
}

/// `runner`: the runner evaluated the example task (it exited `code`).
fn check_runner(code: i32, seen: &Seen) -> Check {
    check(
        "runner",
        code == 0,
        if code == 0 {
            "kernelkite-runner --example evaluated the example task".into()
        } else {
            format!(
                "kernelkite-runner --example exited {code} (3: a node problem such as no python3 or no GPU; see runner/README.md): {}",
                seen.runner_log.join(" | ")
            )
        },
    )
}

/// `clean-up`: pre-exit released the slice and removed the job's state.
fn check_clean_up(hooks: &HookResults) -> Check {
    check(
        "clean-up",
        !hooks.state_left && hooks.pre_exit.0 == 0,
        if hooks.state_left {
            "the job's state file is still there after pre-exit".into()
        } else {
            "pre-exit released the slice and removed the job's state".into()
        },
    )
}

/// Who the command ran as: never root (the sandbox runs it as the job user) unless the
/// configuration says `allow-root`.
pub fn judge_user(seen: &Seen, allow_root: bool) -> Check {
    match seen.uid {
        None => check("user", false, "the command did not say its uid".into()),
        Some(0) if allow_root => check(
            "user",
            true,
            "the command ran as root (allow-root: true in KERNELKITE_CONFIG)".into(),
        ),
        Some(0) => check(
            "user",
            false,
            "the command ran as root: the sandbox is off (KERNELKITE_SANDBOX=off in the agents' environment?) or `user` names root; submissions must never run as root".into(),
        ),
        Some(uid) => check("user", true, format!("the command ran as uid {uid}, not root")),
    }
}

/// What the smoke job is given.
#[derive(Debug, Clone)]
pub struct SmokeOptions {
    /// The agent's hooks-path (`environment`, `command`, `pre-exit`).
    pub hooks_dir: PathBuf,
    /// The agent's environment (from `agent.env`, and any overrides).
    pub env: BTreeMap<String, String>,
    /// Used in the agent's name.
    pub node: String,
    /// The runner command to try in each job (`kernelkite-runner`); `None` to skip it.
    pub runner: Option<String>,
    /// Only these slices; all when `None`.
    pub slices: Option<Vec<u32>>,
}

/// The smoke job of one slice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceReport {
    /// The slice.
    pub slice: u32,
    /// `GPU 0000:18:00.0, CPUs 1-13,113-125, 230.4 GiB`.
    pub about: String,
    /// The verdicts.
    pub checks: Vec<Check>,
}

impl SliceReport {
    /// Whether every check held.
    pub fn ok(&self) -> bool {
        self.checks.iter().all(|c| c.ok)
    }

    /// The report as printed.
    pub fn text(&self) -> String {
        let mut s = format!(
            "smoke job on slice {} ({}): {}\n",
            self.slice,
            self.about,
            if self.ok() { "ok" } else { "FAILED" }
        );
        for c in &self.checks {
            s.push_str(&format!(
                "  {:<4}  {:<9} {}\n",
                if c.ok { "ok" } else { "fail" },
                c.name,
                c.detail
            ));
        }
        s
    }
}

fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(8)..].join(" | ")
}

fn code(o: &Output) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    o.status
        .code()
        .or_else(|| o.status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// The plan the hooks use (`KERNELKITE_PLAN_FILE`).
fn plan_of(env: &BTreeMap<String, String>) -> Result<Plan, SetupError> {
    let path = env
        .get("KERNELKITE_PLAN_FILE")
        .filter(|p| !p.is_empty())
        .ok_or_else(|| {
            SetupError::Invalid(
                "the smoke job needs KERNELKITE_PLAN_FILE (setup writes it to agent.env); pass --env-file or --set KERNELKITE_PLAN_FILE=FILE".into(),
            )
        })?;
    let text = std::fs::read_to_string(path).map_err(|e| SetupError::io(Path::new(path), e))?;
    serde_json::from_str(&text).map_err(|e| {
        SetupError::Invalid(format!(
            "{path} is not a plan ({e}); write it with `kernelkite-isolate plan --json`"
        ))
    })
}

/// The agent-level configuration with a short lease wait: a slice a real job holds is
/// reported, not waited for for minutes.
fn smoke_config(env: &BTreeMap<String, String>) -> Result<(String, Mode, bool), SetupError> {
    let text = env
        .get("KERNELKITE_CONFIG")
        .map(String::as_str)
        .unwrap_or("");
    let parsed =
        parse_config(text).map_err(|e| SetupError::Invalid(format!("KERNELKITE_CONFIG: {e}")))?;
    let mut value: Value = if text.trim().is_empty() {
        Value::Object(Default::default())
    } else {
        serde_json::from_str(text)
            .map_err(|e| SetupError::Invalid(format!("KERNELKITE_CONFIG: {e}")))?
    };
    if let Some(map) = value.as_object_mut() {
        let wait = parsed.lease_wait_secs.min(LEASE_WAIT_SECS);
        map.insert("lease-wait".into(), Value::from(wait));
    }
    Ok((value.to_string(), parsed.mode, parsed.allow_root))
}

fn random_token() -> String {
    let mut buf = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut buf);
    }
    hex::encode(buf)
}

/// The variables the agent gives a job, for the smoke job `job_id` on `slice` (the Job API's
/// socket and token are added once it listens): the caller's `PATH`, `HOME`, `LANG` and
/// `TMPDIR`, then `opts.env`, then Buildkite's.
fn smoke_job_env(
    opts: &SmokeOptions,
    slice: &Slice,
    config: &str,
    job_id: &str,
    checkout: &Path,
) -> BTreeMap<String, String> {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for k in ["PATH", "HOME", "LANG", "TMPDIR"] {
        if let Ok(v) = std::env::var(k) {
            env.insert(k.to_string(), v);
        }
    }
    env.extend(opts.env.clone());
    env.insert("KERNELKITE_CONFIG".into(), config.into());
    let agent_name = format!("{}-smoke", opts.node);
    env.extend(
        JobEnv {
            job_id,
            build_id: job_id,
            build_number: 0,
            organization: "local",
            pipeline: "kernelkite-smoke",
            agent_name: &agent_name,
            tags: vec![("gpu-index", slice.index.to_string())],
            checkout,
            command: &command(opts.runner.as_deref()),
            artifact_paths: None,
            plugin: None,
        }
        .variables(),
    );
    env
}

/// Runs one smoke job on `slice` through the hooks in `opts.hooks_dir`.
// Long because one smoke job end to end: checkout, Job API, the three hooks in order, verdicts.
pub fn run_slice(
    opts: &SmokeOptions,
    plan: &Plan,
    slice: &Slice,
    config: &str,
    mode: Mode,
    allow_root: bool,
) -> Result<SliceReport, SetupError> {
    let job_id = format!("kernelkite-smoke-{}-{}", std::process::id(), slice.index);
    let dir = tempfile::Builder::new()
        .prefix("kernelkite-smoke.")
        .tempdir()
        .map_err(|e| SetupError::io(&std::env::temp_dir(), e))?;
    let checkout = dir.path().join("checkout");
    std::fs::create_dir(&checkout).map_err(|e| SetupError::io(&checkout, e))?;
    // The command runs as the unprivileged job user, which must reach its checkout.
    for (p, mode) in [(dir.path(), 0o755), (checkout.as_path(), 0o777)] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
            .map_err(|e| SetupError::io(p, e))?;
    }
    let token = random_token();
    let mut env = smoke_job_env(opts, slice, config, &job_id, &checkout);
    let api = JobApiServer::start(&dir.path().join("job-api.sock"), &token, env.clone())
        .map_err(|e| SetupError::io(&dir.path().join("job-api.sock"), e))?;
    env.insert(
        "BUILDKITE_AGENT_JOB_API_SOCKET".into(),
        api.socket().display().to_string(),
    );
    env.insert("BUILDKITE_AGENT_JOB_API_TOKEN".into(), token.clone());

    // The hooks run in the checkout: a relative hooks-path would no longer name them.
    let hooks_dir =
        std::path::absolute(&opts.hooks_dir).map_err(|e| SetupError::io(&opts.hooks_dir, e))?;
    let hook = |name: &str, env: &BTreeMap<String, String>| -> Result<Output, SetupError> {
        let path = hooks_dir.join(name);
        Command::new(&path)
            .env_clear()
            .envs(env)
            .current_dir(&checkout)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| SetupError::io(&path, e))
    };
    let environment = hook(ENVIRONMENT_HOOK, &env)?;
    let mut command_out = None;
    if environment.status.success() {
        // What the agent holds for the job reaches the later hooks, as it passes them (the
        // slice's variables reach the command from the job's state).
        let mut job_env = api.env();
        job_env.insert(
            "BUILDKITE_AGENT_JOB_API_SOCKET".into(),
            api.socket().display().to_string(),
        );
        job_env.insert("BUILDKITE_AGENT_JOB_API_TOKEN".into(), token.clone());
        env = job_env;
        command_out = Some(hook(COMMAND_HOOK, &env)?);
    }
    let pre_exit = hook(PRE_EXIT_HOOK, &env)?;
    let run_dir = env
        .get("KERNELKITE_RUN_DIR")
        .cloned()
        .unwrap_or_else(|| super::paths::RUN_DIR.to_string());
    let state_left = Path::new(&run_dir)
        .join("jobs")
        .join(format!("{job_id}.json"))
        .exists();
    let results = HookResults {
        environment: (code(&environment), tail(&environment.stderr)),
        command: command_out.as_ref().map(|o| (code(o), tail(&o.stderr))),
        pre_exit: (code(&pre_exit), tail(&pre_exit.stderr)),
        state_left,
    };
    let seen = command_out
        .as_ref()
        .map(|o| parse_seen(&String::from_utf8_lossy(&o.stdout)))
        .unwrap_or_default();
    Ok(SliceReport {
        slice: slice.index,
        about: slice_about(slice),
        checks: {
            let mut checks = judge(plan, slice, mode, &job_id, &results, &seen);
            if command_out.is_some() {
                // After the checks of where it ran, before the runner's and the clean-up.
                let at = checks
                    .iter()
                    .position(|c| c.name == "runner" || c.name == "clean-up")
                    .unwrap_or(checks.len());
                checks.insert(at, judge_user(&seen, allow_root));
            }
            checks
        },
    })
}

/// What a slice holds, for its report: its GPUs, CPUs and memory.
fn slice_about(slice: &Slice) -> String {
    let gpus: Vec<&str> = slice.gpus().iter().map(|g| g.pci_bus_id.as_str()).collect();
    format!(
        "{}, CPUs {}, {}",
        if gpus.is_empty() {
            "no GPU".to_string()
        } else {
            format!("GPU {}", gpus.join(","))
        },
        format_cpu_list(&slice.cpus),
        format_bytes(slice.memory_bytes)
    )
}

/// Runs the smoke job on every slice (or those asked for), one after the other.
pub fn run(opts: &SmokeOptions) -> Result<Vec<SliceReport>, SetupError> {
    for hook in super::paths::HOOKS {
        let p = opts.hooks_dir.join(hook);
        if !p.exists() {
            return Err(SetupError::Invalid(format!(
                "{} is missing: install the hooks with `kernelkite-isolate setup` (or pass --hooks-dir DIR)",
                p.display()
            )));
        }
    }
    let plan = plan_of(&opts.env)?;
    let (config, mode, allow_root) = smoke_config(&opts.env)?;
    let mut reports = Vec::new();
    for slice in &plan.slices {
        if opts
            .slices
            .as_ref()
            .is_some_and(|only| !only.contains(&slice.index))
        {
            continue;
        }
        reports.push(run_slice(opts, &plan, slice, &config, mode, allow_root)?);
    }
    if reports.is_empty() {
        return Err(SetupError::Invalid(
            "no slice of the plan matches --slice".into(),
        ));
    }
    Ok(reports)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernelkite_topology::plan::SliceGpu;

    fn gpu(bus: &str, uuid: Option<&str>) -> SliceGpu {
        SliceGpu {
            vendor: Vendor::Nvidia,
            pci_bus_id: bus.into(),
            uuid: uuid.map(str::to_string),
            numa_node: Some(0),
            mig: None,
        }
    }

    fn slice(index: u32, g: Option<SliceGpu>, cpus: &[u32]) -> Slice {
        Slice {
            index,
            gpu: g,
            extra_gpus: vec![],
            cpus: cpus.to_vec(),
            mems: vec![0],
            memory_bytes: 1 << 30,
        }
    }

    fn plan() -> Plan {
        Plan {
            slices: vec![
                slice(0, Some(gpu("0000:18:00.0", Some("GPU-a"))), &[1, 2]),
                slice(1, Some(gpu("0000:2a:00.0", None)), &[3, 4]),
            ],
            reserved_cpus: vec![0],
            warnings: vec![],
        }
    }

    fn ok_hooks() -> HookResults {
        HookResults {
            environment: (0, String::new()),
            command: Some((0, String::new())),
            pre_exit: (0, String::new()),
            state_left: false,
        }
    }

    fn seen_for(s: &Slice, job: &str, cuda: Option<&str>) -> Seen {
        let report = format!(
            "noise\n{MARK} env KERNELBOT_CPUSET={}\n{MARK} env KERNELKITE_SLICE={}\n{}{MARK} status Cpus_allowed_list:\t{}\n{MARK} status Mems_allowed_list:\t0\n{MARK} cgroup 0::/kernelkite/{job}\n{MARK} uid 997\n{MARK} runner 0\n{MARK} runner-gpus {}\n",
            format_cpu_list(&s.cpus),
            serde_json::to_string(s).unwrap(),
            cuda.map(|c| format!("{MARK} env CUDA_VISIBLE_DEVICES={c}\n"))
                .unwrap_or_default(),
            format_cpu_list(&s.cpus),
            s.gpus().len(),
        );
        parse_seen(&report)
    }

    fn failed(checks: &[Check]) -> Vec<&'static str> {
        checks.iter().filter(|c| !c.ok).map(|c| c.name).collect()
    }

    #[test]
    fn a_command_that_ran_as_root_fails_the_user_check() {
        let seen = |uid| Seen {
            uid,
            ..Seen::default()
        };
        assert!(judge_user(&seen(Some(997)), false).ok);
        let root = judge_user(&seen(Some(0)), false);
        assert!(!root.ok);
        assert!(
            root.detail.contains("KERNELKITE_SANDBOX=off"),
            "{}",
            root.detail
        );
        assert!(judge_user(&seen(Some(0)), true).ok);
        assert!(!judge_user(&seen(None), false).ok);
    }

    #[test]
    fn a_job_that_sees_its_slice_passes_every_check() {
        let p = plan();
        let s = &p.slices[0];
        let checks = judge(
            &p,
            s,
            Mode::Host,
            "j",
            &ok_hooks(),
            &seen_for(s, "j", Some("GPU-a")),
        );
        assert_eq!(failed(&checks), Vec::<&str>::new(), "{checks:?}");
        let names: Vec<_> = checks.iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            [
                "hooks",
                "gpu",
                "gpu-count",
                "cpuset",
                "affinity",
                "cgroup",
                "runner",
                "clean-up"
            ]
        );
        // What the runner counted in the job: none of its GPU, or nothing said.
        for runner_gpus in [Some(0), None] {
            let mut seen = seen_for(s, "j", Some("GPU-a"));
            seen.runner_gpus = runner_gpus;
            let c = judge(&p, s, Mode::Host, "j", &ok_hooks(), &seen);
            assert_eq!(failed(&c), ["gpu-count"], "{runner_gpus:?}: {c:?}");
        }
        // Without a UUID the host index stands in; slice 1 is device 1.
        let s = &p.slices[1];
        let checks = judge(
            &p,
            s,
            Mode::Host,
            "j",
            &ok_hooks(),
            &seen_for(s, "j", Some("1")),
        );
        assert_eq!(failed(&checks), Vec::<&str>::new(), "{checks:?}");
    }

    #[test]
    fn each_way_a_job_can_see_too_much_is_caught() {
        let p = plan();
        let s = &p.slices[0];
        // Every GPU, or another slice's.
        for cuda in [Some("GPU-a,1"), Some("1"), None] {
            let c = judge(&p, s, Mode::Host, "j", &ok_hooks(), &seen_for(s, "j", cuda));
            assert_eq!(failed(&c), ["gpu"], "{cuda:?}: {c:?}");
        }
        // The command ran on every CPU, outside its cgroup.
        let mut seen = seen_for(s, "j", Some("GPU-a"));
        seen.cpus_allowed = Some("0-7".into());
        seen.cgroups = vec!["0::/system.slice/agent.service".into()];
        let c = judge(&p, s, Mode::Host, "j", &ok_hooks(), &seen);
        assert_eq!(failed(&c), ["affinity", "cgroup"], "{c:?}");
        assert!(c[4].detail.contains("0-7") && c[4].detail.contains("not the slice's 1-2"));
        // The exported cpuset is another slice's.
        let mut seen = seen_for(s, "j", Some("GPU-a"));
        seen.env.insert("KERNELBOT_CPUSET".into(), "3-4".into());
        assert_eq!(
            failed(&judge(&p, s, Mode::Host, "j", &ok_hooks(), &seen)),
            ["cpuset"]
        );
        // A CPU-only slice that sees a GPU.
        let cpu = slice(0, None, &[1, 2]);
        let c = judge(
            &p,
            &cpu,
            Mode::Host,
            "j",
            &ok_hooks(),
            &seen_for(&cpu, "j", Some("0")),
        );
        assert_eq!(failed(&c), ["gpu"], "{c:?}");
        let c = judge(
            &p,
            &cpu,
            Mode::Host,
            "j",
            &ok_hooks(),
            &seen_for(&cpu, "j", None),
        );
        assert_eq!(failed(&c), Vec::<&str>::new(), "{c:?}");
        // The runner failed, and the state stayed.
        let mut seen = seen_for(s, "j", Some("GPU-a"));
        seen.runner = Some(3);
        seen.runner_log = vec!["no python3".into()];
        let mut hooks = ok_hooks();
        hooks.state_left = true;
        let c = judge(&p, s, Mode::Host, "j", &hooks, &seen);
        assert_eq!(failed(&c), ["runner", "clean-up"], "{c:?}");
        assert!(c
            .iter()
            .any(|c| c.detail.contains("exited 3") && c.detail.contains("no python3")));
    }

    #[test]
    fn a_failed_environment_hook_is_the_only_verdict_and_docker_numbers_from_zero() {
        let p = plan();
        let hooks = HookResults {
            environment: (1, "no GPU free after waiting 30s".into()),
            command: None,
            pre_exit: (0, String::new()),
            state_left: false,
        };
        let c = judge(&p, &p.slices[1], Mode::Host, "j", &hooks, &Seen::default());
        assert_eq!(c.len(), 1);
        assert!(!c[0].ok && c[0].detail.contains("environment exited 1: no GPU free"));
        // In a container the GPU is device 0, and there is no job cgroup to look for.
        let s = &p.slices[1];
        let mut seen = seen_for(s, "j", Some("0"));
        seen.cgroups = vec!["0::/".into()];
        let c = judge(&p, s, Mode::Docker, "j", &ok_hooks(), &seen);
        assert_eq!(failed(&c), Vec::<&str>::new(), "{c:?}");
        assert!(!c.iter().any(|c| c.name == "cgroup"));
    }

    #[test]
    fn env_files_parse_as_systemd_reads_what_setup_writes() {
        let env = parse_env_file(
            "# comment\n; also\n\nPATH=/opt/kernelkite/bin:/usr/bin\nKERNELKITE_CONFIG='{\"mode\":\"host\"}'\nA=\"x \\\"y\\\"\"\n",
        )
        .unwrap();
        assert_eq!(env["PATH"], "/opt/kernelkite/bin:/usr/bin");
        assert_eq!(env["KERNELKITE_CONFIG"], r#"{"mode":"host"}"#);
        assert_eq!(env["A"], r#"x "y""#);
        assert!(parse_env_file("no equals sign\n").is_err());
        assert!(parse_env_file("BAD-NAME=1\n").is_err());
    }

    #[test]
    fn the_smoke_config_keeps_the_agents_and_waits_briefly() {
        let env = BTreeMap::from([(
            "KERNELKITE_CONFIG".to_string(),
            r#"{"mode":"host","network":false}"#.to_string(),
        )]);
        let (c, mode, allow_root) = smoke_config(&env).unwrap();
        assert_eq!(mode, Mode::Host);
        assert!(!allow_root);
        let v: Value = serde_json::from_str(&c).unwrap();
        assert_eq!(v["network"], false);
        assert_eq!(v["lease-wait"], LEASE_WAIT_SECS);
        let (c, _, _) = smoke_config(&BTreeMap::new()).unwrap();
        assert_eq!(c, format!(r#"{{"lease-wait":{LEASE_WAIT_SECS}}}"#));
        let root = BTreeMap::from([(
            "KERNELKITE_CONFIG".to_string(),
            r#"{"user":"root","allow-root":true}"#.to_string(),
        )]);
        assert!(smoke_config(&root).unwrap().2);
        let bad = BTreeMap::from([("KERNELKITE_CONFIG".to_string(), r#"{"gpu":1}"#.to_string())]);
        assert!(smoke_config(&bad).is_err());
    }
}
