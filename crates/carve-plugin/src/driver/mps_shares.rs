//! MPS attachment and reconciliation, as the driver drives them: which
//! units a claim's shares use, what a prepare attaches and an unprepare
//! detaches (the daemons themselves are the `mps` module's), recovery's
//! reconciliation of the daemons with the kept claims, and supervision of
//! the daemons of prepared shares.

use std::collections::{BTreeMap, BTreeSet};

use carve_gpu::{ComputeMode, ComputeTarget, GpuBackend};
use carve_model::DeviceName;
use k8s_openapi::api::resource::v1::ResourceClaim;

use super::error::backend_err;
use super::mig::Live;
use super::recovery::RecoveryReport;
use super::state::prune_compute_modes;
use super::{ClaimError, Driver, blocking};
use crate::checkpoint::{CheckpointBody, ClaimState, DeviceRecord, PreparedKind};
use crate::config::MpsSetup;
use crate::error::PluginError;

/// What the other claims on a prepare's GPUs share through MPS, as the
/// checkpoint says (it does not change while the GPUs' locks are held).
#[derive(Debug, Default)]
pub(super) struct Neighbours {
    /// MIG-MPS units other claims share, with one of their device records.
    pub(super) shared: BTreeMap<String, DeviceRecord>,
    /// GPUs on which another claim holds a whole-GPU MPS share.
    pub(super) mps_on: BTreeSet<u32>,
    /// Hard memory limits other claims hold: (pod cgroup, dmem key) → claim.
    pub(super) memory: BTreeMap<(std::path::PathBuf, String), String>,
}

impl Neighbours {
    pub(super) fn of(st: &CheckpointBody, uid: &str) -> Self {
        let mps_on = st
            .claims
            .values()
            .filter(|c| c.uid != uid)
            .flat_map(|c| c.devices.iter())
            .filter(|d| matches!(d.kind, PreparedKind::Mps { .. }))
            .map(|d| d.gpu_index)
            .collect();
        let memory = st
            .memory_limits_set_by_plugin
            .iter()
            .filter(|m| m.claim_uid != uid)
            .map(|m| ((m.cgroup.clone(), m.key.clone()), m.claim_uid.clone()))
            .collect();
        Self {
            shared: Driver::shared_units(st, uid),
            mps_on,
            memory,
        }
    }

    /// Whether `d` is an MPS share of a unit another claim already shares.
    pub(super) fn shares_unit_of(&self, d: &DeviceRecord) -> bool {
        d.kind
            .mps()
            .is_some_and(|s| self.shared.contains_key(&s.unit))
    }
}

/// The MPS units the kept claims of `body` use, with their clients.
fn kept_units(
    body: &CheckpointBody,
    pci: &BTreeMap<u32, String>,
) -> BTreeMap<String, (carve_mps::MpsTarget, Vec<carve_mps::ClientSpec>)> {
    let mut keep: BTreeMap<String, (carve_mps::MpsTarget, Vec<carve_mps::ClientSpec>)> =
        BTreeMap::new();
    for c in body.claims.values() {
        for d in &c.devices {
            let (Some(t), Some(cl)) = (
                crate::mps::target_of(d, pci),
                crate::mps::client_of(&c.uid, d),
            ) else {
                continue;
            };
            keep.entry(t.unit.clone())
                .or_insert((t, Vec::new()))
                .1
                .push(cl);
        }
    }
    keep
}

/// The shares' edits and cgroups as the reconciled daemons have them, by
/// (claim UID, share ID).
fn refresh_shares(
    body: &mut CheckpointBody,
    shares: &BTreeMap<(String, String), (carve_mps::ShareEdits, Option<std::path::PathBuf>)>,
) {
    for c in body.claims.values_mut() {
        for d in &mut c.devices {
            let Some(sid) = d.share_id.clone() else {
                continue;
            };
            if let PreparedKind::Mps { share }
            | PreparedKind::Mig {
                mps: Some(share), ..
            } = &mut d.kind
                && let Some((edits, cgroup)) = shares.get(&(c.uid.clone(), sid))
            {
                share.edits = Some(edits.clone());
                share.cgroup.clone_from(cgroup);
            }
        }
    }
}

