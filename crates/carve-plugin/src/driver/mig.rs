//! MIG instances: reading the GPUs' instances and MIG modes, checking a
//! claim's devices against them, making (MIG mode, GPU instance, compute
//! instance, capability minors) and destroying them, and the instance
//! gauges. Everything here but [`Driver::record_instances`] is blocking and
//! runs inside a caller's blocking hop, under the GPUs' locks.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use carve_gpu::{BackendError, Disposition, GpuBackend, GpuInstanceInfo};
use carve_model::MigProfile;

use super::error::backend_err;
use super::{ClaimError, Driver, Gpu, blocking};
use crate::checkpoint::{DeviceRecord, PreparedKind};
use crate::config::{GpuPolicy, Retry};

/// Instances of GPUs, by index.
pub(super) type Live = BTreeMap<u32, Vec<GpuInstanceInfo>>;

/// GPUs as read: their instances, and which are in MIG mode now.
#[derive(Debug, Default)]
pub(super) struct GpuReads {
    pub(super) live: Live,
    pub(super) mig_on: BTreeSet<u32>,
}

/// Read the MIG-capable GPUs among `gpus` and check `records` against
/// them ([`check_live`]). Blocking.
pub(super) fn read_checked(
    b: &dyn GpuBackend,
    gpus: &BTreeMap<u32, Arc<Gpu>>,
    records: &[DeviceRecord],
    shared: impl Fn(&DeviceRecord) -> bool,
) -> Result<GpuReads, ClaimError> {
    let ids: Vec<u32> = gpus
        .values()
        .filter(|g| g.info.mig_capable)
        .map(|g| g.info.index)
        .collect();
    let reads = read_gpus(b, &ids)?;
    check_live(records, &reads.live, gpus, shared)?;
    Ok(reads)
}

/// Read the instances and the MIG mode of `ids`. Blocking.
fn read_gpus(b: &dyn GpuBackend, ids: &[u32]) -> Result<GpuReads, ClaimError> {
    let mut out = GpuReads::default();
    for &g in ids {
        let v = b
            .gpu_instances(g)
            .map_err(backend_err(format!("list GPU instances of GPU {g}")))?;
        let m = b
            .mig_mode(g)
            .map_err(backend_err(format!("read MIG mode of GPU {g}")))?;
        out.live.insert(g, v);
        if m.current {
            out.mig_on.insert(g);
        }
    }
    Ok(out)
}

/// The devices `records` against NVML truth (`live`, the GPUs' instances):
/// a whole GPU must have no instance, a dynamic MIG placement no instance
/// overlapping it (except the instance of an MPS unit that `shared` says
/// another claim already shares), a static MIG device its instance.
fn check_live<'r>(
    records: impl IntoIterator<Item = &'r DeviceRecord>,
    live: &Live,
    gpus: &BTreeMap<u32, Arc<Gpu>>,
    shared: impl Fn(&DeviceRecord) -> bool,
) -> Result<(), ClaimError> {
    for d in records {
        let g = d.gpu_index;
        let gpu = &gpus[&g];
        let instances = live.get(&g).map(Vec::as_slice).unwrap_or_default();
        match &d.kind {
            PreparedKind::Gpu | PreparedKind::TimeSlice | PreparedKind::Mps { .. } => {
                if !instances.is_empty() {
                    return Err(ClaimError::GpuHasInstances {
                        device: d.device.clone(),
                        gpu: g,
                        instances: instances
                            .iter()
                            .map(|i| describe(i, &gpu.profiles))
                            .collect::<Vec<_>>()
                            .join(", "),
                    });
                }
            }
            PreparedKind::Mig { .. } => check_live_mig(d, instances, gpu, &shared)?,
        }
    }
    Ok(())
}

