//! Recovery and garbage collection. At start the driver converges from
//! NVML truth and the checkpoint ([`Driver::recover`]): completed claims are
//! kept, half-done ones rolled back, orphan instances swept, MIG modes the
//! plugin enabled turned off where nothing is left, the MPS daemons matched
//! to the kept shares, and the CDI directory made to hold exactly the kept
//! claims' specs. While it runs, [`Driver::gc_once`] unprepares claims whose
//! ResourceClaim is gone.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use carve_gpu::{BackendError, GpuInstanceInfo};
use carve_model::Placement;
use kube::api::{Api, ListParams};
use tracing::Instrument as _;

use super::mig::{Live, destroy_instance};
use super::plan::plan_claim;
use super::{ClaimError, Driver, blocking};
use crate::cdi::{self, CdiSpec};
use crate::checkpoint::{
    self, Checkpoint, CheckpointBody, ClaimRecord, ClaimState, DeviceRecord, PreparedKind,
    move_aside,
};
use crate::claim::ReadClaim;
use crate::config::GpuPolicy;
use crate::error::PluginError;

/// What recovery found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Completed claims kept.
    pub kept: Vec<String>,
    /// Half-prepared or half-unprepared claims rolled back.
    pub rolled_back: Vec<String>,
    /// Claims adopted from the API server after a corrupt checkpoint.
    pub adopted: Vec<String>,
    /// Instances destroyed by the orphan sweep, as `gpu/gi`.
    pub swept: Vec<String>,
    /// CDI specs rewritten because they were missing or different.
    pub cdi_rewritten: Vec<String>,
    /// Completed claims whose MIG instance is gone (kept; unprepare will succeed).
    pub missing_instances: Vec<String>,
    /// The checkpoint was from another boot and was discarded.
    pub discarded_other_boot: bool,
    /// Where an unusable checkpoint was moved.
    pub moved_aside: Option<PathBuf>,
    /// MPS units of kept claims and what their daemons needed (adopted
    /// untouched, restarted with the limits re-applied, ...).
    pub mps_units: Vec<(String, carve_mps::Ensure)>,
    /// MPS daemons stopped because no kept claim uses them.
    pub mps_stopped: Vec<String>,
    /// MPS units of kept claims that could not be restored, with why; the
    /// plugin starts anyway and supervision keeps trying.
    pub mps_failed: Vec<(String, String)>,
    /// Hard memory limits of claims not kept, cleared (`<cgroup> <dmem key>`).
    pub memory_limits_cleared: Vec<String>,
    /// Devices whose compute mode was set back to `DEFAULT`.
    pub compute_mode_restored: Vec<String>,
}

/// Up to this many claim UIDs are listed in the recovery summary; more are
/// only counted there (the full lists are logged at debug level).
const LISTED_CLAIMS: usize = 8;

impl RecoveryReport {
    /// The claims recovery kept, adopted and rolled back, `,`-joined, while
    /// they are [`LISTED_CLAIMS`] or fewer; `None` when there are more or none.
    #[must_use]
    pub fn short_claim_list(&self) -> Option<String> {
        let all: Vec<&str> = self
            .kept
            .iter()
            .chain(&self.adopted)
            .chain(&self.rolled_back)
            .map(String::as_str)
            .collect();
        (!all.is_empty() && all.len() <= LISTED_CLAIMS).then(|| all.join(","))
    }

    /// Logs the report: one info line of counts (the claim UIDs too while
    /// they are few), and the full lists at debug level.
    pub fn log(&self) {
        let moved_aside = self.moved_aside.as_ref().map(|p| p.display().to_string());
        tracing::info!(
            kept = self.kept.len(),
            adopted = self.adopted.len(),
            rolled_back = self.rolled_back.len(),
            claims = self.short_claim_list().as_deref(),
            instances_destroyed = self.swept.len(),
            missing_instances = self.missing_instances.len(),
            cdi_specs_rewritten = self.cdi_rewritten.len(),
            checkpoint_from_other_boot = self.discarded_other_boot,
            checkpoint_moved_aside = moved_aside.is_some(),
            checkpoint_moved_to = moved_aside.as_deref(),
            mps_units = self.mps_units.len(),
            mps_daemons_stopped = self.mps_stopped.len(),
            mps_units_failed = self.mps_failed.len(),
            memory_limits_cleared = self.memory_limits_cleared.len(),
            compute_modes_restored = self.compute_mode_restored.len(),
            "recovery done"
        );
        let join = |v: &[String]| v.join(",");
        let units: Vec<String> = self
            .mps_units
            .iter()
            .map(|(u, e)| format!("{u}: {e:?}"))
            .collect();
        let failed: Vec<String> = self
            .mps_failed
            .iter()
            .map(|(u, why)| format!("{u}: {why}"))
            .collect();
        tracing::debug!(
            kept = %join(&self.kept),
            adopted = %join(&self.adopted),
            rolled_back = %join(&self.rolled_back),
            instances_destroyed = %join(&self.swept),
            missing_instances = %join(&self.missing_instances),
            cdi_specs_rewritten = %join(&self.cdi_rewritten),
            mps_units = %units.join("; "),
            mps_daemons_stopped = %join(&self.mps_stopped),
            mps_units_failed = %failed.join("; "),
            memory_limits_cleared = %join(&self.memory_limits_cleared),
            compute_modes_restored = %join(&self.compute_mode_restored),
            "recovery details"
        );
    }
}

