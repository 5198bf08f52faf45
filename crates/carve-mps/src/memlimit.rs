//! Hard MPS memory limits: NVIDIA's memory partitioning, set on a pod's
//! cgroup through `nvidia-smi memory-limits` and read back from `dmem.max`.
//!
//! What NVIDIA documents (`../shared/reference/mps-v3.md` 1.9, 1.10; the
//! tags name the page: [MP] the memory-partitioning page, [NVML] the NVML
//! struct pages, [DYN] NVIDIA Dynamo's MPS guide with its measured
//! behaviour):
//! - It needs cgroup v2 at the cgroup root, driver r615+ / CUDA 13.4, and a
//!   **non-MIG** GPU: MIG is unsupported and NVML rejects MIG handles [MP].
//!   Setting a limit needs root [MP].
//! - Two backends: `dmem` (kernel 6.14+; the limit is the cgroup's
//!   `dmem.max` line for the GPU's key `nvidia/<PCI BDF>/vidmem`, listed in
//!   the root's `dmem.capacity`) and `misc` (the driver keeps the
//!   accounting internally; no files) [MP], [DYN].
//! - Limits are set only through `nvidia-smi memory-limits` or NVML, never by
//!   writing `dmem.*` files [MP]. carve uses `nvidia-smi`: the NVML struct is
//!   spelled two ways in NVIDIA's pages and its constants are not given, so
//!   it cannot be bound faithfully. Values are MiB integers, `max` or
//!   `default`; `memory-limits` comes first; `-n/--namespace` takes the full
//!   cgroup path; `-i` takes an index or a UUID [DYN]. carve passes the UUID,
//!   so NVML's and nvidia-smi's index orders cannot disagree.
//! - The output of `--get` is not documented, so carve does not parse it: it
//!   reads the limit back from `dmem.max` / `dmem.min` (documented: one line
//!   per GPU key, in bytes [DYN]). Only the dmem backend can therefore be
//!   verified, and carve publishes `hard` only there; with misc it says why
//!   memory stays `client` ([`NotHard::NoDmem`]).
//! - A limit can be set only on a cgroup that has `dmem.*` files (its parent
//!   enables `+dmem`); otherwise `Unable to get memory limit: Not Supported`
//!   [DYN]. A soft limit is added to every ancestor's `dmem.min`, and deleting
//!   the leaf leaves that behind, so carve zeroes the soft limit before the
//!   cgroup goes (at unprepare) [MP]. Clear is soft `0` and hard `max`
//!   [NVML].
//! - carve sets soft = hard ("Set soft equal to hard for a strict
//!   partition" [DYN]) on the **pod** cgroup, the only one that exists when
//!   the kubelet prepares a claim. A parent's limit bounds its children's
//!   allocations, but `cudaMemGetInfo` in the container still reports the
//!   whole GPU [DYN, Verified Behavior].

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::detect::Support;
use crate::proc;

/// Bytes in a MiB: `dmem.*` files are in bytes, the tool takes MiB.
pub const MIB: u64 = 1024 * 1024;

