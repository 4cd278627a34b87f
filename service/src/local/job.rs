//! One job's run on its slice, as an agent runs it: the worker that takes jobs off the queue,
//! and the three hooks (`environment` → `command` → `pre-exit`) as separate processes with
//! the agent's variables, the command's process group stopped on cancel or after a restart.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use kernelkite_sys::node::{COMMAND_HOOK, ENVIRONMENT_HOOK, PRE_EXIT_HOOK};
use tokio::process::Command;
use tokio::sync::Notify;

use kernelkite_agent::job_env::JobEnv;

use super::hooks::{self, ProcessId};
use super::jobdir::{JobDir, JobFile};
use super::plan::PlannedSlice;
use super::{lock, LocalExecutor, Queued, Stage, STOP_GRACE, UNENFORCED};
use crate::executor::BuildEventKind;

impl LocalExecutor {
    /// One job on `slice`, from the queue to its `Finished` event.
    async fn run(self: &Arc<Self>, slice: &PlannedSlice, q: Queued, dequeued: DateTime<Utc>) {
        let (file, dir, attempt, cancel) = {
            let mut jobs = lock(&self.jobs);
            let Some(rec) = jobs.get_mut(&q.build_id) else {
                return;
            };
            if rec.canceled || rec.stage != Stage::Queued {
                return;
            }
            rec.stage = Stage::Running;
            rec.slice = Some(slice.index);
            rec.timings.dequeued = Some(dequeued);
            if let Some(started) = rec.started.take() {
                let _ = started.send(());
            }
            (
                rec.file.clone(),
                rec.dir.clone(),
                rec.attempt,
                rec.cancel.clone(),
            )
        };
        let build = file.build.clone();
        self.emit(BuildEventKind::Scheduled, &build, "scheduled");
        let (outcome, cleanup) = self.run_attempt(slice, &file, &dir, attempt, &cancel).await;
        let state = {
            let mut jobs = lock(&self.jobs);
            let Some(rec) = jobs.get_mut(&build.id) else {
                return;
            };
            rec.isolation = outcome.isolation.clone().or(rec.isolation.take());
            rec.exit_code = outcome.exit_code;
            rec.failure = outcome.failure.clone();
            if rec.timings.leased.is_none() {
                rec.timings.leased = outcome.leased;
            }
            rec.timings.command_done = outcome.command_done;
            if rec.canceled {
                "canceled"
            } else if outcome.exit_code == Some(0) {
                "passed"
            } else {
                "failed"
            }
        };
        // The result is final once the runner has exited: it is collected while `pre-exit`
        // cleans up, and the slice takes its next job only after that.
        self.emit(BuildEventKind::Finished, &build, state);
        if let Some(c) = cleanup {
            self.pre_exit(&c.env, &c.checkout, Some(&c.log)).await;
        }
        if let Some(rec) = lock(&self.jobs).get_mut(&build.id) {
            rec.stage = Stage::Finished;
            rec.timings.cleaned = Some(Utc::now());
        }
        self.spawn_cleanup(file.submission_id.clone(), build.id.clone());
    }

