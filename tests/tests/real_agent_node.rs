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

use std::path::{Path, PathBuf};
use std::time::Duration;

use kernelkite_kernelbot::config::Mode;
use kernelkite_testkit::agent_node::{self, Node, NodeSpec, REPOSITORY};
use kernelkite_testkit::fake_buildkite::FAKE_AGENT_TOKEN;
use kernelkite_testkit::harness::{self, Harness};
use serde_json::{json, Value};

fn agent() -> Option<PathBuf> {
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/buildkite-agent/v3.137.0/buildkite-agent");
    kernelkite_testkit::built_binary("KERNELKITE_BUILDKITE_AGENT", Some(built))
}

fn which(tool: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Why the node cannot run here, if it cannot.
fn cannot_run() -> Option<String> {
    if agent().is_none() {
        return Some("the real buildkite-agent is not built: run scripts/buildkite-agent.sh (the README's test command does)".into());
    }
    if let Err(e) = kernelkite_testkit::local::real_cgroups() {
        return Some(e);
    }
    for tool in ["unshare", "nsenter", "git", "mount"] {
        if !which(tool) {
            return Some(format!("no {tool}"));
        }
    }
    if !Path::new("/usr/bin/python3").exists() {
        return Some("no /usr/bin/python3 for the runner".into());
    }
    None
}

/// setup's `--from`: the binaries this test build made, under the names setup installs.
fn binaries(at: &Path) -> PathBuf {
    let dir = at.join("from");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, built) in [
        (
            "kernelkite-isolate",
            env!("CARGO_BIN_EXE_kernelkite-testkit-isolate"),
        ),
        (
            "kernelkite-runner",
            env!("CARGO_BIN_EXE_kernelkite-testkit-runner"),
        ),
    ] {
        std::fs::copy(built, dir.join(name)).unwrap();
    }
    dir
}

/// The agent beside the service that runs the settings step (`pipeline upload`): a plain agent
/// on the `kernelkite-pipeline` queue, its git fetching the repository locally.
struct PipelineAgent {
    child: std::process::Child,
    log: PathBuf,
}

impl Drop for PipelineAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pipeline_agent(at: &Path, agent: &Path, endpoint: &str, repository: &Path) -> PipelineAgent {
    let home = at.join("pipeline-agent");
    for d in ["builds", "plugins", "hooks"] {
        std::fs::create_dir_all(home.join(d)).unwrap();
    }
    std::fs::write(
        home.join(".gitconfig"),
        format!(
            "[url \"{}\"]\n\tinsteadOf = {REPOSITORY}\n",
            repository.display()
        ),
    )
    .unwrap();
    let log = at.join("pipeline-agent.log");
    let file = std::fs::File::create(&log).unwrap();
    let child = std::process::Command::new(agent)
        .arg("start")
        .args(["--name", "kernelkite-pipeline-1"])
        .args(["--tags", "queue=kernelkite-pipeline"])
        .args(["--token", FAKE_AGENT_TOKEN])
        .args(["--endpoint", endpoint])
        .arg("--build-path")
        .arg(home.join("builds"))
        .arg("--plugins-path")
        .arg(home.join("plugins"))
        .arg("--hooks-path")
        .arg(home.join("hooks"))
        .args(["--no-plugins", "--no-local-hooks"])
        .env_clear()
        .env("HOME", &home)
        .env(
            "PATH",
            format!(
                "{}:/usr/local/bin:/usr/bin:/bin",
                agent.parent().unwrap().display()
            ),
        )
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .unwrap();
    PipelineAgent { child, log }
}

struct World {
    stack: Harness,
    node: Node,
    pipeline: PipelineAgent,
    _scratch: tempfile::TempDir,
}

impl World {
    /// The agents' logs and every job's log, for a failing assertion.
    fn logs(&self) -> String {
        let mut s = format!(
            "{}\n--- pipeline agent ---\n{}",
            self.node.logs(),
            std::fs::read_to_string(&self.pipeline.log).unwrap_or_default()
        );
        for b in 1..=self.stack.fake.build_count() {
            for j in self.stack.fake.jobs_of(b) {
                let log = j.log();
                let tail = &log[log.len().saturating_sub(6000)..];
                s.push_str(&format!(
                    "\n--- build {b} job {} ({}, {}, exit {:?}) ---\n{tail}",
                    j.step.label, j.id, j.state, j.exit_status
                ));
            }
        }
        s
    }

