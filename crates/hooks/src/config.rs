//! The plugin's configuration: the step's `kernelkite#...` block, as the agent hands it over in
//! `BUILDKITE_PLUGIN_CONFIGURATION` (JSON), parsed and checked against the same rules as the
//! JSON Schema in `plugin.yml`.
//!
//! serde reads the block (`deny_unknown_fields`, `serde_path_to_error` for the key a bad value
//! sits at), each key into a type that checks its value, so every message names the key and
//! says what would be accepted. Not a JSON Schema engine: the hook binary stays small and fast.
//! `tests/hooks/hooks_config.rs` checks that the keys here and in `plugin.yml` agree.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where the step's command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// On the agent's host, inside a per-job cgroup.
    #[default]
    Host,
    /// In a container started with only the job's GPU, CPUs and memory.
    Docker,
}

/// Clock locking requested before the command (NVIDIA only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind", content = "mhz")]
pub enum LockClocks {
    /// Lock the graphics clock at the GPU's maximum.
    Max,
    /// Lock the graphics clock at this many MHz.
    Mhz(u32),
}

/// Every key of the plugin's configuration, in `plugin.yml` order.
pub const KEYS: &[&str] = &[
    "gpus",
    "mode",
    "image",
    "network",
    "mount-checkout",
    "workdir",
    "environment",
    "docker-args",
    "memory",
    "cpus-per-gpu",
    "pids-limit",
    "require-idle-gpu",
    "idle-memory-mib",
    "lock-clocks",
    "lease-wait",
    "allow-unenforced",
    "user",
    "allow-root",
    "tmp-size",
    "shm-size",
    "allow-syscalls",
    "export-to-agent",
];

/// The account host mode runs the command as, unless the step names another
/// ([`kernelkite_sys::node::JOB_USER`]).
pub const DEFAULT_JOB_USER: &str = kernelkite_sys::node::JOB_USER;

/// The parsed configuration, with defaults filled in. Keys added later default when a state
/// file written by an older version is read back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PluginConfig {
    /// GPUs the job gets (each with its slice of CPUs and memory); `None` (the key left out):
    /// as many as the agent is bound to (`gpu-index`), else one. A given count must match
    /// the agent's binding. Left out of a state file when `None`, which an older binary reads
    /// as its default of one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpus: Option<u32>,
    /// Where the command runs.
    pub mode: Mode,
    /// Docker image (docker mode; required there). `auto` (`images::AUTO`) runs the runner
    /// image of the job's GPUs' vendor, chosen when the container starts (`images::step_image`).
    pub image: Option<String>,
    /// Whether the command may reach the network. `None`: the default, no (loopback only, in
    /// host and docker mode alike).
    pub network: Option<bool>,
    /// Docker mode: mount the checkout at `workdir`.
    pub mount_checkout: bool,
    /// Docker mode: where the checkout is mounted and the command runs.
    pub workdir: String,
    /// Further environment variable names the command gets (host mode: besides the sandbox's
    /// allow-list; docker mode: passed into the container).
    pub environment: Vec<String>,
    /// Docker mode: extra `docker run` arguments (ones that would undo isolation are refused).
    pub docker_args: Vec<String>,
    /// Memory limit in bytes; may only lower the slice's.
    pub memory_bytes: Option<u64>,
    /// CPUs per GPU; may only lower the slice's.
    pub cpus_per_gpu: Option<u32>,
    /// Most tasks (processes and threads) in the job.
    pub pids_limit: u32,
    /// Fail before the command unless the GPUs are idle.
    pub require_idle_gpu: bool,
    /// With `require-idle-gpu`: GPU memory already in use that still counts as idle.
    pub idle_memory_mib: u64,
    /// Lock the graphics clock before the command; reset in `pre-exit`.
    pub lock_clocks: Option<LockClocks>,
    /// Seconds to wait for a held GPU before failing.
    pub lease_wait_secs: u64,
    /// Run without cgroup enforcement when cgroups are not writable (loud warning).
    pub allow_unenforced: bool,
    /// Who the command runs as: a user name, a uid, or `uid:gid`.
    pub user: String,
    /// Whether `user` may be root (uid 0); refused otherwise.
    pub allow_root: bool,
    /// Size of the job's private `/tmp` (bytes); at most the job's memory limit, which is
    /// also the default (its pages are charged to the job's memory cgroup).
    pub tmp_size: Option<u64>,
    /// Size of the job's private `/dev/shm` (bytes; docker `--shm-size`); as `tmp_size`.
    pub shm_size: Option<u64>,
    /// System calls the sandbox's filter lets through for this step (only the names
    /// `sandbox::seccomp::opt_outs` lists: what a profiling or debugging task may need).
    pub allow_syscalls: Vec<String>,
    /// Also hand the slice's variables to the agent through its Job API, for hooks after
    /// `environment` that are not kernelkite's. kernelkite's `command` gives them to the
    /// command from the job's state either way; the agent's answer costs a job 4-5 ms.
    pub export_to_agent: bool,
}

