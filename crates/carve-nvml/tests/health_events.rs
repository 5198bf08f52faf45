//! GPU health events end to end: the real `NvmlBackend` over the NVML simulator
//! library receives injected XID and ECC events, and `carve_model::health`
//! folds them into taints and device health, then clears them on reset.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use carve_gpu::{BackendError, EventKind, GpuBackend, GpuEvent, GpuEvents, live_instances};
use carve_model::DeviceName;
use carve_model::health::{
    ECC_TAINT_KEY, HealthState, HealthStatus, UNMONITORED_TAINT_KEY, XID_TAINT_KEY,
};
use carve_nvml::{NvmlBackend, NvmlOptions};
use nvidia_ml_sim::{
    Fault, FaultAction, GpuEntry, SIDECAR_SUFFIX, SimConfig, SimEvent, inject_event,
    simulate_gpu_reset,
};

/// Long enough never to expire in a test; a wait returns as soon as events are there.
const WAIT: Duration = Duration::from_secs(20);

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
    panic!("libnvidia_ml_sim.so not found near {}", deps.display());
}

/// A private copy of the simulator library with its side-car configuration.
struct Sim {
    _dir: tempfile::TempDir,
    lib: PathBuf,
    cfg: SimConfig,
}

impl Sim {
    fn new(gpus: Vec<GpuEntry>, edit: impl FnOnce(&mut SimConfig)) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("libnvidia-ml.so");
        std::fs::copy(built_sim(), &lib).unwrap();
        let mut cfg = SimConfig::new("node-a", gpus, dir.path());
        edit(&mut cfg);
        let mut side = lib.clone().into_os_string();
        side.push(SIDECAR_SUFFIX);
        cfg.to_file(Path::new(&side)).unwrap();
        Self {
            _dir: dir,
            lib,
            cfg,
        }
    }

    fn open(&self) -> NvmlBackend {
        NvmlBackend::open(NvmlOptions {
            lib_path: Some(self.lib.clone()),
            proc_root: self.cfg.proc_root.clone(),
        })
        .unwrap()
    }

    fn inject(&self, ev: &SimEvent) {
        inject_event(&self.cfg, ev).unwrap();
    }
}

/// Wait until `n` events arrived (each wait returns as soon as there are some).
fn collect(b: &NvmlBackend, n: usize) -> Vec<GpuEvent> {
    let mut out = Vec::new();
    while out.len() < n {
        let got = b.wait_events(WAIT).unwrap();
        assert!(!got.is_empty(), "timed out with {out:?}");
        out.extend(got);
    }
    assert_eq!(out.len(), n, "{out:?}");
    out
}

fn shape(evs: &[GpuEvent]) -> Vec<(u32, EventKind, Option<u32>, Option<u32>)> {
    evs.iter()
        .map(|e| (e.gpu, e.kind.clone(), e.gi, e.ci))
        .collect()
}

fn name(s: &str) -> DeviceName {
    s.parse().unwrap()
}

fn taints(h: &HealthState, dev: &str) -> Vec<(String, String, String)> {
    h.taints(&name(dev))
        .into_iter()
        .map(|t| (t.key, t.value.unwrap_or_default(), t.effect))
        .collect()
}

