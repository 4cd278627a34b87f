//! What `deployment/` ships, checked against what it configures: the pipelines' plugin
//! blocks against the plugin's own parser and their retry rules against the runner's exit
//! codes; the service's unit with `systemd-analyze verify`, its compose file and environment
//! against the service's settings; the Dockerfiles' shape (multi-stage, no toolchain in the
//! final stage, pinned versions). The images themselves are built by scripts/test.sh where a
//! Docker daemon runs, and linted by `lint.rs` with hadolint.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kernelkite_hooks::config::{parse_config_value, Mode};
use kernelkite_hooks::images;
use serde_json::{json, Value};

use crate::systemd;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn yaml(rel: &str) -> Value {
    let v: serde_norway::Value =
        serde_norway::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel} is not YAML: {e}"));
    serde_json::to_value(v).unwrap()
}

/// The pipeline's one step, and the configuration of the plugin in it.
fn step_and_plugin(rel: &str) -> (Value, Value) {
    let p = yaml(rel);
    let steps = p["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 1, "{rel}: one step per submission");
    let step = steps[0].clone();
    let plugins = step["plugins"].as_array().expect("plugins");
    assert_eq!(plugins.len(), 1, "{rel}");
    let (reference, config) = plugins[0].as_object().unwrap().iter().next().unwrap();
    assert!(
        reference.starts_with("github.com/kernelkite/kernelkite/plugin#v"),
        "{rel}: {reference}"
    );
    let config = config.clone();
    (step, config)
}

#[test]
fn the_pipelines_configure_the_plugin_with_keys_it_accepts() {
    for (rel, mode) in [
        ("deployment/pipelines/host.yml", Mode::Host),
        ("deployment/pipelines/docker.yml", Mode::Docker),
    ] {
        let (step, config) = step_and_plugin(rel);
        let parsed =
            parse_config_value(&config).unwrap_or_else(|e| panic!("{rel} is misconfigured: {e}"));
        assert_eq!(parsed.mode, mode, "{rel}");
        // One pipeline for every queue: the agent's binding decides the GPU count (one on a
        // per-slice agent, the group on a multi-GPU queue's agent).
        assert_eq!(parsed.gpus, None, "{rel}");
        assert!(
            !parsed.network_allowed(),
            "{rel}: submissions get no network"
        );
        assert_eq!(
            step["command"], "kernelkite-runner --output result.json",
            "{rel}"
        );
        assert_eq!(
            step["artifact_paths"], "result.json;provenance.json",
            "{rel}: the service fetches these paths (the runner writes both in the checkout)"
        );
        // Interpolated by the pipeline agent's `pipeline upload` (settings.yml), with the
        // build's env; a build without a queue fails its upload rather than running anywhere.
        assert_eq!(
            step["agents"]["queue"], "${KERNELBOT_QUEUE?the build names no KERNELBOT_QUEUE}",
            "{rel}"
        );
    }
}

#[test]
fn the_pipelines_retry_only_infrastructure_failures_and_lost_agents() {
    // Exit 3 is the node's fault: the runner's infrastructure failure (runner/README.md) and
    // the environment hook's refusal of a node with another runner; a cancelled job ends -1
    // with signal_reason "cancel". -1 without a reason is a lost agent; -1 with agent_stop a
    // stopped one (Buildkite's default exit status, `*`, is 1 to 255 only). Nothing else: a
    // bad payload (2) or a failing submission must not rerun.
    assert_eq!(kernelkite_sys::node::EXIT_NODE_FAULT, 3);
    let src = read("runner/src/cli.rs");
    assert!(
        src.contains("pub const EXIT_INFRASTRUCTURE: u8 = kernelkite_sys::node::EXIT_NODE_FAULT;"),
        "the runner's infrastructure exit code moved"
    );
    let want = json!({"automatic": [
        {"exit_status": 3, "signal_reason": "none", "limit": 2},
        {"exit_status": -1, "signal_reason": "none", "limit": 2},
        {"exit_status": -1, "signal_reason": "agent_stop", "limit": 2},
    ]});
    for rel in [
        "deployment/pipelines/host.yml",
        "deployment/pipelines/docker.yml",
    ] {
        let (step, _) = step_and_plugin(rel);
        assert_eq!(step["retry"], want, "{rel}");
        assert!(
            step["timeout_in_minutes"].as_u64().is_some_and(|m| m <= 30),
            "{rel}"
        );
    }
}

#[test]
fn the_docker_pipeline_runs_the_image_the_dockerfile_builds() {
    let (_, config) = step_and_plugin("deployment/pipelines/docker.yml");
    let image = config["image"].as_str().unwrap();
    // `auto`: the runner image of each job's GPUs, so every runner image is one it may run.
    let images: Vec<&str> = if image == images::AUTO {
        images::ALL.iter().map(|i| i.reference).collect()
    } else {
        vec![image]
    };
    for image in images {
        assert!(
            images::ALL
                .iter()
                .any(|i| i.reference == image
                    && read(i.dockerfile).contains(&format!("-t {image} ."))),
            "no Dockerfile's build command tags {image}"
        );
    }
}

#[test]
fn the_runner_images_are_the_ones_their_dockerfiles_build() {
    // The names in `images` (what `image: auto` runs and `doctor` names) against the build
    // command in each Dockerfile's header, the requirements it installs, and the deployment
    // README's build commands.
    let readme = read("deployment/README.md");
    for image in &images::ALL {
        let build = format!(
            "docker build -f {} -t {} .",
            image.dockerfile, image.reference
        );
        let dockerfile = read(image.dockerfile);
        let header: String = dockerfile
            .lines()
            .take_while(|l| l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            header.contains(&format!("#   {build}")),
            "{}'s header does not build {}: {header}",
            image.dockerfile,
            image.reference
        );
        assert!(
            dockerfile.contains(&format!("COPY {} requirements.txt", image.requirements)),
            "{} does not install {}",
            image.dockerfile,
            image.requirements
        );
        assert!(
            readme.contains(&build),
            "deployment/README.md does not show `{build}`"
        );
    }
    assert_eq!(
        images::for_vendor(images::AMD.vendor).reference,
        "ghcr.io/kernelkite/runner-rocm:0.1.0"
    );
}

/// The `FROM` lines of a Dockerfile and what follows each, by stage.
fn stages(dockerfile: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in dockerfile.lines() {
        if let Some(from) = line.strip_prefix("FROM ") {
            out.push((from.to_string(), String::new()));
        } else if let Some(last) = out.last_mut() {
            last.1.push_str(line);
            last.1.push('\n');
        }
    }
    out
}

#[test]
fn the_dockerfiles_build_in_one_stage_and_ship_without_a_toolchain() {
    for (rel, binary) in [
        ("deployment/runner/Dockerfile", "kernelkite-runner"),
        ("deployment/runner/Dockerfile.rocm", "kernelkite-runner"),
        ("deployment/service/Dockerfile", "kernelkite-service"),
    ] {
        let text = read(rel);
        let s = stages(&text);
        assert_eq!(s.len(), 2, "{rel}: a build stage and the final one");
        assert!(
            s[0].0.starts_with("rust:${RUST_VERSION}-") && s[0].0.ends_with(" AS build"),
            "{rel}"
        );
        assert!(
            s[0].1
                .contains(&format!("cargo build --release --locked -p {binary}")),
            "{rel}"
        );
        let (base, final_stage) = &s[1];
        assert!(
            !base.contains("rust"),
            "{rel}: the final stage is based on {base}"
        );
        let tag = base.rsplit(':').next().unwrap();
        assert!(
            base.contains(':') && tag != "latest",
            "{rel}: {base} is not pinned"
        );
        for tool in ["cargo", "rustc", "rustup"] {
            assert!(
                !final_stage.contains(tool),
                "{rel}: {tool} in the final stage"
            );
        }
        assert!(
            final_stage.contains(&format!(
                "COPY --from=build /usr/local/bin/{binary} /usr/local/bin/{binary}"
            )),
            "{rel}"
        );
        let version = text
            .lines()
            .find_map(|l| l.strip_prefix("ARG RUST_VERSION="))
            .unwrap();
        let (major, minor): (u32, u32) = {
            let mut p = version.split('.');
            (
                p.next().unwrap().parse().unwrap(),
                p.next().unwrap().parse().unwrap(),
            )
        };
        assert!(
            (major, minor) >= (1, 89),
            "{rel}: Rust {version} is older than the workspace's rust-version"
        );
    }
    let ignore = read(".dockerignore");
    assert!(
        ignore.lines().any(|l| l == "target"),
        "the build context must not carry target/"
    );
}

/// A requirements file's index options and its pins (name, lower-case, to version).
fn pins(rel: &str) -> (Vec<String>, BTreeMap<String, String>) {
    let mut options = Vec::new();
    let mut pins = BTreeMap::new();
    for line in read(rel)
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        if line.starts_with("--") {
            assert!(
                line.starts_with("--extra-index-url https://download.pytorch.org/"),
                "{rel}: {line}"
            );
            options.push(line.to_string());
            continue;
        }
        let (name, version) = line
            .split_once("==")
            .unwrap_or_else(|| panic!("{rel}: {line:?} is not pinned with =="));
        assert!(
            !version.is_empty() && !version.contains(['*', '>', '<', ',']),
            "{rel}: {line}"
        );
        let old = pins.insert(name.to_ascii_lowercase(), version.to_string());
        assert!(old.is_none(), "{rel}: {name} twice");
    }
    (options, pins)
}

