//! Planning: a claim's allocation becomes the device records to prepare,
//! validated against the node's GPUs and the claim's opaque configuration.
//! Pure: no NVML, no files, no API server. Also the conflict rules between
//! devices on one GPU, which prepare applies against the other claims.

use std::collections::BTreeMap;
use std::sync::Arc;

use carve_model::sharing::{MpsDeviceSpec, translate};
use carve_model::{DeviceName, Placement};
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};

use super::{ClaimError, Gpu};
use crate::checkpoint::{
    CheckpointBody, ClaimRecord, ClaimState, DeviceRecord, HardMemory, MpsShare, PreparedKind,
};
use crate::claim::ClaimRef;
use crate::config::{
    Applicable, GpuPolicy, PluginConfig, capabilities_env, effective_capabilities, effective_mps,
    parse_configs,
};

/// A device of a claim after validation, before any hardware change.
#[derive(Debug, Clone)]
pub(super) struct Planned {
    pub(super) record: DeviceRecord,
}

/// Validate the allocation and turn it into device plans (pure, no I/O).
pub(super) fn plan_claim(
    config: &PluginConfig,
    gpus: &BTreeMap<u32, Arc<Gpu>>,
    rc: &ResourceClaim,
) -> Result<Vec<Planned>, ClaimError> {
    let alloc = rc
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .ok_or(ClaimError::NotAllocated)?;
    let devices = alloc.devices.as_ref();
    let results = devices
        .and_then(|d| d.results.as_deref())
        .unwrap_or_default();
    let configs = devices
        .and_then(|d| d.config.as_deref())
        .unwrap_or_default();
    let configs = parse_configs(&config.driver_name, configs)?;
    let mut planned: Vec<Planned> = Vec::new();
    for r in results.iter().filter(|r| r.driver == config.driver_name) {
        if r.pool != config.pool_name {
            return Err(ClaimError::OtherPool {
                device: r.device.clone(),
                pool: r.pool.clone(),
                ours: config.pool_name.clone(),
            });
        }
        let request = r
            .request
            .split('/')
            .next()
            .unwrap_or(&r.request)
            .to_string();
        // One device (or share) for several requests: one record naming them all.
        if let Some(p) = planned
            .iter_mut()
            .find(|p| p.record.device == r.device && p.record.share_id == r.share_id)
        {
            if !p.record.requests.contains(&request) {
                p.record.requests.push(request);
            }
            continue;
        }
        planned.push(plan_device(config, gpus, r, request, &configs)?);
    }
    check_within_claim(&planned)?;
    check_one_pipe_directory(&planned)?;
    Ok(planned)
}

/// A claim with an MPS share has no other device of this driver. A CUDA
/// process talks to one MPS control daemon, through the one
/// `CUDA_MPS_PIPE_DIRECTORY` its container has; each share's CDI device sets
/// that variable (and `/dev/shm`) for its own unit, so a container given two
/// shares (two units, or two namespaces of one unit), or a share and another
/// GPU device, keeps one share's and reaches the other device without MPS or
/// its limits. carve cannot tell at prepare which containers get which
/// request, so it refuses the claim, before anything is created.
fn check_one_pipe_directory(planned: &[Planned]) -> Result<(), ClaimError> {
    let Some(share) = planned.iter().find(|p| p.record.kind.mps().is_some()) else {
        return Ok(());
    };
    if planned.len() < 2 {
        return Ok(());
    }
    let others: Vec<&str> = planned
        .iter()
        .filter(|p| !std::ptr::eq(*p, share))
        .map(|p| p.record.device.as_str())
        .collect();
    Err(ClaimError::BadShare {
        device: share.record.device.clone(),
        reason: format!(
            "this claim also has {} ({}): a container reaches one MPS daemon through one CUDA_MPS_PIPE_DIRECTORY and one /dev/shm, so with more than one of them it would silently lose MPS (or its limits) on all but one; carve gives an MPS share only to a claim with no other device of this driver: put each in a claim of its own",
            if others.len() == 1 {
                "device"
            } else {
                "devices"
            },
            others.join(", ")
        ),
    })
}

