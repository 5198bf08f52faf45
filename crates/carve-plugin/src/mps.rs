//! The driver's MPS side: attach a claim's shares to their units' control
//! daemons (starting a daemon with its unit's first share, in
//! `EXCLUSIVE_PROCESS` compute mode), detach them (stopping the daemon and
//! restoring the compute mode after the last share), and reconcile daemons
//! with the checkpoint after a restart. Blocking; the driver calls it from
//! `spawn_blocking` with the GPU locks held.
//!
//! A unit is one shared whole GPU (`gpu-0-mps`) or one MIG instance
//! (`gpu-0-mig-1g10gb-3-mps`). The daemon's state (pid, clients, limits) lives
//! in `<state root>/mps/<unit>/state.json` ([`carve_mps::MpsControl`]); the
//! checkpoint records each claim's share (limits, cgroup, container edits), so
//! either side can be rebuilt from the other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use carve_gpu::{ComputeMode, ComputeTarget, GpuBackend};
use carve_mps::{ClientSpec, Ensure, MpsControl, MpsError, MpsTarget};

use crate::checkpoint::{DeviceRecord, MemoryLimitRecord, PreparedKind};
use crate::config::MpsSetup;
use crate::driver::ClaimError;

/// The daemon a device's share belongs to.
fn target(d: &DeviceRecord, pci_bus_id: Option<&str>) -> Option<(MpsTarget, ComputeTarget)> {
    match &d.kind {
        PreparedKind::Mps { share } => Some((
            MpsTarget {
                unit: share.unit.clone(),
                uuid: d.gpu_uuid.clone(),
                pci_bus_id: pci_bus_id.map(str::to_string),
                mig: false,
            },
            ComputeTarget::Gpu(d.gpu_index),
        )),
        PreparedKind::Mig {
            mps: Some(share),
            gi: Some(gi),
            ci: Some(ci),
            mig_uuid: Some(uuid),
            ..
        } => Some((
            MpsTarget {
                unit: share.unit.clone(),
                uuid: uuid.clone(),
                pci_bus_id: pci_bus_id.map(str::to_string),
                mig: true,
            },
            ComputeTarget::Mig {
                gpu: d.gpu_index,
                gi: *gi,
                ci: *ci,
            },
        )),
        _ => None,
    }
}

fn mps_err(device: &str) -> impl FnOnce(MpsError) -> ClaimError + '_ {
    move |source| ClaimError::Mps {
        device: device.to_string(),
        source: Box::new(source),
    }
}

/// The hard memory limits a claim's shares need: per (pod cgroup, GPU), the
/// sum of the claim's shares of that GPU. Decided before anything is set,
/// so the intent can be recorded first.
#[derive(Debug, Default)]
pub(crate) struct MemoryPlan {
    /// The limits to set, recorded in the checkpoint before `nvidia-smi` runs.
    pub limits: Vec<MemoryLimitRecord>,
    /// Per device index: the pod cgroup its share's limit is on.
    pub cgroups: BTreeMap<usize, PathBuf>,
    /// Per device index: why a share of a hard device stays `client`.
    pub client: BTreeMap<usize, String>,
}