#[test]
fn the_runner_images_pin_every_python_dependency() {
    let (cuda_index, cuda) = pins("deployment/runner/requirements.txt");
    let (rocm_index, rocm) = pins("deployment/runner/requirements-rocm.txt");
    for (rel, pins, needed) in [
        ("requirements.txt", &cuda, ["torch", "triton", "numpy"]),
        (
            "requirements-rocm.txt",
            &rocm,
            ["torch", "pytorch-triton-rocm", "numpy"],
        ),
    ] {
        for needed in needed {
            assert!(pins.contains_key(needed), "{needed} is missing from {rel}");
        }
    }
    // The same torch, built for CUDA 12.8 and for ROCm 6.3, each from its own index; the
    // ROCm build brings its own Triton (the `triton` module), so PyPI's must not join it.
    assert_eq!(
        cuda_index,
        ["--extra-index-url https://download.pytorch.org/whl/cu128"]
    );
    assert_eq!(
        rocm_index,
        ["--extra-index-url https://download.pytorch.org/whl/rocm6.3"]
    );
    let torch = |pins: &BTreeMap<String, String>, local: &str| {
        let v = &pins["torch"];
        v.strip_suffix(local)
            .unwrap_or_else(|| panic!("torch {v} is not the +{local} build"))
            .strip_suffix('+')
            .unwrap_or_else(|| panic!("torch {v}"))
            .to_string()
    };
    assert_eq!(torch(&cuda, "cu128"), torch(&rocm, "rocm6.3"));
    assert!(!rocm.contains_key("triton"));
    assert_eq!(cuda["triton"], rocm["pytorch-triton-rocm"]);
    // Everything else pinned exactly alike.
    let rest = |pins: &BTreeMap<String, String>| {
        let mut p = pins.clone();
        for k in ["torch", "triton", "pytorch-triton-rocm"] {
            p.remove(k);
        }
        p
    };
    assert_eq!(rest(&cuda), rest(&rocm));

    for (rel, compiler) in [
        ("deployment/runner/Dockerfile", "FROM nvidia/cuda:"),
        ("deployment/runner/Dockerfile.rocm", "FROM rocm/dev-ubuntu-"),
    ] {
        let dockerfile = read(rel);
        assert!(
            dockerfile.contains("-r requirements.txt") && dockerfile.contains("pip=="),
            "{rel}: pip itself is pinned too"
        );
        assert!(dockerfile.contains("KERNELKITE_REQUIRE_GPU=1"), "{rel}");
        assert!(
            dockerfile.lines().any(|l| l.starts_with(compiler)),
            "{rel}: submissions need the vendor's compiler (nvcc, hipcc): a {compiler}... image"
        );
    }
    assert!(
        read("deployment/runner/Dockerfile").contains("devel"),
        "CUDA submissions need nvcc: the CUDA devel image"
    );
}

