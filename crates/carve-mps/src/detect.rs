//! What the node supports, detected once at plugin start: the MPS control
//! protocol, cgroup v2 and the `dmem` controller.
//!
//! Protocol detection: carve starts a scratch daemon with `-d -p 3` in a
//! private pipe directory and quits it again. A control binary without v3
//! rejects the unknown `-p` option and exits non-zero: that is v2. A binary
//! that does not exist is "MPS not installed". (`--version` output is not
//! documented to name the protocol, so carve does not parse it.)

use std::path::{Path, PathBuf};
use std::time::Duration;

use carve_model::sharing::{ComputeLimit, MemoryLimit, MpsCapabilities};
use serde::{Deserialize, Serialize};

use crate::control::{Daemon, Protocol};
use crate::error::{MpsError, io};
use crate::proc;

/// Which protocol the configuration asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProtocolChoice {
    /// The strongest the node supports.
    #[default]
    Auto,
    /// Legacy v2 only.
    V2,
    /// v3; an error where unsupported.
    V3,
}

/// Supervisor configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpsConfig {
    /// Path of `nvidia-cuda-mps-control`.
    pub control_binary: PathBuf,
    /// The MPS root: one directory per unit below it (0700), normally
    /// `<plugin state dir>/mps`. Unit pipe directories are bind-mounted into
    /// workload containers, so this must be a host path (or mounted at the
    /// same path as on the host).
    pub root: PathBuf,
    /// cgroup v2 mount, normally `/sys/fs/cgroup`.
    pub cgroup_root: PathBuf,
    /// Requested protocol.
    pub protocol: ProtocolChoice,
    /// Bound on every wait: daemon readiness, commands, exit after quit.
    pub timeout: Duration,
}

impl MpsConfig {
    /// Defaults for a plugin state directory: MPS root `<state_root>/mps`,
    /// `/usr/bin/nvidia-cuda-mps-control`, `/sys/fs/cgroup`, automatic
    /// protocol, 10 s waits.
    #[must_use]
    pub fn new(state_root: impl Into<PathBuf>) -> Self {
        Self {
            control_binary: PathBuf::from("/usr/bin/nvidia-cuda-mps-control"),
            root: state_root.into().join("mps"),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            protocol: ProtocolChoice::Auto,
            timeout: Duration::from_secs(10),
        }
    }

    /// The MPS root ([`MpsConfig::root`]).
    #[must_use]
    pub fn mps_root(&self) -> PathBuf {
        self.root.clone()
    }
}

/// What the node supports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Support {
    /// The protocol carve will use.
    pub protocol: Protocol,
    /// cgroup v2 is mounted at the cgroup root.
    pub cgroup_v2: bool,
    /// `dmem` regions (`nvidia/<pci>/vidmem`) from `dmem.capacity`; empty when
    /// the controller is missing.
    pub dmem_regions: Vec<String>,
}

impl Support {
    /// The enforcement levels to publish: v3 namespaces bound to cgroups give
    /// `hard` memory and `percentage` compute limits; otherwise both are `client`.
    /// (`partition` needs static SM partitioning, which carve does not set up.)
    #[must_use]
    pub fn capabilities(&self) -> MpsCapabilities {
        if self.protocol == Protocol::V3 && self.cgroup_v2 {
            MpsCapabilities {
                memory_limit: MemoryLimit::Hard,
                compute_limit: ComputeLimit::Percentage,
            }
        } else {
            MpsCapabilities {
                memory_limit: MemoryLimit::Client,
                compute_limit: ComputeLimit::Client,
            }
        }
    }

    /// The `dmem` region of the GPU at PCI bus id `pci` (any domain width, any case).
    #[must_use]
    pub fn dmem_region(&self, pci: &str) -> Option<&str> {
        let want = normalize_pci(pci);
        self.dmem_regions
            .iter()
            .find(|r| r.split('/').nth(1).map(normalize_pci).as_deref() == Some(want.as_str()))
            .map(String::as_str)
    }
}

/// `00000000:3B:00.0` and `0000:3b:00.0` both become `0000:3b:00.0`.
fn normalize_pci(s: &str) -> String {
    let s = s.to_ascii_lowercase();
    match s.split_once(':') {
        Some((dom, rest)) if dom.len() > 4 => format!("{}:{rest}", &dom[dom.len() - 4..]),
        _ => s,
    }
}

