//! The description of one GPU's MIG geometry, the same whether it comes from a
//! built-in table ([`crate::models`]) or from NVML at runtime.

use std::fmt;

use serde::{Deserialize, Serialize};

/// GPU architecture generation. Decides whether toggling MIG mode needs a GPU reset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Architecture {
    /// Ampere (A100, A30): changing MIG mode needs a GPU reset.
    Ampere,
    /// Hopper (H100, H200): MIG mode toggles without a reset.
    Hopper,
    /// Blackwell (B200).
    Blackwell,
    /// Anything else NVML reports; never MIG-capable in carve's tables.
    Other,
}

impl Architecture {
    /// The name NVIDIA uses, as published in the `architecture` attribute.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ampere => "Ampere",
            Self::Hopper => "Hopper",
            Self::Blackwell => "Blackwell",
            Self::Other => "Other",
        }
    }

    /// Whether enabling or disabling MIG mode needs a GPU reset to take effect.
    #[must_use]
    pub fn mig_mode_needs_reset(self) -> bool {
        matches!(self, Self::Ampere)
    }
}

impl fmt::Display for Architecture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Engine counts of a GPU or of one MIG profile.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Engines {
    /// Copy engines.
    pub copy: u32,
    /// Video decoders (NVDEC).
    pub decoders: u32,
    /// Video encoders (NVENC).
    pub encoders: u32,
    /// JPEG decoders (NVJPG).
    pub jpeg: u32,
    /// Optical flow accelerators (OFA).
    pub ofa: u32,
}

impl Engines {
    /// Component-wise sum.
    #[must_use]
    pub fn plus(self, o: Self) -> Self {
        Self {
            copy: self.copy + o.copy,
            decoders: self.decoders + o.decoders,
            encoders: self.encoders + o.encoders,
            jpeg: self.jpeg + o.jpeg,
            ofa: self.ofa + o.ofa,
        }
    }

    /// Component-wise maximum.
    #[must_use]
    pub fn max(self, o: Self) -> Self {
        Self {
            copy: self.copy.max(o.copy),
            decoders: self.decoders.max(o.decoders),
            encoders: self.encoders.max(o.encoders),
            jpeg: self.jpeg.max(o.jpeg),
            ofa: self.ofa.max(o.ofa),
        }
    }
}

/// A GPU-instance placement, in memory slices: `[start, start + size)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Placement {
    /// First memory slice.
    pub start: u8,
    /// Number of memory slices.
    pub size: u8,
}

impl Placement {
    /// A placement starting at `start` spanning `size` memory slices.
    #[must_use]
    pub const fn new(start: u8, size: u8) -> Self {
        Self { start, size }
    }

    /// One past the last memory slice.
    #[must_use]
    pub const fn end(self) -> u8 {
        self.start + self.size
    }

    /// Bit mask of the memory slices this placement covers.
    #[must_use]
    pub const fn mask(self) -> u16 {
        (((1u32 << self.size) - 1) << self.start) as u16
    }

    /// Whether the two placements share a memory slice.
    #[must_use]
    pub const fn overlaps(self, other: Self) -> bool {
        self.mask() & other.mask() != 0
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.start, self.size)
    }
}

/// One GPU-instance profile of a GPU, e.g. `1g.10gb` on an H100-80GB.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigProfile {
    /// Product name of the profile, e.g. `1g.10gb` or `1g.10gb+me`.
    pub name: String,
    /// NVML profile *index* (`NVML_GPU_INSTANCE_PROFILE_*`), the argument of
    /// `nvmlDeviceGetGpuInstanceProfileInfo`.
    pub index: u32,
    /// NVML profile *id* (what `nvidia-smi mig -lgip` shows), used by placement and
    /// create calls. Differs from the index and per product.
    pub id: u32,
    /// Memory slices per instance (the placement size).
    pub memory_slices: u8,
    /// Compute (SM) slices per instance.
    pub compute_slices: u8,
    /// Streaming multiprocessors per instance.
    pub multiprocessors: u32,
    /// Device memory per instance, in MiB.
    pub memory_mib: u64,
    /// Engines per instance.
    pub engines: Engines,
    /// Maximum instances of this profile on one GPU.
    pub max_instances: u8,
    /// Every allowed placement.
    pub placements: Vec<Placement>,
    /// Whether the profile carries the media extensions (`+me`): at most one
    /// such instance exists per GPU.
    pub media_extensions: bool,
    /// True when a value of this profile comes from inference rather than a
    /// primary source (tables only; NVML-read profiles are always false).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inferred: bool,
}

impl MigProfile {
    /// Device memory in bytes.
    #[must_use]
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * 1024 * 1024
    }
}

/// Everything carve needs to know about one GPU's product and MIG geometry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuSpec {
    /// Product name as NVML reports it, e.g. `NVIDIA H100 80GB HBM3`.
    pub product_name: String,
    /// Architecture.
    pub architecture: Architecture,
    /// CUDA compute capability (major, minor).
    pub cuda_compute_capability: (u32, u32),
    /// Total device memory, in MiB.
    pub memory_mib: u64,
    /// Total streaming multiprocessors.
    pub multiprocessors: u32,
    /// Memory slices (8, or 4 on A30); 0 when not MIG-capable.
    pub memory_slices: u8,
    /// Compute slices (7, or 4 on A30); 0 when not MIG-capable.
    pub compute_slices: u8,
    /// Engines of the whole GPU.
    pub engines: Engines,
    /// Whether the GPU supports MIG.
    pub mig_capable: bool,
    /// GPU-instance profiles, in NVML profile-index order.
    pub profiles: Vec<MigProfile>,
}

