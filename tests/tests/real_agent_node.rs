//! End to end through real Buildkite agents: the production service (its Buildkite executor)
//! → the fake Buildkite's REST API → the pipeline's settings step, run by a real agent on the
//! `kernelkite-pipeline` queue, uploads `deployment/pipelines/host.yml` → the real
//! `buildkite-agent start` processes of a node `kernelkite-isolate setup` made (agent-level
//! hooks, one agent per slice, their tags) run the step: the plugin's hooks, the sandbox, the
//! runner, on real cgroups → the agent uploads `result.json` → signed `build.finished` → the
//! service fetches and checks it → the client.
//!
//! The node lives in a mount namespace over this machine (`kernelkite_testkit::agent_node`), so
//! setup's paths are real and the machine is untouched. Needs root, writable cgroups, the agent
//! (`scripts/buildkite-agent.sh`; the README's test command builds it), Python, git, `unshare`
//! and `nsenter`; skipped (and counted as skipped) without them.

use std::path::Path;
use std::time::Duration;

use kernelkite_kernelbot::config::Mode;
use kernelkite_testkit::agent_node::{self, REPOSITORY};
use kernelkite_testkit::deployment::{
    deployment, deployment_with, settings, Deployment, LOST_AFTER,
};
use kernelkite_testkit::fake_buildkite::agent_api::{AgentCall, AgentCallRecord, AgentFault};
use serde_json::{json, Value};

/// One deployment at a time: each is a node on this machine's real cgroups, whose hooks take
/// another node's jobs for lost ones, and each test compares the machine before and after.
static ONE_NODE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The cgroup directories of this machine (every hierarchy, three levels down): what a job
/// leaves behind shows up here.
fn cgroup_dirs() -> Vec<String> {
    let out = std::process::Command::new("find")
        .args(["/sys/fs/cgroup", "-maxdepth", "3", "-type", "d"])
        .output()
        .unwrap();
    let mut dirs: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        // Below the node's own kernelkite/ group (which setup makes, and stays): jobs' groups.
        .filter(|l| l.contains("kernelkite/"))
        .map(str::to_string)
        .collect();
    dirs.sort();
    dirs
}

/// Processes of the jobs' and submissions' uids (`1950000000..`) and of `also` (the node's job
/// user).
fn job_processes(also: Option<u32>) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        let uid: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|u| u.parse().ok())
            .unwrap_or(0);
        if uid >= 1_950_000_000 || Some(uid as u32) == also {
            found.push(format!("{} uid {uid}", e.file_name().to_string_lossy()));
        }
    }
    found
}

/// The example task with `submission` as the contestant's file.
fn example_with(mode: Mode, submission: &str) -> Value {
    let mut c = kernelkite_runner::example::config(mode);
    c["sources"]["submission.py"] = json!(submission);
    c
}

/// A wrong (off by one) and hostile submission: before answering it tries to leave symlinks to
/// the agent's configuration (its token) wherever `result.json` might be picked up from.
const WRONG_AND_HOSTILE: &str = r#"
import os
for d in [".", "..", "../..", "../../..", os.environ.get("BUILDKITE_BUILD_CHECKOUT_PATH", ".")]:
    for name in ["result.json", "result.json.tmp"]:
        try:
            os.symlink("/etc/kernelkite/agents/slice0.cfg", os.path.join(d, name))
        except OSError:
            pass

