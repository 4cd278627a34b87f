//! `kernelkite-isolate setup` on fixture machines, as a vendor runs it but under `--root`:
//! the dry run and the files written are byte-compared with reviewed output in
//! `tests/data/setup/<fixture>/` (regenerate with `KERNELKITE_BLESS=1`, then review the diff);
//! a second run changes nothing; `--uninstall` leaves the root exactly as it was; the units
//! pass `systemd-analyze verify`.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::systemd;

const BIN: &str = env!("CARGO_BIN_EXE_kernelkite-isolate");
const TOKEN: &str = "bkct_test-token-0123456789abcdef";

/// How the fixture's cgroups are mounted.
#[derive(Clone, Copy)]
enum Cgroups {
    /// The fixture's own cgroup v2 mount.
    V2,
    /// systemd's hybrid layout: v1 controllers and an empty cgroup2 at `unified`.
    V1Hybrid,
    /// v1 only.
    V1Legacy,
}

/// One machine and how it is set up.
struct Case {
    fixture: &'static str,
    node: &'static str,
    queue: &'static str,
    args: &'static [&'static str],
    cgroups: Cgroups,
    kernel: &'static str,
}

const DGX: Case = Case {
    fixture: "dgx-h100",
    node: "dgx01",
    queue: "h100",
    args: &[],
    cgroups: Cgroups::V2,
    kernel: "6.8.0-45-generic",
};

const MI300X: Case = Case {
    fixture: "mi300x-8",
    node: "mi300x01",
    queue: "mi300x",
    args: &["--agents", "pool"],
    cgroups: Cgroups::V2,
    kernel: "6.8.0-45-generic",
};

const WORKSTATION: Case = Case {
    fixture: "workstation-1gpu",
    node: "ws01",
    queue: "rtx4090",
    args: &[
        "--job-config",
        r#"{"mode":"docker","image":"ghcr.io/kernelkite/runner:0.1.0"}"#,
    ],
    cgroups: Cgroups::V1Hybrid,
    kernel: "6.1.0-25-amd64",
};

const CPU_ONLY: Case = Case {
    fixture: "cpu-only",
    node: "cpu01",
    queue: "cpu",
    args: &["--cpu-only-slices", "2", "--no-start"],
    cgroups: Cgroups::V1Legacy,
    kernel: "5.15.0-91-generic",
};

/// A node: the machine (a fixture tree), an empty install root with the files a Debian
/// system has, binaries to install, a token file.
struct Node {
    dir: tempfile::TempDir,
    machine: PathBuf,
}

impl Node {
    fn tmp(&self) -> &Path {
        self.dir.path()
    }
    fn sysfs(&self) -> PathBuf {
        self.machine.clone()
    }
    fn root(&self) -> PathBuf {
        self.tmp().join("root")
    }
    fn from(&self) -> PathBuf {
        self.tmp().join("release")
    }
}