    async fn submit(&self, config: Value, queue: &str) -> String {
        let (status, v) = self
            .stack
            .post(json!({"config": config, "queue": queue, "run_id": "real-agent"}))
            .await;
        assert_eq!(status, 202, "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    /// Long-polls the submission until it ends (at most `within`).
    async fn wait(&self, id: &str, within: Duration) -> Value {
        let deadline = std::time::Instant::now() + within;
        loop {
            let (status, v) = self.stack.get(id, "?wait=20").await;
            assert_eq!(status, 200, "{v}");
            let state = v["state"].as_str().unwrap_or_default();
            if !matches!(state, "queued" | "scheduled" | "running") {
                return v;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "submission {id} still {state} after {within:?}\n{}",
                self.logs()
            );
        }
    }
}

/// The steps an operator pastes into the pipeline's settings.
fn settings() -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/pipelines/settings.yml"),
    )
    .unwrap()
}

async fn world() -> Option<World> {
    if let Some(why) = cannot_run() {
        kernelkite_testkit::skip(why);
        return None;
    }
    let agent = agent().unwrap();
    let scratch = kernelkite_testkit::scratch();
    let stack = harness::harness_with(|cfg| {
        cfg.default_timeout_s = 600;
    })
    .await;
    let repository = agent_node::repository(scratch.path(), &[]);
    stack
        .fake
        .run_builds_on_agents(&settings(), &format!("{REPOSITORY}.git"));
    stack
        .fake
        .set_agent_clock(Duration::from_secs(8), Duration::from_secs(60));
    let endpoint = stack.fake.agent_api_url();
    let from = binaries(scratch.path());
    let mut node = Node::new(&NodeSpec {
        queue: "h100",
        node: "kk-e2e",
        slices: 2,
        binaries: &from,
        agent: &agent,
        endpoint: endpoint.clone(),
        repository: &repository,
    });
    node.start_agent("slice0", &[]);
    node.start_agent("slice1", &[]);
    let pipeline = pipeline_agent(scratch.path(), &agent, &endpoint, &repository);
    Some(World {
        stack,
        node,
        pipeline,
        _scratch: scratch,
    })
}

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

