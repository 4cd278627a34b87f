//! Docker mode through a recording `docker` stub: the exact argument vector, the environment
//! docker is started with, exit codes, and the container's removal in `pre-exit`.

use crate::agent;

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
    assert_eq!(job.slice_env()["NVIDIA_VISIBLE_DEVICES"], uuid);
    assert_eq!(job.slice_env()["KERNELBOT_CPUSET"], "1");
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
    assert_eq!(job.slice_env()["KERNELBOT_GPU_INDEX"], "0,1");
}

/// A node of one-GPU AMD slices at `buses` (render node `renderD<128+i>` each, in its sysfs
/// tree) with the recording `docker` stub: the node and the agent's environment.
fn amd_node(buses: &[&str]) -> (Node, std::collections::BTreeMap<String, String>) {
    let node = Node::new(1);
    let slices: Vec<serde_json::Value> = buses
        .iter()
        .enumerate()
        .map(|(i, bus)| {
            serde_json::json!({"index": i,
            "gpu": {"vendor": "amd", "pci_bus_id": bus, "uuid": null, "numa_node": 0},
            "cpus": [i.min(1)], "mems": [0], "memory_bytes": 1u64 << 30})
        })
        .collect();
    let plan = serde_json::json!({"slices": slices, "reserved_cpus": [], "warnings": []});
    std::fs::write(node.path().join("plan.json"), plan.to_string()).unwrap();
    let sys = node.path().join("sysfs");
    for (i, bus) in buses.iter().enumerate() {
        let drm = format!("sys/bus/pci/devices/{bus}/drm/renderD{}", 128 + i);
        std::fs::create_dir_all(sys.join(drm)).unwrap();
    }
    let stub = docker_stub(node.path(), 0);
    let mut env = node.env.clone();
    env.insert("KERNELKITE_DOCKER".into(), stub.display().to_string());
    env.insert("KERNELKITE_SYSFS_ROOT".into(), sys.display().to_string());
    (node, env)
}

