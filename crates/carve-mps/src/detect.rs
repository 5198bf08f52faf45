//! What the node supports, detected once at plugin start: the MPS control
//! protocol, cgroup v2 and the `dmem` controller.
//!
//! Protocol detection is the documented test: `nvidia-cuda-mps-control -p 3
//! -h` lists the `server` and `namespace` modules on a driver with v3 (r615+)
//! [DYN, Requirements]. It runs with a scratch pipe directory, so it never
//! talks to a running daemon (a call follows a running daemon's protocol
//! [IF]). A binary that rejects `-p 3` is v2; one that does not exist is "MPS
//! not installed". (`-v` prints a version only on Tegra, so it is not used.)
//!
//! Releases 615 and 620 are not told apart, because nothing carve does
//! behaves differently on them. What NVIDIA documents as different, in what
//! was read of 620 (`mps-v3.md` 1.5): (1) the main daemon socket routes a
//! client by its cgroup or UID (615: by UID only) — carve never gives a pod
//! the main socket, only its namespace's directory, whose socket routes to
//! that namespace on both [NS], [NS620]; (2) the configuration file's
//! namespace tables take `cgroup`, `cgroup_depth` and per-device
//! `sm_partition` (615 rejects any key but three) — carve applies no file
//! (`-a`); (3) per-device SM partitions in namespaces — carve creates none.
//! 620's command-line spelling for a cgroup binding, the one difference carve
//! could use, is not in what was read, so carve drives both with the 615 CLI.
//!
//! Enforcement published ([`Support::capabilities_of`]): memory is `hard`
//! only on a whole, non-MIG GPU where memory partitioning holds and carve can
//! verify it: an executable `nvidia-smi` is configured, cgroup v2 is at the
//! cgroup root and its `dmem.capacity` lists the GPU's `nvidia/<BDF>/vidmem`
//! region ([`crate::memlimit::whole_gpu`]). carve then sets the share's limit
//! on its pod's cgroup through `nvidia-smi memory-limits` and reads it back
//! from `dmem.max` ([`crate::memlimit`]). Everywhere else memory is
//! `client`: a v3 namespace's pinned limit is applied by the CUDA client and
//! a tenant can escape it ([DYN]: one `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`
//! entry naming an invisible device drops it); a v2 limit is the client's
//! variable; MIG is unsupported by memory partitioning [MP]; the misc backend
//! has no files to read a limit back from. Compute is `percentage` in
//! v3 (the namespace's active-thread percentage, which overrides the client's
//! variable [ENV]; a ceiling on the threads the client may use, not a
//! reservation [DYN]) and `client` in v2.

use std::path::{Path, PathBuf};
use std::time::Duration;

use carve_model::sharing::{ComputeLimit, MemoryLimit, MpsCapabilities};
use serde::{Deserialize, Serialize};

use crate::control::Protocol;
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
    /// The executable that starts a unit's daemon with the unit's tmpfs as
    /// its `/dev/shm` ([`crate::shm::exec_main`] behind
    /// [`crate::shm::EXEC_FLAG`]; the `carve` binary in the plugin), so that
    /// the MPS server and the share's containers share `/dev/shm`
    /// ([`crate::shm`]). `None`: no tmpfs, no `/dev/shm` mount in the shares'
    /// edits; the daemon keeps the plugin's `/dev/shm`, which a workload
    /// container does not see, so a real MPS client cannot use the server.
    pub shm_launcher: Option<PathBuf>,
    /// `nvidia-smi`, which sets hard memory limits (memory partitioning,
    /// [`crate::memlimit`]). `None`: none are set, memory stays `client`.
    pub nvidia_smi: Option<PathBuf>,
    /// A cgroup directory relative to [`MpsConfig::cgroup_root`] (in each of
    /// its hierarchies, [`crate::daemon_cgroup::hierarchies`]) under which
    /// every unit's daemon runs in a cgroup `<unit>` of its own, outside the
    /// plugin's, so that a container stop does not end it
    /// ([`crate::daemon_cgroup`]; needs [`MpsConfig::shm_launcher`], which
    /// moves it there). `None`: the daemon stays in the plugin's cgroup.
    pub daemon_cgroup: Option<PathBuf>,
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
            shm_launcher: None,
            nvidia_smi: None,
            daemon_cgroup: None,
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
    /// The configured `nvidia-smi`, where it is executable: hard memory
    /// limits are set through it ([`crate::memlimit`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvidia_smi: Option<PathBuf>,
    /// Why the configured `nvidia-smi` cannot be used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvidia_smi_missing: Option<String>,
}

