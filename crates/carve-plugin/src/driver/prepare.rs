//! Prepare: one path for every claim. The claim is read and planned, the
//! GPUs it uses locked, its devices checked against the other claims and
//! recorded as `PrepareStarted`; then one blocking hop reads the GPUs,
//! checks the devices against NVML truth, decides the MIG and compute mode
//! changes, makes the instances and attaches the MPS shares. Where the
//! claim changes node state that outlives it (a MIG mode, a compute mode),
//! that hop stops before changing anything, the intent is written to the
//! checkpoint (so recovery puts it back after a crash), and a second hop
//! makes the devices with what the first decided. Last the CDI spec and
//! `PrepareCompleted` are written; a failure at any step undoes the steps
//! before it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use carve_gpu::{ComputeMode, GpuBackend};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use tracing::Instrument as _;

use super::mig::{
    GpuReads, InstanceGauges, Live, MigModeChanges, destroy_devices, make_devices, read_checked,
};
use super::mps_shares::{MpsJob, Neighbours};
use super::plan::{Planned, check_claims, check_v2_units, plan_claim, started};
use super::{ClaimError, ClaimOp, Driver, Gpu, blocking};
use crate::cdi;
use crate::checkpoint::{ClaimRecord, ClaimState, DeviceRecord, PreparedKind};
use crate::claim::{ClaimRef, PreparedDevice, ReadClaim};
use crate::config::{GpuPolicy, Retry};

impl Driver {
    /// Prepare claims concurrently; every claim gets a result.
    pub async fn prepare(
        &self,
        claims: Vec<ClaimRef>,
    ) -> Vec<(ClaimRef, Result<Vec<PreparedDevice>, ClaimError>)> {
        let futs = claims.into_iter().map(|c| async move {
            let t = std::time::Instant::now();
            // Every line logged while it runs names the claim.
            let span = tracing::info_span!("prepare", claim = %c);
            let r = self.prepare_one(&c).instrument(span).await;
            self.observe(ClaimOp::Prepare, &c, &r, t);
            (c, r)
        });
        futures::future::join_all(futs).await
    }