    // Over 80 lines: one attempt's hooks in the agent's order (log, environment hook, its exports,
    // command), each failure ending the attempt its own way; split, that order would be spread over
    // helpers.
    /// The `environment` and `command` hooks of one attempt, as the agent runs them; what
    /// `pre-exit` needs, once it has something to undo.
    async fn run_attempt(
        self: &Arc<Self>,
        slice: &PlannedSlice,
        file: &JobFile,
        dir: &JobDir,
        attempt: u32,
        cancel: &Notify,
    ) -> (AttemptOutcome, Option<PreExit>) {
        let mut out = AttemptOutcome::default();
        let checkout = dir.attempt(attempt);
        if let Err(e) = std::fs::create_dir_all(checkout.join("work")) {
            out.failure = Some(format!(
                "cannot create the job directory {}: {e}",
                checkout.display()
            ));
            return (out, None);
        }
        // The log is opened here, by the service, in its own directory; the hooks and the
        // command get the descriptor, never a path.
        let log = match dir.open_log(attempt) {
            Ok(f) => f,
            Err(e) => {
                out.failure = Some(format!(
                    "cannot open the job log {}: {e}",
                    dir.log(attempt).display()
                ));
                return (out, None);
            }
        };
        // `BUILDKITE_JOB_ID`: unique per attempt, and a valid cgroup name.
        let job_id = format!("{}-{attempt}", file.build.id);
        let (command, build_env) = self.command_for(file, dir, attempt);
        let agent_name = self.agent_name(slice);
        // As an agent of the local pipeline bound to the slice (the tag the hooks lease by)
        // runs the step.
        let job = JobEnv {
            job_id: &job_id,
            build_id: &file.build.id,
            build_number: file.build.number,
            organization: hooks::ORGANIZATION,
            pipeline: hooks::PIPELINE,
            agent_name: &agent_name,
            tags: vec![
                ("gpu-index", slice.index.to_string()),
                ("queue", file.queue.clone()),
            ],
            checkout: &checkout,
            command: &command,
            artifact_paths: Some(hooks::ARTIFACT_PATHS),
            plugin: Some(hooks::plugin_step(&self.settings.plugin_config)),
        };
        let mut env = hooks::hook_env(std::env::vars(), &build_env, &job);
        let sandbox = if self.settings.sandbox.on {
            "on"
        } else {
            "off"
        };
        env.insert("KERNELKITE_SANDBOX".into(), sandbox.into());
        if self.settings.sandbox.on {
            // Wherever the clone is (under /var/tmp, which the sandbox replaces, or /root,
            // which the job user may not enter), the job reaches the runner it runs.
            env.insert(
                "KERNELKITE_JOB_TOOLS".into(),
                self.settings.bins.runner.display().to_string(),
            );
        }

        // environment: lease, cgroup, exports.
        let environment = self
            .hook(ENVIRONMENT_HOOK)
            .args(["--export", "shell"])
            .envs(&env)
            .current_dir(&checkout)
            .stdin(std::process::Stdio::null())
            .output()
            .await;
        let environment = match environment {
            Ok(o) => o,
            Err(e) => {
                out.failure = Some(format!(
                    "cannot run {} environment: {e}",
                    self.settings.bins.isolate.display()
                ));
                return (out, None);
            }
        };
        let env_log = String::from_utf8_lossy(&environment.stderr).into_owned();
        append_log(&log, ENVIRONMENT_HOOK, &env_log);
        let cleanup = PreExit {
            env: env.clone(),
            checkout: checkout.clone(),
            log,
        };
        out.isolation = isolation_of(&env_log);
        if out.isolation.as_deref() == Some(UNENFORCED) {
            // Loud once; then one line per job, which the job's log also has.
            if !self
                .warned_unenforced
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                tracing::warn!(job = file.build.number, "jobs run UNENFORCED: no CPU, memory or pids limits, because cgroups cannot be used here (`kernelkite-isolate doctor` says why; run as root or delegate the kernelkite cgroup, or pass --enforce to refuse such jobs)");
            } else {
                tracing::info!(job = file.build.number, "job runs UNENFORCED");
            }
        }
        let exports = if environment.status.success() {
            hooks::parse_exports(&String::from_utf8_lossy(&environment.stdout))
                .map_err(|e| format!("the environment hook's exports cannot be read: {e}"))
        } else {
            Err(format!(
                "the environment hook failed ({}): {}",
                environment.status,
                env_log.trim()
            ))
        };
        let exports = match exports {
            Ok(e) => e,
            Err(why) => {
                out.failure = Some(why);
                return (out, Some(cleanup));
            }
        };
        out.leased = Some(Utc::now());
        let canceled = match lock(&self.jobs).get_mut(&file.build.id) {
            Some(rec) => {
                rec.timings.leased = out.leased;
                rec.isolation = out.isolation.clone();
                rec.canceled
            }
            None => true,
        };
        if canceled {
            out.failure = Some("canceled before its command started".into());
            return (out, Some(cleanup));
        }
        self.emit(BuildEventKind::Running, &file.build, "running");