/// Plan the hard memory limits of `devices` (shares with
/// [`crate::checkpoint::HardMemory`]). The limit goes on the claim's one
/// reserved pod's cgroup (the only cgroup that exists at prepare): with
/// several reserved pods no per-share bound can be set (a per-pod limit
/// would give each pod the whole share), so the share stays `client`, or the
/// claim fails where its config demands `hard`. A pod that already has a
/// limit on the GPU from another claim (`taken`: (cgroup, key) → claim) is
/// refused: one pod has one limit per GPU. Blocking (reads the cgroup tree).
///
/// # Errors
/// A per-claim error naming the device and the reason.
pub(crate) fn plan_memory(
    setup: &MpsSetup,
    claim_uid: &str,
    pods: &[String],
    devices: &[DeviceRecord],
    taken: &BTreeMap<(PathBuf, String), String>,
) -> Result<MemoryPlan, ClaimError> {
    let mut out = MemoryPlan::default();
    let mut sums: BTreeMap<(PathBuf, String), (String, u64)> = BTreeMap::new();
    let root = &setup.config.cgroup_root;
    for (i, d) in devices.iter().enumerate() {
        let Some(share) = d.kind.mps() else { continue };
        let Some(hard) = &share.hard_memory else {
            continue;
        };
        if pods.len() != 1 {
            let why = format!(
                "the claim is reserved for {} pods ({pods:?}) at prepare: a hard memory limit is set on one pod's cgroup, so it cannot bound a share used by several pods (nor pods added later)",
                pods.len()
            );
            if hard.demanded {
                return Err(ClaimError::BadShare {
                    device: d.device.clone(),
                    reason: format!("opaque MpsConfig requires memoryLimit hard, but {why}"),
                });
            }
            out.client.insert(i, why);
            continue;
        }
        let cg = carve_mps::pod_cgroup(root, &pods[0]).ok_or_else(|| ClaimError::NoPodCgroup {
            device: d.device.clone(),
            pods: pods.to_vec(),
            root: root.clone(),
        })?;
        let k = (cg.clone(), hard.key.clone());
        if let Some(other) = taken.get(&k) {
            return Err(ClaimError::BadShare {
                device: d.device.clone(),
                reason: format!(
                    "pod cgroup {} already has a hard memory limit on this GPU ({}) for claim {other}; a pod has one limit per GPU, so two claims' MPS shares of one GPU in one pod cannot each be bounded",
                    cg.display(),
                    hard.key
                ),
            });
        }
        let e = sums.entry(k).or_insert((d.gpu_uuid.clone(), 0));
        e.1 += share.limits.memory_limit_mib;
        out.cgroups.insert(i, cg);
    }
    out.limits = sums
        .into_iter()
        .map(|((cgroup, key), (gpu_uuid, mib))| MemoryLimitRecord {
            claim_uid: claim_uid.to_string(),
            cgroup,
            gpu_uuid,
            key,
            mib,
        })
        .collect();
    Ok(out)
}

fn mem_err(device: &str) -> impl FnOnce(carve_mps::memlimit::MemLimitError) -> ClaimError + '_ {
    move |source| ClaimError::MemoryLimit {
        device: device.to_string(),
        source: Box::new(source),
    }
}

fn tool(setup: &MpsSetup) -> Option<carve_mps::memlimit::MemLimits> {
    carve_mps::memlimit::MemLimits::of(
        &setup.support,
        &setup.config.cgroup_root,
        setup.config.timeout,
    )
}

/// Set `limits` (soft = hard, read back). On error the ones set so far (and
/// the failing one) are cleared again.
///
/// # Errors
/// The tool or the read-back failing, naming the device.
pub(crate) fn set_memory(
    setup: &MpsSetup,
    device: &str,
    limits: &[MemoryLimitRecord],
) -> Result<(), ClaimError> {
    if limits.is_empty() {
        return Ok(());
    }
    let t = tool(setup).ok_or_else(|| {
        ClaimError::Task(format!(
            "device {device}: hard memory limits planned without a usable nvidia-smi"
        ))
    })?;
    for (i, l) in limits.iter().enumerate() {
        let g = carve_mps::memlimit::Gpu {
            uuid: &l.gpu_uuid,
            key: &l.key,
        };
        if let Err(e) = t.set(&g, &l.cgroup, l.mib) {
            if let Err(ce) = clear_memory(setup, &limits[..=i]) {
                tracing::error!(device, error = %ce, "clearing memory limits after a failed set");
            }
            return Err(mem_err(device)(e));
        }
    }
    Ok(())
}

/// Clear `limits` (soft 0, then hard max; read back). Tries every one.
///
/// # Errors
/// The first failure, naming the cgroup.
pub(crate) fn clear_memory(
    setup: &MpsSetup,
    limits: &[MemoryLimitRecord],
) -> Result<(), ClaimError> {
    let Some(t) = tool(setup) else {
        return match limits.first() {
            None => Ok(()),
            Some(l) => Err(ClaimError::Task(format!(
                "memory limit of GPU {} on cgroup {}: no usable nvidia-smi to clear it",
                l.gpu_uuid,
                l.cgroup.display()
            ))),
        };
    };
    let mut first = None;
    for l in limits {
        let g = carve_mps::memlimit::Gpu {
            uuid: &l.gpu_uuid,
            key: &l.key,
        };
        if let Err(e) = t.clear(&g, &l.cgroup) {
            tracing::error!(cgroup = %l.cgroup.display(), gpu = %l.gpu_uuid, error = %e, "clearing a memory limit");
            first.get_or_insert(mem_err(&l.claim_uid)(e));
        }
    }
    first.map_or(Ok(()), Err)
}