impl Default for PluginConfig {
    fn default() -> Self {
        PluginConfig {
            gpus: None,
            mode: Mode::Host,
            image: None,
            network: None,
            mount_checkout: true,
            workdir: "/workdir".into(),
            environment: Vec::new(),
            docker_args: Vec::new(),
            memory_bytes: None,
            cpus_per_gpu: None,
            pids_limit: 4096,
            require_idle_gpu: false,
            idle_memory_mib: 1024,
            lock_clocks: None,
            lease_wait_secs: 300,
            allow_unenforced: false,
            user: DEFAULT_JOB_USER.into(),
            allow_root: false,
            tmp_size: None,
            shm_size: None,
            allow_syscalls: Vec::new(),
            export_to_agent: false,
        }
    }
}

impl PluginConfig {
    /// Whether the command may reach the network: only with `network: true`. A job on the
    /// host's network could reach the node's own services on loopback (the service's API: a
    /// job that submits jobs) and the outside world.
    pub fn network_allowed(&self) -> bool {
        self.network.unwrap_or(false)
    }
}

/// A configuration that does not match the schema; `key` is the JSON path.
#[derive(Debug, thiserror::Error)]
#[error("plugin configuration is invalid: {key}: {message}")]
pub struct ConfigError {
    /// Where: the key (`gpus`, `docker-args[0]`), or `(root)`.
    pub key: String,
    /// What is wrong and what would be accepted.
    pub message: String,
    /// The JSON parser's error, when the text is not JSON at all.
    #[source]
    pub source: Option<serde_json::Error>,
}

impl ConfigError {
    /// A key whose value breaks a rule.
    pub fn new(key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError {
            key: key.to_string(),
            message: message.into(),
            source: None,
        }
    }
}

fn bad(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::new(key, message)
}

/// `docker run` flags a step may not pass: each would undo a guarantee the plugin gives.
const FORBIDDEN_DOCKER_ARGS: &[&str] = &[
    "--gpus",
    "--privileged",
    "--cpuset-cpus",
    "--cpuset-mems",
    "--cpus",
    "--memory",
    "-m",
    "--memory-swap",
    "--pids-limit",
    "--network",
    "--net",
    "--device",
    "--cgroup-parent",
    "--cap-add",
    "--pid",
    "--ipc",
    "--userns",
    "--security-opt",
    "--runtime",
    "--volume",
    "-v",
    "--mount",
    // Lets the container open any matching device node it makes (CAP_MKNOD is a default
    // capability): another job's /dev/nvidia<N>.
    "--device-cgroup-rule",
    // Mounts another container's volumes.
    "--volumes-from",
    // `pre-exit` finds a lost container by the name the plugin gives it.
    "--name",
    // A file of variables could set NVIDIA_VISIBLE_DEVICES (see `sets_nvidia_variable`).
    "--env-file",
    // The plugin runs the container as the job's user, without capabilities, in a cgroup and
    // IPC namespace of its own, with a shared-memory size within the job's memory.
    "--user",
    "--group-add",
    "--cgroupns",
    "--shm-size",
];

/// Single-letter `docker run` flags that take a value (`-e X`, `-eX`); the rest of a
/// `-abc` cluster after one of these is its value.
const DOCKER_SHORT_WITH_VALUE: &str = "acehlpuw";
/// Single-letter boolean `docker run` flags, which may be clustered (`-it`).
const DOCKER_SHORT_BOOL: &str = "diPqt";

/// Whether an `--env`/`-e` value sets one of the NVIDIA container runtime's variables, which
/// decide which GPUs the runtime mounts into the container.
fn sets_nvidia_variable(value: &str) -> bool {
    value.trim_start().starts_with("NVIDIA_")
}