fn write(path: &Path, text: &str, mode: u32) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn mkdir(path: &Path) {
    std::fs::create_dir_all(path).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The group the AMD device nodes belong to, named `render` in the root's /etc/group: our
/// own group when not root (files we create get it), else one we can hand them to.
fn render_gid() -> u32 {
    let egid = rustix::process::getegid().as_raw();
    if egid != 0 {
        egid
    } else {
        109
    }
}

/// The machine of a case: its fixture tree, written once per test binary (setup only reads
/// it, and big trees take seconds to write on a busy disk).
fn machine(case: &Case) -> PathBuf {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static TREES: OnceLock<(tempfile::TempDir, Mutex<HashMap<&'static str, PathBuf>>)> =
        OnceLock::new();
    let (dir, made) =
        TREES.get_or_init(|| (tempfile::tempdir().unwrap(), Mutex::new(HashMap::new())));
    let mut made = made.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = made.get(case.fixture) {
        return p.clone();
    }
    let sysfs = dir.path().join(case.fixture);
    let out = Command::new(BIN)
        .args(["fixture", case.fixture, "--out"])
        .arg(&sysfs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    write(
        &sysfs.join("proc/sys/kernel/osrelease"),
        &format!("{}\n", case.kernel),
        0o644,
    );
    let v1 = |with_unified: bool| {
        let mut m = String::from("25 1 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw\n31 25 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755\n");
        for (i, c) in ["cpuset", "memory", "pids", "devices", "freezer"]
            .iter()
            .enumerate()
        {
            m.push_str(&format!(
                "{} 31 0:{} / /sys/fs/cgroup/{c} rw,nosuid,nodev,noexec,relatime shared:{} - cgroup cgroup rw,{c}\n",
                40 + i,
                40 + i,
                20 + i
            ));
        }
        m.push_str("50 31 0:50 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:30 - cgroup cgroup rw,xattr,name=systemd\n");
        if with_unified {
            m.push_str("51 31 0:51 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:31 - cgroup2 cgroup2 rw,nsdelegate\n");
        }
        m
    };
    match case.cgroups {
        Cgroups::V2 => {}
        Cgroups::V1Hybrid => write(&sysfs.join("proc/self/mountinfo"), &v1(true), 0o644),
        Cgroups::V1Legacy => write(&sysfs.join("proc/self/mountinfo"), &v1(false), 0o644),
    }
    let gid = render_gid();
    if sysfs.join("dev/kfd").exists() {
        for i in 0..8 {
            write(
                &sysfs.join(format!("dev/dri/renderD{}", 128 + i)),
                "",
                0o660,
            );
        }
        for dev in std::iter::once(sysfs.join("dev/kfd"))
            .chain((0..8).map(|i| sysfs.join(format!("dev/dri/renderD{}", 128 + i))))
        {
            if std::fs::metadata(&dev).unwrap().gid() != gid {
                std::os::unix::fs::chown(&dev, None, Some(gid)).unwrap();
            }
        }
    }

    made.insert(case.fixture, sysfs.clone());
    sysfs
}

fn prepare(case: &Case) -> Node {
    let node = Node {
        dir: tempfile::tempdir().unwrap(),
        machine: machine(case),
    };
    let gid = render_gid();
    let root = node.root();
    mkdir(&root);
    for d in ["etc", "etc/systemd", "etc/systemd/system", "usr", "usr/bin"] {
        mkdir(&root.join(d));
    }
    write(
        &root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/bash\nbuildkite-agent:x:998:998::/var/lib/buildkite-agent:/bin/sh\n",
        0o644,
    );
    write(
        &root.join("etc/group"),
        &format!("root:x:0:\nvideo:x:44:\nrender:x:{gid}:\nbuildkite-agent:x:998:\n"),
        0o644,
    );
    write(
        &root.join("etc/hostname"),
        &format!("{}\n", case.node),
        0o644,
    );
    write(
        &root.join("usr/bin/buildkite-agent"),
        "#!/bin/sh\n# stands in for the agent\n",
        0o755,
    );
    let from = node.from();
    mkdir(&from);
    for b in ["kernelkite-isolate", "kernelkite-runner"] {
        write(
            &from.join(b),
            &format!("#!/bin/sh\n# stands in for {b}\n"),
            0o755,
        );
    }
    write(
        &node.tmp().join("agent-token"),
        &format!("{TOKEN}\n"),
        0o600,
    );
    node
}

/// `kernelkite-isolate setup` on `node`'s root and sysfs tree, its binaries from `from`.
fn setup_command(node: &Node, from: &Path) -> Command {
    let mut c = Command::new(BIN);
    c.arg("setup")
        .arg("--root")
        .arg(node.root())
        .arg("--sysfs-root")
        .arg(node.sysfs())
        .arg("--from")
        .arg(from)
        .env_remove("KERNELKITE_PLUGIN_LOCATION");
    c
}

fn setup(node: &Node, case: &Case, extra: &[&str]) -> Output {
    setup_command(node, &node.from())
        .args(["--queue", case.queue, "--node", case.node])
        .arg("--agent-token-file")
        .arg(node.tmp().join("agent-token"))
        .args(case.args)
        .args(extra)
        .env_remove("BUILDKITE_AGENT_TOKEN")
        .env_remove("KERNELKITE_SYSFS_ROOT")
        .env_remove("KERNELKITE_QUEUE")
        .env_remove("KERNELKITE_NODE")
        .output()
        .unwrap()
}

fn uninstall(node: &Node) -> Output {
    Command::new(BIN)
        .arg("setup")
        .arg("--root")
        .arg(node.root())
        .arg("--uninstall")
        .output()
        .unwrap()
}

fn stdout_ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// Output with the temporary directory written as `$TMP` and the render group's id (which
/// depends on who runs the tests) as `$RENDER_GID`.
fn normalized(node: &Node, text: &str) -> String {
    text.replace(&node.tmp().display().to_string(), "$TMP")
        .replace(
            &format!("render:x:{}:", render_gid()),
            "render:x:$RENDER_GID:",
        )
}

/// Every path under the root with its type and mode, and each file's contents (a copy of an
/// installed binary is named instead).
fn snapshot(node: &Node) -> String {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for p in entries {
            out.push(p.clone());
            if std::fs::symlink_metadata(&p).unwrap().is_dir() {
                walk(&p, out);
            }
        }
    }
    let root = node.root();
    let mut paths = Vec::new();
    walk(&root, &mut paths);
    let mut s = String::new();
    for p in paths {
        let rel = Path::new("/").join(p.strip_prefix(&root).unwrap());
        let meta = std::fs::symlink_metadata(&p).unwrap();
        let mode = meta.permissions().mode() & 0o7777;
        if meta.file_type().is_symlink() {
            s.push_str(&format!(
                "{} -> {}\n",
                rel.display(),
                std::fs::read_link(&p).unwrap().display()
            ));
        } else if meta.is_dir() {
            s.push_str(&format!("{}/ ({mode:04o})\n", rel.display()));
        } else {
            let bytes = std::fs::read(&p).unwrap();
            let copy_of = ["kernelkite-isolate", "kernelkite-runner"]
                .iter()
                .find(|b| std::fs::read(node.from().join(b)).unwrap() == bytes && rel.ends_with(b));
            match copy_of {
                Some(b) => s.push_str(&format!(
                    "{} ({mode:04o}): the same bytes as $TMP/release/{b}\n",
                    rel.display()
                )),
                None => {
                    let text = String::from_utf8(bytes).unwrap();
                    s.push_str(&format!("{} ({mode:04o}):\n", rel.display()));
                    for line in text.lines() {
                        s.push_str(&format!("  | {line}\n"));
                    }
                }
            }
        }
    }
    normalized(node, &s)
}

/// Compares with the reviewed file, or writes it with `KERNELKITE_BLESS=1`.
fn expect(case: &Case, name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/setup")
        .join(case.fixture)
        .join(name);
    if std::env::var_os("KERNELKITE_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with KERNELKITE_BLESS=1 to write it, then review it",
            path.display()
        )
    });
    if want != actual {
        let (w, a): (Vec<&str>, Vec<&str>) = (want.lines().collect(), actual.lines().collect());
        let at = w
            .iter()
            .zip(&a)
            .position(|(x, y)| x != y)
            .unwrap_or(w.len().min(a.len()));
        panic!(
            "{} differs at line {}:\n  expected: {:?}\n  actual:   {:?}\n(rerun with KERNELKITE_BLESS=1 if the change is intended, and review the diff)",
            path.display(),
            at + 1,
            w.get(at),
            a.get(at)
        );
    }
}

