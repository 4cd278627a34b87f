//! Benchmark: a trivial submission end to end through real Buildkite agents, against local
//! mode (the service's own emulation of an agent running the same hooks) in the same run.
//!
//! Through real agents (`kernelkite_testkit::deployment`: the service's Buildkite executor, the
//! fake Buildkite, the pipeline agent's `pipeline upload`, a node `setup` made with one real
//! `buildkite-agent start` per slice, real cgroups), per submission:
//! - **end to end**: `POST /v1/submissions` → the client holds the result (long-poll);
//! - build created → client: what Buildkite's side and the agents add;
//! - the waits for an agent to ping for a job (the pipeline agent for the routing step, a
//!   node's agent for the uploaded one: every second here, as the fake tells agents to), and
//!   the pipeline agent's upload job (assigned → finished);
//! - the node agent's own time for the evaluation job (accepted → finished), and within it the
//!   hooks (`environment`, `command` less the runner's evaluation, `pre-exit`, both levels),
//!   the checkout and the artifact upload, from the job log's section timestamps;
//! - finished → client (webhook, artifact fetch, check, store, wake).
//!
//! Then what kernelkite's hooks add to a job under the real agent, against the floor the issue
//! names (36, item 8): the same agents and step, interleaved, in four forms:
//! - **bare**: no hooks at all, no plugin; the agent runs the command itself;
//! - **floor**: an empty hook (`#!/bin/true`, executed as kernelkite's are) at every level
//!   kernelkite has one that runs for the job (the agent's `pre-bootstrap`, `environment` and
//!   `pre-exit`; the plugin's `environment` and `pre-exit`); the agent runs the command;
//! - **floor with a command hook**: the same, and at the plugin's `command` level, where
//!   kernelkite's hook runs the command in place of the agent, the least such a hook can be:
//!   executed, it runs the command with the step's shell and nothing else
//!   (`#!/usr/bin/env -S /bin/bash -e -c ${BUILDKITE_COMMAND}`), so the agent's cost of running
//!   a hook at that level is in the floor too;
//! - **kernelkite**: setup's hooks and the plugin (lease, cgroup, sandbox with its PID
//!   namespace and seccomp, clean-up).
//!
//! Each job's command is a script of the repository, `echo kk-command-start && kernelkite-runner
//! ... && echo kk-command-end`; the agent's timestamps of those lines split the job into before the
//! command (accepted → start), the command, and after it (end → finished), and each section of
//! the log is timed. kernelkite's cost is what it adds over bare beside what the floor adds,
//! paired by round, two ways: the hooks' own sections (the hooks, the plugin's preparation, the
//! command phase up to the command, what follows the command), and the whole job less its
//! command (which also carries the checkout's and the agent's noise).
//! `KERNELKITE_BENCH_VERBOSE=1` prints the last job of each form, line by line.
//!
//! The node gets what `setup` installs: the static `kernelkite-isolate` where there is one
//! (`KERNELKITE_STATIC_ISOLATE`, else `target/node`), and, as its mount unit does at boot,
//! the `favordynmods` cgroup hierarchy (cgroup v1).
//!
//! Local mode, same machine, same task: end to end, and its executor's overhead (all but the
//! evaluation).
//!
//! `cargo bench -p kernelkite-testkit --bench real_agent` (`KERNELKITE_BENCH_SHORT=1`: three
//! submissions each, and three rounds of the four forms; else 20). Needs what `tests/tests/real_agent_node.rs` needs (root, writable
//! cgroups, the agent built by `scripts/buildkite-agent.sh`); says so and exits otherwise.

use std::time::{Duration, Instant, SystemTime};

use kernelkite_admin::setup::paths::{HOOKS, HOOKS_DIR};
use kernelkite_admin::setup::render::PRE_BOOTSTRAP_HOOK;
use kernelkite_sys::node::{ENVIRONMENT_HOOK, PRE_EXIT_HOOK};
use kernelkite_testkit::agent_node::{self, PLUGIN_TAG};
use kernelkite_testkit::deployment::{deployment, Deployment};
use kernelkite_testkit::fake_buildkite::agent_api::AgentJob;
use kernelkite_testkit::fake_buildkite::Route;
use kernelkite_testkit::local::{local_stack, probe_config, Confinement};
use kernelkite_testkit::local_bins;
use serde_json::{json, Value};

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The `p` quantile of `v` (nearest rank); NaN when `v` is empty.
fn quantile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n => v[((n - 1) as f64 * p).round() as usize],
    }
}