/// Why a `-xyz` argument is refused, if it is: docker reads `-v/:/host` as `-v /:/host`
/// and `-tv/:/host` as `-t -v /:/host`, so the cluster is walked letter by letter.
fn refused_short_cluster(arg: &str) -> Option<String> {
    let cluster = arg.strip_prefix('-').filter(|c| !c.starts_with('-'))?;
    for (i, c) in cluster.char_indices() {
        if c == 'v' || c == 'm' || c == 'u' {
            return Some(format!(
                "`-{c}` is set by the plugin from the job's slice and may not be overridden"
            ));
        }
        if DOCKER_SHORT_WITH_VALUE.contains(c) {
            let value = &cluster[i + c.len_utf8()..];
            if c == 'e' && sets_nvidia_variable(value) {
                return Some(
                    "NVIDIA_* variables pick the container's GPUs and may not be set".into(),
                );
            }
            return None;
        }
        if !DOCKER_SHORT_BOOL.contains(c) {
            return Some(format!(
                "`{arg}` is not a `docker run` flag the plugin can check; spell it out (`--flag=value`)"
            ));
        }
    }
    None
}

/// Parses a memory size: bytes as an integer, or a string with a binary suffix
/// (`512M`, `64G`, `64GiB`, `1T`).
pub fn parse_memory_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits_end);
    let n: u64 = num.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    n.checked_mul(1u64 << shift)
}

/// What a value is, in the words of the messages (`expected an integer, got string "two"`).
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The step's block as serde reads it: one field per key of `plugin.yml` (kebab-case), each of
/// a type that checks its value and says what would be accepted. `deny_unknown_fields` refuses
/// a misspelt key; `serde_path_to_error` names the key (`docker-args[0]`) in the error. Keys
/// are read in the order of the parsed map (sorted), so the first bad key is reported.
#[derive(Deserialize, Default)]
#[serde(rename_all = "kebab-case", deny_unknown_fields, default)]
struct Block {
    gpus: Key<Int<1, 16>>,
    mode: Key<ModeKey>,
    image: Key<Image>,
    network: Key<Flag>,
    mount_checkout: Key<Flag>,
    workdir: Key<Workdir>,
    environment: Key<List<VarName>>,
    docker_args: Key<List<DockerArg>>,
    memory: Key<Size>,
    cpus_per_gpu: Key<Int<1, 4096>>,
    pids_limit: Key<Int<16, 4_194_304>>,
    require_idle_gpu: Key<Flag>,
    idle_memory_mib: Key<Int<0, { 1 << 24 }>>,
    lock_clocks: Key<Clocks>,
    lease_wait: Key<Int<0, 86_400>>,
    allow_unenforced: Key<Flag>,
    user: Key<User>,
    allow_root: Key<Flag>,
    tmp_size: Key<Size>,
    shm_size: Key<Size>,
    allow_syscalls: Key<List<Syscall>>,
    export_to_agent: Key<Flag>,
}

/// A key that may be left out. Unlike `Option`, a `null` given for it is checked (and
/// refused) like any other value, rather than read as "left out".
struct Key<T>(Option<T>);

impl<T> Default for Key<T> {
    fn default() -> Self {
        Key(None)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Key<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        T::deserialize(d).map(|t| Key(Some(t)))
    }
}

/// A value checked by `$check` (`&Value` → the value, or what is wrong with it).
macro_rules! checked {
    ($(#[$doc:meta])* $name:ident($t:ty) = $check:expr) => {
        $(#[$doc])*
        struct $name($t);

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let check: fn(&Value) -> Result<$t, String> = $check;
                check(&value_of(d)?).map($name).map_err(serde::de::Error::custom)
            }
        }
    };
}

/// The value as the step wrote it. Not `Value::deserialize`: with serde_json's
/// `arbitrary_precision` (which the runner's build turns on in a workspace build), reading a
/// `Value` back from a `Value` turns `-0` into `0`, which the key's check would then accept.
/// Only a negative number, or that `-0`, reaches `visit_i64`; it stays negative here.
fn value_of<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Value, D::Error> {
    d.deserialize_any(ValueOf)
}

struct ValueOf;

impl<'de> serde::de::Visitor<'de> for ValueOf {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(b.into())
    }

    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(n.into())
    }

    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        // `-0` as a float keeps its sign and is no integer to `as_u64`, as it was not before.
        Ok(if n == 0 { (-0.0f64).into() } else { n.into() })
    }

    fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
        Ok(n.into())
    }

    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(s.into())
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Value, A::Error> {
        Value::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Value, A::Error> {
        Value::deserialize(serde::de::value::MapAccessDeserializer::new(map))
    }
}

/// An integer in `MIN..=MAX`.
struct Int<const MIN: u64, const MAX: u64>(u64);