/// The job user and its groups, as `useradd` and `usermod` would have left them.
fn pretend_commands_ran(node: &Node) {
    let root = node.root();
    let passwd = std::fs::read_to_string(root.join("etc/passwd")).unwrap();
    std::fs::write(
        root.join("etc/passwd"),
        format!("{passwd}kernelkite-job:x:997:997:kernelkite job sandbox:/nonexistent:/usr/sbin/nologin\n"),
    )
    .unwrap();
    let group = std::fs::read_to_string(root.join("etc/group")).unwrap();
    let group: String = group
        .lines()
        .map(|l| {
            if l.starts_with("render:") {
                format!("{l}kernelkite-job\n")
            } else {
                format!("{l}\n")
            }
        })
        .collect();
    std::fs::write(root.join("etc/group"), group).unwrap();
}

fn file_lines(out: &str) -> Vec<&str> {
    out.lines()
        .skip_while(|l| *l != "files:")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .collect()
}

fn command_lines(out: &str) -> Vec<&str> {
    out.lines()
        .skip_while(|l| *l != "commands:")
        .skip(1)
        .take_while(|l| !l.is_empty())
        .map(str::trim)
        .collect()
}

/// A setting of an agent's configuration as the agent reads it: the value after `key=`, its
/// double quotes taken off.
fn agent_setting<'t>(cfg: &'t str, key: &str) -> Option<&'t str> {
    cfg.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .map(|v| {
            v.strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(v)
        })
}

/// The default agent configuration of every node runs nothing but kernelkite's hooks: no
/// repository hooks, no plugin but kernelkite's (the docker plugin neither, docker mode or
/// not), no repository but kernelkite's, no job variable but Buildkite's and kernelbot's, and
/// no command evaluated by the agent itself.
fn assert_locked_down(cfg: &str, path: &Path) {
    for (key, value) in [
        ("no-local-hooks", "true"),
        ("no-plugins", "false"),
        (
            "allowed-plugins",
            r"^github\.com/kernelkite/kernelkite/plugin#v[0-9]+(\.[0-9]+)*(-[0-9A-Za-z.]+)?$",
        ),
        ("no-command-eval", "true"),
        ("strict-single-hooks", "true"),
        (
            "allowed-repositories",
            r"^(https://github\.com/|git@github\.com:|ssh://git@github\.com/)kernelkite/kernelkite(\.git)?$",
        ),
        ("enable-environment-variable-allowlist", "true"),
        (
            "allowed-environment-variables",
            "^KERNELBOT_[A-Za-z0-9_]*$,^KERNELKITE_SUBMISSION_ID$",
        ),
        ("no-plugin-validation", "true"),
        ("plugins-always-clone-fresh", "false"),
    ] {
        assert_eq!(
            agent_setting(cfg, key),
            Some(value),
            "{}: {key}\n{cfg}",
            path.display()
        );
    }
}

