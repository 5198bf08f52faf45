//! The simulator's configuration file (JSON) and the Rust helpers tests use to
//! write it.

use std::path::{Path, PathBuf};

use carve_model::GpuModel;
use serde::{Deserialize, Serialize};

/// Environment variable holding the path of the configuration file.
pub const CONFIG_ENV: &str = "CARVE_NVML_SIM_CONFIG";

/// Environment variable with extra faults, a JSON array of [`Fault`], added to
/// the configuration's at each `nvmlInit` (for processes whose configuration
/// file is shared).
pub const FAULTS_ENV: &str = "CARVE_NVML_SIM_FAULTS";

/// Suffix of the side-car configuration file looked up next to the loaded
/// library when [`CONFIG_ENV`] is unset: `libnvidia_ml_sim.so` reads
/// `libnvidia_ml_sim.so.json`.
pub const SIDECAR_SUFFIX: &str = ".json";

/// Whole simulator configuration.
///
/// ```json
/// {
///   "nodeName": "node-a",
///   "gpus": [{"model": "h100-80gb", "count": 8, "migEnabled": true}],
///   "stateFile": "/var/lib/sim/state.json",
///   "procRoot": "/var/lib/sim/proc",
///   "driverVersion": "580.65.06",
///   "faults": [{"function": "nvmlGpuInstanceDestroy", "nth": 1,
///               "action": {"kind": "fail", "code": 19}}],
///   "corruptProfile": {"gpu": 0, "profile": "1g.10gb"}
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SimConfig {
    /// Node name; GPU UUIDs are derived from it and the GPU index.
    pub node_name: String,
    /// GPUs in NVML index order.
    pub gpus: Vec<GpuEntry>,
    /// Where MIG modes, instances and counters persist.
    pub state_file: PathBuf,
    /// Fake `/proc/driver/nvidia`: capability files go under
    /// `<proc_root>/capabilities/gpu<minor>/mig/gi<g>[/ci<c>]/access`.
    pub proc_root: PathBuf,
    /// Driver version reported by `nvmlSystemGetDriverVersion`.
    #[serde(default = "default_driver_version")]
    pub driver_version: String,
    /// Injected faults.
    #[serde(default)]
    pub faults: Vec<Fault>,
    /// Report broken data for one profile (its compute slice count as 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub corrupt_profile: Option<CorruptProfile>,
    /// Answer `nvmlDeviceGetAttributes_v2` for MIG device handles only, as
    /// NVML documents it; by default the simulator also answers for whole GPUs
    /// (whether real drivers do is unverified).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub attributes_mig_only: bool,
    /// GPU indexes that do not support events: `nvmlDeviceGetSupportedEventTypes`
    /// reports none and `nvmlDeviceRegisterEvents` fails with `NOT_SUPPORTED`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events_unsupported: Vec<u32>,
}

fn default_driver_version() -> String {
    "580.65.06".into()
}

fn one() -> u32 {
    1
}

/// One or more identical GPUs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuEntry {
    /// Model key or alias of `carve_model::MODELS`.
    pub model: String,
    /// How many GPUs of this model.
    #[serde(default = "one")]
    pub count: u32,
    /// Initial MIG mode (current and pending) when no state file exists yet.
    #[serde(default)]
    pub mig_enabled: bool,
}

/// A fault to inject at the `nth` (1-based) call of `function` since init.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Fault {
    /// Exported NVML function name, e.g. `nvmlDeviceCreateGpuInstanceWithPlacement`.
    pub function: String,
    /// Which call (1 = first call after `nvmlInit`).
    pub nth: u32,
    /// What happens.
    pub action: FaultAction,
}

/// What an injected fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "camelCase", deny_unknown_fields)]
pub enum FaultAction {
    /// Return this NVML code without doing anything.
    Fail {
        /// The `nvmlReturn_t` to return.
        code: u32,
    },
    /// `std::process::abort()` before the call has any effect.
    AbortBefore,
    /// `std::process::abort()` after the call took effect and was persisted.
    AbortAfter,
}

/// Selects a profile whose data the simulator reports inconsistently.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CorruptProfile {
    /// GPU index.
    pub gpu: u32,
    /// Profile name, e.g. `1g.10gb`.
    pub profile: String,
}

/// Errors of the configuration and state helpers.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A file is not valid JSON of the expected shape.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: serde_json::Error,
    },
    /// The configuration names an unknown GPU model.
    #[error("{path}: gpus[{entry}]: unknown model {model:?} (known: {known})")]
    UnknownModel {
        /// The configuration file.
        path: PathBuf,
        /// Position in `gpus`.
        entry: usize,
        /// The unknown key.
        model: String,
        /// Known keys.
        known: String,
    },
    /// The state file does not describe the configured GPUs.
    #[error("{path}: state holds GPUs {found:?}, configuration says {expected:?}")]
    StateMismatch {
        /// The state file.
        path: PathBuf,
        /// Model keys in the state file.
        found: Vec<String>,
        /// Model keys from the configuration.
        expected: Vec<String>,
    },
    /// A line of the injected-events file is not an event.
    #[error("{path}: line at byte offset {offset}: {source}")]
    BadEvent {
        /// The events file.
        path: PathBuf,
        /// Byte offset of the line.
        offset: u64,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A GPU index does not exist.
    #[error("{path}: no GPU {gpu}")]
    NoSuchGpu {
        /// The state file.
        path: PathBuf,
        /// The index.
        gpu: u32,
    },
}