fn row(name: &str, v: Vec<f64>) {
    if v.is_empty() {
        println!("  {name:<46} (no figures)");
        return;
    }
    println!(
        "  {name:<46} median {:>8.1} ms   p95 {:>8.1} ms   mean {:>8.1} ms",
        quantile(&v, 0.5),
        quantile(&v, 0.95),
        v.iter().sum::<f64>() / v.len() as f64
    );
}

/// A log line's time (unix ms) and text, from the agent's ANSI timestamp before it
/// (`ESC _bk;t=<unix ms> BEL`); `None` for a line without one.
fn stamped(line: &str) -> Option<(u64, &str)> {
    let rest = line.split("_bk;t=").nth(1)?;
    let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    let t = rest[..digits].parse().ok()?;
    Some((t, rest[digits..].trim_start_matches('\u{7}')))
}

/// The log's sections: (header, start ms) in order, from the bootstrap's `~~~ ` headers; the
/// last line's time closes the last section.
fn sections(log: &str) -> (Vec<(String, u64)>, u64) {
    let mut out = Vec::new();
    let mut last = 0;
    for (t, text) in log.lines().filter_map(stamped) {
        last = t;
        if let Some(h) = text.strip_prefix("~~~ ") {
            out.push((h.to_string(), t));
        }
    }
    (out, last)
}

/// Milliseconds of the sections whose header satisfies `pick`.
fn spent(log: &str, pick: &dyn Fn(&str) -> bool) -> f64 {
    let (s, end) = sections(log);
    let mut total = 0;
    for (i, (h, t)) in s.iter().enumerate() {
        let next = s.get(i + 1).map_or(end, |n| n.1);
        if pick(h) {
            total += next.saturating_sub(*t);
        }
    }
    total as f64
}

fn between(a: Option<Instant>, b: Option<Instant>) -> f64 {
    match (a, b) {
        (Some(a), Some(b)) => ms(b.saturating_duration_since(a)),
        _ => f64::NAN,
    }
}

