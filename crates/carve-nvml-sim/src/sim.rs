//! The simulated driver: hardware semantics over `carve_model` tables, with no
//! FFI in it. Every operation returns the NVML return code it would fail with.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};

use carve_model::{Architecture, GpuModel, GpuSpec, Instance, MigProfile, Occupancy, Placement};
use nvml_wrapper_sys::bindings as nv;
use sha2::{Digest, Sha256};

use crate::config::{FaultAction, SimConfig};
use crate::events::{SUPPORTED_EVENT_TYPES, SimEvent, events_end, read_events};
use crate::state::{CiState, GiState, SimState};

/// An NVML return code.
pub(crate) type Ret = nv::nvmlReturn_t;

pub(crate) const SUCCESS: Ret = nv::nvmlReturn_enum_NVML_SUCCESS;
pub(crate) const E_UNINITIALIZED: Ret = nv::nvmlReturn_enum_NVML_ERROR_UNINITIALIZED;
pub(crate) const E_INVALID_ARGUMENT: Ret = nv::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT;
pub(crate) const E_NOT_SUPPORTED: Ret = nv::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED;
pub(crate) const E_NOT_FOUND: Ret = nv::nvmlReturn_enum_NVML_ERROR_NOT_FOUND;
pub(crate) const E_INSUFFICIENT_SIZE: Ret = nv::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE;
pub(crate) const E_DRIVER_NOT_LOADED: Ret = nv::nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED;
pub(crate) const E_RESET_REQUIRED: Ret = nv::nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED;
pub(crate) const E_IN_USE: Ret = nv::nvmlReturn_enum_NVML_ERROR_IN_USE;
pub(crate) const E_INSUFFICIENT_RESOURCES: Ret =
    nv::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES;
pub(crate) const E_VERSION_MISMATCH: Ret = nv::nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
pub(crate) const E_UNKNOWN: Ret = nv::nvmlReturn_enum_NVML_ERROR_UNKNOWN;
pub(crate) const E_TIMEOUT: Ret = nv::nvmlReturn_enum_NVML_ERROR_TIMEOUT;

/// What an opaque handle value names. Handles are tagged integers that are never
/// dereferenced; instance handles carry a serial that is never reused, so a
/// handle to a destroyed instance stays invalid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Handle {
    /// Physical GPU by index.
    Gpu(u32),
    /// MIG device (one per compute instance) by CI serial.
    Mig(u64),
    /// GPU instance by serial.
    Gi(u64),
    /// Compute instance by serial.
    Ci(u64),
    /// Event set by id.
    EventSet(u64),
}

const TAG_SHIFT: u32 = 40;
const TAG_GPU: usize = 1;
const TAG_MIG: usize = 2;
const TAG_GI: usize = 3;
const TAG_CI: usize = 4;
const TAG_EVENT_SET: usize = 5;

impl Handle {
    pub(crate) fn encode(self) -> usize {
        let (tag, v) = match self {
            Self::Gpu(i) => (TAG_GPU, u64::from(i)),
            Self::Mig(s) => (TAG_MIG, s),
            Self::Gi(s) => (TAG_GI, s),
            Self::Ci(s) => (TAG_CI, s),
            Self::EventSet(s) => (TAG_EVENT_SET, s),
        };
        (tag << TAG_SHIFT) | (v as usize & ((1usize << TAG_SHIFT) - 1))
    }

    pub(crate) fn decode(v: usize) -> Option<Self> {
        let payload = (v & ((1usize << TAG_SHIFT) - 1)) as u64;
        match v >> TAG_SHIFT {
            TAG_GPU => u32::try_from(payload).ok().map(Self::Gpu),
            TAG_MIG => Some(Self::Mig(payload)),
            TAG_GI => Some(Self::Gi(payload)),
            TAG_CI => Some(Self::Ci(payload)),
            TAG_EVENT_SET => Some(Self::EventSet(payload)),
            _ => None,
        }
    }
}

