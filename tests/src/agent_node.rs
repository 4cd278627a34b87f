//! A GPU node as `kernelkite-isolate setup` makes it, served by real `buildkite-agent start`
//! processes, on this machine and without changing it.
//!
//! `setup --root` writes the node's files (binaries in `/opt/kernelkite`, `/etc/kernelkite`
//! with the agents' configurations and hooks, `/var/lib/kernelkite`) under a scratch directory.
//! A mount namespace then lays each of `/etc`, `/opt`, `/var/lib` and `/run` over itself with
//! that tree as the writable upper layer (overlayfs): inside it, the node's paths are exactly
//! where setup put them, the job user exists, and nothing the agents or jobs write reaches the
//! machine's own `/etc`, `/opt`, `/var/lib` or `/run`. Cgroups are the machine's (real ones,
//! the point of the exercise), and the jobs' cgroups are gone when the hooks are done.
//!
//! The agents check out `https://github.com/kernelkite/kernelkite` (the repository the
//! pipelines and setup's `allowed-repositories` name) and clone the plugin from
//! `github.com/kernelkite/kernelkite/plugin#v0.1.0` as the deployment pipeline names it: the
//! agents' git (`$HOME/.gitconfig`, `url.<local>.insteadOf`) fetches both from a local
//! repository made from this working tree's `plugin/` and `deployment/`, tagged `v0.1.0`.
//! Only git is redirected; the agent sees the real names.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The repository the pipelines name (`deployment/pipelines/*.yml`, setup's default
/// `--plugin-location`).
pub const REPOSITORY: &str = "https://github.com/kernelkite/kernelkite";
/// The tag the deployment pipelines pin the plugin at.
pub const PLUGIN_TAG: &str = "v0.1.0";
/// The agent token setup writes into the agents' configurations: the fake's.
pub use crate::fake_buildkite::FAKE_AGENT_TOKEN as AGENT_TOKEN;

/// One agent of the node.
pub struct AgentProcess {
    /// Its name (`<node>-slice<N>`).
    pub name: String,
    child: Child,
    /// Its log file.
    pub log: PathBuf,
}

