//! The plugin checkpoint: which claims are prepared and which MIG instances
//! they own. Versioned JSON with a sha256 checksum of the canonical body,
//! replaced atomically on every change (written into a spare file, whose name
//! is then exchanged with the checkpoint's, see `fsutil`: a process that
//! crashes at any point leaves the previous or the new file, and the next
//! process reads it from the page cache).
//!
//! # When a write is fsynced
//!
//! An fsync only matters across a power loss or kernel crash, that is across
//! a reboot. Almost nothing the checkpoint records outlives one: GPU and
//! compute instances, CDI specs (under `/var/run`), MPS daemons and compute
//! modes are gone, and recovery discards the claims and compute modes of a
//! checkpoint whose boot id is not the current boot's. The one exception is
//! [`CheckpointBody::mig_enabled_by_plugin`]: MIG mode persists on the GPU,
//! and recovery carries the set into the new boot to turn MIG mode off again.
//!
//! So a write is fsynced (the file before its exchange, its directory after)
//! when the new body records a GPU in that set, or when the file it replaces
//! may record one, or when the spare it overwrites may (the file the previous
//! write replaced; the driver assumes so for a spare it did not see written)
//! ([`store_bytes`]'s `durable`, decided by the driver). Every other write is
//! not: what it changes is void after a reboot anyway. A write that is not
//! fsynced can, after a power loss, leave a file whose name is exchanged but
//! whose data is not on disk: empty, garbage, or the spare's older content.
//! That file cannot lose anything or bring a GPU of the set back: neither the
//! durable file it replaced nor the spare's content recorded one.
//! Recovery must only not mistake it for a corrupt checkpoint of the current
//! boot (which is rebuilt from the API server); the boot marker
//! ([`write_boot_marker`], `<checkpoint>.boot`, written durably once per boot
//! by recovery) tells it the unusable file comes from an earlier boot, which
//! is then discarded like any checkpoint of an earlier boot.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use carve_model::Placement;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::config::WriteFault;
use crate::fsutil::{FileKind, atomic_write, exchange_write};

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
    /// UUIDs of GPUs the plugin switched to `EXCLUSIVE_PROCESS` compute mode
    /// for an MPS daemon (set back to `DEFAULT` when the daemon stops).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub compute_mode_set_by_plugin: BTreeSet<String>,
    /// Hard MPS memory limits (memory partitioning) carve set or is about to
    /// set on pod cgroups, recorded before `nvidia-smi` is called, so that
    /// recovery clears those of claims that did not complete.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub memory_limits_set_by_plugin: BTreeSet<MemoryLimitRecord>,
}

/// One hard memory limit on a pod cgroup for one GPU.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MemoryLimitRecord {
    /// The claim whose shares it bounds.
    pub claim_uid: String,
    /// The pod cgroup, relative to the cgroup root.
    pub cgroup: PathBuf,
    /// GPU UUID (`nvidia-smi -i`).
    pub gpu_uuid: String,
    /// The GPU's dmem key (`nvidia/<PCI BDF>/vidmem`).
    pub key: String,
    /// Soft = hard limit, MiB (the sum of the claim's shares of the GPU).
    pub mib: u64,
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

impl ClaimRecord {
    /// The claim this record is of (namespace, name and UID), as log lines
    /// and errors name it.
    #[must_use]
    pub fn claim_ref(&self) -> crate::claim::ClaimRef {
        crate::claim::ClaimRef {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            uid: self.uid.clone(),
        }
    }
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
        /// For a MIG-MPS share: the share. The instance is shared by every
        /// claim with a share of the same device: created by the first
        /// prepare, destroyed by the last unprepare.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mps: Option<MpsShare>,
    },
    /// An MPS share of the whole GPU (`gpu-<i>-mps`).
    Mps {
        /// The share.
        share: MpsShare,
    },
}

impl PreparedKind {
    /// The MPS share of this device, if it is one.
    #[must_use]
    pub fn mps(&self) -> Option<&MpsShare> {
        match self {
            Self::Mps { share }
            | Self::Mig {
                mps: Some(share), ..
            } => Some(share),
            _ => None,
        }
    }
}

