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
//! live under `CARGO_TARGET_TMPDIR` (not `/tmp`) so the hooks see them. Each test has its own
//! run dir, and an `environment` hook takes running job cgroups without state in its run dir
//! for another instance's and refuses: so each runs alone, while no other test of the binary
//! has a job on the node (`real_cgroups::turn_alone`).
//!
//! Skipped (counted as skipped) where not root or cgroups are not writable.

use crate::agent;
use crate::real_cgroups;

use kernelkite_testkit::users::TestUser;
use std::collections::BTreeMap;
use std::io::BufRead;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use agent::{output_text, Agent, Install, Job};
use real_cgroups::{online_cpus, real_cgroups_alone};
use serde_json::json;

/// A job id prefix of this test process, so snapshots can tell our cgroups from others'.
fn prefix() -> String {
    format!("kk-sbx-{}", std::process::id())
}

/// A process holding fresh mount and IPC namespaces with their own `/tmp`, `/var/tmp` and
/// `/dev/shm`: the node as the hooks see it.
/// The holder process, and whether it has a network namespace of its own.
struct Holder(Child, bool);

/// The directories the tests need inside the holder (the workspace, its build directory)
/// that the holder's fresh `/tmp`, `/var/tmp` or `/dev/shm` would cover: a checkout under
/// `/tmp` is where many try a project first. Shallowest only.
fn kept_under_covered_dirs() -> Vec<PathBuf> {
    let target_tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf);
    let mut keep: Vec<PathBuf> = [workspace, target_tmp.parent().map(Path::to_path_buf)]
        .into_iter()
        .flatten()
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .filter(|p| {
            ["/tmp", "/var/tmp", "/dev/shm"]
                .iter()
                .any(|d| p.starts_with(d))
        })
        .collect();
    keep.sort();
    let mut out: Vec<PathBuf> = Vec::new();
    for p in keep {
        if !out.iter().any(|o| p.starts_with(o)) {
            out.push(p);
        }
    }
    out
}

/// A shell word for `path` (single-quoted).
fn quoted(path: &Path) -> String {
    format!("'{}'", path.display().to_string().replace('\'', r"'\''"))
}

