//! From what the node needs to what to do, and doing it.
//!
//! [`observe`] reads what is on disk at the paths setup writes (under the root). [`decide`]
//! and [`decide_uninstall`] are pure: the wanted state, the observations and the previous
//! [`Manifest`] in, [`Actions`] out (file actions, commands, the next manifest). [`execute`]
//! applies them under the root; commands run only on the live machine and are recorded (only
//! printed) under `--root` and `--dry-run`.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use super::manifest::{mode_text, sha256_hex, Backup, Entry, Manifest, VERSION};
use super::paths::*;
use super::render::{Content, Desired, Dir, File};
use super::{under, SetupError};

/// What is at a path setup writes, compared with what it would write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// Nothing.
    Missing,
    /// Exactly what setup writes (bytes and mode, or link target).
    Same,
    /// Something else.
    Differs,
}

/// What is at a path an earlier run wrote, compared with the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Gone.
    Missing,
    /// As setup wrote it.
    Unchanged,
    /// Changed since.
    Changed,
}

/// What setup found on the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    /// Each wanted file's path and what is there.
    pub files: BTreeMap<PathBuf, Found>,
    /// Each file of the previous manifest and whether it is still as written.
    pub recorded: BTreeMap<PathBuf, Recorded>,
    /// Directories (wanted ones and their ancestors) that exist.
    pub existing_dirs: BTreeSet<PathBuf>,
    /// Whether the job user exists.
    pub job_user_exists: bool,
    /// Groups the job user is in.
    pub job_user_groups: Vec<String>,
}

/// What happens to a wanted file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileAction {
    /// It is missing: written.
    Create,
    /// Setup wrote it before and it differs now: written again.
    Update,
    /// Already as wanted.
    Same,
    /// Not setup's, different: moved to `<path>.kernelkite-orig`, then written (`--replace`).
    Replace,
    /// Not setup's, different, and no `--replace`: setup stops.
    Conflict,
}

/// What happens to a file an earlier run wrote that is no longer wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StaleAction {
    /// Removed.
    Remove,
    /// Changed since setup wrote it: left in place (and reported).
    KeepChanged,
}

/// A step after (or before) the files: a command, or one of setup's own checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A program and its arguments.
    Run(Vec<String>),
    /// `kernelkite-isolate doctor` (run in-process).
    Doctor,
    /// `kernelkite-isolate smoke` (run in-process).
    Smoke,
}

impl Step {
    /// `systemctl <args...>`.
    fn systemctl(args: &[&str], units: &[String]) -> Step {
        let mut v: Vec<String> = std::iter::once("systemctl")
            .chain(args.iter().copied())
            .map(str::to_string)
            .collect();
        v.extend(units.iter().cloned());
        Step::Run(v)
    }

    /// Whether it changes the machine (doctor and the smoke job only look, and clean up).
    pub fn changes_state(&self) -> bool {
        matches!(self, Step::Run(_))
    }
}

/// Everything setup (or `--uninstall`) will do.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Actions {
    /// Commands before the files change (stopping agents that are going away).
    pub before: Vec<Step>,
    /// Directories to create, parents first.
    pub mkdirs: Vec<Dir>,
    /// Wanted files and what happens to each.
    pub files: Vec<(File, FileAction)>,
    /// Files of an earlier run no longer wanted.
    pub stale: Vec<(PathBuf, StaleAction)>,
    /// Earlier files to put back (`--uninstall`).
    pub restore: Vec<Backup>,
    /// Directories setup created to remove when empty (`--uninstall`), deepest first.
    pub rmdirs: Vec<PathBuf>,
    /// Commands after the files.
    pub after: Vec<Step>,
    /// The manifest to write; `None` when it is removed (`--uninstall`).
    pub manifest: Option<Manifest>,
}

impl Actions {
    /// Paths that exist, are not setup's and differ, when `--replace` was not given.
    pub fn conflicts(&self) -> Vec<String> {
        self.files
            .iter()
            .filter(|(_, a)| *a == FileAction::Conflict)
            .map(|(f, _)| f.path.display().to_string())
            .collect()
    }

    /// Whether it would change anything on the node.
    pub fn changes_anything(&self) -> bool {
        !self.before.is_empty()
            || !self.mkdirs.is_empty()
            || self.files.iter().any(|(_, a)| *a != FileAction::Same)
            || self.stale.iter().any(|(_, a)| *a == StaleAction::Remove)
            || !self.restore.is_empty()
            || !self.rmdirs.is_empty()
            || self.after.iter().any(Step::changes_state)
    }
}

