//! Every NVML call of `kernelkite_sys::nvml`, through the real loader and nvml-wrapper, against
//! the stand-in library (`kernelkite_testkit_leaf::fake_nvml`): what a GPU node's driver would
//! answer, errors included. One test: the stand-in reads its configuration from this
//! process's environment at `nvmlInit_v2`.

use kernelkite_sys::nvml::{ComputeProcess, DriverError, Nvml, NvmlError};
use kernelkite_testkit_leaf::fake_nvml::{h100, mig, mig_uuid, nvlink, FakeNvml};

fn load(fake: &FakeNvml) -> Result<Nvml, NvmlError> {
    Nvml::load_from(&fake.library().display().to_string())
}

#[test]
fn every_nvml_path_against_the_stand_in_library() {
    let fake = match FakeNvml::build_in_this_process() {
        Ok(f) => f,
        Err(why) => return kernelkite_testkit_leaf::skip(&why),
    };
    let (a, b) = ("0000:18:00.0", "0000:2a:00.0");
    fake.configure(&format!(
        "{}{}proc {a} 4242 1073741824\n",
        h100(a, 0, 1 << 30),
        h100(b, 1, 0)
    ));
    let nvml = load(&fake).expect("the stand-in loads and initialises");

    // Enumeration: what plans and `doctor` read.
    assert_eq!(nvml.device_count().unwrap(), 2);
    assert_eq!(nvml.device_name(1).unwrap(), "NVIDIA H100 80GB HBM3");
    let devices = nvml.devices().unwrap();
    assert_eq!(devices.len(), 2);
    assert_eq!(devices[0].pci_bus_id, "00000000:18:00.0");
    assert_eq!(devices[1].minor, Some(1));
    assert_eq!(
        devices[0].uuid.as_deref(),
        Some("GPU-00018000-0000-4000-8000-000000000000")
    );

    // The idle check: a busy GPU and an idle one.
    assert_eq!(
        nvml.compute_processes(a).unwrap(),
        vec![ComputeProcess {
            pid: 4242,
            used_bytes: Some(1 << 30)
        }]
    );
    assert!(nvml.compute_processes(b).unwrap().is_empty());
    assert_eq!(nvml.memory_used_bytes(a).unwrap(), 1 << 30);
    let missing = nvml.compute_processes("0000:99:00.0").unwrap_err();
    assert!(
        matches!(
            missing,
            NvmlError::Call {
                call: "nvmlDeviceGetHandleByPciBusId_v2",
                source: DriverError::NotFound
            }
        ),
        "{missing:?}"
    );

    // Clock locking and its restore.
    assert_eq!(nvml.max_graphics_clock_mhz(b).unwrap(), 1980);
    nvml.lock_graphics_clock(b, 1980).unwrap();
    nvml.reset_graphics_clock(b).unwrap();
    assert_eq!(fake.log(), format!("lock {b} 1980 1980\nreset {b}\n"));
    assert!(
        nvml.lock_graphics_clock(b, 5000).is_err(),
        "above the maximum"
    );
    drop(nvml);

    // The driver refusing: no permission to lock clocks; NVML not initialising.
    fake.configure(&format!(
        "{}fail nvmlDeviceSetGpuLockedClocks 4\n",
        h100(a, 0, 0)
    ));
    let nvml = load(&fake).unwrap();
    let denied = nvml.lock_graphics_clock(a, 1000).unwrap_err();
    assert!(
        matches!(
            denied,
            NvmlError::Call {
                source: DriverError::NoPermission,
                ..
            }
        ),
        "{denied:?}"
    );
    drop(nvml);

    // MIG: GPU b in MIG mode with two devices; NVLink between a and b. The MIG devices are
    // found by index as NVML numbers them, their instance ids through the calls nvml-wrapper
    // binds but does not wrap, and a process on one MIG device is its own, not the GPU's.
    let (m0, m1) = (mig_uuid(b, 3, 0), mig_uuid(b, 5, 0));
    fake.configure(&format!(
        "{}{}{}{}{}proc {m1} 77 1048576\n",
        h100(a, 0, 0),
        h100(b, 1, 0),
        mig(b, 3, 0, 20),
        mig(b, 5, 0, 10),
        nvlink(a, b)
    ));
    let nvml = load(&fake).unwrap();
    let devices = nvml.devices().unwrap();
    assert!(devices[0].mig.is_empty(), "{:?}", devices[0]);
    let migs: Vec<(String, u32, u32, u64)> = devices[1]
        .mig
        .iter()
        .map(|m| {
            (
                m.uuid.clone(),
                m.gpu_instance_id,
                m.compute_instance_id,
                m.memory_bytes,
            )
        })
        .collect();
    assert_eq!(
        migs,
        [(m0.clone(), 3, 0, 20 << 30), (m1.clone(), 5, 0, 10 << 30)]
    );
    assert_eq!(devices[0].nvlink_peers, ["00000000:2A:00.0"]);
    assert_eq!(devices[1].nvlink_peers, ["00000000:18:00.0"]);
    assert_eq!(nvml.compute_processes(&m0).unwrap(), []);
    assert_eq!(
        nvml.compute_processes(&m1).unwrap(),
        [ComputeProcess {
            pid: 77,
            used_bytes: Some(1 << 20)
        }]
    );
    assert_eq!(nvml.compute_processes(b).unwrap(), []);
    let gone = nvml.compute_processes("MIG-00000000-0000-4000-8000-000000000000");
    assert!(
        matches!(
            gone,
            Err(NvmlError::Call {
                call: "nvmlDeviceGetHandleByUUID",
                ..
            })
        ),
        "{gone:?}"
    );
    drop(nvml);
    // A driver whose MIG query fails mid-way says which call failed.
    fake.configure(&format!(
        "{}{}fail nvmlDeviceGetGpuInstanceId 3\n",
        h100(b, 1, 0),
        mig(b, 3, 0, 20)
    ));
    let nvml = load(&fake).unwrap();
    let err = nvml.devices().unwrap_err();
    assert!(
        matches!(
            err,
            NvmlError::Call {
                call: "nvmlDeviceGetGpuInstanceId",
                ..
            }
        ),
        "{err:?}"
    );
    drop(nvml);
    // A GPU this process may not open (a job's sandbox: its node is not in the job's /dev):
    // NVML counts it and answers NO_PERMISSION for its handle; the enumeration goes on past
    // it. Any other error still fails it.
    fake.configure(&format!("{}{}", h100(a, 0, 0), h100(b, 1, 0)));
    let dev = tempfile::tempdir().unwrap();
    std::fs::write(dev.path().join("nvidia1"), "").unwrap();
    std::env::set_var("KERNELKITE_FAKE_NVML_DEV", dev.path());
    let nvml = load(&fake).unwrap();
    assert_eq!(nvml.device_count().unwrap(), 2, "_v2 counts every GPU");
    let devices = nvml.devices().unwrap();
    let seen: Vec<(&str, Option<u32>)> = devices
        .iter()
        .map(|d| (d.pci_bus_id.as_str(), d.minor))
        .collect();
    assert_eq!(seen, [("00000000:2A:00.0", Some(1))]);
    let denied = nvml.compute_processes(a).unwrap_err();
    assert!(
        matches!(
            denied,
            NvmlError::Call {
                call: "nvmlDeviceGetHandleByPciBusId_v2",
                source: DriverError::NoPermission
            }
        ),
        "{denied:?}"
    );
    assert!(nvml.compute_processes(b).is_ok());
    drop(nvml);
    std::env::remove_var("KERNELKITE_FAKE_NVML_DEV");
    fake.configure(&format!(
        "{}fail nvmlDeviceGetHandleByIndex_v2 999\n",
        h100(a, 0, 0)
    ));
    let nvml = load(&fake).unwrap();
    assert!(
        matches!(
            nvml.devices(),
            Err(NvmlError::Call {
                call: "nvmlDeviceGetHandleByIndex_v2",
                source: DriverError::Unknown
            })
        ),
        "another error stops the enumeration"
    );
    drop(nvml);
    fake.configure("fail nvmlInit_v2 999\n");
    let err = load(&fake).unwrap_err();
    assert!(
        matches!(
            err,
            NvmlError::Call {
                call: "nvmlInit_v2",
                ..
            }
        ),
        "{err:?}"
    );
}