#[derive(Default)]
struct Figures {
    end_to_end: Vec<f64>,
    created_to_client: Vec<f64>,
    wait_for_pipeline_agent: Vec<f64>,
    upload_job: Vec<f64>,
    wait_for_node_agent: Vec<f64>,
    agent_job: Vec<f64>,
    hooks: Vec<f64>,
    checkout: Vec<f64>,
    artifacts: Vec<f64>,
    agent_rest: Vec<f64>,
    finished_to_client: Vec<f64>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() {
    let short = std::env::var_os("KERNELKITE_BENCH_SHORT").is_some();
    let n = if short { 3 } else { 20 };
    let bins = local_bins!();
    // What setup installs on a node: the static build where there is one.
    let (isolate, build) = match kernelkite_testkit::static_isolate() {
        Some(p) => (p, "the static build"),
        None => (
            bins.isolate.clone(),
            "the dynamic build (no static one: scripts/node-binaries.sh target/node)",
        ),
    };
    println!("real_agent: the node's kernelkite-isolate is {build}");
    let Some(d) = deployment(&isolate, &bins.runner).await else {
        println!("real_agent: skipped (see the line above)");
        return;
    };
    // What the node's mount units mount at boot (favordynmods): the timings of a node setup
    // made. Here only, not in every test's node: the kernel keeps the mode for good once a
    // hierarchy carrying it has been mounted (seen on Linux 6.18), and a test must leave the
    // machine as it found it.
    d.node.mount_units();
    let trivial = probe_config("test", json!([{}]));
    println!("real_agent: {n} trivial submissions one after another (one test case, no work)");

    // Warm-up: the first job clones the plugin and the repository on each agent.
    for _ in 0..2 {
        let id = d.submit(trivial.clone(), "h100").await;
        assert_eq!(
            d.wait(&id, Duration::from_secs(120)).await["state"],
            "succeeded"
        );
    }
    let mut f = Figures::default();
    for _ in 0..n {
        let t0 = Instant::now();
        let id = d.submit(trivial.clone(), "h100").await;
        let v = d.wait(&id, Duration::from_secs(120)).await;
        let client = Instant::now();
        assert_eq!(v["state"], "succeeded", "{v}\n{}", d.logs());
        f.end_to_end.push(ms(client - t0));
        let (number, eval) = d.eval_jobs(&id).await;
        let jobs = d.stack.fake.jobs_of(number);
        let upload: &AgentJob = jobs
            .iter()
            .find(|j| !j.step.label.contains("kernelbot"))
            .unwrap();
        let eval = &eval[0];
        let created = d
            .stack
            .fake
            .requests()
            .iter()
            .rev()
            .find(|r| r.route == Route::CreateBuild && r.build == Some(number))
            .map(|r| r.at);
        f.created_to_client.push(between(created, Some(client)));
        f.wait_for_pipeline_agent
            .push(between(created, upload.times.assigned));
        f.upload_job
            .push(between(upload.times.assigned, upload.times.finished));
        f.wait_for_node_agent
            .push(between(upload.times.finished, eval.times.assigned));
        let job = between(eval.times.accepted, eval.times.finished);
        f.agent_job.push(job);
        let log = eval.log();
        let evaluation = v["result"]["runs"]["test"]["run"]["duration"]
            .as_f64()
            .unwrap_or(0.0)
            * 1e3;
        let hooks = spent(&log, &|h| h.contains(" hook")) - evaluation;
        let checkout = spent(&log, &|h| h.starts_with("Preparing working directory"));
        let artifacts = spent(&log, &|h| h.starts_with("Uploading artifacts"));
        f.hooks.push(hooks);
        f.checkout.push(checkout);
        f.artifacts.push(artifacts);
        f.agent_rest
            .push(job - hooks - evaluation - checkout - artifacts);
        f.finished_to_client
            .push(between(eval.times.finished, Some(client)));
    }
    println!("through real agents (buildkite-agent v3.137.0, pipeline upload, real cgroups):");
    row("END TO END (POST -> client holds result)", f.end_to_end);
    row("build created -> client", f.created_to_client);
    row(
        "created -> pipeline agent takes its job",
        f.wait_for_pipeline_agent,
    );
    row("pipeline agent: upload job", f.upload_job);
    row(
        "upload done -> node agent takes the step",
        f.wait_for_node_agent,
    );
    row("node agent: evaluation job (accept->finish)", f.agent_job);
    row("  of which hooks (all but the evaluation)", f.hooks);
    row("  of which checkout", f.checkout);
    row("  of which artifact upload", f.artifacts);
    row("  of which the agent's own (the rest)", f.agent_rest);
    row(
        "job finished -> client (webhook, fetch)",
        f.finished_to_client,
    );
    hooks_against_their_floor(&d, n).await;
    drop(d);

    // The same task through local mode: the service's own agent emulation, same hooks.
    let stack = local_stack(&bins, None, Confinement::Real).await;
    let mut local = Vec::new();
    let mut overhead = Vec::new();
    for i in 0..n + 2 {
        let t0 = Instant::now();
        let id = stack.submit(trivial.clone()).await;
        let v: Value = stack.wait(&id).await;
        let took = ms(t0.elapsed());
        assert_eq!(v["state"], "succeeded", "{v}");
        if i >= 2 {
            local.push(took);
            if let Some(r) = stack.local.report(&id) {
                overhead.push(ms(r.timings.phases().overhead()));
            }
        }
    }
    println!("through local mode (the emulated agent: the same hooks run by the service):");
    row("END TO END (POST -> client holds result)", local);
    if !overhead.is_empty() {
        row("executor overhead (all but the evaluation)", overhead);
    }
}

/// The four forms of the job the floor comparison runs (the module's doc).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Form {
    Bare,
    Floor,
    FloorWithCommand,
    Kernelkite,
}

const FORMS: [Form; 4] = [
    Form::Bare,
    Form::Floor,
    Form::FloorWithCommand,
    Form::Kernelkite,
];

