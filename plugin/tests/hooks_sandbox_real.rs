//! The host-mode sandbox against the real kernel, as root, the hooks driven the way the agent
//! runs them (`tests/agent/`): a job that tries every escape the issue lists fails at each one,
//! a kernelbot evaluation (the runner with its CPU example harness) still passes inside, and
//! the node is the same afterwards, listing for listing: cgroups, the run dir (leases, state),
//! `/tmp`, `/var/tmp`, `/dev/shm` and SysV IPC.
//!
//! "The node" is made observable without noise from everything else running on this machine:
//! each test starts a holder process in fresh mount and IPC namespaces with its own `/tmp`,
//! `/var/tmp` and `/dev/shm`, and every hook runs inside them (`nsenter`), as if that were the
//! host. A sandbox that leaked would leak there, where nothing else writes. The tests' files
//! live under `CARGO_TARGET_TMPDIR` (not `/tmp`) so the hooks see them. Tests of this binary
//! run one at a time: each has its own run dir, and an `environment` hook treats job cgroups
//! without state in its run dir as a lost job's.
//!
//! Skipped (counted as skipped) where not root or cgroups are not writable.

mod agent;
#[path = "common/real_cgroups.rs"]
mod real_cgroups;

use kernelkite_testkit::users::TestUser;
use std::collections::BTreeMap;
use std::io::BufRead;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agent::{output_text, Agent, Install, Job};
use real_cgroups::{alive, online_cpus, real_cgroups};
use serde_json::json;

/// One sandbox test at a time (see the module's documentation).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// A job id prefix of this test process, so snapshots can tell our cgroups from others'.
fn prefix() -> String {
    format!("kk-sbx-{}", std::process::id())
}

/// A process holding fresh mount and IPC namespaces with their own `/tmp`, `/var/tmp` and
/// `/dev/shm`: the node as the hooks see it.
struct Holder(Child);

impl Holder {
    fn start() -> Option<Holder> {
        let mut child = Command::new("unshare")
            .args([
                "--mount",
                "--ipc",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
            ])
            .arg(
                "for d in /tmp /var/tmp /dev/shm; do \
                   mount -t tmpfs -o size=16m,mode=1777 kk-node $d || exit 1; done; \
                 echo ready; exec sleep 600",
            )
            .stdout(Stdio::piped())
            .spawn()
            .ok()?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take()?)
            .read_line(&mut line)
            .ok()?;
        (line.trim() == "ready").then_some(Holder(child))
    }

    /// Runs a program inside, in `cwd` (entering a mount namespace starts at its root).
    fn wrapper(&self, cwd: &Path) -> Vec<String> {
        vec![
            "nsenter".into(),
            "--target".into(),
            self.0.id().to_string(),
            "--mount".into(),
            "--ipc".into(),
            format!("--wd={}", cwd.display()),
            "--".into(),
        ]
    }

    /// `/tmp`, `/var/tmp`, `/dev/shm` and SysV IPC as the hooks see them.
    fn listing(&self) -> String {
        let wrapper = self.wrapper(Path::new("/"));
        let mut cmd = Command::new(&wrapper[0]);
        cmd.args(&wrapper[1..]).args([
            "sh",
            "-c",
            "find /tmp /var/tmp /dev/shm -mindepth 1 -printf '%p %M %u %s\\n' | sort; ipcs -a",
        ]);
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", output_text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every cgroup directory of every hierarchy (4 levels deep), except other jobs' cgroups and
/// the per-command cgroups of this machine's own process runner (`process_api`), which come
/// and go with every command anyone runs.
fn cgroup_listing() -> Vec<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mut out = Vec::new();
    for m in kernelkite_isolate::cgroup::parse_mountinfo(&text) {
        if m.fs_type != "cgroup" && m.fs_type != "cgroup2" {
            continue;
        }
        let mut stack = vec![(PathBuf::from(&m.mount_point), 0)];
        while let Some((dir, depth)) = stack.pop() {
            out.push(dir.display().to_string());
            if depth == 4 {
                continue;
            }
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !e.file_type().is_ok_and(|t| t.is_dir()) || name == "process_api" {
                    continue;
                }
                let others_job = dir.file_name().is_some_and(|n| n == "kernelkite")
                    && !name.starts_with(&prefix());
                if !others_job {
                    stack.push((e.path(), depth + 1));
                }
            }
        }
    }
    out.sort();
    out
}

