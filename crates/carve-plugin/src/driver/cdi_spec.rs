//! What a container gets: the node's NVIDIA driver files (discovered, and
//! discovered again while they are missing), the claim's CDI spec built
//! from its record (device names, each device's edits), and the device list
//! the kubelet is answered with. The spec's format and its files are
//! [`crate::cdi`]'s.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::plan::Planned;
use super::{ClaimError, Driver, blocking};
use crate::cdi::{self, CdiDevice, CdiError, CdiSpec, ContainerEdits, DeviceNode};
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

/// CDI device name of a device of a claim.
fn device_name(claim_uid: &str, device: &str) -> Result<String, CdiError> {
    let name = format!("{claim_uid}-{device}");
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
    let ends = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !name.chars().all(ok_char) {
        return Err(CdiError::BadName {
            name,
            reason: "only letters, digits, '-', '_', '.', ':' are allowed",
        });
    }
    if !ends(name.chars().next()) || !ends(name.chars().last()) {
        return Err(CdiError::BadName {
            name,
            reason: "must start and end with a letter or digit",
        });
    }
    Ok(name)
}

/// Fully-qualified CDI id (`k8s.gpu.carve.dev/claim=<name>`).
fn qualified(name: &str) -> String {
    format!("{}={name}", cdi::CDI_KIND)
}

/// Container edits of one device: its GPU node, its MIG capability nodes,
/// and `extra_env` (`NVIDIA_DRIVER_CAPABILITIES` from the claim's config). No
/// visible-device variables: two devices' variables would overwrite each
/// other in one container, and CUDA enumerates the devices whose nodes the
/// container has.
fn device_edits(
    gpu_node: DeviceNode,
    cap_nodes: Vec<DeviceNode>,
    extra_env: Option<String>,
) -> ContainerEdits {
    let mut device_nodes = vec![gpu_node];
    device_nodes.extend(cap_nodes);
    ContainerEdits {
        env: extra_env.into_iter().collect(),
        device_nodes,
        mounts: Vec::new(),
        hooks: Vec::new(),
    }
}

/// Add an MPS share's variables and pipe-directory mount to a device's edits.
fn add_share(e: &mut ContainerEdits, share: &carve_mps::ShareEdits) {
    e.env.extend(share.env.iter().cloned());
    e.mounts.extend(share.mounts.iter().map(|m| cdi::Mount {
        host_path: m.host_path.display().to_string(),
        container_path: m.container_path.clone(),
        options: m.options.clone(),
    }));
}

impl Driver {
    /// The CDI device name of a prepared device: `<claim>-<device>`, and for an
    /// MPS share `<claim>-<device>-<shareID>` (one per share, since each share
    /// has its own limits).
    pub(super) fn cdi_name(rec_uid: &str, d: &DeviceRecord) -> Result<String, CdiError> {
        match (d.kind.mps(), &d.share_id) {
            (Some(_), Some(s)) => device_name(rec_uid, &format!("{}-{s}", d.device)),
            _ => device_name(rec_uid, &d.device),
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
                    .map(|n| vec![qualified(&n)])
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
            let mut container_edits = device_edits(
                files.gpu_node(d.gpu_minor),
                caps,
                d.capabilities_env.clone(),
            );
            if let Some(e) = d.kind.mps().and_then(|s| s.edits.as_ref()) {
                add_share(&mut container_edits, e);
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

    #[test]
    fn mig_edits_and_names() {
        let e = device_edits(
            DeviceNode::path("/dev/nvidia3".into()),
            vec![
                crate::driver_root::cap_node(236, 31, 0o444),
                crate::driver_root::cap_node(236, 32, 0o444),
            ],
            None,
        );
        let paths: Vec<_> = e.device_nodes.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/dev/nvidia3",
                "/dev/nvidia-caps/nvidia-cap31",
                "/dev/nvidia-caps/nvidia-cap32"
            ]
        );
        let v = serde_json::to_value(&e.device_nodes[1]).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"path": "/dev/nvidia-caps/nvidia-cap31", "type": "c", "major": 236, "minor": 31, "fileMode": 292})
        );
        assert!(e.env.is_empty());
        let n = device_name("0f7c-11", "gpu-0-mig-1g10gb-3").unwrap();
        assert_eq!(
            qualified(&n),
            "k8s.gpu.carve.dev/claim=0f7c-11-gpu-0-mig-1g10gb-3"
        );
        assert!(device_name("a/b", "gpu-0").is_err());
    }
}