fn run_case(case: &Case) {
    let node = prepare(case);
    let before = snapshot(&node);

    let dry = stdout_ok(&setup(&node, case, &["--dry-run"]));
    assert_eq!(snapshot(&node), before, "--dry-run changed the root");
    assert!(!dry.contains(TOKEN), "the dry run printed the token");
    expect(case, "dry-run.txt", &normalized(&node, &dry));

    let first = stdout_ok(&setup(&node, case, &[]));
    expect(case, "setup.txt", &normalized(&node, &first));
    let tree = snapshot(&node);
    expect(case, "tree.txt", &tree);
    for cfg in std::fs::read_dir(node.root().join("etc/kernelkite/agents")).unwrap() {
        let cfg = cfg.unwrap().path();
        let meta = std::fs::metadata(&cfg).unwrap();
        assert_eq!(
            meta.permissions().mode() & 0o777,
            0o600,
            "a token file is not root-only"
        );
        assert_locked_down(&std::fs::read_to_string(&cfg).unwrap(), &cfg);
    }

    // Again, once the recorded commands have done their part: nothing changes.
    pretend_commands_ran(&node);
    let settled = snapshot(&node);
    let again = stdout_ok(&setup(&node, case, &[]));
    assert_eq!(snapshot(&node), settled, "a second run changed the root");
    let files = file_lines(&again);
    assert!(!files.is_empty());
    assert!(
        files.iter().all(|l| l.trim_start().starts_with("same ")),
        "second run:\n{again}"
    );
    let bin = "/opt/kernelkite/bin/kernelkite-isolate";
    assert_eq!(
        command_lines(&again)
            .iter()
            .map(|c| c.split(" --").next().unwrap_or(c))
            .collect::<Vec<_>>(),
        vec![format!("{bin} doctor"), format!("{bin} smoke")],
        "a second run only checks:\n{again}"
    );
    assert!(!again.contains("directories:"), "{again}");

    // Without the token: the one an earlier run wrote is kept.
    let out = setup_command(&node, &node.from())
        .args(["--queue", case.queue, "--node", case.node])
        .args(case.args)
        .env_remove("BUILDKITE_AGENT_TOKEN")
        .env_remove("KERNELKITE_SYSFS_ROOT")
        .output()
        .unwrap();
    stdout_ok(&out);
    assert_eq!(
        snapshot(&node),
        settled,
        "rerunning without the token changed the root"
    );

    // Uninstall: the commands undo the user; the files go, and the root is as it was.
    std::fs::write(
        node.root().join("etc/passwd"),
        std::fs::read_to_string(node.root().join("etc/passwd"))
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("kernelkite-job:"))
            .map(|l| format!("{l}\n"))
            .collect::<String>(),
    )
    .unwrap();
    let group = std::fs::read_to_string(node.root().join("etc/group")).unwrap();
    std::fs::write(
        node.root().join("etc/group"),
        group.replace(":kernelkite-job\n", ":\n"),
    )
    .unwrap();
    let gone = stdout_ok(&uninstall(&node));
    expect(case, "uninstall.txt", &normalized(&node, &gone));
    assert_eq!(snapshot(&node), before, "--uninstall left the root changed");
    let twice = stdout_ok(&uninstall(&node));
    assert!(twice.contains("nothing to uninstall"), "{twice}");
}

#[test]
fn dgx_h100_one_agent_per_gpu_on_cgroup_v2() {
    run_case(&DGX);
}

#[test]
fn mi300x_pool_agent_and_the_render_group() {
    run_case(&MI300X);
}

#[test]
fn workstation_in_docker_mode_on_cgroup_v1_with_favordynmods() {
    run_case(&WORKSTATION);
}

#[test]
fn cpu_only_box_on_an_old_cgroup_v1_kernel_without_starting_agents() {
    run_case(&CPU_ONLY);
}

/// The generated units, verified in a root of their own.
fn verify_units(node: &Node) -> Result<(), String> {
    let dir = node.root().join("etc/systemd/system");
    let mut units: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read_to_string(e.path()).unwrap(),
            )
        })
        .collect();
    units.sort();
    systemd::verify(
        &node.tmp().join("verify"),
        &units,
        &["/usr/bin/buildkite-agent"],
    )
}

#[test]
fn generated_units_pass_systemd_analyze_verify() {
    if let Some(why) = systemd::verify_unavailable() {
        kernelkite_testkit::skip(why);
        return;
    }
    for case in [&DGX, &MI300X, &WORKSTATION, &CPU_ONLY] {
        let node = prepare(case);
        stdout_ok(&setup(&node, case, &[]));
        if let Err(e) = verify_units(&node) {
            panic!("{}: {e}", case.fixture);
        }
        // The check itself catches what it should: a key systemd does not know.
        let unit = node.root().join("etc/systemd/system/kernelkite.slice");
        let text = std::fs::read_to_string(&unit).unwrap();
        std::fs::write(&unit, text.replace("MemoryMax=", "MemoryMaximum=")).unwrap();
        assert!(verify_units(&node).is_err(), "a broken unit passed verify");
    }
}

