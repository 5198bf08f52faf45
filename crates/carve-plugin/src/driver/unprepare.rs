//! Unprepare: a claim's MPS shares detached, its instances destroyed and
//! its CDI spec removed (one blocking hop), the claim forgotten, then MIG
//! mode turned off where the plugin turned it on and nothing is left.
//! Idempotent: a retry after an error continues where the last try stopped.

use std::collections::BTreeSet;

use carve_gpu::BackendError;
use tracing::Instrument as _;

use super::mig::{destroy_devices, disable_mig_if_empty};
use super::{ClaimError, ClaimOp, Driver, blocking};
use crate::cdi;
use crate::checkpoint::{ClaimRecord, ClaimState};
use crate::claim::ClaimRef;

impl Driver {
    /// Unprepare claims concurrently; every claim gets a result.
    pub async fn unprepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<(), ClaimError>)> {
        let futs = claims.into_iter().map(|c| async move {
            let t = std::time::Instant::now();
            // Every line logged while it runs names the claim.
            let span = tracing::info_span!("unprepare", claim = %c);
            let r = self.unprepare_uid(&c.uid).instrument(span).await.map(|done| {
                if !done {
                    tracing::info!(claim.uid = %c.uid, claim = %c, "unprepared (the claim was not prepared on this node)");
                }
            });
            self.observe(ClaimOp::Unprepare, &c, &r, t);
            (c, r)
        });
        futures::future::join_all(futs).await
    }

    /// Unprepare one claim (idempotent: an unknown claim is done).
    ///
    /// # Errors
    /// Instances that stay in use, NVML or file errors; the claim then stays
    /// recorded and a retry continues where this one stopped.
    pub async fn unprepare_one(&self, uid: &str) -> Result<(), ClaimError> {
        self.unprepare_uid(uid).await.map(|_| ())
    }

    /// [`Self::unprepare_one`], saying whether the claim was prepared here.
    async fn unprepare_uid(&self, uid: &str) -> Result<bool, ClaimError> {
        let lock = self.claim_lock(uid);
        let guard = lock.lock().await;
        let r = self.unprepare_locked(uid).await;
        drop(guard);
        drop(lock);
        self.drop_claim_lock(uid);
        r
    }

    async fn unprepare_locked(&self, uid: &str) -> Result<bool, ClaimError> {
        self.settle_status_write(uid).await;
        let _host = self.host_lock_for_claim().await?;
        let Some(rec) = self.mark_unprepare_started(uid).await? else {
            return Ok(false);
        };
        let gpu_ids: BTreeSet<u32> = rec.devices.iter().map(|d| d.gpu_index).collect();
        let _gpus = self.lock_gpus(&gpu_ids).await;
        let restored = self.take_apart(&rec, &gpu_ids).await?;
        let restore = self.forget_unprepared(uid, &restored, &gpu_ids).await?;
        self.turn_mig_mode_off(&restore).await?;
        tracing::info!(claim.uid = %uid, claim = %rec.claim_ref(), devices = rec.devices.len(), "unprepared");
        Ok(true)
    }

    /// The claim's record, marked `UnprepareStarted` (written once); `None`
    /// for a claim this plugin does not know.
    async fn mark_unprepare_started(&self, uid: &str) -> Result<Option<ClaimRecord>, ClaimError> {
        let mut st = self.state.lock().await;
        let Some(rec) = st.claims.get_mut(uid) else {
            return Ok(None);
        };
        if rec.state == ClaimState::UnprepareStarted {
            return Ok(Some(rec.clone()));
        }
        rec.state = ClaimState::UnprepareStarted;
        let r = rec.clone();
        self.persist(&st).await?;
        Ok(Some(r))
    }

    /// In one blocking hop: the MPS shares detached first (a daemon's
    /// server holds the instance it serves), the instances destroyed (not
    /// those other claims still share through MPS), the gauges, then the
    /// CDI spec. Returns the devices whose compute mode went back to
    /// `DEFAULT`.
    async fn take_apart(
        &self,
        rec: &ClaimRecord,
        gpu_ids: &BTreeSet<u32>,
    ) -> Result<Vec<String>, ClaimError> {
        let (keep, compute_set, memory) = {
            let st = self.state.lock().await;
            let keep: BTreeSet<String> = Self::shared_units(&st, &rec.uid).into_keys().collect();
            let memory: Vec<_> = st
                .memory_limits_set_by_plugin
                .iter()
                .filter(|m| m.claim_uid == rec.uid)
                .cloned()
                .collect();
            (keep, st.compute_mode_set_by_plugin.clone(), memory)
        };
        let setup = self.mps_setup(&rec.devices)?;
        let b = self.backend.clone();
        let retry = self.config.unprepare_retry;
        let pci = self.pci_map();
        let gauges = self.instance_gauges(gpu_ids.iter().copied());
        let rec = rec.clone();
        blocking(move || -> Result<Vec<String>, ClaimError> {
            let restored = match &setup {
                Some(setup) => {
                    let r =
                        crate::mps::detach(setup, &*b, &rec.uid, &rec.devices, &compute_set, &pci)?;
                    // Soft 0 and hard max on the pod cgroup, read back,
                    // before the kubelet removes the cgroup.
                    crate::mps::clear_memory(setup, &memory)?;
                    r
                }
                None => Vec::new(),
            };
            let destroyed = destroy_devices(&*b, retry, &rec.devices, &keep);
            if let Some(g) = &gauges {
                g.run(&*b);
            }
            destroyed?;
            if let Some(p) = &rec.cdi_spec {
                cdi::remove(p)?;
            }
            Ok(restored)
        })
        .await
        .map_err(ClaimError::Task)?
    }

    /// The claim is gone (and the compute modes `restored`): written. Returns
    /// the GPUs among `gpu_ids` whose MIG mode the plugin turned on and
    /// that no claim uses now.
    async fn forget_unprepared(
        &self,
        uid: &str,
        restored: &[String],
        gpu_ids: &BTreeSet<u32>,
    ) -> Result<Vec<u32>, ClaimError> {
        let mut st = self.state.lock().await;
        st.claims.remove(uid);
        st.memory_limits_set_by_plugin
            .retain(|m| m.claim_uid != uid);
        for u in restored {
            st.compute_mode_set_by_plugin.remove(u);
        }
        self.persist(&st).await?;
        self.record_mps(&st);
        Ok(gpu_ids
            .iter()
            .copied()
            .filter(|g| {
                let gpu = &self.gpus[g];
                st.mig_enabled_by_plugin.contains(&gpu.info.uuid)
                    && !gpu.info.architecture.mig_mode_needs_reset()
                    && !st
                        .claims
                        .values()
                        .any(|c| c.devices.iter().any(|d| d.gpu_index == *g))
            })
            .collect())
    }

    /// Turn MIG mode off on `gpus` where they have no instance (a failure is
    /// logged: the GPU stays in MIG mode, recorded), and forget the ones
    /// turned off (GPU locks still held, checkpoint lock not held across
    /// NVML).
    async fn turn_mig_mode_off(&self, gpus: &[u32]) -> Result<(), ClaimError> {
        if gpus.is_empty() {
            return Ok(());
        }
        let b = self.backend.clone();
        let ids = gpus.to_vec();
        let results: Vec<(u32, Result<bool, BackendError>)> = blocking(move || {
            ids.into_iter()
                .map(|g| (g, disable_mig_if_empty(&*b, g)))
                .collect()
        })
        .await
        .map_err(ClaimError::Task)?;
        let mut disabled = Vec::new();
        for (g, r) in results {
            match r {
                Ok(true) => disabled.push(self.gpus[&g].info.uuid.clone()),
                Ok(false) => {}
                Err(e) => tracing::warn!(gpu = g, error = %e, "disabling MIG mode failed"),
            }
        }
        if !disabled.is_empty() {
            let mut st = self.state.lock().await;
            for u in &disabled {
                st.mig_enabled_by_plugin.remove(u);
            }
            self.persist(&st).await?;
        }
        Ok(())
    }
}