/// An inconsistency in a GPU's profile data.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// A profile value breaks a geometry rule.
    #[error("GPU {gpu}: profile {profile}: {rule}")]
    Profile {
        /// Product name of the GPU.
        gpu: String,
        /// Profile name.
        profile: String,
        /// The rule that is broken.
        rule: String,
    },
    /// A GPU-level value breaks a rule.
    #[error("GPU {gpu}: {rule}")]
    Gpu {
        /// Product name of the GPU.
        gpu: String,
        /// The rule that is broken.
        rule: String,
    },
}

impl GpuSpec {
    /// Total device memory in bytes.
    #[must_use]
    pub fn memory_bytes(&self) -> u64 {
        self.memory_mib * 1024 * 1024
    }

    /// The profile with this name.
    #[must_use]
    pub fn profile(&self, name: &str) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.name == name)
    }

    /// The profile with this NVML profile id.
    #[must_use]
    pub fn profile_by_id(&self, id: u32) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    /// Check the invariants every consumer relies on. NVML data that fails this
    /// is not used to publish MIG devices.
    ///
    /// # Errors
    /// The first broken rule, naming the GPU and profile.
    pub fn validate(&self) -> Result<(), SpecError> {
        let gpu = || self.product_name.clone();
        if !self.mig_capable {
            if !self.profiles.is_empty() {
                return Err(SpecError::Gpu {
                    gpu: gpu(),
                    rule: "not MIG-capable but lists MIG profiles".into(),
                });
            }
            return Ok(());
        }
        if self.memory_slices == 0 || self.memory_slices > 8 {
            return Err(SpecError::Gpu {
                gpu: gpu(),
                rule: format!("memory slices {} not in 1..=8", self.memory_slices),
            });
        }
        if self.compute_slices == 0 || self.compute_slices > self.memory_slices {
            return Err(SpecError::Gpu {
                gpu: gpu(),
                rule: format!(
                    "compute slices {} not in 1..={}",
                    self.compute_slices, self.memory_slices
                ),
            });
        }
        if self.profiles.is_empty() {
            return Err(SpecError::Gpu {
                gpu: gpu(),
                rule: "MIG-capable but no profiles".into(),
            });
        }
        let mut names = std::collections::BTreeSet::new();
        let mut ids = std::collections::BTreeSet::new();
        for p in &self.profiles {
            let err = |rule: String| SpecError::Profile {
                gpu: gpu(),
                profile: p.name.clone(),
                rule,
            };
            if crate::names::ProfileToken::from_profile_name(&p.name).is_none() {
                return Err(err(
                    "name is not of the form <n>g.<m>gb[+me|+me.all|-me|+gfx]".into(),
                ));
            }
            if !names.insert(p.name.clone()) {
                return Err(err("duplicate profile name".into()));
            }
            if !ids.insert(p.id) {
                return Err(err(format!("duplicate profile id {}", p.id)));
            }
            if p.memory_slices == 0 || p.memory_slices > self.memory_slices {
                return Err(err(format!(
                    "memory slices {} not in 1..={}",
                    p.memory_slices, self.memory_slices
                )));
            }
            if p.compute_slices == 0 || p.compute_slices > self.compute_slices {
                return Err(err(format!(
                    "compute slices {} not in 1..={}",
                    p.compute_slices, self.compute_slices
                )));
            }
            if p.multiprocessors == 0 || p.multiprocessors > self.multiprocessors {
                return Err(err(format!(
                    "multiprocessors {} not in 1..={}",
                    p.multiprocessors, self.multiprocessors
                )));
            }
            if p.memory_mib == 0 || p.memory_mib > self.memory_mib {
                return Err(err(format!(
                    "memory {} MiB not in 1..={}",
                    p.memory_mib, self.memory_mib
                )));
            }
            if p.max_instances == 0 {
                return Err(err("max instances is 0".into()));
            }
            if p.placements.is_empty() {
                return Err(err("no placements".into()));
            }
            let mut seen = std::collections::BTreeSet::new();
            for pl in &p.placements {
                if pl.size != p.memory_slices {
                    return Err(err(format!(
                        "placement {pl} size differs from memory slices {}",
                        p.memory_slices
                    )));
                }
                if pl.end() > self.memory_slices {
                    return Err(err(format!(
                        "placement {pl} runs past memory slice {}",
                        self.memory_slices - 1
                    )));
                }
                if !seen.insert(pl.start) {
                    return Err(err(format!("duplicate placement start {}", pl.start)));
                }
            }
        }
        Ok(())
    }
}

/// One physical GPU of a node, as the slice builder needs it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PhysicalGpu {
    /// NVML index on the node.
    pub index: u32,
    /// Device minor (`/dev/nvidia<minor>`).
    pub minor: u32,
    /// GPU UUID (`GPU-...`).
    pub uuid: String,
    /// PCI bus id, e.g. `0000:3b:00.0`, where known.
    pub pci_bus_id: Option<String>,
    /// PCIe root complex, e.g. `pci0000:3a`, where known.
    pub pcie_root: Option<String>,
    /// Driver version as a semver string, e.g. `580.65.6`.
    pub driver_version: String,
    /// Product and geometry.
    pub spec: GpuSpec,
}
