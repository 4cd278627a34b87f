//! The `kernelkite-isolate` binary: `fixture`, `plan`, `doctor` as a user runs them.

use std::path::Path;
use std::process::{Command, Output};

use kernelkite_topology::fakesys;
use kernelkite_topology::plan::Plan;
use kernelkite_topology::planner::{plan, Policy};
use kernelkite_topology::topology::Topology;

use crate::common;
use kernelkite_testkit::{assert_warns, scratch};

fn bin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kernelkite-isolate"))
        .args(args)
        .env_remove("KERNELKITE_SYSFS_ROOT")
        .output()
        .unwrap()
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn fixture_then_plan_json_matches_the_library() {
    let dir = scratch();
    let root = dir.path().join("dgx");
    let o = bin(&["fixture", "dgx-h100", "--out", root.to_str().unwrap()]);
    assert!(o.status.success(), "{:?}", text(&o));
    let o = bin(&["plan", "--sysfs-root", root.to_str().unwrap(), "--json"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let parsed: Plan = serde_json::from_str(&out).unwrap();
    let want = plan(&Topology::discover(&root).unwrap(), &Policy::default()).unwrap();
    assert_eq!(parsed, want);
    // The documented shape: these keys, in this order, on one line.
    assert_eq!(out.lines().count(), 1);
    assert!(out.starts_with(r#"{"slices":[{"index":0,"gpu":{"vendor":"nvidia","pci_bus_id":"0000:18:00.0","uuid":"GPU-"#), "{out}");
    assert!(out.contains(r#""numa_node":0},"cpus":[1,2,"#));
    assert!(out.contains(r#"],"reserved_cpus":[0,56,112,168],"warnings":["#));
}

#[test]
fn plan_table_shows_ranges_and_reasons() {
    let dir = scratch();
    fakesys::dgx_h100().write_to(dir.path()).unwrap();
    let o = bin(&[
        "plan",
        "--sysfs-root",
        dir.path().to_str().unwrap(),
        "--housekeeping-cores",
        "0",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let first = out.lines().nth(1).unwrap();
    for col in ["0", "nvidia", "0000:18:00.0", "0-13,112-125", "230.4 GiB"] {
        assert!(first.contains(col), "{first}");
    }
    assert!(
        out.contains("why:") && out.contains("slice size: 14 core(s)"),
        "{out}"
    );
}

#[test]
fn plan_flags_reach_the_policy() {
    let dir = scratch();
    fakesys::cpu_only().write_to(dir.path()).unwrap();
    let root = dir.path().to_str().unwrap();
    let o = bin(&["plan", "--sysfs-root", root]);
    let (_, err) = text(&o);
    assert!(!o.status.success());
    assert!(err.contains("--cpu-only-slices"), "{err}");
    let o = bin(&[
        "plan",
        "--sysfs-root",
        root,
        "--json",
        "--cpu-only-slices",
        "2",
        "--memory-per-slice",
        "8G",
    ]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let p: Plan = serde_json::from_str(&out).unwrap();
    assert_eq!(p.slices.len(), 2);
    assert!(p
        .slices
        .iter()
        .all(|s| s.gpu.is_none() && s.memory_bytes == 8 << 30));
    let o = bin(&["plan", "--sysfs-root", root, "--memory-per-slice", "lots"]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("not a size"));
}

#[test]
fn plan_from_an_hwloc_export() {
    let xml = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../crates/topology/tests/data/hwloc/32em64t-2n8c2t-pci-normalio.xml");
    let o = bin(&["plan", "--topology-xml", xml.to_str().unwrap(), "--json"]);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    let p: Plan = serde_json::from_str(&out).unwrap();
    assert_eq!(p.slices.len(), 4);
    let o = bin(&["plan", "--topology-xml", "/nonexistent.xml"]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("/nonexistent.xml"));
}

#[test]
fn fixture_variants_reach_the_plan() {
    let dir = scratch();
    let root = dir.path().to_str().unwrap();
    let o = bin(&[
        "fixture",
        "dgx-h100",
        "--out",
        root,
        "--offline",
        "1-2,113-114",
        "--cpuset",
        "0-55,112-167",
    ]);
    assert!(o.status.success(), "{:?}", text(&o));
    let o = bin(&["plan", "--sysfs-root", root, "--json"]);
    let p: Plan = serde_json::from_str(&text(&o).0).unwrap();
    assert_warns(&p.warnings, &["1-2,113-114", "offline"]);
    assert!(p
        .slices
        .iter()
        .flat_map(|s| &s.cpus)
        .all(|c| *c < 56 || (112..168).contains(c)));
    let o = bin(&["fixture", "dgx-h100", "--out", root, "--offline", "9-1"]);
    assert!(!o.status.success());
    assert!(
        text(&o).1.contains("range ends before it starts"),
        "{:?}",
        text(&o)
    );
}

#[test]
fn unknown_fixture_and_list() {
    let o = bin(&["fixture", "--list"]);
    let (out, _) = text(&o);
    assert!(o.status.success());
    for (name, _) in fakesys::FIXTURES {
        assert!(out.contains(name));
    }
    let o = bin(&["fixture", "dgx-h200", "--out", "/tmp/never"]);
    assert!(!o.status.success());
    assert!(text(&o).1.contains("fixture --list"));
}

#[test]
fn plan_and_doctor_work_on_every_fixture() {
    for (name, _) in fakesys::FIXTURES {
        let dir = scratch();
        let root = dir.path().to_str().unwrap();
        assert!(bin(&["fixture", name, "--out", root]).status.success());
        let o = bin(&["plan", "--sysfs-root", root, "--cpu-only-slices", "2"]);
        let (out, err) = text(&o);
        assert!(o.status.success(), "{name}: {err}");
        assert!(out.starts_with("SLICE"), "{name}: {out}");
        let o = bin(&["doctor", "--sysfs-root", root]);
        let (out, _) = text(&o);
        let line = |check: &str| out.lines().find(|l| l.contains(check)).map(str::to_string);
        assert!(
            line("cgroups").is_some_and(|l| l.starts_with("ok")),
            "{name}: {out}"
        );
        let topo = line("topology").unwrap_or_default();
        let want = if *name == "cpu-only" { "warn" } else { "ok" };
        assert!(topo.starts_with(want), "{name}: {out}");
        let failed = out.lines().any(|l| l.starts_with("fail"));
        assert_eq!(o.status.code(), Some(i32::from(failed)), "{name}: {out}");
    }
}

#[test]
fn doctor_on_fixtures_and_the_live_machine() {
    let dir = scratch();
    fakesys::dgx_h100().write_to(dir.path()).unwrap();
    let o = bin(&["doctor", "--sysfs-root", dir.path().to_str().unwrap()]);
    let (out, _) = text(&o);
    assert!(
        out.lines()
            .any(|l| l.starts_with("ok") && l.contains("cgroup v2")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("ok") && l.contains("8 GPU(s)")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.contains("nvidia driver") && l.contains("550.90.07")),
        "{out}"
    );
    // Exit status: 1 exactly when a line says fail.
    let failed = out.lines().any(|l| l.starts_with("fail"));
    assert_eq!(o.status.code(), Some(i32::from(failed)), "{out}");

    let o = bin(&["doctor"]);
    let (out, _) = text(&o);
    assert!(out.lines().any(|l| l.contains("cgroups")), "{out}");
    assert!(out.lines().any(|l| l.contains("buildkite-agent")), "{out}");
    let failed = out.lines().any(|l| l.starts_with("fail"));
    assert_eq!(o.status.code(), Some(i32::from(failed)), "{out}");
}

/// `doctor`'s NVML check through the real loader, against the stand-in library as
/// `libnvidia-ml.so.1` (`kernelkite_testkit::fake_nvml`): NVML answering for the node's 8 GPUs,
/// then NVML failing to initialise.
#[test]
fn doctor_reads_the_gpus_through_nvml() {
    use kernelkite_testkit::fake_nvml::{h100, mig, mig_uuid, write_mig_minors, FakeNvml};
    let fake = match FakeNvml::build() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit::skip(&why),
    };
    let dir = scratch();
    fakesys::dgx_h100().write_to(dir.path()).unwrap();
    let topo = kernelkite_topology::Topology::discover(dir.path()).unwrap();
    let config: String = topo
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| h100(&g.pci_bus_id, i as u32, 0))
        .collect();
    assert_eq!(topo.gpus.len(), 8);
    // The doctor line named `check`, with the stand-in configured as `config` says.
    let doctor_line = |config: &str, check: &str| {
        fake.configure(config);
        let o = Command::new(env!("CARGO_BIN_EXE_kernelkite-isolate"))
            .args(["doctor", "--sysfs-root", dir.path().to_str().unwrap()])
            .env_remove("KERNELKITE_SYSFS_ROOT")
            .envs(fake.env())
            .output()
            .unwrap();
        let (out, _) = text(&o);
        out.lines()
            .find(|l| l.contains(&format!(" {check} ")))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no {check} line: {out}"))
    };
    // The fix line under the doctor line named `check`.
    let doctor_fix = |config: &str, check: &str| {
        fake.configure(config);
        let o = Command::new(env!("CARGO_BIN_EXE_kernelkite-isolate"))
            .args(["doctor", "--sysfs-root", dir.path().to_str().unwrap()])
            .env_remove("KERNELKITE_SYSFS_ROOT")
            .envs(fake.env())
            .output()
            .unwrap();
        let (out, _) = text(&o);
        let mut lines = out
            .lines()
            .skip_while(|l| !l.contains(&format!(" {check} ")));
        lines.next();
        lines.next().unwrap_or_default().to_string()
    };
    let doctor = |config: &str| doctor_line(config, "nvidia driver");
    let line = doctor(&config);
    assert!(
        line.starts_with("ok") && line.contains("NVML sees 8 of 8 GPU(s)"),
        "{line}"
    );
    let line = doctor("fail nvmlInit_v2 999\n");
    assert!(
        line.starts_with("warn") && line.contains("NVML failed") && line.contains("nvmlInit_v2"),
        "{line}"
    );

    // GPU 1 in MIG mode with two MIG devices: doctor reports the layout, and fails it while
    // the driver lists no capability node a job would need for them.
    let bus = &topo.gpus[1].pci_bus_id;
    let mig_config = format!("{config}{}{}", mig(bus, 3, 0, 40), mig(bus, 5, 0, 20));
    let mig_line = || doctor_line(&mig_config, "mig");
    let line = mig_line();
    assert!(
        line.starts_with("fail") && line.contains("lists no capability"),
        "{line}"
    );
    write_mig_minors(dir.path(), 508).unwrap();
    let line = mig_line();
    assert!(
        line.starts_with("fail") && line.contains("/dev/nvidia-caps/nvidia-cap165"),
        "{line}"
    );
    let fix = doctor_fix(&mig_config, "mig");
    assert!(
        fix.contains("nvidia-modprobe -f /proc/driver/nvidia/capabilities/gpu1/mig/gi3/access")
            && !fix.contains("NVreg_ModifyDeviceFiles=1"),
        "{fix}"
    );
    std::fs::create_dir_all(dir.path().join("dev/nvidia-caps")).unwrap();
    // The driver's numbers: gpu1/gi3 165 and 166, gpu1/gi5 183 and 184.
    for cap in [165, 166, 183, 184] {
        std::fs::write(
            dir.path().join(format!("dev/nvidia-caps/nvidia-cap{cap}")),
            "",
        )
        .unwrap();
    }
    let params = dir.path().join("sys/module/nvidia/parameters");
    std::fs::create_dir_all(&params).unwrap();
    std::fs::write(params.join("nv_cap_enable_devfs"), "0\n").unwrap();
    let line = mig_line();
    assert!(
        line.starts_with("fail") && line.contains("nv_cap_enable_devfs=0"),
        "{line}"
    );
    std::fs::write(params.join("nv_cap_enable_devfs"), "1\n").unwrap();
    let line = mig_line();
    assert!(line.starts_with("ok"), "{line}");
    for want in [
        format!("GPU {bus}: 2 MIG device(s)"),
        format!(
            "{} (4g.40gb, GPU instance 3, compute instance 0, 40.0 GiB)",
            mig_uuid(bus, 3, 0)
        ),
        mig_uuid(bus, 5, 0),
        "one slice per MIG device".to_string(),
    ] {
        assert!(line.contains(&want), "{want} in {line}");
    }
}

#[test]
fn output_into_a_closed_pipe_exits_quietly() {
    // `plan | head -c 1` and the like, made deterministic: stdout is a pipe whose reader is
    // already gone, so the first write fails with EPIPE.
    let dir = scratch();
    let root = dir.path().to_str().unwrap();
    common::output_ok(
        Command::new(env!("CARGO_BIN_EXE_kernelkite-isolate"))
            .args(["fixture", "dgx-h100", "--out", root]),
    );
    for args in [
        vec!["plan", "--sysfs-root", root],
        vec!["plan", "--sysfs-root", root, "--json"],
        vec!["fixture", "--list"],
        vec!["doctor", "--sysfs-root", root],
    ] {
        let (reader, writer) = rustix::pipe::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_kernelkite-isolate"))
            .args(&args)
            .stdout(std::process::Stdio::from(writer))
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// Issue 36: MIG devices get new uuids at every boot. `plan --refresh FILE` (which the agents'
/// unit runs as they start) takes them into the plan when the layout is the one planned, and
/// leaves the file alone, naming `setup`, when it is not. NVML is the stand-in library, loaded
/// by the binary as on a node.
#[test]
fn plan_refresh_takes_new_mig_uuids_after_a_reboot() {
    use kernelkite_testkit::fake_nvml::{h100, mig_at, mig_uuid_at, FakeNvml};
    use kernelkite_topology::plan::MigInstance;
    let fake = match FakeNvml::build() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit::skip(&why),
    };
    let dir = scratch();
    fakesys::dgx_h100().write_to(dir.path()).unwrap();
    let topo = Topology::discover(dir.path()).unwrap();
    let bus = topo.gpus[1].pci_bus_id.clone();
    // The plan of boot 0: GPU 1 as two MIG devices (GPU instances 3 and 5).
    let mut p = plan(&topo, &Policy::default()).unwrap();
    let as_mig = |gi: u32| MigInstance {
        uuid: mig_uuid_at(&bus, gi, 0, 0),
        gpu_instance_id: gi,
        compute_instance_id: 0,
        memory_bytes: 20 << 30,
    };
    let mut second = p.slices[1].clone();
    second.index = p.slices.len() as u32;
    for (s, gi) in [(&mut p.slices[1], 3), (&mut second, 5)] {
        let g = s.gpu.as_mut().unwrap();
        g.mig = Some(as_mig(gi));
        g.uuid = Some(mig_uuid_at(&bus, gi, 0, 0));
    }
    p.slices.push(second);
    let file = dir.path().join("plan.json");
    std::fs::write(&file, serde_json::to_string(&p).unwrap()).unwrap();
    let gpus = |boot: u32, gis: &[u32]| -> String {
        let mut c: String = topo
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| h100(&g.pci_bus_id, i as u32, 0))
            .collect();
        for gi in gis {
            c.push_str(&mig_at(&bus, *gi, 0, 20, boot));
        }
        c
    };
    let refresh = |config: &str| {
        fake.configure(config);
        Command::new(env!("CARGO_BIN_EXE_kernelkite-isolate"))
            .args(["plan", "--sysfs-root", dir.path().to_str().unwrap()])
            .arg("--refresh")
            .arg(&file)
            .env_remove("KERNELKITE_SYSFS_ROOT")
            .envs(fake.env())
            .output()
            .unwrap()
    };
    // Boot 1, the same layout: the new uuids are taken.
    let o = refresh(&gpus(1, &[3, 5]));
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(
        out.contains("took the new MIG device uuid(s) of 2 slice(s)"),
        "{out}"
    );
    let fresh: Plan = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let uuids: Vec<String> = fresh
        .slices
        .iter()
        .filter_map(|s| s.gpu.as_ref()?.mig.as_ref().map(|m| m.uuid.clone()))
        .collect();
    assert_eq!(
        uuids,
        [mig_uuid_at(&bus, 3, 0, 1), mig_uuid_at(&bus, 5, 0, 1)]
    );
    // Again: nothing to take.
    let o = refresh(&gpus(1, &[3, 5]));
    assert!(text(&o).0.contains("matches the node"), "{:?}", text(&o));
    // Every agent of a node refreshes as it starts, all at once: each succeeds and the plan
    // is whole afterwards (a shared temporary file let one truncate another's).
    let children: Vec<_> = (0..8)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_kernelkite-isolate"))
                .args(["plan", "--sysfs-root", dir.path().to_str().unwrap()])
                .arg("--refresh")
                .arg(&file)
                .env_remove("KERNELKITE_SYSFS_ROOT")
                .envs(fake.env())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for c in children {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{:?}", text(&o));
    }
    let whole: Plan = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(whole.slices.len(), p.slices.len());
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o644);
    // Boot 2 with another layout: refused, the file as it was.
    let before = std::fs::read(&file).unwrap();
    let o = refresh(&gpus(2, &[3, 7]));
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}{err}");
    assert!(
        err.contains("GPU instance 5") && err.contains("kernelkite-isolate setup"),
        "{err}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), before);
    // NVML that does not load: refused (every MIG device would read as gone), file alone.
    let o = refresh("fail nvmlInit_v2 999\n");
    let (_, err) = text(&o);
    assert!(!o.status.success() && err.contains("needs NVML"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), before);
}

/// A node whose MI300X GPUs are in CPX mode is refused by `plan`, which names the command that
/// makes them whole; in SPX, the same node plans (the `amdgpu_xcp_*` devices exist in both).
#[test]
fn plan_refuses_a_partitioned_mi300x_and_names_the_fix() {
    use kernelkite_testkit::kfd::{write_mi300x_partitioned, Partitioning};
    for (how, ok) in [(Partitioning::cpx(), false), (Partitioning::spx(), true)] {
        let dir = scratch();
        let root = dir.path().to_str().unwrap();
        assert!(bin(&["fixture", "mi300x-8", "--out", root])
            .status
            .success());
        write_mi300x_partitioned(dir.path(), &how, &[]).unwrap();
        let o = bin(&["plan", "--sysfs-root", root]);
        let (out, err) = text(&o);
        assert_eq!(o.status.success(), ok, "{}: {out}{err}", how.compute);
        if !ok {
            assert_eq!(o.status.code(), Some(1));
            assert!(
                err.contains(
                    "GPU 0000:05:00.0 (AMD Instinct MI300X) is in CPX compute partitioning"
                ) && err.contains("sudo amd-smi set --gpu all --compute-partition SPX"),
                "{err}"
            );
        }
    }
}