/// Why a whole GPU's MPS memory limit is not `hard` on this node.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotHard {
    /// A MIG instance: memory partitioning does not support MIG [MP].
    #[error(
        "memory partitioning does not support MIG (NVML rejects MIG handles), so a MIG-MPS share's memory limit is the CUDA client's, which a tenant can escape (v3: the namespace's pinned limit; v2: a variable in the client's environment)"
    )]
    Mig,
    /// No `nvidia-smi` configured or usable.
    #[error(
        "no usable nvidia-smi to set memory-partitioning limits ({why}), so the share's memory limit is the CUDA client's, which a tenant can escape (v3: the namespace's pinned limit; v2: a variable in the client's environment)"
    )]
    NoTool {
        /// What is wrong (not configured, not executable).
        why: String,
    },
    /// cgroup v2 is not mounted at the cgroup root.
    #[error(
        "{root} is not a cgroup v2 root (no cgroup.controllers); memory partitioning needs cgroup v2, so the share's memory limit is the CUDA client's"
    )]
    NoCgroup2 {
        /// The cgroup root.
        root: PathBuf,
    },
    /// The dmem controller is missing (misc backend or none).
    #[error(
        "{root} has no dmem controller: without it the driver uses the misc backend (kernel before 6.14, or cgroup_disable=dmem) or none, whose limits carve cannot read back, so it does not claim them; the share's memory limit is the CUDA client's"
    )]
    NoDmem {
        /// The cgroup root.
        root: PathBuf,
    },
    /// The GPU's key is not in `dmem.capacity`.
    #[error(
        "{root}/dmem.capacity lists no nvidia/{pci}/vidmem region, so the driver does not account this GPU's memory through dmem; the share's memory limit is the CUDA client's"
    )]
    GpuNotInDmem {
        /// The cgroup root.
        root: PathBuf,
        /// The GPU's PCI bus id.
        pci: String,
    },
    /// The GPU's PCI bus id is not known.
    #[error(
        "the GPU's PCI bus id is unknown, so its dmem region cannot be named; the share's memory limit is the CUDA client's"
    )]
    NoPci,
}

/// Why setting, reading back or clearing a limit failed, naming the GPU and
/// the cgroup.
#[derive(Debug, thiserror::Error)]
#[error("memory limit of GPU {gpu} on cgroup {}: {what}", cgroup.display())]
pub struct MemLimitError {
    /// GPU UUID.
    pub gpu: String,
    /// Full cgroup path.
    pub cgroup: PathBuf,
    /// What failed (boxed: it is large).
    pub what: Box<MemLimitFailure>,
}

/// What failed in a [`MemLimitError`].
#[derive(Debug, thiserror::Error)]
pub enum MemLimitFailure {
    /// The tool could not be run or timed out.
    #[error("running {command:?} failed: {why}")]
    Spawn {
        /// The command line.
        command: String,
        /// Spawn error or timeout.
        why: String,
    },
    /// The tool refused (non-zero exit or killed).
    #[error("{command:?} failed ({status}): {output}")]
    Refused {
        /// The command line.
        command: String,
        /// Exit status.
        status: String,
        /// Its stderr and stdout.
        output: String,
    },
    /// What `dmem.max`/`dmem.min` says is not what was set.
    #[error("{file} has {got:?} for {key} after nvidia-smi set {want:?}")]
    ReadBack {
        /// `dmem.max` or `dmem.min`.
        file: &'static str,
        /// The dmem key.
        key: String,
        /// Expected value (bytes or `max`).
        want: String,
        /// Found value, or why none.
        got: String,
    },
}

fn failed(gpu: &Gpu<'_>, cgroup: PathBuf, what: MemLimitFailure) -> MemLimitError {
    MemLimitError {
        gpu: gpu.uuid.to_string(),
        cgroup,
        what: Box::new(what),
    }
}

/// Where a share's limit goes: the GPU and its dmem key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu<'a> {
    /// GPU UUID (passed as `-i`).
    pub uuid: &'a str,
    /// Its dmem key, `nvidia/<PCI BDF>/vidmem`.
    pub key: &'a str,
}

/// The tool and the cgroup root.
#[derive(Clone, Debug)]
pub struct MemLimits {
    /// `nvidia-smi`.
    pub tool: PathBuf,
    /// The cgroup v2 mount.
    pub cgroup_root: PathBuf,
    /// Bound on one tool call.
    pub timeout: Duration,
}

