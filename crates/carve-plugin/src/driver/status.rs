//! The claim-status writer: after a prepare, the claim's `status.devices`
//! is written in the background (server-side apply under the driver's own
//! field manager) (for people and tools; the kubelet does not
//! wait for it), and a claim's unprepare, or a stopping plugin, waits for
//! the write still in flight ([`STATUS_SETTLE`]).

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams};

use super::{Driver, STATUS_SETTLE};
use crate::checkpoint::DeviceRecord;
use crate::checkpoint::PreparedKind;
use crate::claim::{ClaimRef, ReadClaim};

impl Driver {
    /// Write the prepared devices to the claim's `status.devices` in the
    /// background. The kubelet does not wait for it: nothing it starts reads
    /// the status, which is there for people (`kubectl get resourceclaim -o
    /// yaml`) and tools. A failed write is logged; the claim stays prepared.
    /// The claim's unprepare waits for the write first ([`STATUS_SETTLE`]),
    /// so a write never lands after the devices it names are gone.
    pub(super) async fn start_status_write(
        &self,
        api: Api<ReadClaim>,
        rc: &ResourceClaim,
        claim: &ClaimRef,
    ) {
        let Some(patch) = self.status_patch(rc, claim).await else {
            return;
        };
        let (name, uid, label) = (claim.name.clone(), claim.uid.clone(), claim.to_string());
        let manager = self.config.driver_name.clone();
        let permits = self.api_calls.clone();
        let timeout = self.config.api_timeout;
        let task = tokio::spawn(async move {
            // The field manager is the driver's name; force: these entries
            // are this driver's alone (an older carve wrote them with a
            // merge patch, under another manager).
            let params = PatchParams::apply(&manager).force();
            let patch = Patch::Apply(&patch);
            let write = api.patch_status(&name, &params, &patch);
            if let Err(e) = crate::api::bounded(&permits, timeout, write).await {
                tracing::warn!(claim.uid = %uid, claim = %label, error = %e, "writing device status failed; the claim stays prepared");
            }
        });
        let mut writes = self
            .status_writes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        writes.retain(|_, t| !t.is_finished());
        // Under the claim lock, and an unprepare takes the previous write
        // out: there is none for this claim.
        if let Some(old) = writes.insert(claim.uid.clone(), task) {
            old.abort();
        }
    }

    /// Wait for the claim's status write if one is in flight; abort it after
    /// [`STATUS_SETTLE`].
    pub(super) async fn settle_status_write(&self, uid: &str) {
        let task = self
            .status_writes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(uid);
        if let Some(mut task) = task
            && tokio::time::timeout(STATUS_SETTLE, &mut task)
                .await
                .is_err()
        {
            task.abort();
            tracing::warn!(claim.uid = %uid, "status write still in flight after {STATUS_SETTLE:?}; aborted");
        }
    }

    /// Wait for every status write in flight ([`STATUS_SETTLE`] at most, then
    /// abort the rest): a stopping plugin calls this so that what it
    /// prepared is on the claims it prepared.
    pub async fn settle_status_writes(&self) {
        let tasks: Vec<_> = self
            .status_writes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain()
            .collect();
        let deadline = tokio::time::Instant::now() + STATUS_SETTLE;
        for (uid, mut task) in tasks {
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                task.abort();
                tracing::warn!(claim.uid = %uid, "status write still in flight at stop; aborted");
            }
        }
    }

    /// The server-side apply configuration of the claim's `status.devices`:
    /// this driver's entries, what the claim now holds. Applied under the
    /// driver's own field manager, the API server keeps every other
    /// driver's entries (they are other managers' fields) and drops only
    /// entries this driver applied before and no longer lists. A merge
    /// patch would replace the whole list: an entry another driver wrote
    /// between our read and our write would be lost.
    async fn status_patch(
        &self,
        rc: &ResourceClaim,
        claim: &ClaimRef,
    ) -> Option<serde_json::Value> {
        let devices = {
            let st = self.state.lock().await;
            st.claims.get(&claim.uid)?.devices.clone()
        };
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let entries: Vec<serde_json::Value> =
            devices.iter().map(|d| self.status_entry(d, &now)).collect();
        Some(serde_json::json!({
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": rc.metadata.name, "namespace": rc.metadata.namespace},
            "status": {"devices": entries},
        }))
    }

    /// One device's `status.devices` entry: its identity, a `Ready`
    /// condition, and what it is (`data`).
    fn status_entry(&self, d: &DeviceRecord, now: &str) -> serde_json::Value {
        let mps_caps = self.config.mps.as_ref().map(|m| m.support.capabilities());
        let mut data = match &d.kind {
            PreparedKind::Gpu => serde_json::json!({"uuid": d.gpu_uuid}),
            PreparedKind::TimeSlice => {
                serde_json::json!({"uuid": d.gpu_uuid, "sharing": "timeslice"})
            }
            PreparedKind::Mps { .. } => serde_json::json!({"uuid": d.gpu_uuid}),
            PreparedKind::Mig {
                profile,
                placement,
                gi,
                ci,
                mig_uuid,
                ..
            } => serde_json::json!({
                "uuid": mig_uuid, "gpuUUID": d.gpu_uuid, "profile": profile,
                "placement": {"start": placement.start, "size": placement.size},
                "gpuInstanceID": gi, "computeInstanceID": ci,
            }),
        };
        if let Some(share) = d.kind.mps() {
            data["sharing"] = serde_json::json!("mps");
            data["mps"] = serde_json::json!({
                "unit": share.unit,
                "memoryLimitMiB": share.limits.memory_limit_mib,
                "multiprocessors": share.limits.multiprocessors,
                "activeThreadPercentage": share.limits.active_thread_percentage,
                // Per share: hard only where carve set the pod cgroup's
                // limit (memory partitioning), else the client's, with why.
                "memoryLimit": if share.hard_memory.is_some() && share.cgroup.is_some() {
                    Some("hard")
                } else {
                    mps_caps.map(|c| c.memory_limit.as_str())
                },
                "memoryLimitWhy": share.memory_client_why,
                "computeLimit": mps_caps.map(|c| c.compute_limit.as_str()),
                "cgroup": share.cgroup,
            });
        }
        let mut e = serde_json::json!({
            "driver": self.config.driver_name, "pool": d.pool, "device": d.device,
            "conditions": [{"type": "Ready", "status": "True", "reason": "Prepared",
                "message": "prepared by the carve kubelet plugin", "lastTransitionTime": now}],
            "data": data,
        });
        if let Some(s) = &d.share_id {
            e["shareID"] = serde_json::json!(s);
        }
        e
    }
}