        // command: the runner, confined.
        let status = self
            .run_command(
                &env,
                &exports,
                &checkout,
                &cleanup.log,
                dir,
                attempt,
                cancel,
            )
            .await;
        out.command_done = Some(Utc::now());
        match status {
            Ok(code) => out.exit_code = Some(code),
            Err(why) => out.failure = Some(why),
        }
        (out, Some(cleanup))
    }

    /// `BUILDKITE_COMMAND` and the build's env for an attempt: the runner writing the
    /// attempt's `result.json`, the payload in the env as a Buildkite build carries it
    /// (`KERNELBOT_PAYLOAD`, or the chunked carrier past 120 KiB), so the job meets the same
    /// limits as on a node. Nothing of the payload is written where the job could read it.
    fn command_for(
        &self,
        file: &JobFile,
        dir: &JobDir,
        attempt: u32,
    ) -> (String, Vec<(String, String)>) {
        let checkout = dir.attempt(attempt);
        let command = format!(
            "{} --output {} --workdir {}",
            hooks::shell_quote(&self.settings.bins.runner.display().to_string()),
            hooks::shell_quote(&checkout.join("result.json").display().to_string()),
            hooks::shell_quote(&checkout.join("work").display().to_string()),
        );
        let mut env = kernelkite_kernelbot::payload::to_env(&file.payload);
        env.push(("KERNELBOT_RUN_ID".into(), file.run_id.clone()));
        env.push(("KERNELBOT_QUEUE".into(), file.queue.clone()));
        env.push((
            kernelkite_sys::node::SUBMISSION_ID_ENV.into(),
            file.submission_id.clone(),
        ));
        (command, env)
    }

    fn hook(&self, name: &str) -> Command {
        let mut c = Command::new(&self.settings.bins.isolate);
        c.arg(name).args(self.node_args()).env_clear();
        c
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_command(
        &self,
        env: &BTreeMap<String, String>,
        exports: &BTreeMap<String, String>,
        checkout: &Path,
        log: &std::fs::File,
        dir: &JobDir,
        attempt: u32,
        cancel: &Notify,
    ) -> Result<i32, String> {
        let clone = || {
            log.try_clone()
                .map_err(|e| format!("cannot hand the job log to the command hook: {e}"))
        };
        let (log, log_err) = (clone()?, clone()?);
        let mut child = self
            .hook(COMMAND_HOOK)
            .envs(env)
            .envs(exports)
            .current_dir(checkout)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log_err)
            // Its own process group: a cancel (or a restarted service) stops the runner with
            // it, and the runner stops the harness's group on SIGTERM.
            .process_group(0)
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot run {} command: {e}",
                    self.settings.bins.isolate.display()
                )
            })?;
        let me = child.id().and_then(|pid| {
            Some(ProcessId {
                pid,
                start_time: hooks::start_time(pid)?,
            })
        });
        if let Some(p) = me {
            if let Err(e) = dir.write_process(attempt, p) {
                // Only a restart needs the record; without it a restarted service leaves the
                // hook to `pre-exit`, which kills what is in the job's cgroup.
                tracing::warn!(error = %e, pid = p.pid, "cannot record the command hook's process");
            }
        }
        let status = tokio::select! {
            s = child.wait() => s,
            _ = cancel.notified() => stop_child(&mut child, me).await,
        };
        let status = status.map_err(|e| format!("waiting for the command hook failed: {e}"))?;
        use std::os::unix::process::ExitStatusExt;
        Ok(status
            .code()
            .or_else(|| status.signal().map(|s| 128 + s))
            .unwrap_or(1))
    }

    async fn pre_exit(
        &self,
        env: &BTreeMap<String, String>,
        checkout: &Path,
        log: Option<&std::fs::File>,
    ) {
        let out = self
            .hook(PRE_EXIT_HOOK)
            .envs(env)
            .current_dir(checkout)
            .stdin(std::process::Stdio::null())
            .output()
            .await;
        match out {
            Ok(o) => {
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                );
                if let Some(log) = log {
                    append_log(log, PRE_EXIT_HOOK, &text);
                }
                if !o.status.success() {
                    tracing::warn!(report = %text.trim(), "pre-exit could not clean up everything");
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot run the pre-exit hook"),
        }
    }

    /// Stops what attempt `n` of a job left running (its command hook's process group, then
    /// `pre-exit`, which kills what is left in its cgroup and releases its slice).
    pub(super) async fn stop_attempt(&self, dir: &JobDir, file: &JobFile, n: u32) {
        // Only a group whose leader is still the recorded hook is signalled (while a group
        // exists its number is not given to another process, so the group stays the hook's
        // until it is empty). A group that outlived its leader is left to `pre-exit`, which
        // kills what is in the job's cgroup: by pid alone it cannot be told from a later group
        // that took the number over.
        match dir.read_process(n) {
            Ok(Some(rec)) => match hooks::verify_hook(rec.pid, rec.start_time, &rec.boot_id) {
                Ok(p) => stop_group(p.pid, || hooks::is_alive(p)).await,
                Err(hooks::NotTheHook::Gone(_)) => {}
                Err(why) => tracing::warn!(
                    job = file.build.number,
                    attempt = n,
                    "not signalling the recorded command hook: {why}"
                ),
            },
            Ok(None) => {}
            Err(e) => tracing::warn!(
                job = file.build.number,
                attempt = n,
                error = %e,
                "the command hook's record cannot be read; its job is left to pre-exit"
            ),
        }
        let mut env = std::collections::BTreeMap::new();
        env.insert(
            "BUILDKITE_JOB_ID".to_string(),
            format!("{}-{n}", file.build.id),
        );
        if let Ok(path) = std::env::var("PATH") {
            env.insert("PATH".into(), path);
        }
        let checkout = dir.attempt(n);
        let cwd = if checkout.is_dir() {
            checkout.clone()
        } else {
            self.settings.local_dir.clone()
        };
        let log = dir.open_log(n).ok();
        self.pre_exit(&env, &cwd, log.as_ref()).await;
    }
}

