//! The local executor's flags (each with an environment fallback), and where they lead once
//! resolved: the binaries, the directories, the node's roots and the plugin configuration.

use std::path::{Path, PathBuf};

use super::binaries::{self, Binaries};
use super::LocalError;

/// The plugin configuration local jobs run with unless `--plugin-config` says otherwise: the
/// plugin's defaults, and a loud warning instead of a failure where cgroups cannot be used.
pub const DEFAULT_PLUGIN_CONFIG: &str = r#"{"allow-unenforced":true}"#;

/// How local mode runs jobs on this machine (`kernelkite-service local --help`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LocalArgs {
    /// The runner binary. Default: `kernelkite-runner` beside this executable (`cargo build
    /// --release --workspace --bins` puts it there), else on PATH.
    #[arg(long, env = "KERNELKITE_RUNNER_BIN", value_name = "PATH")]
    pub runner_bin: Option<PathBuf>,

    /// The plugin's binary (the job hooks). Default: `kernelkite-isolate` beside this
    /// executable, else on PATH.
    #[arg(long, env = "KERNELKITE_ISOLATE_BIN", value_name = "PATH")]
    pub isolate_bin: Option<PathBuf>,

    /// Where job directories go (payload, logs, result.json; each removed once its result is
    /// stored). Default: `<KERNELKITE_DATA_DIR>/local`, else a temporary directory.
    #[arg(long, env = "KERNELKITE_LOCAL_DIR", value_name = "DIR")]
    pub local_dir: Option<PathBuf>,

    /// The hooks' run dir (GPU leases, job state). Every user of this node's job cgroups
    /// must share one: an agent's hooks treat a job cgroup without state in their run dir as
    /// a lost job's. Default: `/run/kernelkite` (the agents' default) when it can be created,
    /// else `$XDG_RUNTIME_DIR/kernelkite`, else `<local dir>/run`.
    #[arg(long, env = "KERNELKITE_RUN_DIR", value_name = "DIR")]
    pub run_dir: Option<PathBuf>,

    /// The node's plan (`kernelkite-isolate plan --json > FILE`). Default: planned at start
    /// (policy flags from the KERNELKITE_* variables `plan --help` lists).
    #[arg(long, env = "KERNELKITE_PLAN_FILE", value_name = "FILE")]
    pub plan_file: Option<PathBuf>,

    /// On a machine without GPUs, plan this many CPU-only slices (one worker each).
    #[arg(
        long,
        env = "KERNELKITE_CPU_ONLY_SLICES",
        value_name = "N",
        default_value_t = 1
    )]
    pub cpu_only_slices: u32,

    /// Root of the sysfs/procfs tree the node is planned from (a fake tree in tests).
    #[arg(
        long,
        env = "KERNELKITE_SYSFS_ROOT",
        value_name = "DIR",
        default_value = "/"
    )]
    pub sysfs_root: PathBuf,

    /// Root holding `proc/self/mountinfo` and the cgroup mounts (a fake tree in tests).
    #[arg(
        long,
        env = "KERNELKITE_CGROUP_ROOT",
        value_name = "DIR",
        default_value = "/"
    )]
    pub cgroup_root: PathBuf,

    /// The plugin configuration every job gets (JSON, the keys of the plugin's `plugin.yml`),
    /// as a pipeline step would give it.
    #[arg(
        long,
        env = "KERNELKITE_LOCAL_PLUGIN_CONFIG",
        value_name = "JSON",
        default_value = DEFAULT_PLUGIN_CONFIG
    )]
    pub plugin_config: String,

    /// Refuse to run a job unconfined: where cgroups cannot be used, jobs fail instead of
    /// running with a warning (sets the plugin's `allow-unenforced: false`).
    #[arg(long, env = "KERNELKITE_LOCAL_ENFORCE")]
    pub enforce: bool,

    /// Run each command in the plugin's sandbox (as the unprivileged job user, in private
    /// namespaces). `auto`: when this service runs as root and the job user (the plugin
    /// configuration's `user`, default `kernelkite-job`) exists and can run the runner binary;
    /// else without it, with a warning at start. `on`: always (a job fails with the reason where it cannot be used).
    /// The job user must be able to reach the runner binary and the local dir.
    #[arg(
        long,
        env = "KERNELKITE_LOCAL_SANDBOX",
        value_enum,
        default_value = "auto",
        value_name = "WHEN"
    )]
    pub sandbox: SandboxChoice,
}