/// The wanted directories and every ancestor of them and of the files, parents first.
pub fn needed_dirs(desired: &Desired) -> Vec<Dir> {
    let mut out: Vec<Dir> = Vec::new();
    let mut add = |path: &Path, mode: u32| {
        let mut chain: Vec<&Path> = path
            .ancestors()
            .filter(|a| *a != Path::new("/") && !a.as_os_str().is_empty())
            .collect();
        chain.reverse();
        for (i, a) in chain.iter().enumerate() {
            if out.iter().any(|d| d.path == *a) {
                continue;
            }
            // Ancestors setup only creates because something below needs them: 0755.
            let m = if i + 1 == chain.len() { mode } else { 0o755 };
            out.push(Dir {
                path: a.to_path_buf(),
                mode: m,
            });
        }
    };
    for d in &desired.dirs {
        add(&d.path, d.mode);
    }
    for f in &desired.files {
        if let Some(parent) = f.path.parent() {
            add(parent, 0o755);
        }
    }
    out
}

fn file_bytes(content: &Content) -> Result<Option<Vec<u8>>, SetupError> {
    Ok(match content {
        Content::Text(t) => Some(t.clone().into_bytes()),
        Content::Secret { text, .. } => Some(text.clone().into_bytes()),
        Content::Copy(from) => Some(std::fs::read(from).map_err(|e| SetupError::io(from, e))?),
        Content::Link(_) => None,
    })
}

fn found_at(path: &Path, file: &File) -> Result<Found, SetupError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Found::Missing),
        Err(e) => return Err(SetupError::io(path, e)),
    };
    Ok(match &file.content {
        Content::Link(target) => {
            if meta.file_type().is_symlink()
                && std::fs::read_link(path).ok().as_deref() == Some(target.as_path())
            {
                Found::Same
            } else {
                Found::Differs
            }
        }
        content => {
            if !meta.file_type().is_file() || meta.permissions().mode() & 0o7777 != file.mode {
                return Ok(Found::Differs);
            }
            let want = file_bytes(content)?.unwrap_or_default();
            let have = std::fs::read(path).map_err(|e| SetupError::io(path, e))?;
            if have == want {
                Found::Same
            } else {
                Found::Differs
            }
        }
    })
}

fn recorded_at(path: &Path, entry: &Entry) -> Recorded {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Recorded::Missing;
    };
    let unchanged = match entry {
        Entry::Link { target, .. } => {
            meta.file_type().is_symlink()
                && std::fs::read_link(path).ok().as_deref() == Some(target.as_path())
        }
        Entry::File { mode, sha256, .. } => {
            meta.file_type().is_file()
                && mode_text(meta.permissions().mode()) == *mode
                && std::fs::read(path).is_ok_and(|b| sha256_hex(&b) == *sha256)
        }
    };
    if unchanged {
        Recorded::Unchanged
    } else {
        Recorded::Changed
    }
}

/// Reads what is on disk under `root` at every path setup writes or wrote.
pub fn observe(
    root: &Path,
    desired: Option<&Desired>,
    previous: Option<&Manifest>,
) -> Result<Observed, SetupError> {
    let mut obs = Observed::default();
    if let Some(desired) = desired {
        for f in &desired.files {
            obs.files
                .insert(f.path.clone(), found_at(&under(root, &f.path), f)?);
        }
        for d in needed_dirs(desired) {
            if under(root, &d.path).is_dir() {
                obs.existing_dirs.insert(d.path);
            }
        }
    }
    for e in previous.iter().flat_map(|m| m.files.iter()) {
        obs.recorded.insert(
            e.path().to_path_buf(),
            recorded_at(&under(root, e.path()), e),
        );
    }
    Ok(obs)
}

/// The manifest entry of a file as it will be written.
pub fn entry_for(file: &File) -> Result<Entry, SetupError> {
    Ok(match &file.content {
        Content::Link(target) => Entry::Link {
            path: file.path.clone(),
            target: target.clone(),
        },
        content => Entry::File {
            path: file.path.clone(),
            mode: mode_text(file.mode),
            sha256: sha256_hex(&file_bytes(content)?.unwrap_or_default()),
        },
    })
}

fn is_unit(path: &Path) -> bool {
    path.parent() == Some(Path::new(UNIT_DIR))
}