impl<'de, const MIN: u64, const MAX: u64> Deserialize<'de> for Int<MIN, MAX> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = value_of(d)?;
        int(&v, MIN, MAX).map(Int).map_err(serde::de::Error::custom)
    }
}

fn int(v: &Value, min: u64, max: u64) -> Result<u64, String> {
    let n = v
        .as_u64()
        .ok_or_else(|| format!("expected an integer, got {} {v}", type_name(v)))?;
    if n < min || n > max {
        return Err(format!("must be between {min} and {max}, got {n}"));
    }
    Ok(n)
}

fn non_empty(v: &Value) -> Result<String, String> {
    match v {
        Value::String(s) if !s.trim().is_empty() => Ok(s.clone()),
        Value::String(_) => Err("must not be empty".into()),
        _ => Err(format!("expected a string, got {} {v}", type_name(v))),
    }
}

checked!(
    /// `true` or `false`.
    Flag(bool) = |v| {
        v.as_bool()
            .ok_or_else(|| format!("expected true or false, got {} {v}", type_name(v)))
    }
);

checked!(
    /// `host` or `docker`.
    ModeKey(Mode) = |v| match v.as_str() {
        Some("host") => Ok(Mode::Host),
        Some("docker") => Ok(Mode::Docker),
        _ => Err(format!("expected \"host\" or \"docker\", got {v}")),
    }
);

checked!(
    /// An image reference. It goes into `docker run`'s argument vector, where a leading `-`
    /// would be read as a flag (`--privileged`) instead of the image.
    Image(String) = |v| {
        let image = non_empty(v)?;
        if image.starts_with('-') || image.chars().any(char::is_whitespace) {
            return Err(format!(
                "expected an image reference like \"ghcr.io/org/image:tag\", got {image:?}"
            ));
        }
        Ok(image)
    }
);

checked!(
    /// An absolute path in the container.
    Workdir(String) = |v| {
        let w = non_empty(v)?;
        if !w.starts_with('/') {
            return Err(format!("must be an absolute path, got {w:?}"));
        }
        Ok(w)
    }
);

checked!(
    /// A memory size of at least 64 MiB ([`parse_memory_size`]).
    Size(u64) = |v| {
        let parsed = match v {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => parse_memory_size(s),
            _ => None,
        };
        match parsed {
            Some(n) if n >= 64 << 20 => Ok(n),
            Some(n) => Err(format!("{n} bytes is below the 64M minimum")),
            None => Err(format!(
                "expected a size like \"64G\", \"512M\" or a number of bytes, got {v}"
            )),
        }
    }
);

checked!(
    /// A user name as `useradd` accepts it (`kernelkite-job`), a uid (`1500`) or `uid:gid`.
    User(String) = |v| {
        let user = non_empty(v)?;
        if !is_user(&user) {
            return Err(format!(
                "expected a user name (\"{DEFAULT_JOB_USER}\"), a uid or \"uid:gid\", got {user:?}"
            ));
        }
        Ok(user)
    }
);

fn is_user(user: &str) -> bool {
    let numeric = |s: &str| !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit());
    match user.split_once(':') {
        Some((uid, gid)) => numeric(uid) && numeric(gid),
        None => {
            let name = user.strip_suffix('$').unwrap_or(user);
            numeric(user)
                || (name.len() <= 32
                    && name
                        .bytes()
                        .next()
                        .is_some_and(|b| b.is_ascii_lowercase() || b == b'_')
                    && name.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
                    }))
        }
    }
}

checked!(
    /// `true`/`"max"` (the GPU's maximum), `false` (none) or a clock in MHz.
    Clocks(Option<LockClocks>) = |v| match v {
        Value::Bool(false) => Ok(None),
        Value::Bool(true) => Ok(Some(LockClocks::Max)),
        Value::String(s) if s == "max" => Ok(Some(LockClocks::Max)),
        Value::Number(_) => Ok(Some(LockClocks::Mhz(int(v, 100, 10_000)? as u32))),
        _ => Err(format!(
            "expected true, false, \"max\" or a clock in MHz, got {} {v}",
            type_name(v)
        )),
    }
);

checked!(
    /// An environment variable's name.
    VarName(String) = |v| {
        let n = non_empty(v)?;
        if n.contains('=') || n.chars().any(char::is_whitespace) {
            return Err(format!("expected a variable name (no `=` or spaces), got {n:?}"));
        }
        Ok(n)
    }
);