impl AgentProcess {
    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: the agent is lost mid-job (its job's processes are left to the next job's
    /// hooks, as on a node whose agent crashed).
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGKILL to the agent and to the process group of each process it started (the job's
    /// bootstrap and its hooks): the agent is lost mid-job and the job's `pre-exit` never runs,
    /// as when a node's agent is killed with its job (what the job's own command left in its
    /// cgroup stays, for the next job's hooks to reclaim).
    pub fn kill9_with_job(&mut self) {
        let me = self.child.id();
        let proc_root = std::path::Path::new("/proc");
        for pid in kernelkite_sys::procfs::children_of(proc_root, me) {
            let pgrp = kernelkite_sys::procfs::read_stat(proc_root, pid)
                .and_then(|s| s.pgrp)
                .and_then(|g| i32::try_from(g).ok());
            if let Some(pgrp) = pgrp {
                if pgrp > 1 {
                    // SAFETY: kill(2) on a process group the agent started.
                    unsafe { libc::kill(-pgrp, libc::SIGKILL) };
                }
            }
        }
        self.kill9();
    }

    /// SIGTERM, then waits for the agent to exit (it finishes or cancels its job first).
    pub fn stop(&mut self, within: Duration) -> bool {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + within;
        while std::time::Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A node made by setup, its namespace held open by a sleeping process.
pub struct Node {
    dir: tempfile::TempDir,
    holder: Child,
    agent_bin: PathBuf,
    endpoint: String,
    job_user: u32,
    /// The agents started so far (by [`Node::start_agent`]).
    pub agents: Vec<AgentProcess>,
}

impl Drop for Node {
    fn drop(&mut self) {
        for a in &mut self.agents {
            a.kill9();
        }
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `git args` in `dir` (with a committer identity); its output, trimmed. Panics on failure.
pub fn git(dir: &Path, args: &[&str]) -> String {
    run(Command::new("git")
        .current_dir(dir)
        .args(["-c", "user.email=kk@test", "-c", "user.name=kk"])
        .args(args))
    .trim()
    .to_string()
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), &t).unwrap();
        }
    }
}

/// A bare repository holding this working tree's `plugin/` and `deployment/` (what the
/// agents check out and clone the plugin from), with `main` and the tag [`PLUGIN_TAG`].
/// `extra` adds files (a repository hook, say).
pub fn repository(at: &Path, extra: &[(&str, &str)]) -> PathBuf {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let work = at.join("work");
    copy_tree(&workspace.join("plugin/hooks"), &work.join("plugin/hooks"));
    std::fs::copy(
        workspace.join("plugin/plugin.yml"),
        work.join("plugin/plugin.yml"),
    )
    .unwrap();
    copy_tree(
        &workspace.join("deployment/pipelines"),
        &work.join("deployment/pipelines"),
    );
    for (path, text) in extra {
        let p = work.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    git(&work, &["init", "-q", "-b", "main"]);
    git(&work, &["add", "-A"]);
    git(&work, &["commit", "-q", "-m", "kernelkite under test"]);
    git(&work, &["tag", PLUGIN_TAG]);
    let bare = at.join("kernelkite");
    run(Command::new("git")
        .args(["clone", "-q", "--bare"])
        .arg(&work)
        .arg(&bare));
    // `insteadOf` rewrites a prefix: GitHub's `<repo>.git` becomes `<bare>.git`.
    std::os::unix::fs::symlink(&bare, at.join("kernelkite.git")).unwrap();
    bare
}

/// A uid and gid below 1000 that neither `/etc/passwd` nor `/etc/group` uses.
fn free_system_id() -> u32 {
    let used = |file: &str| -> Vec<u32> {
        std::fs::read_to_string(file)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split(':').nth(2)?.parse().ok())
            .collect()
    };
    let (users, groups) = (used("/etc/passwd"), used("/etc/group"));
    (900..1000)
        .rev()
        .find(|id| !users.contains(id) && !groups.contains(id))
        .expect("a free system id below 1000")
}

/// What [`Node::new`] needs.
pub struct NodeSpec<'a> {
    /// `--queue`.
    pub queue: &'a str,
    /// `--node`.
    pub node: &'a str,
    /// `--cpu-only-slices` (this machine has no GPU).
    pub slices: u32,
    /// The directory holding `kernelkite-isolate` and `kernelkite-runner` (setup's `--from`).
    pub binaries: &'a Path,
    /// The real agent.
    pub agent: &'a Path,
    /// The agent API (`http://127.0.0.1:<port>/v3`).
    pub endpoint: String,
    /// The local repository git fetches in place of GitHub ([`repository`]).
    pub repository: &'a Path,
    /// `--verification-jwks`: the public key the agents verify signed steps with.
    pub verification_jwks: Option<&'a Path>,
}

impl Node {
    /// Runs `setup --root` and opens the node's namespace.
    pub fn new(spec: &NodeSpec<'_>) -> Node {
        let dir = crate::scratch();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let token = dir.path().join("agent-token");
        std::fs::write(&token, AGENT_TOKEN).unwrap();
        let isolate = spec.binaries.join("kernelkite-isolate");
        let mut setup = Command::new(&isolate);
        setup.arg("setup");
        if let Some(jwks) = spec.verification_jwks {
            setup.arg("--verification-jwks").arg(jwks);
        }
        let out = run(setup
            .arg("--root")
            .arg(&root)
            .args(["--queue", spec.queue, "--node", spec.node])
            .arg("--cpu-only-slices")
            .arg(spec.slices.to_string())
            .arg("--allow-sharing")
            .arg("--agent-token-file")
            .arg(&token)
            .arg("--from")
            .arg(spec.binaries)
            .arg("--buildkite-agent")
            .arg(spec.agent)
            .env_remove("KERNELKITE_PLUGIN_LOCATION")
            .env_remove("KERNELKITE_SYSFS_ROOT")
            .env_remove("BUILDKITE_AGENT_TOKEN"));
        eprintln!("setup --root: {}", out.lines().last().unwrap_or_default());

        // What the recorded `useradd --system` would have made: the job user, in the
        // overlay's /etc, with a system id nobody here has.
        let id = free_system_id();
        for (file, line) in [
            (
                "passwd",
                format!("kernelkite-job:x:{id}:{id}:kernelkite job sandbox:/nonexistent:/usr/sbin/nologin\n"),
            ),
            ("group", format!("kernelkite-job:x:{id}:\n")),
        ] {
            let mut text = std::fs::read_to_string(Path::new("/etc").join(file)).unwrap();
            text.push_str(&line);
            std::fs::write(root.join("etc").join(file), text).unwrap();
        }
        // The agents' HOME is /var/lib/kernelkite: their git fetches GitHub's names locally.
        std::fs::write(
            root.join("var/lib/kernelkite/.gitconfig"),
            format!(
                "[url \"{}\"]\n\tinsteadOf = {REPOSITORY}\n[safe]\n\tdirectory = *\n",
                spec.repository.display()
            ),
        )
        .unwrap();
        std::fs::create_dir_all(root.join("run")).unwrap();

        let mut script = String::from("set -e\nmount --make-rprivate /\n");
        for d in ["etc", "opt", "var/lib", "run"] {
            let work = dir.path().join("work").join(d.replace('/', "-"));
            std::fs::create_dir_all(&work).unwrap();
            std::fs::create_dir_all(root.join(d)).unwrap();
            script.push_str(&format!(
                "mount -t overlay kernelkite-node -o lowerdir=/{d},upperdir={},workdir={} /{d}\n",
                root.join(d).display(),
                work.display()
            ));
        }
        // The hooks' run dir starts empty, whatever the machine's /run/kernelkite holds.
        script.push_str("mkdir -p /run/kernelkite\nmount -t tmpfs -o mode=0755 kernelkite-run /run/kernelkite\n");
        script.push_str("echo ready\nexec sleep infinity\n");
        let mut holder = Command::new("unshare")
            .args(["--mount", "--propagation", "private", "sh", "-c", &script])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("unshare");
        let mut first = [0u8; 6];
        use std::io::Read;
        holder
            .stdout
            .as_mut()
            .unwrap()
            .read_exact(&mut first)
            .expect("the node's namespace is ready");
        assert_eq!(&first, b"ready\n");
        Node {
            dir,
            holder,
            job_user: id,
            agent_bin: spec.agent.to_path_buf(),
            endpoint: spec.endpoint.clone(),
            agents: Vec::new(),
        }
    }