/// [`check_live`] of MIG device `d` on `gpu`, whose instances are
/// `instances`.
fn check_live_mig(
    d: &DeviceRecord,
    instances: &[GpuInstanceInfo],
    gpu: &Gpu,
    shared: impl Fn(&DeviceRecord) -> bool,
) -> Result<(), ClaimError> {
    let PreparedKind::Mig {
        profile,
        profile_id,
        placement,
        mps,
        ..
    } = &d.kind
    else {
        return Ok(());
    };
    let g = d.gpu_index;
    match gpu.policy {
        GpuPolicy::Dynamic => {
            let shared = mps.is_some() && shared(d);
            if let Some(i) = instances.iter().find(|i| {
                i.placement.overlaps(*placement)
                    && !(shared && i.placement == *placement && i.profile_id == *profile_id)
            }) {
                return Err(ClaimError::Occupied {
                    device: d.device.clone(),
                    gpu: g,
                    placement: *placement,
                    by: format!("{} that carve does not know", describe(i, &gpu.profiles)),
                });
            }
        }
        GpuPolicy::Static => {
            let exists = instances.iter().any(|i| {
                i.placement == *placement
                    && i.profile_id == *profile_id
                    && !i.compute_instances.is_empty()
            });
            if !exists {
                return Err(ClaimError::StaticMissing {
                    device: d.device.clone(),
                    gpu: g,
                    profile: profile.clone(),
                    placement: *placement,
                });
            }
        }
    }
    Ok(())
}

/// MIG mode changes, then each MIG device's instances: created on a dynamic
/// GPU, found in `live` on a static one, taken from the claim that already
/// shares it through MPS (`shared`, by unit). Fills in the records' ids,
/// MIG UUIDs and capability minors. On error destroys the instances it
/// created (a MIG mode it changed stays as recorded). Blocking.
pub(super) fn make_devices(
    b: &dyn GpuBackend,
    retry: Retry,
    mig: &MigModeChanges,
    records: &mut [DeviceRecord],
    live: &Live,
    shared: &BTreeMap<String, DeviceRecord>,
) -> Result<(), ClaimError> {
    set_mig_modes(b, mig)?;
    // (gpu, gi, ci) made so far, for rollback.
    let mut made: Vec<(u32, u32, Option<u32>)> = Vec::new();
    let res = records
        .iter_mut()
        .try_for_each(|d| make_one(b, d, live, shared, &mut made));
    if res.is_err() {
        roll_back(b, retry, &made);
    }
    res
}

/// GPUs whose MIG mode a prepare turns on, and off.
#[derive(Debug, Default, Clone)]
pub(super) struct MigModeChanges {
    pub(super) enable: Vec<u32>,
    pub(super) disable: Vec<u32>,
}

impl MigModeChanges {
    pub(super) fn is_empty(&self) -> bool {
        self.enable.is_empty() && self.disable.is_empty()
    }
}

/// Turn MIG mode off, then on, where `mig` says; an error where the change
/// is pending a GPU reset. Blocking.
fn set_mig_modes(b: &dyn GpuBackend, mig: &MigModeChanges) -> Result<(), ClaimError> {
    for g in &mig.disable {
        let m = b
            .set_mig_mode(*g, false)
            .map_err(backend_err(format!("disable MIG mode on GPU {g}")))?;
        if m.current {
            return Err(ClaimError::WholeInMigMode {
                device: format!("gpu-{g}"),
                gpu: *g,
                why: "disabling MIG mode is pending a GPU reset",
            });
        }
    }
    for g in &mig.enable {
        let m = b
            .set_mig_mode(*g, true)
            .map_err(backend_err(format!("enable MIG mode on GPU {g}")))?;
        if !m.current {
            return Err(ClaimError::MigPending { gpu: *g });
        }
    }
    Ok(())
}

