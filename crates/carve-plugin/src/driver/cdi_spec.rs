//! What a container gets: the node's NVIDIA driver files (discovered, and
//! discovered again while they are missing), the claim's CDI spec built
//! from its record, and the device list the kubelet is answered with.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::plan::Planned;
use super::{ClaimError, Driver, blocking};
use crate::cdi::{self, CdiDevice, CdiError, CdiSpec};
use crate::checkpoint::{ClaimRecord, DeviceRecord, PreparedKind};
use crate::claim::PreparedDevice;
use crate::driver_root::NodeDriver;

/// Log what a driver discovery could not find: once per distinct problem
/// (`before`: the previous discovery, whose problems were logged already);
/// the caps major only where some GPU is MIG-capable.
pub(super) fn log_driver(nd: &NodeDriver, needs_caps: bool, before: Option<&NodeDriver>) {
    let old = before.map(NodeDriver::problems).unwrap_or_default();
    if let Err(e) = &nd.files {
        if !old.contains(&e.to_string()) {
            tracing::error!(error = %e, "containers cannot get the NVIDIA driver: every prepare fails until it is found");
        }
    } else if let (Ok(f), Some(b)) = (&nd.files, before)
        && b.files.as_ref().map_or(true, |o| o.version != f.version)
    {
        tracing::info!(version = %f.version, libraries = %f.lib_dir, "NVIDIA driver found");
    }
    if needs_caps
        && let Err(e) = &nd.caps_major
        && !old.contains(&e.to_string())
    {
        tracing::error!(error = %e, "MIG devices cannot be given to containers: every MIG prepare fails until it is found");
    }
}

impl Driver {
    /// The CDI device name of a prepared device: `<claim>-<device>`, and for an
    /// MPS share `<claim>-<device>-<shareID>` (one per share, since each share
    /// has its own limits).
    pub(super) fn cdi_name(rec_uid: &str, d: &DeviceRecord) -> Result<String, CdiError> {
        match (d.kind.mps(), &d.share_id) {
            (Some(_), Some(s)) => cdi::device_name(rec_uid, &format!("{}-{s}", d.device)),
            _ => cdi::device_name(rec_uid, &d.device),
        }
    }

    pub(super) fn prepared_devices(rec: &ClaimRecord) -> Vec<PreparedDevice> {
        rec.devices
            .iter()
            .map(|d| PreparedDevice {
                request_names: d.requests.clone(),
                pool_name: d.pool.clone(),
                device_name: d.device.clone(),
                cdi_device_ids: Self::cdi_name(&rec.uid, d)
                    .map(|n| vec![cdi::qualified(&n)])
                    .unwrap_or_default(),
                share_id: d.share_id.clone(),
            })
            .collect()
    }

    /// The claim's CDI spec: the driver's files once (spec level), each
    /// device's nodes (the GPU node, for MIG the GI and CI capability nodes
    /// with the `nvidia-caps` major and the capability files' mode), MPS
    /// share edits per share.
    pub(super) fn cdi_spec_for(
        rec: &ClaimRecord,
        nd: &NodeDriver,
        proc_driver_nvidia: &std::path::Path,
    ) -> Result<CdiSpec, ClaimError> {
        let files = nd.files.clone()?;
        let mut devs = Vec::new();
        let mut seen = BTreeSet::new();
        for d in &rec.devices {
            let name = Self::cdi_name(&rec.uid, d)?;
            if !seen.insert(name.clone()) {
                continue;
            }
            let mut caps = Vec::new();
            if let PreparedKind::Mig {
                gi, ci, cap_minors, ..
            } = &d.kind
                && !cap_minors.is_empty()
            {
                let major = nd.caps_major.clone()?;
                let gi = gi.unwrap_or_default();
                for (minor, ci) in cap_minors.iter().zip([None, *ci]) {
                    let mode =
                        crate::driver_root::cap_mode(proc_driver_nvidia, d.gpu_minor, gi, ci)
                            .map_err(Arc::new)?;
                    caps.push(crate::driver_root::cap_node(major, *minor, mode));
                }
            }
            let mut container_edits = cdi::device_edits(
                files.gpu_node(d.gpu_minor),
                caps,
                d.capabilities_env.clone(),
            );
            if let Some(e) = d.kind.mps().and_then(|s| s.edits.as_ref()) {
                cdi::add_share(&mut container_edits, e);
            }
            devs.push(CdiDevice {
                name,
                container_edits,
            });
        }
        Ok(CdiSpec::new(devs, files.common.clone()))
    }

