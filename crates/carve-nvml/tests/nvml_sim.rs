//! The real `NvmlBackend` against the NVML simulator library (`libnvidia_ml_sim.so`,
//! built by cargo as a dev-dependency). Each test loads its own copy of the
//! library with a side-car configuration, so tests run in parallel in one process.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use carve_gpu::{BackendError, ComputeMode, ComputeTarget, Disposition, GpuBackend};
use carve_model::geometry::layouts;
use carve_model::{GpuModel, MODELS, MigProfile, Placement};
use carve_nvml::{NvmlBackend, NvmlOptions, probe};
use nvidia_ml_sim::{
    CorruptProfile, Fault, FaultAction, GpuEntry, SIDECAR_SUFFIX, SimConfig, SimState,
    simulate_gpu_reset,
};

/// The simulator library cargo built next to this test binary.
fn built_sim() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("deps dir");
    for cand in [
        deps.join("libnvidia_ml_sim.so"),
        deps.join("../libnvidia_ml_sim.so"),
    ] {
        if cand.exists() {
            return cand;
        }
    }
    panic!(
        "libnvidia_ml_sim.so not found near {}; build carve-nvml-sim",
        deps.display()
    );
}

/// A temporary directory with a private copy of the simulator and its config.
struct Sim {
    dir: tempfile::TempDir,
    lib: PathBuf,
    cfg: SimConfig,
}

impl Sim {
    fn new(gpus: Vec<GpuEntry>) -> Self {
        // Prefer tmpfs: the simulator persists state on every mutation, and the
        // layout test makes tens of thousands of them.
        let shm = Path::new("/dev/shm");
        let dir = if shm.is_dir() {
            tempfile::tempdir_in(shm).unwrap()
        } else {
            tempfile::tempdir().unwrap()
        };
        let lib = dir.path().join("libnvidia-ml.so");
        std::fs::copy(built_sim(), &lib).unwrap();
        let cfg = SimConfig::new("node-a", gpus, dir.path());
        let s = Self { dir, lib, cfg };
        s.write();
        s
    }

    fn one(model: &str, mig: bool) -> Self {
        Self::new(vec![GpuEntry::new(model, 1, mig)])
    }

    fn config_path(&self) -> PathBuf {
        let mut p = self.lib.clone().into_os_string();
        p.push(SIDECAR_SUFFIX);
        p.into()
    }

    fn write(&self) {
        self.cfg.to_file(&self.config_path()).unwrap();
    }

    fn open(&self) -> NvmlBackend {
        NvmlBackend::open(self.opts()).unwrap()
    }

    fn opts(&self) -> NvmlOptions {
        NvmlOptions {
            lib_path: Some(self.lib.clone()),
            proc_root: self.cfg.proc_root.clone(),
        }
    }

    fn cap_file(&self, gi: u32, ci: Option<u32>) -> PathBuf {
        let mut p = self
            .cfg
            .proc_root
            .join(format!("capabilities/gpu0/mig/gi{gi}"));
        if let Some(c) = ci {
            p.push(format!("ci{c}"));
        }
        p.join("access")
    }
}

fn spec_profiles_by_index(model: &str) -> Vec<MigProfile> {
    let mut ps: Vec<MigProfile> = GpuModel::find(model)
        .unwrap()
        .spec()
        .profiles
        .into_iter()
        .map(|mut p| {
            p.inferred = false;
            p
        })
        .collect();
    ps.sort_by_key(|p| p.index);
    ps
}

