//! The static build of `kernelkite-isolate` (musl), which nodes run the hooks from: it runs a
//! whole job by itself, and hands a hook that may need NVML to the dynamically linked build
//! (`kernelkite-isolate-nvml`) by `exec`, with the same arguments and exit status.
//!
//! `scripts/node-binaries.sh DIR` builds it and `scripts/test.sh` names it in
//! `KERNELKITE_STATIC_ISOLATE`; without it these tests skip, saying so.

use crate::agent;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use agent::{output_text, Install, Node, BIN};

/// The static build under test, or why there is none.
fn static_build() -> Option<PathBuf> {
    let bin = kernelkite_testkit::built_binary("KERNELKITE_STATIC_ISOLATE", None);
    if bin.is_none() {
        kernelkite_testkit::skip(
            "KERNELKITE_STATIC_ISOLATE is not set: build the static kernelkite-isolate with `scripts/node-binaries.sh DIR` and set it to DIR/kernelkite-isolate (scripts/test.sh does)",
        );
    }
    bin
}

/// Whether an ELF executable asks for a dynamic loader (has a `PT_INTERP` program header).
fn has_interpreter(elf: &[u8]) -> bool {
    assert_eq!(&elf[..4], b"\x7fELF", "not an ELF file");
    assert_eq!(elf[4], 2, "not a 64-bit ELF file");
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(elf[0x20..0x28].try_into().unwrap()) as usize;
    let (size, count) = (u16_at(0x36), u16_at(0x38));
    (0..count).any(|i| {
        let at = phoff + i * size;
        u32::from_le_bytes(elf[at..at + 4].try_into().unwrap()) == 3
    })
}

/// A program standing in for the NVML build: records its arguments and exits with 7.
fn recording_nvml_build(dir: &Path) -> (PathBuf, PathBuf) {
    let script = dir.join("kernelkite-isolate-nvml");
    let record = dir.join("nvml-build-argv");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$@\" > '{}'\nexit 7\n",
            record.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    (script, record)
}

/// A two-GPU node whose agent runs `bin`'s hooks, with a recording stand-in for the NVML
/// build named in the agent's environment.
struct Staged {
    node: Node,
    agent: agent::Agent,
    nvml: PathBuf,
    record: PathBuf,
    /// Holds the stand-in.
    _scratch: tempfile::TempDir,
}

fn staged(bin: &Path, agent_name: &str) -> Staged {
    let node = Node::new(2);
    let scratch = tempfile::tempdir().unwrap();
    let (nvml, record) = recording_nvml_build(scratch.path());
    let mut env = node.env.clone();
    env.insert(
        "KERNELKITE_ISOLATE_NVML_BIN".into(),
        nvml.display().to_string(),
    );
    let agent = agent::Agent::with_binary(node.path(), agent_name, &env, bin);
    Staged {
        node,
        agent,
        nvml,
        record,
        _scratch: scratch,
    }
}

fn job_id(n: u32) -> String {
    format!("0190b8c2-5a71-4000-8000-{n:012}")
}

#[test]
fn the_static_build_is_static_and_the_ordinary_build_is_not() {
    let Some(bin) = static_build() else { return };
    assert!(!has_interpreter(&std::fs::read(&bin).unwrap()), "{bin:?}");
    assert!(has_interpreter(&std::fs::read(BIN).unwrap()), "{BIN}");
}

#[test]
fn a_job_runs_whole_in_the_static_build() {
    let Some(bin) = static_build() else { return };
    let st = staged(&bin, "dgx01-gpu1");
    let id = job_id(1);
    let mut job = st.agent.start_job(
        &id,
        "echo \"seen=$CUDA_VISIBLE_DEVICES|$KERNELBOT_CPUSET\"",
        None,
        Install::AgentBinary,
    );
    for (hook, out) in job.run_all() {
        assert!(out.status.success(), "{hook}: {}", output_text(&out));
        if hook == "command" {
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                stdout.contains("seen=GPU-00000001-aaaa-bbbb-cccc-dddddddddddd|1"),
                "{stdout}"
            );
        }
    }
    assert!(
        !st.record.exists(),
        "no hook needed NVML, none was handed over"
    );
    assert!(
        !st.node.cgroup_dir(&id).exists(),
        "pre-exit removed the cgroup"
    );
}