/// The instances of one device (nothing for a device that is no MIG
/// device): the instance of the MPS unit it shares where other claims
/// share it already, else the instances it creates (pushed on `made`) or,
/// for a static device, the ones made for it. Blocking.
fn make_one(
    b: &dyn GpuBackend,
    d: &mut DeviceRecord,
    live: &Live,
    shared: &BTreeMap<String, DeviceRecord>,
    made: &mut Vec<(u32, u32, Option<u32>)>,
) -> Result<(), ClaimError> {
    if use_shared_instance(&mut d.kind, shared) {
        return Ok(());
    }
    let g = d.gpu_index;
    let minor = d.gpu_minor;
    let device = d.device.clone();
    let PreparedKind::Mig {
        profile,
        profile_id,
        placement,
        created: create,
        gi,
        ci,
        mig_uuid,
        cap_minors,
        ..
    } = &mut d.kind
    else {
        return Ok(());
    };
    let (gid, c) = if *create {
        create_instances(b, g, profile, *profile_id, *placement, made)?
    } else {
        static_instance(live, g, *profile_id, *placement).ok_or_else(|| {
            ClaimError::StaticMissing {
                device: device.clone(),
                gpu: g,
                profile: profile.clone(),
                placement: *placement,
            }
        })?
    };
    let cid = c.id;
    *gi = Some(gid);
    *ci = Some(cid);
    let Some(uuid) = c.mig_uuid else {
        return Err(ClaimError::Backend {
            op: format!("read MIG UUID of GPU {g} GI {gid} CI {cid}"),
            source: BackendError::NoSuch {
                what: format!("MIG UUID for GPU {g} GI {gid} CI {cid}"),
            },
        });
    };
    *mig_uuid = Some(uuid);
    *cap_minors = capability_minors(b, g, minor, gid, cid)?;
    Ok(())
}

/// An MPS share of an instance other claims already share: that
/// instance's ids, MIG UUID and capability minors copied into `kind`;
/// whether it was one.
fn use_shared_instance(kind: &mut PreparedKind, shared: &BTreeMap<String, DeviceRecord>) -> bool {
    let PreparedKind::Mig {
        gi,
        ci,
        mig_uuid,
        cap_minors,
        mps: Some(share),
        ..
    } = kind
    else {
        return false;
    };
    let Some(PreparedKind::Mig {
        gi: Some(sg),
        ci: Some(sc),
        mig_uuid: Some(su),
        cap_minors: sm,
        ..
    }) = shared.get(&share.unit).map(|r| &r.kind)
    else {
        return false;
    };
    *gi = Some(*sg);
    *ci = Some(*sc);
    *mig_uuid = Some(su.clone());
    cap_minors.clone_from(sm);
    true
}

/// The instance a static device names: the GPU instance of `profile_id` at
/// `placement` on GPU `g` that is live, with its first compute instance.
fn static_instance(
    live: &Live,
    g: u32,
    profile_id: u32,
    placement: carve_model::Placement,
) -> Option<(u32, carve_gpu::ComputeInstanceInfo)> {
    live.get(&g)
        .and_then(|v| {
            v.iter()
                .find(|i| i.placement == placement && i.profile_id == profile_id)
        })
        .and_then(|i| i.compute_instances.first().map(|c| (i.id, c.clone())))
}

/// The minors of the capability files of GPU instance `gid` and of its
/// compute instance `cid` on GPU `g` (minor `minor`), in that order.
fn capability_minors(
    b: &dyn GpuBackend,
    g: u32,
    minor: u32,
    gid: u32,
    cid: u32,
) -> Result<Vec<u32>, ClaimError> {
    Ok(vec![
        b.capability_minor(minor, gid, None)
            .map_err(backend_err(format!("capability of GPU {g} GI {gid}")))?,
        b.capability_minor(minor, gid, Some(cid))
            .map_err(backend_err(format!(
                "capability of GPU {g} GI {gid} CI {cid}"
            )))?,
    ])
}

/// Create a GPU instance of `profile` at `placement` and its compute
/// instance, each pushed on `made` as soon as it exists. Blocking.
fn create_instances(
    b: &dyn GpuBackend,
    g: u32,
    profile: &str,
    profile_id: u32,
    placement: carve_model::Placement,
    made: &mut Vec<(u32, u32, Option<u32>)>,
) -> Result<(u32, carve_gpu::ComputeInstanceInfo), ClaimError> {
    let info = b
        .create_gpu_instance(g, profile_id, placement)
        .map_err(backend_err(format!(
            "create GPU instance {profile} at {placement} on GPU {g}"
        )))?;
    made.push((g, info.id, None));
    let c = b
        .create_compute_instance(g, info.id)
        .map_err(backend_err(format!(
            "create compute instance in GPU {g} GI {}",
            info.id
        )))?;
    if let Some(last) = made.last_mut() {
        last.2 = Some(c.id);
    }
    Ok((info.id, c))
}