#[test]
fn every_model_full_lifecycle_of_every_placement() {
    for m in MODELS {
        let sim = Sim::one(m.key, true);
        let b = sim.open();
        let gpus = b.gpus().unwrap();
        assert_eq!(gpus.len(), 1);
        let spec = m.spec();
        assert_eq!(gpus[0].name, spec.product_name, "{}", m.key);
        assert_eq!(gpus[0].memory_mib, spec.memory_mib, "{}", m.key);
        assert_eq!(gpus[0].multiprocessors, spec.multiprocessors, "{}", m.key);
        assert_eq!(gpus[0].architecture, spec.architecture, "{}", m.key);
        assert!(gpus[0].uuid.starts_with("GPU-"), "{}", gpus[0].uuid);
        if !spec.mig_capable {
            assert!(!gpus[0].mig_capable);
            assert!(b.profiles(0).unwrap().is_empty());
            assert!(b.gpu_instances(0).unwrap().is_empty());
            assert!(matches!(
                b.mig_mode(0),
                Err(BackendError::NotSupported { .. })
            ));
            continue;
        }
        let profiles = b.profiles(0).unwrap();
        assert_eq!(profiles, spec_profiles_by_index(m.key), "{}", m.key);
        let mut minors = BTreeSet::new();
        let mut uuids = BTreeSet::new();
        for p in &profiles {
            for &pl in &p.placements {
                let ctx = format!("{} {} at {pl}", m.key, p.name);
                let gi = b.create_gpu_instance(0, p.id, pl).expect(&ctx);
                assert_eq!((gi.profile_id, gi.placement), (p.id, pl), "{ctx}");
                let ci = b.create_compute_instance(0, gi.id).expect(&ctx);
                let listed = b.gpu_instances(0).unwrap();
                assert_eq!(listed.len(), 1, "{ctx}");
                assert_eq!(listed[0].id, gi.id);
                assert_eq!(listed[0].compute_instances, vec![ci.clone()], "{ctx}");
                let uuid = ci.mig_uuid.clone().expect("MIG UUID");
                assert!(uuid.starts_with("MIG-"), "{uuid}");
                assert!(uuids.insert(uuid), "{ctx}: MIG UUID reused");
                let gm = b.capability_minor(gpus[0].minor, gi.id, None).unwrap();
                let cm = b
                    .capability_minor(gpus[0].minor, gi.id, Some(ci.id))
                    .unwrap();
                assert!(
                    minors.insert(gm) && minors.insert(cm),
                    "{ctx}: minor reused"
                );
                b.destroy_compute_instance(0, gi.id, ci.id).expect(&ctx);
                assert!(!sim.cap_file(gi.id, Some(ci.id)).exists(), "{ctx}");
                b.destroy_gpu_instance(0, gi.id).expect(&ctx);
                assert!(!sim.cap_file(gi.id, None).exists(), "{ctx}");
                assert!(b.gpu_instances(0).unwrap().is_empty(), "{ctx}");
            }
        }
    }
}

#[test]
fn a100_every_valid_layout_fills_reads_back_and_empties() {
    let sim = Sim::one("a100-40gb", true);
    let b = sim.open();
    let spec = GpuModel::find("a100-40gb").unwrap().spec();
    let all = layouts(&spec);
    assert!(all.len() > 100, "{} layouts", all.len());
    for layout in &all {
        let mut want = Vec::new();
        for inst in layout {
            let p = &spec.profiles[inst.profile];
            let pl = Placement::new(inst.start, p.memory_slices);
            let gi = b
                .create_gpu_instance(0, p.id, pl)
                .unwrap_or_else(|e| panic!("{layout:?}: {} at {pl}: {e}", p.name));
            want.push((p.id, pl));
            let _ = gi;
        }
        let mut got: Vec<_> = b
            .gpu_instances(0)
            .unwrap()
            .iter()
            .map(|g| (g.profile_id, g.placement))
            .collect();
        got.sort();
        want.sort();
        assert_eq!(got, want);
        for g in b.gpu_instances(0).unwrap() {
            b.destroy_gpu_instance(0, g.id).unwrap();
        }
        assert!(b.gpu_instances(0).unwrap().is_empty());
    }
}