/// Flags of `setup` that change what it decides.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flags {
    /// Overwrite files that are not setup's (keeping each as `<path>.kernelkite-orig`).
    pub replace: bool,
    /// Do not enable, start or restart the agents.
    pub no_start: bool,
}

/// What setup does to bring the node to `desired`.
pub fn decide(
    desired: &Desired,
    observed: &Observed,
    previous: Option<&Manifest>,
    node: &str,
    flags: Flags,
) -> Result<Actions, SetupError> {
    let empty = Manifest::default();
    let prev = previous.unwrap_or(&empty);
    let mut actions = Actions::default();

    let (entries, backups) = decide_files(desired, observed, prev, flags, &mut actions)?;
    decide_stale_files(desired, observed, prev, &mut actions);
    let created_dirs = decide_dirs(desired, observed, prev, &mut actions);

    // Units going away are stopped before their files go.
    let agent_units: Vec<String> = desired.agents.iter().map(|a| a.unit()).collect();
    let wanted_units: BTreeSet<&String> = agent_units.iter().chain(desired.units.iter()).collect();
    let going: Vec<String> = prev
        .enabled_units
        .iter()
        .filter(|u| !wanted_units.contains(u))
        .cloned()
        .collect();
    if !going.is_empty() {
        actions
            .before
            .push(Step::systemctl(&["disable", "--now"], &going));
    }

    let (created_job_user, added_groups) = decide_job_user(desired, observed, prev, &mut actions);

    let mut enabled = decide_units(desired, prev, &wanted_units, &mut actions);
    actions.after.push(Step::Doctor);
    actions.after.push(Step::Smoke);
    if !flags.no_start {
        start_agents(desired, &agent_units, &mut enabled, &mut actions);
    }

    actions.manifest = Some(Manifest {
        version: VERSION,
        node: node.to_string(),
        files: entries,
        created_dirs,
        backups,
        created_job_user,
        added_groups,
        enabled_units: enabled,
    });
    Ok(actions)
}

/// What to do with each wanted file; returns their manifest entries and the backups (the
/// previous ones and those of the files replaced now).
fn decide_files(
    desired: &Desired,
    observed: &Observed,
    prev: &Manifest,
    flags: Flags,
    actions: &mut Actions,
) -> Result<(Vec<Entry>, Vec<Backup>), SetupError> {
    let mut entries = Vec::new();
    let mut backups = prev.backups.clone();
    for f in &desired.files {
        let ours = prev.entry(&f.path).is_some();
        let action = match (observed.files.get(&f.path).copied(), ours) {
            (Some(Found::Same), _) => FileAction::Same,
            (Some(Found::Missing) | None, _) => FileAction::Create,
            (Some(Found::Differs), true) => FileAction::Update,
            (Some(Found::Differs), false) if flags.replace => FileAction::Replace,
            (Some(Found::Differs), false) => FileAction::Conflict,
        };
        if action == FileAction::Replace {
            backups.push(Backup {
                path: f.path.clone(),
                moved_to: PathBuf::from(format!("{}{BACKUP_SUFFIX}", f.path.display())),
            });
        }
        entries.push(entry_for(f)?);
        actions.files.push((f.clone(), action));
    }
    Ok((entries, backups))
}

/// What to do with the files setup wrote before and no longer wants: remove them, unless
/// someone changed them since.
fn decide_stale_files(
    desired: &Desired,
    observed: &Observed,
    prev: &Manifest,
    actions: &mut Actions,
) {
    let wanted: BTreeSet<&Path> = desired.files.iter().map(|f| f.path.as_path()).collect();
    for e in &prev.files {
        if wanted.contains(e.path()) {
            continue;
        }
        match observed.recorded.get(e.path()) {
            Some(Recorded::Unchanged) => actions
                .stale
                .push((e.path().to_path_buf(), StaleAction::Remove)),
            Some(Recorded::Changed) => actions
                .stale
                .push((e.path().to_path_buf(), StaleAction::KeepChanged)),
            Some(Recorded::Missing) | None => {}
        }
    }
}

/// The directories to make; returns every directory setup has made, for the manifest.
fn decide_dirs(
    desired: &Desired,
    observed: &Observed,
    prev: &Manifest,
    actions: &mut Actions,
) -> Vec<PathBuf> {
    let mut created_dirs = prev.created_dirs.clone();
    for d in needed_dirs(desired) {
        if !observed.existing_dirs.contains(&d.path) {
            if !created_dirs.contains(&d.path) {
                created_dirs.push(d.path.clone());
            }
            actions.mkdirs.push(d);
        }
    }
    created_dirs
}