/// One claim's share of an MPS control daemon (whole GPU or MIG instance).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MpsShare {
    /// The shared unit: the MPS device name (`gpu-0-mps`,
    /// `gpu-0-mig-1g10gb-3-mps`), which names its daemon directory.
    pub unit: String,
    /// The limits granted (from `consumedCapacity`).
    pub limits: carve_model::sharing::MpsLimits,
    /// The pod cgroup the share is bound to (MPS v3), relative to the cgroup root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<PathBuf>,
    /// What the container gets (pipe directory mount, variables), once the
    /// daemon accepted the share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edits: Option<carve_mps::ShareEdits>,
    /// The share's memory limit is to be hard (memory partitioning on its
    /// whole, non-MIG GPU): the GPU's dmem key. The limit goes on the pod
    /// cgroup `cgroup`; `None`: the memory limit is the CUDA client's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hard_memory: Option<HardMemory>,
    /// Why the share's memory limit is `client`, when it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_client_why: Option<String>,
}

/// A share's hard memory limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HardMemory {
    /// The GPU's dmem key (`nvidia/<PCI BDF>/vidmem`).
    pub key: String,
    /// The claim's opaque config demands `hard` (an error rather than
    /// `client` where it cannot be set).
    #[serde(default)]
    pub demanded: bool,
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

/// The canonical bytes of a body: serde_json writes struct fields in
/// declaration order and BTreeMap keys sorted, so this compact serialization
/// is canonical for a body value.
fn canonical(body: &CheckpointBody) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(body)
}

/// `sha256:<hex>` of canonical body bytes.
fn checksum_of(canonical: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = Sha256::digest(canonical);
    let mut s = String::with_capacity(7 + 64);
    s.push_str("sha256:");
    for b in digest {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    s
}

fn checksum(body: &CheckpointBody) -> String {
    checksum_of(&canonical(body).unwrap_or_default())
}

/// The file's bytes: `{"apiVersion":…,"checksum":…,"body":…}` (the field
/// order of [`Checkpoint`]) with the body written as its canonical bytes, so
/// the body is serialized once and hashed from the same bytes.
fn encode(body: &CheckpointBody) -> Result<Vec<u8>, serde_json::Error> {
    let body = canonical(body)?;
    let sum = checksum_of(&body);
    let mut out = Vec::with_capacity(body.len() + CHECKPOINT_API_VERSION.len() + sum.len() + 48);
    out.extend_from_slice(b"{\"apiVersion\":");
    serde_json::to_writer(&mut out, CHECKPOINT_API_VERSION)?;
    out.extend_from_slice(b",\"checksum\":");
    serde_json::to_writer(&mut out, &sum)?;
    out.extend_from_slice(b",\"body\":");
    out.extend_from_slice(&body);
    out.extend_from_slice(b"}\n");
    Ok(out)
}

/// The bytes of the checkpoint file for `body` (what [`store_bytes`] writes).
pub(crate) fn encode_body(body: &CheckpointBody, path: &Path) -> Result<Vec<u8>, CheckpointError> {
    encode(body).map_err(|e| CheckpointError::Malformed {
        path: path.into(),
        reason: e.to_string(),
    })
}

/// Replace the checkpoint with `bytes` (from [`encode_body`]): written into
/// the spare file, fsynced when `durable` (see the module docs), exchanged
/// with the checkpoint (`fsutil::exchange_write`).
pub(crate) fn store_bytes(
    bytes: &[u8],
    path: &Path,
    durable: bool,
    fault: Option<WriteFault>,
) -> Result<(), CheckpointError> {
    exchange_write(path, bytes, FileKind::Checkpoint, durable, fault).map_err(|source| {
        CheckpointError::Io {
            path: path.into(),
            source,
        }
    })
}

/// The checkpoint file's bytes; `Ok(None)` when it does not exist.
///
/// Read without updating its access time where the process may (it owns
/// the file, or runs as root as the chart does): the file changes with every
/// claim, so under `relatime` each read would otherwise be a journalled
/// inode update.
pub(crate) fn read_bytes(path: &Path) -> Result<Option<Vec<u8>>, CheckpointError> {
    let read = || -> std::io::Result<Vec<u8>> {
        use std::io::Read as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let open = |flags| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(flags)
                .open(path)
        };
        let mut f = match open(nix::libc::O_NOATIME) {
            Err(e) if e.raw_os_error() == Some(nix::libc::EPERM) => open(0)?,
            r => r?,
        };
        // Sized from the file's length, as `std::fs::read` does.
        let len = f.metadata().map_or(0, |m| m.len());
        let mut b = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
        f.read_to_end(&mut b)?;
        Ok(b)
    };
    match read() {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(CheckpointError::Io {
            path: path.into(),
            source,
        }),
    }
}

/// `<checkpoint>.boot`: the boot id of the last boot whose recovery ran.
fn boot_marker_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".boot");
    PathBuf::from(name)
}