#[test]
fn occupied_or_exhausted_placements_are_insufficient_resources() {
    let sim = Sim::one("h100-80gb", true);
    let b = sim.open();
    let spec = GpuModel::find("h100").unwrap().spec();
    let id = |n: &str| spec.profile(n).unwrap().id;
    b.create_gpu_instance(0, id("1g.10gb"), Placement::new(0, 1))
        .unwrap();
    // Overlap.
    let e = b
        .create_gpu_instance(0, id("4g.40gb"), Placement::new(0, 4))
        .unwrap_err();
    assert!(
        matches!(e, BackendError::InsufficientResources { .. }),
        "{e}"
    );
    assert!(e.to_string().contains("0:4"), "{e}");
    // Media extensions: one per GPU.
    b.create_gpu_instance(0, id("1g.10gb+me"), Placement::new(1, 1))
        .unwrap();
    let e = b
        .create_gpu_instance(0, id("1g.10gb+me"), Placement::new(2, 1))
        .unwrap_err();
    assert!(
        matches!(e, BackendError::InsufficientResources { .. }),
        "{e}"
    );
    // Fill the rest: 2g at 2, 3g at 4 (7 of 7 compute slices, 8 of 8 memory).
    b.create_gpu_instance(0, id("2g.20gb"), Placement::new(2, 2))
        .unwrap();
    b.create_gpu_instance(0, id("3g.40gb"), Placement::new(4, 4))
        .unwrap();
    let e = b
        .create_gpu_instance(0, id("1g.10gb"), Placement::new(6, 1))
        .unwrap_err();
    assert!(
        matches!(e, BackendError::InsufficientResources { .. }),
        "{e}"
    );
    // Not an allowed placement at all.
    let e = b
        .create_gpu_instance(0, id("3g.40gb"), Placement::new(2, 4))
        .unwrap_err();
    assert!(matches!(e, BackendError::Nvml { code: 2, .. }), "{e}");
    assert_eq!(b.gpu_instances(0).unwrap().len(), 4);
}

#[test]
fn instances_persist_across_reopen() {
    let sim = Sim::one("a30-24gb", true);
    let (gi, ci) = {
        let b = sim.open();
        let gi = b.create_gpu_instance(0, 5, Placement::new(2, 2)).unwrap();
        let ci = b.create_compute_instance(0, gi.id).unwrap();
        (gi, ci)
    };
    let b = sim.open();
    let listed = b.gpu_instances(0).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, gi.id);
    assert_eq!(listed[0].placement, Placement::new(2, 2));
    assert_eq!(listed[0].compute_instances, vec![ci.clone()]);
    let st = SimState::load(&sim.cfg.state_file).unwrap().unwrap();
    assert_eq!(st.gpus[0].gpu_instances.len(), 1);
    b.destroy_compute_instance(0, gi.id, ci.id).unwrap();
    b.destroy_gpu_instance(0, gi.id).unwrap();
    drop(b);
    assert!(sim.open().gpu_instances(0).unwrap().is_empty());
}

#[test]
fn destroy_semantics_in_use_and_already_gone() {
    let sim = Sim::one("h200-141gb", true);
    let b = sim.open();
    let gi = b.create_gpu_instance(0, 9, Placement::new(0, 4)).unwrap();
    let ci = b.create_compute_instance(0, gi.id).unwrap();
    let e = b.destroy_gpu_instance(0, gi.id).unwrap_err();
    assert!(matches!(e, BackendError::InUse { .. }), "{e}");
    assert_eq!(e.disposition(), Disposition::Retry);
    // A second full-size compute instance does not fit.
    let e = b.create_compute_instance(0, gi.id).unwrap_err();
    assert!(
        matches!(e, BackendError::InsufficientResources { .. }),
        "{e}"
    );
    b.destroy_compute_instance(0, gi.id, ci.id).unwrap();
    let e = b.destroy_compute_instance(0, gi.id, ci.id).unwrap_err();
    assert!(matches!(e, BackendError::NotFound { .. }), "{e}");
    assert_eq!(e.disposition(), Disposition::AlreadyDone);
    b.destroy_gpu_instance(0, gi.id).unwrap();
    let e = b.destroy_gpu_instance(0, gi.id).unwrap_err();
    assert!(matches!(e, BackendError::NotFound { .. }), "{e}");
    let e = b.create_compute_instance(0, gi.id).unwrap_err();
    assert!(matches!(e, BackendError::NotFound { .. }), "{e}");
    assert!(matches!(b.gpus().unwrap().len(), 1));
    assert!(matches!(
        b.destroy_gpu_instance(3, 1),
        Err(BackendError::NoSuch { .. })
    ));
}

