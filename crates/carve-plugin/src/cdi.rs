//! Transient per-claim CDI specs. Serde types matching CDI spec 1.1.0 (the
//! `container-device-interface` crate keeps its spec fields crate-private, so its
//! types cannot be built from outside); carve writes only the fields it uses.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::WriteFault;
use crate::fsutil::{FileKind, atomic_write, remove_file};

/// CDI `kind` of carve's claim specs: vendor `k8s.gpu.carve.dev`, class `claim`.
pub const CDI_KIND: &str = "k8s.gpu.carve.dev/claim";

/// The lowest CDI version that allows what carve writes (device names that
/// start with a digit, as claim UIDs may).
const CDI_VERSION: &str = "0.5.0";

/// A CDI spec document.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiSpec {
    /// `cdiVersion`.
    pub cdi_version: String,
    /// `kind`.
    pub kind: String,
    /// Devices.
    pub devices: Vec<CdiDevice>,
}

/// One device of a spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CdiDevice {
    /// Device name (`<claimUID>-<device>`).
    pub name: String,
    /// Edits applied when the device is requested.
    pub container_edits: ContainerEdits,
}

/// CDI container edits (the subset carve writes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    /// `NAME=VALUE` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Device nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_nodes: Vec<DeviceNode>,
    /// Bind mounts (an MPS share's pipe directory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

/// A mount.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    /// Path on the host.
    pub host_path: String,
    /// Path in the container.
    pub container_path: String,
    /// Mount options (`rbind`, `ro`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

/// A device node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    /// Path in the container (and on the host).
    pub path: String,
}

/// Writing or removing a CDI spec failed.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    /// The file could not be written, renamed or removed.
    #[error("CDI spec {path}: {source}")]
    Io {
        /// The spec file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A name is not a valid CDI device name.
    #[error("CDI device name {name:?} is invalid: {reason}")]
    BadName {
        /// The name.
        name: String,
        /// Why.
        reason: &'static str,
    },
}

/// The spec file of a claim.
#[must_use]
pub fn claim_spec_path(cdi_dir: &Path, claim_uid: &str) -> PathBuf {
    cdi_dir.join(format!("k8s.gpu.carve.dev-claim_{claim_uid}.json"))
}

/// CDI device name of a device of a claim.
pub(crate) fn device_name(claim_uid: &str, device: &str) -> Result<String, CdiError> {
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
pub(crate) fn qualified(name: &str) -> String {
    format!("{CDI_KIND}={name}")
}

/// Container edits for a device: the control nodes, the GPU node, the MIG
/// capability nodes, and the visible-device environment.
pub(crate) fn edits(
    uuid: &str,
    gpu_minor: u32,
    cap_minors: &[u32],
    extra_env: Option<String>,
) -> ContainerEdits {
    let mut device_nodes: Vec<DeviceNode> = [
        "/dev/nvidiactl".to_string(),
        "/dev/nvidia-uvm".into(),
        "/dev/nvidia-uvm-tools".into(),
        format!("/dev/nvidia{gpu_minor}"),
    ]
    .into_iter()
    .map(|path| DeviceNode { path })
    .collect();
    device_nodes.extend(cap_minors.iter().map(|m| DeviceNode {
        path: format!("/dev/nvidia-caps/nvidia-cap{m}"),
    }));
    let mut env = vec![
        format!("NVIDIA_VISIBLE_DEVICES={uuid}"),
        format!("CUDA_VISIBLE_DEVICES={uuid}"),
    ];
    env.extend(extra_env);
    ContainerEdits {
        env,
        device_nodes,
        mounts: Vec::new(),
    }
}

/// Add an MPS share's variables and pipe-directory mount to a device's edits.
pub(crate) fn add_share(e: &mut ContainerEdits, share: &carve_mps::ShareEdits) {
    e.env.extend(share.env.iter().cloned());
    e.mounts.extend(share.mounts.iter().map(|m| Mount {
        host_path: m.host_path.display().to_string(),
        container_path: m.container_path.clone(),
        options: m.options.clone(),
    }));
}

impl CdiSpec {
    /// A claim spec with these devices.
    #[must_use]
    pub fn new(devices: Vec<CdiDevice>) -> Self {
        Self {
            cdi_version: CDI_VERSION.into(),
            kind: CDI_KIND.into(),
            devices,
        }
    }

    /// Write atomically to `path`.
    ///
    /// # Errors
    /// I/O; the old file (if any) is then unchanged.
    pub(crate) fn write(&self, path: &Path, fault: Option<WriteFault>) -> Result<(), CdiError> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| CdiError::Io {
            path: path.to_path_buf(),
            source: e.into(),
        })?;
        atomic_write(path, &bytes, FileKind::Cdi, false, fault).map_err(|source| CdiError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Read a spec file; `None` when it is missing or not a valid spec.
    #[must_use]
    pub fn read(path: &Path) -> Option<Self> {
        let b = std::fs::read(path).ok()?;
        serde_json::from_slice(&b).ok()
    }
}

/// Remove a spec file (missing = removed).
pub(crate) fn remove(path: &Path) -> Result<(), CdiError> {
    remove_file(path).map_err(|source| CdiError::Io {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mig_edits_and_names() {
        let e = edits("MIG-abc", 3, &[31, 32], None);
        let paths: Vec<_> = e.device_nodes.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia3",
                "/dev/nvidia-caps/nvidia-cap31",
                "/dev/nvidia-caps/nvidia-cap32"
            ]
        );
        assert_eq!(
            e.env,
            [
                "NVIDIA_VISIBLE_DEVICES=MIG-abc",
                "CUDA_VISIBLE_DEVICES=MIG-abc"
            ]
        );
        let n = device_name("0f7c-11", "gpu-0-mig-1g10gb-3").unwrap();
        assert_eq!(
            qualified(&n),
            "k8s.gpu.carve.dev/claim=0f7c-11-gpu-0-mig-1g10gb-3"
        );
        assert!(device_name("a/b", "gpu-0").is_err());
    }

    #[test]
    fn spec_json_shape_and_roundtrip() {
        let s = CdiSpec::new(vec![CdiDevice {
            name: "u-gpu-0".into(),
            container_edits: edits("GPU-1", 0, &[], None),
        }]);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["cdiVersion"], "0.5.0");
        assert_eq!(v["kind"], "k8s.gpu.carve.dev/claim");
        assert_eq!(
            v["devices"][0]["containerEdits"]["deviceNodes"][0]["path"],
            "/dev/nvidiactl"
        );
        let d = tempfile::tempdir().unwrap();
        let p = claim_spec_path(d.path(), "u");
        s.write(&p, None).unwrap();
        assert_eq!(CdiSpec::read(&p).unwrap(), s);
        remove(&p).unwrap();
        remove(&p).unwrap();
        assert!(!p.exists());
    }
}