def custom_kernel(data):
    total = 0
    out = []
    for x in data:
        total += x
        out.append(total + 1)
    return out
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn submissions_run_through_real_agents_on_a_node_setup_made() {
    let _turn = ONE_NODE.lock().await;
    let before = (cgroup_dirs(), job_processes(None));
    let Some(mut w) = deployment(
        Path::new(env!("CARGO_BIN_EXE_kernelkite-testkit-isolate")),
        Path::new(env!("CARGO_BIN_EXE_kernelkite-testkit-runner")),
    )
    .await
    else {
        return;
    };
    let long = Duration::from_secs(120);

    // Every mode of the example task, submitted at once, routed by the uploaded pipeline to
    // queue h100 (the settings step alone would say h100 too: the second queue below is what
    // proves the routing).
    let modes = [Mode::Test, Mode::Benchmark, Mode::Leaderboard];
    let mut ids = Vec::new();
    for mode in modes {
        ids.push(
            w.submit(kernelkite_runner::example::config(mode), "h100")
                .await,
        );
    }
    for (mode, id) in modes.iter().zip(&ids) {
        let v = w.wait(id, long).await;
        assert_eq!(v["state"], "succeeded", "{v}\n{}", w.logs());
        assert_eq!(
            v["result"]["runs"][mode.as_str()]["run"]["passed"],
            true,
            "{v}"
        );
    }
    // The result the service holds is the file the node's agent uploaded for the evaluation
    // job, which is the runner's; the node ran the step because the pipeline agent signed it.
    let (na, ja) = w.eval_jobs(&ids[0]).await;
    assert!(
        ja[0].log().contains("Job signature verified"),
        "{}",
        ja[0].log()
    );
    let va = w.wait(&ids[0], long).await;
    // The result and, beside it, the run's provenance: both the step's artifact paths, both
    // uploaded by the real agent for the evaluation job (in either order: the agent uploads
    // a batch's files at once).
    let uploaded = w.stack.fake.artifacts_of(na);
    let mut paths: Vec<(&str, &str)> = uploaded
        .iter()
        .map(|a| (a.path.as_str(), a.state.as_str()))
        .collect();
    paths.sort();
    assert_eq!(
        paths,
        [("provenance.json", "finished"), ("result.json", "finished")],
        "{uploaded:?}"
    );
    assert!(uploaded.iter().all(|a| a.job_id == ja[0].id));
    // The service took the provenance the job uploaded, and it names the real agent that ran it.
    assert_eq!(
        va["provenance"]["agent"].as_str(),
        w.stack.fake.agent_of(&ja[0]).as_deref(),
        "the provenance names the agent that ran the job: {}",
        va["provenance"]
    );
    let result = uploaded.iter().find(|a| a.path == "result.json").unwrap();
    let bytes: Value = serde_json::from_slice(result.bytes.as_ref().unwrap()).unwrap();
    assert_eq!(
        bytes, va["result"],
        "the service's result is not the uploaded file"
    );

    // Two slices at once: two submissions that each take 3 s run on the two agents, each in
    // its own slice, at the same time.
    let slow = || kernelkite_testkit::local::probe_config("test", json!([{"sleep_ms": 3000}]));
    let (a, b) = (
        w.submit(slow(), "h100").await,
        w.submit(slow(), "h100").await,
    );
    let (va, vb) = (w.wait(&a, long).await, w.wait(&b, long).await);
    assert_eq!(va["state"], "succeeded", "{va}\n{}", w.logs());
    assert_eq!(vb["state"], "succeeded", "{vb}\n{}", w.logs());
    let (pa, pb) = (
        kernelkite_testkit::local::probes(&va, "test"),
        kernelkite_testkit::local::probes(&vb, "test"),
    );
    assert_ne!(pa[0].slice, pb[0].slice, "{va}\n{vb}");
    assert!(
        pa[0].start_ns < pb[0].end_ns && pb[0].start_ns < pa[0].end_ns,
        "they did not run at the same time: {pa:?} {pb:?}"
    );
    let (_, ja) = w.eval_jobs(&a).await;
    let (_, jb) = w.eval_jobs(&b).await;
    assert_ne!(w.stack.fake.agent_of(&ja[0]), w.stack.fake.agent_of(&jb[0]));

    // A wrong submission that also plants links to the agent's token where result.json might
    // be taken from: the evaluation says it is wrong, and the uploaded result is the runner's.
    let bad = w
        .submit(example_with(Mode::Test, WRONG_AND_HOSTILE), "h100")
        .await;
    let vbad = w.wait(&bad, long).await;
    assert_eq!(vbad["state"], "succeeded", "{vbad}\n{}", w.logs());
    assert_eq!(
        vbad["result"]["runs"]["test"]["run"]["passed"], false,
        "{vbad}"
    );
    let (nbad, _) = w.eval_jobs(&bad).await;
    for a in w.stack.fake.artifacts_of(nbad) {
        let (path, text) = (
            &a.path,
            String::from_utf8_lossy(a.bytes.as_deref().unwrap_or_default()).into_owned(),
        );
        assert!(
            !text.contains("token="),
            "{path} carried the agent's configuration"
        );
        assert!(
            serde_json::from_str::<Value>(&text).is_ok(),
            "{path}: {text}"
        );
    }

    // Canceled mid-run: the agent sees `canceling` (its job-state poll), stops the command
    // (SIGTERM, its grace period), still runs the pre-exit hooks, and the slice is given back.
    let c = w
        .submit(
            kernelkite_testkit::local::probe_config("test", json!([{"hang": 1}])),
            "h100",
        )
        .await;
    let runs_on = w.wait_running(&c).await;
    w.cancel(&c).await;
    let vc = w.wait(&c, long).await;
    assert_eq!(vc["state"], "canceled", "{vc}\n{}", w.logs());
    let (nc, _) = w.eval_jobs(&c).await;
    assert!(
        w.stack
            .fake
            .wait_state(nc, "canceled", Duration::from_secs(60))
            .await,
        "{}",
        w.logs()
    );
    let (_, jc) = w.eval_jobs(&c).await;
    let jc = &jc[0];
    // What the agent itself reported: interrupted by the signal it sent on a cancel.
    assert_eq!(
        (jc.exit_status, jc.signal_reason.as_deref()),
        (Some(-1), Some("cancel")),
        "{}",
        jc.log()
    );
    assert!(
        w.node
            .agent_log(&runs_on)
            .contains(&format!("Canceling job {}", jc.id)),
        "{}",
        w.node.agent_log(&runs_on)
    );
    assert!(
        w.node
            .agent_log(&runs_on)
            .contains("(job cancelled on Buildkite)"),
        "{}",
        w.node.agent_log(&runs_on)
    );
    assert!(jc.log().contains("released GPU lease"), "{}", jc.log());

    // A step that outlives its timeout_in_minutes: Buildkite, not the agent, times it out, and
    // the agent stops it as it stops a cancel. Once the command runs, a minute lasts 100 ms.
    let t = w
        .submit(
            kernelkite_testkit::local::probe_config("test", json!([{"hang": 1}])),
            "h100",
        )
        .await;
    let runs_on = w.wait_running(&t).await;
    w.stack
        .fake
        .set_agent_clock(LOST_AFTER, Duration::from_millis(100));
    let vt = w.wait(&t, long).await;
    w.stack
        .fake
        .set_agent_clock(LOST_AFTER, Duration::from_secs(60));
    assert_eq!(vt["state"], "failed", "{vt}");
    let (_, jt) = w.eval_jobs(&t).await;
    assert_eq!(jt[0].state, "timed_out", "{}", w.logs());
    assert_eq!(
        (jt[0].exit_status, jt[0].signal_reason.as_deref()),
        (Some(-1), Some("cancel")),
        "{}",
        jt[0].log()
    );
    assert!(
        w.node
            .agent_log(&runs_on)
            .contains("(job timed out on Buildkite)"),
        "{}",
        w.node.agent_log(&runs_on)
    );
    assert!(
        jt[0].log().contains("released GPU lease"),
        "{}",
        jt[0].log()
    );

    // The agent SIGKILLed mid-job, with its job's bootstrap and hooks: Buildkite marks the job
    // lost (exit -1, no signal reason) and the pipeline's retry rule runs it again. The other
    // agent is stopped first, so the retry lands on the lost job's slice, whose next job's
    // `environment` hook reclaims what the lost one left (its lease, its cgroup).
    let k = w
        .submit(
            kernelkite_testkit::local::probe_config("test", json!([{"sleep_ms": 10000}])),
            "h100",
        )
        .await;
    let victim = w.wait_running(&k).await;
    let other = w
        .node
        .agents
        .iter_mut()
        .rposition(|a| a.name != victim && a.running())
        .unwrap();
    assert!(
        w.node.agents[other].stop(Duration::from_secs(30)),
        "{}",
        w.logs()
    );
    let i = w
        .node
        .agents
        .iter()
        .rposition(|a| a.name == victim)
        .unwrap();
    w.node.agents[i].kill9_with_job();
    let victim_instance = victim.rsplit('-').next().unwrap().to_string();
    w.node.start_agent(&victim_instance, &[]);
    let vk = w.wait(&k, long).await;
    assert_eq!(vk["state"], "succeeded", "{vk}\n{}", w.logs());
    let (_, jk) = w.eval_jobs(&k).await;
    assert_eq!(jk.len(), 2, "{}", w.logs());
    // Lost, as Buildkite marks it: exit -1, no signal, no reason (the agent never finished it).
    assert_eq!(
        (
            jk[0].exit_status,
            jk[0].signal_reason.as_deref(),
            jk[0].retried
        ),
        (Some(-1), None, true),
        "{}",
        w.logs()
    );
    assert_eq!(jk[1].state, "passed");
    assert_eq!(
        w.stack.fake.agent_of(&jk[1]).as_deref(),
        Some(victim.as_str())
    );
    assert!(
        jk[1].log().contains("cleaned up after a lost job"),
        "{}",
        jk[1].log()
    );
    let (nk, _) = w.eval_jobs(&k).await;
    let results: Vec<_> = w.stack.fake.artifacts_of(nk);
    assert!(
        results.iter().all(|a| a.job_id == jk[1].id),
        "only the retry uploads a result: {results:?}"
    );
    let other_name = w.node.agents[other].name.clone();
    let other_instance = other_name.rsplit('-').next().unwrap().to_string();
    w.node.start_agent(&other_instance, &[]);

    // A second queue, served by slice 1's agent only (started with that queue's tags, as a
    // node set up with --queue mi300x would be). While no agent serves it, its submission
    // waits, though slice 0's h100 agent is idle and pinging; then it runs on that agent.
    let i = w
        .node
        .agents
        .iter_mut()
        .rposition(|a| a.name.ends_with("slice1") && a.running())
        .unwrap();
    assert!(
        w.node.agents[i].stop(Duration::from_secs(30)),
        "{}",
        w.logs()
    );
    let m = w
        .submit(kernelkite_runner::example::config(Mode::Test), "mi300x")
        .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let waiting = loop {
        let (_, jm) = w.eval_jobs(&m).await;
        if let Some(j) = jm.first() {
            break j.clone();
        }
        assert!(std::time::Instant::now() < deadline, "{}", w.logs());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (_, jm) = w.eval_jobs(&m).await;
    assert_eq!(jm[0].state, "scheduled", "an h100 agent took an mi300x job");
    assert_eq!(
        waiting.step.agents.get("queue").map(String::as_str),
        Some("mi300x")
    );
    w.node.start_agent(
        "slice1",
        &["--tags", "queue=mi300x,node=kk-e2e,gpu-index=1"],
    );
    let vm = w.wait(&m, long).await;
    assert_eq!(vm["state"], "succeeded", "{vm}\n{}", w.logs());
    let mi300x = w
        .stack
        .fake
        .registered_agents()
        .into_iter()
        .rev()
        .find(|a| a.name == "kk-e2e-slice1")
        .unwrap();
    assert_eq!(
        mi300x.tags,
        ["queue=mi300x", "node=kk-e2e", "gpu-index=1"],
        "the agent's --tags replace its configuration's"
    );
    let (_, jm) = w.eval_jobs(&m).await;
    assert_eq!(jm[0].agent.as_deref(), Some(mi300x.id.as_str()));

    // What a node set up by setup refuses: a repository hook, and a step naming another plugin.
    // The pipeline agent refuses a repository hook too (it runs with --no-local-hooks, as
    // deployment/README.md sets it up), so here the node gets the step straight from the
    // settings, with its queue written out.
    let host = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/pipelines/host.yml"),
    )
    .unwrap();
    // `tool sign` refuses a pipeline that still has interpolation in it: the queue and label
    // written out, no binding to a build and no canary's pin (which only an upload can
    // interpolate).
    let direct = host
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            t != "env:" && !t.starts_with("KERNELBOT_SIGNED_") && !t.contains("KERNELBOT_PIN_")
        })
        .map(|l| {
            if l.trim_start().starts_with("queue:") {
                "      queue: h100"
            } else if l.trim_start().starts_with("- label:") {
                "  - label: kernelbot direct"
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    // Unsigned, the node refuses it before anything of it runs (issue 34, item 9: signed
    // pipelines): a step that did not come through the service's pipeline agent.
    w.stack
        .fake
        .run_builds_on_agents(&direct, &format!("{REPOSITORY}.git"));
    let u = w
        .submit(kernelkite_runner::example::config(Mode::Test), "h100")
        .await;
    let vu = w.wait(&u, long).await;
    assert_eq!(vu["state"], "failed", "{vu}\n{}", w.logs());
    let (_, ju) = w.eval_jobs(&u).await;
    assert_eq!(
        (ju[0].exit_status, ju[0].signal_reason.as_deref()),
        (Some(-1), Some("signature_rejected")),
        "{}",
        ju[0].log()
    );
    assert!(
        ju[0].log().contains("Job signature verification failed"),
        "{}",
        ju[0].log()
    );
    assert!(
        !ju[0].log().contains("Running agent environment hook"),
        "a hook ran for an unsigned step: {}",
        ju[0].log()
    );
    // Signed as the pipeline agent signs, but for no build: the node's pre-bootstrap hook
    // refuses it (setup gave the node KERNELKITE_SIGNED_STEPS=on), before any hook runs.
    w.stack
        .fake
        .run_builds_on_agents(&w.signed(&direct), &format!("{REPOSITORY}.git"));
    let n = w
        .submit(kernelkite_runner::example::config(Mode::Test), "h100")
        .await;
    let vn = w.wait(&n, long).await;
    assert_eq!(vn["state"], "failed", "{vn}\n{}", w.logs());
    let (_, jn) = w.eval_jobs(&n).await;
    assert_eq!(
        (jn[0].exit_status, jn[0].signal_reason.as_deref()),
        (Some(-1), Some("agent_refused")),
        "{}\n{}",
        jn[0].log(),
        w.logs()
    );
    assert!(
        jn[0].log().contains("Job signature verified")
            && jn[0].log().contains("pre-bootstrap hook rejected this job"),
        "{}",
        jn[0].log()
    );
    assert!(
        w.node.logs().contains("carries no KERNELBOT_SIGNED_BUILD"),
        "{}",
        w.node.logs()
    );
    w.stack
        .fake
        .run_builds_on_agents(&settings(), &format!("{REPOSITORY}.git"));

    // The build's commit is whoever creates the build's choice: a commit whose host.yml runs
    // something else (here as root, with the network) is never what the pipeline agent uploads
    // (it uploads the file mounted into it), and a repository hook of that commit is refused
    // by the node (no-local-hooks) before it runs as root.
    let marker = w.scratch().join("repository-hook-ran");
    let evil = host
        .replace(
            "kernelkite-runner --output result.json",
            &format!("touch {}", marker.display()),
        )
        .replace(
            "network: false",
            "network: true\n          user: root\n          allow-root: true",
        );
    assert_ne!(evil, host);
    agent_node::commit(
        w.scratch(),
        &[
            (
                ".buildkite/hooks/pre-command",
                &format!("#!/bin/sh\ntouch {}\n", marker.display()),
            ),
            ("deployment/pipelines/host.yml", &evil),
        ],
    );
    let h = w
        .submit(kernelkite_runner::example::config(Mode::Test), "h100")
        .await;
    let vh = w.wait(&h, long).await;
    assert_eq!(vh["state"], "failed", "{vh}\n{}", w.logs());
    assert!(
        !marker.exists(),
        "the commit's hook or pipeline ran on the node"
    );
    let (_, jh) = w.eval_jobs(&h).await;
    assert_eq!(
        jh[0].step.command, "kernelkite-runner --output result.json",
        "the pipeline agent uploaded the commit's pipeline"
    );
    assert!(
        jh[0].log().contains("local hooks are disabled"),
        "{}",
        jh[0].log()
    );
    assert_ne!(jh[0].exit_status, Some(0));
    agent_node::remove(w.scratch(), &[".buildkite/hooks/pre-command"]);
    agent_node::commit(w.scratch(), &[("deployment/pipelines/host.yml", &host)]);

    // What the operator's own pipeline names is still held to the node's allow-lists: a step
    // naming another plugin is refused by the agent before the job starts (its
    // allowed-plugins), not a failed clone.
    let other = host.replacen(
        "    plugins:\n",
        "    plugins:\n      - github.com/buildkite-plugins/docker-buildkite-plugin#v5.12.0:\n          image: alpine\n",
        1,
    );
    assert_ne!(other, host);
    w.set_pipeline(&other);
    let o = w
        .submit(kernelkite_runner::example::config(Mode::Test), "h100")
        .await;
    let vo = w.wait(&o, long).await;
    assert_eq!(vo["state"], "failed", "{vo}\n{}", w.logs());
    let (_, jo) = w.eval_jobs(&o).await;
    assert_eq!(
        (jo[0].exit_status, jo[0].signal_reason.as_deref()),
        (Some(-1), Some("agent_refused")),
        "{}\n{}",
        jo[0].log(),
        w.logs()
    );
    w.set_pipeline(&host);

    let job_user = w.node.job_user();
    drop(w);
    // The node is as it was: no job cgroup, no job process left.
    let after = (cgroup_dirs(), job_processes(Some(job_user)));
    assert_eq!(before, after, "the jobs left something behind");
}

/// The jobs of build `number`.
fn jobs(
    w: &Deployment,
    number: u64,
) -> Vec<kernelkite_testkit::fake_buildkite::agent_api::AgentJob> {
    w.stack.fake.jobs_of(number)
}

/// Issue 34, the reviews of signed pipelines: whoever creates a build chooses its variables,
/// whoever holds a job token may upload steps, and the signature on the deployment's step is
/// the same bytes in every build. None of it steers anything: the pipeline agent (which holds
/// the signing key) refuses a build's git settings (its allow-list), a checkout path and the
/// key asked for as an artifact (its pre-bootstrap hook) before anything runs; a node refuses
/// the deployment's signed step copied into another build (its signature valid, its build
/// binding not) with a variable redirecting the result's upload, in its pre-bootstrap hook,
/// before any hook of the job; and refuses a signed step that sets the hooks' own settings
/// (`KERNELKITE_SANDBOX=off`). The directory a build named as its checkout is untouched, git
/// never ran the build's command, no artifact left, and the node is as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_build_s_variables_and_a_copied_signature_steer_nothing() {
    let _turn = ONE_NODE.lock().await;
    let before = (cgroup_dirs(), job_processes(None));
    let Some(w) = deployment(
        Path::new(env!("CARGO_BIN_EXE_kernelkite-testkit-isolate")),
        Path::new(env!("CARGO_BIN_EXE_kernelkite-testkit-runner")),
    )
    .await
    else {
        return;
    };
    let long = Duration::from_secs(120);
    let victim = w.scratch().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("keep"), "the node's file").unwrap();
    let git_ran = w.scratch().join("git-config-ran");
    let refused = |j: &kernelkite_testkit::fake_buildkite::agent_api::AgentJob| {
        (j.exit_status, j.signal_reason.clone()) == (Some(-1), Some("agent_refused".to_string()))
    };

    // Git settings for the pipeline agent's checkout (which would run a command as root beside
    // the signing key): refused by its allow-list; no step is uploaded.
    let b = w
        .build_with_env(
            json!({
                "KERNELBOT_QUEUE": "h100",
                "GIT_CONFIG_COUNT": "1",
                "GIT_CONFIG_KEY_0": "core.fsmonitor",
                "GIT_CONFIG_VALUE_0": format!("touch {}", git_ran.display()),
            }),
            long,
        )
        .await;
    let j = jobs(&w, b);
    assert_eq!(j.len(), 1, "a step was uploaded: {}", w.logs());
    assert!(refused(&j[0]), "{}\n{}", j[0].log(), w.logs());
    assert!(j[0].log().contains("GIT_CONFIG"), "{}", j[0].log());

    // A checkout path (the bootstrap would empty it for a clean checkout, as root): refused by
    // the pipeline agent's pre-bootstrap hook.
    let b = w
        .build_with_env(
            json!({
                "KERNELBOT_QUEUE": "h100",
                "BUILDKITE_BUILD_CHECKOUT_PATH": victim.display().to_string(),
                "BUILDKITE_CLEAN_CHECKOUT": "true",
            }),
            long,
        )
        .await;
    let j = jobs(&w, b);
    assert_eq!(j.len(), 1, "a step was uploaded: {}", w.logs());
    assert!(refused(&j[0]), "{}\n{}", j[0].log(), w.logs());
    assert!(
        j[0].log().contains("pre-bootstrap hook rejected this job")
            && w.pipeline_agent_log().contains("not by Buildkite:")
            && w.pipeline_agent_log()
                .contains(" BUILDKITE_BUILD_CHECKOUT_PATH"),
        "{}\n{}",
        j[0].log(),
        w.pipeline_agent_log()
    );

    // The signing key as an artifact, asked by the build's variables, and by a step of the
    // settings (as anyone able to upload a step to the routing queue could): refused by the
    // pipeline agent's pre-bootstrap hook (Buildkite never sets the upload's variables for
    // that step), nothing uploaded.
    let key = w.signing_jwks.display().to_string();
    let b = w
        .build_with_env(
            json!({
                "KERNELBOT_QUEUE": "h100",
                "BUILDKITE_ARTIFACT_PATHS": key,
                "BUILDKITE_ARTIFACT_UPLOAD_DESTINATION": "s3://somewhere-else/x",
            }),
            long,
        )
        .await;
    let j = jobs(&w, b);
    assert_eq!(j.len(), 1, "a step was uploaded: {}", w.logs());
    assert!(refused(&j[0]), "{}\n{}", j[0].log(), w.logs());
    assert!(w.stack.fake.artifacts_of(b).is_empty());
    w.stack.fake.run_builds_on_agents(
        &format!(
            "steps:\n  - command: buildkite-agent pipeline upload\n    agents:\n      queue: kernelkite-pipeline\n    artifact_paths: \"{key}\"\n"
        ),
        &format!("{REPOSITORY}.git"),
    );
    let b = w
        .build_with_env(json!({"KERNELBOT_QUEUE": "h100"}), long)
        .await;
    let j = jobs(&w, b);
    assert_eq!(j.len(), 1, "a step was uploaded: {}", w.logs());
    assert!(refused(&j[0]), "{}\n{}", j[0].log(), w.logs());
    assert!(w.stack.fake.artifacts_of(b).is_empty());
    assert!(
        w.pipeline_agent_log()
            .contains("not by Buildkite: BUILDKITE_ARTIFACT_PATHS"),
        "{}",
        w.pipeline_agent_log()
    );
    w.stack
        .fake
        .run_builds_on_agents(&settings(), &format!("{REPOSITORY}.git"));

    // A signed step as the pipeline agent uploads it for a submission, then copied whole
    // (signature and all) into another build's steps, that build's variables redirecting the
    // result's upload: the agent verifies the signature, and the node's pre-bootstrap hook
    // refuses the job for both, before any hook of the job runs.
    let first = w.submit(quick(), "h100").await;
    let vf = w.wait(&first, long).await;
    assert_eq!(vf["state"], "succeeded", "{vf}\n{}", w.logs());
    let (_, signed) = w.eval_jobs(&first).await;
    let copied = serde_json::to_string(&json!({"steps": [signed[0].step.raw.clone()]})).unwrap();
    let signed_for = signed[0].step.env["KERNELBOT_SIGNED_BUILD"].clone();
    w.stack
        .fake
        .run_builds_on_agents(&copied, &format!("{REPOSITORY}.git"));
    let c = w
        .build_with_env(
            json!({
                "KERNELBOT_QUEUE": "h100",
                "KERNELBOT_RUN_ID": "copied",
                "BUILDKITE_ARTIFACT_UPLOAD_DESTINATION": "s3://somewhere-else/x",
            }),
            long,
        )
        .await;
    let jc = jobs(&w, c);
    assert_eq!(jc.len(), 1, "{}", w.logs());
    assert!(refused(&jc[0]), "{}\n{}", jc[0].log(), w.logs());
    assert!(
        jc[0].log().contains("Job signature verified")
            && jc[0].log().contains("pre-bootstrap hook rejected this job")
            && !jc[0].log().contains("Running agent environment hook"),
        "{}",
        jc[0].log()
    );
    let node_log = w.node.logs();
    assert!(
        node_log.contains(&format!("the step was signed for build {signed_for:?}"))
            && node_log.contains("BUILDKITE_ARTIFACT_UPLOAD_DESTINATION is set by the job"),
        "{node_log}"
    );
    // The node's own settings in a step's env, signed and bound as the pipeline agent signs
    // the operator's pipeline: the hooks read their settings from their environment, the
    // agent's and the job's together, so `KERNELKITE_SANDBOX=off` would run the command as
    // the agent's user (root). The agents' allow-list (setup's) refuses the job, naming the
    // variable, before its pre-bootstrap hook, which refuses it too where an operator widened
    // that list (`admission`'s unit tests).
    w.stack
        .fake
        .run_builds_on_agents(&settings(), &format!("{REPOSITORY}.git"));
    let host = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/pipelines/host.yml"),
    )
    .unwrap();
    let steered = host.replacen(
        "    env:\n",
        "    env:\n      KERNELKITE_SANDBOX: \"off\"\n      KERNELKITE_ISOLATE_NVML_BIN: /bin/sh\n",
        1,
    );
    assert_ne!(steered, host);
    w.set_pipeline(&steered);
    let s = w.submit(quick(), "h100").await;
    let vs = w.wait(&s, long).await;
    assert_eq!(vs["state"], "failed", "{vs}\n{}", w.logs());
    let (_, js) = w.eval_jobs(&s).await;
    assert_eq!(
        js[0].step.env["KERNELKITE_SANDBOX"], "off",
        "{:?}",
        js[0].step.env
    );
    assert!(refused(&js[0]), "{}\n{}", js[0].log(), w.logs());
    assert!(
        js[0].log().contains("Job signature verified")
            && !js[0].log().contains("Running agent environment hook"),
        "{}",
        js[0].log()
    );
    let node_log = w.node.logs();
    assert!(
        node_log.contains("failed to validate environment variables: KERNELKITE_"),
        "{node_log}"
    );
    w.set_pipeline(&host);

    // The deployment's own path still works after all of it.
    let ok = w.submit(quick(), "h100").await;
    let vok = w.wait(&ok, long).await;
    assert_eq!(vok["state"], "succeeded", "{vok}\n{}", w.logs());

    assert_eq!(
        std::fs::read_to_string(victim.join("keep")).ok().as_deref(),
        Some("the node's file"),
        "the build's checkout path was touched"
    );
    assert!(!git_ran.exists(), "git ran the build's command");
    drop(w);
    let after = (cgroup_dirs(), job_processes(None));
    assert_eq!(before, after, "the jobs left something behind");
}