impl Driver {
    /// Unprepare claims whose ResourceClaim is gone or has another UID.
    /// Returns the UIDs cleaned up.
    pub async fn gc_once(&self) -> Vec<String> {
        let claims: Vec<ClaimRecord> = {
            let st = self.state.lock().await;
            st.claims
                .values()
                .filter(|c| c.state == ClaimState::PrepareCompleted)
                .cloned()
                .collect()
        };
        let mut done = Vec::new();
        for c in claims {
            let api: Api<ReadClaim> = Api::namespaced(self.client.clone(), &c.namespace);
            let get = api.get_opt(&c.name);
            let stale = match crate::api::bounded(&self.api_calls, self.config.api_timeout, get)
                .await
            {
                Ok(None) => true,
                Ok(Some(ReadClaim(rc))) => rc.metadata.uid.as_deref() != Some(c.uid.as_str()),
                Err(e) => {
                    tracing::warn!(claim.uid = %c.uid, claim = %c.claim_ref(), error = %e, "GC: reading claim failed");
                    false
                }
            };
            if stale {
                let span = tracing::info_span!("gc_unprepare", claim = %c.claim_ref());
                match self.unprepare_one(&c.uid).instrument(span).await {
                    Ok(()) => done.push(c.uid),
                    Err(e) => {
                        tracing::warn!(claim.uid = %c.uid, claim = %c.claim_ref(), error = %e, "GC: unprepare failed")
                    }
                }
            }
        }
        done
    }

    /// Converge from NVML truth and the checkpoint; see the crate docs.
    ///
    /// # Errors
    /// NVML or file failures that leave the state unknown.
    pub async fn recover(&self) -> Result<RecoveryReport, PluginError> {
        let mut report = RecoveryReport::default();
        let path = self.config.checkpoint_path.clone();
        let _host = self.host_lock().await.map_err(|source| PluginError::Io {
            what: "locking checkpoint",
            path: path.clone(),
            source,
        })?;
        self.make_dirs()?;
        let (mut body, rebuild) = self.load_checkpoint(&mut report)?;
        let mut live = self.read_live().await?;
        self.keep_completed(&mut body, &live, rebuild, &mut report)
            .await?;
        // MPS daemons: exactly the kept shares, before the sweep (a daemon's
        // server holds the instance it serves).
        self.reconcile_mps(&mut body, &live, &mut report).await?;
        self.sweep_orphans(&body, &mut live, &mut report).await?;
        self.restore_mig_modes(&mut body, &live).await;
        let wanted = self.rewrite_cdi_specs(&mut body, &mut report)?;
        self.remove_stale_files(&wanted);
        checkpoint::write_boot_marker(&path, &self.boot_id).map_err(|source| PluginError::Io {
            what: "writing the checkpoint's boot marker",
            path: path.clone(),
            source,
        })?;
        self.store_recovered(body).await?;
        self.record_instances(self.gpus.keys().copied().collect::<Vec<_>>())
            .await;
        report.log();
        Ok(report)
    }

    /// The checkpoint's and the CDI specs' directories.
    fn make_dirs(&self) -> Result<(), PluginError> {
        if let Some(dir) = self.config.checkpoint_path.parent() {
            std::fs::create_dir_all(dir).map_err(|source| PluginError::Io {
                what: "creating checkpoint directory",
                path: dir.to_path_buf(),
                source,
            })?;
        }
        std::fs::create_dir_all(&self.config.cdi_dir).map_err(|source| PluginError::Io {
            what: "creating CDI directory",
            path: self.config.cdi_dir.clone(),
            source,
        })
    }