/// The job user: created when missing, added to the device nodes' groups it lacks. Returns
/// whether setup created it and the groups setup added it to, for the manifest.
fn decide_job_user(
    desired: &Desired,
    observed: &Observed,
    prev: &Manifest,
    actions: &mut Actions,
) -> (bool, Vec<String>) {
    let mut created_job_user = prev.created_job_user;
    let mut added_groups = prev.added_groups.clone();
    if !observed.job_user_exists {
        actions.after.push(Step::Run(
            [
                "useradd",
                "--system",
                "--user-group",
                "--no-create-home",
                "--home-dir",
                "/nonexistent",
                "--shell",
                "/usr/sbin/nologin",
                "--comment",
                "kernelkite job sandbox",
                JOB_USER,
            ]
            .map(str::to_string)
            .to_vec(),
        ));
        created_job_user = true;
    }
    let missing_groups: Vec<String> = desired
        .job_user_groups
        .iter()
        .filter(|g| !observed.job_user_groups.contains(g))
        .cloned()
        .collect();
    if !missing_groups.is_empty() {
        actions.after.push(Step::Run(vec![
            "usermod".into(),
            "--append".into(),
            "--groups".into(),
            missing_groups.join(","),
            JOB_USER.into(),
        ]));
        if !created_job_user {
            for g in &missing_groups {
                if !added_groups.contains(g) {
                    added_groups.push(g.clone());
                }
            }
        }
    }
    (created_job_user, added_groups)
}

/// systemd's view of the units: reloaded when a unit file changed, the node's own units
/// (not the agents') enabled. Returns the units enabled after that.
fn decide_units(
    desired: &Desired,
    prev: &Manifest,
    wanted_units: &BTreeSet<&String>,
    actions: &mut Actions,
) -> Vec<String> {
    let units_changed = actions
        .files
        .iter()
        .any(|(f, a)| is_unit(&f.path) && *a != FileAction::Same)
        || actions
            .stale
            .iter()
            .any(|(p, a)| is_unit(p) && *a == StaleAction::Remove);
    if units_changed {
        actions.after.push(Step::systemctl(&["daemon-reload"], &[]));
    }
    let mut enabled: Vec<String> = prev
        .enabled_units
        .iter()
        .filter(|u| wanted_units.contains(u))
        .cloned()
        .collect();
    let new_units: Vec<String> = desired
        .units
        .iter()
        .filter(|u| !enabled.contains(u))
        .cloned()
        .collect();
    if !new_units.is_empty() {
        actions
            .after
            .push(Step::systemctl(&["enable", "--now"], &new_units));
        enabled.extend(new_units);
    }
    enabled
}

/// The agents: those running restarted when what they read changed, the others enabled and
/// started (and added to `enabled`).
fn start_agents(
    desired: &Desired,
    agent_units: &[String],
    enabled: &mut Vec<String>,
    actions: &mut Actions,
) {
    let changed = |p: &Path| {
        actions
            .files
            .iter()
            .any(|(f, a)| f.path == p && *a != FileAction::Same)
    };
    let start: Vec<String> = agent_units
        .iter()
        .filter(|u| !enabled.contains(u))
        .cloned()
        .collect();
    // A running agent reads its configuration, environment and unit only when it starts.
    let shared_changed = changed(Path::new(AGENT_ENV))
        || changed(&Path::new(UNIT_DIR).join(AGENT_UNIT))
        || changed(&Path::new(UNIT_DIR).join(SLICE_UNIT));
    let restart: Vec<String> = desired
        .agents
        .iter()
        .filter(|a| enabled.contains(&a.unit()))
        .filter(|a| shared_changed || changed(&a.config_path()))
        .map(|a| a.unit())
        .collect();
    if !restart.is_empty() {
        actions.after.push(Step::systemctl(&["restart"], &restart));
    }
    if !start.is_empty() {
        actions
            .after
            .push(Step::systemctl(&["enable", "--now"], &start));
        enabled.extend(start);
    }
}