/// The run dir: every path with its mode and size, and the leases' contents.
fn run_dir_listing(run_dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![run_dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        let content = if meta.is_file() {
            std::fs::read_to_string(&p).unwrap_or_default()
        } else {
            String::new()
        };
        out.push(format!(
            "{} {:o} {} {content:?}",
            p.display(),
            meta.mode(),
            meta.len()
        ));
        if meta.is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().flatten().map(|e| e.path()));
        }
    }
    out.sort();
    out
}

/// The node as far as a job could change it.
#[derive(Debug, PartialEq)]
struct Snapshot {
    holder: String,
    cgroups: Vec<String>,
    run_dir: Vec<String>,
}

/// A node for one test: a plan of two NVIDIA GPUs whose slices sit on the last CPU, fake
/// device nodes with the driver's real numbers (`c 195 0`, `c 195 1`, `c 195 255`) and the
/// driver's files naming the minors, an agent bound to GPU 0 whose builds, config and
/// another job's checkout lie beside it, and a holder standing for the host.
struct SandboxNode {
    dir: tempfile::TempDir,
    agent: Agent,
    holder: Holder,
    run_dir: PathBuf,
    user: TestUser,
    own_cpu: u32,
    other_cpu: u32,
}

impl SandboxNode {
    fn new(tag: &str, memory: u64, user_option: Option<&str>) -> Option<SandboxNode> {
        let dir = tempfile::Builder::new()
            .prefix("kk-sandbox")
            .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
            .unwrap();
        // The job user walks these paths (its checkout, the fake GPU nodes) by name.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let root = dir.path();
        let cpus = online_cpus();
        let own_cpu = *cpus.last().unwrap();
        let other_cpu = *cpus.first().unwrap();
        let slices: Vec<serde_json::Value> = (0..2)
            .map(|i| {
                json!({"index": i, "gpu": {"vendor": "nvidia", "pci_bus_id": format!("0000:{:02x}:00.0", 0x18 + i),
                         "uuid": null, "numa_node": 0},
                       "cpus": [own_cpu], "mems": [0], "memory_bytes": memory})
            })
            .collect();
        let plan = json!({"slices": slices, "reserved_cpus": [], "warnings": []});
        std::fs::write(root.join("plan.json"), plan.to_string()).unwrap();
        let sys = root.join("sysfs");
        let dev = root.join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        for (i, minor) in [(0u32, 0u32), (1, 1)] {
            let d = sys.join(format!(
                "proc/driver/nvidia/gpus/0000:{:02x}:00.0",
                0x18 + i
            ));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("information"), format!("Device Minor: \t {minor}\n")).unwrap();
        }
        for (name, minor) in [("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255)] {
            let ok = Command::new("mknod")
                .args(["-m", "666"])
                .arg(dev.join(name))
                .args(["c", "195", &minor.to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "mknod {name}");
        }
        let builds = root.join("builds");
        let other = builds.join("other-job/checkout");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("secret.txt"), "another job's work").unwrap();
        let cfg = root.join("etc/buildkite-agent.cfg");
        std::fs::create_dir_all(cfg.parent().unwrap()).unwrap();
        std::fs::write(&cfg, "token=\"secret-agent-token\"\n").unwrap();
        let run_dir = root.join("run");
        let user = TestUser::new(tag);
        let mut env = BTreeMap::new();
        let mut set = |k: &str, v: &Path| {
            env.insert(k.to_string(), v.display().to_string());
        };
        set("KERNELKITE_RUN_DIR", &run_dir);
        set("KERNELKITE_PLAN_FILE", &root.join("plan.json"));
        set("KERNELKITE_SYSFS_ROOT", &sys);
        set("KERNELKITE_DEV_ROOT", &dev);
        set("KERNELKITE_CGROUP_ROOT", Path::new("/"));
        set("BUILDKITE_BUILD_PATH", &builds);
        set("BUILDKITE_CONFIG_PATH", &cfg);
        set("KK_AGENT_CFG", &cfg);
        set("KK_RUN_DIR", &run_dir);
        set("KK_FAKE_DEV", &dev);
        set("KK_OTHER_CHECKOUT", &other);
        env.insert("BUILDKITE_AGENT_META_DATA_GPU_INDEX".into(), "0".into());
        env.insert("KK_OTHER_CPU".into(), other_cpu.to_string());
        let user_name = user_option.map_or_else(|| user.name.clone(), str::to_string);
        env.insert(
            "KERNELKITE_CONFIG".into(),
            json!({"network": false, "user": user_name}).to_string(),
        );
        // The agent's own directory holds the builds: jobs' checkouts are under it.
        let agent = Agent::new(&builds, &format!("sbx-{tag}"), &env);
        let holder = Holder::start()?;
        Some(SandboxNode {
            dir,
            agent,
            holder,
            run_dir,
            user,
            own_cpu,
            other_cpu,
        })
    }