checked!(
    /// One `docker run` argument that does not undo a guarantee of the plugin's (a value
    /// following `-e`/`--env` is checked with the whole list, in [`docker_env_pairs`]).
    DockerArg(String) = |v| {
        let arg = non_empty(v)?;
        let (flag, value) = match arg.split_once('=') {
            Some((f, v)) => (f, Some(v)),
            None => (arg.as_str(), None),
        };
        if FORBIDDEN_DOCKER_ARGS.contains(&flag) {
            return Err(format!(
                "`{flag}` is set by the plugin from the job's slice and may not be overridden"
            ));
        }
        if let Some(why) = refused_short_cluster(&arg) {
            return Err(why);
        }
        if flag == "--env" && value.is_some_and(sets_nvidia_variable) {
            return Err(NVIDIA_VARIABLES.into());
        }
        Ok(arg)
    }
);

const NVIDIA_VARIABLES: &str = "NVIDIA_* variables pick the container's GPUs and may not be set";

checked!(
    /// A system call the sandbox's filter may let through for a step (only the names
    /// `sandbox::seccomp::opt_outs` lists).
    Syscall(String) = |v| {
        let n = non_empty(v)?;
        let allowed = crate::sandbox::seccomp::opt_outs();
        if !allowed.contains(&n.as_str()) {
            return Err(format!(
                "{n:?} cannot be let through the sandbox's system-call filter; a step may allow only {}",
                allowed.join(", ")
            ));
        }
        Ok(n)
    }
);

/// A list of `T`, each element checked where it stands (`environment[2]`).
struct List<T>(Vec<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for List<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ListVisitor(std::marker::PhantomData))
    }
}

/// Reads a sequence element by element (so the path names the element); anything else is
/// refused with what it is.
struct ListVisitor<T>(std::marker::PhantomData<T>);

impl<T> ListVisitor<T> {
    fn not_a_list<E: serde::de::Error>(v: Value) -> Result<List<T>, E> {
        Err(E::custom(format!(
            "expected a list of strings, got {} {v}",
            type_name(&v)
        )))
    }
}

impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for ListVisitor<T> {
    type Value = List<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of strings")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<List<T>, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(List(items))
    }

    // Anything but a sequence is refused with what it is, read as `value_of` reads it.
    fn visit_unit<E: serde::de::Error>(self) -> Result<List<T>, E> {
        Self::not_a_list(ValueOf.visit_unit()?)
    }

    fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<List<T>, E> {
        Self::not_a_list(ValueOf.visit_bool(b)?)
    }

    fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<List<T>, E> {
        Self::not_a_list(ValueOf.visit_u64(n)?)
    }

    fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<List<T>, E> {
        Self::not_a_list(ValueOf.visit_i64(n)?)
    }

    fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<List<T>, E> {
        Self::not_a_list(ValueOf.visit_f64(n)?)
    }

    fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<List<T>, E> {
        Self::not_a_list(ValueOf.visit_str(s)?)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<List<T>, A::Error> {
        Self::not_a_list(ValueOf.visit_map(map)?)
    }
}

/// `-e NAME=V` / `--env NAME=V` as two items: the value may not set an NVIDIA_* variable.
/// The error is at the flag's item.
fn docker_env_pairs(args: &[String]) -> Result<(), ConfigError> {
    for (i, pair) in args.windows(2).enumerate() {
        if matches!(pair[0].as_str(), "--env" | "-e") && sets_nvidia_variable(&pair[1]) {
            return Err(bad(&format!("docker-args[{i}]"), NVIDIA_VARIABLES));
        }
    }
    Ok(())
}

/// Parses the configuration JSON (`BUILDKITE_PLUGIN_CONFIGURATION`); blank or `null` means all
/// defaults.
pub fn parse_config(json: &str) -> Result<PluginConfig, ConfigError> {
    if json.trim().is_empty() {
        return Ok(PluginConfig::default());
    }
    let value: Value = serde_json::from_str(json).map_err(|e| ConfigError {
        source: Some(e),
        ..bad("(root)", "not valid JSON")
    })?;
    parse_config_value(&value)
}

/// Like [`parse_config`], from an already parsed value.
// Long because one match arm per configuration key, each with its own bounds.
pub fn parse_config_value(value: &Value) -> Result<PluginConfig, ConfigError> {
    let block: Block = match value {
        Value::Null => return Ok(PluginConfig::default()),
        Value::Object(_) => serde_path_to_error::deserialize(value).map_err(block_error)?,
        other => {
            return Err(bad(
                "(root)",
                format!(
                    "expected a map of settings, got {} {other}",
                    type_name(other)
                ),
            ))
        }
    };
    let c = block.into_config();
    docker_env_pairs(&c.docker_args)?;
    check_mode(&c)?;
    Ok(c)
}