/// Issue 39, item 3: a node whose runner is not the version the service expects (its
/// `KERNELKITE_RUNNER_VERSION`, this release's by default) refuses the job in its environment
/// hook, before it holds anything: exit status 3, which the deployment's pipeline retries, and
/// it pauses its own agent (`buildkite-agent pause`, with the job's token) so Buildkite does
/// not dispatch the retry to it again. The retry waits while only the paused agent is there,
/// then runs on the up-to-date node when one connects, and the submission succeeds with the
/// provenance of the node that ran it. Both nodes are left as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_with_another_runner_refuses_the_job_which_runs_on_another_node() {
    let _turn = ONE_NODE.lock().await;
    let before = (cgroup_dirs(), job_processes(None));
    let Some(mut w) = deployment(
        Path::new(env!("CARGO_BIN_EXE_kernelkite-testkit-isolate")),
        Path::new(env!("CARGO_BIN_EXE_kernelkite-testkit-runner")),
    )
    .await
    else {
        return;
    };
    // The up-to-date node's agents stop, so the job meets the outdated node first.
    for a in &mut w.node.agents {
        assert!(a.stop(Duration::from_secs(30)), "{}", w.node.logs());
    }
    let mut old = w.another_node("kk-old", "0.0.1");
    old.start_agent("slice0", &[]);
    let old_agent = old.agents[0].name.clone();
    let id = w.submit(quick(), "h100").await;

    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let refused = loop {
        let (_, jobs) = w.eval_jobs(&id).await;
        if let Some(j) = jobs.iter().find(|j| j.exit_status.is_some()) {
            break j.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the outdated node never ended the job\n{}\n{}",
            w.logs(),
            old.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let log = refused.log();
    assert_eq!(refused.exit_status, Some(3), "{log}");
    assert_eq!(
        w.stack.fake.agent_of(&refused).as_deref(),
        Some(old_agent.as_str())
    );
    let expected = env!("CARGO_PKG_VERSION");
    assert!(
        log.contains(&format!(
            "runs kernelkite-runner 0.0.1, and the job expects {expected}"
        )),
        "{log}"
    );
    assert!(log.contains("paused this agent for 60 min"), "{log}");
    // Refused before the lease: the command never ran.
    assert!(!log.contains("holds GPU(s)"), "{log}");
    // The agent paused itself through the agent API, with the job's token, saying why.
    let pauses = calls_of(&w, AgentCall::Pause, &refused.id);
    assert_eq!(pauses.len(), 1, "{pauses:?}");
    let body = pauses[0].body.clone().unwrap_or_default();
    assert_eq!(body["timeout_in_minutes"], 60, "{body}");
    assert!(
        body["note"]
            .as_str()
            .is_some_and(|n| n.contains("runner 0.0.1 here") && n.contains(expected)),
        "{body}"
    );
    assert!(w
        .stack
        .fake
        .registered_agents()
        .iter()
        .any(|a| a.name == old_agent && a.is_paused()));

    // The retry is made, and the paused agent, still pinging, does not take it.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (_, jobs) = w.eval_jobs(&id).await;
    assert_eq!(jobs.len(), 2, "{jobs:?}");
    assert_eq!(jobs[1].state, "scheduled", "{}", old.logs());
    assert!(old.agents[0].running(), "{}", old.logs());

    // The up-to-date node is back: the retry runs there, and the result is its.
    w.node.start_agent("slice0", &[]);
    let v = w.wait(&id, Duration::from_secs(120)).await;
    assert_eq!(v["state"], "succeeded", "{v}\n{}", w.logs());
    let (_, jobs) = w.eval_jobs(&id).await;
    assert_eq!(jobs.len(), 2, "{jobs:?}");
    assert_eq!(jobs[1].exit_status, Some(0), "{}", jobs[1].log());
    let ran_on = w.stack.fake.agent_of(&jobs[1]).unwrap_or_default();
    assert!(ran_on.starts_with("kk-e2e-"), "{ran_on}");
    assert!(
        jobs[1]
            .log()
            .contains(&format!("kernelkite-runner {expected}, as the job expects")),
        "{}",
        jobs[1].log()
    );
    assert_eq!(
        v["provenance"]["agent"].as_str(),
        Some(ran_on.as_str()),
        "{v}"
    );
    assert_eq!(v["provenance"]["kernelkite_version"], expected, "{v}");

    drop(old);
    drop(w);
    let after = (cgroup_dirs(), job_processes(None));
    assert_eq!(before, after, "the jobs left something behind");
}

/// `GET /v1/fleet`, once `ok` holds (at most `within`).
async fn wait_fleet(w: &Deployment, within: Duration, ok: impl Fn(&Value) -> bool) -> Value {
    w.stack.wait_fleet(within, ok, || w.logs()).await
}

/// The fleet's record of slice `id`.
fn slice<'f>(f: &'f Value, id: &str) -> &'f Value {
    f["slices"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["id"] == id))
        .unwrap_or(&Value::Null)
}