/// Whether `l` is no longer set: its cgroup is gone, or its `dmem.max` line
/// is `max` and its `dmem.min` line `0` (read only).
pub(crate) fn memory_cleared(root: &std::path::Path, l: &MemoryLimitRecord) -> bool {
    let dir = root.join(&l.cgroup);
    if !dir.is_dir() {
        return true;
    }
    let val = |f: &str| {
        std::fs::read_to_string(dir.join(f))
            .ok()
            .and_then(|t| carve_mps::memlimit::dmem_value(&t, &l.key).map(str::to_string))
    };
    val("dmem.max").as_deref() == Some("max") && val("dmem.min").as_deref() == Some("0")
}

/// Put a unit's device into `EXCLUSIVE_PROCESS` before its daemon starts;
/// `known` is its mode if already read. Returns whether carve changed it (an
/// administrator's setting is left alone).
fn exclusive(
    b: &dyn GpuBackend,
    t: ComputeTarget,
    known: Option<ComputeMode>,
) -> Result<bool, carve_gpu::BackendError> {
    let mode = match known {
        Some(m) => m,
        None => b.compute_mode(t)?,
    };
    if mode == ComputeMode::ExclusiveProcess {
        return Ok(false);
    }
    b.set_compute_mode(t, ComputeMode::ExclusiveProcess)?;
    Ok(true)
}

/// What [`attach`] did besides filling in the shares' edits.
#[derive(Debug, Default)]
pub(crate) struct Attached {
    /// Unit UUIDs whose compute mode carve switched to `EXCLUSIVE_PROCESS`.
    pub compute_mode_set: Vec<String>,
}

/// Where [`attach`] finds and puts things besides the devices.
pub(crate) struct AttachCtx<'a> {
    pub setup: &'a MpsSetup,
    pub backend: &'a dyn GpuBackend,
    pub claim_uid: &'a str,
    /// PCI bus ids by GPU index.
    pub pci: &'a BTreeMap<u32, String>,
    /// Compute modes of whole GPUs, as prepare already read them.
    pub gpu_modes: &'a BTreeMap<u32, ComputeMode>,
}