/// Stops a command hook this process started (SIGTERM to its group, SIGKILL after the
/// grace), and waits until nothing of its group is left: the runner stops its harness and
/// writes its result after the hook itself has gone.
async fn stop_child(
    child: &mut tokio::process::Child,
    me: Option<ProcessId>,
) -> std::io::Result<std::process::ExitStatus> {
    let Some(p) = me else {
        let _ = child.start_kill();
        return child.wait().await;
    };
    let mut status = None;
    stop_group(p.pid, || {
        if status.is_none() {
            status = child.try_wait().ok().flatten();
        }
        status.is_none()
    })
    .await;
    match status {
        Some(s) => Ok(s),
        None => child.wait().await,
    }
}

/// SIGTERM to group `pgid`, then waits until the group is empty and `leader_alive` says no;
/// SIGKILL once [`STOP_GRACE`] has passed, and gives up a second later (a member stuck in the
/// kernel cannot be helped here; `pre-exit` reports what it finds).
async fn stop_group(pgid: u32, mut leader_alive: impl FnMut() -> bool) {
    use rustix::process::Signal;
    hooks::signal_group(pgid, Signal::TERM);
    let start = tokio::time::Instant::now();
    let mut killed = false;
    loop {
        let alive = leader_alive();
        if !alive && !hooks::group_running(pgid) {
            return;
        }
        let waited = start.elapsed();
        if !killed && waited >= STOP_GRACE {
            hooks::signal_group(pgid, Signal::KILL);
            killed = true;
        }
        if waited >= STOP_GRACE + Duration::from_secs(1) {
            tracing::warn!(pgid, "processes of a stopped job are still there");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How the hooks confined the job, from the `environment` hook's log.
fn isolation_of(log: &str) -> Option<String> {
    if log.contains("RUNNING UNENFORCED") {
        return Some(UNENFORCED.into());
    }
    log.lines()
        .find_map(|l| l.split(", cgroup ").nth(1))
        .map(|v| format!("cgroup {}", v.trim()))
}

fn append_log(mut log: &std::fs::File, hook: &str, text: &str) {
    use std::io::Write;
    let _ = writeln!(log, "--- {hook}");
    let _ = log.write_all(text.as_bytes());
}

/// What `pre-exit` runs with: the hooks' environment, where they ran, the job's log.
struct PreExit {
    env: BTreeMap<String, String>,
    checkout: std::path::PathBuf,
    log: std::fs::File,
}

#[derive(Debug, Default)]
struct AttemptOutcome {
    exit_code: Option<i32>,
    failure: Option<String>,
    isolation: Option<String>,
    leased: Option<DateTime<Utc>>,
    command_done: Option<DateTime<Utc>>,
}

/// One slice's worker: takes jobs off the queue in order, one at a time. It holds the executor
/// only while it runs a job, so dropping the service ends it.
pub(super) async fn worker(me: Weak<LocalExecutor>, wake: Arc<Notify>, slice: PlannedSlice) {
    loop {
        let Some((this, (q, at))) = next_job(&me, &wake, &slice).await else {
            return;
        };
        this.run(&slice, q, at).await;
    }
}

/// Waits for the next job, registered for a wake-up only while idle. `notify_one` wakes the
/// oldest registered waiter: a worker still registered while it ran a job took the wake-up
/// meant for an idle one, and a free slice sat idle while a job waited (issue 34). The
/// registration is dropped before the job runs; a wake-up it had already taken passes on
/// to the next waiter when it is dropped (tokio's `Notified`).
async fn next_job(
    me: &Weak<LocalExecutor>,
    wake: &Notify,
    slice: &PlannedSlice,
) -> Option<(Arc<LocalExecutor>, (Queued, DateTime<Utc>))> {
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        // Registered before the queue is read, so a job queued in between is not missed.
        notified.as_mut().enable();
        let this = me.upgrade()?;
        if let Some(job) = this.pop(slice) {
            return Some((this, job));
        }
        drop(this);
        // A job this slice may not take now (a ranked one, while it is quarantined) waits for
        // its release, which no enqueue announces: looked at again every second.
        let _ = tokio::time::timeout(RELOOK, notified).await;
    }
}

/// How often an idle worker looks at the queue again without being woken.
const RELOOK: std::time::Duration = std::time::Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::UNENFORCED;

    #[test]
    fn how_a_job_was_confined_comes_from_the_hooks_words() {
        let v1 =
            "kernelkite: job j holds GPU(s) [0]: CPUs 1, memory nodes 0, 42 bytes, cgroup v1\n";
        assert_eq!(isolation_of(v1).as_deref(), Some("cgroup v1"));
        let none = "kernelkite: WARNING: RUNNING UNENFORCED (allow-unenforced: true): no CPU, memory or pids limits\nkernelkite: job j holds GPU(s) [0]: CPUs 1, memory nodes 0, 42 bytes\n";
        assert_eq!(isolation_of(none).as_deref(), Some(UNENFORCED));
        assert_eq!(isolation_of(""), None);
    }
}