/// Static facts of one simulated GPU.
#[derive(Clone, Debug)]
pub(crate) struct SimGpu {
    pub(crate) spec: GpuSpec,
    pub(crate) uuid: String,
    pub(crate) minor: u32,
    pub(crate) bus: u32,
}

/// Values of `nvmlGpuInstanceProfileInfo_v2_t`.
#[derive(Clone, Debug)]
pub(crate) struct GiProfileView {
    pub(crate) id: u32,
    pub(crate) slice_count: u32,
    pub(crate) instance_count: u32,
    pub(crate) multiprocessors: u32,
    pub(crate) copy: u32,
    pub(crate) decoders: u32,
    pub(crate) encoders: u32,
    pub(crate) jpeg: u32,
    pub(crate) ofa: u32,
    pub(crate) memory_mib: u64,
    pub(crate) name: String,
}

/// Values of `nvmlComputeInstanceProfileInfo_v2_t`.
#[derive(Clone, Debug)]
pub(crate) struct CiProfileView {
    pub(crate) id: u32,
    pub(crate) slice_count: u32,
    pub(crate) instance_count: u32,
    pub(crate) multiprocessors: u32,
    pub(crate) gi: GiProfileView,
    pub(crate) name: String,
}

/// Values of `nvmlComputeInstanceInfo_t`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CiView {
    pub(crate) gpu: u32,
    pub(crate) gi_serial: u64,
    pub(crate) id: u32,
    pub(crate) profile_id: u32,
    pub(crate) start: u32,
    pub(crate) slices: u32,
}

/// Compute slices of each compute-instance profile index
/// (`NVML_COMPUTE_INSTANCE_PROFILE_{1,2,3,4,7,8,6}_SLICE`, `_1_SLICE_REV1`);
/// the simulator supports the first five.
const CI_SLICES: [u32; 5] = [1, 2, 3, 4, 7];

/// The process-wide simulator, alive between `nvmlInit` and the last `nvmlShutdown`.
#[derive(Debug)]
pub(crate) struct Sim {
    pub(crate) cfg: SimConfig,
    pub(crate) gpus: Vec<SimGpu>,
    pub(crate) state: SimState,
    calls: HashMap<String, u32>,
    pub(crate) refcount: u32,
    event_sets: HashMap<u64, EventSetState>,
    next_event_set: u64,
}

/// One event set: registered GPUs with their event-type masks, and how far it
/// has read the injected-events file.
#[derive(Debug)]
struct EventSetState {
    registered: HashMap<u32, u64>,
    cursor: u64,
    pending: VecDeque<SimEvent>,
}

fn hex_uuid(prefix: &str, parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    let d = h.finalize();
    let x: String = d[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{prefix}-{}-{}-{}-{}-{}",
        &x[0..8],
        &x[8..12],
        &x[12..16],
        &x[16..20],
        &x[20..32]
    )
}