impl Holder {
    /// With `net`, the holder's node has a network namespace of its own too (only `lo`, up),
    /// where the network tests build a node and an outside world (`own_network_world`).
    fn start_with(net: bool) -> Option<Holder> {
        // Each kept directory is opened before the covering mounts and bound back from its
        // descriptor afterwards (`/proc/self/fd/N` names the covered directory itself).
        let keep = kept_under_covered_dirs();
        let mut script = String::new();
        for (i, k) in keep.iter().enumerate().take(6) {
            script.push_str(&format!("exec {}< {} || exit 1; ", i + 3, quoted(k)));
        }
        script.push_str(
            "for d in /tmp /var/tmp /dev/shm; do \
               mount -t tmpfs -o size=16m,mode=1777 kk-node $d || exit 1; done; ",
        );
        for (i, k) in keep.iter().enumerate().take(6) {
            script.push_str(&format!(
                "mkdir -p {k} && mount --no-canonicalize --bind /proc/self/fd/{fd} {k} || exit 1; exec {fd}<&-; ",
                k = quoted(k),
                fd = i + 3
            ));
        }
        if net {
            script.push_str("ip link set lo up || exit 1; ");
        }
        script.push_str("echo ready; exec sleep 600");
        let mut unshare = Command::new("unshare");
        unshare.args(["--mount", "--ipc"]);
        if net {
            unshare.arg("--net");
        }
        let mut child = unshare
            .args(["--propagation", "private", "--", "sh", "-c"])
            .arg(script)
            .stdout(Stdio::piped())
            .spawn()
            .ok()?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take()?)
            .read_line(&mut line)
            .ok()?;
        (line.trim() == "ready").then_some(Holder(child, net))
    }

    /// Runs a program inside, in `cwd` (entering a mount namespace starts at its root).
    fn wrapper(&self, cwd: &Path) -> Vec<String> {
        let mut w = vec![
            "nsenter".into(),
            "--target".into(),
            self.0.id().to_string(),
            "--mount".into(),
            "--ipc".into(),
        ];
        if self.1 {
            w.push("--net".into());
        }
        w.extend([format!("--wd={}", cwd.display()), "--".into()]);
        w
    }

    /// `/tmp`, `/var/tmp`, `/dev/shm` and SysV IPC as the hooks see them.
    fn listing(&self) -> String {
        let wrapper = self.wrapper(Path::new("/"));
        let mut cmd = Command::new(&wrapper[0]);
        cmd.args(&wrapper[1..]).args([
            "sh",
            "-c",
            // -xdev: not into the test's own directories bound back under /tmp.
            "find /tmp /var/tmp /dev/shm -xdev -mindepth 1 -printf '%p %M %u %s\\n' | sort; ipcs -a",
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
    for m in kernelkite_hooks::cgroup::parse_mountinfo(&text) {
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
        SandboxNode::build(tag, memory, user_option, false)
    }

    /// A node whose holder has a network namespace of its own (the network tests).
    fn with_own_network(tag: &str, memory: u64) -> Option<SandboxNode> {
        SandboxNode::build(tag, memory, None, true)
    }

    fn build(tag: &str, memory: u64, user_option: Option<&str>, net: bool) -> Option<SandboxNode> {
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
        // The driver's /proc directories as a node has them (both GPUs, their UUIDs, the
        // writable registries, UVM's list of GPUs in use): what the job sees of them is masked.
        kernelkite_testkit::fake_nvml::write_driver_proc(
            &sys,
            &[("0000:18:00.0", 0), ("0000:19:00.0", 1)],
            &[],
        )
        .unwrap();
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
        // By its real path: the job compares it with its mount table.
        set("KK_FAKE_SYSFS", &std::fs::canonicalize(&sys).unwrap());
        set("KK_OTHER_CHECKOUT", &other);
        // A directory of the host's that anyone may write to (as /var/crash or a forgotten
        // 1777 directory would be): the job's view of it is read-only.
        let open = root.join("open");
        std::fs::create_dir_all(&open).unwrap();
        std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o1777))
            .unwrap();
        set("KK_HOST_WRITABLE", &open);
        env.insert("BUILDKITE_AGENT_META_DATA_GPU_INDEX".into(), "0".into());
        env.insert("KK_OTHER_CPU".into(), other_cpu.to_string());
        let user_name = user_option.map_or_else(|| user.name.clone(), str::to_string);
        // A credential of the node's, which the job must never see (the allow-list).
        env.insert("AWS_SECRET_ACCESS_KEY".into(), "node-secret".into());
        // The test's own variables reach the job only because the step lists them.
        env.insert(
            "KERNELKITE_CONFIG".into(),
            json!({"user": user_name, "environment": TEST_VARIABLES}).to_string(),
        );
        // The agent's own directory holds the builds: jobs' checkouts are under it.
        let agent = Agent::new(&builds, &format!("sbx-{tag}"), &env);
        let holder = Holder::start_with(net)?;
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
        // The step's artifact_paths, as the agent hands them to the hooks: what of the job's
        // writes to its checkout reaches the host.
        job.set_env("BUILDKITE_ARTIFACT_PATHS", "result.json;daemon.pid;planted");
        job
    }

    /// A job whose command is the runner evaluating `payload.txt` of its checkout into
    /// `result.json`, with `python`; the job and its checkout.
    fn evaluation_job(&self, id: &str, python: &str, runner: &Path) -> (Job, PathBuf) {
        let mut job = self.job(
            id,
            r#""$KK_RUNNER" --payload-file payload.txt --output result.json"#,
        );
        job.set_env("KERNELKITE_PYTHON", python);
        let checkout = PathBuf::from(&job.env["BUILDKITE_BUILD_CHECKOUT_PATH"]);
        job.set_env("KK_RUNNER", &runner_for_the_job(runner, &checkout));
        (job, checkout)
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

/// A system Python the job user can run and the runner (the `kernelkite-runner` example, built
/// by `cargo test`); `None`, said as a skip, without Python.
fn evaluation_tools() -> Option<(&'static str, PathBuf)> {
    let Some(python) = ["/usr/bin/python3", "/usr/local/bin/python3"]
        .into_iter()
        .find(|p| Path::new(p).exists())
    else {
        kernelkite_testkit::skip("no system python3 the job user can run");
        return None;
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
    Some((python, runner))
}

/// The runner as the job can run it: from the checkout when the build directory is under a
/// directory the sandbox replaces (a workspace under `/tmp`), else where cargo built it.
fn runner_for_the_job(runner: &Path, checkout: &Path) -> String {
    let covered = ["/tmp", "/var/tmp", "/dev/shm"]
        .iter()
        .any(|d| runner.starts_with(d));
    if !covered {
        return runner.display().to_string();
    }
    let copy = checkout.join("kernelkite-runner");
    std::fs::copy(runner, &copy).unwrap();
    copy.display().to_string()
}

/// A host path the test made, removed when the test ends however it ends.
struct RemovedAtEnd(PathBuf);

impl Drop for RemovedAtEnd {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The machine's cgroups and this test's turn alone at them (see the module's documentation).
fn needs_root_and_cgroups() -> Option<real_cgroups::RealCgroups> {
    let cg = real_cgroups_alone()?;
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

/// The variables the tests hand their jobs (by the step's `environment` list).
const TEST_VARIABLES: &[&str] = &[
    "KK_AGENT_CFG",
    "KK_RUN_DIR",
    "KK_FAKE_DEV",
    "KK_FAKE_SYSFS",
    "KK_OTHER_CHECKOUT",
    "KK_OTHER_CPU",
    "KK_OWN_CPUS",
    "KK_ROOT_PROCS",
    "KK_API_SOCKET",
    "KK_BOOTSTRAP_PID",
    "KK_RUNNER",
    "KK_SERVICE_PORT",
    "KK_HOST_WRITABLE",
    "KK_HOST_SOCKET",
];

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
echo "driver-gpus $(ls "$KK_FAKE_SYSFS/proc/driver/nvidia/gpus" | tr '\n' ' ')"
echo "driver-entries $(ls "$KK_FAKE_SYSFS/proc/driver/nvidia" | sort | tr '\n' ' ')"
echo "driver-own-gpu $(grep -c 'Device Minor' "$KK_FAKE_SYSFS/proc/driver/nvidia/gpus/0000:18:00.0/information")"
try other-gpu-in-proc test -e "$KK_FAKE_SYSFS/proc/driver/nvidia/gpus/0000:19:00.0"
try other-uuid-in-proc sh -c 'grep -rq "GPU-00019000" "$KK_FAKE_SYSFS/proc/driver"'
try uvm-gpus-in-proc sh -c 'ls -A "$KK_FAKE_SYSFS/proc/driver/nvidia-uvm" | grep -q .'
try driver-warnings-in-proc test -e "$KK_FAKE_SYSFS/proc/driver/nvidia/warnings"
echo "modify $(grep ModifyDeviceFiles "$KK_FAKE_SYSFS/proc/driver/nvidia/params")"
echo "driver-mounts $(awk -v d="$KK_FAKE_SYSFS/proc/driver/" 'index($5, d) == 1 { split($6, o, ","); for (i = 7; $i != "-"; i++); print substr($5, length(d) + 1) ":" $(i + 1) ":" o[1] }' /proc/self/mountinfo | LC_ALL=C sort | tr '\n' ' ')"
try interrupts-in-proc sh -c 'grep -q . /proc/interrupts'
try firmware-in-sys sh -c 'ls -A /sys/firmware | grep -q .'
try page-flags-in-proc sh -c 'test -n "$(head -c 8 /proc/kpageflags | od -An)"'
echo "proc-read-only $(awk '$5 ~ /^\/proc\/(bus|fs|sys|sysrq-trigger)$/ && $6 ~ /^ro(,|$)/ { print $5 }' /proc/self/mountinfo | LC_ALL=C sort -u | tr '\n' ' ')"
try mknod mknod /tmp/kk-node c 195 1
try write-etc touch /etc/kk-escape
try signal-agent kill -0 "$KK_BOOTSTRAP_PID"
try see-agent test -e "/proc/$KK_BOOTSTRAP_PID"
try see-agent-in-proc sh -c 'for d in /proc/[0-9]*; do [ "$(stat -c %u $d)" = 0 ] && exit 0; done; exit 1'
try pid-namespace-is-the-host-s test "$(readlink /proc/self/ns/pid)" = "pid:[4026531836]"
echo "pid-of-the-job-shell $$"
try node-secret-in-env test -n "$AWS_SECRET_ACCESS_KEY"
try user-namespace unshare --user true
try mount-namespace unshare --mount true
try io-uring python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); r=l.syscall(425,1,0); sys.exit(1 if r<0 and ctypes.get_errno()==1 else 0)'
try keyring python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); r=l.syscall(248,b"user",b"kk",b"x",1,-3); sys.exit(1 if r<0 and ctypes.get_errno()==1 else 0)'
try userfaultfd python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); r=l.syscall(323,0); sys.exit(1 if r<0 and ctypes.get_errno()==1 else 0)'
try perf python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); r=l.syscall(298,0,0,-1,-1,0); sys.exit(1 if r<0 and ctypes.get_errno()==1 else 0)'
try personality python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); r=l.personality(0x0040000); sys.exit(1 if r<0 and ctypes.get_errno()==1 else 0)'
try loopback-service sh -c 'exec 3<>/dev/tcp/127.0.0.1/$KK_SERVICE_PORT'
try host-socket python3 -c 'import os,socket; socket.socket(socket.AF_UNIX).connect(os.environ["KK_HOST_SOCKET"])'
try setuid-root setpriv --reuid=0 --keep-groups true
try setgid-root setpriv --regid=0 --keep-groups true
try setgroups setpriv --clear-groups true
try setuid-another-job setpriv --reuid=1950000001 --keep-groups true
try setuid-another-submission setpriv --reuid=1960000001 --keep-groups true
echo "submission-user $KERNELKITE_SUBMISSION_USER"
echo "became $(setpriv --reuid="${KERNELKITE_SUBMISSION_USER%%:*}" --regid="${KERNELKITE_SUBMISSION_USER##*:}" --keep-groups id -u)"
try network bash -c 'exec 3<>/dev/tcp/192.0.2.1/80'
echo leak > /dev/shm/kk-leak && echo "left /dev/shm/kk-leak"
echo leak > /tmp/kk-leak && echo "left /tmp/kk-leak"
echo leak > /var/tmp/kk-leak && echo "left /var/tmp/kk-leak"
ipcmk -M 4096 >/dev/null && ipcmk -Q >/dev/null && ipcmk -S 1 >/dev/null && echo "left SysV shm, queue, semaphore"
echo done
"#;

#[test]
fn every_escape_fails_and_the_node_is_left_as_it_was() {
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
    let mounts = kernelkite_hooks::cgroup::parse_mountinfo(&text);
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
    // A service of the node's on loopback (the kernelkite service's API, say): a job must not
    // reach it (a job that submits jobs). It would answer a connection from the host's network.
    let service = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    job.set_env(
        "KK_SERVICE_PORT",
        &service.local_addr().unwrap().port().to_string(),
    );

    // A socket of the node's under /run (a database's, D-Bus's), open to everyone by its mode:
    // the host reaches it, the job must not.
    let host_socket = RemovedAtEnd(PathBuf::from(format!("/run/kk-{id}.sock")));
    let _ = std::fs::remove_file(&host_socket.0);
    let _listener = std::os::unix::net::UnixListener::bind(&host_socket.0).unwrap();
    std::fs::set_permissions(
        &host_socket.0,
        std::os::unix::fs::PermissionsExt::from_mode(0o666),
    )
    .unwrap();
    std::os::unix::net::UnixStream::connect(&host_socket.0).unwrap();
    job.set_env("KK_HOST_SOCKET", &host_socket.0.display().to_string());

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
        "see-agent-in-proc",
        "pid-namespace-is-the-host-s",
        "node-secret-in-env",
        "user-namespace",
        "mount-namespace",
        "io-uring",
        "keyring",
        "userfaultfd",
        "perf",
        "personality",
        "loopback-service",
        "network",
        "host-socket",
        "setuid-root",
        "setgid-root",
        "setgroups",
        "setuid-another-job",
        "setuid-another-submission",
        "interrupts-in-proc",
        "firmware-in-sys",
        "page-flags-in-proc",
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
    // Only the evaluator's three capabilities (CAP_KILL, CAP_SETGID, CAP_SETUID: 0xe0), and
    // with them only the slice's submission identity, not root or another slice's ids.
    for set in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
        assert!(
            stdout.contains(&format!("{set}:\t00000000000000e0")),
            "{set}: {stdout}"
        );
    }
    let submission = kernelkite_hooks::sandbox::user::SUBMISSION_ID_BASE;
    assert!(
        stdout.contains(&format!("submission-user {submission}:{submission}\n")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("became {submission}\n")),
        "{stdout}"
    );
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
    // Under a directory the sandbox replaces (a workspace in /tmp) the fake node is not even
    // there for the job; elsewhere it is, and the devices controller must refuse it.
    let fake_dev_visible = !["/tmp", "/var/tmp", "/dev/shm"]
        .iter()
        .any(|d| std::fs::canonicalize(node.dir.path()).is_ok_and(|p| p.starts_with(d)));
    if !fake_dev_visible {
        assert!(
            stdout.contains("open-other-gpu-host-node: No such file or directory"),
            "{stdout}"
        );
    } else if cg.version() == 1 && Path::new("/sys/fs/cgroup/devices/devices.deny").exists() {
        assert!(
            stdout.contains("open-other-gpu-host-node: Operation not permitted"),
            "{stdout}"
        );
    }
    // The driver's /proc directory (the fake tree standing for it, masked by the same code):
    // its own GPU only, the driver's three files with ModifyDeviceFiles off, nothing of the
    // other GPU (its directory, its UUID, UVM's list of GPUs in use), all of it read-only.
    let sys = std::fs::canonicalize(node.dir.path().join("sysfs")).unwrap();
    if fake_dev_visible {
        for blocked in [
            "other-gpu-in-proc",
            "other-uuid-in-proc",
            "uvm-gpus-in-proc",
            "driver-warnings-in-proc",
        ] {
            assert!(
                stdout.contains(&format!("blocked {blocked}\n")),
                "{blocked}: {stdout}"
            );
        }
        for seen in [
            "driver-gpus 0000:18:00.0 \n",
            "driver-entries gpus params registry version \n",
            "driver-own-gpu 1\n",
            "modify ModifyDeviceFiles: 0\n",
        ] {
            assert!(stdout.contains(seen), "{seen:?}: {stdout}");
        }
        let mounts: Vec<&str> = stdout
            .lines()
            .find_map(|l| l.strip_prefix("driver-mounts "))
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        assert_eq!(mounts.len(), 3, "{mounts:?}");
        assert_eq!(mounts[0], "nvidia-uvm:tmpfs:ro", "{mounts:?}");
        assert!(
            mounts[1].starts_with("nvidia/gpus/0000:18:00.0:") && mounts[1].ends_with(":ro"),
            "{mounts:?}"
        );
        assert_eq!(mounts[2], "nvidia:tmpfs:ro", "{mounts:?}");
        let said = format!(
            "kernelkite: sandbox: {}/proc/driver/nvidia: only GPU 0000:18:00.0 (and the driver's version, params, registry), read-only; {}/proc/driver/nvidia-uvm: empty",
            sys.display(),
            sys.display()
        );
        assert!(stderr.contains(&said), "{said:?} not in\n{stderr}");
    } else {
        assert!(stdout.contains("driver-gpus \n"), "{stdout}");
    }
    // Root's writable files of the job's /proc are read-only (runc's read-only paths).
    let proc_ro: String = kernelkite_hooks::sandbox::mounts::PROC_READ_ONLY
        .iter()
        .filter(|p| Path::new(p).exists())
        .map(|p| format!("{p} "))
        .collect();
    assert!(
        stdout.contains(&format!("proc-read-only {proc_ro}\n")),
        "{proc_ro}: {stdout}"
    );
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
        format!("no_new_privs, no capabilities but CAP_SETUID, CAP_SETGID and CAP_KILL, with which its evaluator runs the submission as kernelkite-submission-0 (uid {submission}): its filter lets it take no other id"),
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
    assert!(
        hidden
            .split_once("hidden: ")
            .is_some_and(|(_, list)| list.split(", ").any(|p| p == "/run")),
        "the host's /run not hidden: {hidden}"
    );

    // The setsid daemon ended with the command: the job's PID namespace died with it, so
    // nothing of the job is left in its cgroup even before pre-exit, which hands the checkout
    // back.
    assert!(checkout.join("daemon.pid").exists());
    assert_eq!(cg.pids(&id).unwrap(), Vec::<u32>::new());
    assert_eq!(std::fs::metadata(&checkout).unwrap().uid(), node.user.uid);
    let exit = job.run_hook("pre-exit");
    assert!(exit.status.success(), "{}", output_text(&exit));
    let report = String::from_utf8_lossy(&exit.stdout);
    assert!(report.contains("returned the checkout"), "{report}");
    for f in ["", "daemon.pid", "escapes.sh"] {
        assert_eq!(std::fs::metadata(checkout.join(f)).unwrap().uid(), 0, "{f}");
    }

    // The node is as it was: no file, segment, cgroup or lease of the job is left.
    let after = node.snapshot();
    assert_eq!(before, after);
    // The mask was the job's alone: the host's tree is whole.
    let host_gpus: Vec<String> = std::fs::read_dir(sys.join("proc/driver/nvidia/gpus"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(host_gpus, ["0000:18:00.0", "0000:19:00.0"]);
    assert!(
        std::fs::read_to_string(sys.join("proc/driver/nvidia/params"))
            .unwrap()
            .contains("ModifyDeviceFiles: 1\n")
    );
    drop(node.dir);
}

#[test]
fn a_kernelbot_evaluation_passes_inside_the_sandbox() {
    let Some(_cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some((python, runner)) = evaluation_tools() else {
        return;
    };
    let Some(node) = SandboxNode::new("k", 256 << 20, None) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    node.warm_up();
    let before = node.snapshot();
    let id = format!("{}-eval", prefix());
    let _guard = real_cgroups::CgroupGuard(vec![id.clone()]);
    let (mut job, checkout) = node.evaluation_job(&id, python, &runner);
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

/// What a hostile submission adds to the example's `submission.py`: it tries to stop, read and
/// kill the runner that evaluates it (its harness's parent), to take the runner's uid or root's,
/// and to write the checkout where `result.json` goes; prints each try (the result carries the
/// harness's output; only when `eval.py` imports it, not in kernelbot's pre-run, whose output
/// is not kept), and leaves a forger behind: a chain of forks, out of the harness's
/// session, that tries to rewrite `result.json` with a forged success for 5 s, long after the
/// runner wrote the real one, unless something ends it with the job.
const HOSTILE_SUBMISSION: &str = r#"
import json as _j, os as _o, signal as _s, time as _t
_runner = _o.getppid()
_checkout = _o.environ["BUILDKITE_BUILD_CHECKOUT_PATH"]
_result = _o.path.join(_checkout, "result.json")
if __name__ != "__main__":
    _tries = {}
    def _try(name, fn):
        try:
            fn()
            _tries[name] = "ESCAPED"
        except OSError as e:
            _tries[name] = "blocked (%s)" % e.strerror
    _try("stop-runner", lambda: _o.kill(_runner, _s.SIGSTOP))
    _try("kill-runner", lambda: _o.kill(_runner, _s.SIGKILL))
    _try("kill-everyone", lambda: _o.kill(-1, _s.SIGKILL))
    _try("read-runner-environ", lambda: open("/proc/%d/environ" % _runner).read())
    _try("read-runner-memory", lambda: open("/proc/%d/mem" % _runner, "rb").read(1))
    _try("pidfd-of-runner", lambda: _o.pidfd_open(_runner))
    def _other_thread():
        others = [int(t) for t in _o.listdir("/proc/%d/task" % _runner) if int(t) != _runner]
        if not others:
            raise OSError(1, "the runner has one thread")
        _o.kill(others[0], 0)
    _try("signal-a-runner-thread", _other_thread)
    import resource as _r
    _try("take-runner-descriptors", lambda: _r.prlimit(_runner, _r.RLIMIT_NOFILE, (0, 0)))
    _try("move-runner-cpus", lambda: _o.sched_setaffinity(_runner, {0}))
    _try("deprioritise-runner", lambda: _o.setpriority(_o.PRIO_PROCESS, _runner, 19))
    _try("become-the-runner", lambda: _o.setuid(_o.stat(_checkout).st_uid))
    _try("become-root", lambda: _o.setuid(0))
    _try("write-the-checkout", lambda: open(_o.path.join(_checkout, "planted"), "w"))
    _try("write-result-json", lambda: open(_result, "w"))
    print("KK-ATTACKS " + _j.dumps({"uid": _o.getuid(), "tries": _tries}), flush=True)
    if _o.fork() == 0:
        _o.setsid()
        for _ in range(30):
            if _o.fork() != 0:
                _o._exit(0)
        _forged = _j.dumps({"success": True, "error": "", "system": {}, "runs": {"forged": {}}})
        _end = _t.time() + 5
        while _t.time() < _end:
            try:
                with open(_result + ".f", "w") as f:
                    f.write(_forged)
                _o.replace(_result + ".f", _result)
            except OSError:
                pass
            _t.sleep(0.01)
        _o._exit(0)
"#;

/// The submission runs as the slice's submission identity, not the runner's uid: it cannot
/// stop, kill, read or trace the runner, take its uid or root's, or write the checkout, and
/// nothing it starts outlives the job to rewrite `result.json` (the job's PID namespace ends
/// with the runner). The result is the runner's.
#[test]
fn a_submission_cannot_stop_the_evaluator_or_forge_its_result() {
    let Some(_cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some((python, runner)) = evaluation_tools() else {
        return;
    };
    let Some(node) = SandboxNode::new("f", 256 << 20, None) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    node.warm_up();
    let before = node.snapshot();
    let id = format!("{}-forge", prefix());
    let _guard = real_cgroups::CgroupGuard(vec![id.clone()]);
    let (mut job, checkout) = node.evaluation_job(&id, python, &runner);
    let mut config = kernelkite_runner::example::config(kernelkite_kernelbot::config::Mode::Test);
    let honest = kernelkite_runner::example::SUBMISSION;
    config["sources"]["submission.py"] = format!("{honest}\n{HOSTILE_SUBMISSION}").into();
    let payload = kernelkite_kernelbot::payload::encode(&config).unwrap();
    std::fs::write(checkout.join("payload.txt"), payload).unwrap();
    let outs = job.run_all();
    let result = std::fs::read_to_string(checkout.join("result.json")).unwrap_or_default();
    for (hook, o) in &outs {
        assert!(
            o.status.success(),
            "{hook}: {}\nresult: {result}",
            output_text(o)
        );
    }
    let parsed: serde_json::Value = serde_json::from_str(&result).unwrap();
    let stdout = parsed["runs"]["test"]["run"]["stdout"]
        .as_str()
        .unwrap_or("");
    let report = stdout
        .lines()
        .find_map(|l| l.strip_prefix("KK-ATTACKS "))
        .unwrap_or_else(|| panic!("no report in {result}"));
    let report: serde_json::Value = serde_json::from_str(report).unwrap();
    let tries: BTreeMap<String, String> = serde_json::from_value(report["tries"].clone()).unwrap();
    assert_eq!(tries.len(), 14, "{tries:?}");
    for (name, verdict) in &tries {
        assert!(
            verdict.starts_with("blocked"),
            "{name}: {verdict} in {report}"
        );
    }
    // Another uid than the runner's (the node's test user): the slice's submission identity.
    assert_eq!(
        report["uid"],
        kernelkite_hooks::sandbox::user::SUBMISSION_ID_BASE,
        "{report}"
    );
    assert_ne!(report["uid"], node.user.uid);
    assert!(!checkout.join("planted").exists());
    // Well past the moment the forger would have rewritten it, the result is the runner's.
    std::thread::sleep(Duration::from_millis(300));
    let result: serde_json::Value =
        serde_json::from_slice(&std::fs::read(checkout.join("result.json")).unwrap()).unwrap();
    assert!(result["runs"].get("forged").is_none(), "{result}");
    assert_eq!(result["runs"]["test"]["run"]["passed"], true, "{result}");
    assert_eq!(before, node.snapshot());
}

/// Two jobs at once on two slices, each as the default job user: each runs as its slice's own
/// uid, in its own PID namespace, so one cannot see, signal or trace the other's processes
/// (not even with `kill -9 -1`), and the node is the same afterwards.
#[test]
fn two_jobs_on_two_slices_cannot_reach_each_other() {
    let Some(cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some(node) = SandboxNode::new("x", 64 << 20, Some("kernelkite-job")) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    node.warm_up();
    // Slice 1's lease file too, which stays for later jobs.
    let mut warm = node.job(&format!("{}-warm1", prefix()), "true");
    warm.set_env("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "1");
    for (hook, o) in warm.run_all() {
        assert!(o.status.success(), "{hook}: {}", output_text(&o));
    }
    let before = node.snapshot();
    let a_id = format!("{}-a", prefix());
    let b_id = format!("{}-b", prefix());
    let _guard = real_cgroups::CgroupGuard(vec![a_id.clone(), b_id.clone()]);
    let mut a = node.job(&a_id, "echo \"uid $(id -u)\"; exec sleep 4");
    let mut b = node.job(
        &b_id,
        r#"set +e
try() { name=$1; shift; ( "$@" ) >/dev/null 2>&1 && echo "ESCAPED $name" || echo "blocked $name"; }
echo "uid $(id -u)"
try see-other-job sh -c 'for p in /proc/[0-9]*; do [ "$(cat $p/comm 2>/dev/null)" = sleep ] && exit 0; done; exit 1'
try other-job-in-cgroups sh -c 'grep -qs . /sys/fs/cgroup/pids/kernelkite/*-a/cgroup.procs'
echo "processes-seen $(ls -d /proc/[0-9]* | wc -l)"
kill -9 -1
echo "survived kill -9 -1"
"#,
    );
    b.set_env("BUILDKITE_AGENT_META_DATA_GPU_INDEX", "1");
    for job in [&mut a, &mut b] {
        let out = job.run_hook("environment");
        assert!(out.status.success(), "{}", output_text(&out));
    }
    let a_command = std::thread::spawn(move || {
        let out = a.run_hook("command");
        (a, out)
    });
    // a is running once its `sleep` is in its cgroup.
    let sleeping = || {
        cg.pids(&a_id).unwrap_or_default().iter().any(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "sleep")
        })
    };
    let start = std::time::Instant::now();
    while !sleeping() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(sleeping(), "job a did not start");
    let b_out = b.run_hook("command");
    let (mut a, a_out) = a_command.join().unwrap();
    let a_text = String::from_utf8_lossy(&a_out.stdout).into_owned();
    let b_text = String::from_utf8_lossy(&b_out.stdout).into_owned();
    // a ran its whole sleep: b's `kill -9 -1` never reached it.
    assert!(a_out.status.success(), "{}", output_text(&a_out));
    assert!(!b_text.contains("ESCAPED"), "{b_text}");
    assert!(b_text.contains("blocked see-other-job"), "{b_text}");
    // kill(-1) spares its caller: b's shell goes on, having killed nothing of a's.
    assert!(b_text.contains("survived kill -9 -1"), "{b_text}");
    let uid = |text: &str| -> u32 {
        text.lines()
            .find_map(|l| l.strip_prefix("uid "))
            .and_then(|u| u.trim().parse().ok())
            .unwrap_or_else(|| panic!("no uid line in {text}"))
    };
    let base = kernelkite_hooks::sandbox::user::SLICE_ID_BASE;
    assert_eq!(uid(&a_text), base, "{a_text}");
    assert_eq!(uid(&b_text), base + 1, "{b_text}");
    let b_log = String::from_utf8_lossy(&b_out.stderr);
    assert!(b_log.contains("runs as kernelkite-job-1"), "{b_log}");
    for job in [&mut a, &mut b] {
        let out = job.run_hook("pre-exit");
        assert!(out.status.success(), "{}", output_text(&out));
    }
    assert_eq!(before, node.snapshot());
}

/// A job that fills its disk: the checkout's writable layer is the job's own (`tmp-size`),
/// so the write fails with "No space left on device"; nothing else on the host is writable
/// (a world-writable directory of the host's is read-only in its view); of what it wrote only
/// the artifact reaches the host's checkout; and the node is the same afterwards.
#[test]
fn a_job_that_fills_its_disk_fails_clearly_and_the_host_disk_is_untouched() {
    let Some(_cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some(node) = SandboxNode::new("d", 256 << 20, None) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    node.warm_up();
    let before = node.snapshot();
    let id = format!("{}-disk", prefix());
    let _guard = real_cgroups::CgroupGuard(vec![id.clone()]);
    let mut job = node.job(
        &id,
        r#"set +e
head -c 100M /dev/zero > junk.bin; echo "fill-exit $?"
truncate -s 1M junk.bin
for d in "$KK_HOST_WRITABLE" /var/tmp/.. /opt /usr/local /etc; do
  ( echo x > "$d/kk-leak" ) 2>/dev/null && echo "ESCAPED write $d" || echo "blocked write $d"
done
echo '{"ok": true}' > result.json
"#,
    );
    job.set_env(
        "KERNELKITE_CONFIG",
        &json!({"user": node.user.name, "tmp-size": "64M", "environment": TEST_VARIABLES})
            .to_string(),
    );
    let checkout = PathBuf::from(&job.env["BUILDKITE_BUILD_CHECKOUT_PATH"]);
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    let stdout = String::from_utf8_lossy(&outs[1].1.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&outs[1].1.stderr).into_owned();
    assert!(stdout.contains("fill-exit 1"), "{stdout}");
    assert!(stderr.contains("No space left on device"), "{stderr}");
    assert!(!stdout.contains("ESCAPED"), "{stdout}");
    assert_eq!(stdout.matches("blocked write").count(), 5, "{stdout}");
    // The artifact arrived; the 64 MiB of junk did not.
    assert_eq!(
        std::fs::read_to_string(checkout.join("result.json")).unwrap(),
        "{\"ok\": true}\n"
    );
    assert!(!checkout.join("junk.bin").exists());
    let open = node.dir.path().join("open");
    assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);
    assert!(stderr.contains("carried 1 artifact file(s)"), "{stderr}");
    assert_eq!(before, node.snapshot());
}

#[test]
fn root_needs_allow_root_and_then_runs_without_capabilities() {
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
    // Root without capabilities may write a sysctl by its mode alone: the job's /proc/sys is
    // read-only. The value written is the one already there, so an escape changes nothing.
    let mut job = node.job(
        &id,
        "grep -E '^(Uid|CapEff|CapBnd|NoNewPrivs)' /proc/self/status; \
         v=$(cat /proc/sys/vm/overcommit_memory); \
         (echo \"$v\" > /proc/sys/vm/overcommit_memory) 2>/dev/null \
         && echo 'ESCAPED write-proc-sys' || echo 'blocked write-proc-sys'; \
         test -n \"$(head -c 8 /proc/kpageflags 2>/dev/null | od -An)\" \
         && echo 'ESCAPED page-flags-in-proc' || echo 'blocked page-flags-in-proc'; \
         for f in /dev/null /dev/urandom /proc/interrupts; do \
           chmod 666 $f 2>/dev/null && echo \"ESCAPED chmod $f\" || echo \"blocked chmod $f\"; \
         done; head -c 1 /dev/urandom > /dev/null && echo 'urandom still reads'; \
         echo x > /dev/null && echo 'null still writes'",
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
    assert!(stdout.contains("blocked write-proc-sys\n"), "{stdout}");
    // The physical page maps are root's alone by their mode, which a root command passes:
    // covered for it.
    assert!(stdout.contains("blocked page-flags-in-proc\n"), "{stdout}");
    // Root owns the host's device nodes, and chmod needs no capability on one's own file: the
    // job's nodes (and the /dev/null over a masked file) are read-only binds, which still open
    // for reading and writing. The mode set is the one they have, so an escape changes nothing.
    for f in ["/dev/null", "/dev/urandom", "/proc/interrupts"] {
        assert!(stdout.contains(&format!("blocked chmod {f}\n")), "{stdout}");
    }
    assert!(stdout.contains("urandom still reads\n"), "{stdout}");
    assert!(stdout.contains("null still writes\n"), "{stdout}");
    let log = String::from_utf8_lossy(&outs[1].1.stderr);
    assert!(log.contains("WARNING: the command runs as root"), "{log}");
}

/// A node's job tool is bound into every job and run with the evaluator's capabilities: one
/// that someone other than root (or the hooks' owner) could replace is left out, and the job
/// log says why; one only root can change is bound as before.
#[test]
fn a_job_tool_others_could_replace_is_not_bound() {
    use std::os::unix::fs::PermissionsExt;
    let Some(_cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some(node) = SandboxNode::new("t", 64 << 20, None) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    // Hidden from the job: it reaches a tool in there only if the sandbox binds it.
    let tools = node.dir.path().join("tools");
    let tool = |dir: &str, mode: u32| {
        let d = tools.join(dir);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode)).unwrap();
        let t = d.join("tool.sh");
        std::fs::write(&t, format!("#!/bin/sh\necho ran-{dir}\n")).unwrap();
        std::fs::set_permissions(&t, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::canonicalize(t).unwrap()
    };
    let safe = tool("safe", 0o755);
    // Anyone may write here (no sticky bit): anyone could put another tool.sh in its place.
    let open = tool("open", 0o777);
    let id = format!("{}-tools", prefix());
    let _guard = real_cgroups::CgroupGuard(vec![id.clone()]);
    let mut job = node.job(
        &id,
        &format!(
            "{} ; {} || echo 'not reached: open'",
            quoted(&safe),
            quoted(&open)
        ),
    );
    job.set_env("KERNELKITE_HIDE", &tools.display().to_string());
    job.set_env(
        "KERNELKITE_JOB_TOOLS",
        &format!("{}:{}", safe.display(), open.display()),
    );
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    let stdout = String::from_utf8_lossy(&outs[1].1.stdout);
    assert!(stdout.contains("ran-safe\n"), "{stdout}");
    assert!(!stdout.contains("ran-open"), "{stdout}");
    assert!(stdout.contains("not reached: open"), "{stdout}");
    let log = String::from_utf8_lossy(&outs[1].1.stderr);
    assert!(
        log.contains(&format!(
            "WARNING: the job tool {} is not bound into the sandbox: {} is writable by its group or others (mode 777)",
            open.display(),
            open.parent().unwrap().display()
        )),
        "{log}"
    );
}

#[test]
fn a_missing_job_user_fails_the_job_before_anything_is_held() {
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

/// A MIG device as a slice, in the real sandbox: GPU 0 in MIG mode, slices 0 and 1 its two
/// MIG devices. The job sees its MIG device by uuid; its private `/dev` holds the GPU's node
/// and its own MIG device's two capability nodes, not the other MIG device's nor MIG's
/// `config` and `monitor`; the devices controller refuses the other's capability even where
/// its host node is reachable; and the node is the same afterwards.
#[test]
fn a_mig_slice_sees_only_its_own_mig_device() {
    let Some(cg) = needs_root_and_cgroups() else {
        return;
    };
    let Some(node) = SandboxNode::new("m", 64 << 20, Some("kernelkite-job")) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc)");
        return;
    };
    let root = node.dir.path();
    let cpu = online_cpus().last().copied().unwrap();
    let uuid = |gi: u32| format!("MIG-00000018-{gi:04x}-4000-8000-000000000000");
    let slice = |index: u32, gi: u32| {
        json!({"index": index,
               "gpu": {"vendor": "nvidia", "pci_bus_id": "0000:18:00.0", "uuid": uuid(gi),
                       "numa_node": 0,
                       "mig": {"uuid": uuid(gi), "gpu_instance_id": gi, "compute_instance_id": 0,
                               "memory_bytes": 20u64 << 30}},
               "cpus": [cpu], "mems": [0], "memory_bytes": 64u64 << 20})
    };
    let plan = json!({"slices": [slice(0, 3), slice(1, 5)], "reserved_cpus": [], "warnings": []});
    std::fs::write(root.join("plan.json"), plan.to_string()).unwrap();
    // The driver's /proc with both MIG instances' capability files (and MIG's config and
    // monitor): the job is shown its own two only.
    kernelkite_testkit::fake_nvml::write_driver_proc(
        &root.join("sysfs"),
        &[("0000:18:00.0", 0), ("0000:19:00.0", 1)],
        &[(0, 3, 0), (0, 5, 0)],
    )
    .unwrap();
    // A major no driver of this machine has: opening a node the job may use says ENXIO.
    const CAPS_MAJOR: u32 = 508;
    // The driver's whole table: gpu0/gi3 is 30 and 31, gpu0/gi5 48 and 49.
    kernelkite_testkit::fake_nvml::write_mig_minors(&root.join("sysfs"), CAPS_MAJOR).unwrap();
    std::fs::create_dir_all(root.join("dev/nvidia-caps")).unwrap();
    for minor in [1, 2, 30, 31, 48, 49] {
        let ok = Command::new("mknod")
            .args(["-m", "444"])
            .arg(root.join(format!("dev/nvidia-caps/nvidia-cap{minor}")))
            .args(["c", &CAPS_MAJOR.to_string(), &minor.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mknod nvidia-cap{minor}");
    }
    node.warm_up();
    let before = node.snapshot();
    let mut job = node.job(
        &format!("{}-mig", prefix()),
        r#"set +e
echo "cuda $CUDA_VISIBLE_DEVICES"
echo "caps $(ls /dev/nvidia-caps | sort | tr '\n' ' ')"
echo "gpu-nodes $(ls /dev | grep '^nvidia' | sort | tr '\n' ' ')"
echo "open-own-cap: $( (exec 3< /dev/nvidia-caps/nvidia-cap31) 2>&1 | sed 's/.*: //')"
echo "open-other-cap-host-node: $( (exec 3< "$KK_FAKE_DEV/nvidia-caps/nvidia-cap49") 2>&1 | sed 's/.*: //')"
echo "mig-caps $(cd "$KK_FAKE_SYSFS/proc/driver/nvidia/capabilities" 2>/dev/null && find . -type f | LC_ALL=C sort | tr '\n' ' ')"
"#,
    );
    let outs = job.run_all();
    for (hook, o) in &outs {
        assert!(o.status.success(), "{hook}: {}", output_text(o));
    }
    let stdout = String::from_utf8_lossy(&outs[1].1.stdout).into_owned();
    assert!(stdout.contains(&format!("cuda {}", uuid(3))), "{stdout}");
    assert!(
        stdout.contains("caps nvidia-cap30 nvidia-cap31 \n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("gpu-nodes nvidia-caps nvidia0 nvidiactl \n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("open-own-cap: No such device or address"),
        "{stdout}"
    );
    let fake_dev_visible = !["/tmp", "/var/tmp", "/dev/shm"]
        .iter()
        .any(|d| std::fs::canonicalize(root).is_ok_and(|p| p.starts_with(d)));
    if fake_dev_visible
        && cg.version() == 1
        && Path::new("/sys/fs/cgroup/devices/devices.deny").exists()
    {
        assert!(
            stdout.contains("open-other-cap-host-node: Operation not permitted"),
            "{stdout}"
        );
    }
    // Of the driver's capability files, its own MIG device's two: no other instance's, not
    // MIG's config or monitor.
    if fake_dev_visible {
        assert!(
            stdout.contains("mig-caps ./gpu0/mig/gi3/access ./gpu0/mig/gi3/ci0/access \n"),
            "{stdout}"
        );
    }
    assert_eq!(before, node.snapshot());
}

/// The node of a holder with its own network ([`SandboxNode::with_own_network`]) given a way
/// out, and an outside world: a network namespace holding a server at 203.0.113.1:80 that
/// answers `OUTSIDE from <peer>`, the node's default route through it (the node 10.99.0.2, the
/// world 10.99.0.1); on the node, a service on its loopback, one on all its addresses and one
/// on an abstract unix socket, each answering `NODE <name>`. Everything lives in namespaces of
/// the test's: this machine's own network is not touched.
struct OwnNetworkWorld {
    _outside: Killed,
    _node_services: Killed,
    loopback_port: u16,
    any_port: u16,
    abstract_name: String,
}

/// A process killed when the test lets go of it, however the test ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", output_text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A Python server on `binds` (`("tcp", "host", port)` or `("unix", "\0name")`) answering each
/// connection with `reply` (`{peer}` filled in), started in the network namespace of `target`
/// (`None`: a new one).
fn serve(target: Option<u32>, binds: &str, reply: &str) -> Killed {
    let script = format!(
        r#"
import socket, threading
def serve(s, name):
    s.listen(16)
    while True:
        c, a = s.accept()
        peer = a[0] if isinstance(a, tuple) else "unix"
        c.sendall(("{reply}\n").replace("{{peer}}", peer).replace("{{name}}", name).encode())
        c.close()
for b in {binds}:
    if b[0] == "tcp":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((b[1], b[2]))
    else:
        s = socket.socket(socket.AF_UNIX); s.bind(b[1])
    threading.Thread(target=serve, args=(s, str(b[-1]))).start()
print("ready", flush=True)
threading.Event().wait()
"#
    );
    let mut cmd = match target {
        Some(pid) => {
            let mut c = Command::new("nsenter");
            c.args([
                "--target",
                &pid.to_string(),
                "--net",
                "--",
                "python3",
                "-c",
                &script,
            ]);
            c
        }
        None => {
            let mut c = Command::new("unshare");
            c.args(["--net", "--", "python3", "-c", &script]);
            c
        }
    };
    let mut child = Killed(
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufReader::new(child.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready", "{binds}");
    child
}

fn own_network_world(node: &SandboxNode, tag: &str) -> OwnNetworkWorld {
    let holder = node.holder.0.id().to_string();
    let (loopback_port, any_port) = (7101, 7102);
    let abstract_name = format!("kk-node-{tag}-{}", std::process::id());
    let outside = serve(None, r#"[("tcp", "0.0.0.0", 80)]"#, "OUTSIDE from {peer}");
    let world = outside.0.id().to_string();
    sh(&[
        "ip", "link", "add", "eth0", "netns", &holder, "type", "veth", "peer", "name", "up0",
        "netns", &world,
    ]);
    let inside = |pid: &str, args: &[&str]| {
        let mut v = vec!["nsenter", "--target", pid, "--net", "--", "ip"];
        v.extend(args);
        sh(&v);
    };
    inside(&world, &["addr", "add", "10.99.0.1/24", "dev", "up0"]);
    inside(&world, &["addr", "add", "203.0.113.1/32", "dev", "lo"]);
    inside(&world, &["link", "set", "up0", "up"]);
    inside(&world, &["link", "set", "lo", "up"]);
    inside(&holder, &["addr", "add", "10.99.0.2/24", "dev", "eth0"]);
    inside(&holder, &["link", "set", "eth0", "up"]);
    inside(&holder, &["route", "add", "default", "via", "10.99.0.1"]);
    let node_services = serve(
        Some(node.holder.0.id()),
        &format!(
            r#"[("tcp", "127.0.0.1", {loopback_port}), ("tcp", "0.0.0.0", {any_port}), ("unix", "\0{abstract_name}")]"#
        ),
        "NODE",
    );
    OwnNetworkWorld {
        _outside: outside,
        _node_services: node_services,
        loopback_port,
        any_port,
        abstract_name,
    }
}

/// What a job (or the node itself) reaches: `reached NAME: <answer>` or `blocked NAME: <why>`
/// per probe, one a line.
fn probes(world: &OwnNetworkWorld) -> String {
    format!(
        r#"
import socket, sys
def probe(name, family, addr):
    s = socket.socket(family)
    s.settimeout(2)
    try:
        s.connect(addr)
        print(f"reached {{name}}: {{s.recv(100).decode().strip()}}")
    except OSError as e:
        print(f"blocked {{name}}: {{e}}")
probe("outside", socket.AF_INET, ("203.0.113.1", 80))
probe("node-loopback", socket.AF_INET, ("127.0.0.1", {lo}))
probe("node-address", socket.AF_INET, ("10.99.0.2", {any}))
probe("node-gateway", socket.AF_INET, ("198.18.0.1", {any}))
probe("node-lan", socket.AF_INET, ("10.99.0.1", 80))
probe("node-abstract", socket.AF_UNIX, "\0{name}")
"#,
        lo = world.loopback_port,
        any = world.any_port,
        name = world.abstract_name
    )
}

/// The network of the holder's node as `ip` lists it, and its forwarding switches.
fn node_network(node: &SandboxNode) -> String {
    let holder = node.holder.0.id().to_string();
    let list = |args: &[&str]| {
        let mut v = vec!["nsenter", "--target", &holder, "--net", "--", "ip", "-o"];
        v.extend(args);
        sh(&v)
    };
    // Counters and link indices of a veth's peer change with every job: names and addresses.
    let links: Vec<String> = list(&["link"])
        .lines()
        .map(|l| l.split_whitespace().nth(1).unwrap_or_default().to_string())
        .collect();
    format!("{links:?}\n{}{}", list(&["addr"]), list(&["route"]))
}

/// Issue 34, item 7: `network: true` put the job on the node's network namespace, where it
/// reached a host service listening on an abstract unix socket (and every service on the
/// node's loopback). Now the job has a namespace of its own with a link out through the node:
/// it reaches the outside world, and nothing of the node's (its loopback, its addresses, the
/// host end of its own link, its abstract sockets), each of which the node itself reaches. The
/// node's network is as it was after the job (no link, namespace or route of the job left),
/// and this machine's own network (its links, its nftables ruleset) was never touched.
#[test]
fn network_true_reaches_the_outside_and_nothing_of_the_node() {
    let Some(_cg) = needs_root_and_cgroups() else {
        return;
    };
    for tool in ["ip", "nft", "python3"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            kernelkite_testkit::skip(format!("{tool} is not installed (network: true needs it)"));
            return;
        }
    }
    let host_network = || (sh(&["ip", "-o", "link"]), sh(&["nft", "list", "ruleset"]));
    let host_before = host_network();
    let Some(node) = SandboxNode::with_own_network("net", 256 << 20) else {
        kernelkite_testkit::skip("cannot make a holder namespace (unshare --mount --ipc --net)");
        return;
    };
    let world = own_network_world(&node, "net");
    // The node itself reaches each of its services and the outside.
    let holder = node.holder.0.id().to_string();
    let from_node = sh(&[
        "nsenter",
        "--target",
        &holder,
        "--net",
        "--",
        "python3",
        "-c",
        &probes(&world),
    ]);
    for name in [
        "outside",
        "node-loopback",
        "node-address",
        "node-abstract",
        "node-lan",
    ] {
        assert!(
            from_node.contains(&format!("reached {name}")),
            "{from_node}"
        );
    }
    node.warm_up();
    let config = |network: bool| {
        json!({"user": node.user.name, "environment": TEST_VARIABLES, "network": network})
            .to_string()
    };
    let run = |id: &str, allow: &str| {
        let _guard = real_cgroups::CgroupGuard(vec![id.to_string()]);
        let mut job = node.job(id, "python3 probes.py; ip -o -4 addr show dev eth0 || true");
        let checkout = PathBuf::from(&job.env["BUILDKITE_BUILD_CHECKOUT_PATH"]);
        std::fs::write(checkout.join("probes.py"), probes(&world)).unwrap();
        job.set_env("KERNELKITE_CONFIG", &config(true));
        job.set_env("KERNELKITE_JOB_NETWORK_ALLOW", allow);
        let mut out = String::new();
        for (hook, o) in job.run_all() {
            assert!(o.status.success(), "{hook}: {}", output_text(&o));
            out.push_str(&output_text(&o));
        }
        out
    };
    // A first job with the network loads the node's rules (they stay, as the node's); then
    // the node is as every later job finds it.
    run(&format!("{}-net-warm", prefix()), "");
    let before = (node.snapshot(), node_network(&node));
    let out = run(&format!("{}-net", prefix()), "");
    assert!(
        out.contains("reached outside: OUTSIDE from 10.99.0.2"),
        "{out}"
    );
    for name in [
        "node-loopback",
        "node-address",
        "node-gateway",
        "node-abstract",
        "node-lan",
    ] {
        assert!(out.contains(&format!("blocked {name}")), "{name}: {out}");
    }
    assert!(out.contains("inet 198.18.0.2/30"), "{out}");
    assert!(
        out.contains("network: its own, routed out through the node"),
        "{out}"
    );
    let after = (node.snapshot(), node_network(&node));
    assert_eq!(before, after, "the job left something on the node");
    // What the operator opens (a mirror on the LAN) is reached; the node itself still is not.
    let opened = run(&format!("{}-net-allow", prefix()), "10.99.0.1/32");
    assert!(
        opened.contains("reached node-lan: OUTSIDE from 10.99.0.2"),
        "{opened}"
    );
    for name in ["node-loopback", "node-address", "node-gateway"] {
        assert!(
            opened.contains(&format!("blocked {name}")),
            "{name}: {opened}"
        );
    }
    drop(world);
    drop(node);
    assert_eq!(
        host_before,
        host_network(),
        "this machine's network was touched"
    );
}