/// What `--uninstall` does: undo exactly what the manifest records.
pub fn decide_uninstall(manifest: &Manifest, observed: &Observed) -> Actions {
    let mut actions = Actions::default();
    if !manifest.enabled_units.is_empty() {
        // Agents first: they were started last.
        let mut units = manifest.enabled_units.clone();
        units.reverse();
        actions
            .before
            .push(Step::systemctl(&["disable", "--now"], &units));
    }
    let mut units_removed = false;
    for e in manifest.files.iter().rev() {
        match observed.recorded.get(e.path()) {
            Some(Recorded::Unchanged) => {
                units_removed |= is_unit(e.path());
                actions
                    .stale
                    .push((e.path().to_path_buf(), StaleAction::Remove));
            }
            Some(Recorded::Changed) => actions
                .stale
                .push((e.path().to_path_buf(), StaleAction::KeepChanged)),
            Some(Recorded::Missing) | None => {}
        }
    }
    actions.restore = manifest.backups.clone();
    actions.rmdirs = manifest.created_dirs.iter().rev().cloned().collect();
    if units_removed {
        actions.after.push(Step::systemctl(&["daemon-reload"], &[]));
    }
    if manifest.created_job_user {
        actions
            .after
            .push(Step::Run(vec!["userdel".into(), JOB_USER.into()]));
    } else {
        for g in &manifest.added_groups {
            actions.after.push(Step::Run(vec![
                "gpasswd".into(),
                "--delete".into(),
                JOB_USER.into(),
                g.clone(),
            ]));
        }
    }
    actions
}

/// How [`execute`] treats commands and checks.
pub trait Runner {
    /// Runs a command; an error stops setup.
    fn run(&mut self, argv: &[String]) -> Result<(), SetupError>;
    /// Runs `doctor`; an error stops setup.
    fn doctor(&mut self) -> Result<(), SetupError>;
    /// Runs the smoke job; an error stops setup.
    fn smoke(&mut self) -> Result<(), SetupError>;
}

/// Records every step instead of running it (`--root`): they are printed with the plan.
#[derive(Debug, Default)]
pub struct Recorder {
    /// The steps, in order.
    pub steps: Vec<Step>,
}

impl Runner for Recorder {
    fn run(&mut self, argv: &[String]) -> Result<(), SetupError> {
        self.steps.push(Step::Run(argv.to_vec()));
        Ok(())
    }
    fn doctor(&mut self) -> Result<(), SetupError> {
        self.steps.push(Step::Doctor);
        Ok(())
    }
    fn smoke(&mut self) -> Result<(), SetupError> {
        self.steps.push(Step::Smoke);
        Ok(())
    }
}

fn run_steps(steps: &[Step], runner: &mut dyn Runner) -> Result<(), SetupError> {
    for s in steps {
        match s {
            Step::Run(argv) => runner.run(argv)?,
            Step::Doctor => runner.doctor()?,
            Step::Smoke => runner.smoke()?,
        }
    }
    Ok(())
}

fn write_file(root: &Path, file: &File) -> Result<(), SetupError> {
    let path = under(root, &file.path);
    match &file.content {
        Content::Link(target) => {
            // A new link beside it, renamed over: the hook is never missing.
            let tmp = path.with_file_name(format!(
                ".{}.kernelkite-new",
                path.file_name()
                    .map(|n| n.to_string_lossy())
                    .unwrap_or_default()
            ));
            let _ = std::fs::remove_file(&tmp);
            std::os::unix::fs::symlink(target, &tmp).map_err(|e| SetupError::io(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| SetupError::io(&path, e))
        }
        content => {
            let bytes = file_bytes(content)?.unwrap_or_default();
            // The temporary file is 0600 until it has its mode: a token is never world-readable.
            kernelkite_sys::fs::write_atomic(&path, &bytes, file.mode)
                .map_err(|e| SetupError::io(&path, e))
        }
    }
}

fn write_manifest(root: &Path, manifest: &Manifest) -> Result<(), SetupError> {
    let path = under(root, Path::new(MANIFEST));
    if std::fs::read_to_string(&path).is_ok_and(|t| t == manifest.to_text()) {
        return Ok(());
    }
    kernelkite_sys::fs::write_atomic(&path, manifest.to_text().as_bytes(), 0o600)
        .map_err(|e| SetupError::io(&path, e))
}

/// What [`execute`] could not undo (`--uninstall`): each a line for the operator.
pub type Leftovers = Vec<String>;

/// Applies `actions` under `root`, running commands through `runner`.
pub fn execute(
    root: &Path,
    actions: &Actions,
    previous: Option<&Manifest>,
    runner: &mut dyn Runner,
) -> Result<Leftovers, SetupError> {
    let conflicts = actions.conflicts();
    if !conflicts.is_empty() {
        return Err(SetupError::Conflicts(conflicts));
    }
    let mut leftovers = Vec::new();
    run_steps(&actions.before, runner)?;
    make_dirs(root, &actions.mkdirs)?;
    write_files(root, &actions.files)?;
    remove_stale(root, &actions.stale, &mut leftovers)?;
    restore_backups(root, &actions.restore, &mut leftovers)?;
    match &actions.manifest {
        Some(m) => write_manifest(root, &manifest_before_steps(m, previous))?,
        None => {
            let p = under(root, Path::new(MANIFEST));
            match std::fs::remove_file(&p) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(SetupError::io(&p, e)),
            }
        }
    }
    remove_dirs(root, &actions.rmdirs, &mut leftovers);
    run_steps(&actions.after, runner)?;
    if let Some(m) = &actions.manifest {
        write_manifest(root, m)?;
    }
    Ok(leftovers)
}

