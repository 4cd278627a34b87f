//! The whole deployment on this machine, for the end-to-end test and benchmark through real
//! agents: the production service (its Buildkite executor) against the fake Buildkite, which
//! plays its builds on agents; the pipeline's settings steps (`deployment/pipelines/settings.yml`)
//! run by a pipeline agent configured as `deployment/service/compose.yaml` runs it; a node
//! `kernelkite-isolate setup` made ([`crate::agent_node`]) with one real agent per slice.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use crate::agent_node::{self, Node, NodeSpec, REPOSITORY};
use crate::fake_buildkite::FAKE_AGENT_TOKEN;
use crate::harness::{self, Harness};

/// The real agent `scripts/buildkite-agent.sh` builds (`KERNELKITE_BUILDKITE_AGENT`, else its
/// place under `target/`).
pub fn agent() -> Option<PathBuf> {
    let built = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/buildkite-agent/v3.137.0/buildkite-agent");
    crate::built_binary("KERNELKITE_BUILDKITE_AGENT", Some(built))
}

/// Whether `tool` is on the PATH.
fn which(tool: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Why the real agent cannot run here: it was never built.
pub const NO_AGENT: &str = "the real buildkite-agent is not built: run scripts/buildkite-agent.sh (the README's test command does)";

/// Why the node cannot run here, if it cannot.
pub fn cannot_run() -> Option<String> {
    if agent().is_none() {
        return Some(NO_AGENT.into());
    }
    if let Err(e) = crate::local::real_cgroups() {
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

/// setup's `--from`: `isolate` and `runner` under the names setup installs.
fn binaries(at: &Path, isolate: &Path, runner: &Path) -> PathBuf {
    let dir = at.join("from");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, built) in [
        ("kernelkite-isolate", isolate),
        ("kernelkite-runner", runner),
    ] {
        std::fs::copy(built, dir.join(name)).unwrap();
    }
    dir
}

/// The agent beside the service that runs the settings step (`pipeline upload`), configured as
/// `deployment/service/compose.yaml` runs it.
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

/// The `pipeline-agent` service's environment in `deployment/service/compose.yaml`.
fn compose_pipeline_agent_env() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/service/compose.yaml"),
    )
    .unwrap();
    let compose = kernelkite_service::task::pyyaml::load(&text).unwrap();
    compose["services"]["pipeline-agent"]["environment"]
        .as_object()
        .expect("compose.yaml has a pipeline-agent with an environment map")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
        .collect()
}

/// The signing key pair of the pipeline agent, made by the real agent's `tool keygen` with the
/// key id `deployment/service/compose.yaml` names: (private JWKS, public JWKS).
fn signing_keys(at: &Path, agent: &Path) -> (PathBuf, PathBuf) {
    let key_id = compose_pipeline_agent_env()
        .into_iter()
        .find(|(k, _)| k == "BUILDKITE_AGENT_SIGNING_JWKS_KEY_ID")
        .map(|(_, v)| v)
        .expect("compose.yaml's pipeline agent names its signing key");
    let (private, public) = (
        at.join("signing-private.jwks"),
        at.join("signing-public.jwks"),
    );
    let out = std::process::Command::new(agent)
        .args(["tool", "keygen", "--alg", "EdDSA", "--key-id", &key_id])
        .arg("--private-jwks-file")
        .arg(&private)
        .arg("--public-jwks-file")
        .arg(&public)
        .output()
        .expect("buildkite-agent tool keygen");
    assert!(out.status.success(), "{out:?}");
    (private, public)
}

/// The pipeline agent's hooks (`deployment/service/compose.yaml` mounts them as its hooks-path).
fn pipeline_agent_hooks() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/service/pipeline-agent/hooks")
}

