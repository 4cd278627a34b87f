//! The hooks as the agent runs them (see `agent/`): agent-level links and the plugin's hook
//! files, the slice's variables reaching the command (and the Job API with `export-to-agent`),
//! leases by tag and pool, bad configuration, faults, clean-up. Cgroups here are a fake v2 tree; `hooks_cgroup_real*.rs` run the same hooks against the real kernel.

use crate::agent;

use std::collections::BTreeMap;
use std::path::Path;

use agent::{output_text, Install, Node};
use serde_json::json;

fn job_id(n: u32) -> String {
    format!("0190b8c2-0000-4000-8000-{n:012}")
}

#[test]
fn binary_hooks_give_the_command_its_slice_without_waiting_on_the_job_api() {
    let node = Node::new(4);
    let agent = node.agent("dgx01-gpu2");
    let id = job_id(1);
    let mut job = agent.start_job(
        &id,
        "echo \"seen=$CUDA_VISIBLE_DEVICES|$KERNELBOT_GPU_INDEX|$KERNELBOT_CPUSET|$KERNELBOT_MEMORY|$CUDA_DEVICE_ORDER\"",
        None,
        Install::AgentBinary,
    );
    let env_out = job.run_hook("environment");
    assert!(env_out.status.success(), "{}", output_text(&env_out));
    // The variables stay in the job's state for kernelkite's `command`: the agent is not
    // asked (its answer costs a job milliseconds, for hooks that are not kernelkite's).
    assert!(job.api.requests().is_empty());
    assert!(!job.env.contains_key("CUDA_VISIBLE_DEVICES"));
    let uuid = "GPU-00000002-aaaa-bbbb-cccc-dddddddddddd";
    assert_eq!(job.slice_env()["CUDA_VISIBLE_DEVICES"], uuid);
    assert_eq!(job.slice_env()["NVIDIA_VISIBLE_DEVICES"], uuid);
    assert_eq!(job.slice_env()["CUDA_DEVICE_ORDER"], "PCI_BUS_ID");
    assert_eq!(job.slice_env()["KERNELBOT_GPU_INDEX"], "2");
    assert_eq!(job.slice_env()["KERNELBOT_CPUSET"], "0");
    assert_eq!(job.slice_env()["KERNELBOT_MEMORY"], "256m");
    let slice: serde_json::Value =
        serde_json::from_str(&job.slice_env()["KERNELKITE_SLICE"]).unwrap();
    assert_eq!(slice["index"], 2);
    assert_eq!(slice["gpu"]["pci_bus_id"], "0000:1a:00.0");

    // The job cgroup exists with the slice's limits (fake v2 tree: the files the kernel reads).
    let cg = node.cgroup_dir(&id);
    let read = |f: &str| std::fs::read_to_string(cg.join(f)).unwrap();
    assert_eq!(read("cpuset.cpus"), "0");
    assert_eq!(read("cpuset.mems"), "0");
    assert_eq!(read("memory.max"), (256u64 << 20).to_string());
    assert_eq!(read("memory.swap.max"), "0");
    assert_eq!(read("pids.max"), "4096");
    let sub = std::fs::read_to_string(
        node.path()
            .join("cgroot/sys/fs/cgroup/kernelkite/cgroup.subtree_control"),
    )
    .unwrap();
    assert_eq!(sub, "+cpuset +memory +pids");

    let cmd = job.run_hook("command");
    assert!(cmd.status.success(), "{}", output_text(&cmd));
    let stdout = String::from_utf8_lossy(&cmd.stdout);
    assert!(
        stdout.contains(&format!("seen={uuid}|2|0|256m|PCI_BUS_ID")),
        "{stdout}"
    );
    // The command's shell joined the cgroup before exec.
    let procs = read("cgroup.procs");
    assert!(
        !procs.trim().is_empty(),
        "the command never wrote itself into cgroup.procs"
    );

    let exit = job.run_hook("pre-exit");
    assert!(exit.status.success(), "{}", output_text(&exit));
    let text = String::from_utf8_lossy(&exit.stdout);
    assert!(text.contains("released GPU lease(s) [2]"), "{text}");
    assert!(!cg.exists(), "pre-exit must remove the job cgroup");
    // Idempotent.
    let again = job.run_hook("pre-exit");
    assert!(again.status.success(), "{}", output_text(&again));
    assert!(String::from_utf8_lossy(&again.stdout).contains("nothing to clean up"));
}