/// Whether a whole GPU at `pci` gets hard memory limits: the dmem key of
/// its region, or why not.
///
/// # Errors
/// [`NotHard`] naming the missing condition.
pub fn whole_gpu(
    support: &Support,
    cgroup_root: &Path,
    pci: Option<&str>,
) -> Result<String, NotHard> {
    if let Some(why) = &support.nvidia_smi_missing {
        return Err(NotHard::NoTool { why: why.clone() });
    }
    if support.nvidia_smi.is_none() {
        return Err(NotHard::NoTool {
            why: "not configured".into(),
        });
    }
    if !support.cgroup_v2 {
        return Err(NotHard::NoCgroup2 {
            root: cgroup_root.to_path_buf(),
        });
    }
    if support.dmem_regions.is_empty() {
        return Err(NotHard::NoDmem {
            root: cgroup_root.to_path_buf(),
        });
    }
    let pci = pci.ok_or(NotHard::NoPci)?;
    support
        .dmem_region(pci)
        .map(str::to_string)
        .ok_or_else(|| NotHard::GpuNotInDmem {
            root: cgroup_root.to_path_buf(),
            pci: pci.to_string(),
        })
}

/// The value of `key` in a `dmem.*` file's text (`<key> <value>` lines).
#[must_use]
pub fn dmem_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some(key)).then(|| w.next()).flatten()
    })
}

impl MemLimits {
    /// The tool and cgroup root of a configured node, if the tool was found.
    #[must_use]
    pub fn of(support: &Support, cgroup_root: &Path, timeout: Duration) -> Option<Self> {
        support.nvidia_smi.clone().map(|tool| Self {
            tool,
            cgroup_root: cgroup_root.to_path_buf(),
            timeout,
        })
    }

    /// Soft and hard limit `mib` on cgroup `rel` (relative to the root) for
    /// `gpu`, read back from `dmem.max` and `dmem.min`. A read-back that
    /// differs clears the limit again (best effort) and fails.
    ///
    /// # Errors
    /// The tool failing or the read-back differing.
    pub fn set(&self, gpu: &Gpu<'_>, rel: &Path, mib: u64) -> Result<(), MemLimitError> {
        let n = mib.to_string();
        self.call(gpu, rel, &n, &n)?;
        let want = (mib * MIB).to_string();
        let checked = self
            .read_back(gpu, rel, "dmem.max", &want)
            .and_then(|()| self.read_back(gpu, rel, "dmem.min", &want));
        if let Err(e) = checked {
            if let Err(ce) = self.clear(gpu, rel) {
                tracing::error!(gpu = gpu.uuid, cgroup = %rel.display(), error = %ce, "clearing a memory limit whose read-back differed");
            }
            return Err(e);
        }
        Ok(())
    }

    /// Soft `0` and hard `max` on cgroup `rel` for `gpu` (soft zeroed so the
    /// ancestors' `dmem.min` loses the reservation before the cgroup goes),
    /// read back. A cgroup that no longer exists has no limit to clear
    /// (removing a cgroup clears its limits [NVML]; what the driver leaves in
    /// the ancestors is then out of reach): `Ok`, logged.
    ///
    /// # Errors
    /// The tool failing or the read-back differing.
    pub fn clear(&self, gpu: &Gpu<'_>, rel: &Path) -> Result<(), MemLimitError> {
        let full = self.cgroup_root.join(rel);
        if !full.is_dir() {
            tracing::warn!(gpu = gpu.uuid, cgroup = %full.display(), "cgroup is gone before its memory limit was cleared; an ancestor's dmem.min may keep its soft reservation");
            return Ok(());
        }
        self.call(gpu, rel, "0", "max")?;
        self.read_back(gpu, rel, "dmem.max", "max")?;
        self.read_back(gpu, rel, "dmem.min", "0")
    }