    fn job(&self, id: &str, command: &str) -> Job {
        let mut job = self
            .agent
            .start_job(id, command, None, Install::AgentBinary);
        let checkout = PathBuf::from(&job.env["BUILDKITE_BUILD_CHECKOUT_PATH"]);
        job.wrapper = self.holder.wrapper(&checkout);
        job
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            holder: self.holder.listing(),
            cgroups: cgroup_listing(),
            run_dir: run_dir_listing(&self.run_dir),
        }
    }

    /// A job that only runs `true`: leaves the lease files every later job finds.
    fn warm_up(&self) {
        let mut job = self.job(&format!("{}-warm", prefix()), "true");
        for (hook, o) in job.run_all() {
            assert!(o.status.success(), "{hook}: {}", output_text(&o));
        }
    }
}

fn needs_root_and_cgroups() -> Option<kernelkite_isolate::cgroup::Cgroups> {
    let cg = real_cgroups()?;
    for tool in ["unshare", "nsenter", "ipcs", "ipcmk", "mknod"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            kernelkite_testkit::skip(format_args!("{tool} is not installed"));
            return None;
        }
    }
    Some(cg)
}

const ESCAPES: &str = r#"set +e
try() { name=$1; shift; ( "$@" ) >/dev/null 2>&1 && echo "ESCAPED $name" || echo "blocked $name"; }
echo "uid $(id -u)"
grep -E '^(CapEff|CapPrm|CapInh|CapBnd|CapAmb|NoNewPrivs)' /proc/self/status
try write-own-cgroup sh -c "echo $KK_OTHER_CPU > $KK_OWN_CPUS"
try make-sub-cgroup mkdir "$(dirname "$KK_OWN_CPUS")/escape"
try move-self sh -c 'ok=1; for f in $KK_ROOT_PROCS; do echo $$ > $f && ok=0; done; exit $ok'
setsid sleep 300 </dev/null >/dev/null 2>&1 &
daemon=$!
echo $daemon > daemon.pid
try move-daemon sh -c "ok=1; for f in \$KK_ROOT_PROCS; do echo $daemon > \$f && ok=0; done; exit \$ok"
try taskset-outside taskset -c "$KK_OTHER_CPU" true
taskset -pc 0-4095 $$ >/dev/null 2>&1
echo "cpus-after-taskset $(grep Cpus_allowed_list /proc/self/status | cut -f2)"
try read-run-dir sh -c "ls -A '$KK_RUN_DIR' | grep -q ."
try read-leases sh -c "cat '$KK_RUN_DIR'/leases/*"
try token-in-env test -n "$BUILDKITE_AGENT_ACCESS_TOKEN"
try job-api-in-env test -n "$BUILDKITE_AGENT_JOB_API_TOKEN$BUILDKITE_AGENT_JOB_API_SOCKET"
try token-in-config grep -q secret-agent-token "$KK_AGENT_CFG"
try job-api-socket test -S "$KK_API_SOCKET"
try other-checkout cat "$KK_OTHER_CHECKOUT/secret.txt"
try other-gpu-in-dev test -e /dev/nvidia1
echo "open-own-gpu: $( (exec 3< /dev/nvidia0) 2>&1 | sed 's/.*: //')"
echo "open-other-gpu-host-node: $( (exec 3< "$KK_FAKE_DEV/nvidia1") 2>&1 | sed 's/.*: //')"
try mknod mknod /tmp/kk-node c 195 1
try write-etc touch /etc/kk-escape
try signal-agent kill -0 "$KK_BOOTSTRAP_PID"
try see-agent test -e "/proc/$KK_BOOTSTRAP_PID"
try network bash -c 'exec 3<>/dev/tcp/192.0.2.1/80'
echo leak > /dev/shm/kk-leak && echo "left /dev/shm/kk-leak"
echo leak > /tmp/kk-leak && echo "left /tmp/kk-leak"
echo leak > /var/tmp/kk-leak && echo "left /var/tmp/kk-leak"
ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null && ipcmk -S 1 >/dev/null && echo "left SysV shm, queue, semaphore"
echo done
"#;