#[test]
fn mig_mode_ampere_pends_until_reset_hopper_toggles() {
    let sim = Sim::new(vec![
        GpuEntry::new("a100-80gb", 1, false),
        GpuEntry::new("h100-94gb", 1, false),
    ]);
    {
        let b = sim.open();
        // GPU-instance operations need MIG mode.
        let e = b
            .create_gpu_instance(0, 0, Placement::new(0, 8))
            .unwrap_err();
        assert!(matches!(e, BackendError::NotSupported { .. }), "{e}");
        let m = b.set_mig_mode(0, true).unwrap();
        assert_eq!((m.current, m.pending), (false, true));
        let m = b.set_mig_mode(1, true).unwrap();
        assert_eq!((m.current, m.pending), (true, true));
        b.create_gpu_instance(1, 0, Placement::new(0, 8)).unwrap();
        let e = b.set_mig_mode(1, false).unwrap_err();
        assert!(matches!(e, BackendError::InUse { .. }), "{e}");
        assert!(b.mig_mode(1).unwrap().current);
    }
    simulate_gpu_reset(&sim.cfg, 0).unwrap();
    let b = sim.open();
    let m = b.mig_mode(0).unwrap();
    assert_eq!((m.current, m.pending), (true, true));
    b.create_gpu_instance(0, 0, Placement::new(0, 8)).unwrap();
}

#[test]
fn injected_failure_maps_to_the_typed_error_then_recovers() {
    let mut sim = Sim::one("h100-80gb", true);
    sim.cfg.faults = vec![
        Fault {
            function: "nvmlDeviceCreateGpuInstanceWithPlacement".into(),
            nth: 2,
            action: FaultAction::Fail { code: 23 },
        },
        Fault {
            function: "nvmlGpuInstanceDestroy".into(),
            nth: 1,
            action: FaultAction::Fail { code: 19 },
        },
        Fault {
            function: "nvmlComputeInstanceDestroy".into(),
            nth: 1,
            action: FaultAction::Fail { code: 15 },
        },
    ];
    sim.write();
    let b = sim.open();
    let a = b.create_gpu_instance(0, 19, Placement::new(0, 1)).unwrap();
    let e = b
        .create_gpu_instance(0, 19, Placement::new(1, 1))
        .unwrap_err();
    assert!(
        matches!(e, BackendError::InsufficientResources { .. }),
        "{e}"
    );
    b.create_gpu_instance(0, 19, Placement::new(1, 1)).unwrap();
    let e = b.destroy_gpu_instance(0, a.id).unwrap_err();
    assert!(matches!(e, BackendError::InUse { .. }), "{e}");
    b.destroy_gpu_instance(0, a.id).unwrap();
    let gi = b.gpu_instances(0).unwrap()[0].id;
    let ci = b.create_compute_instance(0, gi).unwrap();
    let e = b.destroy_compute_instance(0, gi, ci.id).unwrap_err();
    assert!(
        matches!(
            e,
            BackendError::Nvml {
                code: 15,
                call: "nvmlComputeInstanceDestroy",
                ..
            }
        ),
        "{e}"
    );
    b.destroy_compute_instance(0, gi, ci.id).unwrap();
}

#[test]
fn failed_init_is_unavailable() {
    let mut sim = Sim::one("h100-80gb", true);
    sim.cfg.faults = vec![Fault {
        function: "nvmlInit_v2".into(),
        nth: 1,
        action: FaultAction::Fail { code: 9 },
    }];
    sim.write();
    let e = NvmlBackend::open(sim.opts()).unwrap_err();
    assert!(matches!(e, BackendError::Unavailable { .. }), "{e}");
}