/// Under MPS v2 a unit serves one claim ([`carve_mps::control`]): a share of
/// this claim on a v2 unit another claim's share uses is refused (the
/// published v2 device already lets one claim take the whole unit; this
/// guards against a stale slice or a scheduler that allocated it anyway).
pub(super) fn check_v2_units(
    claim: &ClaimRef,
    planned: &[Planned],
    st: &CheckpointBody,
    v2: bool,
) -> Result<(), ClaimError> {
    if !v2 {
        return Ok(());
    }
    for share in planned.iter().filter_map(|p| p.record.kind.mps()) {
        for o in st.claims.values().filter(|c| c.uid != claim.uid) {
            if o.devices
                .iter()
                .any(|x| x.kind.mps().is_some_and(|y| y.unit == share.unit))
            {
                return Err(ClaimError::BadShare {
                    device: share.unit.clone(),
                    reason: format!(
                        "the unit's MPS daemon speaks protocol v2 and already serves claim {}/{} ({}); under v2 every client reaches the daemon's control endpoint (quit, limit commands), so a v2 unit serves one claim at a time (its pods may share it); MPS v3 (driver r615 or later) gives several claims a unit",
                        o.namespace, o.name, o.uid
                    ),
                });
            }
        }
    }
    Ok(())
}

/// One allocation result of this driver, first seen, as a device plan.
fn plan_device(
    config: &PluginConfig,
    gpus: &BTreeMap<u32, Arc<Gpu>>,
    r: &DeviceRequestAllocationResult,
    request: String,
    configs: &[Applicable],
) -> Result<Planned, ClaimError> {
    let name: DeviceName = r.device.parse()?;
    let gpu_index = name.gpu();
    let gpu = gpus.get(&gpu_index).ok_or_else(|| ClaimError::NoSuchGpu {
        device: r.device.clone(),
        gpu: gpu_index,
    })?;
    let share = match &name {
        DeviceName::Mps { .. } | DeviceName::MigMps { .. } => {
            Some(plan_share(config, gpu, &name, r, configs)?)
        }
        _ => None,
    };
    let kind = match &name {
        DeviceName::Gpu { .. } => PreparedKind::Gpu,
        DeviceName::Mig { .. } | DeviceName::MigMps { .. } => mig_kind(gpu, &name, r, share)?,
        DeviceName::Mps { .. } => PreparedKind::Mps {
            share: share.ok_or_else(|| ClaimError::Task("MPS share not planned".into()))?,
        },
        DeviceName::TimeSlice { .. } => PreparedKind::TimeSlice,
    };
    if kind.mps().is_none() {
        // An MpsConfig naming this request is an error; a class-wide one is not for it.
        effective_mps(configs, &r.request, &r.device, false)?;
    }
    let is_mig = matches!(kind, PreparedKind::Mig { .. });
    let caps = effective_capabilities(configs, &r.request, &r.device, is_mig)?;
    Ok(Planned {
        record: DeviceRecord {
            requests: vec![request],
            pool: r.pool.clone(),
            device: r.device.clone(),
            share_id: r.share_id.clone(),
            gpu_index,
            gpu_uuid: gpu.info.uuid.clone(),
            gpu_minor: gpu.info.minor,
            kind,
            capabilities_env: caps.map(|c| capabilities_env(&c)),
        },
    })
}

