//! The command's environment inside the sandbox: an allow-list, not a deny-list. The agent's
//! (or, in local mode, the service's) whole environment reaches the hooks, credentials
//! included (a node's `AWS_SECRET_ACCESS_KEY`, the service's `BUILDKITE_API_TOKEN`); the
//! command gets only what a kernelbot evaluation needs, plus what the step names in
//! `environment`. Its own `/proc/<pid>/environ` is all a job can read of any environment: the
//! hooks' processes are outside its PID namespace.

use std::collections::BTreeMap;

use kernelkite_sys::identity::SUBMISSION_USER_ENV;

use super::user::JobUser;

/// Names passed through when the job has them.
pub const NAMES: &[&str] = &[
    // The shell's and every runtime's basics.
    "PATH",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    // Which GPUs the job sees (exported by `environment`).
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    // The slice as JSON (exported by `environment`).
    "KERNELKITE_SLICE",
    // The runner's settings that a node or the local service sets (runner/README.md; the
    // service passes the same ones to its hooks, service/src/local/hooks.rs).
    "KERNELKITE_PYTHON",
    "KERNELKITE_NVCC",
    "KERNELKITE_REQUIRE_GPU",
    "KERNELKITE_TORCH_PROBE",
    // The job's identity, as Buildkite documents these variables; none is a credential.
    "BUILDKITE",
    "CI",
    "BUILDKITE_JOB_ID",
    "BUILDKITE_BUILD_ID",
    "BUILDKITE_BUILD_NUMBER",
    "BUILDKITE_BUILD_CHECKOUT_PATH",
    "BUILDKITE_ORGANIZATION_SLUG",
    "BUILDKITE_PIPELINE_SLUG",
    "BUILDKITE_STEP_KEY",
    "BUILDKITE_LABEL",
    "BUILDKITE_BRANCH",
    "BUILDKITE_COMMIT",
    "BUILDKITE_AGENT_NAME",
    "BUILDKITE_RETRY_COUNT",
    "BUILDKITE_PARALLEL_JOB",
    "BUILDKITE_PARALLEL_JOB_COUNT",
];

/// Prefixes passed through: kernelbot's run (`KERNELBOT_PAYLOAD`, `KERNELBOT_RUN_ID`,
/// `KERNELBOT_GPU_INDEX`, ...), its harness protocol, and the locale.
pub const PREFIXES: &[&str] = &["KERNELBOT_", "POPCORN_", "LC_"];

/// Never passed, even when a step lists them: the agent's credentials and Job API (whose
/// socket is hidden anyway), and the NVIDIA runtime's own variables beyond the visible devices.
pub fn withheld(name: &str) -> bool {
    name == "BUILDKITE_AGENT_ACCESS_TOKEN" || name.starts_with("BUILDKITE_AGENT_JOB_API_")
}

/// Whether the command gets `name`: on the allow-list, or named by the step's `environment`.
pub fn passed(name: &str, extra: &[String]) -> bool {
    !withheld(name)
        && (NAMES.contains(&name)
            || PREFIXES.iter().any(|p| name.starts_with(p))
            || extra.iter().any(|e| e == name))
}

/// The command's environment: the allowed part of the job's, with `HOME` (the job user's own
/// directory, `mounts::JOB_HOME`) and `TMPDIR` in the private `/tmp` (the job user has no home)
/// and `USER`/`LOGNAME` naming it.
///
/// `submission` is the identity the evaluator is to run the submission as, named in
/// `KERNELKITE_SUBMISSION_USER` (`kernelkite_sys::identity`); only the sandbox sets that
/// variable, whatever the job's environment or the step's list says.
pub fn job_env(
    env: &BTreeMap<String, String>,
    user: &JobUser,
    submission: Option<&JobUser>,
    extra: &[String],
) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = env
        .iter()
        .filter(|(k, _)| passed(k, extra) && k.as_str() != SUBMISSION_USER_ENV)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    out.insert("HOME".into(), super::mounts::JOB_HOME.into());
    out.insert("TMPDIR".into(), "/tmp".into());
    out.insert("USER".into(), user.name.clone());
    out.insert("LOGNAME".into(), user.name.clone());
    if let Some(s) = submission {
        let ids = kernelkite_sys::identity::Ids {
            uid: s.uid,
            gid: s.gid,
        };
        out.insert(SUBMISSION_USER_ENV.into(), ids.to_env());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user() -> JobUser {
        JobUser::example()
    }

    #[test]
    fn the_command_gets_the_allow_list_and_nothing_else() {
        let env: BTreeMap<String, String> = [
            ("AWS_SECRET_ACCESS_KEY", "s3"),
            ("BUILDKITE_AGENT_ACCESS_TOKEN", "secret"),
            ("BUILDKITE_AGENT_JOB_API_SOCKET", "/s"),
            ("BUILDKITE_AGENT_JOB_API_TOKEN", "t"),
            ("BUILDKITE_API_TOKEN", "service's"),
            ("KERNELKITE_API_TOKEN", "service's"),
            ("KERNELKITE_CALLBACK_SECRET", "service's"),
            ("BUILDKITE_JOB_ID", "j"),
            ("HOME", "/root"),
            ("KERNELBOT_PAYLOAD", "p"),
            ("LC_ALL", "C.UTF-8"),
            ("PATH", "/usr/bin"),
            ("CUDA_VISIBLE_DEVICES", "GPU-1"),
            ("MY_SETTING", "x"),
            ("SSH_AUTH_SOCK", "/run/ssh"),
            ("KERNELKITE_SUBMISSION_USER", "0:0"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let e = job_env(
            &env,
            &user(),
            None,
            &["MY_SETTING".into(), "KERNELKITE_SUBMISSION_USER".into()],
        );
        let keys: Vec<&str> = e.keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "BUILDKITE_JOB_ID",
                "CUDA_VISIBLE_DEVICES",
                "HOME",
                "KERNELBOT_PAYLOAD",
                "LC_ALL",
                "LOGNAME",
                "MY_SETTING",
                "PATH",
                "TMPDIR",
                "USER"
            ]
        );
        assert_eq!(e["HOME"], "/tmp/.kernelkite-home");
        assert_eq!(e["USER"], "kernelkite-job");
        // A step cannot list its way to the agent's token.
        let e = job_env(
            &env,
            &user(),
            None,
            &["BUILDKITE_AGENT_ACCESS_TOKEN".into()],
        );
        assert!(!e.contains_key("BUILDKITE_AGENT_ACCESS_TOKEN"));
        // The submission's identity is the sandbox's word only.
        let submission = JobUser {
            name: "kernelkite-submission-3".into(),
            uid: 1_960_000_003,
            gid: 1_960_000_003,
        };
        let e = job_env(&env, &user(), Some(&submission), &[]);
        assert_eq!(e["KERNELKITE_SUBMISSION_USER"], "1960000003:1960000003");
    }
}