/// The key serde stopped at and what was wrong there; a misspelt key is named as itself.
fn block_error(e: serde_path_to_error::Error<serde_json::Error>) -> ConfigError {
    let message = e.inner().to_string();
    // serde's message for `deny_unknown_fields` is "unknown field `KEY`, expected one of ...".
    if let Some(unknown) = message
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split_once('`'))
        .map(|(key, _)| key)
    {
        return bad(
            unknown,
            format!("unknown key; allowed keys are: {}", KEYS.join(", ")),
        );
    }
    bad(&e.path().to_string(), message)
}

/// The keys that only make sense in one mode.
fn check_mode(c: &PluginConfig) -> Result<(), ConfigError> {
    if c.mode == Mode::Docker && c.image.is_none() {
        return Err(bad("image", "required when mode is \"docker\""));
    }
    if c.mode == Mode::Host {
        for (key, set) in [
            ("image", c.image.is_some()),
            ("docker-args", !c.docker_args.is_empty()),
        ] {
            if set {
                return Err(bad(
                    key,
                    "only applies to mode \"docker\"; set `mode: docker` or drop it",
                ));
            }
        }
    }
    Ok(())
}

impl Block {
    /// The configuration: what the step set, defaults for the rest.
    fn into_config(self) -> PluginConfig {
        let d = PluginConfig::default();
        PluginConfig {
            gpus: self.gpus.0.map(|n| n.0 as u32),
            mode: self.mode.0.map_or(d.mode, |m| m.0),
            image: self.image.0.map(|i| i.0),
            network: self.network.0.map(|f| f.0),
            mount_checkout: self.mount_checkout.0.map_or(d.mount_checkout, |f| f.0),
            workdir: self.workdir.0.map_or(d.workdir, |w| w.0),
            environment: self
                .environment
                .0
                .map_or(d.environment, |l| strings(l.0, |n| n.0)),
            docker_args: self
                .docker_args
                .0
                .map_or(d.docker_args, |l| strings(l.0, |a| a.0)),
            memory_bytes: self.memory.0.map(|s| s.0),
            cpus_per_gpu: self.cpus_per_gpu.0.map(|n| n.0 as u32),
            pids_limit: self.pids_limit.0.map_or(d.pids_limit, |n| n.0 as u32),
            require_idle_gpu: self.require_idle_gpu.0.map_or(d.require_idle_gpu, |f| f.0),
            idle_memory_mib: self.idle_memory_mib.0.map_or(d.idle_memory_mib, |n| n.0),
            lock_clocks: self.lock_clocks.0.and_then(|c| c.0),
            lease_wait_secs: self.lease_wait.0.map_or(d.lease_wait_secs, |n| n.0),
            allow_unenforced: self.allow_unenforced.0.map_or(d.allow_unenforced, |f| f.0),
            user: self.user.0.map_or(d.user, |u| u.0),
            allow_root: self.allow_root.0.map_or(d.allow_root, |f| f.0),
            tmp_size: self.tmp_size.0.map(|s| s.0),
            shm_size: self.shm_size.0.map(|s| s.0),
            allow_syscalls: self
                .allow_syscalls
                .0
                .map_or(d.allow_syscalls, |l| strings(l.0, |n| n.0)),
            export_to_agent: self.export_to_agent.0.map_or(d.export_to_agent, |f| f.0),
        }
    }
}