/// Attach every MPS share of `devices` to its daemon and record the container
/// edits and cgroup in the share. On error, the shares attached so far are
/// detached again (their daemons stopped if now idle, compute modes
/// restored), so nothing of this claim stays behind.
pub(crate) fn attach(
    cx: &AttachCtx<'_>,
    devices: &mut [DeviceRecord],
) -> Result<Attached, ClaimError> {
    let mut out = Attached::default();
    let mut done = Vec::new();
    let mut failed = None;
    for (i, d) in devices.iter_mut().enumerate() {
        if d.kind.mps().is_none() {
            continue;
        }
        match attach_one(cx, d, &mut out) {
            Ok(()) => done.push(i),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    if let Some(e) = failed {
        let undo: Vec<DeviceRecord> = done.iter().map(|&i| devices[i].clone()).collect();
        let set: BTreeSet<String> = out.compute_mode_set.iter().cloned().collect();
        if let Err(re) = detach(cx.setup, cx.backend, cx.claim_uid, &undo, &set, cx.pci) {
            tracing::error!(claim.uid = cx.claim_uid, error = %re, "rollback of MPS shares after a failed prepare");
        }
        return Err(e);
    }
    Ok(out)
}

/// Attach one share (`d` has one). A compute mode set for it is undone if
/// the daemon refuses the share.
fn attach_one(
    cx: &AttachCtx<'_>,
    d: &mut DeviceRecord,
    out: &mut Attached,
) -> Result<(), ClaimError> {
    let (t, ct) = target(d, cx.pci.get(&d.gpu_index).map(String::as_str)).ok_or_else(|| {
        ClaimError::Task(format!(
            "device {}: the MIG instance of the MPS share is not known",
            d.device
        ))
    })?;
    // The pod cgroup of a hard memory limit (set before the attach).
    let cgroup = d.kind.mps().and_then(|s| s.cgroup.clone());
    let mut ctl = MpsControl::open(&cx.setup.config, &cx.setup.support, t.clone())
        .map_err(mps_err(&d.device))?;
    let known = match ct {
        ComputeTarget::Gpu(g) => cx.gpu_modes.get(&g).copied(),
        ComputeTarget::Mig { .. } => None,
    };
    let set_mode = ctl.is_idle()
        && exclusive(cx.backend, ct, known).map_err(|source| ClaimError::Backend {
            op: format!("set {} to EXCLUSIVE_PROCESS compute mode for MPS", t.uuid),
            source,
        })?;
    let Some(limits) = d.kind.mps().map(|s| s.limits) else {
        return Ok(());
    };
    let added = ctl.add_client(ClientSpec {
        claim_uid: cx.claim_uid.to_string(),
        share_id: d.share_id.clone().unwrap_or_default(),
        limits,
        cgroup: cgroup.clone(),
    });
    let edits = match added {
        Ok(e) => e,
        Err(e) => {
            if set_mode {
                let _ = cx.backend.set_compute_mode(ct, ComputeMode::Default);
            }
            return Err(mps_err(&d.device)(e));
        }
    };
    if set_mode {
        out.compute_mode_set.push(t.uuid.clone());
    }
    if let PreparedKind::Mps { share }
    | PreparedKind::Mig {
        mps: Some(share), ..
    } = &mut d.kind
    {
        share.edits = Some(edits);
        share.cgroup = cgroup;
    }
    Ok(())
}

/// Detach every MPS share of `devices` from its daemon; stop a daemon whose
/// last share this was and, where carve set it (`compute_set`), put its
/// device back into `DEFAULT` compute mode. Returns the UUIDs restored.
pub(crate) fn detach(
    setup: &MpsSetup,
    b: &dyn GpuBackend,
    claim_uid: &str,
    devices: &[DeviceRecord],
    compute_set: &BTreeSet<String>,
    pci: &BTreeMap<u32, String>,
) -> Result<Vec<String>, ClaimError> {
    let mut restored = Vec::new();
    for d in devices {
        if d.kind.mps().is_none() {
            continue;
        }
        let share_id = d.share_id.clone().unwrap_or_default();
        // A MIG share whose instance ids were never learnt never reached a daemon.
        let Some((t, ct)) = target(d, pci.get(&d.gpu_index).map(String::as_str)) else {
            continue;
        };
        let mut ctl = MpsControl::open(&setup.config, &setup.support, t.clone())
            .map_err(mps_err(&d.device))?;
        ctl.remove_client(claim_uid, &share_id)
            .map_err(mps_err(&d.device))?;
        if ctl.is_idle() {
            ctl.stop_if_idle().map_err(mps_err(&d.device))?;
            if compute_set.contains(&t.uuid) {
                match b.set_compute_mode(ct, ComputeMode::Default) {
                    Ok(()) => restored.push(t.uuid.clone()),
                    Err(e) => {
                        tracing::warn!(unit = %t.unit, error = %e, "restoring DEFAULT compute mode failed")
                    }
                }
            }
        }
    }
    Ok(restored)
}

/// What [`reconcile`] found and did.
#[derive(Debug, Default)]
pub(crate) struct Reconciled {
    /// Kept units and what their daemons needed.
    pub kept: Vec<(String, Ensure)>,
    /// Units whose daemon was stopped (no kept share).
    pub stopped: Vec<String>,
    /// Kept units that could not be restored, with why (supervision retries them).
    pub failed: Vec<(String, String)>,
    /// Per (claim UID, shareID) of the kept shares: the container edits and
    /// the cgroup the daemon has for it (authoritative over a share rebuilt
    /// from the API server, which knows neither).
    pub shares: BTreeMap<(String, String), (carve_mps::ShareEdits, Option<PathBuf>)>,
}

/// After a restart: every unit in `keep` (unit → its target and the shares the
/// checkpoint holds) gets exactly those clients and a running daemon (adopted
/// untouched if it still runs); a share the daemon already has keeps its
/// recorded limits and cgroup. Every other unit directory loses its clients
/// and its daemon.
pub(crate) fn reconcile(
    setup: &MpsSetup,
    keep: &BTreeMap<String, (MpsTarget, Vec<ClientSpec>)>,
    fallback_uuid: &dyn Fn(&str) -> Option<String>,
) -> Result<Reconciled, ClaimError> {
    let mut shares = BTreeMap::new();
    let mut kept = Vec::new();
    let mut failed = Vec::new();
    for (unit, (t, clients)) in keep {
        match restore_unit(setup, unit, t, clients, &mut shares) {
            Ok(what) => kept.push((unit.clone(), what)),
            // One unit that cannot be brought back must not keep the plugin
            // (and every other GPU) from starting: supervision retries it.
            Err(e) => {
                tracing::error!(unit = %unit, error = %e, "MPS unit not restored at recovery");
                failed.push((unit.clone(), e.to_string()));
            }
        }
    }
    let mut stopped = Vec::new();
    let units = unit_dirs(&setup.config.mps_root());
    for unit in units.difference(&keep.keys().cloned().collect()) {
        let Some(uuid) = fallback_uuid(unit) else {
            continue;
        };
        if stop_unit(setup, unit, uuid)? {
            stopped.push(unit.clone());
        }
    }
    Ok(Reconciled {
        kept,
        stopped,
        failed,
        shares,
    })
}

/// The units that have a daemon directory under the MPS root.
fn unit_dirs(root: &std::path::Path) -> BTreeSet<String> {
    let mut units = BTreeSet::new();
    if let Ok(rd) = std::fs::read_dir(root) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.file_type().is_ok_and(|t| t.is_dir())
                && name.parse::<carve_model::DeviceName>().is_ok()
            {
                units.insert(name);
            }
        }
    }
    units
}