/// The runner version the pipeline agent signs into every step (the nodes refuse a job on
/// another runner) is this release's, which is also the service's default
/// `KERNELKITE_RUNNER_VERSION`, and its command hook gives that setting, never the build's, to
/// the upload.
#[test]
fn the_pipeline_agent_expects_this_release_s_runner_and_no_build_chooses_it() {
    let c = yaml("deployment/service/compose.yaml");
    assert_eq!(
        c["services"]["pipeline-agent"]["environment"]["KERNELKITE_RUNNER_VERSION"],
        env!("CARGO_PKG_VERSION")
    );
    let hook = read("deployment/service/pipeline-agent/hooks/command");
    assert!(
        hook.lines().any(|l| l.starts_with(
            "KERNELBOT_RUNNER_VERSION=\"${KERNELKITE_RUNNER_VERSION:-}\" buildkite-agent pipeline upload"
        )),
        "{hook}"
    );
    for p in [
        "deployment/pipelines/host.yml",
        "deployment/pipelines/docker.yml",
    ] {
        assert!(
            read(p).contains("KERNELBOT_SIGNED_RUNNER_VERSION: \"${KERNELBOT_RUNNER_VERSION:-}\""),
            "{p}"
        );
    }
}

#[test]
fn the_compose_file_keeps_the_data_dir_on_a_volume_and_reads_service_env() {
    let c = yaml("deployment/service/compose.yaml");
    let svc = &c["services"]["service"];
    let data_dir = svc["environment"]["KERNELKITE_DATA_DIR"].as_str().unwrap();
    assert!(
        svc["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v.as_str() == Some(&format!("data:{data_dir}"))),
        "the data dir {data_dir} is not on the volume"
    );
    assert!(c["volumes"].get("data").is_some());
    assert_eq!(svc["env_file"], "service.env");
    assert_eq!(svc["build"]["dockerfile"], "deployment/service/Dockerfile");
    assert_eq!(svc["read_only"], true);
    let dockerfile = read("deployment/service/Dockerfile");
    assert!(
        dockerfile.contains(&format!("VOLUME [\"{data_dir}\"]")),
        "the image declares the same volume"
    );
    // The pipeline agent runs the settings step (pipelines/settings.yml) on its queue, with
    // plugins and repository hooks refused (tests/tests/real_agent_node.rs runs a real agent
    // with this environment).
    let agent = &c["services"]["pipeline-agent"];
    let settings = yaml("deployment/pipelines/settings.yml");
    let queue = settings["steps"][0]["agents"]["queue"].as_str().unwrap();
    assert_eq!(
        agent["environment"]["BUILDKITE_AGENT_TAGS"],
        format!("queue={queue}")
    );
    assert_eq!(agent["environment"]["BUILDKITE_NO_PLUGINS"], "true");
    assert_eq!(agent["environment"]["BUILDKITE_NO_LOCAL_HOOKS"], "true");
    assert_eq!(agent["env_file"], "pipeline-agent.env");
}

/// The fail-over deployment: two replicas on PostgreSQL (no disk), each what the service
/// reads, behind haproxy spreading requests over those whose `/readyz` answers (the shipped
/// file runs under the real haproxy in `the_shipped_haproxy_config_spreads_over_replicas_through_a_kill_and_a_freeze`); and the
/// Procfile's web process, a replica, so a platform may run several.
#[test]
fn the_ha_compose_file_runs_replicas_behind_a_health_checked_balancer() {
    let c = yaml("deployment/service/compose.ha.yaml");
    let known = service_variables();
    let haproxy = read("deployment/service/haproxy.cfg");
    assert!(haproxy.contains("option httpchk GET /readyz"), "{haproxy}");
    assert!(
        read("deployment/service/Dockerfile").contains("KERNELKITE_DATA_DIR="),
        "the image names a data dir, which the replicas unset"
    );
    for name in ["replica-a", "replica-b"] {
        let r = &c["services"][name];
        assert_eq!(r["environment"]["KERNELKITE_REPLICA"], "true", "{name}");
        for k in r["environment"].as_object().unwrap().keys() {
            assert!(
                known.contains(k),
                "{name} sets {k}, which the service does not read"
            );
        }
        let entry: Vec<&str> = r["entrypoint"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert_eq!(
            entry,
            [
                "/usr/bin/env",
                "-u",
                "KERNELKITE_DATA_DIR",
                "/usr/local/bin/kernelkite-service"
            ],
            "{name}: both stores named is refused (TwoStores)"
        );
        assert_eq!(r["command"][0], "serve");
        assert_eq!(r["env_file"], "service.env");
        assert!(r.get("volumes").is_none(), "{name} keeps nothing on disk");
        assert_eq!(r["depends_on"]["postgres"]["condition"], "service_healthy");
        assert!(
            r.get("healthcheck").is_none(),
            "{name}: a replica serves /healthz from its start; the image's check holds"
        );
        let port = r["environment"]["KERNELKITE_LISTEN"]
            .as_str()
            .unwrap()
            .rsplit(':')
            .next()
            .unwrap();
        assert!(
            haproxy
                .lines()
                .any(|l| l.trim() == format!("server {name} {name}:{port}")),
            "haproxy routes to {name}:{port}: {haproxy}"
        );
    }
    assert!(
        haproxy.contains("default-server check"),
        "every server is checked"
    );
    let balancer = &c["services"]["balancer"];
    assert!(balancer["volumes"][0]
        .as_str()
        .unwrap()
        .starts_with("./haproxy.cfg:"));
    let procfile = read("deployment/service/Procfile");
    let web: Vec<&str> = procfile.lines().filter(|l| l.starts_with("web:")).collect();
    assert_eq!(web.len(), 1, "one web process: {procfile}");
    assert!(web[0].contains("kernelkite-service serve --replica --listen \"0.0.0.0:${PORT}\""));
    for flag in ["--listen", "--replica"] {
        assert!(
            read("service/README.md").contains(&format!("| `{flag}` |")),
            "{flag} is the service's flag"
        );
    }
    assert!(
        haproxy.contains("balance roundrobin"),
        "every replica takes requests"
    );
}

/// The variables the service reads, from the configuration table of service/README.md.
fn service_variables() -> Vec<String> {
    let readme = read("service/README.md");
    let mut vars: Vec<String> = readme
        .lines()
        .filter(|l| l.starts_with("| `--"))
        .filter_map(|l| l.split('|').nth(2))
        .map(|c| c.trim().trim_matches('`').to_string())
        .collect();
    vars.push("RUST_LOG".into());
    vars
}

#[test]
fn the_service_environment_names_only_variables_the_service_reads() {
    let known = service_variables();
    assert!(
        known.iter().any(|v| v == "BUILDKITE_WEBHOOK_TOKEN"),
        "{known:?}"
    );
    let example = read("deployment/service/service.env.example");
    let mut seen = Vec::new();
    for line in example.lines() {
        let line = line.trim().trim_start_matches("# ");
        let Some((k, _)) = line.split_once('=') else {
            continue;
        };
        if k.chars().all(|c| c.is_ascii_uppercase() || c == '_') && !k.is_empty() {
            assert!(
                known.contains(&k.to_string()),
                "service.env.example sets {k}, which the service does not read"
            );
            seen.push(k.to_string());
        }
    }
    for required in [
        "BUILDKITE_ORG",
        "BUILDKITE_PIPELINE",
        "BUILDKITE_API_TOKEN",
        "BUILDKITE_WEBHOOK_TOKEN",
        "KERNELKITE_API_TOKEN",
    ] {
        assert!(
            seen.iter().any(|s| s == required),
            "service.env.example lacks {required}"
        );
    }
    let unit = read("deployment/service/kernelkite-service.service");
    for line in unit.lines().filter_map(|l| l.strip_prefix("Environment=")) {
        let k = line.split('=').next().unwrap();
        assert!(known.contains(&k.to_string()), "the unit sets {k}");
    }
}

#[test]
fn the_service_unit_passes_systemd_analyze_verify() {
    if let Some(why) = systemd::verify_unavailable() {
        kernelkite_testkit::skip(why);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let unit = read("deployment/service/kernelkite-service.service");
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .unwrap()
        .to_string();
    systemd::verify(
        dir.path(),
        &[("kernelkite-service.service".into(), unit.clone())],
        &[&exec],
    )
    .unwrap();
    // The check catches a misspelt key.
    let broken = unit.replace("ProtectHome=", "ProtectHomes=");
    assert!(systemd::verify(
        dir.path(),
        &[("kernelkite-service.service".into(), broken)],
        &[&exec]
    )
    .is_err());
}

/// One version a user can pin (issue 35): every plugin reference (`…/plugin#vX.Y.Z`) and every
/// kernelkite image tag (`ghcr.io/kernelkite/<image>:X.Y.Z`) in the documents, pipelines and
/// compose files is this workspace's version, as is the Python client's; and where this
/// checkout has tags, `v<version>` is one of them.
#[test]
fn one_version_everywhere_and_its_tag() {
    let version = env!("CARGO_PKG_VERSION");
    let files = std::process::Command::new("git")
        .args(["ls-files", "*.md", "*.yml", "*.yaml", "*.toml"])
        .current_dir(repo())
        .output();
    let Some(files) = files.ok().filter(|o| o.status.success()) else {
        kernelkite_testkit::skip("not a git checkout: the files to check cannot be listed");
        return;
    };
    let plugin_ref =
        regex::Regex::new(r"kernelkite/kernelkite/plugin#v([0-9][0-9A-Za-z.\-]*)").unwrap();
    let image = regex::Regex::new(r"ghcr\.io/kernelkite/[a-z\-]+:([0-9][0-9A-Za-z.\-]*)").unwrap();
    let mut wrong = Vec::new();
    let mut seen = 0;
    for f in String::from_utf8_lossy(&files.stdout).lines() {
        let text = read(f);
        for re in [&plugin_ref, &image] {
            for c in re.captures_iter(&text) {
                seen += 1;
                let v = c[1].trim_end_matches('.');
                if v != version {
                    wrong.push(format!("{f}: {}", &c[0]));
                }
            }
        }
    }
    assert!(seen >= 5, "the references were found: {seen}");
    assert!(wrong.is_empty(), "not version {version}: {wrong:#?}");
    let pyproject = read("clients/python/pyproject.toml");
    assert!(
        pyproject.contains(&format!("version = \"{version}\"")),
        "clients/python/pyproject.toml"
    );
    let tags = std::process::Command::new("git")
        .args(["tag", "--list"])
        .current_dir(repo())
        .output()
        .expect("git tag");
    let tags = String::from_utf8_lossy(&tags.stdout).into_owned();
    if tags.trim().is_empty() {
        kernelkite_testkit::skip(
            "this clone has no tags (fetched without them): the release tag cannot be checked",
        );
        return;
    }
    assert!(
        tags.lines().any(|t| t == format!("v{version}")),
        "no tag v{version} among {tags:?}: `git tag -a v{version}` on the release commit"
    );
}