fn strings<T>(items: Vec<T>, f: fn(T) -> String) -> Vec<String> {
    items.into_iter().map(f).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_null_mean_defaults() {
        assert_eq!(parse_config("").unwrap(), PluginConfig::default());
        assert_eq!(parse_config("null").unwrap(), PluginConfig::default());
        assert_eq!(parse_config("{}").unwrap(), PluginConfig::default());
    }

    #[test]
    fn full_docker_config_parses() {
        let c = parse_config(
            r#"{"gpus":2,"mode":"docker","image":"ghcr.io/x/y:1","network":true,
                "memory":"64G","cpus-per-gpu":8,"pids-limit":1000,"require-idle-gpu":true,
                "idle-memory-mib":512,"lock-clocks":1410,"lease-wait":30,
                "environment":["HF_TOKEN"],"docker-args":["--tmpfs=/scratch"],"workdir":"/w",
                "mount-checkout":false,"allow-unenforced":true,"user":"eval","allow-root":false,
                "tmp-size":"1G","shm-size":"8G","export-to-agent":true}"#,
        )
        .unwrap();
        assert!(c.export_to_agent);
        assert!(!PluginConfig::default().export_to_agent);
        assert_eq!(c.gpus, Some(2));
        assert_eq!(c.mode, Mode::Docker);
        assert_eq!(c.memory_bytes, Some(64 << 30));
        assert_eq!(c.lock_clocks, Some(LockClocks::Mhz(1410)));
        assert_eq!(c.docker_args, vec!["--tmpfs=/scratch"]);
        assert!(c.network_allowed());
        assert_eq!(c.user, "eval");
        assert_eq!((c.tmp_size, c.shm_size), (Some(1 << 30), Some(8 << 30)));
    }

    #[test]
    fn the_job_user_is_a_name_a_uid_or_uid_gid() {
        assert_eq!(PluginConfig::default().user, DEFAULT_JOB_USER);
        assert!(!PluginConfig::default().allow_root);
        for ok in [
            "kernelkite-job",
            "_eval",
            "build$",
            "1500",
            "1500:1500",
            "root",
        ] {
            let json = serde_json::json!({ "user": ok });
            assert_eq!(parse_config(&json.to_string()).unwrap().user, ok);
        }
        for bad in ["", "Eval", "1500:", ":1", "a b", "-x", "../x", "a:b"] {
            let json = serde_json::json!({ "user": bad });
            let e = parse_config(&json.to_string()).unwrap_err();
            assert_eq!(e.key, "user", "{bad}");
        }
        assert_eq!(parse_config(r#"{"user":15}"#).unwrap_err().key, "user");
        assert_eq!(
            parse_config(r#"{"allow-root":"yes"}"#).unwrap_err().key,
            "allow-root"
        );
        assert_eq!(
            parse_config(r#"{"shm-size":"1M"}"#).unwrap_err().key,
            "shm-size"
        );
    }

    #[test]
    fn an_old_state_s_configuration_reads_back_with_the_new_defaults() {
        // Written by a version without `user`, `allow-root`, `tmp-size`, `shm-size` and
        // `export-to-agent`.
        let mut old = serde_json::to_value(PluginConfig::default()).unwrap();
        for k in [
            "user",
            "allow_root",
            "tmp_size",
            "shm_size",
            "export_to_agent",
        ] {
            old.as_object_mut().unwrap().remove(k);
        }
        let back: PluginConfig = serde_json::from_value(old).unwrap();
        assert_eq!(back, PluginConfig::default());
    }

    #[test]
    fn unknown_keys_and_wrong_types_name_the_key() {
        let e = parse_config(r#"{"gpu":1}"#).unwrap_err();
        assert_eq!(e.key, "gpu");
        assert!(e.to_string().contains("unknown key"), "{e}");
        let e = parse_config(r#"{"gpus":"two"}"#).unwrap_err();
        assert_eq!(e.key, "gpus");
        assert!(e.message.contains("expected an integer"), "{e}");
        let e = parse_config(r#"{"gpus":0}"#).unwrap_err();
        assert_eq!(e.key, "gpus");
        let e = parse_config(r#"{"mode":"vm"}"#).unwrap_err();
        assert_eq!(e.key, "mode");
        let e = parse_config(r#"{"memory":"lots"}"#).unwrap_err();
        assert_eq!(e.key, "memory");
        let e = parse_config(r#"[1]"#).unwrap_err();
        assert_eq!(e.key, "(root)");
        let e = parse_config(r#"{"environment":["A=B"]}"#).unwrap_err();
        assert_eq!(e.key, "environment[0]");
    }

    #[test]
    fn docker_needs_an_image_and_host_refuses_docker_keys() {
        assert_eq!(
            parse_config(r#"{"mode":"docker"}"#).unwrap_err().key,
            "image"
        );
        assert_eq!(parse_config(r#"{"image":"x"}"#).unwrap_err().key, "image");
        for image in ["--privileged", "-v", "ubuntu --privileged"] {
            let json = serde_json::json!({"mode": "docker", "image": image}).to_string();
            assert_eq!(parse_config(&json).unwrap_err().key, "image", "{image}");
        }
        // `auto` is kept as written: the job's slice decides the image when it starts.
        let c = parse_config(r#"{"mode":"docker","image":"auto"}"#).unwrap();
        assert_eq!(c.image.as_deref(), Some(crate::images::AUTO));
        assert_eq!(
            parse_config(r#"{"image":"auto"}"#).unwrap_err().key,
            "image",
            "host mode runs no image"
        );
    }

    #[test]
    fn isolation_breaking_docker_args_are_refused() {
        for arg in [
            "--gpus=all",
            "--privileged",
            "--network",
            "-v",
            "--memory-swap=-1",
            // Short flags with their value attached, alone or after boolean flags.
            "-v/:/host",
            "-tv/:/host",
            "-m64g",
            "--device-cgroup-rule=c 195:* rwm",
            "--volumes-from=other",
            "--name=mine",
            "--env-file=/tmp/e",
            "--env=NVIDIA_VISIBLE_DEVICES=all",
            "-eNVIDIA_VISIBLE_DEVICES=all",
            "-Z",
            // The plugin picks the container's user, groups, cgroup namespace and /dev/shm.
            "--user=0",
            "-u0",
            "-tu0",
            "--group-add=disk",
            "--cgroupns=host",
            "--shm-size=8g",
        ] {
            let json = serde_json::json!({"mode":"docker","image":"x","docker-args":[arg]});
            let e = parse_config(&json.to_string()).unwrap_err();
            assert_eq!(e.key, "docker-args[0]", "{arg}");
        }
        let e = parse_config(
            r#"{"mode":"docker","image":"x","docker-args":["-e","NVIDIA_VISIBLE_DEVICES=all"]}"#,
        )
        .unwrap_err();
        assert_eq!(e.key, "docker-args[0]");
        // Harmless flags still pass, including values that merely contain a `v`, `m` or `u`.
        let ok = parse_config(
            r#"{"mode":"docker","image":"x","docker-args":["-it","-eVERBOSE=1","--env","MODE=v","--tmpfs=/x","-evm"]}"#,
        )
        .unwrap();
        assert_eq!(ok.docker_args.len(), 6);
    }

    #[test]
    fn the_network_is_off_unless_the_step_asks() {
        assert!(!PluginConfig::default().network_allowed());
        let c = parse_config(r#"{"mode":"docker","image":"x"}"#).unwrap();
        assert!(!c.network_allowed());
        assert!(parse_config(r#"{"network":true}"#)
            .unwrap()
            .network_allowed());
    }

    #[test]
    fn only_listed_system_calls_may_be_let_through() {
        let c = parse_config(r#"{"allow-syscalls":["ptrace"]}"#).unwrap();
        assert_eq!(c.allow_syscalls, ["ptrace"]);
        let e = parse_config(r#"{"allow-syscalls":["ptrace","unshare"]}"#).unwrap_err();
        assert_eq!(e.key, "allow-syscalls[1]");
        assert!(e.message.contains("perf_event_open, ptrace"), "{e}");
    }

    #[test]
    fn every_key_is_read_and_a_null_is_checked_not_taken_for_absent() {
        for key in KEYS {
            let e = parse_config(&serde_json::json!({ *key: {"x": 1} }).to_string()).unwrap_err();
            assert_eq!(e.key, *key);
            assert!(!e.message.contains("unknown key"), "{e}");
            let e = parse_config(&serde_json::json!({ *key: null }).to_string()).unwrap_err();
            assert_eq!(e.key, *key, "null is not \"left out\"");
        }
        // `-0` is no integer, however serde_json is built (`arbitrary_precision` or not).
        for key in [
            "gpus",
            "lease-wait",
            "idle-memory-mib",
            "memory",
            "lock-clocks",
        ] {
            let e = parse_config(&format!(r#"{{"{key}": -0}}"#)).unwrap_err();
            assert_eq!(e.key, key);
        }
        let e = parse_config(r#"{"environment":{"A":1}}"#).unwrap_err();
        assert_eq!(
            e.message,
            r#"expected a list of strings, got object {"A":1}"#
        );
        let e = parse_config(r#"{"gpus":1,"zz":2}"#).unwrap_err();
        assert_eq!(
            (
                e.key.as_str(),
                e.message
                    .starts_with("unknown key; allowed keys are: gpus, mode")
            ),
            ("zz", true)
        );
    }

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_memory_size("512M"), Some(512 << 20));
        assert_eq!(parse_memory_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_memory_size("1024"), Some(1024));
        assert_eq!(parse_memory_size("1.5G"), None);
        assert_eq!(parse_memory_size("99999999999T"), None);
    }
}
