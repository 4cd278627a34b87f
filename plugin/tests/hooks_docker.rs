//! Docker mode through a recording `docker` stub: the exact argument vector, the environment
//! docker is started with, exit codes, and the container's removal in `pre-exit`.

mod agent;

use std::path::{Path, PathBuf};

use agent::{output_text, Install, Node};

/// A `docker` that records each invocation (argv NUL-separated, and its environment).
fn docker_stub(dir: &Path, exit: i32) -> PathBuf {
    let stub = dir.join("docker");
    let rec = dir.join("docker-calls");
    std::fs::create_dir_all(&rec).unwrap();
    std::fs::write(
        &stub,
        format!(
            "#!/bin/bash\nn=$(ls {rec} | grep -c args)\nprintf '%s\\0' \"$@\" > {rec}/$n.args\nenv -0 > {rec}/$n.env\nstat -c %u:%g . > {rec}/$n.owner\n[[ $1 == run ]] && exit {exit}\nexit 0\n",
            rec = rec.display()
        ),
    )
    .unwrap();
    let mut perms = std::fs::metadata(&stub).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&stub, perms).unwrap();
    stub
}

fn calls(dir: &Path) -> Vec<(Vec<String>, Vec<String>)> {
    let rec = dir.join("docker-calls");
    let mut n = 0;
    let mut out = Vec::new();
    while rec.join(format!("{n}.args")).exists() {
        let split = |p: PathBuf| -> Vec<String> {
            std::fs::read(p)
                .unwrap()
                .split(|b| *b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        };
        out.push((
            split(rec.join(format!("{n}.args"))),
            split(rec.join(format!("{n}.env"))),
        ));
        n += 1;
    }
    out
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn docker_run_gets_exactly_the_slice() {
    let node = Node::new(2);
    let stub = docker_stub(node.path(), 0);
    let mut env = node.env.clone();
    env.insert("KERNELKITE_DOCKER".into(), stub.display().to_string());
    env.insert("HF_TOKEN".into(), "hf-secret".into());
    let agent = agent::Agent::new(node.path(), "dgx-gpu1", &env);
    let id = "0190b8c2-0000-4000-8000-00000000d0c1";
    let mut job = agent.start_job(
        id,
        "python3 eval.py",
        Some(r#"{"mode":"docker","image":"ghcr.io/kernelkite/runner:1","environment":["HF_TOKEN"],"docker-args":["--tmpfs=/scratch"],"user":"1000:1000","shm-size":"128M"}"#),
        Install::Plugin,
    );
    let checkout = PathBuf::from(&job.env["BUILDKITE_BUILD_CHECKOUT_PATH"]);
    std::fs::create_dir_all(checkout.join(".git")).unwrap();
    let owner_before = owner(&checkout);
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    // Exported for pipelines that use the official docker plugin instead.
    let uuid = "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd";
    assert_eq!(job.env["NVIDIA_VISIBLE_DEVICES"], uuid);
    assert_eq!(job.env["KERNELBOT_CPUSET"], "1");
    // Docker mode makes no host cgroup.
    assert!(!node.cgroup_dir(id).exists());

    let calls = calls(node.path());
    assert_eq!(
        calls.len(),
        2,
        "docker run, then docker rm in pre-exit: {calls:?}"
    );
    let (args, docker_env) = &calls[0];
    let checkout = job.env["BUILDKITE_BUILD_CHECKOUT_PATH"].clone();
    let mem = (256u64 << 20).to_string();
    let name = format!("kernelkite-{id}");
    let label = format!("kernelkite.job={id}");
    let volume = format!("{checkout}:/workdir");
    let git = format!("{checkout}/.git:/workdir/.git:ro");
    let gpus = format!("device={uuid}");
    // Only root can hand the checkout over: without it the container runs as the agent.
    let user = if rustix::process::geteuid().is_root() {
        "1000:1000".to_string()
    } else {
        format!(
            "{}:{}",
            rustix::process::geteuid().as_raw(),
            rustix::process::getegid().as_raw()
        )
    };
    let shm = (128u64 << 20).to_string();
    let prefix = strings(&[
        "run",
        "--rm",
        "--init",
        "--name",
        &name,
        "--label",
        &label,
        "--gpus",
        &gpus,
        "--cpuset-cpus",
        "1",
        "--cpuset-mems",
        "0",
        "--memory",
        &mem,
        "--memory-swap",
        &mem,
        "--pids-limit",
        "4096",
        "--user",
        &user,
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--ipc",
        "private",
        "--shm-size",
        &shm,
        "--cgroupns",
        "private",
        "--network",
        "none",
        "--volume",
        &volume,
        "--volume",
        &git,
        "--workdir",
        "/workdir",
    ]);
    let suffix = strings(&[
        "--env",
        "CUDA_DEVICE_ORDER=PCI_BUS_ID",
        "--env",
        &format!("CUDA_VISIBLE_DEVICES={uuid}"),
        "--tmpfs=/scratch",
        "ghcr.io/kernelkite/runner:1",
        "/bin/sh",
        "-e",
        "-c",
        "python3 eval.py",
    ]);
    assert_eq!(args[..prefix.len()], prefix[..], "{args:?}");
    assert_eq!(args[args.len() - suffix.len()..], suffix[..], "{args:?}");
    let middle = &args[prefix.len()..args.len() - suffix.len()];
    assert!(
        middle.len() % 2 == 0 && middle.chunks(2).all(|c| c[0] == "--env"),
        "{middle:?}"
    );
    let names: Vec<&str> = middle.chunks(2).map(|c| c[1].as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(names, sorted, "deterministic order");
    for want in [
        "BUILDKITE_JOB_ID",
        "BUILDKITE_BUILD_ID",
        "KERNELBOT_GPU_INDEX",
        "KERNELBOT_CPUSET",
        "KERNELBOT_MEMORY",
        "KERNELKITE_SLICE",
        "HF_TOKEN",
    ] {
        assert!(names.contains(&want), "{want} not passed: {names:?}");
    }
    for never in [
        "BUILDKITE_AGENT_ACCESS_TOKEN",
        "BUILDKITE_AGENT_JOB_API_TOKEN",
        "BUILDKITE_AGENT_JOB_API_SOCKET",
        "NVIDIA_VISIBLE_DEVICES",
        "HOME",
        "PATH",
    ] {
        assert!(
            !names.contains(&never),
            "{never} must not be passed: {names:?}"
        );
    }
    assert!(
        names.iter().all(|n| !n.contains('=')),
        "values must not appear in argv"
    );
    // `--env NAME` takes the value from docker's own environment.
    assert!(docker_env.contains(&"KERNELBOT_GPU_INDEX=1".to_string()));
    assert!(docker_env.contains(&"HF_TOKEN=hf-secret".to_string()));

    let (rm, _) = &calls[1];
    assert_eq!(rm, &strings(&["rm", "--force", &name]));
    // The container's user owned the checkout while it ran; its owner has it back after.
    let during = std::fs::read_to_string(node.path().join("docker-calls/0.owner")).unwrap();
    assert_eq!(during.trim(), user);
    assert_eq!(owner(Path::new(&checkout)), owner_before);
    let pre_exit = String::from_utf8_lossy(&outs[2].1.stdout);
    assert!(
        pre_exit.contains("returned the checkout to its owner"),
        "{pre_exit}"
    );
}

fn owner(p: &Path) -> String {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(p).unwrap();
    format!("{}:{}", m.uid(), m.gid())
}

#[test]
fn network_opt_in_exit_codes_and_multi_gpu() {
    let node = Node::new(4);
    let stub = docker_stub(node.path(), 3);
    let mut env = node.env.clone();
    env.insert("KERNELKITE_DOCKER".into(), stub.display().to_string());
    let agent = agent::Agent::new(node.path(), "pool", &env);
    let mut job = agent.start_job(
        "job-multi",
        "nvidia-smi",
        Some(r#"{"mode":"docker","image":"img","gpus":2,"network":true,"mount-checkout":false,"user":"65534"}"#),
        Install::AgentBinary,
    );
    let outs = job.run_all();
    assert!(outs[0].1.status.success(), "{}", output_text(&outs[0].1));
    assert_eq!(
        outs[1].1.status.code(),
        Some(3),
        "docker's exit code is the command's"
    );
    let calls = calls(node.path());
    let args = &calls[0].0;
    assert!(
        !args.contains(&"none".to_string()),
        "network: true keeps the network: {args:?}"
    );
    assert!(!args.contains(&"--volume".to_string()));
    let i = args.iter().position(|a| a == "--gpus").unwrap();
    assert_eq!(
        args[i + 1],
        "\"device=GPU-00000000-aaaa-bbbb-cccc-dddddddddddd,GPU-00000001-aaaa-bbbb-cccc-dddddddddddd\""
    );
    let i = args.iter().position(|a| a == "--memory").unwrap();
    assert_eq!(
        args[i + 1],
        (512u64 << 20).to_string(),
        "two slices' memory"
    );
    assert_eq!(job.env["KERNELBOT_GPU_INDEX"], "0,1");
}

#[test]
fn amd_gpus_are_passed_as_devices() {
    let node = Node::new(1);
    let plan = serde_json::json!({"slices": [{"index": 0,
        "gpu": {"vendor": "amd", "pci_bus_id": "0000:0c:00.0", "uuid": null, "numa_node": 0},
        "cpus": [0], "mems": [0], "memory_bytes": 1u64 << 30}], "reserved_cpus": [], "warnings": []});
    std::fs::write(node.path().join("plan.json"), plan.to_string()).unwrap();
    let sys = node.path().join("sysfs");
    std::fs::create_dir_all(sys.join("sys/bus/pci/devices/0000:0c:00.0/drm/renderD130")).unwrap();
    let stub = docker_stub(node.path(), 0);
    let mut env = node.env.clone();
    env.insert("KERNELKITE_DOCKER".into(), stub.display().to_string());
    env.insert("KERNELKITE_SYSFS_ROOT".into(), sys.display().to_string());
    let agent = agent::Agent::new(node.path(), "mi300x-gpu0", &env);
    let mut job = agent.start_job(
        "job-amd",
        "true",
        Some(r#"{"mode":"docker","image":"rocm","user":"65534"}"#),
        Install::AgentBinary,
    );
    let outs = job.run_all();
    assert!(outs.iter().all(|(_, o)| o.status.success()));
    assert_eq!(job.env["ROCR_VISIBLE_DEVICES"], "0");
    assert!(!job.env.contains_key("HIP_VISIBLE_DEVICES"));
    assert!(!job.env.contains_key("CUDA_VISIBLE_DEVICES"));
    let args = &calls(node.path())[0].0;
    let joined = args.join(" ");
    assert!(
        joined.contains(
            "--device /dev/kfd --device /dev/dri/renderD130 --group-add video --cpuset-cpus 0"
        ),
        "{joined}"
    );
    assert!(!joined.contains("--gpus"));
}