/// The agent beside the service, as compose runs it: its environment, its hooks, the pipeline
/// it uploads mounted (here `pipeline`, a copy the test may change). No git configuration:
/// it checks nothing out (a clone of the pipeline's GitHub repository would fail here).
fn pipeline_agent(
    at: &Path,
    agent: &Path,
    endpoint: &str,
    pipeline: &Path,
    signing_jwks: &Path,
) -> PipelineAgent {
    let home = at.join("pipeline-agent");
    for d in ["builds", "plugins"] {
        std::fs::create_dir_all(home.join(d)).unwrap();
    }
    let log = at.join("pipeline-agent.log");
    let file = std::fs::File::create(&log).unwrap();
    let child = std::process::Command::new(agent)
        .arg("start")
        .env_clear()
        .envs(compose_pipeline_agent_env())
        // What the image and pipeline-agent.env add: the token, and the agent's own paths.
        .env("BUILDKITE_AGENT_TOKEN", FAKE_AGENT_TOKEN)
        .env("BUILDKITE_AGENT_ENDPOINT", endpoint)
        .env("BUILDKITE_BUILD_PATH", home.join("builds"))
        .env("BUILDKITE_PLUGINS_PATH", home.join("plugins"))
        // Where compose mounts its hooks, its pipeline and its secret, here.
        .env("BUILDKITE_HOOKS_PATH", pipeline_agent_hooks())
        .env("KERNELKITE_PIPELINE_FILE", pipeline)
        .env("BUILDKITE_AGENT_SIGNING_JWKS_FILE", signing_jwks)
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

/// How long an agent holding a job may go without a heartbeat before the fake Buildkite takes
/// it for lost (Buildkite's own is minutes; the agents here heartbeat every second).
pub const LOST_AFTER: Duration = Duration::from_secs(8);

/// The whole deployment on this machine: the service (Buildkite executor) and its fake Buildkite
/// playing builds on agents, a node `setup` made with one real agent per slice, and the
/// pipeline agent beside the service.
pub struct Deployment {
    /// The service and the fake Buildkite.
    pub stack: Harness,
    /// The node and its agents.
    pub node: Node,
    pipeline: PipelineAgent,
    /// The pipeline the pipeline agent uploads (compose mounts the deployment's host.yml).
    pipeline_file: PathBuf,
    scratch: tempfile::TempDir,
    /// The private JWKS the pipeline agent signs its uploads with (the node verifies them).
    pub signing_jwks: PathBuf,
    /// What another node needs to join: setup's `--from`, the repository git fetches, the
    /// public key, the agent API.
    binaries: PathBuf,
    repository: PathBuf,
    verification_jwks: PathBuf,
    endpoint: String,
}

impl Deployment {
    /// The agents' logs and every job's log, for a failing assertion.
    pub fn logs(&self) -> String {
        let mut s = format!(
            "{}\n--- pipeline agent ---\n{}",
            self.node.logs(),
            std::fs::read_to_string(&self.pipeline.log).unwrap_or_default()
        );
        for a in self.stack.fake.registered_agents() {
            s.push_str(&format!(
                "\n--- agent {} (id {}, tags {:?}, paused {:?}, disconnected {}, seen {:?} ago)",
                a.name,
                a.id,
                a.tags,
                a.is_paused().then_some(&a.paused),
                a.disconnected,
                a.seen.elapsed()
            ));
        }
        for b in 1..=self.stack.fake.build_count() {
            for j in self.stack.fake.jobs_of(b) {
                let log = j.log();
                let tail = &log[log.len().saturating_sub(6000)..];
                s.push_str(&format!(
                    "\n--- build {b} job {} ({}, {}, exit {:?}, agents {:?}, on {:?}) ---\n{tail}",
                    j.step.label,
                    j.id,
                    j.state,
                    j.exit_status,
                    j.step.agents,
                    self.stack.fake.agent_of(&j)
                ));
            }
        }
        s
    }

    /// Submits `config` to `queue`; its id.
    pub async fn submit(&self, config: Value, queue: &str) -> String {
        let (status, v) = self
            .stack
            .post(json!({"config": config, "queue": queue, "run_id": "real-agent"}))
            .await;
        assert_eq!(status, 202, "{v}");
        v["id"].as_str().unwrap().to_string()
    }

    /// Long-polls the submission until it ends (at most `within`).
    pub async fn wait(&self, id: &str, within: Duration) -> Value {
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
pub fn settings() -> String {
    std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/pipelines/settings.yml"),
    )
    .unwrap()
}

/// The deployment, the node's binaries being `isolate` and `runner` (the caller's build of
/// `kernelkite-isolate` and `kernelkite-runner`); `None` (reported as a skip) where it cannot
/// run here.
pub async fn deployment(isolate: &Path, runner: &Path) -> Option<Deployment> {
    deployment_with(isolate, runner, |_| {}).await
}

/// [`deployment`], the service's configuration changed by `configure` too.
pub async fn deployment_with(
    isolate: &Path,
    runner: &Path,
    configure: impl FnOnce(&mut kernelkite_service::config::Config) + Send + 'static,
) -> Option<Deployment> {
    if let Some(why) = cannot_run() {
        crate::skip(why);
        return None;
    }
    let agent = agent().unwrap();
    let scratch = crate::scratch();
    let stack = harness::harness_with(move |cfg| {
        cfg.default_timeout_s = 600;
        configure(cfg);
    })
    .await;
    let repository = agent_node::repository(scratch.path(), &[]);
    stack
        .fake
        .run_builds_on_agents(&settings(), &format!("{REPOSITORY}.git"));
    stack
        .fake
        .set_agent_clock(LOST_AFTER, Duration::from_secs(60));
    let endpoint = stack.fake.agent_api_url();
    let from = binaries(scratch.path(), isolate, runner);
    let (signing, verification) = signing_keys(scratch.path(), &agent);
    let mut node = Node::new(&NodeSpec {
        queue: "h100",
        node: "kk-e2e",
        slices: 2,
        binaries: &from,
        agent: &agent,
        endpoint: endpoint.clone(),
        repository: &repository,
        verification_jwks: Some(&verification),
    });
    node.start_agent("slice0", &[]);
    node.start_agent("slice1", &[]);
    // What compose mounts into the pipeline agent: the deployment's host.yml.
    let pipeline_file = scratch.path().join("pipeline.yml");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deployment/pipelines/host.yml"),
        &pipeline_file,
    )
    .unwrap();
    let pipeline = pipeline_agent(scratch.path(), &agent, &endpoint, &pipeline_file, &signing);
    Some(Deployment {
        stack,
        node,
        pipeline,
        pipeline_file,
        scratch,
        signing_jwks: signing,
        binaries: from,
        repository,
        verification_jwks: verification,
        endpoint,
    })
}

impl Deployment {
    /// Another node of queue `h100`, named `name`, that setup made from the same binaries
    /// except its runner, which says it is version `runner_version` (and runs the real runner
    /// otherwise): a node left on another release. Its agents are not started.
    pub fn another_node(&self, name: &str, runner_version: &str) -> Node {
        let from = self.scratch().join(format!("from-{name}"));
        std::fs::create_dir_all(&from).unwrap();
        std::fs::copy(
            self.binaries.join("kernelkite-isolate"),
            from.join("kernelkite-isolate"),
        )
        .unwrap();
        let real = self.binaries.join("kernelkite-runner");
        let runner = from.join("kernelkite-runner");
        std::fs::write(
            &runner,
            format!(
                "#!/bin/sh
if [ \"$1\" = --version ]; then echo 'kernelkite-runner {runner_version}'; exit 0; fi
exec '{}' \"$@\"
",
                real.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&runner, std::fs::Permissions::from_mode(0o755)).unwrap();
        Node::new(&NodeSpec {
            queue: "h100",
            node: name,
            slices: 1,
            binaries: &from,
            agent: &agent().unwrap(),
            endpoint: self.endpoint.clone(),
            repository: &self.repository,
            verification_jwks: Some(&self.verification_jwks),
        })
    }

    /// Scratch space that lives as long as the deployment (the repository's work tree is in it).
    pub fn scratch(&self) -> &Path {
        self.scratch.path()
    }

    /// Replaces the pipeline the pipeline agent uploads (as an operator would edit the file
    /// compose mounts); the next submission's build gets it.
    pub fn set_pipeline(&self, text: &str) {
        std::fs::write(&self.pipeline_file, text).unwrap();
    }

    /// The jobs of the submission's build that ran the step of the deployment pipeline.
    pub async fn eval_jobs(
        &self,
        id: &str,
    ) -> (u64, Vec<crate::fake_buildkite::agent_api::AgentJob>) {
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
    pub async fn wait_running(&self, id: &str) -> String {
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

    /// `pipeline` (YAML) signed as the pipeline agent signs its uploads, by the real agent's
    /// `tool sign` (offline: with the key and the repository's URL), for steps given to the node
    /// straight from the pipeline's settings.
    pub fn signed(&self, pipeline: &str) -> String {
        let file = self.scratch().join("to-sign.yml");
        std::fs::write(&file, pipeline).unwrap();
        let out = std::process::Command::new(agent().unwrap())
            .args(["tool", "sign", "--jwks-file"])
            .arg(&self.signing_jwks)
            .args(["--repo", &format!("{REPOSITORY}.git"), "--no-confirm"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// Creates a build straight through Buildkite's REST API with `env` as its variables, as
    /// whoever holds an API token of the organization can (the service's, or an attacker's):
    /// its number, once the build has ended (at most `within`).
    pub async fn build_with_env(&self, env: Value, within: Duration) -> u64 {
        let url = format!(
            "{}/organizations/{}/pipelines/{}/builds",
            self.stack.fake.api_url(),
            crate::fake_buildkite::FAKE_ORG,
            crate::fake_buildkite::FAKE_PIPELINE
        );
        let b: Value = self
            .stack
            .http
            .post(url)
            .bearer_auth(crate::fake_buildkite::FAKE_API_TOKEN)
            .json(&json!({"commit": "HEAD", "branch": "main", "env": env}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let number = b["number"].as_u64().expect("a build number");
        let deadline = std::time::Instant::now() + within;
        loop {
            let state = self.stack.fake.build_state(number).unwrap_or_default();
            if matches!(state.as_str(), "passed" | "failed" | "canceled") {
                return number;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "build {number} still {state} after {within:?}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The pipeline agent's log.
    pub fn pipeline_agent_log(&self) -> String {
        std::fs::read_to_string(&self.pipeline.log).unwrap_or_default()
    }

    /// `POST /v1/submissions/{id}/cancel`.
    pub async fn cancel(&self, id: &str) {
        let r = self
            .stack
            .http
            .post(format!("{}/v1/submissions/{id}/cancel", self.stack.base))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{:?}", r.text().await);
    }
}