    /// Prepare one claim (idempotent).
    ///
    /// # Errors
    /// See [`ClaimError`]; on error nothing stays created.
    pub async fn prepare_one(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, ClaimError> {
        let lock = self.claim_lock(&claim.uid);
        let guard = lock.lock().await;
        let r = self.prepare_locked(claim).await;
        drop(guard);
        drop(lock);
        self.drop_claim_lock(&claim.uid);
        r
    }

    async fn prepare_locked(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, ClaimError> {
        // The claim GET runs while the host lock is taken (and the checkpoint
        // reread): the allocation it reads is not guarded by that lock, and
        // its result is used only once the lock is held. For a claim found
        // prepared already the result is ignored (one wasted GET).
        // A claim found prepared answers from the checkpoint without waiting
        // for the GET (an API server that does not answer must not hold it
        // up); any other claim waits for it, [`PluginConfig::api_timeout`]
        // at most.
        let api: Api<ReadClaim> = Api::namespaced(self.client.clone(), &claim.namespace);
        let mut get = std::pin::pin!(crate::api::bounded(
            &self.api_calls,
            self.config.api_timeout,
            api.get_opt(&claim.name),
        ));
        let mut host_lock = std::pin::pin!(self.host_lock());
        let mut got = None;
        let host = tokio::select! {
            h = &mut host_lock => h,
            g = &mut get => {
                got = Some(g);
                host_lock.await
            }
        };
        let _host = host
            .map_err(|source| ClaimError::host_lock(self.config.checkpoint_path.clone(), source))?;
        if let Some(rec) = self.state.lock().await.claims.get(&claim.uid)
            && rec.state == ClaimState::PrepareCompleted
        {
            return Ok(Self::prepared_devices(rec));
        }
        let got = match got {
            Some(g) => g,
            None => get.await,
        };
        let rc = Self::claim_asked_for(claim, got)?;
        let planned = plan_claim(&self.config, &self.gpus, &rc)?;
        self.node_driver(&planned).await?;
        let devs = self.prepare_planned(claim, &rc, planned).await?;
        self.start_status_write(api.clone(), &rc, claim).await;
        tracing::info!(claim.uid = %claim.uid, claim = %claim, devices = devs.len(), "prepared");
        Ok(devs)
    }

    /// The ResourceClaim the GET `got`: there, and the claim the kubelet
    /// asked for (its UID), not one made again under the same name.
    fn claim_asked_for(
        claim: &ClaimRef,
        got: Result<Option<ReadClaim>, crate::api::ApiFailure>,
    ) -> Result<ResourceClaim, ClaimError> {
        let rc = got
            .map_err(|e| ClaimError::Kube {
                what: "get ResourceClaim".into(),
                source: Box::new(e),
            })?
            .ok_or_else(|| ClaimError::NotFound {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
            })?
            .0;
        let found = rc.metadata.uid.clone().unwrap_or_default();
        if found != claim.uid {
            return Err(ClaimError::Replaced {
                expected: claim.uid.clone(),
                found,
            });
        }
        Ok(rc)
    }

    /// Everything after planning, under the claim's GPUs' locks.
    async fn prepare_planned(
        &self,
        claim: &ClaimRef,
        rc: &ResourceClaim,
        planned: Vec<Planned>,
    ) -> Result<Vec<PreparedDevice>, ClaimError> {
        let gpu_ids: BTreeSet<u32> = planned.iter().map(|p| p.record.gpu_index).collect();
        let _gpus = self.lock_gpus(&gpu_ids).await;
        let job = self.reserve(claim, rc, &planned, &gpu_ids).await?;
        let made = self.make(claim, job).await?;
        let rec = self.complete(claim, made).await?;
        self.record_mps(&*self.state.lock().await);
        Ok(Self::prepared_devices(&rec))
    }

    /// Check the devices against the other claims and record the claim as
    /// `PrepareStarted` (in memory); returns the hardware step to run.
    async fn reserve(
        &self,
        claim: &ClaimRef,
        rc: &ResourceClaim,
        planned: &[Planned],
        gpu_ids: &BTreeSet<u32>,
    ) -> Result<HardwareJob, ClaimError> {
        let records: Vec<DeviceRecord> = planned.iter().map(|p| p.record.clone()).collect();
        let mps = self.mps_job(rc, &records)?;
        let neighbours = {
            let mut st = self.state.lock().await;
            let n = Neighbours::of(&st, &claim.uid);
            check_claims(claim, planned, &st)?;
            let v2 = self
                .config
                .mps
                .as_ref()
                .is_some_and(|m| m.support.protocol == carve_mps::Protocol::V2);
            check_v2_units(claim, planned, &st, v2)?;
            st.claims.insert(claim.uid.clone(), started(claim, planned));
            n
        };
        Ok(HardwareJob {
            backend: self.backend.clone(),
            retry: self.config.unprepare_retry,
            gpus: gpu_ids.iter().map(|g| (*g, self.gpus[g].clone())).collect(),
            records,
            neighbours,
            mps,
            // The gauges are read in the same hop (an undo sets them again).
            gauges: self.instance_gauges(gpu_ids.iter().copied()),
        })
    }

    /// Run the hardware step: one hop, or two with the intent written
    /// between them. On failure the claim is forgotten again.
    async fn make(&self, claim: &ClaimRef, job: HardwareJob) -> Result<Made, ClaimError> {
        let first = self
            .hop(move || Ok(job.first()))
            .await
            .unwrap_or_else(Hop::Failed);
        let made = match first {
            Hop::Made(m) => Ok(m),
            Hop::Failed(e) => Err(e),
            Hop::Refused(e) => {
                // Nothing was changed or written for the claim.
                self.state.lock().await.claims.remove(&claim.uid);
                return Err(e);
            }
            Hop::NeedsIntent(job, decision) => {
                self.record_intent(claim, &decision).await?;
                self.hop(move || job.finish(&decision)).await
            }
        };
        if made.is_err() {
            self.forget_failed(claim).await;
        }
        made
    }

    /// Record the node state the hardware step will change (MIG modes the
    /// plugin turns on or off, compute modes it sets) and write the
    /// checkpoint where that changes it, before NVML changes anything.
    /// PrepareStarted is written only here: anything else a crash before
    /// PrepareCompleted leaves is found without it (GPU instances no
    /// completed claim owns are swept, CDI specs of unknown claims removed,
    /// MPS shares of unknown claims dropped). On error the claim is
    /// forgotten and the record is as it was.
    async fn record_intent(&self, claim: &ClaimRef, d: &Decision) -> Result<(), ClaimError> {
        let mut st = self.state.lock().await;
        let before = (
            st.mig_enabled_by_plugin.clone(),
            st.compute_mode_set_by_plugin.clone(),
            st.memory_limits_set_by_plugin.clone(),
        );
        for g in &d.mig.enable {
            st.mig_enabled_by_plugin
                .insert(self.gpus[g].info.uuid.clone());
        }
        for g in &d.mig.disable {
            st.mig_enabled_by_plugin.remove(&self.gpus[g].info.uuid);
        }
        st.compute_mode_set_by_plugin
            .extend(d.compute_mode_intent.iter().cloned());
        st.memory_limits_set_by_plugin
            .extend(d.memory.limits.iter().cloned());
        if (
            &st.mig_enabled_by_plugin,
            &st.compute_mode_set_by_plugin,
            &st.memory_limits_set_by_plugin,
        ) == (&before.0, &before.1, &before.2)
        {
            return Ok(());
        }
        if let Err(e) = self.persist(&st).await {
            st.claims.remove(&claim.uid);
            (
                st.mig_enabled_by_plugin,
                st.compute_mode_set_by_plugin,
                st.memory_limits_set_by_plugin,
            ) = before;
            return Err(e.into());
        }
        Ok(())
    }

    /// The CDI spec, then `PrepareCompleted`, on one thread; the spec first,
    /// so a completed claim always has one. On error the claim's devices
    /// are taken apart again and the claim forgotten.
    async fn complete(&self, claim: &ClaimRef, made: Made) -> Result<ClaimRecord, ClaimError> {
        let rec = ClaimRecord {
            uid: claim.uid.clone(),
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            state: ClaimState::PrepareCompleted,
            cdi_spec: Some(cdi::claim_spec_path(&self.config.cdi_dir, &claim.uid)),
            devices: made.records,
        };
        match self.write_completed(&rec, &made.compute_mode_set).await {
            Ok(()) => Ok(rec),
            Err(e) => {
                if let Some(p) = &rec.cdi_spec {
                    let _ = cdi::remove(p);
                }
                self.undo_prepare(claim, rec.devices).await;
                Err(e)
            }
        }
    }

    /// [`Self::complete`]'s writes; on error the in-memory state is as before.
    async fn write_completed(
        &self,
        rec: &ClaimRecord,
        compute_set: &[String],
    ) -> Result<(), ClaimError> {
        let spec = Self::cdi_spec_for(
            rec,
            &self.current_node_driver(),
            &self.config.driver.proc_driver_nvidia,
        )?;
        let path = rec.cdi_spec.clone().unwrap_or_default();
        let fault = self.config.write_fault;
        let mut st = self.state.lock().await;
        let compute_before = st.compute_mode_set_by_plugin.clone();
        let prev = st.claims.insert(rec.uid.clone(), rec.clone());
        st.compute_mode_set_by_plugin
            .extend(compute_set.iter().cloned());
        let written = self
            .persist_after(&st, move || Ok(spec.write(&path, fault)?))
            .await;
        if written.is_err() {
            match prev {
                Some(p) => st.claims.insert(rec.uid.clone(), p),
                None => st.claims.remove(&rec.uid),
            };
            st.compute_mode_set_by_plugin = compute_before;
        }
        written
    }

    /// Roll back a prepare after the hardware step: detach MPS shares, destroy
    /// the instances this claim made (not those other claims share through
    /// MPS), forget the claim. Errors are logged: the original error is what
    /// the kubelet sees, and recovery sweeps leftovers.
    async fn undo_prepare(&self, claim: &ClaimRef, devs: Vec<DeviceRecord>) {
        let b = self.backend.clone();
        let retry = self.config.unprepare_retry;
        let setup = self.config.mps.clone();
        let uid = claim.uid.clone();
        let pci = self.pci_map();
        let (keep, compute_set, memory) = {
            let st = self.state.lock().await;
            let keep: BTreeSet<String> = Self::shared_units(&st, &claim.uid).into_keys().collect();
            let memory: Vec<_> = st
                .memory_limits_set_by_plugin
                .iter()
                .filter(|m| m.claim_uid == claim.uid)
                .cloned()
                .collect();
            (keep, st.compute_mode_set_by_plugin.clone(), memory)
        };
        let gauges = self.instance_gauges(devs.iter().map(|d| d.gpu_index));
        let undone = self
            .hop(move || {
                let r = setup
                    .as_ref()
                    .map_or(Ok(Vec::new()), |setup| {
                        let r = crate::mps::detach(setup, &*b, &uid, &devs, &compute_set, &pci);
                        crate::mps::clear_memory(setup, &memory).and(r)
                    })
                    .and_then(|_| destroy_devices(&*b, retry, &devs, &keep));
                if let Some(g) = &gauges {
                    g.run(&*b);
                }
                r
            })
            .await;
        if let Err(e) = undone {
            tracing::error!(claim.uid = %claim.uid, claim = %claim, error = %e, "rollback after a failed prepare");
        }
        self.forget_failed(claim).await;
    }

    /// Run `f` on a blocking thread: every NVML call is made there.
    async fn hop<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T, ClaimError> + Send + 'static,
    ) -> Result<T, ClaimError> {
        blocking(f).await.map_err(ClaimError::Task)?
    }
}

/// A prepare's hardware step, owned by the blocking thread that runs it.
struct HardwareJob {
    backend: Arc<dyn GpuBackend>,
    retry: Retry,
    /// The claim's GPUs.
    gpus: BTreeMap<u32, Arc<Gpu>>,
    records: Vec<DeviceRecord>,
    neighbours: Neighbours,
    mps: Option<MpsJob>,
    gauges: Option<InstanceGauges>,
}

/// What the hardware step decided from what it read.
#[derive(Debug)]
struct Decision {
    /// The GPUs' instances.
    live: Live,
    /// Compute modes of the GPUs whole-GPU MPS shares are on.
    modes: BTreeMap<u32, ComputeMode>,
    mig: MigModeChanges,
    /// Whole GPUs whose first MPS share this is and that are not in
    /// `EXCLUSIVE_PROCESS` yet: carve sets it, so it records them first (a
    /// crash in between still restores them).
    compute_mode_intent: Vec<String>,
    /// Hard memory limits to set on pod cgroups: recorded first, so that
    /// recovery clears them after a crash before the claim completed.
    memory: crate::mps::MemoryPlan,
}

impl Decision {
    fn changes_node_state(&self) -> bool {
        !self.mig.is_empty()
            || !self.compute_mode_intent.is_empty()
            || !self.memory.limits.is_empty()
    }
}

/// What the hardware step made: the records with their ids filled in, and
/// the devices whose compute mode carve set for MPS.
struct Made {
    records: Vec<DeviceRecord>,
    compute_mode_set: Vec<String>,
}

/// How a prepare's first hop ended.
enum Hop {
    /// The devices are made.
    Made(Made),
    /// The decision changes node state: record it, then [`HardwareJob::finish`].
    NeedsIntent(Box<HardwareJob>, Decision),
    /// Refused before anything was changed (a read failed, a placement is taken).
    Refused(ClaimError),
    /// Making the devices failed (what was made is destroyed again).
    Failed(ClaimError),
}

/// Whether GPU `g`, not in MIG mode, is turned to it for its devices
/// `on_gpu` (a MIG device among them); an error where it cannot be: a
/// static GPU has no instances to hand out, and some architectures need a
/// GPU reset for it.
fn turns_mig_on(g: u32, gpu: &Gpu, on_gpu: &[&DeviceRecord]) -> Result<bool, ClaimError> {
    if !on_gpu
        .iter()
        .any(|d| matches!(d.kind, PreparedKind::Mig { .. }))
    {
        return Ok(false);
    }
    if gpu.policy == GpuPolicy::Static {
        // A static GPU with MIG off has no instances to hand out.
        if let Some(DeviceRecord {
            device,
            kind: PreparedKind::Mig {
                profile, placement, ..
            },
            ..
        }) = on_gpu.first()
        {
            return Err(ClaimError::StaticMissing {
                device: device.clone(),
                gpu: g,
                profile: profile.clone(),
                placement: *placement,
            });
        }
    }
    if gpu.info.architecture.mig_mode_needs_reset() {
        return Err(ClaimError::MigPending { gpu: g });
    }
    Ok(true)
}

/// Whether GPU `g`, in MIG mode, is turned out of it for its devices
/// `on_gpu` (a whole-GPU device among them); an error where it cannot be:
/// its MIG policy is static, or leaving MIG mode needs a GPU reset.
fn turns_mig_off(g: u32, gpu: &Gpu, on_gpu: &[&DeviceRecord]) -> Result<bool, ClaimError> {
    let Some(w) = on_gpu.iter().find(|d| {
        matches!(
            d.kind,
            PreparedKind::Gpu | PreparedKind::TimeSlice | PreparedKind::Mps { .. }
        )
    }) else {
        return Ok(false);
    };
    let why = if gpu.policy == GpuPolicy::Static {
        Some("its MIG policy is static")
    } else if gpu.info.architecture.mig_mode_needs_reset() {
        Some("leaving MIG mode needs a GPU reset on this architecture")
    } else {
        None
    };
    match why {
        Some(why) => Err(ClaimError::WholeInMigMode {
            device: w.device.clone(),
            gpu: g,
            why,
        }),
        None => Ok(true),
    }
}

impl HardwareJob {
    /// Read, check and decide; make the devices unless the decision needs
    /// its intent written first. Blocking.
    fn first(self) -> Hop {
        let decision = match self.decide() {
            Ok(d) => d,
            Err(e) => return Hop::Refused(e),
        };
        if decision.changes_node_state() {
            return Hop::NeedsIntent(Box::new(self), decision);
        }
        match self.finish(&decision) {
            Ok(m) => Hop::Made(m),
            Err(e) => Hop::Failed(e),
        }
    }