/// A MIG device (or MIG-MPS share `share`): its profile and placement must
/// be one the GPU offers.
fn mig_kind(
    gpu: &Gpu,
    name: &DeviceName,
    r: &DeviceRequestAllocationResult,
    share: Option<MpsShare>,
) -> Result<PreparedKind, ClaimError> {
    let gpu_index = gpu.info.index;
    if !gpu.info.mig_capable {
        return Err(ClaimError::NotMigCapable {
            device: r.device.clone(),
            gpu: gpu_index,
            uuid: gpu.info.uuid.clone(),
        });
    }
    let (profile, start) = name.mig_placement().unwrap_or_default();
    let p = gpu
        .profiles
        .iter()
        .find(|p| p.name == profile)
        .ok_or_else(|| ClaimError::NoSuchProfile {
            device: r.device.clone(),
            gpu: gpu_index,
            profile: profile.clone(),
        })?;
    let placement = p
        .placements
        .iter()
        .find(|pl| pl.start == start)
        .copied()
        .ok_or_else(|| ClaimError::BadPlacement {
            device: r.device.clone(),
            profile: profile.clone(),
            start,
            allowed: p.placements.iter().map(|pl| pl.start).collect(),
        })?;
    Ok(PreparedKind::Mig {
        profile,
        profile_id: p.id,
        placement,
        created: gpu.policy == GpuPolicy::Dynamic,
        gi: None,
        ci: None,
        mig_uuid: None,
        cap_minors: Vec::new(),
        mps: share,
    })
}

/// Two devices of one claim must not overlap either.
fn check_within_claim(planned: &[Planned]) -> Result<(), ClaimError> {
    for (i, a) in planned.iter().enumerate() {
        for b in &planned[..i] {
            if a.record.gpu_index != b.record.gpu_index || a.record.device == b.record.device {
                continue;
            }
            if conflicts(&a.record.kind, &b.record.kind) {
                return Err(ClaimError::Occupied {
                    device: a.record.device.clone(),
                    gpu: a.record.gpu_index,
                    placement: match &a.record.kind {
                        PreparedKind::Mig { placement, .. } => *placement,
                        PreparedKind::Gpu | PreparedKind::TimeSlice | PreparedKind::Mps { .. } => {
                            Placement::new(0, 0)
                        }
                    },
                    by: format!("device {} of the same claim", b.record.device),
                });
            }
        }
    }
    Ok(())
}

/// The in-memory record of a claim being prepared.
pub(super) fn started(claim: &ClaimRef, planned: &[Planned]) -> ClaimRecord {
    ClaimRecord {
        uid: claim.uid.clone(),
        namespace: claim.namespace.clone(),
        name: claim.name.clone(),
        state: ClaimState::PrepareStarted,
        cdi_spec: None,
        devices: planned.iter().map(|p| p.record.clone()).collect(),
    }
}

/// The first device of `planned` that another claim's device (as the
/// checkpoint `st` records them) conflicts with, as the error.
pub(super) fn check_claims(
    claim: &ClaimRef,
    planned: &[Planned],
    st: &CheckpointBody,
) -> Result<(), ClaimError> {
    for p in planned {
        let d = &p.record;
        let g = d.gpu_index;
        // Other claims' devices on this GPU.
        for o in st.claims.values().filter(|c| c.uid != claim.uid) {
            let Some(x) = o
                .devices
                .iter()
                .find(|x| x.gpu_index == g && conflicts(&d.kind, &x.kind))
            else {
                continue;
            };
            let who = format!("{}/{} ({})", o.namespace, o.name, o.uid);
            return Err(match (&d.kind, &x.kind) {
                (PreparedKind::Mig { placement, .. }, PreparedKind::Mig { .. }) => {
                    ClaimError::Occupied {
                        device: d.device.clone(),
                        gpu: g,
                        placement: *placement,
                        by: format!("claim {who}"),
                    }
                }
                (_, PreparedKind::Gpu) => ClaimError::GpuHeld {
                    device: d.device.clone(),
                    gpu: g,
                    by: format!("as a whole GPU by claim {who}"),
                },
                (_, k) => ClaimError::GpuHeld {
                    device: d.device.clone(),
                    gpu: g,
                    by: format!("by claim {who} {}", holds(k)),
                },
            });
        }
    }
    Ok(())
}

