//! Persistent simulator state: MIG modes, GPU and compute instances, counters.
//! Written atomically to the state file after every mutation and reloaded at
//! `nvmlInit`, so a restarted process sees the instances it created.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::{SimConfig, SimError, write_atomic};

/// Everything that survives a process restart.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SimState {
    /// Per GPU, in index order.
    pub gpus: Vec<GpuState>,
    /// Next serial number (handles and MIG UUIDs are derived from serials, so a
    /// destroyed instance's handle never names a new one).
    pub next_serial: u64,
    /// Next capability device-file minor.
    pub next_cap_minor: u32,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuState {
    /// Model key.
    pub model: String,
    /// MIG mode in effect.
    pub mig_current: bool,
    /// MIG mode after the next reset.
    pub mig_pending: bool,
    /// GPU instances.
    pub gpu_instances: Vec<GiState>,
    /// Compute mode of the whole GPU (`nvmlComputeMode_t`).
    #[serde(default)]
    pub compute_mode: u32,
}

/// One GPU instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GiState {
    /// Unique serial (handle).
    pub serial: u64,
    /// GPU-instance id.
    pub id: u32,
    /// Profile id.
    pub profile_id: u32,
    /// Placement start (memory slice).
    pub start: u8,
    /// Capability device-file minor.
    pub cap_minor: u32,
    /// Compute instances.
    pub compute_instances: Vec<CiState>,
}

/// One compute instance.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CiState {
    /// Unique serial (handle, MIG device handle, MIG UUID).
    pub serial: u64,
    /// Compute-instance id within its GPU instance.
    pub id: u32,
    /// Compute-instance profile id.
    pub profile_id: u32,
    /// Compute slices it uses.
    pub slices: u32,
    /// Placement start within the GPU instance (compute slices).
    pub start: u32,
    /// Capability device-file minor.
    pub cap_minor: u32,
    /// MIG device UUID.
    pub uuid: String,
    /// Compute mode of its MIG device (`nvmlComputeMode_t`).
    #[serde(default)]
    pub compute_mode: u32,
}

impl SimState {
    /// Fresh state for `cfg`: no instances, MIG modes as configured.
    #[must_use]
    pub fn fresh(models: &[&str], mig: &[bool]) -> Self {
        Self {
            gpus: models
                .iter()
                .zip(mig)
                .map(|(m, &on)| GpuState {
                    model: (*m).into(),
                    mig_current: on,
                    mig_pending: on,
                    gpu_instances: Vec::new(),
                    compute_mode: 0,
                })
                .collect(),
            next_serial: 1,
            // 0 is nvidiactl's, 1 and 2 are the MIG config/monitor capabilities.
            next_cap_minor: 3,
        }
    }

    /// Load `path`, or `None` when it does not exist.
    ///
    /// # Errors
    /// Unreadable or malformed file.
    pub fn load(path: &Path) -> Result<Option<Self>, SimError> {
        match std::fs::read(path) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|source| SimError::Json {
                    path: path.into(),
                    source,
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(SimError::Io {
                path: path.into(),
                source,
            }),
        }
    }

    /// Persist atomically.
    ///
    /// # Errors
    /// I/O failure; the previous file is left intact.
    pub fn save(&self, path: &Path) -> Result<(), SimError> {
        let bytes = serde_json::to_vec_pretty(self).map_err(|source| SimError::Json {
            path: path.into(),
            source,
        })?;
        write_atomic(path, &bytes)
    }

    /// The state for `cfg`: the persisted one when it exists (and matches the
    /// configured GPUs), else a fresh one.
    ///
    /// # Errors
    /// Unreadable state, or state of different GPUs.
    pub fn for_config(cfg: &SimConfig, cfg_path: &Path) -> Result<Self, SimError> {
        let models = cfg.model_keys(cfg_path)?;
        match Self::load(&cfg.state_file)? {
            Some(s) => {
                let found: Vec<String> = s.gpus.iter().map(|g| g.model.clone()).collect();
                if found.iter().map(String::as_str).ne(models.iter().copied()) {
                    return Err(SimError::StateMismatch {
                        path: cfg.state_file.clone(),
                        found,
                        expected: models.iter().map(|m| (*m).to_string()).collect(),
                    });
                }
                Ok(s)
            }
            None => Ok(Self::fresh(&models, &cfg.initial_mig())),
        }
    }
}

/// Simulate a reset of GPU `gpu` (what `nvidia-smi -r` or a reboot does): a
/// pending MIG mode takes effect, GPU and compute instances are gone (with their
/// capability files) and the compute mode is back to default. Edits the state
/// file of `cfg`; call it while no process has the simulator initialised (the
/// library reloads the file at `nvmlInit`).
///
/// # Errors
/// Unreadable or unwritable state file, or no such GPU.
pub fn simulate_gpu_reset(cfg: &SimConfig, gpu: u32) -> Result<(), SimError> {
    let mut s = SimState::for_config(cfg, &cfg.state_file)?;
    let g = s
        .gpus
        .get_mut(gpu as usize)
        .ok_or_else(|| SimError::NoSuchGpu {
            path: cfg.state_file.clone(),
            gpu,
        })?;
    g.mig_current = g.mig_pending;
    g.compute_mode = 0;
    g.gpu_instances.clear();
    s.save(&cfg.state_file)?;
    let mig = cfg
        .proc_root
        .join("capabilities")
        .join(format!("gpu{gpu}"))
        .join("mig");
    match std::fs::remove_dir_all(&mig) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(SimError::Io {
            path: mig,
            source: e,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GpuEntry;

    #[test]
    fn state_of_other_gpus_is_rejected_and_reset_applies_pending_mode() {
        let d = tempfile::tempdir().unwrap();
        let cfg = SimConfig::new("n", vec![GpuEntry::new("a100", 1, false)], d.path());
        let mut s = SimState::for_config(&cfg, Path::new("cfg")).unwrap();
        s.gpus[0].mig_pending = true;
        s.save(&cfg.state_file).unwrap();
        simulate_gpu_reset(&cfg, 0).unwrap();
        let s = SimState::load(&cfg.state_file).unwrap().unwrap();
        assert!(s.gpus[0].mig_current);
        assert!(matches!(
            simulate_gpu_reset(&cfg, 3),
            Err(SimError::NoSuchGpu { gpu: 3, .. })
        ));
        let other = SimConfig::new("n", vec![GpuEntry::new("h100", 1, false)], d.path());
        let e = SimState::for_config(&other, Path::new("cfg")).unwrap_err();
        assert!(matches!(e, SimError::StateMismatch { .. }), "{e}");
    }
}