    /// The checkpoint to start from, and whether it was unusable in this
    /// boot (moved aside: the claims are then rebuilt from NVML and the API
    /// server). One of another boot keeps only the MIG modes the plugin
    /// enabled (a reboot undoes everything else).
    fn load_checkpoint(
        &self,
        report: &mut RecoveryReport,
    ) -> Result<(CheckpointBody, bool), PluginError> {
        let path = &self.config.checkpoint_path;
        let fresh = || CheckpointBody {
            boot_id: self.boot_id.clone(),
            ..Default::default()
        };
        let e = match Checkpoint::load(path) {
            Ok(Some(c)) if c.body.boot_id == self.boot_id => return Ok((c.body, false)),
            Ok(Some(c)) => {
                tracing::warn!(old = %c.body.boot_id, new = %self.boot_id, "checkpoint from another boot: discarded");
                report.discarded_other_boot = true;
                let body = CheckpointBody {
                    boot_id: self.boot_id.clone(),
                    mig_enabled_by_plugin: c.body.mig_enabled_by_plugin,
                    claims: BTreeMap::new(),
                    // Compute modes do not survive a reboot, nor do the pod
                    // cgroups that held memory limits.
                    compute_mode_set_by_plugin: BTreeSet::new(),
                    memory_limits_set_by_plugin: BTreeSet::new(),
                };
                return Ok((body, false));
            }
            Ok(None) => return Ok((fresh(), false)),
            Err(e) => e,
        };
        let rebuild = match checkpoint::read_boot_marker(path) {
            // Recovery ran in an earlier boot, so the file was last
            // written then: a write that was not fsynced, torn by the
            // power loss, and one that recorded nothing a reboot
            // does not undo (`checkpoint` module docs).
            Some(old) if old != self.boot_id => {
                let aside = self.move_checkpoint_aside(report)?;
                tracing::warn!(error = %e, aside = %aside.display(), old = %old, new = %self.boot_id, "unusable checkpoint from another boot moved aside and discarded");
                report.discarded_other_boot = true;
                false
            }
            // Moved aside only once the rebuild has read the API server
            // ([`Self::keep_completed`]): a recovery that fails before (the
            // API server down or hung) leaves the file where the next start
            // finds it and rebuilds again, instead of finding no checkpoint
            // and sweeping the running claims' instances as orphans.
            _ => {
                tracing::error!(error = %e, "unusable checkpoint; rebuilding from NVML and the API server");
                true
            }
        };
        Ok((fresh(), rebuild))
    }

    /// Move the unusable checkpoint aside (kept for inspection).
    fn move_checkpoint_aside(&self, report: &mut RecoveryReport) -> Result<PathBuf, PluginError> {
        let path = &self.config.checkpoint_path;
        let aside = move_aside(path).map_err(|source| PluginError::Io {
            what: "moving corrupt checkpoint aside",
            path: path.clone(),
            source,
        })?;
        report.moved_aside = Some(aside.clone());
        Ok(aside)
    }

    /// NVML truth: the instances of every MIG-capable GPU.
    async fn read_live(&self) -> Result<Live, PluginError> {
        let b = self.backend.clone();
        let ids: Vec<u32> = self
            .gpus
            .values()
            .filter(|g| g.info.mig_capable)
            .map(|g| g.info.index)
            .collect();
        blocking(move || {
            ids.into_iter()
                .map(|g| {
                    b.gpu_instances(g)
                        .map(|v| (g, v))
                        .map_err(|source| PluginError::Backend {
                            op: format!("list GPU instances of GPU {g}"),
                            source,
                        })
                })
                .collect::<Result<_, _>>()
        })
        .await
        .map_err(|reason| PluginError::Task {
            what: "recovery",
            reason,
        })?
    }

    /// Keep completed claims, their ids refreshed from NVML; roll back the
    /// rest (their CDI specs removed). After an unusable checkpoint, adopt
    /// the claims the API server allocated here whose instances exist.
    async fn keep_completed(
        &self,
        body: &mut CheckpointBody,
        live: &Live,
        rebuild: bool,
        report: &mut RecoveryReport,
    ) -> Result<(), PluginError> {
        let mut kept = BTreeMap::new();
        for (uid, mut rec) in std::mem::take(&mut body.claims) {
            if rec.state != ClaimState::PrepareCompleted {
                report.rolled_back.push(uid.clone());
                if let Some(p) = &rec.cdi_spec {
                    cdi::remove(p)?;
                }
                continue;
            }
            if !self.refresh_from_nvml(&mut rec, live) {
                report.missing_instances.push(uid.clone());
            }
            kept.insert(uid, rec);
        }
        if rebuild {
            let adopted = self.adopt_from_api(live).await?;
            let aside = self.move_checkpoint_aside(report)?;
            tracing::warn!(aside = %aside.display(), adopted = adopted.len(), "unusable checkpoint moved aside; claims rebuilt from NVML and the API server");
            for rec in adopted {
                report.adopted.push(rec.uid.clone());
                kept.insert(rec.uid.clone(), rec);
            }
        }
        report.kept = kept
            .keys()
            .filter(|k| !report.adopted.contains(k))
            .cloned()
            .collect();
        body.claims = kept;
        Ok(())
    }