/// Destroy what [`make_devices`] made, last first; errors are logged
/// (recovery sweeps what stays). Blocking.
fn roll_back(b: &dyn GpuBackend, retry: Retry, made: &[(u32, u32, Option<u32>)]) {
    for (g, gi, ci) in made.iter().rev() {
        let r = ci
            .map_or(Ok(()), |c| {
                with_retry(retry, "rollback: destroy compute instance", || {
                    b.destroy_compute_instance(*g, *gi, c)
                })
            })
            .and_then(|()| {
                with_retry(retry, "rollback: destroy GPU instance", || {
                    b.destroy_gpu_instance(*g, *gi)
                })
            });
        if let Err(re) = r {
            tracing::error!(gpu = g, gi, error = %re, "rollback after failed prepare");
        }
    }
}

/// Destroy the instances the plugin created for these devices (CI then GI),
/// verifying by placement that the id still names the same instance.
/// Blocking.
pub(super) fn destroy_devices(
    b: &dyn GpuBackend,
    retry: Retry,
    devs: &[DeviceRecord],
    keep: &BTreeSet<String>,
) -> Result<(), ClaimError> {
    let mut cache: BTreeMap<u32, Vec<GpuInstanceInfo>> = BTreeMap::new();
    for d in devs {
        let PreparedKind::Mig {
            placement,
            profile_id,
            created: true,
            gi,
            ci,
            mps,
            ..
        } = &d.kind
        else {
            continue;
        };
        if mps.as_ref().is_some_and(|s| keep.contains(&s.unit)) {
            // Other claims still share this instance through MPS.
            continue;
        }
        let g = d.gpu_index;
        let instances = match cache.entry(g) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => e.insert(
                b.gpu_instances(g)
                    .map_err(backend_err(format!("list GPU instances of GPU {g}")))?,
            ),
        };
        let found = instances
            .iter()
            .find(|i| Some(i.id) == *gi && i.placement == *placement)
            .or_else(|| {
                instances
                    .iter()
                    .find(|i| i.placement == *placement && i.profile_id == *profile_id)
            });
        let Some(i) = found else { continue };
        let mut i = i.clone();
        if i.compute_instances.is_empty()
            && let Some(c) = ci
        {
            // Listed before the CI existed; try the recorded one too.
            i.compute_instances.push(carve_gpu::ComputeInstanceInfo {
                id: *c,
                profile_id: 0,
                mig_uuid: None,
            });
        }
        destroy_instance(b, retry, g, &i)?;
    }
    Ok(())
}

/// Call `f` until it succeeds, reports already-done, or fails fatally;
/// `IN_USE` is retried with backoff. Blocking.
fn with_retry(
    retry: Retry,
    op: &str,
    mut f: impl FnMut() -> Result<(), BackendError>,
) -> Result<(), ClaimError> {
    let mut delay = retry.initial;
    let attempts = retry.attempts.max(1);
    for n in 1..=attempts {
        match f() {
            Ok(()) => return Ok(()),
            Err(e) => match e.disposition() {
                Disposition::AlreadyDone => return Ok(()),
                Disposition::Retry if n < attempts => {
                    tracing::warn!(op, attempt = n, error = %e, "in use; retrying");
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(retry.max);
                }
                Disposition::Retry => {
                    return Err(ClaimError::Busy {
                        op: op.to_string(),
                        attempts,
                        source: e,
                    });
                }
                Disposition::Fatal => {
                    return Err(ClaimError::Backend {
                        op: op.to_string(),
                        source: e,
                    });
                }
            },
        }
    }
    Ok(())
}