/// Validate an MPS allocation and turn its `consumedCapacity` into limits (pure).
fn plan_share(
    config: &PluginConfig,
    gpu: &Gpu,
    name: &DeviceName,
    r: &DeviceRequestAllocationResult,
    configs: &[Applicable],
) -> Result<MpsShare, ClaimError> {
    let device = || r.device.clone();
    let setup = config
        .mps
        .as_ref()
        .ok_or_else(|| ClaimError::MpsDisabled { device: device() })?;
    check_share_id(r)?;
    let Some(consumed) = r.consumed_capacity.as_ref().filter(|c| !c.is_empty()) else {
        return Err(ClaimError::BadShare {
            device: device(),
            reason: "the allocation result has no consumedCapacity, so the share has no memory or SM limit (the scheduler records it with DRAConsumableCapacity enabled; an API server with that feature gate off drops it from the claim: enable it on kube-apiserver)".into(),
        });
    };
    let mig = name.mig_placement().is_some();
    let root = &setup.config.cgroup_root;
    let hard = if mig {
        Err(carve_mps::memlimit::NotHard::Mig)
    } else {
        carve_mps::memlimit::whole_gpu(&setup.support, root, Some(&gpu.info.pci_bus_id))
    };
    let caps = setup.support.unit_capabilities(mig, hard.is_ok());
    let need = effective_mps(configs, &r.request, &r.device, true)?;
    check_demands(&r.device, &need, caps, hard.as_ref().err())?;
    let demanded = need.memory_limit == Some(carve_model::sharing::MemoryLimit::Hard);
    let sharing_err = |source| ClaimError::Sharing {
        device: device(),
        source: Box::new(source),
    };
    let spec = match name.mig_placement() {
        None => MpsDeviceSpec::whole(&gpu.physical, caps),
        Some((profile, start)) => MpsDeviceSpec::mig(&gpu.physical, &profile, start, caps),
    }
    .map_err(sharing_err)?;
    let limits = translate(consumed, &spec).map_err(sharing_err)?;
    let (hard_memory, memory_client_why) = match hard {
        Ok(key) => (Some(HardMemory { key, demanded }), None),
        Err(why) => (None, Some(why.to_string())),
    };
    Ok(MpsShare {
        unit: r.device.clone(),
        limits,
        cgroup: None,
        edits: None,
        hard_memory,
        memory_client_why,
    })
}

/// The allocation result names its share with a UID-like `shareID`.
fn check_share_id(r: &DeviceRequestAllocationResult) -> Result<(), ClaimError> {
    let share_id = r.share_id.as_deref().ok_or_else(|| ClaimError::BadShare {
        device: r.device.clone(),
        reason: "the allocation result has no shareID (the scheduler gives every share of a shareable device one; an API server with the DRAConsumableCapacity feature gate off drops shareID and consumedCapacity from the claim: enable it on kube-apiserver)".into(),
    })?;
    if share_id.is_empty()
        || share_id.len() > 64
        || !share_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(ClaimError::BadShare {
            device: r.device.clone(),
            reason: format!("shareID {share_id:?} is not a UID"),
        });
    }
    Ok(())
}

/// The enforcement levels a claim's opaque `MpsConfig` demands, against what
/// the device gives (`not_hard`: why its memory is not hard, when it is not).
fn check_demands(
    device: &str,
    need: &crate::config::MpsConfig,
    caps: carve_model::sharing::MpsCapabilities,
    not_hard: Option<&carve_mps::memlimit::NotHard>,
) -> Result<(), ClaimError> {
    if let Some(m) = need.memory_limit
        && caps.memory_limit < m
    {
        let why = not_hard.map_or_else(String::new, ToString::to_string);
        return Err(ClaimError::BadShare {
            device: device.to_string(),
            reason: format!(
                "opaque MpsConfig requires memoryLimit {}, this device enforces {}: {why}; {}",
                m.as_str(),
                caps.memory_limit.as_str(),
                carve_mps::detect::WHY_MEMORY_IS_CLIENT
            ),
        });
    }
    if let Some(c) = need.compute_limit
        && caps.compute_limit < c
    {
        return Err(ClaimError::BadShare {
            device: device.to_string(),
            reason: format!(
                "opaque MpsConfig requires computeLimit {}, this node enforces {}",
                c.as_str(),
                caps.compute_limit.as_str()
            ),
        });
    }
    Ok(())
}