impl SimConfig {
    /// A configuration with `gpus`, state and proc tree under `dir`, no faults.
    #[must_use]
    pub fn new(node_name: &str, gpus: Vec<GpuEntry>, dir: &Path) -> Self {
        Self {
            node_name: node_name.into(),
            gpus,
            state_file: dir.join("nvml-sim-state.json"),
            proc_root: dir.join("proc"),
            driver_version: default_driver_version(),
            faults: Vec::new(),
            corrupt_profile: None,
            attributes_mig_only: false,
            events_unsupported: Vec::new(),
        }
    }

    /// Read a configuration file.
    ///
    /// # Errors
    /// The file is unreadable or not a valid configuration.
    pub fn from_file(path: &Path) -> Result<Self, SimError> {
        let text = std::fs::read(path).map_err(|source| SimError::Io {
            path: path.into(),
            source,
        })?;
        let cfg: Self = serde_json::from_slice(&text).map_err(|source| SimError::Json {
            path: path.into(),
            source,
        })?;
        cfg.model_keys(path)?;
        Ok(cfg)
    }

    /// Write the configuration atomically (temp file + rename).
    ///
    /// # Errors
    /// The file cannot be written.
    pub fn to_file(&self, path: &Path) -> Result<(), SimError> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|source| SimError::Json {
            path: path.into(),
            source,
        })?;
        write_atomic(path, &bytes)
    }

    /// The model key of every GPU, in index order (aliases resolved).
    ///
    /// # Errors
    /// [`SimError::UnknownModel`] naming `path` and the entry.
    pub fn model_keys(&self, path: &Path) -> Result<Vec<&'static str>, SimError> {
        let mut out = Vec::new();
        for (entry, g) in self.gpus.iter().enumerate() {
            let m = GpuModel::find(&g.model).ok_or_else(|| SimError::UnknownModel {
                path: path.into(),
                entry,
                model: g.model.clone(),
                known: GpuModel::keys().join(", "),
            })?;
            out.extend(std::iter::repeat_n(m.key, g.count as usize));
        }
        Ok(out)
    }

    /// Initial MIG mode of each GPU, in index order.
    #[must_use]
    pub fn initial_mig(&self) -> Vec<bool> {
        self.gpus
            .iter()
            .flat_map(|g| std::iter::repeat_n(g.mig_enabled, g.count as usize))
            .collect()
    }
}

impl GpuEntry {
    /// `count` GPUs of `model` with MIG mode `mig_enabled`.
    #[must_use]
    pub fn new(model: &str, count: u32, mig_enabled: bool) -> Self {
        Self {
            model: model.into(),
            count,
            mig_enabled,
        }
    }
}

/// Write `bytes` to `path` through a temporary file in the same directory and a
/// rename, so readers (and a process that crashes mid-write) see the old or the
/// new content, never a half-written file. No fsync: the simulator guards
/// against process crashes, not power loss.
///
/// # Errors
/// Any I/O failure; the temporary file is removed then.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), SimError> {
    let io = |source| SimError::Io {
        path: path.into(),
        source,
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp.{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let res = (|| {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        std::fs::rename(&tmp, path)
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_model_expansion() {
        let d = tempfile::tempdir().unwrap();
        let mut c = SimConfig::new(
            "n",
            vec![
                GpuEntry::new("h100", 2, true),
                GpuEntry::new("a30", 1, false),
            ],
            d.path(),
        );
        c.faults.push(Fault {
            function: "nvmlGpuInstanceDestroy".into(),
            nth: 2,
            action: FaultAction::AbortAfter,
        });
        let p = d.path().join("c.json");
        c.to_file(&p).unwrap();
        let back = SimConfig::from_file(&p).unwrap();
        assert_eq!(back, c);
        assert_eq!(
            back.model_keys(&p).unwrap(),
            ["h100-80gb", "h100-80gb", "a30-24gb"]
        );
        assert_eq!(back.initial_mig(), [true, true, false]);
    }

    #[test]
    fn unknown_model_and_unknown_field_name_the_problem() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.json");
        let mut c = SimConfig::new("n", vec![GpuEntry::new("h100", 1, true)], d.path());
        c.gpus.push(GpuEntry::new("v100", 1, true));
        c.to_file(&p).unwrap();
        let e = SimConfig::from_file(&p).unwrap_err().to_string();
        assert!(
            e.contains("gpus[1]") && e.contains("v100") && e.contains("c.json"),
            "{e}"
        );
        std::fs::write(
            &p,
            r#"{"nodeName":"n","gpus":[],"stateFile":"s","procRoot":"p","gpuz":1}"#,
        )
        .unwrap();
        let e = SimConfig::from_file(&p).unwrap_err().to_string();
        assert!(e.contains("gpuz"), "{e}");
    }

    #[test]
    fn failed_atomic_write_keeps_the_old_file_and_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        write_atomic(&p, b"old").unwrap();
        // A directory in the way of the temporary file makes the write fail.
        let mut tmp = p.clone().into_os_string();
        tmp.push(format!(".tmp.{}", std::process::id()));
        std::fs::create_dir(&tmp).unwrap();
        assert!(write_atomic(&p, b"new").is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"old");
    }
}