#[test]
fn unknown_model_in_config_is_unavailable_naming_nothing_half_done() {
    let mut sim = Sim::one("h100-80gb", true);
    sim.cfg.gpus[0].model = "v100".into();
    sim.write();
    let e = NvmlBackend::open(sim.opts()).unwrap_err();
    assert!(matches!(e, BackendError::Unavailable { .. }), "{e}");
    assert!(!sim.cfg.state_file.exists());
}

#[test]
fn failed_state_write_loses_nothing() {
    let sim = Sim::one("h100-80gb", true);
    let b = sim.open();
    let kept = b.create_gpu_instance(0, 19, Placement::new(0, 1)).unwrap();
    // Make the atomic rename fail: the state path becomes a non-empty directory.
    std::fs::remove_file(&sim.cfg.state_file).unwrap();
    std::fs::create_dir_all(sim.cfg.state_file.join("x")).unwrap();
    let e = b
        .create_gpu_instance(0, 19, Placement::new(1, 1))
        .unwrap_err();
    assert!(matches!(e, BackendError::Nvml { code: 999, .. }), "{e}");
    let listed = b.gpu_instances(0).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, kept.id);
    let caps = std::fs::read_dir(sim.cfg.proc_root.join("capabilities/gpu0/mig"))
        .unwrap()
        .count();
    assert_eq!(caps, 1, "no capability file for the failed instance");
}

/// Runs only as the child process of `abort_case`: opens the simulator copy in
/// `CARVE_NVML_TEST_CHILD_DIR`, configured through `CARVE_NVML_SIM_CONFIG`, and
/// creates one GPU instance, which the configured fault aborts.
#[test]
#[ignore = "child process of the abort tests"]
fn child_abort_helper() {
    let dir = std::env::var("CARVE_NVML_TEST_CHILD_DIR").expect("run by abort_case");
    let lib = Path::new(&dir).join("libnvidia-ml.so");
    let b = NvmlBackend::open(NvmlOptions {
        lib_path: Some(lib),
        proc_root: Path::new(&dir).join("proc"),
    })
    .unwrap();
    let _ = b.create_gpu_instance(0, 0, Placement::new(0, 8));
    panic!("the injected abort did not happen");
}

fn abort_case(action: FaultAction) -> Sim {
    use std::os::unix::process::ExitStatusExt;
    let mut sim = Sim::one("b200-180gb", true);
    // The child finds its configuration through the environment variable, not
    // the side-car file.
    std::fs::remove_file(sim.config_path()).unwrap();
    let fault = Fault {
        function: "nvmlDeviceCreateGpuInstanceWithPlacement".into(),
        nth: 1,
        action,
    };
    // Abort-before comes from the configuration file, abort-after from the
    // fault environment variable: both ways are exercised.
    let mut faults_env = "[]".to_string();
    if action == FaultAction::AbortBefore {
        sim.cfg.faults = vec![fault];
    } else {
        faults_env = serde_json::to_string(&[fault]).unwrap();
    }
    let env_cfg = sim.dir.path().join("env-config.json");
    sim.cfg.to_file(&env_cfg).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_abort_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("CARVE_NVML_TEST_CHILD_DIR", sim.dir.path())
        .env(nvidia_ml_sim::CONFIG_ENV, &env_cfg)
        .env(nvidia_ml_sim::FAULTS_ENV, faults_env)
        .output()
        .unwrap();
    assert_eq!(
        out.status.signal(),
        Some(6),
        "child should die of SIGABRT: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    sim.cfg.faults.clear();
    sim.write();
    sim
}

#[test]
fn abort_before_the_mutation_leaves_no_instance() {
    let sim = abort_case(FaultAction::AbortBefore);
    assert!(sim.open().gpu_instances(0).unwrap().is_empty());
}

#[test]
fn abort_after_the_mutation_leaves_the_instance() {
    let sim = abort_case(FaultAction::AbortAfter);
    let listed = sim.open().gpu_instances(0).unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].placement, Placement::new(0, 8));
    assert!(sim.cap_file(listed[0].id, None).exists());
}