impl Support {
    /// The base enforcement levels, without memory partitioning (memory
    /// `client`); a unit's own are [`Support::capabilities_of`].
    #[must_use]
    pub fn capabilities(&self) -> MpsCapabilities {
        capabilities(self.protocol)
    }

    /// The enforcement levels of one unit: a whole GPU's (`mig` false, at PCI
    /// bus id `pci`) memory limit is `hard` where memory partitioning holds
    /// for it ([`crate::memlimit::whole_gpu`]); a MIG instance's never is.
    #[must_use]
    pub fn capabilities_of(
        &self,
        cgroup_root: &Path,
        pci: Option<&str>,
        mig: bool,
    ) -> MpsCapabilities {
        let hard = !mig && crate::memlimit::whole_gpu(self, cgroup_root, pci).is_ok();
        self.unit_capabilities(mig, hard)
    }

    /// [`Support::capabilities_of`] for a caller that already knows whether
    /// memory partitioning holds for the unit (`hard`, from
    /// [`crate::memlimit::whole_gpu`]).
    #[must_use]
    pub fn unit_capabilities(&self, mig: bool, hard: bool) -> MpsCapabilities {
        let c = self.capabilities();
        if mig {
            return c.on_mig();
        }
        if hard {
            MpsCapabilities {
                memory_limit: MemoryLimit::Hard,
                ..c
            }
        } else {
            c
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

/// Why an MPS unit's memory limit is `client` (module docs), for the error of
/// a claim that demands `hard`; the unit's own reason is
/// [`crate::memlimit::NotHard`].
pub const WHY_MEMORY_IS_CLIENT: &str = "a v3 namespace's pinned limit is applied by the CUDA client and a tenant can escape it (NVIDIA Dynamo measured it), a v2 limit is the client's own variable; carve publishes hard only on a whole non-MIG GPU whose memory partitioning (dmem) it can set through nvidia-smi memory-limits and read back";

/// The base enforcement levels under `protocol` (before memory partitioning,
/// [`Support::capabilities_of`]): memory `client`, compute
/// `percentage` (the v3 namespace's active-thread ceiling) or `client` (v2's
/// variable).
#[must_use]
pub fn capabilities(protocol: Protocol) -> MpsCapabilities {
    MpsCapabilities {
        memory_limit: MemoryLimit::Client,
        compute_limit: match protocol {
            Protocol::V3 => ComputeLimit::Percentage,
            Protocol::V2 => ComputeLimit::Client,
        },
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
    if cfg.protocol == ProtocolChoice::V3 && !v3 {
        return Err(MpsError::StrategyUnsupported {
            wanted: "protocol v3".into(),
            why: format!(
                "{} -p 3 -h does not list the server and namespace modules",
                cfg.control_binary.display()
            ),
        });
    }
    // No cgroup binding is used, so v3 does not need cgroup v2.
    let protocol = if v3 { Protocol::V3 } else { Protocol::V2 };
    let (nvidia_smi, nvidia_smi_missing) = match &cfg.nvidia_smi {
        None => (None, None),
        Some(p) => match proc::executable(p) {
            Ok(()) => (Some(p.clone()), None),
            Err(why) => (None, Some(format!("{} {why}", p.display()))),
        },
    };
    Ok(Support {
        protocol,
        cgroup_v2,
        dmem_regions,
        nvidia_smi,
        nvidia_smi_missing,
    })
}

/// `-p 3 -h` [DYN]: v3 when it succeeds and lists `server` and `namespace`.
fn probe_v3(cfg: &MpsConfig) -> Result<bool, MpsError> {
    let dir = cfg.mps_root().join("probe");
    crate::control::make_private_dir(&cfg.mps_root())?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(io("remove", &dir))?;
    }
    crate::control::make_private_dir(&dir)?;
    let mut cmd = std::process::Command::new(&cfg.control_binary);
    cmd.args(crate::control::v3::HELP)
        .env("CUDA_MPS_PIPE_DIRECTORY", &dir)
        .env("CUDA_MPS_LOG_DIRECTORY", &dir)
        .env_remove("CUDA_MPS_PROTOCOL_VERSION");
    let out = proc::run(cmd, "", cfg.timeout);
    std::fs::remove_dir_all(&dir).map_err(io("remove", &dir))?;
    // Could not run it at all (spawn error, timeout): not a protocol answer.
    let out = out.map_err(|why| MpsError::Command {
        unit: "probe".into(),
        command: format!(
            "{} {}",
            cfg.control_binary.display(),
            crate::control::v3::HELP.join(" ")
        ),
        why,
    })?;
    Ok(out.status.success() && lists_v3_modules(&out.stdout))
}

/// Whether help text names the `server` and `namespace` modules as words.
fn lists_v3_modules(help: &str) -> bool {
    let words: Vec<&str> = help
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        .collect();
    words.contains(&"server") && words.contains(&"namespace")
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
            nvidia_smi: None,
            nvidia_smi_missing: None,
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
    fn the_v3_test_wants_both_module_words() {
        assert!(lists_v3_modules("Modules:\n  server\n  namespace\n"));
        assert!(!lists_v3_modules("get_server_list\nquit\n"));
        assert!(!lists_v3_modules("server only\n"));
    }

    #[test]
    fn memory_is_hard_only_on_a_whole_gpu_with_dmem_and_the_tool() {
        let root = Path::new("/sys/fs/cgroup");
        for protocol in [Protocol::V2, Protocol::V3] {
            let mut s = Support {
                protocol,
                cgroup_v2: true,
                dmem_regions: vec!["nvidia/0000:3b:00.0/vidmem".into()],
                nvidia_smi: None,
                nvidia_smi_missing: None,
            };
            let pci = Some("00000000:3B:00.0");
            assert_eq!(s.capabilities().memory_limit, MemoryLimit::Client);
            assert_eq!(
                s.capabilities_of(root, pci, false).memory_limit,
                MemoryLimit::Client,
                "no nvidia-smi"
            );
            s.nvidia_smi = Some(PathBuf::from("/usr/bin/nvidia-smi"));
            assert_eq!(
                s.capabilities_of(root, pci, false).memory_limit,
                MemoryLimit::Hard
            );
            assert_eq!(
                s.capabilities_of(root, pci, true).memory_limit,
                MemoryLimit::Client,
                "MIG-MPS is never hard"
            );
            assert_eq!(
                s.capabilities_of(root, Some("0000:86:00.0"), false)
                    .memory_limit,
                MemoryLimit::Client,
                "GPU not in dmem.capacity"
            );
            s.dmem_regions.clear();
            assert_eq!(
                s.capabilities_of(root, pci, false).memory_limit,
                MemoryLimit::Client,
                "misc backend"
            );
            s.cgroup_v2 = false;
            assert_eq!(
                s.capabilities_of(root, pci, false).memory_limit,
                MemoryLimit::Client,
                "cgroup v1"
            );
        }
    }

    #[test]
    fn detect_finds_the_configured_nvidia_smi_or_says_why_not() {
        let d = tempfile::tempdir().unwrap();
        let mut cfg = MpsConfig::new(d.path());
        cfg.control_binary = PathBuf::from("/bin/false");
        cfg.protocol = ProtocolChoice::V2;
        cfg.cgroup_root = d.path().join("cg");
        assert_eq!(detect(&cfg).unwrap().nvidia_smi, None);
        cfg.nvidia_smi = Some(d.path().join("nvidia-smi"));
        let s = detect(&cfg).unwrap();
        assert_eq!(s.nvidia_smi, None);
        assert!(
            s.nvidia_smi_missing
                .as_deref()
                .is_some_and(|w| w.contains("does not exist")),
            "{s:?}"
        );
        cfg.nvidia_smi = Some(PathBuf::from("/bin/true"));
        assert_eq!(
            detect(&cfg).unwrap().nvidia_smi,
            Some(PathBuf::from("/bin/true"))
        );
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
