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
use kernelkite_testkit::deployment::{deployment, settings, LOST_AFTER};
use serde_json::{json, Value};

/// The cgroup directories of this machine (every hierarchy, three levels down): what a job
/// leaves behind shows up here.
fn cgroup_dirs() -> Vec<String> {
    let out = std::process::Command::new("find")
        .args(["/sys/fs/cgroup", "-maxdepth", "3", "-type", "d"])
        .output()
        .unwrap();
    let mut dirs: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("kernelkite"))
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
    // job, which is the runner's.
    let (na, ja) = w.eval_jobs(&ids[0]).await;
    let va = w.wait(&ids[0], long).await;
    let uploaded = w.stack.fake.artifacts_of(na);
    assert_eq!(uploaded.len(), 1, "{uploaded:?}");
    assert_eq!(
        (uploaded[0].path.as_str(), uploaded[0].state.as_str()),
        ("result.json", "finished")
    );
    assert_eq!(uploaded[0].job_id, ja[0].id);
    let bytes: Value = serde_json::from_slice(uploaded[0].bytes.as_ref().unwrap()).unwrap();
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
    let direct = host
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("queue:") {
                "      queue: h100"
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    w.stack
        .fake
        .run_builds_on_agents(&direct, &format!("{REPOSITORY}.git"));
    let marker = w.scratch().join("repository-hook-ran");
    agent_node::commit(
        w.scratch(),
        &[(
            ".buildkite/hooks/pre-command",
            &format!("#!/bin/sh\ntouch {}\n", marker.display()),
        )],
    );
    let h = w
        .submit(kernelkite_runner::example::config(Mode::Test), "h100")
        .await;
    let vh = w.wait(&h, long).await;
    assert_eq!(vh["state"], "failed", "{vh}\n{}", w.logs());
    assert!(
        !marker.exists(),
        "the repository's hook ran as root on the node"
    );
    let (_, jh) = w.eval_jobs(&h).await;
    assert!(
        jh[0].log().contains("local hooks are disabled"),
        "{}",
        jh[0].log()
    );
    assert_ne!(jh[0].exit_status, Some(0));
    agent_node::remove(w.scratch(), &[".buildkite/hooks/pre-command"]);
    w.stack
        .fake
        .run_builds_on_agents(&settings(), &format!("{REPOSITORY}.git"));

    let other = host.replacen(
        "    plugins:\n",
        "    plugins:\n      - github.com/buildkite-plugins/docker-buildkite-plugin#v5.12.0:\n          image: alpine\n",
        1,
    );
    assert_ne!(other, host);
    agent_node::commit(w.scratch(), &[("deployment/pipelines/host.yml", &other)]);
    let o = w
        .submit(kernelkite_runner::example::config(Mode::Test), "h100")
        .await;
    let vo = w.wait(&o, long).await;
    assert_eq!(vo["state"], "failed", "{vo}\n{}", w.logs());
    let (_, jo) = w.eval_jobs(&o).await;
    // Refused by the agent before the job starts (its allowed-plugins), not a failed clone.
    assert_eq!(
        (jo[0].exit_status, jo[0].signal_reason.as_deref()),
        (Some(-1), Some("agent_refused")),
        "{}\n{}",
        jo[0].log(),
        w.logs()
    );

    let job_user = w.node.job_user();
    drop(w);
    // The node is as it was: no job cgroup, no job process left.
    let after = (cgroup_dirs(), job_processes(Some(job_user)));
    assert_eq!(before, after, "the jobs left something behind");
}