/// The hard memory limit of every kept claim's shares that the checkpoint
/// does not record (a claim adopted after an unusable checkpoint: the limit
/// was set at its prepare, the record went with the file), rebuilt from the
/// shares as its prepare planned it (per pod cgroup and GPU, the sum of the
/// claim's shares), so its unprepare clears the limit.
fn adopt_memory_records(body: &mut CheckpointBody) {
    let mut sums: BTreeMap<(String, std::path::PathBuf, String), (String, u64)> = BTreeMap::new();
    for c in body.claims.values() {
        for d in &c.devices {
            let Some(share) = d.kind.mps() else { continue };
            let (Some(hard), Some(cg)) = (&share.hard_memory, &share.cgroup) else {
                continue;
            };
            let e = sums
                .entry((c.uid.clone(), cg.clone(), hard.key.clone()))
                .or_insert((d.gpu_uuid.clone(), 0));
            e.1 += share.limits.memory_limit_mib;
        }
    }
    for ((claim_uid, cgroup, key), (gpu_uuid, mib)) in sums {
        let recorded = body
            .memory_limits_set_by_plugin
            .iter()
            .any(|m| m.claim_uid == claim_uid && m.cgroup == cgroup && m.key == key);
        if !recorded {
            tracing::warn!(claim.uid = %claim_uid, cgroup = %cgroup.display(), key = %key, mib, "hard memory limit of an adopted claim recorded again");
            body.memory_limits_set_by_plugin
                .insert(crate::checkpoint::MemoryLimitRecord {
                    claim_uid,
                    cgroup,
                    gpu_uuid,
                    key,
                    mib,
                });
        }
    }
}

/// What a prepare needs to attach its MPS shares, owned by its blocking hop.
pub(super) struct MpsJob {
    setup: MpsSetup,
    claim_uid: String,
    /// Pod UIDs of the claim's `reservedFor`.
    pods: Vec<String>,
    /// PCI bus ids by GPU index.
    pci: BTreeMap<u32, String>,
}

impl MpsJob {
    pub(super) fn claim_uid(&self) -> &str {
        &self.claim_uid
    }

    /// The hard memory limits of `records`' shares (read-only: resolves the
    /// pod cgroup). Blocking.
    pub(super) fn plan_memory(
        &self,
        records: &[DeviceRecord],
        neighbours: &Neighbours,
    ) -> Result<crate::mps::MemoryPlan, ClaimError> {
        crate::mps::plan_memory(
            &self.setup,
            &self.claim_uid,
            &self.pods,
            records,
            &neighbours.memory,
        )
    }

    /// Set the planned limits on the records' pod cgroups; the records
    /// learn their cgroups (or why they stay `client`). On error the limits
    /// set are cleared. Blocking.
    pub(super) fn set_memory(
        &self,
        plan: &crate::mps::MemoryPlan,
        records: &mut [DeviceRecord],
    ) -> Result<(), ClaimError> {
        for (i, d) in records.iter_mut().enumerate() {
            if let PreparedKind::Mps { share } = &mut d.kind {
                if let Some(cg) = plan.cgroups.get(&i) {
                    share.cgroup = Some(cg.clone());
                } else if let Some(why) = plan.client.get(&i) {
                    share.hard_memory = None;
                    share.memory_client_why = Some(why.clone());
                }
            }
        }
        let device = records
            .iter()
            .find(|d| d.kind.mps().is_some_and(|s| s.cgroup.is_some()))
            .map_or_else(String::new, |d| d.device.clone());
        crate::mps::set_memory(&self.setup, &device, &plan.limits)
    }

    /// Clear the planned limits again (a later prepare step failed). Blocking.
    pub(super) fn clear_memory(&self, plan: &crate::mps::MemoryPlan) {
        if let Err(e) = crate::mps::clear_memory(&self.setup, &plan.limits) {
            tracing::error!(claim.uid = %self.claim_uid, error = %e, "clearing memory limits after a failed prepare");
        }
    }

    /// The compute modes of the GPUs that whole-GPU MPS shares among
    /// `records` are on. Blocking.
    pub(super) fn compute_modes(
        b: &dyn GpuBackend,
        records: &[DeviceRecord],
    ) -> Result<BTreeMap<u32, ComputeMode>, ClaimError> {
        records
            .iter()
            .filter(|d| matches!(d.kind, PreparedKind::Mps { .. }))
            .map(|d| {
                let g = d.gpu_index;
                b.compute_mode(ComputeTarget::Gpu(g))
                    .map(|m| (g, m))
                    .map_err(backend_err(format!("read compute mode of GPU {g}")))
            })
            .collect()
    }

    /// Attach the shares of `records` to their daemons (starting them as
    /// needed; `modes`: the compute modes read of whole GPUs). Returns the
    /// devices whose compute mode carve set. On error the shares attached
    /// so far are detached again. Blocking.
    pub(super) fn attach(
        &self,
        b: &dyn GpuBackend,
        records: &mut [DeviceRecord],
        modes: &BTreeMap<u32, ComputeMode>,
    ) -> Result<Vec<String>, ClaimError> {
        let cx = crate::mps::AttachCtx {
            setup: &self.setup,
            backend: b,
            claim_uid: &self.claim_uid,
            pci: &self.pci,
            gpu_modes: modes,
        };
        crate::mps::attach(&cx, records).map(|a| a.compute_mode_set)
    }
}

