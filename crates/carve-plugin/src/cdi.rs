//! Transient per-claim CDI specs. Serde types matching CDI spec 1.1.0 (the
//! `container-device-interface` crate keeps its spec fields crate-private, so its
//! types cannot be built from outside); carve writes only the fields it uses.
//! The spec files: their path, written atomically, read, removed. What a
//! claim's spec holds is built in the driver's `cdi_spec` module.

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
    /// Edits applied when any device of the spec is requested: the driver's
    /// libraries, utilities, control nodes, hooks and environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_edits: Option<ContainerEdits>,
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
    /// Bind mounts (driver files, an MPS share's pipe directory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
    /// OCI hooks (the Container Toolkit's `nvidia-cdi-hook`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

/// An OCI hook.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hook {
    /// `createRuntime`, `createContainer`, `startContainer`, `poststart`, `poststop`.
    pub hook_name: String,
    /// Absolute host path of the program.
    pub path: String,
    /// Arguments, `argv[0]` first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// `NAME=VALUE` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    /// Seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<i64>,
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

/// A device node. With `type` and `major` set the runtime creates the node
/// from these numbers; with the path alone it copies them from the host's node
/// at `hostPath` (else `path`), and fails where that node does not exist.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceNode {
    /// Path in the container.
    pub path: String,
    /// Path on the host, where it differs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<String>,
    /// `c` for a character device.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub dev_type: Option<String>,
    /// Major number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<i64>,
    /// Minor number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub minor: Option<i64>,
    /// Permission bits of the node in the container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_mode: Option<u32>,
}

impl DeviceNode {
    /// A node given by its path alone.
    #[must_use]
    pub fn path(path: String) -> Self {
        Self {
            path,
            host_path: None,
            dev_type: None,
            major: None,
            minor: None,
            file_mode: None,
        }
    }
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

impl CdiSpec {
    /// A claim spec with these devices and spec-level edits.
    #[must_use]
    pub fn new(devices: Vec<CdiDevice>, common: ContainerEdits) -> Self {
        Self {
            cdi_version: CDI_VERSION.into(),
            kind: CDI_KIND.into(),
            devices,
            container_edits: Some(common),
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
    fn spec_json_shape_and_roundtrip() {
        let common = ContainerEdits {
            env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
            device_nodes: vec![DeviceNode::path("/dev/nvidiactl".into())],
            ..ContainerEdits::default()
        };
        let s = CdiSpec::new(
            vec![CdiDevice {
                name: "u-gpu-0".into(),
                container_edits: ContainerEdits {
                    device_nodes: vec![DeviceNode::path("/dev/nvidia0".into())],
                    ..ContainerEdits::default()
                },
            }],
            common,
        );
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["cdiVersion"], "0.5.0");
        assert_eq!(v["kind"], "k8s.gpu.carve.dev/claim");
        assert_eq!(
            v["devices"][0]["containerEdits"]["deviceNodes"][0]["path"],
            "/dev/nvidia0"
        );
        assert_eq!(
            v["containerEdits"]["deviceNodes"][0]["path"],
            "/dev/nvidiactl"
        );
        assert_eq!(v["containerEdits"]["env"][0], "NVIDIA_VISIBLE_DEVICES=void");
        let d = tempfile::tempdir().unwrap();
        let p = claim_spec_path(d.path(), "u");
        s.write(&p, None).unwrap();
        assert_eq!(CdiSpec::read(&p).unwrap(), s);
        remove(&p).unwrap();
        remove(&p).unwrap();
        assert!(!p.exists());
    }
}