/// `--sandbox`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SandboxChoice {
    /// On where it can work (root, the job user exists), else off with a warning.
    #[default]
    Auto,
    /// Always on.
    On,
    /// Always off: commands run as this service's user.
    Off,
}

/// Whether local jobs run in the sandbox, and why not when they do not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxDecision {
    /// `KERNELKITE_SANDBOX` for the hooks.
    pub on: bool,
    /// Why it is off under `auto` (printed at start), `None` when on or chosen off.
    pub why_off: Option<String>,
}

/// The plugin's default `user` (the service does not link the plugin; both import it).
const DEFAULT_JOB_USER: &str = kernelkite_sys::node::JOB_USER;

/// The job user the plugin configuration names (its `user` key, else the plugin's default).
fn job_user(config: &serde_json::Map<String, serde_json::Value>) -> String {
    match config.get("user") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => DEFAULT_JOB_USER.into(),
    }
}

/// `path` when users other than its owner may not read and execute it: the job user cannot
/// run it then. Where it lies does not matter: the sandbox binds the runner into every job
/// at its own path (the hooks' `--job-tool`), over a fresh `/tmp` or `/var/tmp` and over a
/// directory on the way the job user may not search (a clone in `/root`).
pub fn closed_to_others(path: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let open = std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o005 == 0o005);
    (!open).then(|| path.to_path_buf())
}

/// Decides `--sandbox` for a service running as `euid` on a node whose `/etc/passwd` reads
/// `passwd`; `runner_blocked_at` is the runner binary when the job user may not run it
/// ([`closed_to_others`]). A numeric user (`"1500"`, `"1500:1500"`) needs no
/// account.
pub fn decide_sandbox(
    choice: SandboxChoice,
    euid: u32,
    passwd: &str,
    config: &serde_json::Map<String, serde_json::Value>,
    runner_blocked_at: Option<&Path>,
) -> SandboxDecision {
    let off = |why: Option<String>| SandboxDecision {
        on: false,
        why_off: why,
    };
    match choice {
        SandboxChoice::On => SandboxDecision {
            on: true,
            why_off: None,
        },
        SandboxChoice::Off => off(None),
        SandboxChoice::Auto => {
            let user = job_user(config);
            let numeric = user
                .split(':')
                .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
            // The default user needs no account: each slice's job runs as that slice's own
            // reserved uid (the plugin's `sandbox::user::for_slice`).
            let exists = numeric
                || user == DEFAULT_JOB_USER
                || kernelkite_sys::passwd::has_user(passwd, &user);
            if euid != 0 {
                off(Some(format!(
                    "the sandbox needs root and this service runs as uid {euid}: commands run as uid {euid}, unsandboxed (fine for your own code; run as root with --sandbox on for untrusted submissions)"
                )))
            } else if !exists {
                off(Some(format!(
                    "the job user {user:?} does not exist: commands run as root, unsandboxed; create it (`kernelkite-isolate setup`, or `useradd --system --user-group --no-create-home --shell /usr/sbin/nologin {user}`) to run them in the sandbox"
                )))
            } else if let Some(at) = runner_blocked_at {
                off(Some(format!(
                    "the job user {user:?} cannot run the runner binary {}, which only its owner may read and run: commands run as root, unsandboxed; `chmod a+rx` it (or install the binaries with `kernelkite-isolate setup`, which puts them in /opt/kernelkite/bin, and pass --runner-bin), or pass --sandbox on to fail such jobs instead",
                    at.display()
                )))
            } else {
                SandboxDecision {
                    on: true,
                    why_off: None,
                }
            }
        }
    }
}