    /// Make the devices as `decision` says, and set the gauges. Blocking.
    fn finish(self, decision: &Decision) -> Result<Made, ClaimError> {
        let made = self.make(decision);
        if let Some(g) = &self.gauges {
            g.run(&*self.backend);
        }
        made
    }

    /// The GPUs read (instances, MIG modes, the compute modes MPS needs),
    /// the devices checked against them, the MIG and compute mode changes
    /// decided. Blocking.
    fn decide(&self) -> Result<Decision, ClaimError> {
        let b = &*self.backend;
        // The instance of an MPS unit another claim already shares is expected.
        let reads = read_checked(b, &self.gpus, &self.records, |d| {
            self.neighbours.shares_unit_of(d)
        })?;
        let modes = match &self.mps {
            Some(_) => MpsJob::compute_modes(b, &self.records)?,
            None => BTreeMap::new(),
        };
        let mig = self.mig_mode_changes(&reads)?;
        let compute_mode_intent = modes
            .iter()
            .filter(|(g, m)| {
                !self.neighbours.mps_on.contains(g) && **m != ComputeMode::ExclusiveProcess
            })
            .map(|(g, _)| self.gpus[g].info.uuid.clone())
            .collect();
        let memory = match &self.mps {
            Some(m) => m.plan_memory(&self.records, &self.neighbours)?,
            None => crate::mps::MemoryPlan::default(),
        };
        Ok(Decision {
            live: reads.live,
            modes,
            mig,
            compute_mode_intent,
            memory,
        })
    }

