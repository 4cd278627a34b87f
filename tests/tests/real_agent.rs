//! The real Buildkite agent (`buildkite-agent bootstrap`, v3.137.0, built by
//! `scripts/buildkite-agent.sh` from `tests/buildkite-agent/go.mod`) running a job's plugin and
//! command phases, with no Buildkite behind it: what our emulations of the agent assume is
//! checked against what it does.
//!
//! - A plugin in a repository subdirectory (`<repository>.git/plugin#<commit>`, as the
//!   deployment pipelines name `github.com/kernelkite/kernelkite/plugin`) gets exactly the
//!   variables `kernelkite_service::buildkite::plugins::plugin_variables` makes, which local
//!   mode gives the plugin's hooks.
//! - Hook order: agent-level `environment` before the plugin's, agent-level `pre-exit` before
//!   the plugin's (the plugin's README and `plugin/src/job/env.rs` rely on this).
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
    let emulated = kernelkite_service::buildkite::plugins::plugin_variables(&location, &config);
    assert_eq!(seen, emulated, "{log}");
    assert_eq!(seen["BUILDKITE_PLUGIN_NAME"], "PLUGIN");
}
