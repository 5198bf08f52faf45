//! The plugin checkpoint: which claims are prepared and which MIG instances
//! they own. Versioned JSON with a sha256 checksum of the canonical body,
//! replaced atomically on every change.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use carve_model::Placement;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::WriteFault;
use crate::fsutil::{FileKind, atomic_write};

/// `apiVersion` of the checkpoint format written by this version.
pub const CHECKPOINT_API_VERSION: &str = "checkpoint.gpu.carve.dev/v1";

/// The checkpoint file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Checkpoint {
    /// Format version.
    pub api_version: String,
    /// `sha256:<hex>` of the canonical JSON of `body`.
    pub checksum: String,
    /// The content.
    pub body: CheckpointBody,
}

/// What the checkpoint records.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CheckpointBody {
    /// Boot id of the node when written.
    pub boot_id: String,
    /// UUIDs of GPUs whose MIG mode the plugin enabled (to be disabled again
    /// when their last instance goes, on GPUs that need no reset).
    #[serde(default)]
    pub mig_enabled_by_plugin: BTreeSet<String>,
    /// Claims by UID.
    #[serde(default)]
    pub claims: BTreeMap<String, ClaimRecord>,
}

/// Where a claim is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimState {
    /// Prepare began; instances may exist half-made.
    PrepareStarted,
    /// Prepare finished; devices are handed out.
    PrepareCompleted,
    /// Unprepare began; instances may be half-destroyed.
    UnprepareStarted,
}

/// One claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimRecord {
    /// Claim UID.
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// State.
    pub state: ClaimState,
    /// CDI spec file, once written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cdi_spec: Option<PathBuf>,
    /// Devices.
    pub devices: Vec<DeviceRecord>,
}

/// One prepared (or planned) device of a claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeviceRecord {
    /// Allocation request names (subrequest suffix stripped).
    pub requests: Vec<String>,
    /// Pool.
    pub pool: String,
    /// Device name.
    pub device: String,
    /// Share id from the allocation result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// GPU index.
    pub gpu_index: u32,
    /// GPU UUID.
    pub gpu_uuid: String,
    /// GPU device minor.
    pub gpu_minor: u32,
    /// What was handed out.
    pub kind: PreparedKind,
    /// `NVIDIA_DRIVER_CAPABILITIES=...` from opaque config, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities_env: Option<String>,
}

/// The hardware behind a device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all_fields = "camelCase", deny_unknown_fields)]
pub enum PreparedKind {
    /// The whole GPU.
    Gpu,
    /// The whole GPU shared with other claims' time-slice shares: no limits,
    /// no hardware change (the driver's default time-slicing scheduler).
    TimeSlice,
    /// A MIG device.
    Mig {
        /// Profile name.
        profile: String,
        /// NVML profile id.
        profile_id: u32,
        /// Placement.
        placement: Placement,
        /// Whether the plugin created it (dynamic) or found it (static).
        created: bool,
        /// GPU-instance id, once known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gi: Option<u32>,
        /// Compute-instance id, once known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ci: Option<u32>,
        /// MIG UUID, once known.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mig_uuid: Option<String>,
        /// Capability device minors (GI, CI), once known.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        cap_minors: Vec<u32>,
    },
}

/// A checkpoint that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading or writing the file failed.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Not valid JSON of the expected shape.
    #[error("checkpoint {path}: malformed: {reason}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// serde's message.
        reason: String,
    },
    /// Written by a format carve does not know.
    #[error(
        "checkpoint {path}: unknown apiVersion {api_version:?} (expected {CHECKPOINT_API_VERSION})"
    )]
    UnknownVersion {
        /// The file.
        path: PathBuf,
        /// The version found.
        api_version: String,
    },
    /// The checksum does not match the body.
    #[error("checkpoint {path}: checksum mismatch (file says {stored}, body hashes to {computed})")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// Recorded.
        stored: String,
        /// Computed.
        computed: String,
    },
}

fn checksum(body: &CheckpointBody) -> String {
    // serde_json writes struct fields in declaration order and BTreeMap keys
    // sorted, so this serialization is canonical for a body value.
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let digest = Sha256::digest(&bytes);
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

impl Checkpoint {
    /// Wrap a body, computing its checksum.
    #[must_use]
    pub fn new(body: CheckpointBody) -> Self {
        Self {
            api_version: CHECKPOINT_API_VERSION.into(),
            checksum: checksum(&body),
            body,
        }
    }

    /// Load and verify. `Ok(None)` when the file does not exist.
    ///
    /// # Errors
    /// Unreadable, malformed, unknown version or checksum mismatch.
    pub fn load(path: &Path) -> Result<Option<Self>, CheckpointError> {
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(CheckpointError::Io {
                    path: path.into(),
                    source,
                });
            }
        };
        let malformed = |e: serde_json::Error| CheckpointError::Malformed {
            path: path.into(),
            reason: e.to_string(),
        };
        let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(malformed)?;
        let api_version = v
            .get("apiVersion")
            .and_then(|a| a.as_str())
            .unwrap_or_default()
            .to_string();
        if api_version != CHECKPOINT_API_VERSION {
            return Err(CheckpointError::UnknownVersion {
                path: path.into(),
                api_version,
            });
        }
        let c: Self = serde_json::from_value(v).map_err(malformed)?;
        let computed = checksum(&c.body);
        if computed != c.checksum {
            return Err(CheckpointError::Checksum {
                path: path.into(),
                stored: c.checksum,
                computed,
            });
        }
        Ok(Some(c))
    }

    /// Write atomically (temp file, fsync, rename; see `fsutil`).
    ///
    /// # Errors
    /// I/O; the previous checkpoint is then unchanged.
    pub fn store(
        body: &CheckpointBody,
        path: &Path,
        fault: Option<WriteFault>,
    ) -> Result<(), CheckpointError> {
        let c = Self::new(body.clone());
        let bytes = serde_json::to_vec_pretty(&c).map_err(|e| CheckpointError::Malformed {
            path: path.into(),
            reason: e.to_string(),
        })?;
        atomic_write(path, &bytes, FileKind::Checkpoint, fault).map_err(|source| {
            CheckpointError::Io {
                path: path.into(),
                source,
            }
        })
    }
}