/// Processes of the jobs' and submissions' uids (`1950000000..`, and the node's job user).
fn job_processes() -> Vec<String> {
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
        if uid >= 1_950_000_000 {
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

impl World {
    /// The jobs of the submission's build that ran the step of the deployment pipeline.
    async fn eval_jobs(
        &self,
        id: &str,
    ) -> (
        u64,
        Vec<kernelkite_testkit::fake_buildkite::agent_api::AgentJob>,
    ) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let number = loop {
            let (_, v) = self.stack.get(id, "").await;
            if let Some(n) = v["build"]["number"].as_u64() {
                break n;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no build for {id}: {v}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let jobs = self
            .stack
            .fake
            .jobs_of(number)
            .into_iter()
            .filter(|j| j.step.label.contains("kernelbot"))
            .collect();
        (number, jobs)
    }

    /// Waits until the submission's evaluation job runs on an agent; its agent's name.
    async fn wait_running(&self, id: &str) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let (_, jobs) = self.eval_jobs(id).await;
            if let Some(j) = jobs.iter().find(|j| j.state == "running") {
                // The command hook has started the command once the sandbox said what it is.
                if j.log().contains("kernelkite: sandbox: network") {
                    return self.stack.fake.agent_of(j).unwrap();
                }
            }
            assert!(
                std::time::Instant::now() < deadline,
                "never ran\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn cancel(&self, id: &str) {
        let r = self
            .stack
            .http
            .delete(format!("{}/v1/submissions/{id}", self.stack.base))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{:?}", r.text().await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn submissions_run_through_real_agents_on_a_node_setup_made() {
    let before = (cgroup_dirs(), job_processes());
    let Some(mut w) = world().await else {
        return;
    };
    let long = Duration::from_secs(120);

    // Two submissions at once: each on its own slice's agent, at the same time, routed by the
    // uploaded pipeline to queue h100 (the settings step alone would have said h100 too: see
    // the second queue below for what proves the routing).
    let a = w
        .submit(kernelkite_runner::example::config(Mode::Test), "h100")
        .await;
    let b = w
        .submit(kernelkite_runner::example::config(Mode::Benchmark), "h100")
        .await;
    let (va, vb) = (w.wait(&a, long).await, w.wait(&b, long).await);
    assert_eq!(va["state"], "succeeded", "{va}\n{}", w.logs());
    assert_eq!(vb["state"], "succeeded", "{vb}\n{}", w.logs());
    assert_eq!(va["result"]["runs"]["test"]["run"]["passed"], true, "{va}");
    assert_eq!(
        vb["result"]["runs"]["benchmark"]["run"]["passed"], true,
        "{vb}"
    );
    let (na, ja) = w.eval_jobs(&a).await;
    let (_, jb) = w.eval_jobs(&b).await;
    let (agent_a, agent_b) = (
        w.stack.fake.agent_of(&ja[0]).unwrap(),
        w.stack.fake.agent_of(&jb[0]).unwrap(),
    );
    assert_ne!(agent_a, agent_b, "both ran on one agent\n{}", w.logs());
    // The result the service holds is the file the agent uploaded, which is the runner's.
    let uploaded = w.stack.fake.artifacts_of(na);
    assert_eq!(uploaded.len(), 1, "{uploaded:?}");
    assert_eq!(
        (uploaded[0].0.as_str(), uploaded[0].1.as_str()),
        ("result.json", "finished")
    );
    let bytes: Value = serde_json::from_slice(uploaded[0].2.as_ref().unwrap()).unwrap();
    assert_eq!(
        bytes, va["result"],
        "the service's result is not the uploaded file"
    );
    // The checkout's commit, sent by the agent as meta-data, and the variables the plugin got.
    assert!(w
        .stack
        .fake
        .meta_data_of(na)
        .contains_key("buildkite:git:commit"));

    // Leaderboard mode.
    let l = w
        .submit(
            kernelkite_runner::example::config(Mode::Leaderboard),
            "h100",
        )
        .await;
    let vl = w.wait(&l, long).await;
    assert_eq!(vl["state"], "succeeded", "{vl}\n{}", w.logs());
    assert_eq!(
        vl["result"]["runs"]["leaderboard"]["run"]["passed"], true,
        "{vl}"
    );

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
    for (path, _, bytes) in w.stack.fake.artifacts_of(nbad) {
        let text = String::from_utf8_lossy(bytes.as_deref().unwrap_or_default()).into_owned();
        assert!(
            !text.contains("token="),
            "{path} carried the agent's configuration"
        );
        assert!(
            serde_json::from_str::<Value>(&text).is_ok(),
            "{path}: {text}"
        );
    }

    // Canceled mid-run: the agent sees `canceling`, stops the command (SIGTERM, its grace
    // period), still runs the pre-exit hooks, and the slice is given back.
    let c = w
        .submit(
            kernelkite_testkit::local::probe_config("test", json!([{"hang": 1}])),
            "h100",
        )
        .await;
    w.wait_running(&c).await;
    w.cancel(&c).await;
    let vc = w.wait(&c, long).await;
    assert_eq!(vc["state"], "canceled", "{vc}\n{}", w.logs());
    let (nc, jc) = w.eval_jobs(&c).await;
    assert!(
        w.stack
            .fake
            .wait_state(nc, "canceled", Duration::from_secs(30))
            .await,
        "{}",
        w.logs()
    );
    let jc = w
        .stack
        .fake
        .jobs_of(nc)
        .into_iter()
        .find(|j| j.id == jc[0].id)
        .unwrap();
    assert_eq!(jc.state, "canceled", "{}", w.logs());
    assert_eq!(jc.signal_reason.as_deref(), Some("cancel"), "{}", jc.log());
    assert!(jc.log().contains("released GPU lease"), "{}", jc.log());

    // A step that outlives its timeout_in_minutes (a minute lasts 100 ms here): Buildkite, not
    // the agent, times it out; the agent stops it as it stops a cancel.
    w.stack
        .fake
        .set_agent_clock(Duration::from_secs(8), Duration::from_millis(100));
    let t = w
        .submit(
            kernelkite_testkit::local::probe_config("test", json!([{"hang": 1}])),
            "h100",
        )
        .await;
    let vt = w.wait(&t, long).await;
    w.stack
        .fake
        .set_agent_clock(Duration::from_secs(5), Duration::from_secs(60));
    let (_, jt) = w.eval_jobs(&t).await;
    assert_eq!(jt[0].state, "timed_out", "{}", w.logs());
    assert!(
        jt[0].log().contains("released GPU lease"),
        "{}",
        jt[0].log()
    );
    assert!(matches!(vt["state"].as_str(), Some("failed")), "{vt}");

    // The agent SIGKILLed mid-job: Buildkite marks the job lost (exit -1, no signal reason),
    // the pipeline's retry rule runs it again, on an agent that is alive.
    let k = w
        .submit(
            kernelkite_testkit::local::probe_config("test", json!([{"sleep_ms": 4000}])),
            "h100",
        )
        .await;
    let victim = w.wait_running(&k).await;
    let i = w.node.agents.iter().position(|a| a.name == victim).unwrap();
    w.node.agents[i].kill9();
    let vk = w.wait(&k, long).await;
    assert_eq!(vk["state"], "succeeded", "{vk}\n{}", w.logs());
    let (_, jk) = w.eval_jobs(&k).await;
    assert_eq!(jk.len(), 2, "{}", w.logs());
    assert_eq!(
        (jk[0].exit_status, jk[0].retried),
        (Some(-1), true),
        "{}",
        w.logs()
    );
    assert_eq!(jk[1].state, "passed");
    assert_ne!(
        w.stack.fake.agent_of(&jk[1]).as_deref(),
        Some(victim.as_str())
    );
    let instance = victim.rsplit('-').next().unwrap().to_string();
    w.node.start_agent(&instance, &[]);

    // A second queue, served by slice 1's agent only (started with that queue's tags, as a
    // node set up with --queue mi300x would be): its submission runs there, never on h100's.
    let i = w
        .node
        .agents
        .iter()
        .rposition(|a| a.name.ends_with("slice1"))
        .unwrap();
    assert!(
        w.node.agents[i].stop(Duration::from_secs(30)),
        "{}",
        w.logs()
    );
    w.node.start_agent(
        "slice1",
        &["--tags", "queue=mi300x,node=kk-e2e,gpu-index=1"],
    );
    let m = w
        .submit(kernelkite_runner::example::config(Mode::Test), "mi300x")
        .await;
    let vm = w.wait(&m, long).await;
    assert_eq!(vm["state"], "succeeded", "{vm}\n{}", w.logs());
    let (_, jm) = w.eval_jobs(&m).await;
    assert_eq!(
        jm[0].step.agents.get("queue").map(String::as_str),
        Some("mi300x")
    );
    assert_eq!(
        w.stack.fake.agent_of(&jm[0]).as_deref(),
        Some("kk-e2e-slice1")
    );

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
    let marker = w._scratch.path().join("repository-hook-ran");
    agent_node::commit(
        w._scratch.path(),
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
    assert!(jh[0].log().contains("local hooks"), "{}", jh[0].log());
    agent_node::remove(w._scratch.path(), &[".buildkite/hooks/pre-command"]);
    w.stack
        .fake
        .run_builds_on_agents(&settings(), &format!("{REPOSITORY}.git"));

    let other = host.replacen(
        "    plugins:\n",
        "    plugins:\n      - github.com/buildkite-plugins/docker-buildkite-plugin#v5.12.0:\n          image: alpine\n",
        1,
    );
    assert_ne!(other, host);
    agent_node::commit(
        w._scratch.path(),
        &[("deployment/pipelines/host.yml", &other)],
    );
    let o = w
        .submit(kernelkite_runner::example::config(Mode::Test), "h100")
        .await;
    let vo = w.wait(&o, long).await;
    assert_eq!(vo["state"], "failed", "{vo}\n{}", w.logs());
    let (_, jo) = w.eval_jobs(&o).await;
    assert!(
        jo[0].log().contains("docker-buildkite-plugin"),
        "{}",
        jo[0].log()
    );

    drop(w);
    // The node is as it was: no job cgroup, no job process left.
    let after = (cgroup_dirs(), job_processes());
    assert_eq!(before, after, "the jobs left something behind");
}
