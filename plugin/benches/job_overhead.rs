//! Benchmark: the whole per-job overhead of the hooks in host mode on the DGX H100 fixture —
//! `environment` (orphan scan, plan, lease, cgroup), `command` (confined start of a command
//! that does nothing) and `pre-exit` (kill, remove, release) — each a separate process as the
//! agent runs them, next to the prototype's environment hook in the same run.
//!
//! `cargo bench -p kernelkite-isolate --bench job_overhead` (`KERNELKITE_BENCH_SHORT=1` for a
//! run under 30 s). Uses the machine's real cgroups when root and writable, else a fake v2 tree.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kernelkite_isolate::cgroup::{Cgroups, Limits};
use kernelkite_topology::fakesys;

mod common;
use common::{ms, output_ok, path_with, stats, stub_nvidia_smi_bin, Stats, Table};

fn run(cmd: &mut Command) -> Duration {
    let t = Instant::now();
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let took = t.elapsed();
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    took
}

fn fake_cgroup_v2(dir: &Path) -> PathBuf {
    let root = dir.join("cgroot");
    std::fs::create_dir_all(root.join("proc/self")).unwrap();
    std::fs::write(
        root.join("proc/self/mountinfo"),
        "30 23 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
    )
    .unwrap();
    std::fs::create_dir_all(root.join("sys/fs/cgroup")).unwrap();
    std::fs::write(
        root.join("sys/fs/cgroup/cgroup.controllers"),
        "cpuset memory pids\n",
    )
    .unwrap();
    root
}

/// Real cgroups when usable (root, writable), else the fake v2 tree.
fn cgroup_root(fake: &Path) -> (PathBuf, String) {
    if rustix::process::geteuid().is_root() {
        if let Ok(cg) = Cgroups::detect(Path::new("/")) {
            let probe = format!("kk-bench-probe-{}", std::process::id());
            let limits = Limits {
                cpus: vec![0],
                mems: vec![0],
                memory_bytes: 64 << 20,
                pids: 64,
                deny_devices: vec![],
            };
            let ok = cg.create(&probe, &limits).is_ok();
            let _ = cg.clean_up(&probe);
            if ok {
                return ("/".into(), format!("real cgroup v{}", cg.version()));
            }
        }
    }
    (fake.to_path_buf(), "fake cgroup v2 tree (not root)".into())
}

/// Start cost of a process in a cgroup v2 directory: migrated after fork vs born inside.
fn cgroup2_start_costs(iterations: usize) -> Option<(Stats, Stats, Stats)> {
    use kernelkite_isolate::cgroup::v2::V2;
    use kernelkite_isolate::confine::{spawn, spawn_into_cgroup2, Confinement};
    if !rustix::process::geteuid().is_root() {
        return None;
    }
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mount = kernelkite_isolate::cgroup::parse_mountinfo(&text)
        .into_iter()
        .find(|m| m.fs_type == "cgroup2")?;
    let v2 = V2::new(PathBuf::from(&mount.mount_point));
    let name = format!("kk-bench-{}", std::process::id());
    std::fs::create_dir_all(v2.base().join(&name)).ok()?;
    let dir = v2.base().join(&name);
    let env: BTreeMap<String, String> = [("PATH".to_string(), "/usr/bin:/bin".to_string())].into();
    let c = Confinement {
        procs_files: v2.procs_files(&name),
        isolate_network: false,
    };
    let mut migrate = Vec::new();
    let mut born = Vec::new();
    let mut plain = Vec::new();
    for _ in 0..iterations {
        let t = Instant::now();
        assert!(Command::new("/bin/true").status().unwrap().success());
        plain.push(t.elapsed());
        let t = Instant::now();
        let mut child = spawn(&mut Command::new("/bin/true"), &c).unwrap();
        assert!(child.wait().unwrap().success());
        migrate.push(t.elapsed());
        let t = Instant::now();
        let mut child =
            spawn_into_cgroup2("/bin/true".as_ref(), &[], &env, &dir, false).unwrap()?;
        assert!(child.wait().unwrap().success());
        born.push(t.elapsed());
    }
    let _ = v2.clean_up(&name);
    Some((stats(migrate), stats(born), stats(plain)))
}