/// The plugin version whose hooks are empty (no `command`: the agent runs the command); a
/// version setup's agents allow (`allowed-plugins`).
const FLOOR_TAG: &str = "v0.0.0-floor";

/// The floor's plugin with a `command` hook that only runs the command (a tag `allowed-plugins`
/// lets through: no second `-`).
const FLOOR_COMMAND_TAG: &str = "v0.0.0-floor.command";

/// The least a `command` hook can be: executed (its `#!` line names `env`, then no shell, so
/// the agent does not wrap it: `shellscript.IsPOSIXShell` in the agent's source), it runs the
/// step's command with bash as the agent's default shell would, and nothing else. GNU `env -S`
/// splits the line and expands the variable; the hook's path follows as bash's `$0`.
const RUN_ONLY_COMMAND_HOOK: &str = "#!/usr/bin/env -S /bin/bash -e -c ${BUILDKITE_COMMAND}\n# runs the command and nothing else: the floor of the real-agent benchmark\n";

/// An empty hook the agent executes (not a shell: no wrapper), as it executes kernelkite's.
const EMPTY_HOOK: &str = "#!/bin/true\n# an empty hook: the floor of the real-agent benchmark\n";

/// The command every form runs: a script in the repository (setup's agents run with
/// `no-command-eval`, so the agent itself runs only a script of the checkout), marked where it
/// starts and ends.
const MARKED_COMMAND: &str = "./kk-command.sh";
const MARKED_SCRIPT: &str = "#!/bin/sh\necho kk-command-start && kernelkite-runner --output result.json && echo kk-command-end\n";

/// The deployment's pipeline (`host.yml`) as `form` runs it. Panics when `host.yml` no longer
/// has what this rewrites, so the benchmark never measures a pipeline it did not mean to.
fn pipeline_for(host: &str, form: Form) -> String {
    let command = "    command: kernelkite-runner --output result.json\n";
    assert!(host.contains(command), "host.yml's command changed");
    let text = host.replace(command, &format!("    command: {MARKED_COMMAND}\n"));
    match form {
        Form::Kernelkite => text,
        Form::Floor | Form::FloorWithCommand => {
            let plugin = format!("/plugin#{PLUGIN_TAG}:");
            assert!(text.contains(&plugin), "host.yml's plugin changed");
            let tag = match form {
                Form::Floor => FLOOR_TAG,
                _ => FLOOR_COMMAND_TAG,
            };
            text.replace(&plugin, &format!("/plugin#{tag}:"))
        }
        Form::Bare => {
            let start = text.find("    plugins:\n").expect("host.yml has plugins");
            let end = start + text[start..].find("    env:\n").expect("env after plugins");
            format!("{}{}", &text[..start], &text[end..])
        }
    }
}

/// The node's agent-level hooks set for `form`: setup's (moved aside for the others, into a
/// directory the agent does not read), none, or empty ones at the levels that run.
fn agent_hooks_for(d: &Deployment, form: Form) {
    let dir = HOOKS_DIR;
    let aside = format!("{HOOKS_DIR}-set-aside");
    let all = format!("{PRE_BOOTSTRAP_HOOK} {}", HOOKS.join(" "));
    let mut script = format!(
        "mkdir -p {aside}\nfor h in {all}; do\n  \
         if [ -e {aside}/$h ] || [ -L {aside}/$h ]; then rm -f {dir}/$h; mv {aside}/$h {dir}/$h; fi\ndone\n"
    );
    if form != Form::Kernelkite {
        script.push_str(&format!(
            "for h in {all}; do mv {dir}/$h {aside}/$h; done\n"
        ));
    }
    if matches!(form, Form::Floor | Form::FloorWithCommand) {
        // No agent-level `command`: the floor plugin's, or the agent, runs the command.
        for h in [PRE_BOOTSTRAP_HOOK, ENVIRONMENT_HOOK, PRE_EXIT_HOOK] {
            script.push_str(&format!(
                "printf '%s' '{EMPTY_HOOK}' > {dir}/{h}\nchmod 0755 {dir}/{h}\n"
            ));
        }
    }
    d.node.sh(&script);
}