impl Sim {
    /// Build from the configuration at `cfg_path`, loading persisted state.
    pub(crate) fn load(cfg_path: &Path) -> Result<Self, String> {
        let mut cfg = SimConfig::from_file(cfg_path).map_err(|e| e.to_string())?;
        if let Some(v) = std::env::var_os(crate::config::FAULTS_ENV) {
            let extra: Vec<crate::config::Fault> = serde_json::from_str(&v.to_string_lossy())
                .map_err(|e| {
                    format!(
                        "{}: not a JSON array of faults: {e}",
                        crate::config::FAULTS_ENV
                    )
                })?;
            cfg.faults.extend(extra);
        }
        let state = SimState::for_config(&cfg, cfg_path).map_err(|e| e.to_string())?;
        let keys = cfg.model_keys(cfg_path).map_err(|e| e.to_string())?;
        let gpus = keys
            .iter()
            .enumerate()
            .map(|(i, key)| {
                let model = GpuModel::find(key).ok_or_else(|| format!("unknown model {key}"))?;
                let idx = i.to_string();
                Ok(SimGpu {
                    spec: model.spec(),
                    uuid: hex_uuid("GPU", &[&cfg.node_name, &idx]),
                    minor: i as u32,
                    bus: 0x18 + 0x10 * i as u32,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Self {
            cfg,
            gpus,
            state,
            calls: HashMap::new(),
            refcount: 1,
            event_sets: HashMap::new(),
            next_event_set: 1,
        })
    }

    /// Count a call of `name` and return the fault configured for this call.
    pub(crate) fn fault(&mut self, name: &str) -> Option<FaultAction> {
        let n = self.calls.entry(name.to_string()).or_insert(0);
        *n += 1;
        let n = *n;
        self.cfg
            .faults
            .iter()
            .find(|f| f.function == name && f.nth == n)
            .map(|f| f.action)
    }

    pub(crate) fn gpu(&self, h: Handle) -> Result<(u32, &SimGpu), Ret> {
        match h {
            Handle::Gpu(i) => self
                .gpus
                .get(i as usize)
                .map(|g| (i, g))
                .ok_or(E_INVALID_ARGUMENT),
            _ => Err(E_INVALID_ARGUMENT),
        }
    }

    fn mig_gpu(&self, h: Handle) -> Result<(u32, &SimGpu), Ret> {
        let (i, g) = self.gpu(h)?;
        if !g.spec.mig_capable {
            return Err(E_NOT_SUPPORTED);
        }
        Ok((i, g))
    }

    /// A MIG-capable GPU with MIG mode currently enabled.
    fn mig_enabled_gpu(&self, h: Handle) -> Result<(u32, &SimGpu), Ret> {
        let (i, g) = self.mig_gpu(h)?;
        if !self.state.gpus[i as usize].mig_current {
            return Err(E_NOT_SUPPORTED);
        }
        Ok((i, g))
    }

    /// GPU-instance profile by NVML profile index, as the hardware reports it.
    pub(crate) fn gi_profile(&self, dev: Handle, index: u32) -> Result<GiProfileView, Ret> {
        let (gi, g) = self.mig_gpu(dev)?;
        let p = g.spec.profiles.iter().find(|p| p.index == index).ok_or(
            if index < nv::NVML_GPU_INSTANCE_PROFILE_COUNT {
                E_NOT_SUPPORTED
            } else {
                E_INVALID_ARGUMENT
            },
        )?;
        let corrupt = self
            .cfg
            .corrupt_profile
            .as_ref()
            .is_some_and(|c| c.gpu == gi && c.profile == p.name);
        Ok(view(p, corrupt))
    }

    fn profile_by_id(&self, gpu: u32, id: u32) -> Result<(usize, &MigProfile), Ret> {
        self.gpus[gpu as usize]
            .spec
            .profiles
            .iter()
            .enumerate()
            .find(|(_, p)| p.id == id)
            .ok_or(E_INVALID_ARGUMENT)
    }

    /// Every placement of a profile, whatever is occupied (as real NVML).
    pub(crate) fn placements(&self, dev: Handle, profile_id: u32) -> Result<Vec<Placement>, Ret> {
        let (i, _) = self.mig_gpu(dev)?;
        Ok(self.profile_by_id(i, profile_id)?.1.placements.clone())
    }

    fn occupancy(&self, gpu: u32) -> Occupancy<'_> {
        let spec = &self.gpus[gpu as usize].spec;
        let mut o = Occupancy::new(spec);
        for gi in &self.state.gpus[gpu as usize].gpu_instances {
            if let Some(pi) = spec.profiles.iter().position(|p| p.id == gi.profile_id) {
                // Persisted instances were checked on creation.
                let _ = o.place(Instance {
                    profile: pi,
                    start: gi.start,
                });
            }
        }
        o
    }

    /// How many more instances of the profile fit now.
    pub(crate) fn remaining_capacity(&self, dev: Handle, profile_id: u32) -> Result<u32, Ret> {
        let (i, _) = self.mig_enabled_gpu(dev)?;
        let (pi, p) = self.profile_by_id(i, profile_id)?;
        let mut o = self.occupancy(i);
        let mut n = 0;
        for pl in &p.placements {
            if o.place(Instance {
                profile: pi,
                start: pl.start,
            })
            .is_ok()
            {
                n += 1;
            }
        }
        Ok(n)
    }

    fn gi_dir(&self, gpu: u32, gi: u32) -> PathBuf {
        self.cfg
            .proc_root
            .join("capabilities")
            .join(format!("gpu{}", self.gpus[gpu as usize].minor))
            .join("mig")
            .join(format!("gi{gi}"))
    }

    /// Persist `next` and make it current; nothing changes when that fails.
    fn commit(&mut self, next: SimState) -> Result<(), Ret> {
        next.save(&self.cfg.state_file).map_err(|e| {
            eprintln!("nvml-sim: {e}");
            E_UNKNOWN
        })?;
        self.state = next;
        Ok(())
    }

    pub(crate) fn create_gi(
        &mut self,
        dev: Handle,
        profile_id: u32,
        pl: Placement,
    ) -> Result<u64, Ret> {
        let (gpu, _) = self.mig_enabled_gpu(dev)?;
        let (pi, p) = self.profile_by_id(gpu, profile_id)?;
        if pl.size != p.memory_slices || !p.placements.contains(&pl) {
            return Err(E_INVALID_ARGUMENT);
        }
        self.occupancy(gpu)
            .check(Instance {
                profile: pi,
                start: pl.start,
            })
            .map_err(|_| E_INSUFFICIENT_RESOURCES)?;
        let mut next = self.state.clone();
        let serial = next.next_serial;
        next.next_serial += 1;
        let cap_minor = next.next_cap_minor;
        next.next_cap_minor += 1;
        let gs = &mut next.gpus[gpu as usize];
        let id = (1..)
            .find(|id| gs.gpu_instances.iter().all(|g| g.id != *id))
            .unwrap_or(1);
        gs.gpu_instances.push(GiState {
            serial,
            id,
            profile_id,
            start: pl.start,
            cap_minor,
            compute_instances: Vec::new(),
        });
        let dir = self.gi_dir(gpu, id);
        write_cap(&dir, cap_minor)?;
        if let Err(e) = self.commit(next) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        Ok(serial)
    }

    /// (GPU index, position in its instance list) of a GI serial.
    fn find_gi(&self, serial: u64) -> Result<(u32, usize), Ret> {
        for (gi, g) in self.state.gpus.iter().enumerate() {
            if let Some(pos) = g.gpu_instances.iter().position(|x| x.serial == serial) {
                return Ok((gi as u32, pos));
            }
        }
        Err(E_INVALID_ARGUMENT)
    }

    pub(crate) fn gi(&self, serial: u64) -> Result<(u32, &GiState), Ret> {
        let (g, pos) = self.find_gi(serial)?;
        Ok((g, &self.state.gpus[g as usize].gpu_instances[pos]))
    }

    pub(crate) fn gi_placement(&self, gpu: u32, gi: &GiState) -> Placement {
        let size = self
            .profile_by_id(gpu, gi.profile_id)
            .map_or(0, |(_, p)| p.memory_slices);
        Placement::new(gi.start, size)
    }

    pub(crate) fn gis_of_profile(&self, dev: Handle, profile_id: u32) -> Result<Vec<u64>, Ret> {
        let (gpu, _) = self.mig_enabled_gpu(dev)?;
        self.profile_by_id(gpu, profile_id)?;
        let mut v: Vec<&GiState> = self.state.gpus[gpu as usize]
            .gpu_instances
            .iter()
            .filter(|g| g.profile_id == profile_id)
            .collect();
        v.sort_by_key(|g| g.id);
        Ok(v.iter().map(|g| g.serial).collect())
    }

    pub(crate) fn gi_by_id(&self, dev: Handle, id: u32) -> Result<u64, Ret> {
        let (gpu, _) = self.mig_enabled_gpu(dev)?;
        self.state.gpus[gpu as usize]
            .gpu_instances
            .iter()
            .find(|g| g.id == id)
            .map(|g| g.serial)
            .ok_or(E_NOT_FOUND)
    }

    pub(crate) fn destroy_gi(&mut self, serial: u64) -> Result<(), Ret> {
        let (gpu, pos) = self.find_gi(serial)?;
        let gi = &self.state.gpus[gpu as usize].gpu_instances[pos];
        if !gi.compute_instances.is_empty() {
            return Err(E_IN_USE);
        }
        let dir = self.gi_dir(gpu, gi.id);
        let mut next = self.state.clone();
        next.gpus[gpu as usize].gpu_instances.remove(pos);
        self.commit(next)?;
        let _ = std::fs::remove_dir_all(dir);
        Ok(())
    }

    fn gi_profile_of(&self, serial: u64) -> Result<(u32, GiProfileView), Ret> {
        let (gpu, gi) = self.gi(serial)?;
        let (_, p) = self.profile_by_id(gpu, gi.profile_id)?;
        Ok((gpu, view(p, false)))
    }

    pub(crate) fn ci_profile(&self, gi: u64, index: u32, eng: u32) -> Result<CiProfileView, Ret> {
        if eng != nv::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED {
            return Err(E_NOT_SUPPORTED);
        }
        let (_, gp) = self.gi_profile_of(gi)?;
        let Some(&slices) = CI_SLICES.get(index as usize) else {
            return Err(if index < nv::NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
                E_NOT_SUPPORTED
            } else {
                E_INVALID_ARGUMENT
            });
        };
        if slices > gp.slice_count || (slices == 3 && gp.slice_count == 4) {
            return Err(E_NOT_SUPPORTED);
        }
        let gi_name = gp.name.trim_start_matches("MIG ").to_string();
        let name = if slices == gp.slice_count {
            format!("MIG {gi_name}")
        } else {
            format!("MIG {slices}c.{gi_name}")
        };
        Ok(CiProfileView {
            id: index,
            slice_count: slices,
            instance_count: gp.slice_count / slices,
            multiprocessors: gp.multiprocessors * slices / gp.slice_count,
            gi: gp,
            name,
        })
    }

    fn ci_profile_by_id(&self, gi: u64, id: u32) -> Result<CiProfileView, Ret> {
        // Profile ids equal indexes in the simulator.
        self.ci_profile(gi, id, nv::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            .map_err(|e| {
                if e == E_NOT_SUPPORTED {
                    E_INVALID_ARGUMENT
                } else {
                    e
                }
            })
    }

    pub(crate) fn create_ci(&mut self, gi: u64, profile_id: u32) -> Result<u64, Ret> {
        let cp = self.ci_profile_by_id(gi, profile_id)?;
        let (gpu, pos) = self.find_gi(gi)?;
        let gs = &self.state.gpus[gpu as usize].gpu_instances[pos];
        let used: Vec<(u32, u32)> = gs
            .compute_instances
            .iter()
            .map(|c| (c.start, c.start + c.slices))
            .collect();
        let start = (0..cp.gi.slice_count)
            .step_by(cp.slice_count as usize)
            .find(|&s| {
                s + cp.slice_count <= cp.gi.slice_count
                    && used.iter().all(|&(a, b)| s + cp.slice_count <= a || s >= b)
            })
            .ok_or(E_INSUFFICIENT_RESOURCES)?;
        let gi_id = gs.id;
        let mut next = self.state.clone();
        let serial = next.next_serial;
        next.next_serial += 1;
        let cap_minor = next.next_cap_minor;
        next.next_cap_minor += 1;
        let gs = &mut next.gpus[gpu as usize].gpu_instances[pos];
        let id = (0..)
            .find(|id| gs.compute_instances.iter().all(|c| c.id != *id))
            .unwrap_or(0);
        let idx = gpu.to_string();
        let ser = serial.to_string();
        gs.compute_instances.push(CiState {
            serial,
            id,
            profile_id,
            slices: cp.slice_count,
            start,
            cap_minor,
            uuid: hex_uuid("MIG", &[&self.cfg.node_name, &idx, &ser]),
            compute_mode: 0,
        });
        let dir = self.gi_dir(gpu, gi_id).join(format!("ci{id}"));
        write_cap(&dir, cap_minor)?;
        if let Err(e) = self.commit(next) {
            let _ = std::fs::remove_dir_all(&dir);
            return Err(e);
        }
        Ok(serial)
    }

    fn find_ci(&self, serial: u64) -> Result<(u32, usize, usize), Ret> {
        for (g, gs) in self.state.gpus.iter().enumerate() {
            for (i, gi) in gs.gpu_instances.iter().enumerate() {
                if let Some(c) = gi.compute_instances.iter().position(|c| c.serial == serial) {
                    return Ok((g as u32, i, c));
                }
            }
        }
        Err(E_INVALID_ARGUMENT)
    }

    pub(crate) fn ci(&self, serial: u64) -> Result<(CiView, &CiState), Ret> {
        let (g, i, c) = self.find_ci(serial)?;
        let gi = &self.state.gpus[g as usize].gpu_instances[i];
        let ci = &gi.compute_instances[c];
        Ok((
            CiView {
                gpu: g,
                gi_serial: gi.serial,
                id: ci.id,
                profile_id: ci.profile_id,
                start: ci.start,
                slices: ci.slices,
            },
            ci,
        ))
    }

    pub(crate) fn cis_of_profile(&self, gi: u64, profile_id: u32) -> Result<Vec<u64>, Ret> {
        self.ci_profile_by_id(gi, profile_id)?;
        let (_, g) = self.gi(gi)?;
        let mut v: Vec<&CiState> = g
            .compute_instances
            .iter()
            .filter(|c| c.profile_id == profile_id)
            .collect();
        v.sort_by_key(|c| c.id);
        Ok(v.iter().map(|c| c.serial).collect())
    }

    pub(crate) fn ci_by_id(&self, gi: u64, id: u32) -> Result<u64, Ret> {
        let (_, g) = self.gi(gi)?;
        g.compute_instances
            .iter()
            .find(|c| c.id == id)
            .map(|c| c.serial)
            .ok_or(E_NOT_FOUND)
    }

    pub(crate) fn destroy_ci(&mut self, serial: u64) -> Result<(), Ret> {
        let (g, i, c) = self.find_ci(serial)?;
        let gi = &self.state.gpus[g as usize].gpu_instances[i];
        let dir = self
            .gi_dir(g, gi.id)
            .join(format!("ci{}", gi.compute_instances[c].id));
        let mut next = self.state.clone();
        next.gpus[g as usize].gpu_instances[i]
            .compute_instances
            .remove(c);
        self.commit(next)?;
        let _ = std::fs::remove_dir_all(dir);
        Ok(())
    }

    /// MIG devices of a GPU (one per CI), ordered by GI id then CI id.
    pub(crate) fn mig_devices(&self, dev: Handle) -> Result<Vec<u64>, Ret> {
        let (gpu, _) = self.mig_enabled_gpu(dev)?;
        let mut gis: Vec<&GiState> = self.state.gpus[gpu as usize].gpu_instances.iter().collect();
        gis.sort_by_key(|g| g.id);
        let mut out = Vec::new();
        for gi in gis {
            let mut cis: Vec<&CiState> = gi.compute_instances.iter().collect();
            cis.sort_by_key(|c| c.id);
            out.extend(cis.iter().map(|c| c.serial));
        }
        Ok(out)
    }

    pub(crate) fn mig_mode(&self, dev: Handle) -> Result<(bool, bool), Ret> {
        let (i, _) = self.mig_gpu(dev)?;
        let s = &self.state.gpus[i as usize];
        Ok((s.mig_current, s.mig_pending))
    }

    /// Set MIG mode; returns the activation status.
    pub(crate) fn set_mig_mode(&mut self, dev: Handle, on: bool) -> Result<Ret, Ret> {
        let (i, g) = self.mig_gpu(dev)?;
        let needs_reset = g.spec.architecture.mig_mode_needs_reset();
        let s = &self.state.gpus[i as usize];
        if !s.gpu_instances.is_empty() {
            return Err(E_IN_USE);
        }
        let mut next = self.state.clone();
        let s = &mut next.gpus[i as usize];
        s.mig_pending = on;
        if !needs_reset {
            s.mig_current = on;
        }
        let status = if s.mig_current == on {
            SUCCESS
        } else {
            E_RESET_REQUIRED
        };
        self.commit(next)?;
        Ok(status)
    }

    /// Compute mode of a whole GPU (only without MIG mode) or a MIG device.
    pub(crate) fn compute_mode(&self, h: Handle) -> Result<u32, Ret> {
        match h {
            Handle::Gpu(_) => {
                let (i, _) = self.gpu_for_compute_mode(h)?;
                Ok(self.state.gpus[i as usize].compute_mode)
            }
            Handle::Mig(serial) => Ok(self.ci(serial)?.1.compute_mode),
            _ => Err(E_INVALID_ARGUMENT),
        }
    }

    fn gpu_for_compute_mode(&self, h: Handle) -> Result<(u32, &SimGpu), Ret> {
        let (i, g) = self.gpu(h)?;
        if self.state.gpus[i as usize].mig_current {
            // With MIG enabled NVML wants a MIG device handle.
            return Err(E_NOT_SUPPORTED);
        }
        Ok((i, g))
    }

    /// Set the compute mode (`EXCLUSIVE_THREAD` is no longer supported by NVML).
    pub(crate) fn set_compute_mode(&mut self, h: Handle, mode: u32) -> Result<(), Ret> {
        match mode {
            nv::nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT
            | nv::nvmlComputeMode_enum_NVML_COMPUTEMODE_PROHIBITED
            | nv::nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_PROCESS => {}
            nv::nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_THREAD => {
                return Err(E_NOT_SUPPORTED);
            }
            _ => return Err(E_INVALID_ARGUMENT),
        }
        let mut next = self.state.clone();
        match h {
            Handle::Gpu(_) => {
                let (i, _) = self.gpu_for_compute_mode(h)?;
                next.gpus[i as usize].compute_mode = mode;
            }
            Handle::Mig(serial) => {
                let (g, i, c) = self.find_ci(serial)?;
                next.gpus[g as usize].gpu_instances[i].compute_instances[c].compute_mode = mode;
            }
            _ => return Err(E_INVALID_ARGUMENT),
        }
        self.commit(next)
    }

    /// Static facts of the GPU a handle (physical or MIG) belongs to, plus the
    /// MIG device's CI when it is one.
    pub(crate) fn device(&self, h: Handle) -> Result<(u32, &SimGpu, Option<CiView>), Ret> {
        match h {
            Handle::Gpu(_) => {
                let (i, g) = self.gpu(h)?;
                Ok((i, g, None))
            }
            Handle::Mig(serial) => {
                let (v, _) = self.ci(serial)?;
                Ok((v.gpu, &self.gpus[v.gpu as usize], Some(v)))
            }
            _ => Err(E_INVALID_ARGUMENT),
        }
    }

    /// GPU-instance profile of a MIG device's GI.
    pub(crate) fn mig_profile(&self, v: &CiView) -> Result<GiProfileView, Ret> {
        Ok(self.gi_profile_of(v.gi_serial)?.1)
    }

    /// A new event set; it sees events injected from now on.
    pub(crate) fn create_event_set(&mut self) -> u64 {
        let id = self.next_event_set;
        self.next_event_set += 1;
        self.event_sets.insert(
            id,
            EventSetState {
                registered: HashMap::new(),
                cursor: events_end(&self.cfg.events_file()),
                pending: VecDeque::new(),
            },
        );
        id
    }

    /// Event types a physical GPU supports (none for `eventsUnsupported` GPUs).
    pub(crate) fn supported_event_types(&self, h: Handle) -> Result<u64, Ret> {
        let (i, _) = self.gpu(h)?;
        Ok(if self.cfg.events_unsupported.contains(&i) {
            0
        } else {
            SUPPORTED_EVENT_TYPES
        })
    }

    /// Register a physical GPU for `types` in event set `set`. MIG device
    /// handles are refused, as NVML does not report per instance through them.
    pub(crate) fn register_events(&mut self, h: Handle, types: u64, set: u64) -> Result<(), Ret> {
        if matches!(h, Handle::Mig(_)) {
            return Err(E_NOT_SUPPORTED);
        }
        let supported = self.supported_event_types(h)?;
        let (i, _) = self.gpu(h)?;
        let st = self.event_sets.get_mut(&set).ok_or(E_INVALID_ARGUMENT)?;
        if supported == 0 || types & !supported != 0 {
            return Err(E_NOT_SUPPORTED);
        }
        *st.registered.entry(i).or_insert(0) |= types;
        Ok(())
    }

    /// The next event for `set` of a registered GPU and type, or `E_TIMEOUT`
    /// when none has been injected yet.
    pub(crate) fn next_event(&mut self, set: u64) -> Result<SimEvent, Ret> {
        let path = self.cfg.events_file();
        let st = self.event_sets.get_mut(&set).ok_or(E_INVALID_ARGUMENT)?;
        let (evs, off) = read_events(&path, st.cursor).map_err(|e| {
            eprintln!("nvml-sim: {e}");
            E_UNKNOWN
        })?;
        st.cursor = off;
        st.pending.extend(evs);
        while let Some(ev) = st.pending.pop_front() {
            if st
                .registered
                .get(&ev.gpu)
                .is_some_and(|m| m & ev.event_type != 0)
            {
                return Ok(ev);
            }
        }
        Err(E_TIMEOUT)
    }

    pub(crate) fn free_event_set(&mut self, set: u64) -> Result<(), Ret> {
        self.event_sets
            .remove(&set)
            .map(|_| ())
            .ok_or(E_INVALID_ARGUMENT)
    }

    pub(crate) fn architecture(g: &SimGpu) -> u32 {
        match (g.spec.architecture, g.spec.cuda_compute_capability) {
            (Architecture::Ampere, _) => nv::NVML_DEVICE_ARCH_AMPERE,
            (Architecture::Hopper, _) => nv::NVML_DEVICE_ARCH_HOPPER,
            (Architecture::Blackwell, _) => nv::NVML_DEVICE_ARCH_BLACKWELL,
            (Architecture::Other, (8, 9)) => nv::NVML_DEVICE_ARCH_ADA,
            (Architecture::Other, _) => nv::NVML_DEVICE_ARCH_UNKNOWN,
        }
    }
}

fn view(p: &MigProfile, corrupt: bool) -> GiProfileView {
    GiProfileView {
        id: p.id,
        slice_count: if corrupt {
            0
        } else {
            u32::from(p.compute_slices)
        },
        instance_count: u32::from(p.max_instances),
        multiprocessors: p.multiprocessors,
        copy: p.engines.copy,
        decoders: p.engines.decoders,
        encoders: p.engines.encoders,
        jpeg: p.engines.jpeg,
        ofa: p.engines.ofa,
        memory_mib: p.memory_mib,
        name: format!("MIG {}", p.name),
    }
}

fn write_cap(dir: &Path, minor: u32) -> Result<(), Ret> {
    let r = std::fs::create_dir_all(dir).and_then(|()| {
        std::fs::write(
            dir.join("access"),
            format!("DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"),
        )
    });
    r.map_err(|e| {
        eprintln!("nvml-sim: writing {}: {e}", dir.display());
        let _ = std::fs::remove_dir_all(dir);
        E_UNKNOWN
    })
}