    fn call(&self, gpu: &Gpu<'_>, rel: &Path, soft: &str, hard: &str) -> Result<(), MemLimitError> {
        let full = self.cgroup_root.join(rel);
        let args: Vec<std::ffi::OsString> = vec![
            "memory-limits".into(),
            "--set".into(),
            "--namespace".into(),
            full.clone().into_os_string(),
            "--soft-limit".into(),
            soft.into(),
            "--hard-limit".into(),
            hard.into(),
            "-i".into(),
            gpu.uuid.into(),
        ];
        let command = format!(
            "{} {}",
            self.tool.display(),
            args.iter()
                .map(|a| a.to_string_lossy())
                .collect::<Vec<_>>()
                .join(" ")
        );
        let mut cmd = Command::new(&self.tool);
        cmd.args(&args);
        let out = proc::run(cmd, "", self.timeout).map_err(|why| {
            failed(
                gpu,
                full.clone(),
                MemLimitFailure::Spawn {
                    command: command.clone(),
                    why,
                },
            )
        })?;
        if !out.status.success() {
            return Err(failed(
                gpu,
                full,
                MemLimitFailure::Refused {
                    command,
                    status: out.status.to_string(),
                    output: format!("{} {}", out.stderr.trim(), out.stdout.trim())
                        .trim()
                        .to_string(),
                },
            ));
        }
        Ok(())
    }

    fn read_back(
        &self,
        gpu: &Gpu<'_>,
        rel: &Path,
        file: &'static str,
        want: &str,
    ) -> Result<(), MemLimitError> {
        let full = self.cgroup_root.join(rel);
        let got = match std::fs::read_to_string(full.join(file)) {
            Ok(t) => dmem_value(&t, gpu.key)
                .map_or_else(|| format!("no line for {}", gpu.key), str::to_string),
            Err(e) => format!("unreadable: {e}"),
        };
        if got == want {
            return Ok(());
        }
        Err(failed(
            gpu,
            full,
            MemLimitFailure::ReadBack {
                file,
                key: gpu.key.to_string(),
                want: want.to_string(),
                got,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::Protocol;

    fn support(smi: bool, v2: bool, dmem: bool) -> Support {
        Support {
            protocol: Protocol::V3,
            cgroup_v2: v2,
            dmem_regions: if dmem {
                vec!["nvidia/0000:3b:00.0/vidmem".into()]
            } else {
                vec![]
            },
            nvidia_smi: smi.then(|| PathBuf::from("/bin/true")),
            nvidia_smi_missing: None,
        }
    }

    #[test]
    fn hard_only_with_tool_cgroup2_and_the_gpus_dmem_region() {
        let root = Path::new("/sys/fs/cgroup");
        let pci = Some("00000000:3B:00.0");
        assert_eq!(
            whole_gpu(&support(true, true, true), root, pci).as_deref(),
            Ok("nvidia/0000:3b:00.0/vidmem")
        );
        assert!(matches!(
            whole_gpu(&support(false, true, true), root, pci),
            Err(NotHard::NoTool { .. })
        ));
        assert!(matches!(
            whole_gpu(&support(true, false, false), root, pci),
            Err(NotHard::NoCgroup2 { .. })
        ));
        // misc backend: cgroup v2 without dmem regions.
        assert!(matches!(
            whole_gpu(&support(true, true, false), root, pci),
            Err(NotHard::NoDmem { .. })
        ));
        assert!(matches!(
            whole_gpu(&support(true, true, true), root, Some("0000:86:00.0")),
            Err(NotHard::GpuNotInDmem { .. })
        ));
        assert_eq!(
            whole_gpu(&support(true, true, true), root, None),
            Err(NotHard::NoPci)
        );
        let mut missing = support(true, true, true);
        missing.nvidia_smi_missing = Some("/x/nvidia-smi does not exist".into());
        assert!(
            whole_gpu(&missing, root, pci)
                .unwrap_err()
                .to_string()
                .contains("/x/nvidia-smi does not exist")
        );
    }

    #[test]
    fn dmem_lines_are_keyed() {
        let t = "nvidia/0000:3b:00.0/vidmem 1048576\nnvidia/0000:86:00.0/vidmem max\n";
        assert_eq!(dmem_value(t, "nvidia/0000:3b:00.0/vidmem"), Some("1048576"));
        assert_eq!(dmem_value(t, "nvidia/0000:86:00.0/vidmem"), Some("max"));
        assert_eq!(dmem_value(t, "nvidia/0000:01:00.0/vidmem"), None);
    }
}