/// Unix milliseconds of an `Instant`, through one reading of both clocks.
struct Clock {
    at: Instant,
    unix_ms: f64,
}

impl Clock {
    fn now() -> Clock {
        let unix = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        Clock {
            at: Instant::now(),
            unix_ms: unix.as_secs_f64() * 1e3,
        }
    }

    fn unix_ms(&self, t: Instant) -> f64 {
        self.unix_ms + ms(t.saturating_duration_since(self.at))
            - ms(self.at.saturating_duration_since(t))
    }
}

/// The agent's timestamp (unix ms) of the first log line holding `text` as a whole line.
fn line_time(log: &str, text: &str) -> Option<f64> {
    log.lines()
        .filter_map(stamped)
        .find(|(_, body)| body.trim_end() == text)
        .map(|(t, _)| t as f64)
}

/// One of a [`Split`]'s per-job figures.
type Pick = fn(&Split) -> &Vec<f64>;

#[derive(Default)]
struct Split {
    before: Vec<f64>,
    after: Vec<f64>,
    job_less_command: Vec<f64>,
    /// Each section of the job's log (its header; the command's own lines as `(the
    /// command)`, what follows it in the same section as `(after the command)`): its times.
    sections: Vec<(String, Vec<f64>)>,
    /// The sections the hooks are in ([`is_hooks_section`]), summed per job.
    hooks: Vec<f64>,
}

/// Whether a section of the job's log is the hooks' (a hook, the plugin's preparation, the
/// command phase up to the command, what follows the command before the artifact upload), not
/// the agent's own work that every form does alike (starting, checking out, uploading).
fn is_hooks_section(header: &str) -> bool {
    header.contains(" hook")
        || header == "Running script"
        || header.starts_with("Preparing plugins")
        || header == "(after the command)"
}

impl Split {
    /// Adds the sections of one job's log, the command split out by its markers.
    fn add_sections(&mut self, log: &str, start: f64, end: f64, accepted: f64, finished: f64) {
        // Within a millisecond, the command starts after its section's header and ends before
        // the next one.
        let (headers, _) = sections(log);
        let mut s: Vec<(String, u64, u8)> = headers.into_iter().map(|(h, t)| (h, t, 1)).collect();
        s.push(("(the command)".into(), start as u64, 2));
        s.push(("(after the command)".into(), end as u64, 0));
        s.sort_by_key(|(_, t, rank)| (*t, *rank));
        let mut s: Vec<(String, u64)> = s.into_iter().map(|(h, t, _)| (h, t)).collect();
        s.insert(
            0,
            (
                "(accepted, before the first section)".into(),
                accepted as u64,
            ),
        );
        let mut hooks = 0.0;
        for (i, (h, t)) in s.iter().enumerate() {
            let next = s.get(i + 1).map_or(finished, |n| n.1 as f64);
            let took = next - *t as f64;
            if is_hooks_section(h) {
                hooks += took;
            }
            match self.sections.iter_mut().find(|(name, _)| name == h) {
                Some((_, v)) => v.push(took),
                None => self.sections.push((h.clone(), vec![took])),
            }
        }
        self.hooks.push(hooks);
    }
}