/// Move an unusable checkpoint aside to `<path>.corrupt-<unix seconds>`.
pub(crate) fn move_aside(path: &Path) -> std::io::Result<PathBuf> {
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".corrupt-{ts}"));
    let aside = PathBuf::from(name);
    std::fs::rename(path, &aside)?;
    Ok(aside)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CheckpointBody {
        let mut b = CheckpointBody {
            boot_id: "b-1".into(),
            ..Default::default()
        };
        b.mig_enabled_by_plugin.insert("GPU-1".into());
        b.claims.insert(
            "u1".into(),
            ClaimRecord {
                uid: "u1".into(),
                namespace: "ns".into(),
                name: "c".into(),
                state: ClaimState::PrepareCompleted,
                cdi_spec: Some("/var/run/cdi/x.json".into()),
                devices: vec![
                    DeviceRecord {
                        requests: vec!["r".into()],
                        pool: "node-a".into(),
                        device: "gpu-0-mig-1g10gb-3".into(),
                        share_id: None,
                        gpu_index: 0,
                        gpu_uuid: "GPU-1".into(),
                        gpu_minor: 0,
                        kind: PreparedKind::Mig {
                            profile: "1g.10gb".into(),
                            profile_id: 19,
                            placement: Placement::new(3, 1),
                            created: true,
                            gi: Some(9),
                            ci: Some(0),
                            mig_uuid: Some("MIG-x".into()),
                            cap_minors: vec![100, 101],
                        },
                        capabilities_env: None,
                    },
                    DeviceRecord {
                        requests: vec!["w".into()],
                        pool: "node-a".into(),
                        device: "gpu-1".into(),
                        share_id: Some("s".into()),
                        gpu_index: 1,
                        gpu_uuid: "GPU-2".into(),
                        gpu_minor: 1,
                        kind: PreparedKind::Gpu,
                        capabilities_env: Some("NVIDIA_DRIVER_CAPABILITIES=all".into()),
                    },
                ],
            },
        );
        b
    }

    #[test]
    fn roundtrip() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("checkpoint.json");
        assert!(Checkpoint::load(&p).unwrap().is_none());
        Checkpoint::store(&sample(), &p, None).unwrap();
        let c = Checkpoint::load(&p).unwrap().unwrap();
        assert_eq!(c.api_version, CHECKPOINT_API_VERSION);
        assert_eq!(c.body, sample());
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(v["body"]["claims"]["u1"]["state"], "PrepareCompleted");
        assert_eq!(
            v["body"]["claims"]["u1"]["devices"][0]["kind"]["type"],
            "Mig"
        );
        assert_eq!(
            v["body"]["claims"]["u1"]["devices"][0]["kind"]["placement"]["start"],
            3
        );
    }

    #[test]
    fn v1_fixture_still_loads() {
        // A v1 document as written by this version; keep it loading forever.
        let body = r#"{"bootId":"b","migEnabledByPlugin":[],"claims":{"u":{"uid":"u","namespace":"n","name":"c","state":"PrepareStarted","devices":[{"requests":["r"],"pool":"p","device":"gpu-0-mig-7g80gb-0","gpuIndex":0,"gpuUuid":"GPU-a","gpuMinor":0,"kind":{"type":"Mig","profile":"7g.80gb","profileId":0,"placement":{"start":0,"size":8},"created":true}}]}}}"#;
        let b: CheckpointBody = serde_json::from_str(body).unwrap();
        let doc = format!(
            r#"{{"apiVersion":"{CHECKPOINT_API_VERSION}","checksum":"{}","body":{body}}}"#,
            checksum(&b)
        );
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.json");
        std::fs::write(&p, doc).unwrap();
        let c = Checkpoint::load(&p).unwrap().unwrap();
        assert_eq!(c.body.claims["u"].state, ClaimState::PrepareStarted);
    }

    #[test]
    fn tampered_unknown_and_garbage_are_rejected() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("checkpoint.json");
        Checkpoint::store(&sample(), &p, None).unwrap();
        let s = std::fs::read_to_string(&p)
            .unwrap()
            .replace("\"gpu-1\"", "\"gpu-2\"");
        std::fs::write(&p, s).unwrap();
        assert!(matches!(
            Checkpoint::load(&p),
            Err(CheckpointError::Checksum { .. })
        ));
        std::fs::write(
            &p,
            r#"{"apiVersion":"checkpoint.gpu.carve.dev/v9","body":{}}"#,
        )
        .unwrap();
        let e = Checkpoint::load(&p).unwrap_err();
        assert!(
            e.to_string()
                .contains("unknown apiVersion \"checkpoint.gpu.carve.dev/v9\""),
            "{e}"
        );
        std::fs::write(&p, "{not json").unwrap();
        assert!(matches!(
            Checkpoint::load(&p),
            Err(CheckpointError::Malformed { .. })
        ));
        let aside = move_aside(&p).unwrap();
        assert!(!p.exists());
        assert!(aside.to_string_lossy().contains("checkpoint.json.corrupt-"));
    }
}