    /// Per GPU: MIG mode on for a MIG device (unless the GPU is static or
    /// needs a reset for it), off for a whole GPU (unless static or it
    /// needs a reset; no instance exists: checked before). The next MIG
    /// claim turns it on again.
    fn mig_mode_changes(&self, reads: &GpuReads) -> Result<MigModeChanges, ClaimError> {
        let mut out = MigModeChanges::default();
        for (g, gpu) in &self.gpus {
            let mig_on = reads.mig_on.contains(g);
            let on_gpu: Vec<&DeviceRecord> =
                self.records.iter().filter(|d| d.gpu_index == *g).collect();
            if !mig_on && turns_mig_on(*g, gpu, &on_gpu)? {
                out.enable.push(*g);
            }
            if mig_on && turns_mig_off(*g, gpu, &on_gpu)? {
                out.disable.push(*g);
            }
        }
        Ok(out)
    }

    /// MIG modes, instances, then the MPS shares attached to their daemons
    /// (starting them as needed); on an attach error the instances are
    /// destroyed again. Blocking.
    fn make(&self, decision: &Decision) -> Result<Made, ClaimError> {
        let b = &*self.backend;
        let mut records = self.records.clone();
        make_devices(
            b,
            self.retry,
            &decision.mig,
            &mut records,
            &decision.live,
            &self.neighbours.shared,
        )?;
        let Some(mps) = &self.mps else {
            return Ok(Made {
                records,
                compute_mode_set: Vec::new(),
            });
        };
        // The pod is bounded before any of its shares reaches a daemon.
        let attached = mps
            .set_memory(&decision.memory, &mut records)
            .and_then(|()| {
                mps.attach(b, &mut records, &decision.modes)
                    .inspect_err(|_| {
                        mps.clear_memory(&decision.memory);
                    })
            });
        match attached {
            Ok(compute_mode_set) => Ok(Made {
                records,
                compute_mode_set,
            }),
            Err(e) => {
                let keep: BTreeSet<String> = self.neighbours.shared.keys().cloned().collect();
                if let Err(de) = destroy_devices(b, self.retry, &records, &keep) {
                    tracing::error!(claim.uid = %mps.claim_uid(), error = %de, "rollback after a failed prepare");
                }
                Err(e)
            }
        }
    }
}
