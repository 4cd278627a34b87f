//! `kernelkite-isolate smoke`: one job per slice through agent-level hooks linked to this
//! binary, the agent played by `smoke` itself (Job API on a unix socket included). On a fake
//! tree the hooks' side is checked and the kernel's side is seen to fail; as root with
//! writable cgroups, on this machine's own cgroups, every check holds.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kernelkite_hooks::cgroup::{Cgroups, Limits};

const BIN: &str = env!("CARGO_BIN_EXE_kernelkite-isolate");

/// An installed node in a temp dir: hooks linked to the binary, a plan, an env file, a
/// stand-in runner on the PATH.
struct Installed {
    dir: tempfile::TempDir,
}

impl Installed {
    fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// `sandbox`: whether the hooks run commands in the sandbox (as the configuration's `user`);
/// without it the env file says `KERNELKITE_SANDBOX=off`, as fake trees need (the sandbox
/// wants root and a job user).
fn install(
    plan_args: &[&str],
    sysfs: &Path,
    config: &str,
    runner_exit: i32,
    sandbox: bool,
) -> Installed {
    install_counting(plan_args, sysfs, config, runner_exit, sandbox, 1)
}

/// [`install`], with a stand-in runner that writes a result whose `system.device_count` is
/// `gpus` (what the real runner counts inside the job).
fn install_counting(
    plan_args: &[&str],
    sysfs: &Path,
    config: &str,
    runner_exit: i32,
    sandbox: bool,
    gpus: u32,
) -> Installed {
    use std::os::unix::fs::PermissionsExt;
    // The sandbox gives the job a fresh /tmp: a runner it must find lives elsewhere, as in
    // /opt/kernelkite/bin on a real node.
    let dir = if sandbox {
        tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR"))
    } else {
        tempfile::tempdir()
    };
    let inst = Installed { dir: dir.unwrap() };
    let d = inst.path();
    // The job user runs the stand-in runner from here.
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    let hooks = d.join("hooks");
    std::fs::create_dir_all(&hooks).unwrap();
    for h in ["environment", "command", "pre-exit"] {
        std::os::unix::fs::symlink(BIN, hooks.join(h)).unwrap();
    }
    let out = Command::new(BIN)
        .arg("plan")
        .arg("--sysfs-root")
        .arg(sysfs)
        .arg("--json")
        .args(plan_args)
        .env_remove("KERNELKITE_SYSFS_ROOT")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(d.join("plan.json"), &out.stdout).unwrap();
    let bin = d.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let runner = bin.join("kernelkite-runner");
    std::fs::write(
        &runner,
        format!("#!/bin/sh\necho \"runner saw $*\" >&2\n[ \"$1\" = --example ] || exit 2\n[ {runner_exit} = 0 ] && [ \"$2\" = --output ] && printf '{{\"success\": true, \"system\": {{\"gpu\": \"\", \"device_count\": {gpus}}}}}\\n' > \"$3\"\n[ {runner_exit} = 0 ] || echo 'python3 not found' >&2\nexit {runner_exit}\n"),
    )
    .unwrap();
    std::fs::set_permissions(&runner, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(
        d.join("agent.env"),
        format!(
            "# as setup writes it\nPATH={}:/usr/local/bin:/usr/bin:/bin\nKERNELKITE_PLAN_FILE={}\nKERNELKITE_RUN_DIR={}\nKERNELKITE_CONFIG='{config}'\n{}",
            bin.display(),
            d.join("plan.json").display(),
            d.join("run").display(),
            // Setup installs the runner in /opt/kernelkite/bin, which every job reaches; this
            // test's lies in the target dir, which may be anywhere.
            if sandbox {
                format!("KERNELKITE_JOB_TOOLS={}\n", runner.display())
            } else {
                "KERNELKITE_SANDBOX=off\n".to_string()
            }
        ),
    )
    .unwrap();
    inst
}

/// `smoke` with the hooks pointed at a fixture's sysfs and its (fake) cgroups.
fn smoke_on_fixture(inst: &Installed, sysfs: &Path) -> Output {
    smoke(
        inst,
        &[
            "--set".into(),
            format!("KERNELKITE_CGROUP_ROOT={}", sysfs.display()),
            "--set".into(),
            format!("KERNELKITE_SYSFS_ROOT={}", sysfs.display()),
        ],
    )
}

fn smoke(inst: &Installed, extra: &[String]) -> Output {
    Command::new(BIN)
        .arg("smoke")
        .arg("--hooks-dir")
        .arg(inst.path().join("hooks"))
        .arg("--env-file")
        .arg(inst.path().join("agent.env"))
        .args(["--node", "test"])
        .args(extra)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn fixture(name: &str, dir: &Path) -> PathBuf {
    let root = dir.join(name);
    let out = Command::new(BIN)
        .args(["fixture", name, "--out"])
        .arg(&root)
        .output()
        .unwrap();
    assert!(out.status.success());
    root
}

#[test]
fn on_a_fake_tree_the_hooks_side_holds_and_the_kernels_side_is_reported() {
    let trees = tempfile::tempdir().unwrap();
    // The fixture has a cgroup v2 mount (plain files) and the NVIDIA driver's files.
    let sysfs = fixture("workstation-1gpu", trees.path());
    let inst = install(&[], &sysfs, r#"{"mode":"host"}"#, 0, false);
    let set = |k: &str| format!("{k}={}", sysfs.display());
    let out = smoke(
        &inst,
        &[
            "--set".into(),
            set("KERNELKITE_SYSFS_ROOT"),
            "--set".into(),
            set("KERNELKITE_CGROUP_ROOT"),
        ],
    );
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(
        t.contains("smoke job on slice 0 (GPU 0000:01:00.0, CPUs 1-15,17-31, 115.2 GiB): FAILED"),
        "{t}"
    );
    for ok in [
        "ok    hooks     environment, command and pre-exit exited 0",
        "ok    gpu       CUDA_VISIBLE_DEVICES=GPU-00000000-0000-4000-8000-000000001000 (1 GPU(s): 0000:01:00.0)",
        "ok    cpuset    KERNELBOT_CPUSET=1-15,17-31",
        "ok    runner    kernelkite-runner --example evaluated the example task",
        "ok    gpu-count the runner in the job counts 1 GPU(s), as CUDA/ROCm enumerate them there",
        "ok    clean-up  pre-exit released the slice",
    ] {
        assert!(t.contains(ok), "missing {ok:?}:\n{t}");
    }
    // A fake cgroup holds nobody: the command ran where this test runs.
    assert!(t.contains("fail  affinity"), "{t}");
    assert!(
        t.contains("fail  cgroup    the command was not in …/kernelkite/kernelkite-smoke-"),
        "{t}"
    );
    assert!(t.contains("smoke: 0 of 1 slice(s) ok"), "{t}");
    // Without the sandbox the command runs as whoever runs the hooks: as root, that fails.
    if rustix::process::geteuid().is_root() {
        assert!(
            t.contains("fail  user      the command ran as root: the sandbox is off"),
            "{t}"
        );
    } else {
        assert!(t.contains("ok    user      the command ran as uid "), "{t}");
    }
    assert!(
        !inst.path().join("run/jobs").exists()
            || std::fs::read_dir(inst.path().join("run/jobs"))
                .unwrap()
                .next()
                .is_none(),
        "a smoke job left its state"
    );
}

/// A job whose variables name its GPU but which cannot use it (the AMD host-mode fault the
/// variables' text hid: HIP saw no GPU) fails `gpu-count`, counted by the runner in the job.
#[test]
fn a_job_that_cannot_use_its_gpu_fails_the_gpu_count() {
    let trees = tempfile::tempdir().unwrap();
    let sysfs = fixture("workstation-1gpu", trees.path());
    let inst = install_counting(&[], &sysfs, r#"{"mode":"host"}"#, 0, false, 0);
    let out = smoke_on_fixture(&inst, &sysfs);
    let t = text(&out);
    assert!(t.contains("ok    gpu       CUDA_VISIBLE_DEVICES="), "{t}");
    assert!(
        t.contains("fail  gpu-count the runner in the job counts 0 GPU(s), the slice has 1"),
        "{t}"
    );
}

#[test]
fn a_runner_that_cannot_run_fails_the_smoke_job_with_its_log() {
    let trees = tempfile::tempdir().unwrap();
    let sysfs = fixture("workstation-1gpu", trees.path());
    let inst = install(&[], &sysfs, r#"{"mode":"host"}"#, 3, false);
    let out = smoke_on_fixture(&inst, &sysfs);
    let t = text(&out);
    assert!(
        t.contains("fail  runner    kernelkite-runner --example exited 3")
            && t.contains("python3 not found"),
        "{t}"
    );
    // Without the runner, it is not tried.
    let out = smoke(
        &inst,
        &[
            "--no-runner".into(),
            "--set".into(),
            format!("KERNELKITE_CGROUP_ROOT={}", sysfs.display()),
        ],
    );
    assert!(!text(&out).contains("runner "), "{}", text(&out));
}

#[test]
fn without_installed_hooks_or_a_plan_it_says_what_to_run() {
    let d = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .arg("smoke")
        .arg("--hooks-dir")
        .arg(d.path())
        .arg("--set")
        .arg("KERNELKITE_PLAN_FILE=/nonexistent")
        .output()
        .unwrap();
    let t = text(&out);
    assert!(!out.status.success());
    assert!(
        t.contains("environment is missing: install the hooks with `kernelkite-isolate setup`"),
        "{t}"
    );
    let out = Command::new(BIN)
        .arg("smoke")
        .arg("--env-file")
        .arg(d.path().join("agent.env"))
        .output()
        .unwrap();
    assert!(text(&out).contains("written by `kernelkite-isolate setup`; pass --env-file FILE"));
}

/// This machine's cgroups, if the hooks can create job cgroups in them; else the reason.
fn usable_cgroups() -> Result<(), String> {
    if !rustix::process::geteuid().is_root() {
        return Err("the smoke job on real cgroups needs root".into());
    }
    let cg = Cgroups::detect(Path::new("/")).map_err(|e| format!("no usable cgroups: {e}"))?;
    let probe = format!("kernelkite-smoke-probe-{}", std::process::id());
    let limits = Limits {
        cpus: vec![0],
        mems: vec![0],
        memory_bytes: 64 << 20,
        pids: 64,
        allow_devices: None,
    };
    let made = cg.create(&probe, &limits);
    let _ = cg.clean_up(&probe);
    made.map(drop)
        .map_err(|e| format!("cannot create a cgroup here: {e}"))
}

#[test]
fn on_this_machines_cgroups_every_check_holds() {
    if let Err(why) = usable_cgroups() {
        kernelkite_testkit::skip(why);
        return;
    }
    // A GPU node plans its GPUs; a build machine one CPU-only slice.
    let gpu_plan = Command::new(BIN)
        .args(["plan", "--json", "--sysfs-root", "/"])
        .output()
        .unwrap();
    let args: &[&str] = if gpu_plan.status.success() {
        &[]
    } else {
        &["--cpu-only-slices", "1"]
    };
    let probe = Command::new(BIN)
        .args(["plan", "--sysfs-root", "/"])
        .args(args)
        .output()
        .unwrap();
    if !probe.status.success() {
        kernelkite_testkit::skip(format_args!(
            "this machine cannot be planned: {}",
            String::from_utf8_lossy(&probe.stderr).trim()
        ));
        return;
    }
    // The command runs in the sandbox, as a job user made for the test: the stand-in runner
    // installed under the target dir (wherever this clone is: under /var/tmp, in /root) is
    // one of the node's tools, bound into the job.
    let user = kernelkite_testkit::users::TestUser::new("smk");
    let config = serde_json::json!({"mode": "host", "user": user.name}).to_string();
    // The stand-in runner reports what the real one counts there: the slice's GPU, or none.
    let gpus = u32::from(gpu_plan.status.success());
    let inst = install_counting(args, Path::new("/"), &config, 0, true, gpus);
    let out = smoke(&inst, &[]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(!t.contains("fail "), "{t}");
    for check in [
        "hooks",
        "gpu",
        "gpu-count",
        "cpuset",
        "affinity",
        "cgroup",
        "user",
        "runner",
        "clean-up",
    ] {
        assert!(
            t.contains(&format!("ok    {check:<9} ")),
            "no {check} check:\n{t}"
        );
    }
}