#[test]
fn missing_library_is_unavailable() {
    let e = NvmlBackend::open(NvmlOptions {
        lib_path: Some("/nonexistent/libnvidia-ml.so.1".into()),
        proc_root: "/nonexistent".into(),
    })
    .unwrap_err();
    assert!(matches!(e, BackendError::Unavailable { .. }), "{e}");
    assert!(
        e.to_string().contains("/nonexistent/libnvidia-ml.so.1"),
        "{e}"
    );
}

/// A copy of the simulator whose dynamic symbol table no longer defines `name`:
/// its string is renamed in place (same length), so `dlsym` cannot find it.
fn without_symbol(sim: &Sim, name: &str) {
    let mut bytes = std::fs::read(&sim.lib).unwrap();
    let needle: Vec<u8> = [&[0u8][..], name.as_bytes(), &[0u8]].concat();
    let mut hits = 0;
    let mut i = 0;
    while let Some(pos) = bytes[i..].windows(needle.len()).position(|w| w == needle) {
        bytes[i + pos + 1] = b'X';
        hits += 1;
        i += pos + needle.len();
    }
    assert!(hits > 0, "{name} not found in the library");
    std::fs::write(&sim.lib, bytes).unwrap();
}

#[test]
fn library_lacking_a_mig_symbol_is_missing_symbol() {
    let sim = Sim::one("h100-80gb", true);
    without_symbol(&sim, "nvmlDeviceGetGpuInstanceProfileInfoV");
    // The GPU is still served (whole); only its MIG profiles are refused.
    let b = NvmlBackend::open(sim.opts()).unwrap();
    let gpus = b.gpus().unwrap();
    assert_eq!(gpus.len(), 1);
    let e = b.profiles(0).unwrap_err();
    match e {
        BackendError::MissingSymbol { symbol } => {
            assert_eq!(symbol, "nvmlDeviceGetGpuInstanceProfileInfoV");
        }
        e => panic!("expected MissingSymbol, got {e}"),
    }
}

#[test]
fn inconsistent_profile_names_gpu_and_profile() {
    let mut sim = Sim::new(vec![
        GpuEntry::new("h100-80gb", 1, true),
        GpuEntry::new("a100-40gb", 1, true),
    ]);
    sim.cfg.corrupt_profile = Some(CorruptProfile {
        gpu: 1,
        profile: "2g.10gb".into(),
    });
    sim.write();
    let b = sim.open();
    assert!(b.profiles(0).is_ok());
    let e = b.profiles(1).unwrap_err();
    match &e {
        BackendError::Inconsistent { gpu, reason } => {
            assert_eq!(*gpu, 1);
            assert!(reason.contains("2g.10gb"), "{reason}");
            assert!(reason.contains("compute slices 0"), "{reason}");
        }
        e => panic!("expected Inconsistent, got {e}"),
    }
}

#[test]
fn eight_gpus_have_distinct_stable_identities() {
    let sim = Sim::new(vec![GpuEntry::new("h100", 8, true)]);
    let first = sim.open().gpus().unwrap();
    let again = sim.open().gpus().unwrap();
    assert_eq!(first, again);
    let uuids: BTreeSet<_> = first.iter().map(|g| g.uuid.clone()).collect();
    let buses: BTreeSet<_> = first.iter().map(|g| g.pci_bus_id.clone()).collect();
    assert_eq!((uuids.len(), buses.len()), (8, 8));
    assert!(first.iter().all(|g| g.driver_version == "580.65.06"));
}

#[test]
fn probe_matches_committed_fixtures() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let update = std::env::var_os("CARVE_UPDATE_FIXTURES").is_some();
    for m in MODELS {
        let sim = Sim::one(m.key, true);
        let b = sim.open();
        let p = probe(&b).unwrap();
        let path = fixtures.join(format!("probe-{}.json", m.key));
        let got = serde_json::to_string_pretty(&p).unwrap() + "\n";
        if update {
            std::fs::write(&path, &got).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (CARVE_UPDATE_FIXTURES=1 writes it)",
                path.display()
            )
        });
        assert_eq!(
            got,
            want,
            "probe of {} differs from {}",
            m.key,
            path.display()
        );
    }
}