    /// Destroy the instances on dynamic GPUs that no kept claim owns, and
    /// take them out of `live`.
    async fn sweep_orphans(
        &self,
        body: &CheckpointBody,
        live: &mut Live,
        report: &mut RecoveryReport,
    ) -> Result<(), PluginError> {
        let owned: BTreeSet<(u32, Placement, u32)> = body
            .claims
            .values()
            .flat_map(|c| c.devices.iter())
            .filter_map(|d| match &d.kind {
                PreparedKind::Mig {
                    placement,
                    profile_id,
                    ..
                } => Some((d.gpu_index, *placement, *profile_id)),
                PreparedKind::Gpu | PreparedKind::TimeSlice | PreparedKind::Mps { .. } => None,
            })
            .collect();
        let mut orphans: Vec<(u32, GpuInstanceInfo)> = Vec::new();
        for (g, instances) in live.iter() {
            if self.gpus[g].policy != GpuPolicy::Dynamic {
                continue;
            }
            for i in instances {
                if !owned.contains(&(*g, i.placement, i.profile_id)) {
                    orphans.push((*g, i.clone()));
                }
            }
        }
        let b = self.backend.clone();
        let retry = self.config.unprepare_retry;
        let o2 = orphans.clone();
        blocking(move || -> Result<(), ClaimError> {
            for (g, i) in &o2 {
                destroy_instance(&*b, retry, *g, i)?;
            }
            Ok(())
        })
        .await
        .map_err(|reason| PluginError::Task {
            what: "orphan sweep",
            reason,
        })?
        .map_err(|e| PluginError::Sweep {
            source: Box::new(e),
        })?;
        for (g, i) in &orphans {
            report.swept.push(format!("{g}/{}", i.id));
            if let Some(v) = live.get_mut(g) {
                v.retain(|x| x.id != i.id);
            }
        }
        Ok(())
    }

    /// MIG mode back off where the plugin enabled it and nothing is left.
    async fn restore_mig_modes(&self, body: &mut CheckpointBody, live: &Live) {
        for gpu in self.gpus.values() {
            let g = gpu.info.index;
            let used = body
                .claims
                .values()
                .any(|c| c.devices.iter().any(|d| d.gpu_index == g));
            if !body.mig_enabled_by_plugin.contains(&gpu.info.uuid)
                || gpu.info.architecture.mig_mode_needs_reset()
                || used
                || live.get(&g).is_some_and(|v| !v.is_empty())
            {
                continue;
            }
            let b = self.backend.clone();
            match blocking(move || b.set_mig_mode(g, false)).await {
                Ok(Ok(_)) => {
                    body.mig_enabled_by_plugin.remove(&gpu.info.uuid);
                }
                Ok(Err(e)) => tracing::warn!(gpu = g, error = %e, "disabling MIG mode failed"),
                Err(e) => tracing::warn!(gpu = g, error = %e, "disabling MIG mode failed"),
            }
        }
    }

    /// Verify or rewrite the kept claims' CDI specs; returns their paths
    /// (every other spec of ours is then removed).
    fn rewrite_cdi_specs(
        &self,
        body: &mut CheckpointBody,
        report: &mut RecoveryReport,
    ) -> Result<BTreeSet<PathBuf>, PluginError> {
        let mut wanted = BTreeSet::new();
        let nd = self.current_node_driver();
        for rec in body.claims.values_mut() {
            let path = cdi::claim_spec_path(&self.config.cdi_dir, &rec.uid);
            match Self::cdi_spec_for(rec, &nd, &self.config.driver.proc_driver_nvidia) {
                Ok(spec) => {
                    if CdiSpec::read(&path).as_ref() != Some(&spec) {
                        spec.write(&path, self.config.write_fault)?;
                        report.cdi_rewritten.push(rec.uid.clone());
                    }
                }
                Err(ClaimError::Cdi(e)) => return Err(e.into()),
                Err(e) => {
                    // The driver or a capability file is not found now: keep
                    // the spec written when the claim was prepared.
                    tracing::error!(claim.uid = %rec.uid, error = %e, "cannot rebuild the claim's CDI spec; keeping the one on disk");
                }
            }
            rec.cdi_spec = Some(path.clone());
            wanted.insert(path);
        }
        Ok(wanted)
    }

