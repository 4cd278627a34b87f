//! The real Buildkite agent (`buildkite-agent bootstrap`, v3.137.0, built by
//! `scripts/buildkite-agent.sh` from `tests/buildkite-agent/go.mod`) running a job's plugin and
//! command phases, with no Buildkite behind it: what our emulations of the agent assume is
//! checked against what it does.
//!
//! - A plugin in a repository subdirectory (`<repository>.git/plugin#<commit>`, as the
//!   deployment pipelines name `github.com/kernelkite/kernelkite/plugin`) gets exactly the
//!   variables `kernelkite_agent::plugins::plugin_variables` makes, which local
//!   mode gives the plugin's hooks.
//! - Hook order: agent-level `environment` before the plugin's, agent-level `pre-exit` before
//!   the plugin's (the plugin's README and `crates/hooks/src/job/env.rs` rely on this).
//! - A polyglot hook (a first line naming another interpreter than a shell) is executed, not
//!   sourced, and what it sets through the Job API (`buildkite-agent env set`) reaches the
//!   command: the plugin's hook files (`#!/opt/kernelkite/bin/kernelkite-isolate plugin-hook`)
//!   export `environment`'s variables that way.
//!
//! The README's test command always builds the agent and names it in
//! `KERNELKITE_BUILDKITE_AGENT`; elsewhere the test looks in `target/` and skips (counted as
//! skipped) when the agent was never built.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use kernelkite_testkit::agent_node::git;
use kernelkite_testkit::deployment;
use serde_json::json;

/// The agent binary ([`deployment::agent`]); a skip when it was never built.
fn agent() -> Option<PathBuf> {
    let agent = deployment::agent();
    if agent.is_none() {
        kernelkite_testkit::skip(deployment::NO_AGENT);
    }
    agent
}