#[test]
fn the_plugin_s_hook_files_run_the_static_build_and_hand_over_the_same_way() {
    let Some(bin) = static_build() else { return };
    let st = staged(&bin, "dgx01-gpu1");
    let mut job = st.agent.start_job(
        &job_id(5),
        "echo \"seen=$CUDA_VISIBLE_DEVICES\"",
        Some("{}"),
        Install::Plugin,
    );
    job.hooks_dir = agent::plugin_hooks(&bin, &st.node.path().join("plugin"));
    for (hook, out) in job.run_all() {
        assert!(out.status.success(), "{hook}: {}", output_text(&out));
        if hook == "command" {
            assert!(String::from_utf8_lossy(&out.stdout)
                .contains("seen=GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"));
        }
    }
    assert!(!st.record.exists(), "no hook needed NVML");
    // A step asking for locked clocks: `plugin-hook .../environment` becomes the NVML build's
    // `environment --export state`, as for an agent-level link.
    let mut job = st.agent.start_job(
        &job_id(6),
        "true",
        Some(r#"{"lock-clocks":1410}"#),
        Install::Plugin,
    );
    job.hooks_dir = agent::plugin_hooks(&bin, &st.node.path().join("plugin"));
    let out = job.run_hook("environment");
    assert_eq!(out.status.code(), Some(7), "{}", output_text(&out));
    assert_eq!(
        std::fs::read_to_string(&st.record).unwrap(),
        "environment\n--export\nstate\n"
    );
}

#[test]
fn a_hook_that_needs_nvml_runs_in_the_nvml_build_with_the_same_arguments() {
    let Some(bin) = static_build() else { return };
    let st = staged(&bin, "dgx01-gpu0");
    let mut job = st.agent.start_job(
        &job_id(2),
        "true",
        Some(r#"{"lock-clocks":1410}"#),
        Install::AgentBinary,
    );
    let out = job.run_hook("environment");
    // The exit status is the NVML build's: the hook was replaced, not wrapped.
    assert_eq!(out.status.code(), Some(7), "{}", output_text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the step asks for lock-clocks")
            && stderr.contains(&st.nvml.display().to_string()),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(&st.record).unwrap(),
        "environment\n--export\nstate\n"
    );
    // Nothing was done before the hand-over: no lease, no state, no cgroup.
    let run = st.node.path().join("run");
    let leftovers: Vec<_> = walk(&run).into_iter().filter(|p| p.is_file()).collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn pre_exit_of_a_job_with_locked_clocks_runs_in_the_nvml_build() {
    let Some(bin) = static_build() else { return };
    let st = staged(&bin, "dgx01-gpu0");
    let id = job_id(3);
    let mut job = st.agent.start_job(&id, "true", None, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    // As the NVML build leaves a job that locked its clocks.
    let state = st.node.path().join("run/jobs").join(format!("{id}.json"));
    let text = std::fs::read_to_string(&state).unwrap();
    assert!(text.contains(r#""clocks_locked":false"#), "{text}");
    std::fs::write(
        &state,
        text.replace(r#""clocks_locked":false"#, r#""clocks_locked":true"#),
    )
    .unwrap();
    let out = job.run_hook("pre-exit");
    assert_eq!(out.status.code(), Some(7), "{}", output_text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains(&format!("job {id} has its GPU clocks locked")),
        "{}",
        output_text(&out)
    );
    assert_eq!(std::fs::read_to_string(&st.record).unwrap(), "pre-exit\n");
}

#[test]
fn without_the_nvml_build_a_hook_that_needs_it_says_how_to_install_it() {
    let Some(bin) = static_build() else { return };
    // A copy with nothing beside it and nothing named by the environment.
    let scratch = tempfile::tempdir().unwrap();
    let alone = scratch.path().join("kernelkite-isolate");
    std::fs::copy(&bin, &alone).unwrap();
    let node = Node::new(1);
    let env: BTreeMap<String, String> = node.env.clone();
    let agent = agent::Agent::with_binary(node.path(), "dgx01-gpu0", &env, &alone);
    let mut job = agent.start_job(
        &job_id(4),
        "true",
        Some(r#"{"require-idle-gpu":true}"#),
        Install::AgentBinary,
    );
    let out = job.run_hook("environment");
    assert!(!out.status.success(), "{}", output_text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    for want in [
        "require-idle-gpu",
        "static build",
        &scratch
            .path()
            .join("kernelkite-isolate-nvml")
            .display()
            .to_string(),
        "setup --from",
        "KERNELKITE_ISOLATE_NVML_BIN",
    ] {
        assert!(stderr.contains(want), "missing {want:?} in {stderr}");
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            }
            out.push(p);
        }
    }
    out
}