    /// Remove CDI specs of ours not in `wanted`, and temporary files a
    /// checkpoint write left.
    fn remove_stale_files(&self, wanted: &BTreeSet<PathBuf>) {
        if let Ok(rd) = std::fs::read_dir(&self.config.cdi_dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let ours = name.starts_with("k8s.gpu.carve.dev-claim_")
                    || name.starts_with(".k8s.gpu.carve.dev-claim_");
                if ours && !wanted.contains(&e.path()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let cp = &self.config.checkpoint_path;
        if let (Some(dir), Some(name)) = (cp.parent(), cp.file_name()) {
            let prefix = format!(".{}.tmp-", name.to_string_lossy());
            if let Ok(rd) = std::fs::read_dir(dir) {
                for e in rd.flatten() {
                    if e.file_name().to_string_lossy().starts_with(&prefix) {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
        }
    }

    /// Update a completed claim's ids from NVML; false if an instance is gone.
    fn refresh_from_nvml(&self, rec: &mut ClaimRecord, live: &Live) -> bool {
        let mut all = true;
        for d in &mut rec.devices {
            if let PreparedKind::Mig {
                placement,
                profile_id,
                gi,
                ci,
                mig_uuid,
                ..
            } = &mut d.kind
            {
                let found = live.get(&d.gpu_index).and_then(|v| {
                    v.iter()
                        .find(|i| i.placement == *placement && i.profile_id == *profile_id)
                });
                match found.and_then(|i| i.compute_instances.first().map(|c| (i.id, c))) {
                    Some((gid, c)) => {
                        *gi = Some(gid);
                        *ci = Some(c.id);
                        if c.mig_uuid.is_some() {
                            mig_uuid.clone_from(&c.mig_uuid);
                        }
                    }
                    None => all = false,
                }
            }
        }
        all
    }

    /// After a corrupt checkpoint: claims allocated to this node whose MIG
    /// devices all match live instances become completed claims again.
    async fn adopt_from_api(&self, live: &Live) -> Result<Vec<ClaimRecord>, PluginError> {
        let api: Api<ReadClaim> = Api::all(self.client.clone());
        let lp = ListParams::default();
        let list = crate::api::bounded(&self.api_calls, self.config.api_timeout, api.list(&lp))
            .await
            .map_err(|e| PluginError::Kube {
                what: "list ResourceClaims".into(),
                source: Box::new(e),
            })?;
        let mut out = Vec::new();
        for ReadClaim(rc) in list.items {
            let Ok(planned) = plan_claim(&self.config, &self.gpus, &rc) else {
                continue;
            };
            if planned.is_empty() {
                continue;
            }
            let mut rec = ClaimRecord {
                uid: rc.metadata.uid.clone().unwrap_or_default(),
                namespace: rc.metadata.namespace.clone().unwrap_or_default(),
                name: rc.metadata.name.clone().unwrap_or_default(),
                state: ClaimState::PrepareCompleted,
                cdi_spec: None,
                devices: planned.into_iter().map(|p| p.record).collect(),
            };
            if !self.refresh_from_nvml(&mut rec, live) {
                continue;
            }
            // Capability minors are not in NVML's instance list: read them.
            let b = self.backend.clone();
            let devs = rec.devices.clone();
            let Ok(Ok(devs)) = blocking(move || -> Result<Vec<DeviceRecord>, BackendError> {
                let mut devs = devs;
                for d in &mut devs {
                    if let PreparedKind::Mig {
                        gi: Some(g),
                        ci: Some(c),
                        cap_minors,
                        ..
                    } = &mut d.kind
                    {
                        *cap_minors = vec![
                            b.capability_minor(d.gpu_minor, *g, None)?,
                            b.capability_minor(d.gpu_minor, *g, Some(*c))?,
                        ];
                    }
                }
                Ok(devs)
            })
            .await
            else {
                continue;
            };
            rec.devices = devs;
            out.push(rec);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_lists_claims_only_while_they_are_few() {
        let uids = |p: &str, n: usize| (0..n).map(|i| format!("{p}{i}")).collect::<Vec<_>>();
        let mut r = RecoveryReport {
            kept: uids("k", 2),
            adopted: uids("a", 1),
            rolled_back: uids("r", 1),
            ..Default::default()
        };
        assert_eq!(r.short_claim_list().as_deref(), Some("k0,k1,a0,r0"));
        r.kept = uids("k", LISTED_CLAIMS - 1);
        assert!(r.short_claim_list().is_none(), "9 claims listed");
        assert!(RecoveryReport::default().short_claim_list().is_none());
    }
}