#[test]
fn plugin_hook_files_are_executed_and_give_the_command_its_slice() {
    let node = Node::new(2);
    let agent = node.agent("pool-1");
    let mut job = agent.start_job(
        &job_id(2),
        "echo \"gpu=$KERNELBOT_GPU_INDEX\"; exit 7",
        Some(r#"{"gpus":1,"memory":"128M","pids-limit":64}"#),
        Install::Plugin,
    );
    let outs = job.run_all();
    let (_, env_out) = &outs[0];
    assert!(env_out.status.success(), "{}", output_text(env_out));
    // Executed, not sourced: nothing on stdout for a shell to evaluate, and no PATCH
    // without `export-to-agent`.
    assert!(
        !String::from_utf8_lossy(&env_out.stdout).contains("export "),
        "{}",
        output_text(env_out)
    );
    assert!(
        !job.api.requests().contains(&"PATCH".to_string()),
        "the plugin's environment hook exported through the Job API unasked"
    );
    assert_eq!(job.slice_env()["KERNELBOT_GPU_INDEX"], "0");
    assert_eq!(job.slice_env()["KERNELBOT_MEMORY"], "128m");
    assert_eq!(
        job.slice_env()["CUDA_VISIBLE_DEVICES"],
        "GPU-00000000-aaaa-bbbb-cccc-dddddddddddd"
    );
    let (_, cmd) = &outs[1];
    assert_eq!(
        cmd.status.code(),
        Some(7),
        "the exit code is the command's: {}",
        output_text(cmd)
    );
    assert!(String::from_utf8_lossy(&cmd.stdout).contains("gpu=0"));
    let (_, exit) = &outs[2];
    assert!(exit.status.success(), "{}", output_text(exit));
    assert!(!node.cgroup_dir(&job.id).exists());
}

#[test]
fn export_to_agent_hands_the_slice_to_the_agent_through_the_job_api() {
    let node = Node::new(2);
    let agent = node.agent("pool-1");
    let mut job = agent.start_job(
        &job_id(78),
        "echo \"gpu=$KERNELBOT_GPU_INDEX\"",
        Some(r#"{"export-to-agent":true}"#),
        Install::Plugin,
    );
    let env_out = job.run_hook("environment");
    assert!(env_out.status.success(), "{}", output_text(&env_out));
    assert_eq!(job.api.requests(), ["PATCH"]);
    // What the agent now holds for later hooks is what the command gets.
    let slice_env = job.slice_env();
    assert!(!slice_env.is_empty());
    for (k, v) in &slice_env {
        assert_eq!(job.env.get(k), Some(v), "{k}");
    }
    let cmd = job.run_hook("command");
    assert!(cmd.status.success(), "{}", output_text(&cmd));
    assert!(String::from_utf8_lossy(&cmd.stdout).contains("gpu=0"));
    assert!(job.run_hook("pre-exit").status.success());
}
/// With `export-to-agent` the Job API must take the variables: a job that cannot be told its
/// slice fails, and frees its GPU.
#[test]
fn wrong_or_missing_job_api_token_fails_the_job_and_frees_the_gpu() {
    let node = Node::new(1);
    let agent = node.agent("gpu-host-gpu0");
    let export = Some(r#"{"export-to-agent":true}"#);
    let mut job = agent.start_job(&job_id(3), "true", export, Install::Plugin);
    job.set_env("BUILDKITE_AGENT_JOB_API_TOKEN", "wrong");
    let out = job.run_hook("environment");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("401"), "{err}");
    assert!(!job.env.contains_key("KERNELBOT_GPU_INDEX"));

    let mut job2 = agent.start_job(&job_id(4), "true", export, Install::Plugin);
    job2.env.remove("BUILDKITE_AGENT_JOB_API_TOKEN");
    let out = job2.run_hook("environment");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("BUILDKITE_AGENT_JOB_API_TOKEN"));

    // Neither failure kept the (only) GPU.
    let mut job3 = agent.start_job(
        &job_id(5),
        "true",
        Some(r#"{"lease-wait":0}"#),
        Install::Plugin,
    );
    let out = job3.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
}

/// A checkout path the agent did not compute (a build's variables set it, and the agent keeps
/// it) is refused at `environment`, before anything is held: the hooks would hand that
/// directory to the job's user. The GPU stays free for the next job.
#[test]
fn a_checkout_outside_the_agent_s_build_path_is_refused_before_anything_is_held() {
    let node = Node::new(1);
    let agent = node.agent("gpu-host-gpu0");
    let mut job = agent.start_job(&job_id(9), "true", None, Install::AgentBinary);
    let checkout = job.env["BUILDKITE_BUILD_CHECKOUT_PATH"].clone();
    // The agent's build path here: the directory above each job's own.
    let builds = Path::new(&checkout)
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .display()
        .to_string();
    job.env
        .insert("BUILDKITE_BUILD_PATH".into(), builds.clone());
    job.env
        .insert("BUILDKITE_BUILD_CHECKOUT_PATH".into(), "/usr".into());
    let out = job.run_hook("environment");
    assert!(!out.status.success(), "{}", output_text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"/usr\" (BUILDKITE_BUILD_CHECKOUT_PATH) is not a directory under the agent's build path")
            && err.contains("refused"),
        "{err}"
    );
    assert!(!job.env.contains_key("KERNELBOT_GPU_INDEX"));
    // The agent's own path under its build path is the normal case, and the GPU is free.
    let mut next = agent.start_job(
        &job_id(10),
        "true",
        Some(r#"{"lease-wait":0}"#),
        Install::AgentBinary,
    );
    next.env.insert("BUILDKITE_BUILD_PATH".into(), builds);
    let out = next.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
}

#[test]
fn without_the_job_api_only_export_to_agent_fails_and_says_so() {
    let node = Node::new(1);
    let agent = node.agent("a");
    // The agent-level hooks never need it: the command gets its slice from the job's state.
    let mut job = agent.start_job(&job_id(6), "true", None, Install::AgentBinary);
    job.env.remove("BUILDKITE_AGENT_JOB_API_SOCKET");
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(job.run_hook("pre-exit").status.success());
    // A step that asks for the export cannot have it.
    let export = Some(r#"{"export-to-agent":true}"#);
    let mut job = agent.start_job(&job_id(79), "true", export, Install::Plugin);
    job.env.remove("BUILDKITE_AGENT_JOB_API_SOCKET");
    let out = job.run_hook("environment");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Job API"),
        "{}",
        output_text(&out)
    );
}

#[test]
fn bad_configuration_fails_at_environment_with_the_schema_error() {
    let node = Node::new(1);
    let agent = node.agent("a");
    for (cfg, key, what) in [
        (r#"{"gpu":1}"#, "gpu", "unknown key"),
        (r#"{"gpus":"one"}"#, "gpus", "expected an integer"),
        (r#"{"mode":"docker"}"#, "image", "required"),
        (r#"{"lock-clocks":"fast"}"#, "lock-clocks", "expected true"),
    ] {
        for install in [Install::AgentBinary, Install::Plugin] {
            let mut job = agent.start_job(&job_id(7), "true", Some(cfg), install);
            let out = job.run_hook("environment");
            assert!(!out.status.success(), "{cfg} was accepted");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains(&format!("plugin configuration is invalid: {key}:"))
                    && err.contains(what),
                "{cfg} ({install:?}): {err}"
            );
            assert!(!job.env.contains_key("KERNELBOT_GPU_INDEX"));
        }
    }
    assert!(
        !node.path().join("run/jobs").exists()
            || std::fs::read_dir(node.path().join("run/jobs"))
                .unwrap()
                .count()
                == 0
    );
}

#[test]
fn misconfigured_agents_on_one_gpu_wait_then_name_the_holder() {
    let node = Node::new(2);
    let mut tagged = node.env.clone();
    tagged.insert("BUILDKITE_AGENT_META_DATA_GPU_INDEX".into(), "1".into());
    let a = agent::Agent::new(node.path(), "host-a", &tagged);
    let b = agent::Agent::new(node.path(), "host-b", &tagged);
    let mut first = a.start_job(&job_id(8), "true", None, Install::AgentBinary);
    assert!(first.run_hook("environment").status.success());
    assert_eq!(first.slice_env()["KERNELBOT_GPU_INDEX"], "1");
    let mut second = b.start_job(
        &job_id(9),
        "true",
        Some(r#"{"lease-wait":1}"#),
        Install::AgentBinary,
    );
    let started = std::time::Instant::now();
    let out = second.run_hook("environment");
    assert!(!out.status.success());
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(900),
        "did not wait"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("GPU 1 is held by job {}", job_id(8))) && err.contains("host-a"),
        "{err}"
    );
    // The holder finishing frees it.
    assert!(first.run_hook("pre-exit").status.success());
    let out = second.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
}

#[test]
fn agent_bound_to_a_gpu_the_plan_lacks_is_refused() {
    let node = Node::new(2);
    let a = node.agent("host-gpu5");
    let mut job = a.start_job(&job_id(10), "true", None, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no slice for GPU 5"),
        "{}",
        output_text(&out)
    );
}

#[test]
fn lost_job_is_cleaned_up_by_the_next_environment_hook() {
    let node = Node::new(1);
    let agent = node.agent("pool");
    let mut lost = agent.start_job(&job_id(11), "true", None, Install::AgentBinary);
    assert!(lost.run_hook("environment").status.success());
    assert!(node.cgroup_dir(&lost.id).exists());
    // The agent dies mid-job: no pre-exit, and the bootstrap process is gone.
    lost.bootstrap.kill().unwrap();
    lost.bootstrap.wait().unwrap();

    let mut next = agent.start_job(
        &job_id(12),
        "true",
        Some(r#"{"lease-wait":0}"#),
        Install::AgentBinary,
    );
    let out = next.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("cleaned up after a lost job: job {}", lost.id)),
        "{err}"
    );
    assert!(!node.cgroup_dir(&lost.id).exists());
    assert_eq!(next.slice_env()["KERNELBOT_GPU_INDEX"], "0");
}

#[test]
/// An empty job cgroup without state, made over an hour ago, is a lost job's and goes; one
/// made lately may be another instance's job between its `environment` and `command` hooks
/// (its checkout running) and stays.
fn orphaned_cgroup_without_state_is_removed() {
    let node = Node::new(1);
    let stray = node.cgroup_dir("stray-job");
    let recent = node.cgroup_dir("recent-job");
    for dir in [&stray, &recent] {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("cgroup.procs"), "").unwrap();
    }
    let two_hours_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
    std::fs::File::open(&stray)
        .unwrap()
        .set_modified(two_hours_ago)
        .unwrap();
    let agent = node.agent("pool");
    let mut job = agent.start_job(&job_id(13), "true", None, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(!stray.exists());
    assert!(recent.exists());
}

#[test]
fn gpu_checks_without_nvml_fail_at_environment_and_free_the_gpu() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        kernelkite_testkit::skip("this machine has the NVIDIA driver, NVML would load");
        return;
    }
    let node = Node::new(1);
    let agent = node.agent("pool");
    for cfg in [r#"{"require-idle-gpu":true}"#, r#"{"lock-clocks":true}"#] {
        let mut job = agent.start_job(&job_id(14), "true", Some(cfg), Install::AgentBinary);
        let out = job.run_hook("environment");
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("libnvidia-ml.so.1"),
            "{}",
            output_text(&out)
        );
        assert!(!node.cgroup_dir(&job.id).exists());
    }
    let mut job = agent.start_job(
        &job_id(15),
        "true",
        Some(r#"{"lease-wait":0}"#),
        Install::AgentBinary,
    );
    assert!(job.run_hook("environment").status.success());
}

/// The NVML paths of the hooks, through the real loader, against the stand-in library
/// (`kernelkite_testkit::fake_nvml`) as `libnvidia-ml.so.1`: `require-idle-gpu` refuses a GPU
/// a process is using (and frees the slice), and `lock-clocks` locks the slice's GPU at its
/// maximum at `environment` and restores it at `pre-exit`.
#[test]
fn gpu_checks_through_nvml_refuse_a_busy_gpu_and_lock_then_restore_clocks() {
    use kernelkite_testkit::fake_nvml::{h100, FakeNvml};
    let fake = match FakeNvml::build() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit::skip(&why),
    };
    let node = Node::new(1);
    let bus = "0000:18:00.0"; // the plan's slice 0
    let mut env = node.env.clone();
    env.extend(fake.env());
    let agent = agent::Agent::new(node.path(), "pool", &env);

    fake.configure(&format!(
        "{}proc {bus} 4242 1073741824\n",
        h100(bus, 0, 1 << 30)
    ));
    let mut job = agent.start_job(
        &job_id(41),
        "true",
        Some(r#"{"require-idle-gpu":true}"#),
        Install::AgentBinary,
    );
    let out = job.run_hook("environment");
    assert!(!out.status.success(), "{}", output_text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is not idle") && err.contains("pid 4242"),
        "{}",
        output_text(&out)
    );
    assert!(
        !node.cgroup_dir(&job.id).exists(),
        "the busy GPU's slice is freed"
    );

    fake.configure(&h100(bus, 0, 0));
    let mut job = agent.start_job(
        &job_id(42),
        "true",
        Some(r#"{"require-idle-gpu":true,"lock-clocks":true}"#),
        Install::AgentBinary,
    );
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(fake.log(), format!("lock {bus} 1980 1980\n"));
    let out = job.run_hook("pre-exit");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(fake.log(), format!("lock {bus} 1980 1980\nreset {bus}\n"));
}

#[test]
fn unusable_cgroups_fail_clearly_unless_unenforced_is_allowed() {
    let node = Node::new(1);
    // cgroup v1 hierarchies that refuse new groups (sysfs refuses mkdir, even for root).
    let root = node.path().join("ro-cgroot");
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    std::fs::create_dir_all(root.join("sys/fs/cgroup")).unwrap();
    let mut mountinfo = String::new();
    for c in ["cpuset", "memory", "pids"] {
        std::os::unix::fs::symlink("/sys/kernel", root.join("sys/fs/cgroup").join(c)).unwrap();
        mountinfo.push_str(&format!(
            "1 1 0:1 / /sys/fs/cgroup/{c} rw - cgroup cgroup rw,{c}\n"
        ));
    }
    std::fs::write(root.join("proc/self/mountinfo"), mountinfo).unwrap();
    let mut env = node.env.clone();
    env.insert("KERNELKITE_CGROUP_ROOT".into(), root.display().to_string());
    let agent = agent::Agent::new(node.path(), "pool", &env);

    let mut job = agent.start_job(&job_id(16), "true", None, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot write") && err.contains("allow-unenforced"),
        "{err}"
    );

    let mut job = agent.start_job(
        &job_id(17),
        "echo ran",
        Some(r#"{"allow-unenforced":true,"lease-wait":0}"#),
        Install::AgentBinary,
    );
    let outs = job.run_all();
    assert!(
        outs.iter().all(|(_, o)| o.status.success()),
        "{:?}",
        outs.iter()
            .map(|(h, o)| format!("{h}: {}", output_text(o)))
            .collect::<Vec<_>>()
    );
    assert!(String::from_utf8_lossy(&outs[0].1.stderr).contains("RUNNING UNENFORCED"));
    assert!(String::from_utf8_lossy(&outs[1].1.stderr).contains("RUNNING UNENFORCED"));
    assert!(String::from_utf8_lossy(&outs[1].1.stdout).contains("ran"));
}

#[test]
fn command_hook_without_environment_refuses_to_run_unconfined() {
    let node = Node::new(1);
    let agent = node.agent("pool");
    let mut job = agent.start_job(
        &job_id(18),
        "echo should-not-run",
        None,
        Install::AgentBinary,
    );
    let out = job.run_hook("command");
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stdout).contains("should-not-run"));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("environment` hook did not run"),
        "{}",
        output_text(&out)
    );
    // pre-exit with nothing to do is fine.
    assert!(job.run_hook("pre-exit").status.success());
}