fn main() {
    let short = std::env::var_os("KERNELKITE_BENCH_SHORT").is_some();
    let iterations = if short { 40 } else { 300 };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = env!("CARGO_BIN_EXE_kernelkite-isolate");
    // The run dir is /run/kernelkite in production, a tmpfs; /dev/shm stands in for it (and for
    // sysfs, which is in memory too) where this machine's /tmp is a disk.
    let dir = if Path::new("/dev/shm").is_dir() {
        tempfile::tempdir_in("/dev/shm").unwrap()
    } else {
        tempfile::tempdir().unwrap()
    };
    let sys = dir.path().join("dgx-h100");
    fakesys::dgx_h100().write_to(&sys).unwrap();
    let fake = fake_cgroup_v2(dir.path());
    let (cgroot, cg_kind) = cgroup_root(&fake);

    // The live machine has fewer CPUs than the fixture: the job's cgroup gets one of ours, so
    // the plan file is the fixture's plan with CPUs folded onto this machine (same sizes).
    let plan_out = output_ok(
        Command::new(exe)
            .args(["plan", "--json", "--sysfs-root"])
            .arg(&sys),
    );
    let mut plan: serde_json::Value = serde_json::from_slice(&plan_out.stdout).unwrap();
    for s in plan["slices"].as_array_mut().unwrap() {
        s["cpus"] = serde_json::json!([0]);
        s["mems"] = serde_json::json!([0]);
        s["memory_bytes"] = serde_json::json!(1u64 << 30);
    }
    let plan_file = dir.path().join("plan.json");
    std::fs::write(&plan_file, plan.to_string()).unwrap();

    let base_env = |job: &str| -> BTreeMap<String, String> {
        let mut e = BTreeMap::new();
        e.insert("PATH".into(), std::env::var("PATH").unwrap_or_default());
        e.insert("BUILDKITE_JOB_ID".into(), job.into());
        e.insert("BUILDKITE_AGENT_NAME".into(), "dgx01".into());
        e.insert("BUILDKITE_COMMAND".into(), "true".into());
        e.insert(
            "KERNELKITE_RUN_DIR".into(),
            dir.path().join("run").display().to_string(),
        );
        e.insert(
            "KERNELKITE_CGROUP_ROOT".into(),
            cgroot.display().to_string(),
        );
        e.insert("KERNELKITE_JOB_PID".into(), std::process::id().to_string());
        e
    };
    let hook = |sub: &str, env: &BTreeMap<String, String>| {
        let mut c = Command::new(exe);
        c.arg(sub).env_clear().envs(env);
        if sub == "environment" {
            c.args(["--export", "shell"]);
        }
        c
    };

    // One job, both ways of finding the slice.
    let mut env_live = Vec::new();
    let mut env_file = Vec::new();
    let mut command = Vec::new();
    let mut pre_exit = Vec::new();
    let mut total = Vec::new();
    for i in 0..iterations + 3 {
        let job = format!("bench-{}-{i}", std::process::id());
        let mut env = base_env(&job);
        let live_or_file = i % 2 == 0;
        if live_or_file {
            // Planned live from the fixture, whose CPUs this machine lacks: its cgroup goes into
            // the fake tree.
            env.insert("KERNELKITE_SYSFS_ROOT".into(), sys.display().to_string());
            env.insert("KERNELKITE_CGROUP_ROOT".into(), fake.display().to_string());
            let t = run(&mut hook("environment", &env));
            run(&mut hook("pre-exit", &env));
            if i >= 3 {
                env_live.push(t);
            }
            env.remove("KERNELKITE_SYSFS_ROOT");
            env.insert(
                "KERNELKITE_CGROUP_ROOT".into(),
                cgroot.display().to_string(),
            );
        }
        env.insert(
            "KERNELKITE_PLAN_FILE".into(),
            plan_file.display().to_string(),
        );
        let job = format!("{job}-f");
        env.insert("BUILDKITE_JOB_ID".into(), job);
        let e = run(&mut hook("environment", &env));
        let c = run(&mut hook("command", &env));
        let p = run(&mut hook("pre-exit", &env));
        if i >= 3 {
            env_file.push(e);
            command.push(c);
            pre_exit.push(p);
            total.push(e + c + p);
        }
    }

    // What the command itself costs without any hook: the agent would run it anyway.
    let bare: Vec<Duration> = (0..iterations)
        .map(|_| run(Command::new("/bin/bash").args(["-e", "-c", "true"])))
        .collect();

    let path_with_stub = path_with(&stub_nvidia_smi_bin(dir.path()));
    let proto_hook = manifest.join("benches/prototype-environment-hook.sh");
    let proto: Vec<Duration> = (0..iterations + 3)
        .map(|_| {
            run(Command::new("bash")
                .arg(&proto_hook)
                .env("PATH", &path_with_stub)
                .env("KERNELKITE_PROTO_ROOT", &sys)
                .env("BUILDKITE_AGENT_NAME", "dgx01-4"))
        })
        .skip(3)
        .collect();

    let total = stats(total);
    let bare = stats(bare);
    println!("job overhead benchmark: DGX H100 fixture (224 CPUs, 8 GPUs), host mode, {cg_kind}, {iterations} jobs");
    let table = Table::new(58);
    let row = |name: &str, s: &Stats| table.row(name, s);
    row(
        "environment, live plan from sysfs (process, fake cgroups)",
        &stats(env_live),
    );
    row("environment, plan file (process)", &stats(env_file));
    row(
        "command, running `true` in the job cgroup (process)",
        &stats(command),
    );
    row("pre-exit (process)", &stats(pre_exit));
    row(
        "total per job: environment(plan file)+command+pre-exit",
        &total,
    );
    row(
        "  of which the command itself (bash -e -c true, bare)",
        &bare,
    );
    row(
        "prototype environment hook (bash, baseline)",
        &stats(proto.clone()),
    );
    if let Some((migrate, born, plain)) = cgroup2_start_costs(iterations) {
        println!(
            "starting /bin/true in a real cgroup v2 directory (this machine's cgroup2 mount):"
        );
        row("  plain spawn, no cgroup", &plain);
        row(
            "  spawn + write cgroup.procs (migration, as on v1)",
            &migrate,
        );
        row("  clone3(CLONE_INTO_CGROUP) (`command` on v2)", &born);
    }
    let overhead = total.median.saturating_sub(bare.median);
    println!(
        "hook overhead per job (total - bare command, medians): {}; target <= 10 ms total: {}",
        ms(overhead),
        if total.median <= Duration::from_millis(10) {
            "met"
        } else {
            "MISSED"
        }
    );
}