/// [`LocalArgs`] resolved: every path known and checked.
#[derive(Debug, Clone)]
pub struct LocalSettings {
    /// The binaries jobs run.
    pub bins: Binaries,
    /// Job directories live in `<local_dir>/jobs`.
    pub local_dir: PathBuf,
    /// The hooks' run dir.
    pub run_dir: PathBuf,
    /// A plan file given by the operator (else one is written to `<local_dir>/plan.json`).
    pub plan_file: Option<PathBuf>,
    /// CPU-only slices on a machine without GPUs.
    pub cpu_only_slices: u32,
    /// sysfs/procfs root.
    pub sysfs_root: PathBuf,
    /// cgroup root.
    pub cgroup_root: PathBuf,
    /// The plugin configuration (a JSON object).
    pub plugin_config: serde_json::Map<String, serde_json::Value>,
    /// Whether commands run in the plugin's sandbox.
    pub sandbox: SandboxDecision,
}

impl LocalArgs {
    /// Finds the binaries and decides the directories; `data_dir` is the service's
    /// KERNELKITE_DATA_DIR and `temp` a directory to use when there is neither it nor
    /// `--local-dir`.
    pub fn resolve(
        &self,
        data_dir: Option<&Path>,
        temp: impl FnOnce() -> std::io::Result<PathBuf>,
    ) -> Result<LocalSettings, LocalError> {
        let bins = binaries::find(self.runner_bin.as_deref(), self.isolate_bin.as_deref())?;
        let local_dir = match (&self.local_dir, data_dir) {
            (Some(d), _) => d.clone(),
            (None, Some(d)) => d.join("local"),
            (None, None) => temp().map_err(|source| LocalError::Dir {
                path: std::env::temp_dir(),
                source,
            })?,
        };
        std::fs::create_dir_all(local_dir.join("jobs")).map_err(|source| LocalError::Dir {
            path: local_dir.join("jobs"),
            source,
        })?;
        let run_dir = match &self.run_dir {
            Some(d) => d.clone(),
            None => default_run_dir(&local_dir),
        };
        let mut plugin_config = match serde_json::from_str(&self.plugin_config) {
            Ok(serde_json::Value::Object(m)) => m,
            Ok(_) | Err(_) => {
                return Err(LocalError::PluginConfig(self.plugin_config.clone()));
            }
        };
        if self.enforce {
            plugin_config.insert("allow-unenforced".into(), serde_json::Value::Bool(false));
        }
        let sandbox = decide_sandbox(
            self.sandbox,
            rustix::process::geteuid().as_raw(),
            &std::fs::read_to_string("/etc/passwd").unwrap_or_default(),
            &plugin_config,
            closed_to_others(&bins.runner).as_deref(),
        );
        Ok(LocalSettings {
            sandbox,
            bins,
            local_dir,
            run_dir,
            plan_file: self.plan_file.clone(),
            cpu_only_slices: self.cpu_only_slices,
            sysfs_root: self.sysfs_root.clone(),
            cgroup_root: self.cgroup_root.clone(),
            plugin_config,
        })
    }
}

/// The agents' run dir (`/run/kernelkite`) when this process may use it; else a run dir of its
/// own in the user's runtime directory (`$XDG_RUNTIME_DIR`), else in the local dir. The hooks
/// write their state there with `fsync`: on the tmpfs `/run` is, that costs nothing, on a
/// disk some milliseconds per job.
fn default_run_dir(local_dir: &Path) -> PathBuf {
    let shared = PathBuf::from(kernelkite_sys::node::RUN_DIR);
    if std::fs::create_dir_all(&shared).is_ok() && writable(&shared) {
        return shared;
    }
    if let Some(rt) = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        let mine = rt.join("kernelkite");
        if std::fs::create_dir_all(&mine).is_ok() && writable(&mine) {
            return mine;
        }
    }
    local_dir.join("run")
}