/// Makes the directories, each with its mode; one already there is left as it is.
fn make_dirs(root: &Path, dirs: &[Dir]) -> Result<(), SetupError> {
    for d in dirs {
        let p = under(root, &d.path);
        match std::fs::create_dir(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(SetupError::io(&p, e)),
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(d.mode))
            .map_err(|e| SetupError::io(&p, e))?;
    }
    Ok(())
}

/// Writes the files to create, update or replace (a replaced one moved aside first).
fn write_files(root: &Path, files: &[(File, FileAction)]) -> Result<(), SetupError> {
    for (f, action) in files {
        match action {
            FileAction::Same | FileAction::Conflict => continue,
            FileAction::Replace => {
                let p = under(root, &f.path);
                let moved = PathBuf::from(format!("{}{BACKUP_SUFFIX}", p.display()));
                if std::fs::symlink_metadata(&moved).is_ok() {
                    return Err(SetupError::Invalid(format!(
                        "{} already exists: move it away before --replace keeps {} there",
                        moved.display(),
                        f.path.display()
                    )));
                }
                std::fs::rename(&p, &moved).map_err(|e| SetupError::io(&p, e))?;
            }
            FileAction::Create | FileAction::Update => {}
        }
        write_file(root, f)?;
    }
    Ok(())
}

/// Removes the stale files; those changed since stay, with a line in `leftovers`.
fn remove_stale(
    root: &Path,
    stale: &[(PathBuf, StaleAction)],
    leftovers: &mut Leftovers,
) -> Result<(), SetupError> {
    for (path, action) in stale {
        let p = under(root, path);
        match action {
            StaleAction::Remove => std::fs::remove_file(&p).map_err(|e| SetupError::io(&p, e))?,
            StaleAction::KeepChanged => leftovers.push(format!(
                "{} was changed since setup wrote it: left in place",
                path.display()
            )),
        }
    }
    Ok(())
}

/// Puts the files `--replace` moved aside back, unless something took their place since.
fn restore_backups(
    root: &Path,
    restore: &[Backup],
    leftovers: &mut Leftovers,
) -> Result<(), SetupError> {
    for b in restore {
        let from = under(root, &b.moved_to);
        let to = under(root, &b.path);
        if std::fs::symlink_metadata(&to).is_ok() {
            leftovers.push(format!(
                "{} is still there, so {} was not put back",
                b.path.display(),
                b.moved_to.display()
            ));
        } else if std::fs::symlink_metadata(&from).is_ok() {
            std::fs::rename(&from, &to).map_err(|e| SetupError::io(&from, e))?;
        }
    }
    Ok(())
}

/// The manifest to write before the commands run: `m`'s files, with the state the commands
/// change (the job user, its groups, the enabled units) as it was, so that a command failing
/// does not leave a manifest claiming what it would have done.
fn manifest_before_steps(m: &Manifest, previous: Option<&Manifest>) -> Manifest {
    let mut now = m.clone();
    if let Some(p) = previous {
        now.created_job_user = p.created_job_user;
        now.added_groups = p.added_groups.clone();
        now.enabled_units = p
            .enabled_units
            .iter()
            .filter(|u| m.enabled_units.contains(u))
            .cloned()
            .collect();
    } else {
        now.created_job_user = false;
        now.added_groups.clear();
        now.enabled_units.clear();
    }
    now
}

/// Removes the directories setup made; one not empty stays, with a line in `leftovers`.
fn remove_dirs(root: &Path, rmdirs: &[PathBuf], leftovers: &mut Leftovers) {
    for d in rmdirs {
        let p = under(root, d);
        match std::fs::remove_dir(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => leftovers.push(format!(
                "{} is not empty: left in place (remove it by hand if nothing in it is needed)",
                d.display()
            )),
        }
    }
}