/// The pods a claim is reserved for (`status.reservedFor`), by UID: hard
/// MPS limits bind a share to one of their cgroups.
fn reserved_pods(rc: &ResourceClaim) -> Vec<String> {
    rc.status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .map(|v| {
            v.iter()
                .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
                .map(|r| r.uid.clone())
                .collect()
        })
        .unwrap_or_default()
}

impl Driver {
    /// The MPS part of a prepare of `rc`'s `records`: `None` without MPS
    /// shares, an error where the plugin runs without MPS.
    pub(super) fn mps_job(
        &self,
        rc: &ResourceClaim,
        records: &[DeviceRecord],
    ) -> Result<Option<MpsJob>, ClaimError> {
        Ok(self.mps_setup(records)?.map(|setup| MpsJob {
            setup,
            claim_uid: rc.metadata.uid.clone().unwrap_or_default(),
            pods: reserved_pods(rc),
            pci: self.pci_map(),
        }))
    }

    /// MIG-MPS units that claims other than `except` hold, with one of their
    /// device records (which knows the instance).
    pub(super) fn shared_units(
        st: &CheckpointBody,
        except: &str,
    ) -> BTreeMap<String, DeviceRecord> {
        let mut out = BTreeMap::new();
        for c in st.claims.values().filter(|c| c.uid != except) {
            for d in &c.devices {
                if let PreparedKind::Mig { mps: Some(s), .. } = &d.kind {
                    out.entry(s.unit.clone()).or_insert_with(|| d.clone());
                }
            }
        }
        out
    }

    /// The `carve_mps_daemons` gauge: units with at least one prepared share.
    pub(super) fn record_mps(&self, st: &CheckpointBody) {
        if let Some(m) = &self.config.metrics {
            let units: BTreeSet<&str> = st
                .claims
                .values()
                .flat_map(|c| c.devices.iter())
                .filter_map(|d| d.kind.mps().map(|s| s.unit.as_str()))
                .collect();
            m.set_mps_daemons(units.len() as u64);
        }
    }

    /// The setup for a record's MPS shares; an error when the plugin runs without MPS.
    pub(super) fn mps_setup(
        &self,
        devices: &[DeviceRecord],
    ) -> Result<Option<MpsSetup>, ClaimError> {
        match devices.iter().find(|d| d.kind.mps().is_some()) {
            None => Ok(None),
            Some(d) => self
                .config
                .mps
                .clone()
                .map(Some)
                .ok_or_else(|| ClaimError::MpsDisabled {
                    device: d.device.clone(),
                }),
        }
    }

    /// Recovery's MPS step: the daemons run exactly the kept claims' shares
    /// (their edits and cgroups refreshed into the records), and compute
    /// modes carve set where no kept share is go back to `DEFAULT`.
    pub(super) async fn reconcile_mps(
        &self,
        body: &mut CheckpointBody,
        live: &Live,
        report: &mut RecoveryReport,
    ) -> Result<(), PluginError> {
        let Some(setup) = self.config.mps.clone() else {
            if let Some(d) = body
                .claims
                .values()
                .flat_map(|c| c.devices.iter())
                .find(|d| d.kind.mps().is_some())
            {
                tracing::error!(device = %d.device, "prepared MPS shares exist but the plugin runs without MPS; their daemons are not supervised and unprepare will fail until MPS is configured again");
            }
            return Ok(());
        };
        self.clear_stale_memory(&setup, body, report).await?;
        let keep = kept_units(body, &self.pci_map());
        let uuids: BTreeMap<u32, String> = self
            .gpus
            .iter()
            .map(|(i, g)| (*i, g.info.uuid.clone()))
            .collect();
        let fallback = move |unit: &str| {
            unit.parse::<DeviceName>()
                .ok()
                .and_then(|n| uuids.get(&n.gpu()).cloned())
        };
        let s2 = setup.clone();
        let r = blocking(move || crate::mps::reconcile(&s2, &keep, &fallback))
            .await
            .map_err(|reason| PluginError::Task {
                what: "MPS recovery",
                reason,
            })?
            .map_err(|e| PluginError::MpsRecovery {
                source: Box::new(e),
            })?;
        refresh_shares(body, &r.shares);
        adopt_memory_records(body);
        report.mps_units = r.kept;
        report.mps_stopped = r.stopped;
        report.mps_failed = r.failed;
        self.restore_compute_modes(body, live, report).await?;
        self.record_mps(body);
        Ok(())
    }