#[test]
fn injected_events_reach_the_backend_map_to_devices_and_clear_on_reset() {
    let sim = Sim::new(vec![GpuEntry::new("h100-80gb", 2, true)], |_| {});
    let b = sim.open();
    let profiles = b.profiles(0).unwrap();
    let p = profiles.iter().find(|p| p.name == "1g.10gb").unwrap();
    let gi1 = b.create_gpu_instance(0, p.id, p.placements[0]).unwrap();
    let gi2 = b.create_gpu_instance(0, p.id, p.placements[1]).unwrap();
    assert_eq!((gi1.id, gi2.id), (1, 2));
    let ci = b.create_compute_instance(0, gi2.id).unwrap();
    assert_eq!(ci.id, 0);

    // Watching starts: every GPU supports events, nothing to report.
    assert_eq!(b.wait_events(Duration::ZERO).unwrap(), []);
    sim.inject(&SimEvent::xid(1, 79));
    sim.inject(&SimEvent::xid(0, 31).on_instance(2, 0));
    sim.inject(&SimEvent::xid(0, 94).on_instance(2, 0));
    sim.inject(&SimEvent::dbe(0));
    let evs = collect(&b, 4);
    assert_eq!(
        shape(&evs),
        [
            (1, EventKind::Xid(79), None, None),
            (0, EventKind::Xid(31), Some(2), Some(0)),
            (0, EventKind::Xid(94), Some(2), Some(0)),
            (0, EventKind::DoubleBitEcc, None, None),
        ]
    );
    assert_eq!(b.wait_events(Duration::ZERO).unwrap(), [], "delivered once");

    let mut live = live_instances(&b.gpu_instances(0).unwrap(), &profiles).unwrap();
    live.extend(live_instances(&b.gpu_instances(1).unwrap(), &b.profiles(1).unwrap()).unwrap());
    let mut h = HealthState::default();
    assert!(h.apply(&evs, &live));

    let on_gi2 = format!("gpu-0-mig-1g10gb-{}", gi2.placement.start);
    let on_gi1 = format!("gpu-0-mig-1g10gb-{}", gi1.placement.start);
    let dbe = (
        ECC_TAINT_KEY.to_string(),
        "dbe".to_string(),
        "NoSchedule".to_string(),
    );
    let xid79 = (
        XID_TAINT_KEY.to_string(),
        "79".to_string(),
        "NoSchedule".to_string(),
    );
    assert_eq!(taints(&h, "gpu-1"), vec![xid79.clone()]);
    assert_eq!(taints(&h, "gpu-1-mig-7g80gb-0"), vec![xid79]);
    assert_eq!(taints(&h, "gpu-0"), vec![dbe.clone()]);
    assert_eq!(
        taints(&h, &on_gi1),
        vec![dbe.clone()],
        "XID 31 is an application fault"
    );
    assert_eq!(
        taints(&h, &on_gi2),
        [
            dbe,
            (
                XID_TAINT_KEY.to_string(),
                "94".to_string(),
                "None".to_string()
            )
        ],
        "XID 94 on GI 2 lands on GI 2's device only"
    );
    let devices: Vec<DeviceName> = ["gpu-0", "gpu-0-mps", &on_gi1, &on_gi2, "gpu-1", "gpu-1-ts"]
        .iter()
        .map(|s| name(s))
        .collect();
    let now = SystemTime::now();
    assert!(
        h.health(&devices, now)
            .iter()
            .all(|d| d.status == HealthStatus::Unhealthy && !d.message.is_empty())
    );

    // The GPUs are reset: instances gone, conditions cleared.
    drop(b);
    simulate_gpu_reset(&sim.cfg, 0).unwrap();
    simulate_gpu_reset(&sim.cfg, 1).unwrap();
    let b = sim.open();
    assert_eq!(b.gpu_instances(0).unwrap(), []);
    assert!(h.gpu_reset(0) && h.gpu_reset(1));
    let after = h.health(&devices, now);
    assert!(
        after
            .iter()
            .all(|d| d.status == HealthStatus::Healthy && d.message.is_empty())
    );
    assert!(devices.iter().all(|d| h.taints(d).is_empty()));

    // A new watch sees only events injected after it started.
    assert_eq!(b.wait_events(Duration::ZERO).unwrap(), []);
    sim.inject(&SimEvent::sbe(0));
    assert_eq!(
        shape(&collect(&b, 1)),
        [(0, EventKind::SingleBitEcc, None, None)]
    );
}

#[test]
fn gpu_without_event_support_is_reported_once_as_unmonitored() {
    let sim = Sim::new(vec![GpuEntry::new("h100-80gb", 2, true)], |c| {
        c.events_unsupported = vec![1];
    });
    let b = sim.open();
    let first = b.wait_events(WAIT).unwrap();
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(first[0].gpu, 1);
    let EventKind::Unmonitored { reason } = &first[0].kind else {
        panic!("{first:?}");
    };
    assert!(reason.contains("none of the XID and ECC"), "{reason}");
    assert_eq!(b.wait_events(Duration::ZERO).unwrap(), [], "reported once");
    // GPU 1 is not watched; GPU 0 is.
    sim.inject(&SimEvent::xid(1, 79));
    sim.inject(&SimEvent::xid(0, 48));
    assert_eq!(
        shape(&collect(&b, 1)),
        [(0, EventKind::Xid(48), None, None)]
    );

    let mut h = HealthState::default();
    h.apply(&first, &[]);
    assert_eq!(
        h.device_health(&name("gpu-1-mps"), SystemTime::now())
            .status,
        HealthStatus::Unknown
    );
    assert_eq!(
        taints(&h, "gpu-1"),
        [(UNMONITORED_TAINT_KEY.into(), "true".into(), "None".into())]
    );
    assert!(h.taints(&name("gpu-0")).is_empty());
}