/// Destroy a GPU instance and its compute instances. Blocking.
pub(super) fn destroy_instance(
    backend: &dyn GpuBackend,
    retry: Retry,
    gpu: u32,
    gi: &GpuInstanceInfo,
) -> Result<(), ClaimError> {
    for ci in &gi.compute_instances {
        with_retry(
            retry,
            &format!(
                "destroy compute instance {} of GPU {gpu} GI {}",
                ci.id, gi.id
            ),
            || backend.destroy_compute_instance(gpu, gi.id, ci.id),
        )?;
    }
    with_retry(retry, &format!("destroy GPU {gpu} GI {}", gi.id), || {
        backend.destroy_gpu_instance(gpu, gi.id)
    })
}

fn describe(gi: &GpuInstanceInfo, profiles: &[MigProfile]) -> String {
    let p = profiles.iter().find(|p| p.id == gi.profile_id).map_or_else(
        || format!("profile id {}", gi.profile_id),
        |p| p.name.clone(),
    );
    format!("GPU instance {} ({p} at {})", gi.id, gi.placement)
}

/// Turn MIG mode off on GPU `g` if it has no instance; whether it did.
/// Blocking.
pub(super) fn disable_mig_if_empty(b: &dyn GpuBackend, g: u32) -> Result<bool, BackendError> {
    if b.gpu_instances(g)?.is_empty() {
        b.set_mig_mode(g, false)?;
        Ok(true)
    } else {
        Ok(false)
    }
}

/// GI/CI and stranded-slice gauges to set from NVML
/// ([`Driver::instance_gauges`]).
pub(super) struct InstanceGauges {
    metrics: Arc<carve_metrics::Metrics>,
    /// GPU index, UUID (the gauges' label) and spec.
    targets: Vec<(u32, String, carve_model::GpuSpec)>,
}

impl InstanceGauges {
    /// Read the GPUs' instances and set the gauges. Blocking.
    pub(super) fn run(&self, b: &dyn GpuBackend) {
        let m = &self.metrics;
        for (g, uuid, spec) in &self.targets {
            match b.gpu_instances(*g) {
                Ok(v) => {
                    let cis: usize = v.iter().map(|gi| gi.compute_instances.len()).sum();
                    m.set_instances(uuid, v.len() as u64, cis as u64);
                    let live: Vec<carve_model::Instance> = v
                        .iter()
                        .filter_map(|gi| {
                            let profile =
                                spec.profiles.iter().position(|p| p.id == gi.profile_id)?;
                            Some(carve_model::Instance {
                                profile,
                                start: gi.placement.start,
                            })
                        })
                        .collect();
                    if let Ok(occ) = carve_model::Occupancy::with(spec, &live) {
                        let st = occ.stranded();
                        m.set_stranded(
                            uuid,
                            u64::from(st.memory_slices),
                            u64::from(st.compute_slices),
                        );
                    }
                }
                Err(e) => tracing::debug!(gpu = g, error = %e, "instance count for metrics"),
            }
        }
    }
}

impl Driver {
    /// Set the GI/CI gauges of the MIG-capable GPUs among `gpus` from NVML
    /// (only with metrics configured), on a blocking thread. A failed read
    /// leaves the gauge as it was.
    pub(super) async fn record_instances(&self, gpus: impl IntoIterator<Item = u32>) {
        if let Some(job) = self.instance_gauges(gpus) {
            let b = self.backend.clone();
            let _ = blocking(move || job.run(&*b)).await;
        }
    }

    /// What [`Self::record_instances`] does, to run inside a blocking hop
    /// that already holds the GPUs' locks (prepare's and unprepare's
    /// hardware steps): `None` without metrics or MIG-capable GPUs.
    pub(super) fn instance_gauges(
        &self,
        gpus: impl IntoIterator<Item = u32>,
    ) -> Option<InstanceGauges> {
        let metrics = self.config.metrics.clone()?;
        let targets: Vec<(u32, String, carve_model::GpuSpec)> = gpus
            .into_iter()
            .filter_map(|g| self.gpus.get(&g))
            .filter(|g| g.info.mig_capable && !g.profiles.is_empty())
            .map(|g| {
                (
                    g.info.index,
                    g.info.uuid.clone(),
                    g.info.spec(g.profiles.clone()),
                )
            })
            .collect();
        (!targets.is_empty()).then_some(InstanceGauges { metrics, targets })
    }
}