/// cgroup v2 presence and `dmem` regions under `root`.
///
/// # Errors
/// Unreadable `dmem.capacity` when the controller is listed.
pub fn detect_cgroup(root: &Path) -> Result<(bool, Vec<String>), MpsError> {
    let Ok(controllers) = std::fs::read_to_string(root.join("cgroup.controllers")) else {
        return Ok((false, Vec::new()));
    };
    if !controllers.split_whitespace().any(|c| c == "dmem") {
        return Ok((true, Vec::new()));
    }
    let cap = root.join("dmem.capacity");
    let text = std::fs::read_to_string(&cap).map_err(io("read", &cap))?;
    let regions = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|r| r.starts_with("nvidia/"))
        .map(str::to_string)
        .collect();
    Ok((true, regions))
}

/// Detect what the node supports and check it against the configuration.
///
/// # Errors
/// [`MpsError::NotInstalled`] without the control binary;
/// [`MpsError::StrategyUnsupported`] when v3 is required but the binary or the
/// cgroup setup lacks it. No probe daemon is left running either way.
pub fn detect(cfg: &MpsConfig) -> Result<Support, MpsError> {
    proc::executable(&cfg.control_binary).map_err(|why| MpsError::NotInstalled {
        path: cfg.control_binary.clone(),
        why,
    })?;
    let (cgroup_v2, dmem_regions) = detect_cgroup(&cfg.cgroup_root)?;
    let v3 = match cfg.protocol {
        ProtocolChoice::V2 => false,
        ProtocolChoice::Auto | ProtocolChoice::V3 => probe_v3(cfg)?,
    };
    if cfg.protocol == ProtocolChoice::V3 {
        if !v3 {
            return Err(MpsError::StrategyUnsupported {
                wanted: "protocol v3".into(),
                why: format!("{} rejects -p 3", cfg.control_binary.display()),
            });
        }
        if !cgroup_v2 {
            return Err(MpsError::StrategyUnsupported {
                wanted: "protocol v3".into(),
                why: format!("no cgroup v2 at {}", cfg.cgroup_root.display()),
            });
        }
    }
    // v3 without cgroup v2 cannot bind namespaces to pods: use v2.
    let protocol = if v3 && cgroup_v2 {
        Protocol::V3
    } else {
        Protocol::V2
    };
    Ok(Support {
        protocol,
        cgroup_v2,
        dmem_regions,
    })
}

fn probe_v3(cfg: &MpsConfig) -> Result<bool, MpsError> {
    let dir = cfg.mps_root().join("probe");
    crate::control::make_private_dir(&cfg.mps_root())?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(io("remove", &dir))?;
    }
    crate::control::make_private_dir(&dir)?;
    let d = Daemon::new(cfg, "probe", &dir, None);
    let ok = match d.start(Protocol::V3) {
        Ok(id) => {
            d.stop(&id)?;
            true
        }
        // The binary ran and refused `-p 3`: a v2-only driver. Anything else
        // (it could not be run, timed out) is an error, not a protocol answer.
        Err(MpsError::StartFailed { .. }) => false,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
    };
    std::fs::remove_dir_all(&dir).map_err(io("remove", &dir))?;
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_ids_match_across_domain_widths() {
        let s = Support {
            protocol: Protocol::V3,
            cgroup_v2: true,
            dmem_regions: vec![
                "nvidia/0000:3b:00.0/vidmem".into(),
                "nvidia/0000:86:00.0/vidmem".into(),
            ],
        };
        assert_eq!(
            s.dmem_region("00000000:86:00.0"),
            Some("nvidia/0000:86:00.0/vidmem")
        );
        assert_eq!(
            s.dmem_region("0000:3B:00.0"),
            Some("nvidia/0000:3b:00.0/vidmem")
        );
        assert_eq!(s.dmem_region("0000:01:00.0"), None);
    }

    #[test]
    fn cgroup_detection_reads_controllers_and_capacity() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(detect_cgroup(d.path()).unwrap(), (false, vec![]));
        std::fs::write(d.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        assert_eq!(detect_cgroup(d.path()).unwrap(), (true, vec![]));
        std::fs::write(d.path().join("cgroup.controllers"), "cpu dmem memory\n").unwrap();
        assert!(detect_cgroup(d.path()).is_err());
        std::fs::write(
            d.path().join("dmem.capacity"),
            "drm/0000:00:02.0/vram0 1024\nnvidia/0000:3b:00.0/vidmem 85899345920\n",
        )
        .unwrap();
        assert_eq!(
            detect_cgroup(d.path()).unwrap(),
            (true, vec!["nvidia/0000:3b:00.0/vidmem".to_string()])
        );
    }
}