/// Whether two devices on the same GPU cannot be prepared at the same time:
/// anything excludes a whole GPU; time-slice shares go together, MPS shares of
/// one unit go together; MIG devices clash when they overlap, unless both are
/// MPS shares of the same instance.
fn conflicts(a: &PreparedKind, b: &PreparedKind) -> bool {
    match (a, b) {
        (PreparedKind::TimeSlice, PreparedKind::TimeSlice) => false,
        (PreparedKind::Mps { share: x }, PreparedKind::Mps { share: y }) => x.unit != y.unit,
        (
            PreparedKind::Mig {
                placement: x,
                mps: sx,
                ..
            },
            PreparedKind::Mig {
                placement: y,
                mps: sy,
                ..
            },
        ) => {
            let same_unit = matches!((sx, sy), (Some(p), Some(q)) if p.unit == q.unit);
            x.overlaps(*y) && !same_unit
        }
        _ => true,
    }
}

/// How a device holds its GPU, for error messages.
fn holds(kind: &PreparedKind) -> &'static str {
    match kind {
        PreparedKind::Gpu => "as a whole GPU",
        PreparedKind::TimeSlice => "as a time-sliced GPU",
        PreparedKind::Mps { .. } => "through MPS",
        PreparedKind::Mig { .. } => "using its MIG devices",
    }
}

/// Dynamic GPUs of these models (`GpuModel` names) as the driver holds them,
/// without NVML: for the plan tests and the fuzz targets.
#[cfg(any(test, feature = "fuzzing"))]
fn simulated_gpus(models: &[&str]) -> BTreeMap<u32, Arc<Gpu>> {
    models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let spec = carve_model::GpuModel::find(m)
                .expect("a known GPU model")
                .spec();
            let i = i as u32;
            let info = carve_gpu::GpuInfo {
                index: i,
                minor: i,
                uuid: format!("GPU-{i}"),
                name: spec.product_name.clone(),
                architecture: spec.architecture,
                cuda_compute_capability: spec.cuda_compute_capability,
                driver_version: "580.65.06".into(),
                pci_bus_id: String::new(),
                memory_mib: spec.memory_mib,
                multiprocessors: spec.multiprocessors,
                mig_capable: spec.mig_capable,
                mig_mode: spec.mig_capable.then_some(carve_gpu::MigMode {
                    current: false,
                    pending: false,
                }),
            };
            (
                i,
                Arc::new(Gpu {
                    physical: carve_model::PhysicalGpu {
                        index: info.index,
                        minor: info.minor,
                        uuid: info.uuid.clone(),
                        pci_bus_id: None,
                        pcie_root: None,
                        driver_version: "580.65.6".into(),
                        spec: spec.clone(),
                    },
                    info,
                    profiles: spec.profiles,
                    policy: GpuPolicy::Dynamic,
                    lock: tokio::sync::Mutex::default(),
                }),
            )
        })
        .collect()
}