#[test]
fn every_escape_fails_and_the_node_is_left_as_it_was() {
    let _one = serial();
    let Some(cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some(node) = SandboxNode::new("e", 64 << 20, None) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    node.warm_up();
    let before = node.snapshot();
    let id = format!("{}-escape", prefix());
    let _guard = real_cgroups::CgroupGuard(vec![id.clone()]);
    let mut job = node.job(&id, "bash escapes.sh");
    let checkout = PathBuf::from(&job.env["BUILDKITE_BUILD_CHECKOUT_PATH"]);
    std::fs::write(checkout.join("escapes.sh"), ESCAPES).unwrap();
    // What the script aims at: its own cgroup's CPUs and every root cgroup.procs.
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mounts = kernelkite_isolate::cgroup::parse_mountinfo(&text);
    let roots: Vec<String> = mounts
        .iter()
        .filter(|m| m.fs_type == "cgroup" || m.fs_type == "cgroup2")
        .map(|m| format!("{}/cgroup.procs", m.mount_point))
        .collect();
    let own_cpus = match cg.version() {
        1 => format!("/sys/fs/cgroup/cpuset/kernelkite/{id}/cpuset.cpus"),
        _ => {
            let m = mounts.iter().find(|m| m.fs_type == "cgroup2").unwrap();
            format!("{}/kernelkite/{id}/cpuset.cpus", m.mount_point)
        }
    };
    job.set_env("KK_OWN_CPUS", &own_cpus);
    job.set_env("KK_ROOT_PROCS", &roots.join(" "));
    let socket = job.env["BUILDKITE_AGENT_JOB_API_SOCKET"].clone();
    job.set_env("KK_API_SOCKET", &socket);
    let bootstrap = job.bootstrap.id().to_string();
    job.set_env("KK_BOOTSTRAP_PID", &bootstrap);

    let env_out = job.run_hook("environment");
    assert!(env_out.status.success(), "{}", output_text(&env_out));
    let cpus_before = std::fs::read_to_string(&own_cpus).unwrap();
    let cmd = job.run_hook("command");
    assert!(cmd.status.success(), "{}", output_text(&cmd));
    let stdout = String::from_utf8_lossy(&cmd.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&cmd.stderr).into_owned();
    assert!(stdout.ends_with("done\n"), "{}", output_text(&cmd));

    // Each escape failed.
    assert!(!stdout.contains("ESCAPED"), "{stdout}");
    for blocked in [
        "write-own-cgroup",
        "make-sub-cgroup",
        "move-self",
        "move-daemon",
        "taskset-outside",
        "read-run-dir",
        "read-leases",
        "token-in-env",
        "job-api-in-env",
        "token-in-config",
        "job-api-socket",
        "other-checkout",
        "other-gpu-in-dev",
        "mknod",
        "write-etc",
        "signal-agent",
        "see-agent",
        "network",
    ] {
        assert!(
            stdout.contains(&format!("blocked {blocked}\n")),
            "{blocked}: {stdout}"
        );
    }
    // Unprivileged, for good.
    assert!(
        stdout.contains(&format!("uid {}\n", node.user.uid)),
        "{stdout}"
    );
    for set in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
        assert!(
            stdout.contains(&format!("{set}:\t0000000000000000")),
            "{set}: {stdout}"
        );
    }
    assert!(stdout.contains("NoNewPrivs:\t1"), "{stdout}");
    // Its cgroup is as the hooks made it, and so is what it runs on.
    assert_eq!(std::fs::read_to_string(&own_cpus).unwrap(), cpus_before);
    assert!(
        stdout.contains(&format!("cpus-after-taskset {}\n", node.own_cpu)),
        "{stdout}"
    );
    assert_ne!(node.own_cpu, node.other_cpu, "needs two CPUs");
    // Its own GPU's node is there (and only the missing driver stops it); the other GPU's is
    // not, and on cgroup v1 the devices controller refuses it even where it does exist.
    assert!(
        stdout.contains("open-own-gpu: No such device or address"),
        "{stdout}"
    );
    if cg.version() == 1 && Path::new("/sys/fs/cgroup/devices/devices.deny").exists() {
        assert!(
            stdout.contains("open-other-gpu-host-node: Operation not permitted"),
            "{stdout}"
        );
    }
    // It could write its private directories and SysV IPC...
    for left in [
        "left /dev/shm/kk-leak",
        "left /tmp/kk-leak",
        "left /var/tmp/kk-leak",
        "left SysV shm, queue, semaphore",
    ] {
        assert!(stdout.contains(left), "{left}: {stdout}");
    }
    // ... and the job log said what it could see.
    for said in [
        format!(
            "kernelkite: sandbox: the command runs as {} (uid {}",
            node.user.name, node.user.uid
        ),
        "no_new_privs, no capabilities".into(),
        format!(
            "kernelkite: sandbox: CPUs {}, memory nodes 0, memory limit 64 MiB",
            node.own_cpu
        ),
        "GPU device nodes: /dev/nvidia0, /dev/nvidiactl (no other GPU's node exists in this /dev)"
            .into(),
        "private: /tmp (64 MiB), /var/tmp (64 MiB)".into(),
        "/dev/shm (64 MiB)".into(),
        "read-only: the cgroup file system".into(),
        "network: loopback only".into(),
    ] {
        assert!(stderr.contains(&said), "{said:?} not in\n{stderr}");
    }
    // The run dir among the hidden paths (the Job API socket's directory may come first).
    let hidden = stderr
        .lines()
        .find(|l| l.contains("sandbox: hidden: "))
        .unwrap_or_else(|| panic!("no hidden line in\n{stderr}"));
    assert!(
        hidden
            .split_once("hidden: ")
            .is_some_and(|(_, list)| list.split(", ").any(|p| Path::new(p) == node.run_dir)),
        "{} not hidden: {hidden}",
        node.run_dir.display()
    );

    // The daemon is still in the job's cgroup; pre-exit kills it and hands the checkout back.
    let daemon: u32 = std::fs::read_to_string(checkout.join("daemon.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(alive(daemon));
    assert!(cg.pids(&id).unwrap().contains(&daemon));
    assert_eq!(std::fs::metadata(&checkout).unwrap().uid(), node.user.uid);
    let exit = job.run_hook("pre-exit");
    assert!(exit.status.success(), "{}", output_text(&exit));
    let report = String::from_utf8_lossy(&exit.stdout);
    assert!(
        report.contains(&daemon.to_string()) && report.contains("returned the checkout"),
        "{report}"
    );
    let start = Instant::now();
    while alive(daemon) && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!alive(daemon));
    for f in ["", "daemon.pid", "escapes.sh"] {
        assert_eq!(std::fs::metadata(checkout.join(f)).unwrap().uid(), 0, "{f}");
    }

    // The node is as it was: no file, segment, cgroup or lease of the job is left.
    let after = node.snapshot();
    assert_eq!(before, after);
    drop(node.dir);
}

#[test]
fn a_kernelbot_evaluation_passes_inside_the_sandbox() {
    let _one = serial();
    let Some(_cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some(python) = ["/usr/bin/python3", "/usr/local/bin/python3"]
        .into_iter()
        .find(|p| Path::new(p).exists())
    else {
        kernelkite_testkit::skip("no system python3 the job user can run");
        return;
    };
    let runner = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("examples/kernelkite-runner");
    assert!(
        runner.exists(),
        "{} (built by cargo test)",
        runner.display()
    );
    let Some(node) = SandboxNode::new("k", 256 << 20, None) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    node.warm_up();
    let before = node.snapshot();
    let id = format!("{}-eval", prefix());
    let _guard = real_cgroups::CgroupGuard(vec![id.clone()]);
    let mut job = node.job(
        &id,
        r#""$KK_RUNNER" --payload-file payload.txt --output result.json"#,
    );
    job.set_env("KK_RUNNER", &runner.display().to_string());
    job.set_env("KERNELKITE_PYTHON", python);
    let checkout = PathBuf::from(&job.env["BUILDKITE_BUILD_CHECKOUT_PATH"]);
    // The payload kernelbot would send, in the checkout as a pipeline would carry it.
    let payload = Command::new(&runner)
        .args(["--example", "--print-payload"])
        .output()
        .unwrap();
    assert!(payload.status.success());
    std::fs::write(checkout.join("payload.txt"), &payload.stdout).unwrap();
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    let result: serde_json::Value =
        serde_json::from_slice(&std::fs::read(checkout.join("result.json")).unwrap()).unwrap();
    assert_eq!(result["success"], true, "{result}");
    for run in ["test", "benchmark", "leaderboard"] {
        assert_eq!(
            result["runs"][run]["run"]["passed"], true,
            "{run}: {result}"
        );
    }
    // Written by the job user; the agent's again for the upload.
    assert_eq!(
        std::fs::metadata(checkout.join("result.json"))
            .unwrap()
            .uid(),
        0
    );
    let log = String::from_utf8_lossy(&outs[1].1.stderr);
    assert!(
        log.contains(&format!("the command runs as {}", node.user.name)),
        "{log}"
    );
    assert_eq!(before, node.snapshot());
}

#[test]
fn root_needs_allow_root_and_then_runs_without_capabilities() {
    let _one = serial();
    let Some(_cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some(node) = SandboxNode::new("r", 64 << 20, Some("root")) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    let id = format!("{}-root", prefix());
    let _guard = real_cgroups::CgroupGuard(vec![id.clone()]);
    let mut job = node.job(
        &id,
        "grep -E '^(Uid|CapEff|CapBnd|NoNewPrivs)' /proc/self/status",
    );
    let refused = job.run_hook("environment");
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("would run as root") && err.contains("allow-root: true"),
        "{err}"
    );
    assert!(
        node.run_dir
            .join("leases")
            .read_dir()
            .map_or(true, |mut d| d.all(|e| e
                .unwrap()
                .metadata()
                .unwrap()
                .len()
                == 0)),
        "nothing may be held after a refusal"
    );
    assert!(job.run_hook("pre-exit").status.success());

    let id = format!("{}-root-allowed", prefix());
    let _guard2 = real_cgroups::CgroupGuard(vec![id.clone()]);
    let mut job = node.job(
        &id,
        "grep -E '^(Uid|CapEff|CapBnd|NoNewPrivs)' /proc/self/status",
    );
    job.set_env(
        "BUILDKITE_PLUGIN_CONFIGURATION",
        &json!({"user": "root", "allow-root": true}).to_string(),
    );
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    let env_log = String::from_utf8_lossy(&outs[0].1.stderr);
    assert!(
        env_log.contains("WARNING: the command will run as root"),
        "{env_log}"
    );
    let stdout = String::from_utf8_lossy(&outs[1].1.stdout);
    assert!(stdout.contains("Uid:\t0\t0\t0\t0"), "{stdout}");
    assert!(stdout.contains("CapEff:\t0000000000000000"), "{stdout}");
    assert!(stdout.contains("CapBnd:\t0000000000000000"), "{stdout}");
    assert!(stdout.contains("NoNewPrivs:\t1"), "{stdout}");
    let log = String::from_utf8_lossy(&outs[1].1.stderr);
    assert!(log.contains("WARNING: the command runs as root"), "{log}");
}

#[test]
fn a_missing_job_user_fails_the_job_before_anything_is_held() {
    let _one = serial();
    let Some(_cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some(node) = SandboxNode::new("m", 64 << 20, Some("kk-no-such-user")) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    let id = format!("{}-nouser", prefix());
    let _guard = real_cgroups::CgroupGuard(vec![id.clone()]);
    let mut job = node.job(&id, "true");
    let out = job.run_hook("environment");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"kk-no-such-user\"") && err.contains("useradd --system"),
        "{err}"
    );
    assert!(!node.run_dir.join("leases").exists(), "no lease was taken");
}

#[test]
fn a_command_that_cannot_start_fails_the_step_with_the_reason() {
    let _one = serial();
    let Some(_cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some(node) = SandboxNode::new("x", 64 << 20, None) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    let id = format!("{}-noshell", prefix());
    let _guard = real_cgroups::CgroupGuard(vec![id.clone()]);
    let mut job = node.job(&id, "true");
    job.set_env("BUILDKITE_SHELL", "/nonexistent/shell -c");
    assert!(job.run_hook("environment").status.success());
    let cmd = job.run_hook("command");
    assert_eq!(cmd.status.code(), Some(1), "{}", output_text(&cmd));
    let err = String::from_utf8_lossy(&cmd.stderr);
    assert!(
        err.contains("cannot start \"/nonexistent/shell\" in the job's cgroup")
            && err.contains("No such file or directory"),
        "{err}"
    );
    // A failure inside the sandbox's own set-up comes back with its reason: the hook running
    // in a directory the sandbox hides (another job's checkout) cannot be entered again.
    let other = node.dir.path().join("builds/other-job/checkout");
    job.set_env("BUILDKITE_SHELL", "/bin/bash -e -c");
    job.wrapper = node.holder.wrapper(&other);
    let cmd = job.run_hook("command");
    assert_eq!(cmd.status.code(), Some(1), "{}", output_text(&cmd));
    let err = String::from_utf8_lossy(&cmd.stderr);
    assert!(
        err.contains(&format!(
            "cannot start the command in its sandbox: cannot enter {}: No such file or directory",
            other.display()
        )),
        "{err}"
    );
    let exit = job.run_hook("pre-exit");
    assert!(exit.status.success(), "{}", output_text(&exit));
}