#[test]
fn registration_refused_as_not_supported_is_unmonitored_not_an_error() {
    let sim = Sim::new(vec![GpuEntry::new("a100-40gb", 2, false)], |c| {
        c.faults.push(Fault {
            function: "nvmlDeviceRegisterEvents".into(),
            nth: 1,
            action: FaultAction::Fail { code: 3 },
        });
    });
    let b = sim.open();
    let first = b.wait_events(WAIT).unwrap();
    assert_eq!(
        shape(&first),
        [(
            0,
            EventKind::Unmonitored {
                reason: "nvmlDeviceRegisterEvents: not supported".into()
            },
            None,
            None
        )]
    );
    sim.inject(&SimEvent::dbe(1));
    assert_eq!(
        shape(&collect(&b, 1)),
        [(1, EventKind::DoubleBitEcc, None, None)]
    );
}

#[test]
fn failed_registration_leaves_nothing_registered_and_is_retried() {
    let sim = Sim::new(vec![GpuEntry::new("h100-80gb", 2, true)], |c| {
        c.faults.push(Fault {
            function: "nvmlDeviceRegisterEvents".into(),
            nth: 2,
            action: FaultAction::Fail { code: 999 },
        });
    });
    let b = sim.open();
    let e = b.wait_events(WAIT).unwrap_err();
    assert!(
        matches!(
            e,
            BackendError::Nvml {
                call: "nvmlDeviceRegisterEvents",
                code: 999,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("GPU 1"), "{e}");
    // The next wait starts watching afresh and succeeds.
    assert_eq!(b.wait_events(Duration::ZERO).unwrap(), []);
    sim.inject(&SimEvent::xid(1, 74));
    sim.inject(&SimEvent::xid(0, 74));
    assert_eq!(
        shape(&collect(&b, 2)),
        [
            (1, EventKind::Xid(74), None, None),
            (0, EventKind::Xid(74), None, None)
        ]
    );
}

#[test]
fn unreadable_event_is_an_error_naming_the_call() {
    let sim = Sim::new(vec![GpuEntry::new("h100-80gb", 1, true)], |_| {});
    let b = sim.open();
    assert_eq!(b.wait_events(Duration::ZERO).unwrap(), []);
    std::fs::write(sim.cfg.events_file(), "not json\n").unwrap();
    let e = b.wait_events(WAIT).unwrap_err();
    assert!(
        matches!(
            e,
            BackendError::Nvml {
                call: "nvmlEventSetWait_v2",
                ..
            }
        ),
        "{e}"
    );
}

/// Rename `name` in the library copy's symbol table so `dlsym` cannot find it.
fn without_symbol(lib: &Path, name: &str) {
    let mut bytes = std::fs::read(lib).unwrap();
    let needle: Vec<u8> = [&[0u8][..], name.as_bytes(), &[0u8]].concat();
    let mut hits = 0;
    let mut i = 0;
    while let Some(pos) = bytes[i..].windows(needle.len()).position(|w| w == needle) {
        bytes[i + pos + 1] = b'X';
        hits += 1;
        i += pos + needle.len();
    }
    assert!(hits > 0, "{name} not found in the library");
    std::fs::write(lib, bytes).unwrap();
}

#[test]
fn library_without_the_event_api_reports_every_gpu_unmonitored() {
    let sim = Sim::new(vec![GpuEntry::new("l4-24gb", 2, false)], |_| {});
    without_symbol(&sim.lib, "nvmlEventSetWait_v2");
    let b = sim.open();
    let first = b.wait_events(WAIT).unwrap();
    assert_eq!(first.iter().map(|e| e.gpu).collect::<Vec<_>>(), [0, 1]);
    assert!(first.iter().all(|e| matches!(
        &e.kind,
        EventKind::Unmonitored { reason } if reason.contains("lacks the NVML event API")
    )));
    // Nothing to watch: a wait returns empty after its timeout.
    assert_eq!(b.wait_events(Duration::from_millis(1)).unwrap(), []);
    // MIG operations are unaffected.
    assert_eq!(b.gpus().unwrap().len(), 2);
}