/// Issue 39, item 2, where Buildkite dispatches: each slice that joins gets a canary whose
/// build is pinned to the slice's agent (the pipeline's agent rules take the node and
/// gpu-index tags from the build), and it runs there; an operator's quarantine pauses the
/// slice's real agent through Buildkite's REST API, after which ranked runs go only to the
/// other slice; the release resumes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn canaries_run_on_their_slice_and_a_quarantined_slice_s_agent_takes_no_ranked_run() {
    let _turn = ONE_NODE.lock().await;
    let before = (cgroup_dirs(), job_processes(None));
    let Some(w) = deployment_with(
        Path::new(env!("CARGO_BIN_EXE_kernelkite-testkit-isolate")),
        Path::new(env!("CARGO_BIN_EXE_kernelkite-testkit-runner")),
        |cfg| {
            cfg.fleet.canary = true;
            cfg.queues.agents_refresh_s = 1;
            // What is measured here is where canaries run, not how fast: this machine's
            // "GPUs" are shared CPU cores, whose canaries differ by more than 5% from run to
            // run (the local-mode test judges a canary whose timing it controls).
            cfg.fleet.canary_slower_by = 0.9;
            cfg.fleet.canary_max_spread = 0.9;
        },
    )
    .await
    else {
        return;
    };
    let slices = ["kk-e2e-slice0", "kk-e2e-slice1"];
    let f = wait_fleet(&w, Duration::from_secs(300), |f| {
        slices
            .iter()
            .all(|s| slice(f, s)["canary"]["submission"].is_string())
    })
    .await;
    for s in slices {
        let id = slice(&f, s)["canary"]["submission"].as_str().unwrap();
        let v = w.wait(id, Duration::from_secs(60)).await;
        assert_eq!(v["provenance"]["agent"], s, "{v}");
        let (_, jobs) = w.eval_jobs(id).await;
        assert_eq!(jobs.len(), 1, "{jobs:?}");
        assert_eq!(w.stack.fake.agent_of(&jobs[0]).as_deref(), Some(s));
        assert_eq!(
            jobs[0].step.agents.get("node").map(String::as_str),
            Some("kk-e2e")
        );
    }

    // slice1 is taken out: its agent is paused, with the service's note.
    let url = format!("{}/v1/fleet/slices/{}/quarantine", w.stack.base, slices[1]);
    let r = w
        .stack
        .http
        .post(&url)
        .json(&json!({"reason": "fan replacement"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let paused = |name: &str| {
        w.stack
            .fake
            .registered_agents()
            .iter()
            .rev()
            .find(|a| a.name == name)
            .and_then(|a| a.is_paused().then(|| a.paused.clone().unwrap().0))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while paused(slices[1]).is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "never paused\n{}",
            w.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(paused(slices[1]).unwrap().contains("fan replacement"));
    // Ranked runs, at once: both run on slice0.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let mut c = quick();
        c["mode"] = json!("leaderboard");
        ids.push(w.submit(c, "h100").await);
    }
    for id in &ids {
        let v = w.wait(id, Duration::from_secs(180)).await;
        assert_eq!(v["state"], "succeeded", "{v}\n{}", w.logs());
        let (_, jobs) = w.eval_jobs(id).await;
        assert_eq!(
            w.stack.fake.agent_of(&jobs[0]).as_deref(),
            Some(slices[0]),
            "a ranked run reached the quarantined slice"
        );
    }
    // Released: resumed.
    assert_eq!(
        w.stack.http.delete(&url).send().await.unwrap().status(),
        200
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while paused(slices[1]).is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "never resumed\n{}",
            w.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(w);
    let after = (cgroup_dirs(), job_processes(None));
    assert_eq!(before, after, "the jobs left something behind");
}

/// A submission that passes quickly.
fn quick() -> Value {
    kernelkite_testkit::local::probe_config("test", json!([{"sleep_ms": 200}]))
}

/// What the agent API received for `job`, of `call`.
fn calls_of(w: &Deployment, call: AgentCall, job: &str) -> Vec<AgentCallRecord> {
    w.stack
        .fake
        .agent_calls(Some(call))
        .into_iter()
        .filter(|c| c.job.as_deref() == Some(job))
        .collect()
}

fn fail(call: AgentCall, status: u16) -> AgentFault {
    AgentFault {
        call,
        status,
        times: 1,
        queue: Some("h100".into()),
    }
}

/// Issue 34, item 8: the agent's failure paths, through the real agent (v3.137.0) on a node setup
/// made, the fake's agent API failing calls as Buildkite can. Each ends the submission as it
/// should, the result is never taken from a job that did not upload it, and the node is left as
/// it was:
/// - finish answered 502, then 429: the agent sends the same finish again (about 2-3 s later),
///   and the submission succeeds;
/// - a log chunk answered 500: sent again, the log whole; answered 429: given up, counted in
///   finish's `chunks_failed_count`, the result unaffected;
/// - the job-state poll answered 401: the agent cancels the job (as on a cancel from Buildkite),
///   pre-exit still releases the slice, and the submission fails saying the build failed;
/// - the artifact batch refused (422) after a passed command: the job's exit status turns 1, no
///   `result.json` exists, and the submission fails saying so;
/// - the cancel budget: a job that makes its clean-up as slow as it can (processes ignoring
///   SIGTERM, each mapping 256 MiB it touched, forked until it can fork no more; its tmpfs full
///   of files) is canceled, and the bootstrap finishes (post-command, the artifact upload,
///   pre-exit) inside half the agent's signal grace (setup's `cancel-grace-period`, less one
///   second): the agent never has to SIGKILL it, and the slice is clean. With the agent's
///   default grace (9 s) this job's pre-exit alone took 7.2 s, most of it the kernel tearing
///   down what its processes mapped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_agents_failure_paths_end_each_submission_as_they_should() {
    let _turn = ONE_NODE.lock().await;
    let before = (cgroup_dirs(), job_processes(None));
    let Some(w) = deployment(
        Path::new(env!("CARGO_BIN_EXE_kernelkite-testkit-isolate")),
        Path::new(env!("CARGO_BIN_EXE_kernelkite-testkit-runner")),
    )
    .await
    else {
        return;
    };
    let long = Duration::from_secs(120);

    // Finish answered 502, then 429: the same finish again, each a retry later.
    for status in [502, 429] {
        w.stack
            .fake
            .fail_agent_calls(fail(AgentCall::Finish, status));
        let id = w.submit(quick(), "h100").await;
        let v = w.wait(&id, long).await;
        assert_eq!(v["state"], "succeeded", "{status}: {v}\n{}", w.logs());
        let (_, jobs) = w.eval_jobs(&id).await;
        let finishes = calls_of(&w, AgentCall::Finish, &jobs[0].id);
        assert_eq!(finishes.len(), 2, "{status}: {finishes:?}");
        assert_eq!(
            (finishes[0].failed, finishes[1].failed),
            (Some(status), None)
        );
        assert_eq!(finishes[0].body, finishes[1].body, "the same finish again");
        let gap = finishes[1].at - finishes[0].at;
        assert!(
            gap >= Duration::from_millis(1500),
            "{status}: retried after {gap:?}"
        );
    }

    // A chunk answered 500 is sent again; one answered 429 is given up and counted.
    w.stack.fake.fail_agent_calls(fail(AgentCall::Chunks, 500));
    let id = w.submit(quick(), "h100").await;
    assert_eq!(
        w.wait(&id, long).await["state"],
        "succeeded",
        "{}",
        w.logs()
    );
    let (_, jobs) = w.eval_jobs(&id).await;
    let chunks = calls_of(&w, AgentCall::Chunks, &jobs[0].id);
    assert!(chunks.iter().any(|c| c.failed == Some(500)), "{chunks:?}");
    assert_eq!(jobs[0].chunks_failed, Some(0), "{}", jobs[0].log());
    assert!(
        jobs[0].log().contains("released GPU lease"),
        "{}",
        jobs[0].log()
    );
    w.stack.fake.fail_agent_calls(fail(AgentCall::Chunks, 429));
    let id = w.submit(quick(), "h100").await;
    assert_eq!(
        w.wait(&id, long).await["state"],
        "succeeded",
        "{}",
        w.logs()
    );
    let (_, jobs) = w.eval_jobs(&id).await;
    assert_eq!(jobs[0].chunks_failed, Some(1), "{}", jobs[0].log());

    // The job-state poll answered 401: the agent cancels the job.
    w.stack
        .fake
        .fail_agent_calls(fail(AgentCall::JobState, 401));
    let id = w
        .submit(
            kernelkite_testkit::local::probe_config("test", json!([{"hang": 1}])),
            "h100",
        )
        .await;
    let v = w.wait(&id, long).await;
    assert_eq!(v["state"], "failed", "{v}\n{}", w.logs());
    assert!(v["result"].is_null(), "{v}");
    let (_, jobs) = w.eval_jobs(&id).await;
    let j = &jobs[0];
    assert_eq!(
        (j.exit_status, j.signal_reason.as_deref()),
        (Some(-1), Some("cancel")),
        "{}",
        j.log()
    );
    let agent = w.stack.fake.agent_of(j).unwrap();
    assert!(
        w.node.agent_log(&agent).contains("Invalid access token"),
        "{}",
        w.node.agent_log(&agent)
    );
    // The agent's first poll comes at a random point of its first interval
    // (agent/job_runner.go: a first check at once, after `rand.N(JobStatusInterval)` of
    // jitter), so the cancel may land before `environment` took a lease (CI saw it once,
    // with nothing from any hook in the log). A lease the job was told it holds is released,
    // in its log; the next scenarios on the same GPU, and the node's check at the end, find
    // nothing left either way.
    if j.log().contains(" holds GPU(s) ") {
        assert!(j.log().contains("released GPU lease"), "{}", j.log());
    }

    // The artifact batch refused after the command passed: exit status 1, no result.
    w.stack
        .fake
        .fail_agent_calls(fail(AgentCall::CreateArtifacts, 422));
    let id = w.submit(quick(), "h100").await;
    let v = w.wait(&id, long).await;
    assert_eq!(v["state"], "failed", "{v}\n{}", w.logs());
    let error = v["error"].as_str().unwrap_or_default();
    assert!(error.contains("result.json"), "{v}");
    let (number, jobs) = w.eval_jobs(&id).await;
    assert_eq!(jobs[0].exit_status, Some(1), "{}", jobs[0].log());
    assert!(
        jobs[0].log().contains("breaking the retry loop"),
        "{}",
        jobs[0].log()
    );
    assert!(
        jobs[0].log().contains("released GPU lease"),
        "{}",
        jobs[0].log()
    );
    assert!(
        w.stack
            .fake
            .artifacts_of(number)
            .iter()
            .all(|a| a.state != "finished"),
        "{:?}",
        w.stack.fake.artifacts_of(number)
    );

    // Signed pipelines (item 9): a job whose command is not the signed step's (a backend or a
    // token running something else than the service's pipeline agent uploaded) is refused
    // before anything of it runs.
    w.stack.fake.forge_command(Some((
        "h100",
        "kernelkite-runner --output result.json; touch /tmp/forged",
    )));
    let id = w.submit(quick(), "h100").await;
    let v = w.wait(&id, long).await;
    w.stack.fake.forge_command(None);
    assert_eq!(v["state"], "failed", "{v}\n{}", w.logs());
    let (_, jobs) = w.eval_jobs(&id).await;
    assert_eq!(
        (jobs[0].exit_status, jobs[0].signal_reason.as_deref()),
        (Some(-1), Some("signature_rejected")),
        "{}",
        jobs[0].log()
    );
    assert!(
        jobs[0].log().contains("does not match signed step"),
        "{}",
        jobs[0].log()
    );
    assert!(
        !jobs[0].log().contains("Running agent environment hook"),
        "{}",
        jobs[0].log()
    );

    // The cancel budget.
    let mut hostile = kernelkite_testkit::local::probe_config("test", json!([{"n": 1}]));
    hostile["sources"]["eval.py"] = json!(SLOW_TO_CLEAN);
    hostile["main"] = json!("eval.py");
    let id = w.submit(hostile, "h100").await;
    let runs_on = w.wait_running(&id).await;
    // It litters for a few seconds (files, memory, then its processes), then hangs: the cancel
    // comes once all of its processes are there, as its cgroup counts them.
    let (_, jobs) = w.eval_jobs(&id).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while job_tasks(&jobs[0].id) < HOSTILE_CHILDREN {
        assert!(
            std::time::Instant::now() < deadline,
            "the job never had its {HOSTILE_CHILDREN} processes: {}\n{}",
            job_tasks(&jobs[0].id),
            w.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let canceled = std::time::Instant::now();
    w.cancel(&id).await;
    let v = w.wait(&id, long).await;
    assert_eq!(v["state"], "canceled", "{v}\n{}", w.logs());
    let (number, _) = w.eval_jobs(&id).await;
    assert!(
        w.stack
            .fake
            .wait_state(number, "canceled", Duration::from_secs(60))
            .await,
        "{}",
        w.logs()
    );
    let (_, jobs) = w.eval_jobs(&id).await;
    let j = &jobs[0];
    let took = j.times.finished.unwrap() - canceled;
    let grace = Duration::from_secs(kernelkite_admin::setup::render::CANCEL_GRACE_S - 1);
    println!("cancel budget: the hostile job's bootstrap ended {took:?} after the cancel (the agent's signal grace: {grace:?})");
    assert_eq!(
        (
            j.exit_status,
            j.signal.as_deref(),
            j.signal_reason.as_deref()
        ),
        (Some(-1), Some("SIGTERM"), Some("cancel")),
        "the agent had to SIGKILL the bootstrap: its clean-up did not fit the grace\n{}",
        j.log()
    );
    assert!(j.log().contains("released GPU lease"), "{}", j.log());
    // The job-state poll sees the cancel within 2 s (a 1 s interval and its jitter); the rest
    // is the clean-up's, which must leave room: half of the grace at most.
    assert!(
        took < grace / 2,
        "the clean-up took {took:?} of the {grace:?} grace\n{}",
        j.log()
    );
    // The grace is setup's (the agent says which it used), and it never ran out.
    let agent_log = w.node.agent_log(&runs_on);
    assert!(
        agent_log.contains(&format!(
            "with a signal grace period of {}s",
            grace.as_secs()
        )),
        "{agent_log}"
    );
    assert!(!agent_log.contains("hasn't stopped within"), "{agent_log}");
    let job_user = w.node.job_user();
    drop(w);
    let after = (cgroup_dirs(), job_processes(Some(job_user)));
    assert_eq!(before, after, "the jobs left something behind");
}

/// How many children [`SLOW_TO_CLEAN`] forks.
const HOSTILE_CHILDREN: u64 = 1000;

/// The tasks in the job's cgroup (`pids.current` of its pids group, v1 or v2).
fn job_tasks(job: &str) -> u64 {
    for dir in [
        "/sys/fs/cgroup/pids/kernelkite",
        "/sys/fs/cgroup/kernelkite",
    ] {
        let text = std::fs::read_to_string(Path::new(dir).join(job).join("pids.current"));
        if let Ok(n) = text.unwrap_or_default().trim().parse() {
            return n;
        }
    }
    0
}

/// A harness whose clean-up is as slow as a job can make it: it ignores SIGTERM, fills its
/// tmpfs with small files, touches 256 MiB, and forks 1,000 children (each mapping that memory,
/// each ignoring SIGTERM); then it waits to be killed. Its kernel teardown is most of the cost:
/// 1,400 such processes took 4 s to reap here, 1,400 without the memory 0.2 s.
const SLOW_TO_CLEAN: &str = r#"
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
litter = "/tmp/litter"
os.makedirs(litter, exist_ok=True)
for i in range(50000):
    try:
        with open(f"{litter}/{i}", "w") as f:
            f.write("x" * 512)
    except OSError:
        break
hog = bytearray(256 << 20)
for i in range(0, len(hog), 4096):
    hog[i] = 1
children = 0
for i in range(1000):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        while True:
            time.sleep(3600)
    children += 1
print(f"littered: {children} children", file=sys.stderr, flush=True)
while True:
    time.sleep(3600)
"#;