fn write_hook(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn the_real_agent_gives_plugin_variables_hook_order_and_job_api_exports_as_emulated() {
    let Some(agent) = agent() else {
        return;
    };
    let python = Path::new("/usr/bin/python3");
    if !python.exists() {
        kernelkite_testkit::skip("no /usr/bin/python3 for the polyglot hook");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let record = root.join("record");
    std::fs::create_dir(&record).unwrap();

    // The plugin, in a repository's `plugin` directory as ours is: a polyglot `environment`
    // hook (Python, so it cannot be sourced) and a shell `pre-exit`.
    let src = root.join("src");
    write_hook(
        &src.join("plugin/hooks/environment"),
        r#"#!/usr/bin/python3
import json, os, subprocess
rec = os.environ["KK_RECORD"]
with open(os.path.join(rec, "plugin-env.json"), "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith("BUILDKITE_PLUGIN_")}, f)
with open(os.path.join(rec, "order"), "a") as f:
    f.write("plugin environment\n")
subprocess.run(["buildkite-agent", "env", "set", "KK_FROM_PLUGIN=exported"], check=True,
               stdout=subprocess.DEVNULL)
"#,
    );
    write_hook(
        &src.join("plugin/hooks/pre-exit"),
        "#!/bin/bash\necho 'plugin pre-exit' >> \"$KK_RECORD/order\"\n",
    );
    std::fs::write(src.join("plugin/plugin.yml"), "name: recorder\n").unwrap();
    git(&src, &["init", "-q"]);
    git(&src, &["add", "-A"]);
    git(&src, &["commit", "-qm", "plugin"]);
    let commit = git(&src, &["rev-parse", "HEAD"]);
    let bare = root.join("kernelkite.git");
    git(
        root,
        &[
            "clone",
            "-q",
            "--bare",
            src.to_str().unwrap(),
            bare.to_str().unwrap(),
        ],
    );

    let hooks = root.join("agent-hooks");
    for name in ["environment", "pre-exit"] {
        write_hook(
            &hooks.join(name),
            &format!("#!/bin/bash\necho 'agent {name}' >> \"$KK_RECORD/order\"\n"),
        );
    }
    let location = format!("{}/plugin#{commit}", bare.display());
    let config = json!({"user": "nobody", "allow-syscalls": ["ptrace", "perf_event_open"],
                        "nested": {"a-b": 1}, "network": true, "tmp-size": "1G"});
    let agent_dir = agent.parent().unwrap();
    let out = Command::new(&agent)
        .args(["bootstrap", "--phases", "plugin,command"])
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", agent_dir.display()))
        .env("HOME", root)
        .env("KK_RECORD", &record)
        .env("BUILDKITE_AGENT_ACCESS_TOKEN", "a-token-never-used")
        .env("BUILDKITE_AGENT_ENDPOINT", "http://127.0.0.1:9/v3")
        .env("BUILDKITE_JOB_ID", "job-1")
        .env("BUILDKITE_BUILD_ID", "build-1")
        .env("BUILDKITE_AGENT_NAME", "agent-1")
        .env("BUILDKITE_ORGANIZATION_SLUG", "org")
        .env("BUILDKITE_PIPELINE_SLUG", "pipeline")
        .env("BUILDKITE_PIPELINE_PROVIDER", "git")
        .env("BUILDKITE_REPO", &bare)
        .env("BUILDKITE_COMMIT", &commit)
        .env("BUILDKITE_BRANCH", "main")
        .env("BUILDKITE_BUILD_PATH", root.join("builds"))
        .env("BUILDKITE_PLUGINS_PATH", root.join("plugins"))
        .env("BUILDKITE_HOOKS_PATH", &hooks)
        .env(
            "BUILDKITE_COMMAND",
            "echo \"command sees KK_FROM_PLUGIN=$KK_FROM_PLUGIN\" >> \"$KK_RECORD/order\"",
        )
        .env(
            "BUILDKITE_PLUGINS",
            json!([{ location.clone(): config.clone() }]).to_string(),
        )
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bootstrap failed:\n{log}");

    let order = std::fs::read_to_string(record.join("order")).unwrap_or_default();
    assert_eq!(
        order.lines().collect::<Vec<_>>(),
        [
            "agent environment",
            "plugin environment",
            "command sees KK_FROM_PLUGIN=exported",
            "agent pre-exit",
            "plugin pre-exit",
        ],
        "{log}"
    );
    let seen: BTreeMap<String, String> =
        serde_json::from_slice(&std::fs::read(record.join("plugin-env.json")).unwrap()).unwrap();
    // `BUILDKITE_PLUGINS` and `BUILDKITE_PLUGINS_PATH` are the step's and the agent's, not the
    // plugin's own.
    let seen: BTreeMap<String, String> = seen
        .into_iter()
        .filter(|(k, _)| k.starts_with("BUILDKITE_PLUGIN_"))
        .collect();
    let emulated = kernelkite_agent::plugins::plugin_variables(&location, &config);
    assert_eq!(seen, emulated, "{log}");
    assert_eq!(seen["BUILDKITE_PLUGIN_NAME"], "PLUGIN");
}

/// A multi-GPU queue's agent as `setup` renders it (`setup::render::agent_config`), started by
/// the real agent against the fake Buildkite: it registers `gpu-index` with every GPU of its
/// group (the hooks read that tag as `BUILDKITE_AGENT_META_DATA_GPU_INDEX`). The agent splits
/// its `tags` at commas, so the group must not be written with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_agent_registers_a_multi_gpu_agent_s_whole_group() {
    use kernelkite_admin::setup::render::{self, AgentLayout, MultiGpu, Options};
    let Some(agent) = agent() else {
        return;
    };
    let fake = kernelkite_testkit::fake_buildkite::FakeBuildkite::start().await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let topo = kernelkite_topology::fakesys::dgx_h100();
    topo.write_to(&root.join("sys")).unwrap();
    let topo = kernelkite_topology::Topology::discover(&root.join("sys")).unwrap();
    let plan = kernelkite_topology::planner::plan(&topo, &Default::default()).unwrap();
    let opts = Options {
        prefix: "/opt/kernelkite".into(),
        binaries_from: root.into(),
        optional_binaries: Vec::new(),
        queue: "h100".into(),
        node: "dgx01".into(),
        agents: AgentLayout::PerSlice,
        job_config: r#"{"mode":"host"}"#.into(),
        buildkite_agent: agent.clone(),
        token: Some(kernelkite_testkit::fake_buildkite::FAKE_AGENT_TOKEN.into()),
        plugin_location: "github.com/kernelkite/kernelkite/plugin".into(),
        job_env: Vec::new(),
        multi_gpu: Some(MultiGpu {
            queue: "h100-x4".into(),
            groups: vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]],
        }),
        verification_jwks: None,
    };
    let agents = render::agents(&plan, &opts);
    let group = agents.iter().find(|a| a.instance == "x4-1").unwrap();
    let (config, _) = render::agent_config(&plan, &opts, group);
    let cfg = root.join("x4-1.cfg");
    std::fs::write(&cfg, config).unwrap();
    for d in ["builds", "plugins", "hooks"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    let log = root.join("agent.log");
    let mut child = Command::new(&agent)
        .arg("start")
        .arg("--config")
        .arg(&cfg)
        .arg("--endpoint")
        .arg(fake.agent_api_url())
        .arg("--build-path")
        .arg(root.join("builds"))
        .arg("--plugins-path")
        .arg(root.join("plugins"))
        .arg("--hooks-path")
        .arg(root.join("hooks"))
        .env_clear()
        .env("HOME", root)
        .env("PATH", "/usr/bin:/bin")
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(root.join("agent.err")).unwrap())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let registered = loop {
        if let Some(a) = fake.registered_agents().into_iter().next() {
            break a;
        }
        if start.elapsed() > std::time::Duration::from_secs(30) {
            let _ = child.kill();
            panic!(
                "the agent did not register: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(registered.name, "dgx01-x4-1");
    assert!(
        registered.tags.contains(&"gpu-index=4+5+6+7".to_string()),
        "{:?}",
        registered.tags
    );
    assert!(registered.tags.contains(&"queue=h100-x4".to_string()));
    // What the hooks make of that tag: the whole group.
    let env = BTreeMap::from([(
        "BUILDKITE_AGENT_META_DATA_GPU_INDEX".to_string(),
        "4+5+6+7".to_string(),
    )]);
    assert_eq!(
        kernelkite_hooks::job::env::agent_gpus(&env).unwrap(),
        Some(vec![4, 5, 6, 7])
    );
}

/// The deployment's pipelines, uploaded by the real agent (`pipeline upload --dry-run`, which
/// interpolates as an upload does and prints the result): a build that pins nothing runs on
/// its queue alone; a canary's build (the service's `KERNELBOT_PIN_*`) is held to one agent's
/// `node` and `gpu-index` tags, and the runner version given to the upload (the pipeline
/// agent's command hook gives its own setting) is signed into the step's env.
#[test]
fn the_pipelines_pin_only_a_canary_s_build_to_one_agent() {
    let Some(agent) = agent() else {
        return;
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for file in [
        "deployment/pipelines/host.yml",
        "deployment/pipelines/docker.yml",
    ] {
        let upload = |pin: &[(&str, &str)]| -> serde_json::Value {
            let out = Command::new(&agent)
                .args(["pipeline", "upload", "--dry-run", "--format", "json"])
                .arg(root.join(file))
                .env_clear()
                .env("BUILDKITE_AGENT_ACCESS_TOKEN", "unused")
                .env("BUILDKITE_JOB_ID", "j")
                .env("BUILDKITE_BUILD_ID", "b")
                .env("KERNELBOT_QUEUE", "h100")
                .env("KERNELBOT_RUNNER_VERSION", "0.1.0")
                .envs(pin.iter().copied())
                .output()
                .unwrap();
            assert!(out.status.success(), "{file}: {out:?}");
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{file}: {e}: {out:?}"))
        };
        let plain = upload(&[]);
        let step = &plain["steps"][0];
        assert_eq!(step["agents"], json!({"queue": "h100"}), "{file}");
        assert_eq!(
            step["env"]["KERNELBOT_SIGNED_RUNNER_VERSION"], "0.1.0",
            "{file}"
        );
        let canary = upload(&[
            ("KERNELBOT_PIN_NODE_TAG", "node"),
            ("KERNELBOT_PIN_NODE", "dgx1"),
            ("KERNELBOT_PIN_GPU_TAG", "gpu-index"),
            ("KERNELBOT_PIN_GPU_INDEX", "3"),
        ]);
        assert_eq!(
            canary["steps"][0]["agents"],
            json!({"queue": "h100", "node": "dgx1", "gpu-index": "3"}),
            "{file}"
        );
    }
}