#[test]
fn files_setup_did_not_write_are_refused_unless_replaced_and_come_back_on_uninstall() {
    let node = prepare(&DGX);
    // The old README told vendors to write the plan by hand.
    write(
        &node.root().join("etc/kernelkite/plan.json"),
        "{\"slices\":[]}\n",
        0o644,
    );
    let before = snapshot(&node);
    let out = setup(&node, &DGX, &[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/etc/kernelkite/plan.json already exist(s) and was not written by setup")
            && err.contains("--replace"),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("CONFLICT"));
    assert_eq!(snapshot(&node), before, "a refused setup changed the root");

    let out = stdout_ok(&setup(&node, &DGX, &["--replace"]));
    assert!(out.contains("replace  0644  /etc/kernelkite/plan.json (the earlier file is kept as /etc/kernelkite/plan.json.kernelkite-orig)"), "{out}");
    assert_eq!(
        std::fs::read_to_string(node.root().join("etc/kernelkite/plan.json.kernelkite-orig"))
            .unwrap(),
        "{\"slices\":[]}\n"
    );
    // An operator edits a file setup wrote: uninstall leaves it and says so.
    let env = node.root().join("etc/kernelkite/agent.env");
    let mut text = std::fs::read_to_string(&env).unwrap();
    text.push_str("EXTRA=1\n");
    std::fs::write(&env, &text).unwrap();
    let gone = stdout_ok(&uninstall(&node));
    assert!(
        gone.contains("keep           /etc/kernelkite/agent.env (changed since setup wrote it: left in place)"),
        "{gone}"
    );
    assert!(gone.contains("restore        /etc/kernelkite/plan.json (from /etc/kernelkite/plan.json.kernelkite-orig)"), "{gone}");
    assert!(
        gone.contains(
            "note: /etc/kernelkite/agent.env was changed since setup wrote it: left in place"
        ),
        "{gone}"
    );
    let mut left: Vec<String> = std::fs::read_dir(node.root().join("etc/kernelkite"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["agent.env", "plan.json"]);
    assert_eq!(
        std::fs::read_to_string(node.root().join("etc/kernelkite/plan.json")).unwrap(),
        "{\"slices\":[]}\n",
        "the earlier plan was not put back"
    );
    assert_eq!(std::fs::read_to_string(&env).unwrap(), text);
    assert!(!node
        .root()
        .join("etc/kernelkite/plan.json.kernelkite-orig")
        .exists());
}

#[test]
fn a_changed_layout_stops_and_removes_the_agents_it_no_longer_wants() {
    let node = prepare(&DGX);
    stdout_ok(&setup(&node, &DGX, &[]));
    pretend_commands_ran(&node);
    let out = stdout_ok(&setup(&node, &DGX, &["--agents", "pool"]));
    let commands = command_lines(&out);
    assert!(
        commands[0].starts_with("systemctl disable --now kernelkite-agent@gpu0.service")
            && commands[0].ends_with("kernelkite-agent@gpu7.service"),
        "{out}"
    );
    assert_eq!(
        commands.last(),
        Some(&"systemctl enable --now kernelkite-agent@pool.service"),
        "{out}"
    );
    for i in 0..8 {
        assert!(
            out.contains(&format!(
                "  remove         /etc/kernelkite/agents/gpu{i}.cfg\n"
            )),
            "{out}"
        );
        assert!(!node
            .root()
            .join(format!("etc/kernelkite/agents/gpu{i}.cfg"))
            .exists());
    }
    assert!(
        out.contains("  create   0600  /etc/kernelkite/agents/pool.cfg\n"),
        "{out}"
    );
    // The shared environment changed nothing; the agent unit did not change either.
    assert!(
        !commands.iter().any(|c| c.starts_with("systemctl restart")),
        "{out}"
    );

    // A new queue changes every agent's configuration: the running pool agent restarts.
    let other = Case {
        queue: "h100-b",
        ..DGX
    };
    let out = stdout_ok(&setup(&node, &other, &["--agents", "pool"]));
    assert!(
        command_lines(&out).contains(&"systemctl restart kernelkite-agent@pool.service"),
        "{out}"
    );
    assert!(
        out.contains("  update   0600  /etc/kernelkite/agents/pool.cfg\n"),
        "{out}"
    );
}

/// A queue of 4-GPU jobs beside the one-GPU queue on a DGX H100: one agent per NUMA node's
/// four GPUs, bound to those slices, on its own queue; the one-GPU agents stay as they were.
/// A multi-GPU queue named like the one-GPU queue, or a size no group fits, is refused first.
#[test]
fn a_multi_gpu_queue_is_served_beside_the_one_gpu_queue() {
    let node = prepare(&DGX);
    let before = snapshot(&node);
    for (extra, says) in [
        (
            &["--multi-gpu-queue", "h100"][..],
            "is the node's one-GPU queue",
        ),
        (
            &["--multi-gpu-queue", "h100-x9", "--multi-gpu-size", "9"][..],
            "no group of 9 GPUs",
        ),
        (
            &["--multi-gpu-queue", "h100-x1", "--multi-gpu-size", "1"][..],
            "2 GPUs or more",
        ),
    ] {
        let out = setup(&node, &DGX, extra);
        assert!(!out.status.success(), "{extra:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{extra:?}: {err}");
        assert_eq!(snapshot(&node), before, "{extra:?} changed the root");
    }
    let out = stdout_ok(&setup(
        &node,
        &DGX,
        &["--multi-gpu-queue", "h100-x4", "--multi-gpu-size", "4"],
    ));
    assert!(
        out.contains(r#"; 2 agent(s) of 4 GPUs on queue "h100-x4""#),
        "{out}"
    );
    let cfg = |name: &str| {
        std::fs::read_to_string(
            node.root()
                .join(format!("etc/kernelkite/agents/{name}.cfg")),
        )
        .unwrap()
    };
    for (name, tags) in [
        ("x4-0", "queue=h100-x4,node=dgx01,gpu-index=0+1+2+3"),
        ("x4-1", "queue=h100-x4,node=dgx01,gpu-index=4+5+6+7"),
        ("gpu0", "queue=h100,node=dgx01,gpu-index=0"),
        ("gpu7", "queue=h100,node=dgx01,gpu-index=7"),
    ] {
        let text = cfg(name);
        assert_eq!(agent_setting(&text, "tags"), Some(tags), "{name}:\n{text}");
        assert_locked_down(&text, Path::new(name));
    }
    assert_eq!(agent_setting(&cfg("x4-1"), "name"), Some("dgx01-x4-1"));
    assert!(
        command_lines(&out)
            .iter()
            .any(|c| c.contains("kernelkite-agent@x4-0.service")
                && c.contains("kernelkite-agent@gpu0.service")),
        "{out}"
    );
}

#[test]
fn setup_refuses_what_it_cannot_use_before_touching_anything() {
    let node = prepare(&DGX);
    let before = snapshot(&node);
    let run = |extra: &[&str], token: bool, from: &Path| {
        let mut c = setup_command(&node, from);
        c.args(["--node", "dgx01"])
            .args(extra)
            .env_remove("BUILDKITE_AGENT_TOKEN")
            .env_remove("KERNELKITE_QUEUE");
        if token {
            c.arg("--agent-token-file")
                .arg(node.tmp().join("agent-token"));
        }
        let out = c.output().unwrap();
        assert!(!out.status.success(), "{extra:?} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["--queue", "h100"], false, &node.from());
    assert!(
        err.contains("no agent token: pass --agent-token-file FILE or set BUILDKITE_AGENT_TOKEN"),
        "{err}"
    );
    let err = run(&["--queue", "h100"], true, node.tmp());
    assert!(
        err.contains("kernelkite-isolate is not in") && err.contains("--from DIR"),
        "{err}"
    );
    let err = run(&["--queue", "h 100"], true, &node.from());
    assert!(err.contains("the queue \"h 100\" must be"), "{err}");
    let err = run(
        &["--queue", "h100", "--job-config", r#"{"gpu":1}"#],
        true,
        &node.from(),
    );
    assert!(
        err.contains("--job-config: ") && err.contains("gpu"),
        "{err}"
    );
    let err = run(&[], true, &node.from());
    assert!(err.contains("--queue"), "{err}");
    assert_eq!(snapshot(&node), before);

    // A dry run without a token shows where it goes, and writes nothing.
    let out = setup_command(&node, &node.from())
        .args(["--queue", "h100", "--node", "dgx01", "--dry-run"])
        .env_remove("BUILDKITE_AGENT_TOKEN")
        .output()
        .unwrap();
    let text = stdout_ok(&out);
    assert!(
        text.contains(
            "token=\"<missing: pass --agent-token-file FILE or set BUILDKITE_AGENT_TOKEN>\""
        ),
        "{text}"
    );
    assert_eq!(snapshot(&node), before);

    // The token from the environment is used, and never printed.
    let out = setup_command(&node, &node.from())
        .args(["--queue", "h100", "--node", "dgx01"])
        .env("BUILDKITE_AGENT_TOKEN", "bkct_from-env")
        .output()
        .unwrap();
    let text = stdout_ok(&out);
    assert!(!text.contains("bkct_from-env"));
    let cfg = std::fs::read_to_string(node.root().join("etc/kernelkite/agents/gpu3.cfg")).unwrap();
    assert!(cfg.contains("token=\"bkct_from-env\"\n"), "{cfg}");
}

#[test]
fn a_reader_that_stops_early_does_not_break_setup() {
    // `setup --dry-run | head` (or quitting `less`): the output goes nowhere, setup still ends well.
    let node = prepare(&DGX);
    let mut child = setup_command(&node, &node.from())
        .args(["--queue", "h100", "--node", "dgx01", "--dry-run"])
        .arg("--agent-token-file")
        .arg(node.tmp().join("agent-token"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn the_nvml_build_is_installed_beside_a_static_kernelkite_isolate_when_given() {
    let node = prepare(&DGX);
    write(
        &node.from().join("kernelkite-isolate-nvml"),
        "#!/bin/sh\n# stands in for the dynamically linked build\n",
        0o755,
    );
    stdout_ok(&setup(&node, &DGX, &[]));
    let installed = node
        .root()
        .join("opt/kernelkite/bin/kernelkite-isolate-nvml");
    assert_eq!(
        std::fs::read(&installed).unwrap(),
        std::fs::read(node.from().join("kernelkite-isolate-nvml")).unwrap()
    );
    assert_eq!(
        std::fs::metadata(&installed).unwrap().permissions().mode() & 0o777,
        0o755
    );
    // And `--uninstall` removes it with the rest.
    stdout_ok(&uninstall(&node));
    assert!(!installed.exists());
}

#[test]
fn with_another_prefix_the_plugin_hooks_path_leads_to_the_installed_binary() {
    // The plugin's hook files run /opt/kernelkite/bin/kernelkite-isolate (a shebang cannot
    // search), so a node installed elsewhere links that path to its binary.
    let node = prepare(&DGX);
    let out = stdout_ok(&setup(&node, &DGX, &["--prefix", "/srv/kernelkite"]));
    let link = node.root().join("opt/kernelkite/bin/kernelkite-isolate");
    assert_eq!(
        std::fs::read_link(&link).unwrap(),
        Path::new("/srv/kernelkite/bin/kernelkite-isolate"),
        "{out}"
    );
    assert!(node
        .root()
        .join("srv/kernelkite/bin/kernelkite-isolate")
        .is_file());
    stdout_ok(&uninstall(&node));
    assert!(std::fs::symlink_metadata(&link).is_err(), "the link stayed");
    // At the default prefix the binary itself is there: no link.
    stdout_ok(&setup(&node, &DGX, &[]));
    assert!(std::fs::symlink_metadata(&link).unwrap().is_file());
}

#[test]
fn the_agents_run_only_the_plugin_from_plugin_location_and_the_job_variables_allowed() {
    // The workstation is in docker mode: the official docker plugin is refused there too.
    let node = prepare(&WORKSTATION);
    let out = stdout_ok(&setup(
        &node,
        &WORKSTATION,
        &[
            "--plugin-location",
            "github.com/acme-gpu/kernelkite.fork/plugin",
            "--allow-job-env",
            "HF_TOKEN",
            "--allow-job-env",
            "POPCORN_*",
        ],
    ));
    let path = node.root().join("etc/kernelkite/agents/gpu0.cfg");
    let cfg = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}\n{out}"));
    let pattern = |key: &str| {
        let value = agent_setting(&cfg, key).unwrap_or_else(|| panic!("no {key}:\n{cfg}"));
        // The agent compiles each comma-separated pattern with Go's regexp and calls
        // MatchString, which finds a match anywhere; `is_match` does the same.
        value
            .split(',')
            .map(|p| regex::Regex::new(p.trim()).unwrap())
            .collect::<Vec<_>>()
    };
    let matches = |key: &str, value: &str| pattern(key).iter().any(|r| r.is_match(value));

    for yes in [
        "github.com/acme-gpu/kernelkite.fork/plugin#v0.1.0",
        "github.com/acme-gpu/kernelkite.fork/plugin#v2",
    ] {
        assert!(matches("allowed-plugins", yes), "{yes} refused:\n{cfg}");
    }
    for no in [
        // The default location is not this node's any more.
        "github.com/kernelkite/kernelkite/plugin#v0.1.0",
        "github.com/acme-gpu/kernelkiteXfork/plugin#v1",
        "github.com/evil/kernelkite-plugin#v1",
        "github.com/evil/acme-gpu/kernelkite.fork/plugin#v1",
        "github.com/acme-gpu/kernelkite.fork/plugin#main",
        // `docker#v5.0.0` as the agent matches it.
        "github.com/buildkite-plugins/docker-buildkite-plugin#v5.0.0",
    ] {
        assert!(!matches("allowed-plugins", no), "{no} allowed:\n{cfg}");
    }
    assert!(matches(
        "allowed-repositories",
        "https://github.com/acme-gpu/kernelkite.fork.git"
    ));
    assert!(matches(
        "allowed-repositories",
        "git@github.com:acme-gpu/kernelkite.fork.git"
    ));
    assert!(!matches(
        "allowed-repositories",
        "https://github.com/kernelkite/kernelkite.git"
    ));
    for yes in [
        "KERNELBOT_PAYLOAD_3",
        "KERNELKITE_SUBMISSION_ID",
        "HF_TOKEN",
        "POPCORN_FD",
    ] {
        assert!(matches("allowed-environment-variables", yes), "{yes}");
    }
    for no in [
        "LD_PRELOAD",
        "KERNELKITE_CGROUP_ROOT",
        "HF_TOKENS",
        "BASH_ENV",
    ] {
        assert!(!matches("allowed-environment-variables", no), "{no}");
    }

    // What setup cannot make a safe pattern of is refused before anything is written.
    let fresh = prepare(&WORKSTATION);
    let before = snapshot(&fresh);
    for (flag, value, says) in [
        (
            "--plugin-location",
            "github.com/kernelkite/kernelkite/plugin#v0.1.0",
            "must be the plugin's place on GitHub",
        ),
        (
            "--plugin-location",
            "github.com/kernelkite/.*",
            "must be the plugin's place on GitHub",
        ),
        (
            "--plugin-location",
            "gitlab.com/kernelkite/kernelkite/plugin",
            "must be the plugin's place on GitHub",
        ),
        ("--allow-job-env", "*", "must be a variable's name"),
        ("--allow-job-env", "LD_PRELOAD", "a job may not set LD_*"),
        (
            "--allow-job-env",
            "KERNELKITE_CGROUP_ROOT",
            "a job may not set KERNELKITE_*",
        ),
    ] {
        let out = setup(&fresh, &WORKSTATION, &[flag, value]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} was accepted");
        assert!(
            err.contains(flag) && err.contains(says),
            "{flag} {value}: {err}"
        );
    }
    assert_eq!(snapshot(&fresh), before);
}

#[test]
fn the_deployments_pipelines_pass_a_set_up_nodes_allow_lists() {
    // What a set-up node accepts by default, against what deployment/pipelines/*.yml run:
    // their plugin (every reference), and the env they set besides the service's build env.
    use kernelkite_admin::setup::render::{
        allowed_environment_variables, allowed_plugins, DEFAULT_PLUGIN_LOCATION,
    };
    let plugin = regex::Regex::new(&allowed_plugins(DEFAULT_PLUGIN_LOCATION)).unwrap();
    let env: Vec<regex::Regex> = allowed_environment_variables(&[])
        .iter()
        .map(|p| regex::Regex::new(p).unwrap())
        .collect();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for rel in [
        "deployment/pipelines/host.yml",
        "deployment/pipelines/docker.yml",
    ] {
        let text = std::fs::read_to_string(repo.join(rel)).unwrap();
        let pipeline: serde_json::Value =
            serde_json::to_value(serde_norway::from_str::<serde_norway::Value>(&text).unwrap())
                .unwrap();
        let mut names = Vec::new();
        let mut references = Vec::new();
        let blocks = std::iter::once(&pipeline)
            .chain(pipeline["steps"].as_array().unwrap())
            .collect::<Vec<_>>();
        for block in blocks {
            if let Some(vars) = block["env"].as_object() {
                names.extend(vars.keys().cloned());
            }
            for p in block["plugins"].as_array().into_iter().flatten() {
                match p {
                    serde_json::Value::String(s) => references.push(s.clone()),
                    serde_json::Value::Object(o) => references.extend(o.keys().cloned()),
                    other => panic!("{rel}: plugin {other}"),
                }
            }
        }
        assert!(!references.is_empty(), "{rel}");
        for r in &references {
            assert!(plugin.is_match(r), "{rel}: a set-up node refuses {r}");
        }
        for n in &names {
            assert!(
                n == "CI" || n.starts_with("BUILDKITE") || env.iter().any(|e| e.is_match(n)),
                "{rel}: a set-up node refuses jobs with {n}"
            );
        }
    }
}

/// `setup` on a node whose MI300X GPUs are in CPX mode stops at the plan, naming the command
/// that makes the GPUs whole, and writes nothing.
#[test]
fn setup_refuses_a_partitioned_mi300x_before_touching_anything() {
    use kernelkite_testkit::kfd::{write_mi300x_partitioned, Partitioning};
    let mut node = prepare(&MI300X);
    let cpx_dir = kernelkite_testkit::scratch();
    let cpx = cpx_dir.path().join("cpx");
    let out = Command::new(BIN)
        .args(["fixture", "mi300x-8", "--out"])
        .arg(&cpx)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Every partition's render node in /dev, in the render group, as on the MI300X case's node.
    let every: Vec<(usize, usize)> = (0..8).flat_map(|i| (0..8).map(move |p| (i, p))).collect();
    write_mi300x_partitioned(&cpx, &Partitioning::cpx(), &every).unwrap();
    write(
        &cpx.join("proc/sys/kernel/osrelease"),
        &format!("{}\n", MI300X.kernel),
        0o644,
    );
    let gid = render_gid();
    for e in std::fs::read_dir(cpx.join("dev/dri")).unwrap() {
        std::os::unix::fs::chown(e.unwrap().path(), None, Some(gid)).unwrap();
    }
    std::os::unix::fs::chown(cpx.join("dev/kfd"), None, Some(gid)).unwrap();
    node.machine = cpx;
    let before = snapshot(&node);
    let out = setup(&node, &MI300X, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("is in CPX compute partitioning")
            && err.contains("sudo amd-smi set --gpu all --compute-partition SPX"),
        "{err}"
    );
    assert_eq!(snapshot(&node), before);
}