    /// The node's driver for a prepare: the last discovery while it is
    /// healthy, else a new one (NVML's driver version read again). An error
    /// names what is missing when the driver's files are not found, or when
    /// the claim has MIG devices and the `nvidia-caps` major is not found:
    /// checked before anything is changed for the claim.
    pub(super) async fn node_driver(
        &self,
        planned: &[Planned],
    ) -> Result<Arc<NodeDriver>, ClaimError> {
        let cur = self
            .node_driver
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let needs_caps = self.gpus.values().any(|g| g.info.mig_capable);
        let nd = if cur.healthy(needs_caps) {
            cur
        } else {
            let b = self.backend.clone();
            let version = blocking(move || {
                b.gpus()
                    .map(|g| g.first().map(|g| g.driver_version.clone()))
            })
            .await
            .map_err(ClaimError::Task)?
            .map_err(|source| ClaimError::Backend {
                op: "read the driver version".into(),
                source,
            })?;
            let cfg = self.config.driver.clone();
            let nd = Arc::new(
                blocking(move || NodeDriver::discover(&cfg, version.as_deref()))
                    .await
                    .map_err(ClaimError::Task)?,
            );
            log_driver(&nd, needs_caps, Some(&cur));
            *self
                .node_driver
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = nd.clone();
            nd
        };
        nd.files.clone()?;
        if planned
            .iter()
            .any(|p| matches!(p.record.kind, PreparedKind::Mig { .. }))
        {
            nd.caps_major.clone()?;
        }
        Ok(nd)
    }

    pub(super) fn current_node_driver(&self) -> Arc<NodeDriver> {
        self.node_driver
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::ClaimState;
    use carve_model::Placement;

    #[test]
    fn cdi_spec_from_record() {
        let rec = ClaimRecord {
            uid: "u-1".into(),
            namespace: "ns".into(),
            name: "c".into(),
            state: ClaimState::PrepareCompleted,
            cdi_spec: None,
            devices: vec![DeviceRecord {
                requests: vec!["a".into()],
                pool: "node-a".into(),
                device: "gpu-2-mig-1g10gb-3".into(),
                share_id: None,
                gpu_index: 2,
                gpu_uuid: "GPU-2".into(),
                gpu_minor: 2,
                kind: PreparedKind::Mig {
                    profile: "1g.10gb".into(),
                    profile_id: 19,
                    placement: Placement::new(3, 1),
                    created: true,
                    gi: Some(7),
                    ci: Some(0),
                    mig_uuid: Some("MIG-7".into()),
                    cap_minors: vec![66, 67],
                    mps: None,
                },
                capabilities_env: None,
            }],
        };
        let d = tempfile::tempdir().unwrap();
        let fake =
            nvidia_ml_sim::driver_root::write_fake_driver(d.path(), "580.65.06", &[]).unwrap();
        let access = d.path().join("proc/capabilities/gpu2/mig/gi7");
        std::fs::create_dir_all(access.join("ci0")).unwrap();
        std::fs::write(
            access.join("access"),
            "DeviceFileMinor: 66\nDeviceFileMode: 292\n",
        )
        .unwrap();
        std::fs::write(
            access.join("ci0/access"),
            "DeviceFileMinor: 67\nDeviceFileMode: 256\n",
        )
        .unwrap();
        let cfg = crate::DriverRootConfig {
            container_root: fake.root.clone(),
            proc_devices: fake.devices_file.clone(),
            ..crate::DriverRootConfig::default()
        };
        let nd = NodeDriver::discover(&cfg, Some("580.65.06"));
        let s = Driver::cdi_spec_for(&rec, &nd, &d.path().join("proc")).unwrap();
        assert_eq!(s.devices[0].name, "u-1-gpu-2-mig-1g10gb-3");
        let e = &s.devices[0].container_edits;
        assert!(e.env.is_empty(), "no visible-device variables: {:?}", e.env);
        let caps: Vec<_> = e.device_nodes[1..]
            .iter()
            .map(|n| {
                (
                    n.path.as_str(),
                    n.dev_type.as_deref(),
                    n.major,
                    n.minor,
                    n.file_mode,
                )
            })
            .collect();
        let major = Some(i64::from(nvidia_ml_sim::driver_root::CAPS_MAJOR));
        assert_eq!(
            caps,
            [
                (
                    "/dev/nvidia-caps/nvidia-cap66",
                    Some("c"),
                    major,
                    Some(66),
                    Some(0o444)
                ),
                (
                    "/dev/nvidia-caps/nvidia-cap67",
                    Some("c"),
                    major,
                    Some(67),
                    Some(0o400)
                ),
            ]
        );
        assert!(
            s.container_edits
                .as_ref()
                .unwrap()
                .env
                .contains(&"NVIDIA_VISIBLE_DEVICES=void".to_string())
        );
        let d = Driver::prepared_devices(&rec);
        assert_eq!(
            d[0].cdi_device_ids,
            ["k8s.gpu.carve.dev/claim=u-1-gpu-2-mig-1g10gb-3"]
        );
    }
}