#[test]
fn a_step_naming_the_plugin_on_a_node_with_agent_level_hooks_is_prepared_once() {
    // What `setup` makes and the deployment pipelines use: agent-level hooks, and a step that
    // names the plugin. The agent runs environment agent-level first, then the plugin's; the
    // plugin's command only; pre-exit the plugin's first, then the agent-level one.
    let node = Node::new(2);
    let agent = node.agent("pool");
    let cfg = r#"{"gpus":1,"memory":"128M","lease-wait":0}"#;
    let mut job = agent.start_job(
        &job_id(22),
        "echo \"gpu=$KERNELBOT_GPU_INDEX mem=$KERNELBOT_MEMORY\"",
        Some(cfg),
        Install::AgentBinary,
    );
    // The agent gives the step's plugin configuration to the plugin's hooks only.
    let plugin_vars: Vec<String> = job
        .env
        .keys()
        .filter(|k| k.starts_with("BUILDKITE_PLUGIN_"))
        .cloned()
        .collect();
    let mut for_plugin = BTreeMap::new();
    for k in &plugin_vars {
        for_plugin.insert(k.clone(), job.env.remove(k).unwrap());
        job.api.set(k, None);
    }
    assert!(job.env.contains_key("BUILDKITE_PLUGINS"));
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("the step uses the kernelkite plugin"),
        "{}",
        output_text(&out)
    );
    assert!(!job.env.contains_key("KERNELBOT_GPU_INDEX"));
    let jobs_dir = node.path().join("run/jobs");
    let states = || {
        std::fs::read_dir(&jobs_dir)
            .map(|d| d.filter_map(Result::ok).count())
            .unwrap_or(0)
    };
    assert_eq!(states(), 0, "the agent-level hook prepared the job");
    assert!(!node.cgroup_dir(&job.id).exists());

    job.install = Install::Plugin;
    job.hooks_dir = agent::plugin_hooks(Path::new(agent::BIN), &node.path().join("plugin"));
    for (k, v) in &for_plugin {
        job.set_env(k, v);
    }
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(
        job.slice_env()["KERNELBOT_MEMORY"],
        "128m",
        "the step's configuration"
    );
    assert_eq!(states(), 1);
    let out = job.run_hook("command");
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("mem=128m"));
    assert!(job.run_hook("pre-exit").status.success());
    assert_eq!(states(), 0);
    job.install = Install::AgentBinary;
    job.hooks_dir = agent.hooks_dir.clone();
    for k in for_plugin.keys() {
        job.env.remove(k);
    }
    let out = job.run_hook("pre-exit");
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("the step uses the kernelkite plugin"),
        "{}",
        output_text(&out)
    );
    assert!(!node.cgroup_dir(&job.id).exists());
    // Both GPUs are free again.
    for n in [23, 24] {
        let mut next = agent.start_job(
            &job_id(n),
            "true",
            Some(r#"{"lease-wait":0}"#),
            Install::Plugin,
        );
        assert!(next.run_hook("environment").status.success());
    }
}