    /// Mounts what setup's mount units mount, as systemd does at boot (on cgroup v1 with Linux
    /// 6.0+, the `favordynmods` hierarchy: without it every move into a job's cgroup waits for
    /// an RCU grace period, about 10 ms here, which a node setup made never pays), in the
    /// node's namespace. For what measures a node's timings: the mount goes with the node, but
    /// the kernel's cgroup lock stays in favordynmods mode after it (seen on Linux 6.18).
    pub fn mount_units(&self) {
        let units = self
            .root()
            .join(kernelkite_admin::setup::paths::UNIT_DIR.trim_start_matches('/'));
        let Ok(entries) = std::fs::read_dir(&units) else {
            return;
        };
        for e in entries.flatten() {
            if e.path().extension().is_none_or(|x| x != "mount") {
                continue;
            }
            let text = std::fs::read_to_string(e.path()).unwrap();
            let key = |k: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(&format!("{k}=")))
                    .unwrap_or_else(|| panic!("{} has no {k}=", e.path().display()))
                    .to_string()
            };
            let (what, at, kind, options) =
                (key("What"), key("Where"), key("Type"), key("Options"));
            self.sh(&format!(
                "mkdir -p '{at}'\nmount -t '{kind}' -o '{options}' '{what}' '{at}'"
            ));
        }
    }

    /// Runs `script` (`sh -e`) as root in the node's mount namespace, where its agents see
    /// setup's tree (`/etc/kernelkite/hooks`...); its output. Panics when it fails.
    pub fn sh(&self, script: &str) -> String {
        run(Command::new("nsenter")
            .arg("--mount")
            .arg("--target")
            .arg(self.holder.id().to_string())
            .args(["--", "sh", "-ec", script]))
    }

    /// The uid (and gid) of the node's job user, `kernelkite-job`.
    pub fn job_user(&self) -> u32 {
        self.job_user
    }

    /// The node's tree as setup wrote it (and the jobs' writes to it since).
    pub fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    /// The environment setup's units give the agents (`EnvironmentFile=/etc/kernelkite/agent.env`).
    fn agent_env(&self) -> Vec<(String, String)> {
        let text = std::fs::read_to_string(self.root().join("etc/kernelkite/agent.env")).unwrap();
        text.lines()
            .filter(|l| !l.trim_start().starts_with('#') && l.contains('='))
            .map(|l| {
                let (k, v) = l.split_once('=').unwrap();
                let v = v
                    .strip_prefix('\'')
                    .and_then(|v| v.strip_suffix('\''))
                    .unwrap_or(v);
                (k.to_string(), v.to_string())
            })
            .collect()
    }

    /// Starts the agent of `instance` (`slice0`...) as setup's unit does (`buildkite-agent
    /// start --config /etc/kernelkite/agents/<instance>.cfg`, the unit's environment), against
    /// the fake's agent API; `extra` adds flags (a test's own tags, say). Returns its index in
    /// [`Node::agents`].
    pub fn start_agent(&mut self, instance: &str, extra: &[&str]) -> usize {
        let log = self
            .dir
            .path()
            .join(format!("agent-{instance}-{}.log", self.agents.len()));
        let file = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new("nsenter");
        cmd.arg("--mount")
            .arg("--target")
            .arg(self.holder.id().to_string())
            .arg("--")
            .arg(&self.agent_bin)
            .arg("start")
            .arg("--config")
            .arg(format!("/etc/kernelkite/agents/{instance}.cfg"))
            .arg("--endpoint")
            .arg(&self.endpoint)
            .args(extra)
            .env_clear()
            .envs(self.agent_env())
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        let child = cmd.spawn().expect("start buildkite-agent");
        let text = std::fs::read_to_string(
            self.root()
                .join(format!("etc/kernelkite/agents/{instance}.cfg")),
        )
        .unwrap();
        let name = text
            .lines()
            .find_map(|l| l.strip_prefix("name=\""))
            .map(|n| n.trim_end_matches('"').to_string())
            .unwrap_or_default();
        self.agents.push(AgentProcess { name, child, log });
        self.agents.len() - 1
    }

    /// The log of the agent named `name` that started last.
    pub fn agent_log(&self, name: &str) -> String {
        self.agents
            .iter()
            .rev()
            .find(|a| a.name == name)
            .map(AgentProcess::log_text)
            .unwrap_or_default()
    }

    /// Every agent's log, for a failing test's message.
    pub fn logs(&self) -> String {
        self.agents
            .iter()
            .map(|a| format!("--- {} ---\n{}", a.name, a.log_text()))
            .collect()
    }
}