#[test]
fn amd_gpus_are_passed_as_devices() {
    let (node, env) = amd_node(&["0000:0c:00.0"]);
    let agent = agent::Agent::new(node.path(), "mi300x-gpu0", &env);
    let mut job = agent.start_job(
        "job-amd",
        "true",
        Some(r#"{"mode":"docker","image":"rocm","user":"65534"}"#),
        Install::AgentBinary,
    );
    let outs = job.run_all();
    assert!(outs.iter().all(|(_, o)| o.status.success()));
    assert_eq!(job.slice_env()["ROCR_VISIBLE_DEVICES"], "0");
    assert!(!job.env.contains_key("HIP_VISIBLE_DEVICES"));
    assert!(!job.env.contains_key("CUDA_VISIBLE_DEVICES"));
    let args = &calls(node.path())[0].0;
    let joined = args.join(" ");
    assert!(
        joined.contains(
            "--device /dev/kfd --device /dev/dri/renderD128 --group-add video --cpuset-cpus 0"
        ),
        "{joined}"
    );
    assert!(!joined.contains("--gpus"));
}

#[test]
fn image_auto_runs_the_runner_image_of_the_slice_s_gpus() {
    // An AMD slice: the ROCm image.
    let (node, env) = amd_node(&["0000:0c:00.0"]);
    let agent = agent::Agent::new(node.path(), "mi300x-gpu0", &env);
    let mut job = agent.start_job(
        "job-amd-auto",
        "kernelkite-runner --output result.json",
        Some(r#"{"mode":"docker","image":"auto","user":"65534"}"#),
        Install::AgentBinary,
    );
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    let command = output_text(&outs[1].1);
    assert!(
        command.contains(
            "image auto: ghcr.io/kernelkite/runner-rocm:0.1.0, the runner image for AMD GPUs"
        ),
        "{command}"
    );
    let args = &calls(node.path())[0].0;
    let at = args.len() - 5;
    assert_eq!(
        args[at..],
        strings(&[
            "ghcr.io/kernelkite/runner-rocm:0.1.0",
            "/bin/sh",
            "-e",
            "-c",
            "kernelkite-runner --output result.json"
        ])[..],
        "{args:?}"
    );
    assert!(args.contains(&"/dev/kfd".to_string()), "{args:?}");

    // An NVIDIA slice: the CUDA image.
    let node = Node::new(1);
    let stub = docker_stub(node.path(), 0);
    let mut env = node.env.clone();
    env.insert("KERNELKITE_DOCKER".into(), stub.display().to_string());
    let agent = agent::Agent::new(node.path(), "dgx-gpu0", &env);
    let mut job = agent.start_job(
        "job-nvidia-auto",
        "true",
        Some(r#"{"mode":"docker","image":"auto","user":"65534"}"#),
        Install::AgentBinary,
    );
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    let args = &calls(node.path())[0].0;
    assert_eq!(
        args[args.len() - 5],
        "ghcr.io/kernelkite/runner:0.1.0",
        "{args:?}"
    );
    assert!(args.contains(&"--gpus".to_string()), "{args:?}");
}

/// A MIG slice in docker mode: the container is given the MIG device by its uuid (`--gpus
/// device=MIG-…`, which the NVIDIA container toolkit turns into the GPU's node and the MIG
/// device's capability nodes) and sees it under that uuid; a job of two slices of which one
/// is a MIG device is refused before any container starts.
#[test]
fn a_mig_slice_gets_its_mig_device_in_the_container() {
    let node = Node::new(1);
    let bus = "0000:2a:00.0";
    let mig = |index: u32, gi: u32| {
        let uuid = format!("MIG-0000002a-{gi:04x}-4000-8000-000000000000");
        serde_json::json!({"index": index,
            "gpu": {"vendor": "nvidia", "pci_bus_id": bus, "uuid": uuid, "numa_node": 0,
                    "mig": {"uuid": uuid, "gpu_instance_id": gi, "compute_instance_id": 0,
                            "memory_bytes": 20u64 << 30}},
            "cpus": [index], "mems": [0], "memory_bytes": 1u64 << 30})
    };
    let plan = serde_json::json!({"slices": [mig(0, 3), mig(1, 5)],
        "reserved_cpus": [], "warnings": []});
    std::fs::write(node.path().join("plan.json"), plan.to_string()).unwrap();
    let stub = docker_stub(node.path(), 0);
    let mut env = node.env.clone();
    env.insert("KERNELKITE_DOCKER".into(), stub.display().to_string());
    let config = Some(r#"{"mode":"docker","image":"auto","user":"65534"}"#);
    let agent = agent::Agent::new(node.path(), "dgx-gpu1", &env);
    let mut job = agent.start_job("job-mig", "true", config, Install::AgentBinary);
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    let uuid = "MIG-0000002a-0005-4000-8000-000000000000";
    assert_eq!(job.slice_env()["NVIDIA_VISIBLE_DEVICES"], uuid);
    let args = &calls(node.path())[0].0;
    let at = args.iter().position(|a| a == "--gpus").unwrap();
    assert_eq!(args[at + 1], format!("device={uuid}"), "{args:?}");
    assert!(
        args.contains(&format!("CUDA_VISIBLE_DEVICES={uuid}")),
        "{args:?}"
    );
    assert!(args.contains(&"ghcr.io/kernelkite/runner:0.1.0".to_string()));

    let mut two = env.clone();
    two.insert("BUILDKITE_AGENT_META_DATA_GPU_INDEX".into(), "0,1".into());
    let agent = agent::Agent::new(node.path(), "pair", &two);
    let mut job = agent.start_job("job-mig-pair", "true", config, Install::AgentBinary);
    let out = job.run_hook("environment");
    assert!(!out.status.success(), "{}", output_text(&out));
    assert!(
        output_text(&out).contains("is a MIG device"),
        "{}",
        output_text(&out)
    );
    assert_eq!(
        calls(node.path()).len(),
        2,
        "no container for the refused job"
    );
}

/// A multi-GPU queue's agent bound to two AMD slices in docker mode, its step leaving `gpus`
/// to the binding: the container gets both GPUs' render nodes and `/dev/kfd`, and numbers
/// them from 0 as ROCr does in a `/dev` holding only those (kernelkite_sys::kfd).
#[test]
fn two_amd_gpus_reach_one_container_numbered_as_it_sees_them() {
    let (node, mut env) = amd_node(&["0000:0c:00.0", "0000:22:00.0", "0000:38:00.0"]);
    env.insert("BUILDKITE_AGENT_META_DATA_GPU_INDEX".into(), "1+2".into());
    let agent = agent::Agent::new(node.path(), "mi300x-x2-0", &env);
    let mut job = agent.start_job(
        "job-amd-two",
        "true",
        Some(r#"{"mode":"docker","image":"auto","user":"65534"}"#),
        Install::AgentBinary,
    );
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    assert_eq!(job.slice_env()["KERNELBOT_GPU_INDEX"], "1,2");
    let args = &calls(node.path())[0].0;
    let joined = args.join(" ");
    assert!(
        joined.contains(
            "--device /dev/kfd --device /dev/dri/renderD129 --device /dev/dri/renderD130 "
        ),
        "{joined}"
    );
    assert!(!joined.contains("renderD128"), "{joined}");
    assert!(
        args.contains(&"ROCR_VISIBLE_DEVICES=0,1".to_string()),
        "{joined}"
    );
    assert!(!joined.contains("HIP_VISIBLE_DEVICES"), "{joined}");
}