/// The boot id recorded by [`write_boot_marker`], if any (unreadable counts as
/// none).
pub(crate) fn read_boot_marker(path: &Path) -> Option<String> {
    std::fs::read_to_string(boot_marker_path(path))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Record durably that recovery ran in boot `boot_id` (temp file, fsync,
/// rename, fsync of the directory), unless the marker says so already. See
/// the module docs for why.
pub(crate) fn write_boot_marker(path: &Path, boot_id: &str) -> std::io::Result<()> {
    if read_boot_marker(path).as_deref() == Some(boot_id) {
        return Ok(());
    }
    atomic_write(
        &boot_marker_path(path),
        format!("{boot_id}\n").as_bytes(),
        FileKind::Marker,
        true,
        None,
    )
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
        match read_bytes(path)? {
            Some(bytes) => Self::decode(path, &bytes).map(Some),
            None => Ok(None),
        }
    }

    /// Parse and verify the bytes of the file at `path`.
    pub(crate) fn decode(path: &Path, bytes: &[u8]) -> Result<Self, CheckpointError> {
        let malformed = |e: serde_json::Error| CheckpointError::Malformed {
            path: path.into(),
            reason: e.to_string(),
        };
        let unknown = |api_version: String| CheckpointError::UnknownVersion {
            path: path.into(),
            api_version,
        };
        // The common case in one typed pass; a document that does not fit
        // the type is parsed again untyped only to name what is wrong (an
        // unknown apiVersion before a shape error).
        let c: Self = match serde_json::from_slice(bytes) {
            Ok(c) => c,
            Err(e) => {
                let v: serde_json::Value = serde_json::from_slice(bytes).map_err(malformed)?;
                let api_version = v
                    .get("apiVersion")
                    .and_then(|a| a.as_str())
                    .unwrap_or_default();
                if api_version != CHECKPOINT_API_VERSION {
                    return Err(unknown(api_version.to_string()));
                }
                return Err(malformed(e));
            }
        };
        if c.api_version != CHECKPOINT_API_VERSION {
            return Err(unknown(c.api_version));
        }
        let computed = checksum(&c.body);
        if computed != c.checksum {
            return Err(CheckpointError::Checksum {
                path: path.into(),
                stored: c.checksum,
                computed,
            });
        }
        Ok(c)
    }

    /// Write atomically and durably (temp file, fsync, rename; see `fsutil`):
    /// compact JSON, the body serialized once and hashed from those bytes.
    /// The driver's own writes fsync only where the module docs say.
    ///
    /// # Errors
    /// I/O; the previous checkpoint is then unchanged.
    pub fn store(
        body: &CheckpointBody,
        path: &Path,
        fault: Option<WriteFault>,
    ) -> Result<(), CheckpointError> {
        store_bytes(&encode_body(body, path)?, path, true, fault)
    }
}

impl Checkpoint {
    /// Checkpoint fsyncs done in this process so far and the time spent in
    /// them: the disk's share of prepare and unprepare, which `carve bench
    /// prepare` reports next to the overhead. Only writes that must survive a
    /// power loss are fsynced (module docs), so this can stay 0 per call.
    #[must_use]
    pub fn sync_totals() -> (u64, std::time::Duration) {
        crate::fsutil::sync_totals()
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
                            mps: None,
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
    fn file_is_compact_and_its_checksum_covers_the_canonical_body() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("checkpoint.json");
        let (syncs, _) = Checkpoint::sync_totals();
        Checkpoint::store(&sample(), &p, None).unwrap();
        assert!(Checkpoint::sync_totals().0 > syncs);
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys.len(), 3);
        assert_eq!(v["apiVersion"], CHECKPOINT_API_VERSION);
        // The same checksum as Checkpoint::new computes for the body.
        assert_eq!(v["checksum"], Checkpoint::new(sample()).checksum.as_str());
        assert!(text.contains(&String::from_utf8(canonical(&sample()).unwrap()).unwrap()));
    }

    #[test]
    fn pretty_files_of_earlier_versions_still_load() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("checkpoint.json");
        let doc = serde_json::to_vec_pretty(&Checkpoint::new(sample())).unwrap();
        std::fs::write(&p, doc).unwrap();
        assert_eq!(Checkpoint::load(&p).unwrap().unwrap().body, sample());
        // A shape error under the known version is reported as malformed.
        std::fs::write(
            &p,
            format!(r#"{{"apiVersion":"{CHECKPOINT_API_VERSION}","checksum":"x","body":{{"claims":7}}}}"#),
        )
        .unwrap();
        assert!(matches!(
            Checkpoint::load(&p),
            Err(CheckpointError::Malformed { .. })
        ));
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