/// Commits `files` (path, text) to the repository [`repository`] made under `at`, on `main`.
pub fn commit(at: &Path, files: &[(&str, &str)]) {
    let work = at.join("work");
    write_executables(&work, files);
    git(&work, &["add", "-A"]);
    publish(at, "change under test");
}

/// Writes `files` (path, text) under `work`, executable.
fn write_executables(work: &Path, files: &[(&str, &str)]) {
    for (path, text) in files {
        let p = work.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
}

/// Tags as `tag`, in the repository [`repository`] made under `at`, `main` with `files`
/// (path, text) written over it and `removed` taken out, without moving `main` (a plugin
/// version a pipeline can name as `...#<tag>`).
pub fn tag_with(at: &Path, tag: &str, files: &[(&str, &str)], removed: &[&str]) {
    let work = at.join("work");
    git(&work, &["checkout", "-q", "--detach"]);
    write_executables(&work, files);
    for p in removed {
        git(&work, &["rm", "-q", p]);
    }
    git(&work, &["add", "-A"]);
    git(&work, &["commit", "-q", "-m", &format!("{tag} under test")]);
    git(&work, &["tag", tag]);
    git(&work, &["checkout", "-q", "main"]);
    let bare = at.join("kernelkite");
    git(&work, &["push", "-q", bare.to_str().unwrap(), tag]);
}

/// Removes `paths` from the repository [`repository`] made under `at`, in a commit on `main`.
pub fn remove(at: &Path, paths: &[&str]) {
    let work = at.join("work");
    for p in paths {
        git(&work, &["rm", "-q", p]);
    }
    publish(at, "removed under test");
}

/// Commits what is staged in the work tree and pushes `main` to the bare repository.
fn publish(at: &Path, message: &str) {
    let work = at.join("work");
    let bare = at.join("kernelkite");
    git(&work, &["commit", "-q", "-m", message]);
    git(&work, &["push", "-q", bare.to_str().unwrap(), "main"]);
}