#[test]
fn compute_mode_on_whole_gpus_and_mig_devices_resets_with_the_gpu() {
    let sim = Sim::new(vec![
        GpuEntry::new("h100", 1, true),
        GpuEntry::new("l4", 1, false),
    ]);
    let (gi, ci) = {
        let b = sim.open();
        // Whole GPU without MIG.
        assert_eq!(
            b.compute_mode(ComputeTarget::Gpu(1)).unwrap(),
            ComputeMode::Default
        );
        b.set_compute_mode(ComputeTarget::Gpu(1), ComputeMode::ExclusiveProcess)
            .unwrap();
        assert_eq!(
            b.compute_mode(ComputeTarget::Gpu(1)).unwrap(),
            ComputeMode::ExclusiveProcess
        );
        // MIG mode: only MIG devices.
        let e = b
            .set_compute_mode(ComputeTarget::Gpu(0), ComputeMode::ExclusiveProcess)
            .unwrap_err();
        assert!(matches!(e, BackendError::NotSupported { .. }), "{e}");
        let gi = b
            .create_gpu_instance(0, 9, Placement::new(4, 4))
            .unwrap()
            .id;
        let ci = b.create_compute_instance(0, gi).unwrap().id;
        let t = ComputeTarget::Mig { gpu: 0, gi, ci };
        assert_eq!(b.compute_mode(t).unwrap(), ComputeMode::Default);
        b.set_compute_mode(t, ComputeMode::ExclusiveProcess)
            .unwrap();
        let missing = ComputeTarget::Mig {
            gpu: 0,
            gi,
            ci: ci + 1,
        };
        let e = b.compute_mode(missing).unwrap_err();
        assert!(matches!(e, BackendError::NotFound { .. }), "{e}");
        (gi, ci)
    };
    // Kept across a process restart, like the hardware.
    let t = ComputeTarget::Mig { gpu: 0, gi, ci };
    assert_eq!(
        sim.open().compute_mode(t).unwrap(),
        ComputeMode::ExclusiveProcess
    );
    // A GPU reset drops instances and compute modes.
    simulate_gpu_reset(&sim.cfg, 0).unwrap();
    simulate_gpu_reset(&sim.cfg, 1).unwrap();
    let b = sim.open();
    assert!(b.gpu_instances(0).unwrap().is_empty());
    assert!(!sim.cap_file(gi, None).exists());
    assert_eq!(
        b.compute_mode(ComputeTarget::Gpu(1)).unwrap(),
        ComputeMode::Default
    );
}

#[test]
fn every_listed_symbol_is_in_the_library() {
    let bytes = std::fs::read(built_sim()).unwrap();
    for name in nvidia_ml_sim::EXPORTED_SYMBOLS {
        let needle: Vec<u8> = [&[0u8][..], name.as_bytes(), &[0u8]].concat();
        assert!(
            bytes.windows(needle.len()).any(|w| w == needle),
            "{name} missing from libnvidia_ml_sim.so"
        );
    }
}

#[test]
fn without_whole_gpu_attributes_sms_come_from_the_largest_profile() {
    let mut sim = Sim::new(vec![
        GpuEntry::new("a100-40gb", 1, true),
        GpuEntry::new("h100", 1, true),
        GpuEntry::new("l4", 1, false),
    ]);
    sim.cfg.attributes_mig_only = true;
    sim.write();
    let gpus = sim.open().gpus().unwrap();
    // A100: 7g.40gb has 98 of the 108 SMs; H100: 7g.80gb has all 132; L4: unknown.
    let sms: Vec<u32> = gpus.iter().map(|g| g.multiprocessors).collect();
    assert_eq!(sms, [98, 132, 0]);
}