    /// Hard memory limits recorded for claims that are not kept (a crash
    /// between the intent and the claim's completion, or during its
    /// unprepare): cleared through the tool and forgotten; one whose clear
    /// fails stays recorded (logged, retried at the next start).
    async fn clear_stale_memory(
        &self,
        setup: &MpsSetup,
        body: &mut CheckpointBody,
        report: &mut RecoveryReport,
    ) -> Result<(), PluginError> {
        let stale: Vec<_> = body
            .memory_limits_set_by_plugin
            .iter()
            .filter(|m| !body.claims.contains_key(&m.claim_uid))
            .cloned()
            .collect();
        if stale.is_empty() {
            return Ok(());
        }
        let s2 = setup.clone();
        let cleared = blocking(move || {
            stale
                .into_iter()
                .filter(|m| crate::mps::clear_memory(&s2, std::slice::from_ref(m)).is_ok())
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|reason| PluginError::Task {
            what: "MPS recovery",
            reason,
        })?;
        for m in &cleared {
            body.memory_limits_set_by_plugin.remove(m);
            report
                .memory_limits_cleared
                .push(format!("{} {}", m.cgroup.display(), m.key));
        }
        Ok(())
    }

    /// Compute modes carve set on devices no kept share uses: back to `DEFAULT`.
    async fn restore_compute_modes(
        &self,
        body: &mut CheckpointBody,
        live: &Live,
        report: &mut RecoveryReport,
    ) -> Result<(), PluginError> {
        let before = body.compute_mode_set_by_plugin.clone();
        prune_compute_modes(body);
        let stale: Vec<String> = before
            .difference(&body.compute_mode_set_by_plugin)
            .cloned()
            .collect();
        let mut targets = Vec::new();
        for u in &stale {
            if let Some(g) = self.gpus.values().find(|g| g.info.uuid == *u) {
                targets.push((u.clone(), carve_gpu::ComputeTarget::Gpu(g.info.index)));
            } else if let Some((g, gi, ci)) = live.iter().find_map(|(g, v)| {
                v.iter().find_map(|i| {
                    i.compute_instances
                        .iter()
                        .find(|c| c.mig_uuid.as_deref() == Some(u.as_str()))
                        .map(|c| (*g, i.id, c.id))
                })
            }) {
                targets.push((u.clone(), carve_gpu::ComputeTarget::Mig { gpu: g, gi, ci }));
            }
        }
        let b = self.backend.clone();
        let restored = blocking(move || {
            targets
                .into_iter()
                .filter_map(|(u, t)| {
                    match b.set_compute_mode(t, carve_gpu::ComputeMode::Default) {
                        Ok(()) => Some(u),
                        Err(e) => {
                            tracing::warn!(device = %u, error = %e, "restoring DEFAULT compute mode failed");
                            None
                        }
                    }
                })
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|reason| PluginError::Task {
            what: "MPS recovery",
            reason,
        })?;
        report.compute_mode_restored = restored;
        Ok(())
    }

    /// Keep the MPS daemons of prepared shares running: one that died is
    /// restarted with every share's limits re-applied. Returns the units that
    /// needed something, with what happened (or the error).
    pub async fn supervise_mps(&self) -> Vec<(String, Result<carve_mps::Ensure, ClaimError>)> {
        let Some(setup) = self.config.mps.clone() else {
            return Vec::new();
        };
        let pci = self.pci_map();
        let (units, gpus): (BTreeMap<String, carve_mps::MpsTarget>, BTreeSet<u32>) = {
            let st = self.state.lock().await;
            let mut units = BTreeMap::new();
            let mut gpus = BTreeSet::new();
            for c in st
                .claims
                .values()
                .filter(|c| c.state == ClaimState::PrepareCompleted)
            {
                for d in &c.devices {
                    if let Some(t) = crate::mps::target_of(d, &pci) {
                        gpus.insert(d.gpu_index);
                        units.entry(t.unit.clone()).or_insert(t);
                    }
                }
            }
            (units, gpus)
        };
        if units.is_empty() {
            return Vec::new();
        }
        let mut guards = Vec::new();
        for g in &gpus {
            if let Some(gpu) = self.gpus.get(g) {
                guards.push(gpu.lock.lock().await);
            }
        }
        let out = blocking(move || crate::mps::supervise(&setup, &units))
            .await
            .unwrap_or_else(|e| vec![("*".into(), Err(ClaimError::Task(e)))]);
        drop(guards);
        let out: Vec<_> = out
            .into_iter()
            // A fresh supervisor finds a live daemon "adopted": nothing was done.
            .filter(|(_, r)| {
                !matches!(
                    r,
                    Ok(carve_mps::Ensure::Running | carve_mps::Ensure::Adopted)
                )
            })
            .collect();
        for (unit, r) in &out {
            match r {
                Ok(e) => tracing::warn!(unit = %unit, outcome = ?e, "MPS daemon supervision"),
                Err(e) => tracing::error!(unit = %unit, error = %e, "MPS daemon supervision"),
            }
        }
        out
    }
}