/// Runs `n` submissions in each [`Form`], interleaved, on the deployment's agents, and prints
/// what kernelkite adds to a job beside what empty hooks at the same levels add.
async fn hooks_against_their_floor(d: &Deployment, n: usize) {
    let host = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/pipelines/host.yml"),
    )
    .unwrap();
    agent_node::commit(d.scratch(), &[(MARKED_COMMAND, MARKED_SCRIPT)]);
    agent_node::tag_with(
        d.scratch(),
        FLOOR_TAG,
        &[
            ("plugin/hooks/environment", EMPTY_HOOK),
            ("plugin/hooks/pre-exit", EMPTY_HOOK),
        ],
        &["plugin/hooks/command"],
    );
    agent_node::tag_with(
        d.scratch(),
        FLOOR_COMMAND_TAG,
        &[
            ("plugin/hooks/environment", EMPTY_HOOK),
            ("plugin/hooks/pre-exit", EMPTY_HOOK),
            ("plugin/hooks/command", RUN_ONLY_COMMAND_HOOK),
        ],
        &[],
    );
    let clock = Clock::now();
    let trivial = probe_config("test", json!([{}]));
    let mut splits: Vec<Split> = FORMS.iter().map(|_| Split::default()).collect();
    // One warm-up of each form (the floors' plugins are cloned on their first jobs), then n
    // rounds.
    for round in 0..=n {
        for (i, form) in FORMS.into_iter().enumerate() {
            agent_hooks_for(d, form);
            d.set_pipeline(&pipeline_for(&host, form));
            let id = d.submit(trivial.clone(), "h100").await;
            let v = d.wait(&id, Duration::from_secs(120)).await;
            assert_eq!(v["state"], "succeeded", "{form:?}: {v}\n{}", d.logs());
            if round == 0 {
                continue;
            }
            let (_, eval) = d.eval_jobs(&id).await;
            let job = &eval[0];
            let log = job.log();
            let (Some(start), Some(end)) = (
                line_time(&log, "kk-command-start"),
                line_time(&log, "kk-command-end"),
            ) else {
                panic!("{form:?}: the command's markers are not in its log:\n{log}");
            };
            let (accepted, finished) = (
                clock.unix_ms(job.times.accepted.expect("accepted")),
                clock.unix_ms(job.times.finished.expect("finished")),
            );
            if round == n && std::env::var_os("KERNELKITE_BENCH_VERBOSE").is_some() {
                println!("--- {form:?}: the last job's log, ms since accepted ---");
                for (t, text) in log.lines().filter_map(stamped) {
                    let text: String = text.chars().take(150).collect();
                    println!("{:>8.0} {text}", t as f64 - accepted);
                }
            }
            let s = &mut splits[i];
            s.add_sections(&log, start, end, accepted, finished);
            s.before.push(start - accepted);
            s.after.push(finished - end);
            s.job_less_command
                .push((finished - accepted) - (end - start));
        }
    }
    agent_hooks_for(d, Form::Kernelkite);
    d.set_pipeline(&host);
    println!(
        "the hooks under the real agent: {n} jobs in each form, interleaved (one warm-up each)"
    );
    for (form, s) in FORMS.iter().zip(&splits) {
        println!("  {form:?}:");
        row("accepted -> command starts", s.before.clone());
        row("command ends -> job finished", s.after.clone());
        row("the job less its command", s.job_less_command.clone());
        println!("    by section of the job's log:");
        for (h, v) in &s.sections {
            let name: String = h.chars().take(44).collect();
            row(&format!("  {name}"), v.clone());
        }
    }
    // Paired by round (the four jobs of a round ran one after another), which leaves out
    // what drifts between rounds; the median of the pairs.
    let added = |i: usize, of: Pick| {
        let pairs: Vec<f64> = of(&splits[i])
            .iter()
            .zip(of(&splits[0]))
            .map(|(form, bare)| form - bare)
            .collect();
        quantile(&pairs, 0.5)
    };
    let pick: [(&str, Pick); 2] = [
        ("the hooks' sections", |s| &s.hooks),
        ("the whole job less its command", |s| &s.job_less_command),
    ];
    for (what, of) in pick {
        let (floor, with_command, kernelkite) = (added(1, of), added(2, of), added(3, of));
        println!(
            "  added over the bare agent, {what} (median of the rounds' differences): kernelkite {kernelkite:.1} ms; \
             floor with a command hook that only runs the command {with_command:.1} ms: {:.2}x (goal: at most 1.3x); \
             floor without a command hook {floor:.1} ms: {:.2}x",
            kernelkite / with_command,
            kernelkite / floor
        );
    }
    let pick: [(&str, Pick); 2] = [
        ("before the command", |s| &s.before),
        ("after the command", |s| &s.after),
    ];
    for (what, of) in pick {
        let median = |i: usize| quantile(of(&splits[i]), 0.5);
        println!(
            "    {what}: floor +{:.1} ms, floor with a command hook +{:.1} ms, kernelkite +{:.1} ms",
            median(1) - median(0),
            median(2) - median(0),
            median(3) - median(0)
        );
    }
}