/// A kept unit's daemon running with exactly `clients` (stale ones removed,
/// missing ones added); each client's share edits and cgroup into `shares`.
fn restore_unit(
    setup: &MpsSetup,
    unit: &str,
    t: &MpsTarget,
    clients: &[ClientSpec],
    shares: &mut BTreeMap<(String, String), (carve_mps::ShareEdits, Option<PathBuf>)>,
) -> Result<Ensure, ClaimError> {
    let mut ctl =
        MpsControl::open(&setup.config, &setup.support, t.clone()).map_err(mps_err(unit))?;
    let wanted: BTreeSet<(String, String)> = clients
        .iter()
        .map(|c| (c.claim_uid.clone(), c.share_id.clone()))
        .collect();
    let stale: Vec<(String, String)> = ctl
        .clients()
        .map(|c| (c.claim_uid.clone(), c.share_id.clone()))
        .filter(|k| !wanted.contains(k))
        .collect();
    let what = ctl.ensure_running().map_err(mps_err(unit))?;
    for (c, s) in &stale {
        ctl.remove_client(c, s).map_err(mps_err(unit))?;
    }
    for c in clients {
        let key = (c.claim_uid.clone(), c.share_id.clone());
        let got = match ctl.share(&c.claim_uid, &c.share_id) {
            Some(s) => s,
            None => {
                let e = ctl.add_client(c.clone()).map_err(mps_err(unit))?;
                (e, c.cgroup.clone())
            }
        };
        shares.insert(key, got);
    }
    Ok(what)
}

/// A unit no kept share uses: its clients removed, its daemon stopped if it
/// runs. Returns whether it stopped one.
fn stop_unit(setup: &MpsSetup, unit: &str, uuid: String) -> Result<bool, ClaimError> {
    let t = MpsTarget {
        unit: unit.to_string(),
        uuid,
        pci_bus_id: None,
        mig: unit
            .parse::<carve_model::DeviceName>()
            .is_ok_and(|n| n.mig_placement().is_some()),
    };
    let mut ctl = MpsControl::open(&setup.config, &setup.support, t).map_err(mps_err(unit))?;
    let clients: Vec<(String, String)> = ctl
        .clients()
        .map(|c| (c.claim_uid.clone(), c.share_id.clone()))
        .collect();
    for (c, s) in &clients {
        ctl.remove_client(c, s).map_err(mps_err(unit))?;
    }
    ctl.stop_if_idle().map_err(mps_err(unit))
}

/// Keep the daemons of `units` running: restart (with every share's limits
/// re-applied) one that died. Returns what each unit needed.
pub(crate) fn supervise(
    setup: &MpsSetup,
    units: &BTreeMap<String, MpsTarget>,
) -> Vec<(String, Result<Ensure, ClaimError>)> {
    units
        .iter()
        .map(|(unit, t)| {
            let r = MpsControl::open(&setup.config, &setup.support, t.clone())
                .and_then(|mut c| c.ensure_running())
                .map_err(mps_err(unit));
            (unit.clone(), r)
        })
        .collect()
}

/// The daemon target of a prepared device with an MPS share.
pub(crate) fn target_of(d: &DeviceRecord, pci: &BTreeMap<u32, String>) -> Option<MpsTarget> {
    target(d, pci.get(&d.gpu_index).map(String::as_str)).map(|(t, _)| t)
}

/// The client spec a prepared share corresponds to.
pub(crate) fn client_of(claim_uid: &str, d: &DeviceRecord) -> Option<ClientSpec> {
    let s = d.kind.mps()?;
    Some(ClientSpec {
        claim_uid: claim_uid.to_string(),
        share_id: d.share_id.clone()?,
        limits: s.limits,
        cgroup: s.cgroup.clone(),
    })
}