/// Fuzzing entry ([`crate::fuzzing`]): plan `rc` for node `node-a` with an
/// H100, an A100 and an L4 (the validation every claim from the API server
/// goes through before anything is made). Returns the number of devices.
#[cfg(feature = "fuzzing")]
pub(crate) fn plan_on_simulated_node(rc: &ResourceClaim) -> Result<usize, ClaimError> {
    static GPUS: std::sync::OnceLock<BTreeMap<u32, Arc<Gpu>>> = std::sync::OnceLock::new();
    let gpus = GPUS.get_or_init(|| simulated_gpus(&["h100-80gb", "a100-40gb", "l4-24gb"]));
    plan_claim(&PluginConfig::new("node-a"), gpus, rc).map(|p| p.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(models: &[&str]) -> BTreeMap<u32, Arc<Gpu>> {
        simulated_gpus(models)
    }

    fn claim(results: serde_json::Value, config: serde_json::Value) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "ns", "uid": "u-1"},
            "spec": {},
            "status": {"allocation": {"devices": {"results": results, "config": config}}}
        }))
        .unwrap()
    }

    fn res(req: &str, pool: &str, device: &str) -> serde_json::Value {
        serde_json::json!({"request": req, "driver": "gpu.carve.dev", "pool": pool, "device": device})
    }

    fn cfg() -> PluginConfig {
        PluginConfig::new("node-a")
    }

    #[test]
    fn plans_mig_and_whole_gpu_devices() {
        let g = gpus(&["h100-80gb", "l4-24gb"]);
        let rc = claim(
            serde_json::json!([
                res("a/small", "node-a", "gpu-0-mig-1g10gb-3"),
                res("b", "node-a", "gpu-1"),
                {"request": "x", "driver": "other.dev", "pool": "p", "device": "whatever"}
            ]),
            serde_json::json!([]),
        );
        let p = plan_claim(&cfg(), &g, &rc).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[0].record.requests, ["a"]);
        match &p[0].record.kind {
            PreparedKind::Mig {
                profile,
                placement,
                created,
                gi,
                ..
            } => {
                assert_eq!(profile, "1g.10gb");
                assert_eq!(*placement, Placement::new(3, 1));
                assert!(*created);
                assert!(gi.is_none());
            }
            _ => panic!("expected MIG"),
        }
        assert_eq!(p[1].record.kind, PreparedKind::Gpu);
        assert_eq!(p[1].record.gpu_uuid, "GPU-1");
    }

    #[test]
    fn bad_allocations_name_the_problem() {
        let g = gpus(&["a100-40gb", "l4-24gb"]);
        let cases = [
            (
                res("r", "node-b", "gpu-0"),
                "allocated from pool \"node-b\"",
            ),
            (
                res("r", "node-a", "gpu-0-mig-bogus-1"),
                "\"gpu-0-mig-bogus-1\" is not a carve device name",
            ),
            (
                res("r", "node-a", "gpu-7-mig-1g5gb-0"),
                "this node has no GPU 7",
            ),
            (
                res("r", "node-a", "gpu-0-mig-1g80gb-0"),
                "GPU 0 has no MIG profile 1g.80gb",
            ),
            (
                res("r", "node-a", "gpu-0-mig-3g20gb-1"),
                "cannot be placed at slice 1",
            ),
            (
                res("r", "node-a", "gpu-1-mig-1g5gb-0"),
                "GPU 1 (GPU-1) is not MIG-capable",
            ),
            (
                res("r", "node-a", "gpu-0-mps"),
                "MPS is not enabled on this node",
            ),
        ];
        for (r, want) in cases {
            let e = plan_claim(
                &cfg(),
                &g,
                &claim(serde_json::json!([r]), serde_json::json!([])),
            )
            .unwrap_err();
            assert!(e.to_string().contains(want), "{e} / {want}");
        }
        let unalloc: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "u"}, "spec": {}
        }))
        .unwrap();
        assert!(matches!(
            plan_claim(&cfg(), &g, &unalloc),
            Err(ClaimError::NotAllocated)
        ));
    }

    #[test]
    fn overlapping_devices_in_one_claim_are_rejected() {
        let g = gpus(&["a100-40gb"]);
        let rc = claim(
            serde_json::json!([
                res("a", "node-a", "gpu-0-mig-4g20gb-0"),
                res("b", "node-a", "gpu-0-mig-1g5gb-3")
            ]),
            serde_json::json!([]),
        );
        let e = plan_claim(&cfg(), &g, &rc).unwrap_err().to_string();
        assert!(
            e.contains("occupied by device gpu-0-mig-4g20gb-0 of the same claim"),
            "{e}"
        );
    }

    #[test]
    fn opaque_config_reaches_the_record() {
        let g = gpus(&["a100-40gb"]);
        let rc = claim(
            serde_json::json!([res("a", "node-a", "gpu-0-mig-1g5gb-0")]),
            serde_json::json!([{"source": "FromClaim", "opaque": {"driver": "gpu.carve.dev",
                "parameters": {"apiVersion": "gpu.carve.dev/v1alpha1", "kind": "MigConfig", "driverCapabilities": ["compute", "utility"]}}}]),
        );
        let p = plan_claim(&cfg(), &g, &rc).unwrap();
        assert_eq!(
            p[0].record.capabilities_env.as_deref(),
            Some("NVIDIA_DRIVER_CAPABILITIES=compute,utility")
        );
    }
}