#[test]
fn environment_twice_in_one_job_keeps_one_lease() {
    // Agent-level hooks and the plugin both installed: two environment hooks per job.
    let node = Node::new(2);
    let agent = node.agent("pool");
    let mut job = agent.start_job(&job_id(19), "true", None, Install::AgentBinary);
    assert!(job.run_hook("environment").status.success());
    let first: BTreeMap<_, _> = job.slice_env();
    job.install = Install::Plugin;
    job.hooks_dir = agent::plugin_hooks(Path::new(agent::BIN), &node.path().join("plugin"));
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(
        job.slice_env()["KERNELBOT_GPU_INDEX"],
        first["KERNELBOT_GPU_INDEX"]
    );
    // A second job still gets the other GPU, not a third lease on the first.
    let mut other = agent.start_job(
        &job_id(20),
        "true",
        Some(r#"{"lease-wait":0}"#),
        Install::AgentBinary,
    );
    assert!(other.run_hook("environment").status.success());
    assert_ne!(
        other.slice_env()["KERNELBOT_GPU_INDEX"],
        job.slice_env()["KERNELBOT_GPU_INDEX"]
    );
}

#[test]
fn the_lease_follows_the_agent_bootstrap_found_among_ancestors() {
    // A process named `buildkite-agent` (a copy of bash) plays the agent's per-job bootstrap and
    // executes the plugin's hook file; no KERNELKITE_JOB_PID is set.
    let node = Node::new(1);
    let bash = String::from_utf8(
        std::process::Command::new("bash")
            .args(["-c", "command -v bash"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let fake_agent = node.path().join("buildkite-agent");
    std::fs::copy(bash.trim(), &fake_agent).unwrap();
    let pidfile = node.path().join("bootstrap.pid");
    let hooks = agent::plugin_hooks(Path::new(agent::BIN), &node.path().join("plugin"));
    let script = format!(
        "echo $$ > {}; {}/environment; sleep 30",
        pidfile.display(),
        hooks.display()
    );
    let api = agent::JobApiServer::start(node.path(), "anchor-token", node.env.clone());
    let mut bootstrap = std::process::Command::new(&fake_agent)
        .args(["-c", &script])
        .envs(&node.env)
        .env("BUILDKITE_JOB_ID", "job-anchor")
        .env("BUILDKITE_AGENT_NAME", "pool")
        .env("BUILDKITE_AGENT_JOB_API_SOCKET", &api.socket)
        .env("BUILDKITE_AGENT_JOB_API_TOKEN", &api.token)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lease = node.path().join("run/leases/gpu0.lock");
    let start = std::time::Instant::now();
    let holder = loop {
        let text = std::fs::read_to_string(&lease).unwrap_or_default();
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
            break v;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(10),
            "no lease taken"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let bootstrap_pid: u64 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        holder["anchor"]["pid"].as_u64(),
        Some(bootstrap_pid),
        "{holder}"
    );
    assert_eq!(holder["job_id"], "job-anchor");
    // The bootstrap dies without pre-exit: the GPU is free for the next job at once.
    bootstrap.kill().unwrap();
    bootstrap.wait().unwrap();
    let agent = node.agent("pool");
    let mut next = agent.start_job(
        &job_id(21),
        "true",
        Some(r#"{"lease-wait":0}"#),
        Install::AgentBinary,
    );
    let out = next.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
}

#[test]
fn job_api_client_against_the_agent_protocol() {
    use kernelkite_hooks::jobapi::JobApi;
    let dir = tempfile::tempdir().unwrap();
    let start: BTreeMap<String, String> = [("A".to_string(), "1".to_string())].into();
    let server = agent::JobApiServer::start(dir.path(), "sekrit", start);
    let api = JobApi::new(&server.socket, "sekrit");
    assert_eq!(api.get_env().unwrap()["A"], "1");
    api.patch_env(&[("B".to_string(), "two words".to_string())].into())
        .unwrap();
    assert_eq!(server.env()["B"], "two words");
    api.delete_env(&["A".to_string()]).unwrap();
    assert!(!server.env().contains_key("A"));
    let e = JobApi::new(&server.socket, "wrong").get_env().unwrap_err();
    assert!(
        matches!(
            e,
            kernelkite_hooks::jobapi::JobApiError::Unauthorized { .. }
        ),
        "{e}"
    );
    let e = e.to_string();
    assert!(
        e.contains("401") && e.contains("BUILDKITE_AGENT_JOB_API_TOKEN"),
        "{e}"
    );
    let e = JobApi::new(&server.socket, "")
        .patch_env(&BTreeMap::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("401"), "{e}");
}

#[test]
fn other_gpus_device_numbers_reach_the_cgroup_layer() {
    // On the fake v2 tree the devices cannot be denied (no BPF): the job log must say so, which
    // shows the other GPU's device number was found and handed to the cgroup layer.
    let node = Node::new(2);
    let sys = node.path().join("sysfs");
    let info = sys.join("proc/driver/nvidia/gpus/0000:19:00.0");
    std::fs::create_dir_all(&info).unwrap();
    std::fs::write(
        info.join("information"),
        "Model: H100\nDevice Minor: \t 1\n",
    )
    .unwrap();
    let mut env = node.env.clone();
    env.insert("KERNELKITE_SYSFS_ROOT".into(), sys.display().to_string());
    let agent = agent::Agent::new(node.path(), "host-gpu0", &env);
    let mut job = agent.start_job(&job_id(22), "true", None, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("restricts devices only through BPF"), "{err}");
    // Without the other GPU's driver file there is nothing to deny and no warning.
    let plain = node.agent("host-gpu1");
    let mut job = plain.start_job(&job_id(23), "true", None, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("BPF"),
        "{}",
        output_text(&out)
    );
}

#[test]
fn a_step_without_a_command_runs_nothing_and_succeeds() {
    let node = Node::new(1);
    let agent = node.agent("pool");
    let mut job = agent.start_job(&job_id(24), "", None, Install::AgentBinary);
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    assert!(String::from_utf8_lossy(&outs[1].1.stderr).contains("no command"));
}

#[test]
fn a_slice_of_two_amd_gpus_is_numbered_as_the_job_sees_them_and_hip_is_left_alone() {
    let node = Node::new(1);
    let gpu = |bus: &str| json!({"vendor": "amd", "pci_bus_id": bus, "uuid": null, "numa_node": 0});
    let plan = json!({"slices": [
        {"index": 0, "gpu": gpu("0000:0c:00.0"), "extra_gpus": [gpu("0000:22:00.0")],
         "cpus": [0], "mems": [0], "memory_bytes": 256u64 << 20},
        {"index": 1, "gpu": gpu("0000:38:00.0"), "extra_gpus": [gpu("0000:5c:00.0")],
         "cpus": [1], "mems": [0], "memory_bytes": 256u64 << 20}],
        "reserved_cpus": [], "warnings": []});
    std::fs::write(node.path().join("plan.json"), plan.to_string()).unwrap();
    let agent = node.agent("mi300x-gpu1");
    let mut job = agent.start_job(&job_id(40), "true", None, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    // This node runs with the sandbox off: the job sees the host's /dev, where ROCr numbers
    // every GPU, so its GPUs are 2 and 3 (in the sandbox's private /dev they are 0 and 1:
    // job::devices' per-slice test). HIP is never told again (kernelkite_sys::kfd).
    assert_eq!(job.slice_env()["ROCR_VISIBLE_DEVICES"], "2,3");
    assert!(
        !job.env.contains_key("HIP_VISIBLE_DEVICES"),
        "{:?}",
        job.env
    );
    assert_eq!(job.slice_env()["KERNELBOT_GPU_INDEX"], "2,3");
    let out = job.run_hook("pre-exit");
    assert!(out.status.success(), "{}", output_text(&out));
}

/// Issue 36: a MIG slice whose MIG device is gone (destroyed, or not made again after a
/// reboot) is refused by `environment` before anything is held, saying what to run; so is one
/// whose plan was written before this boot (every boot gives MIG devices new uuids). The
/// driver's files say it (`/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/ci<c>`), no
/// NVML needed; the other MIG slice still runs, and no cgroup or lease is left.
#[test]
fn a_mig_job_whose_mig_device_is_gone_is_refused_before_anything_is_held() {
    use kernelkite_testkit::fake_nvml::mig_uuid;
    let node = Node::new(1);
    let bus = "0000:2a:00.0";
    let slice = |index: u32, gi: u32| {
        let uuid = mig_uuid(bus, gi, 0);
        json!({"index": index,
               "gpu": {"vendor": "nvidia", "pci_bus_id": bus, "uuid": uuid, "numa_node": 0,
                       "mig": {"uuid": uuid, "gpu_instance_id": gi, "compute_instance_id": 0,
                               "memory_bytes": 20u64 << 30}},
               "cpus": [0], "mems": [0], "memory_bytes": 256u64 << 20})
    };
    let plan = json!({"slices": [slice(1, 3), slice(2, 5)], "reserved_cpus": [], "warnings": []});
    let plan_file = node.path().join("plan.json");
    std::fs::write(&plan_file, plan.to_string()).unwrap();
    // The driver's files: GPU 1 (minor 1) with both instances.
    let sys = node.path().join("sys-root");
    let info = sys.join("proc/driver/nvidia/gpus").join(bus);
    std::fs::create_dir_all(&info).unwrap();
    std::fs::write(
        info.join("information"),
        "Model: NVIDIA H100 80GB HBM3\nDevice Minor: 1\n",
    )
    .unwrap();
    let mig_dir = sys.join("proc/driver/nvidia/capabilities/gpu1/mig");
    for gi in [3, 5] {
        std::fs::create_dir_all(mig_dir.join(format!("gi{gi}/ci0"))).unwrap();
    }
    let mut env = node.env.clone();
    env.insert("KERNELKITE_SYSFS_ROOT".into(), sys.display().to_string());
    // Agents named `…-gpu<N>` are bound to slice N; slice N runs GPU instance `gi`.
    let run = |agent: &str, n: u32| {
        let gi = if agent.ends_with("gpu1") { 3 } else { 5 };
        let agent = agent::Agent::new(node.path(), agent, &env);
        let mut job = agent.start_job(&job_id(n), "true", None, Install::AgentBinary);
        let out = job.run_hook("environment");
        let text = output_text(&out);
        let ok = out.status.success();
        if ok {
            assert_eq!(
                job.slice_env()["CUDA_VISIBLE_DEVICES"],
                mig_uuid(bus, gi, 0)
            );
            let done = job.run_hook("pre-exit");
            assert!(done.status.success(), "{}", output_text(&done));
        }
        assert!(
            !node.cgroup_dir(&job.id).exists(),
            "a cgroup was left: {text}"
        );
        (ok, text)
    };
    let (ok, text) = run("mig-gpu2", 70);
    assert!(ok, "{text}");

    // GPU instance 5 destroyed: its slice is refused, the other still runs.
    std::fs::remove_dir_all(mig_dir.join("gi5")).unwrap();
    let (ok, text) = run("mig-gpu2", 71);
    assert!(!ok);
    assert!(
        text.contains(&mig_uuid(bus, 5, 0))
            && text.contains("plan --refresh")
            && text.contains("was not started"),
        "{text}"
    );
    let (ok, text) = run("mig-gpu1", 72);
    assert!(ok, "{text}");
    // The slice's lease was given back: with the instance made again, its job runs.
    std::fs::create_dir_all(mig_dir.join("gi5/ci0")).unwrap();
    let (ok, text) = run("mig-gpu2", 73);
    assert!(ok, "{text}");

    // A plan written before this boot: its MIG uuids are from another boot.
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let btime: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
        .expect("btime");
    let touched = std::process::Command::new("touch")
        .arg("-d")
        .arg(format!("@{}", btime - 3600))
        .arg(&plan_file)
        .status()
        .unwrap();
    assert!(touched.success());
    let (ok, text) = run("mig-gpu1", 74);
    assert!(!ok);
    assert!(
        text.contains("before this boot") && text.contains("plan --refresh"),
        "{text}"
    );
}

/// A GPU in MIG mode cut into two slices (plan from NVML's MIG enumeration: the topology
/// crate's stand-in test). The slice's job sees its MIG device by uuid; `require-idle-gpu`
/// asks NVML about that MIG device, not the GPU (another MIG device's process is not in the
/// way; its own is); `lock-clocks` leaves the shared clock alone; and a job of two slices of
/// which one is a MIG device is refused, naming the fix.
#[test]
fn a_mig_slice_sees_its_mig_device_and_is_checked_as_one() {
    use kernelkite_testkit::fake_nvml::{h100, mig, mig_uuid, FakeNvml};
    let fake = match FakeNvml::build() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit::skip(&why),
    };
    let node = Node::new(1);
    let bus = "0000:2a:00.0";
    let (m3, m5) = (mig_uuid(bus, 3, 0), mig_uuid(bus, 5, 0));
    let slice = |index: u32, gi: u32, uuid: &str| {
        json!({"index": index,
               "gpu": {"vendor": "nvidia", "pci_bus_id": bus, "uuid": uuid, "numa_node": 0,
                       "mig": {"uuid": uuid, "gpu_instance_id": gi, "compute_instance_id": 0,
                               "memory_bytes": 20u64 << 30}},
               "cpus": [0], "mems": [0], "memory_bytes": 256u64 << 20})
    };
    let plan = json!({"slices": [
        {"index": 0, "gpu": {"vendor": "nvidia", "pci_bus_id": "0000:18:00.0", "uuid": null,
                             "numa_node": 0},
         "cpus": [0], "mems": [0], "memory_bytes": 256u64 << 20},
        slice(1, 3, &m3), slice(2, 5, &m5)],
        "reserved_cpus": [], "warnings": []});
    std::fs::write(node.path().join("plan.json"), plan.to_string()).unwrap();
    let mut env = node.env.clone();
    env.extend(fake.env());
    let config = Some(r#"{"require-idle-gpu":true,"lock-clocks":true}"#);

    // A process on the other MIG device of the same GPU: this slice is idle.
    fake.configure(&format!(
        "{}{}{}proc {m5} 4242 1073741824\n",
        h100(bus, 1, 2 << 30),
        mig(bus, 3, 0, 20),
        mig(bus, 5, 0, 20)
    ));
    let agent = agent::Agent::new(node.path(), "mig-gpu1", &env);
    let mut job = agent.start_job(&job_id(60), "true", config, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(job.slice_env()["CUDA_VISIBLE_DEVICES"], m3);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("lock-clocks skipped") && err.contains("MIG mode"),
        "{err}"
    );
    let out = job.run_hook("pre-exit");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(
        fake.log(),
        "",
        "the shared clock is neither locked nor reset"
    );

    // Its own MIG device busy: refused, and the slice is free again.
    let agent = agent::Agent::new(node.path(), "mig-gpu2", &env);
    let mut job = agent.start_job(&job_id(61), "true", config, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(!out.status.success(), "{}", output_text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is not idle") && err.contains("pid 4242"),
        "{err}"
    );
    assert!(!node.cgroup_dir(&job.id).exists());

    // Two slices, one of them a MIG device: one job cannot use both.
    let mut two = env.clone();
    two.insert("BUILDKITE_AGENT_META_DATA_GPU_INDEX".into(), "0,1".into());
    let agent = agent::Agent::new(node.path(), "pair", &two);
    let mut job = agent.start_job(
        &job_id(62),
        "true",
        Some(r#"{"gpus":2}"#),
        Install::AgentBinary,
    );
    let out = job.run_hook("environment");
    assert!(!out.status.success(), "{}", output_text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("slice 1 is a MIG device") && err.contains("gpus: 1"),
        "{err}"
    );
}

/// A multi-GPU queue's agent bound to two NVIDIA slices in host mode, its step leaving `gpus`
/// to the binding (as the deployment's pipelines do): the job gets both GPUs by UUID, both
/// slices' CPUs, and one lease per GPU, all freed at `pre-exit`.
#[test]
fn a_two_gpu_agent_s_job_gets_both_gpus_without_naming_a_count() {
    let node = Node::new(3);
    let mut env = node.env.clone();
    // As setup writes a group in the agent's tags (the agent splits them at commas).
    env.insert("BUILDKITE_AGENT_META_DATA_GPU_INDEX".into(), "1+2".into());
    let agent = agent::Agent::new(node.path(), "dgx-x2-0", &env);
    let mut job = agent.start_job(&job_id(63), "true", Some("{}"), Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(
        job.slice_env()["CUDA_VISIBLE_DEVICES"],
        "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd,GPU-00000002-aaaa-bbbb-cccc-dddddddddddd"
    );
    assert_eq!(job.slice_env()["KERNELBOT_GPU_INDEX"], "1,2");
    let slice: serde_json::Value =
        serde_json::from_str(&job.slice_env()["KERNELKITE_SLICE"]).unwrap();
    assert_eq!(
        slice["extra_gpus"].as_array().map(Vec::len),
        Some(1),
        "{slice}"
    );
    // Given, a count must match the binding.
    let mut wrong = agent.start_job(
        &job_id(64),
        "true",
        Some(r#"{"gpus":1}"#),
        Install::AgentBinary,
    );
    let out = wrong.run_hook("environment");
    assert!(!out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("bound to 2 GPU(s)"),
        "{}",
        output_text(&out)
    );
    let out = job.run_hook("pre-exit");
    assert!(out.status.success(), "{}", output_text(&out));
}

/// The `pre-bootstrap` hook as the agent runs it (the file setup installs, executed: its first
/// line names the binary), with the job's variables in `BUILDKITE_ENV_JSON_FILE`: silent and
/// 0 for a job of Buildkite's own variables, 1 with one line per reason otherwise, and 1 when
/// the file cannot be read; given to a shell (an agent with a `hooks-shell`), the same.
#[test]
fn the_pre_bootstrap_hook_refuses_what_steers_the_bootstrap_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let hook = dir.path().join("pre-bootstrap");
    let bin = Path::new(env!("CARGO_BIN_EXE_kernelkite-isolate"))
        .parent()
        .unwrap();
    std::fs::write(
        &hook,
        kernelkite_admin::setup::render::pre_bootstrap_hook(bin),
    )
    .unwrap();
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let run = |vars: serde_json::Value, signed: &str| {
        let file = dir.path().join("env.json");
        std::fs::write(&file, vars.to_string()).unwrap();
        std::process::Command::new(&hook)
            .env("BUILDKITE_ENV_JSON_FILE", &file)
            .env("KERNELKITE_SIGNED_STEPS", signed)
            .output()
            .unwrap()
    };
    let good = json!({
        "BUILDKITE_BUILD_ID": "b-1",
        "BUILDKITE_AGENT_META_DATA_QUEUE": "h100",
        "KERNELBOT_SIGNED_BUILD": "b-1",
        "KERNELBOT_SIGNED_QUEUE": "h100",
        "BUILDKITE_ARTIFACT_PATHS": "result.json",
    });
    let out = run(good.clone(), "on");
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(out.stdout.is_empty(), "{}", output_text(&out));
    let mut bad = good.clone();
    bad["BUILDKITE_BUILD_CHECKOUT_PATH"] = json!("/usr");
    bad["BUILDKITE_ARTIFACT_PATHS"] = json!("result.json;/etc/shadow");
    bad["KERNELBOT_SIGNED_BUILD"] = json!("b-0");
    let out = run(bad, "off");
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(said.lines().count(), 3, "{said}");
    assert!(
        said.lines()
            .all(|l| l.starts_with("kernelkite: job refused: ")),
        "{said}"
    );
    let mut unbound = good;
    unbound
        .as_object_mut()
        .unwrap()
        .remove("KERNELBOT_SIGNED_QUEUE");
    assert!(run(unbound.clone(), "off").status.success());
    assert_eq!(run(unbound, "on").status.code(), Some(1));
    let missing = std::process::Command::new(&hook)
        .env("BUILDKITE_ENV_JSON_FILE", dir.path().join("nope.json"))
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&missing.stdout).contains("cannot read the job's variables"),
        "{}",
        output_text(&missing)
    );
}

/// The pool on a node of two vendors, numbered as the planner numbers the `mixed-vendors`
/// machine (slices 0 and 2 NVIDIA, 1 and 3 AMD; 0 and 1 on NUMA node 0): a pool job of two
/// gets one vendor's pair, waits rather than take one GPU of each, and a step asking for more
/// than any vendor has, or an agent bound to both vendors' slices, is refused with the reason.
#[test]
fn a_pool_job_of_two_never_mixes_vendors() {
    let node = Node::new(1);
    let slice = |index: u32, vendor: &str, bus: &str, uuid: Option<&str>, numa: u32| {
        json!({"index": index,
               "gpu": {"vendor": vendor, "pci_bus_id": bus, "uuid": uuid, "numa_node": numa},
               "cpus": [index], "mems": [numa], "memory_bytes": 256u64 << 20})
    };
    let (nv0, nv2) = (
        "GPU-00000000-0000-4000-8000-000000180000",
        "GPU-00000001-0000-4000-8000-000000860000",
    );
    let plan = json!({"slices": [
        slice(0, "nvidia", "0000:18:00.0", Some(nv0), 0),
        slice(1, "amd", "0000:3b:00.0", None, 0),
        slice(2, "nvidia", "0000:86:00.0", Some(nv2), 1),
        slice(3, "amd", "0000:af:00.0", None, 1)],
        "reserved_cpus": [], "warnings": []});
    std::fs::write(node.path().join("plan.json"), plan.to_string()).unwrap();
    let pool = node.agent("pool-1");
    let two = Some(r#"{"gpus":2,"lease-wait":0}"#);
    // The buses of the job's GPUs, from its slice (KERNELBOT_GPU_INDEX numbers them per vendor).
    let buses = |env: &BTreeMap<String, String>| {
        let slice: serde_json::Value = serde_json::from_str(&env["KERNELKITE_SLICE"]).unwrap();
        std::iter::once(&slice["gpu"])
            .chain(slice["extra_gpus"].as_array().into_iter().flatten())
            .map(|g| g["pci_bus_id"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };

    // All free: the lowest vendor's pair, across the NUMA nodes (no node has two of one
    // vendor), and the job log says so.
    let mut job = pool.start_job(&job_id(70), "true", two, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(buses(&job.slice_env()), ["0000:18:00.0", "0000:86:00.0"]);
    assert_eq!(
        job.slice_env()["CUDA_VISIBLE_DEVICES"],
        format!("{nv0},{nv2}")
    );
    // CUDA numbers NVIDIA GPUs only: these are its 0 and 1.
    assert_eq!(job.slice_env()["KERNELBOT_GPU_INDEX"], "0,1");
    assert!(
        output_text(&out).contains("slices 0 and 2 sit on NUMA nodes 0 and 1"),
        "{}",
        output_text(&out)
    );
    assert!(job.run_hook("pre-exit").status.success());

    // Slices 0 (NVIDIA) and 3 (AMD) held: 1 and 2 are free, but of two vendors.
    let mut held = Vec::new();
    for (n, index) in [(71, "0"), (72, "3")] {
        let mut env = node.env.clone();
        env.insert("BUILDKITE_AGENT_META_DATA_GPU_INDEX".into(), index.into());
        let agent = agent::Agent::new(node.path(), &format!("bound-{index}"), &env);
        let mut job = agent.start_job(&job_id(n), "true", None, Install::AgentBinary);
        let out = job.run_hook("environment");
        assert!(out.status.success(), "{}", output_text(&out));
        held.push((agent, job));
    }
    let mut job = pool.start_job(&job_id(73), "true", two, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(!out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains(&format!("GPU 0 is held by job {}", job_id(71))),
        "{}",
        output_text(&out)
    );
    // Slice 3 freed: the AMD pair.
    assert!(held[1].1.run_hook("pre-exit").status.success());
    let mut job = pool.start_job(&job_id(74), "true", two, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(buses(&job.slice_env()), ["0000:3b:00.0", "0000:af:00.0"]);
    assert_eq!(job.slice_env()["ROCR_VISIBLE_DEVICES"], "0,1");
    assert!(job.run_hook("pre-exit").status.success());
    assert!(held[0].1.run_hook("pre-exit").status.success());

    // Three: no vendor has them.
    let mut job = pool.start_job(
        &job_id(75),
        "true",
        Some(r#"{"gpus":3}"#),
        Install::AgentBinary,
    );
    let out = job.run_hook("environment");
    assert!(!out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("no vendor has 3 GPU slices on this node (nvidia 2, amd 2)"),
        "{}",
        output_text(&out)
    );

    // An agent bound to one slice of each vendor: refused, and nothing stays held.
    let mut env = node.env.clone();
    env.insert("BUILDKITE_AGENT_META_DATA_GPU_INDEX".into(), "0+1".into());
    let agent = agent::Agent::new(node.path(), "mixed-pair", &env);
    let mut job = agent.start_job(&job_id(76), "true", None, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(!out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains(
            "slices 0 (nvidia 0000:18:00.0) and 1 (amd 0000:3b:00.0): a job's GPUs must all be one vendor's"
        ),
        "{}",
        output_text(&out)
    );
    let mut job = pool.start_job(&job_id(77), "true", two, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(buses(&job.slice_env()), ["0000:18:00.0", "0000:86:00.0"]);
    assert!(job.run_hook("pre-exit").status.success());
}