/// Whether this process may create files in `dir`.
fn writable(dir: &Path) -> bool {
    rustix::fs::access(
        dir,
        rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK,
    )
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(dir: &Path) -> LocalArgs {
        let exe = dir.join("bin");
        std::fs::write(&exe, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        LocalArgs {
            runner_bin: Some(exe.clone()),
            isolate_bin: Some(exe),
            plugin_config: DEFAULT_PLUGIN_CONFIG.into(),
            run_dir: Some(dir.join("run")),
            ..LocalArgs::default()
        }
    }

    #[test]
    fn directories_and_the_plugin_configuration_resolve() {
        let d = tempfile::tempdir().unwrap();
        let mut a = args(d.path());
        let s = a
            .resolve(Some(&d.path().join("data")), || unreachable!())
            .unwrap();
        assert_eq!(s.local_dir, d.path().join("data/local"));
        assert!(s.local_dir.join("jobs").is_dir());
        assert_eq!(s.plugin_config["allow-unenforced"], true);
        a.enforce = true;
        let s = a.resolve(None, || Ok(d.path().join("tmp"))).unwrap();
        assert_eq!(s.local_dir, d.path().join("tmp"));
        assert_eq!(s.plugin_config["allow-unenforced"], false);
        a.plugin_config = "[1]".into();
        let e = a.resolve(None, || Ok(d.path().join("tmp"))).unwrap_err();
        assert!(e.to_string().contains("--plugin-config"), "{e}");
        a.plugin_config = DEFAULT_PLUGIN_CONFIG.into();
        a.runner_bin = Some(d.path().join("missing"));
        let e = a.resolve(None, || Ok(d.path().join("tmp"))).unwrap_err();
        assert!(e.to_string().contains("not an executable file"), "{e}");
    }

    #[test]
    fn a_binary_only_its_owner_may_run_is_closed_to_the_job_user() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        // A closed directory on the way does not count: the sandbox covers it.
        let dir = d.path().join("closed");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let exe = dir.join("kernelkite-runner");
        std::fs::write(&exe, "").unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(closed_to_others(&exe), None);
        for mode in [0o700, 0o751, 0o754] {
            std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(mode)).unwrap();
            assert_eq!(
                closed_to_others(&exe).as_deref(),
                Some(exe.as_path()),
                "{mode:o}"
            );
        }
        assert!(closed_to_others(&dir.join("absent")).is_some());
    }

    #[test]
    fn the_sandbox_is_used_where_it_can_work_unless_chosen() {
        let passwd = "root:x:0:0::/root:/bin/sh\nkernelkite-job:x:999:999::/:/usr/sbin/nologin\n";
        let cfg = |v: serde_json::Value| v.as_object().unwrap().clone();
        let default = cfg(serde_json::json!({}));
        let auto = |euid, passwd, c: &serde_json::Map<_, _>| {
            decide_sandbox(SandboxChoice::Auto, euid, passwd, c, None)
        };
        assert!(auto(0, passwd, &default).on);
        // Not root: off, saying why.
        let d = auto(1000, passwd, &default);
        assert!(!d.on);
        assert!(d.why_off.unwrap().contains("needs root"));
        // The default user needs no account (one reserved uid per slice)...
        assert!(auto(0, "root:x:0:0::/root:/bin/sh\n", &default).on);
        // ... a user the config names does: off, naming how to make one.
        let d = auto(
            0,
            "root:x:0:0::/root:/bin/sh\n",
            &cfg(serde_json::json!({"user": "bob"})),
        );
        assert!(!d.on);
        let why = d.why_off.unwrap();
        assert!(why.contains("\"bob\" does not exist"), "{why}");
        assert!(why.contains("useradd"), "{why}");
        // The configured user is the one looked up; a number needs no account.
        assert!(!auto(0, passwd, &cfg(serde_json::json!({"user": "alice"}))).on);
        assert!(auto(0, "", &cfg(serde_json::json!({"user": "1500:1500"}))).on);
        assert!(!auto(0, "", &cfg(serde_json::json!({"user": "15a"}))).on);
        // Chosen: no second guessing, and no warning for off.
        // A runner the job user may not run: off, naming it.
        let d = decide_sandbox(
            SandboxChoice::Auto,
            0,
            passwd,
            &default,
            Some(Path::new("/opt/x/kernelkite-runner")),
        );
        assert!(!d.on);
        let why = d.why_off.unwrap();
        assert!(why.contains("cannot run the runner binary"), "{why}");
        assert!(why.contains("/opt/x/kernelkite-runner"), "{why}");
        let on = decide_sandbox(
            SandboxChoice::On,
            1000,
            "",
            &default,
            Some(Path::new("/root")),
        );
        assert_eq!(
            on,
            SandboxDecision {
                on: true,
                why_off: None
            }
        );
        let off = decide_sandbox(SandboxChoice::Off, 0, passwd, &default, None);
        assert_eq!(
            off,
            SandboxDecision {
                on: false,
                why_off: None
            }
        );
    }
}
