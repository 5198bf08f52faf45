//! The NVML implementation of [`carve_gpu::GpuBackend`]: [`NvmlBackend`] loads
//! `libnvidia-ml.so` (or any library with its ABI, such as the simulator
//! `carve-nvml-sim`) and reads GPUs, MIG profiles and placements, and creates
//! and destroys GPU and compute instances. Also [`probe`], a JSON-serialisable
//! dump of everything a backend reads.
//!
//! It uses nvml-wrapper for what that covers and raw `NvmlLib` calls for the MIG
//! instance API. Every symbol is looked up without panicking: a library that
//! lacks one yields [`BackendError::MissingSymbol`] at [`NvmlBackend::open`].
//! It also implements [`carve_gpu::GpuEvents`] over the NVML event API (XID,
//! single- and double-bit ECC); the event symbols are optional: a library
//! without them reports every GPU unmonitored.
//! It is not a GPU manager: no telemetry, no MPS daemon control (only the
//! compute mode MPS wants).
#![deny(clippy::undocumented_unsafe_blocks)]

use std::ffi::{c_char, c_uint};
use std::path::{Path, PathBuf};

use carve_gpu::{
    BackendError, ComputeInstanceInfo, ComputeMode, ComputeTarget, GpuBackend, GpuInfo,
    GpuInstanceInfo, MigMode,
};
use carve_model::{Architecture, Engines, MigProfile, Placement};
use nvml_wrapper::Nvml;
use nvml_wrapper::enums::device::DeviceArchitecture;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings as nv;
use serde::{Deserialize, Serialize};

/// How to open NVML.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmlOptions {
    /// Library to load; `None` loads `libnvidia-ml.so` through the normal
    /// library search path.
    pub lib_path: Option<PathBuf>,
    /// Root of the MIG capability files, `/proc/driver/nvidia` on a node.
    pub proc_root: PathBuf,
}

impl Default for NvmlOptions {
    fn default() -> Self {
        Self {
            lib_path: None,
            proc_root: PathBuf::from("/proc/driver/nvidia"),
        }
    }
}

/// [`GpuBackend`] over an initialised NVML library. Dropping it shuts NVML down.
pub struct NvmlBackend {
    nvml: Nvml,
    proc_root: PathBuf,
    lib: String,
    /// The event watch of [`carve_gpu::GpuEvents`], started by its first wait.
    events: std::sync::Mutex<events::EventWatch>,
}

impl Drop for NvmlBackend {
    fn drop(&mut self) {
        // Free the event set before `Nvml`'s Drop shuts NVML down.
        let w = self
            .events
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(set) = w.take_set() {
            self.free_event_set(set);
        }
    }
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend")
            .field("lib", &self.lib)
            .field("proc_root", &self.proc_root)
            .finish_non_exhaustive()
    }
}

/// Look a symbol up in the loaded library without panicking.
macro_rules! sym {
    ($lib:expr, $name:ident) => {
        $lib.$name
            .as_ref()
            .map_err(|_| BackendError::MissingSymbol {
                symbol: stringify!($name).to_string(),
            })?
    };
}

mod events;

/// Version word of a `_v2` NVML struct (`NVML_STRUCT_VERSION(T, 2)`).
const fn v2<T>() -> c_uint {
    (std::mem::size_of::<T>() as c_uint) | (2 << 24)
}

/// Map an NVML return code to the typed error.
fn code_err(call: &'static str, code: nv::nvmlReturn_t, what: String) -> BackendError {
    match code {
        nv::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES => {
            BackendError::InsufficientResources { call, what }
        }
        nv::nvmlReturn_enum_NVML_ERROR_IN_USE => BackendError::InUse { call, what },
        nv::nvmlReturn_enum_NVML_ERROR_NOT_FOUND => BackendError::NotFound { call, what },
        nv::nvmlReturn_enum_NVML_ERROR_NO_PERMISSION => BackendError::NoPermission { call, what },
        nv::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => BackendError::NotSupported { call, what },
        code => BackendError::Nvml { call, code, what },
    }
}

fn check(
    call: &'static str,
    code: nv::nvmlReturn_t,
    what: impl FnOnce() -> String,
) -> Result<(), BackendError> {
    if code == nv::nvmlReturn_enum_NVML_SUCCESS {
        Ok(())
    } else {
        Err(code_err(call, code, what()))
    }
}

/// Map an nvml-wrapper error back to its NVML code, then to the typed error.
fn wrapper_err(call: &'static str, e: NvmlError, what: String) -> BackendError {
    #[allow(deprecated)]
    let code = match e {
        NvmlError::FailedToLoadSymbol(_) => {
            return BackendError::MissingSymbol {
                symbol: call.to_string(),
            };
        }
        NvmlError::Uninitialized => 1,
        NvmlError::InvalidArg => 2,
        NvmlError::NotSupported => 3,
        NvmlError::NoPermission => 4,
        NvmlError::AlreadyInitialized => 5,
        NvmlError::NotFound => 6,
        NvmlError::InsufficientSize(_) => 7,
        NvmlError::InsufficientPower => 8,
        NvmlError::DriverNotLoaded => 9,
        NvmlError::Timeout => 10,
        NvmlError::IrqIssue => 11,
        NvmlError::LibraryNotFound => 12,
        NvmlError::FunctionNotFound => 13,
        NvmlError::CorruptedInfoROM => 14,
        NvmlError::GpuLost => 15,
        NvmlError::ResetRequired => 16,
        NvmlError::OperatingSystem => 17,
        NvmlError::LibRmVersionMismatch => 18,
        NvmlError::InUse => 19,
        NvmlError::InsufficientMemory => 20,
        NvmlError::NoData => 21,
        NvmlError::UnexpectedVariant(c) => c,
        NvmlError::Unknown => 999,
        other => {
            return BackendError::Nvml {
                call,
                code: 999,
                what: format!("{what}: {other}"),
            };
        }
    };
    code_err(call, code, what)
}

fn c_name(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `0000:3b:00.0` from NVML's `00000000:3B:00.0`.
fn normalise_bus_id(raw: &str) -> String {
    let lower = raw.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((dom, rest)) if dom.len() > 4 => format!("{}:{rest}", &dom[dom.len() - 4..]),
        _ => lower,
    }
}

/// A GPU-instance profile exactly as NVML reports it (index and v2 info).
#[derive(Clone, Debug)]
struct RawProfile {
    index: u32,
    info: nv::nvmlGpuInstanceProfileInfo_v2_t,
}

impl NvmlBackend {
    /// Load and initialise NVML, and check that every symbol carve calls exists.
    ///
    /// # Errors
    /// [`BackendError::Unavailable`] when the library cannot be loaded or
    /// initialised, [`BackendError::MissingSymbol`] when it lacks a symbol.
    pub fn open(opts: NvmlOptions) -> Result<Self, BackendError> {
        let lib = opts.lib_path.as_ref().map_or_else(
            || "libnvidia-ml.so".to_string(),
            |p| p.display().to_string(),
        );
        let mut builder = Nvml::builder();
        if let Some(p) = &opts.lib_path {
            builder.lib_path(p.as_os_str());
        }
        let nvml = builder.init().map_err(|e| match e {
            NvmlError::FailedToLoadSymbol(_) => BackendError::MissingSymbol {
                symbol: "nvmlInit_v2".into(),
            },
            // The loader's message (dlerror) names the file when it could
            // not open it; name it once.
            e => BackendError::Unavailable {
                reason: match e.to_string() {
                    m if m.contains(&lib) => m,
                    m => format!("{lib}: {m}"),
                },
            },
        })?;
        if nvml.lib().nvmlShutdown.as_ref().is_err() {
            // `Nvml`'s Drop would call the missing symbol and panic: leak it.
            std::mem::forget(nvml);
            return Err(BackendError::MissingSymbol {
                symbol: "nvmlShutdown".into(),
            });
        }
        let b = Self {
            nvml,
            proc_root: opts.proc_root,
            lib,
            events: std::sync::Mutex::new(events::EventWatch::default()),
        };
        b.check_symbols()?;
        tracing::debug!(lib = %b.lib, "NVML initialised");
        Ok(b)
    }

    /// Check the symbols every GPU needs (enumeration and identity). The MIG and
    /// compute-mode symbols are looked up when used, so an NVML without them
    /// still serves whole GPUs: [`GpuBackend::profiles`] then fails with
    /// [`BackendError::MissingSymbol`] for each GPU, and the caller publishes no
    /// MIG devices for it.
    fn check_symbols(&self) -> Result<(), BackendError> {
        let l = self.nvml.lib();
        let _ = sym!(l, nvmlSystemGetDriverVersion);
        let _ = sym!(l, nvmlDeviceGetCount_v2);
        let _ = sym!(l, nvmlDeviceGetHandleByIndex_v2);
        let _ = sym!(l, nvmlDeviceGetUUID);
        let _ = sym!(l, nvmlDeviceGetName);
        let _ = sym!(l, nvmlDeviceGetPciInfo_v3);
        let _ = sym!(l, nvmlDeviceGetMemoryInfo_v2);
        let _ = sym!(l, nvmlDeviceGetMinorNumber);
        let _ = sym!(l, nvmlDeviceGetArchitecture);
        let _ = sym!(l, nvmlDeviceGetCudaComputeCapability);
        Ok(())
    }

    /// The MIG symbols, checked by [`GpuBackend::profiles`] before it reports
    /// any profile: a GPU is published with MIG devices only if every call its
    /// lifecycle needs exists.
    fn check_mig_symbols(&self) -> Result<(), BackendError> {
        let l = self.nvml.lib();
        let _ = sym!(l, nvmlDeviceGetMigMode);
        let _ = sym!(l, nvmlDeviceSetMigMode);
        let _ = sym!(l, nvmlDeviceGetGpuInstanceProfileInfoV);
        let _ = sym!(l, nvmlDeviceGetGpuInstancePossiblePlacements_v2);
        let _ = sym!(l, nvmlDeviceCreateGpuInstanceWithPlacement);
        let _ = sym!(l, nvmlGpuInstanceDestroy);
        let _ = sym!(l, nvmlDeviceGetGpuInstances);
        let _ = sym!(l, nvmlDeviceGetGpuInstanceById);
        let _ = sym!(l, nvmlGpuInstanceGetInfo);
        let _ = sym!(l, nvmlGpuInstanceGetComputeInstanceProfileInfoV);
        let _ = sym!(l, nvmlGpuInstanceCreateComputeInstance);
        let _ = sym!(l, nvmlComputeInstanceDestroy);
        let _ = sym!(l, nvmlGpuInstanceGetComputeInstances);
        let _ = sym!(l, nvmlGpuInstanceGetComputeInstanceById);
        let _ = sym!(l, nvmlComputeInstanceGetInfo_v2);
        let _ = sym!(l, nvmlDeviceGetComputeMode);
        let _ = sym!(l, nvmlDeviceSetComputeMode);
        Ok(())
    }

    /// The raw handle of GPU `gpu`.
    fn dev(&self, gpu: u32) -> Result<nv::nvmlDevice_t, BackendError> {
        let d = self.nvml.device_by_index(gpu).map_err(|e| match e {
            NvmlError::InvalidArg | NvmlError::NotFound => BackendError::NoSuch {
                what: format!("GPU {gpu}"),
            },
            e => wrapper_err("nvmlDeviceGetHandleByIndex_v2", e, format!("GPU {gpu}")),
        })?;
        // SAFETY: the handle is only passed back to NVML functions of the same
        // `Nvml` instance, which `self` keeps initialised for as long as the
        // handle is used (no call outlives `&self`).
        Ok(unsafe { d.handle() })
    }

    /// GPU-instance profiles by index, unsupported indexes skipped.
    fn raw_profiles(
        &self,
        gpu: u32,
        dev: nv::nvmlDevice_t,
    ) -> Result<Vec<RawProfile>, BackendError> {
        let f = sym!(self.nvml.lib(), nvmlDeviceGetGpuInstanceProfileInfoV);
        let mut out = Vec::new();
        for index in 0..nv::NVML_GPU_INSTANCE_PROFILE_COUNT {
            // SAFETY: the struct is plain C data (integers and a char array), for
            // which all-zero bytes are a valid value.
            let mut info: nv::nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            info.version = v2::<nv::nvmlGpuInstanceProfileInfo_v2_t>();
            // SAFETY: `dev` is a live handle of this NVML instance; `info` is a
            // valid, writable v2 struct whose version field says so.
            let rc = unsafe { f(dev, index, &raw mut info) };
            match rc {
                nv::nvmlReturn_enum_NVML_SUCCESS => out.push(RawProfile { index, info }),
                nv::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
                | nv::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => {}
                rc => {
                    return Err(code_err(
                        "nvmlDeviceGetGpuInstanceProfileInfoV",
                        rc,
                        format!("GPU {gpu} profile index {index}"),
                    ));
                }
            }
        }
        Ok(out)
    }

    fn placements(
        &self,
        gpu: u32,
        dev: nv::nvmlDevice_t,
        profile_id: u32,
    ) -> Result<Vec<Placement>, BackendError> {
        let f = sym!(
            self.nvml.lib(),
            nvmlDeviceGetGpuInstancePossiblePlacements_v2
        );
        let what = || format!("GPU {gpu} profile id {profile_id}");
        let mut count: c_uint = 0;
        // SAFETY: `dev` is a live handle; a null buffer asks only for the count,
        // written to the valid `count`.
        let rc = unsafe { f(dev, profile_id, std::ptr::null_mut(), &raw mut count) };
        check("nvmlDeviceGetGpuInstancePossiblePlacements_v2", rc, what)?;
        let mut buf = vec![nv::nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        // SAFETY: `buf` holds `count` placements and `count` says so; NVML
        // writes at most that many and updates `count`.
        let rc = unsafe { f(dev, profile_id, buf.as_mut_ptr(), &raw mut count) };
        check("nvmlDeviceGetGpuInstancePossiblePlacements_v2", rc, what)?;
        buf.truncate(count as usize);
        buf.iter()
            .map(|p| match (u8::try_from(p.start), u8::try_from(p.size)) {
                (Ok(s), Ok(z)) if s < 16 && z <= 16 && s + z <= 16 => Ok(Placement::new(s, z)),
                _ => Err(BackendError::Inconsistent {
                    gpu,
                    reason: format!(
                        "profile id {profile_id}: placement {}:{} out of range",
                        p.start, p.size
                    ),
                }),
            })
            .collect()
    }

    fn mig_profile(
        &self,
        gpu: u32,
        dev: nv::nvmlDevice_t,
        raw: &RawProfile,
    ) -> Result<MigProfile, BackendError> {
        let i = &raw.info;
        let name = c_name(&i.name);
        let name = name.strip_prefix("MIG ").unwrap_or(&name).to_string();
        let placements = self.placements(gpu, dev, i.id)?;
        let bad = |what: &str, v: u32| BackendError::Inconsistent {
            gpu,
            reason: format!("profile {name}: {what} {v} out of range"),
        };
        let memory_slices = placements.first().map_or(0, |p| p.size);
        Ok(MigProfile {
            index: raw.index,
            id: i.id,
            memory_slices,
            compute_slices: u8::try_from(i.sliceCount)
                .map_err(|_| bad("slice count", i.sliceCount))?,
            multiprocessors: i.multiprocessorCount,
            memory_mib: i.memorySizeMB,
            engines: Engines {
                copy: i.copyEngineCount,
                decoders: i.decoderCount,
                encoders: i.encoderCount,
                jpeg: i.jpegCount,
                ofa: i.ofaCount,
            },
            max_instances: u8::try_from(i.instanceCount)
                .map_err(|_| bad("instance count", i.instanceCount))?,
            placements,
            media_extensions: name.ends_with("+me"),
            inferred: false,
            name,
        })
    }

    fn gi_info(
        &self,
        gpu: u32,
        gi: nv::nvmlGpuInstance_t,
    ) -> Result<nv::nvmlGpuInstanceInfo_t, BackendError> {
        let f = sym!(self.nvml.lib(), nvmlGpuInstanceGetInfo);
        // SAFETY: plain C struct (a pointer and integers); all-zero is valid.
        let mut info: nv::nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `gi` is a GPU-instance handle NVML returned during this call
        // of ours; `info` is valid and writable.
        let rc = unsafe { f(gi, &raw mut info) };
        check("nvmlGpuInstanceGetInfo", rc, || format!("GPU {gpu}"))?;
        Ok(info)
    }

    fn gi_by_id(
        &self,
        gpu: u32,
        dev: nv::nvmlDevice_t,
        id: u32,
    ) -> Result<nv::nvmlGpuInstance_t, BackendError> {
        let f = sym!(self.nvml.lib(), nvmlDeviceGetGpuInstanceById);
        let mut gi: nv::nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: `dev` is a live handle; `gi` is a valid out pointer.
        let rc = unsafe { f(dev, id, &raw mut gi) };
        check("nvmlDeviceGetGpuInstanceById", rc, || {
            format!("GPU {gpu} GPU instance {id}")
        })?;
        Ok(gi)
    }

    fn ci_by_id(
        &self,
        gpu: u32,
        gi_id: u32,
        gi: nv::nvmlGpuInstance_t,
        ci: u32,
    ) -> Result<nv::nvmlComputeInstance_t, BackendError> {
        let f = sym!(self.nvml.lib(), nvmlGpuInstanceGetComputeInstanceById);
        let mut c: nv::nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: `gi` is a live GPU-instance handle; `c` is a valid out pointer.
        let rc = unsafe { f(gi, ci, &raw mut c) };
        check("nvmlGpuInstanceGetComputeInstanceById", rc, || {
            format!("GPU {gpu} GPU instance {gi_id} compute instance {ci}")
        })?;
        Ok(c)
    }

    /// The device handle a compute-mode call addresses.
    fn compute_target(&self, t: ComputeTarget) -> Result<(u32, nv::nvmlDevice_t), BackendError> {
        match t {
            ComputeTarget::Gpu(gpu) => Ok((gpu, self.dev(gpu)?)),
            ComputeTarget::Mig { gpu, gi, ci } => {
                let dev = self.dev(gpu)?;
                let g = self.gi_by_id(gpu, dev, gi)?;
                let c = self.ci_by_id(gpu, gi, g, ci)?;
                let f = sym!(self.nvml.lib(), nvmlComputeInstanceGetInfo_v2);
                // SAFETY: plain C struct (pointers and integers); zero is valid.
                let mut info: nv::nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
                // SAFETY: `c` is the compute-instance handle NVML just returned;
                // `info` is valid and writable.
                let rc = unsafe { f(c, &raw mut info) };
                check("nvmlComputeInstanceGetInfo_v2", rc, || {
                    format!("GPU {gpu} GPU instance {gi} compute instance {ci}")
                })?;
                if info.device.is_null() {
                    return Err(BackendError::NotSupported {
                        call: "nvmlComputeInstanceGetInfo_v2",
                        what: format!(
                            "GPU {gpu} GPU instance {gi} compute instance {ci} has no MIG device"
                        ),
                    });
                }
                Ok((gpu, info.device))
            }
        }
    }

    /// Compute-instance profiles of a GPU instance (index order), unsupported
    /// indexes skipped.
    fn ci_profiles(
        &self,
        gpu: u32,
        gi_id: u32,
        gi: nv::nvmlGpuInstance_t,
    ) -> Result<Vec<nv::nvmlComputeInstanceProfileInfo_v2_t>, BackendError> {
        let f = sym!(
            self.nvml.lib(),
            nvmlGpuInstanceGetComputeInstanceProfileInfoV
        );
        let mut out = Vec::new();
        for index in 0..nv::NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            // SAFETY: plain C struct of integers and a char array; zero is valid.
            let mut info: nv::nvmlComputeInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            info.version = v2::<nv::nvmlComputeInstanceProfileInfo_v2_t>();
            // SAFETY: `gi` is a live GPU-instance handle; `info` is a valid,
            // writable v2 struct whose version field says so.
            let rc = unsafe {
                f(
                    gi,
                    index,
                    nv::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                    &raw mut info,
                )
            };
            match rc {
                nv::nvmlReturn_enum_NVML_SUCCESS => out.push(info),
                nv::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
                | nv::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => {}
                rc => {
                    return Err(code_err(
                        "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
                        rc,
                        format!("GPU {gpu} GPU instance {gi_id} CI profile index {index}"),
                    ));
                }
            }
        }
        Ok(out)
    }

    fn uuid_of(&self, dev: nv::nvmlDevice_t) -> Result<Option<String>, BackendError> {
        let f = sym!(self.nvml.lib(), nvmlDeviceGetUUID);
        let mut buf = [0 as c_char; nv::NVML_DEVICE_UUID_V2_BUFFER_SIZE as usize];
        // SAFETY: `dev` is a MIG device handle NVML returned in this call of
        // ours; `buf` is writable for the length passed.
        let rc = unsafe { f(dev, buf.as_mut_ptr(), buf.len() as c_uint) };
        match rc {
            nv::nvmlReturn_enum_NVML_SUCCESS => Ok(Some(c_name(&buf))),
            nv::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => Ok(None),
            rc => Err(code_err("nvmlDeviceGetUUID", rc, "MIG device".into())),
        }
    }

    fn ci_info(
        &self,
        gpu: u32,
        gi_id: u32,
        ci: nv::nvmlComputeInstance_t,
    ) -> Result<ComputeInstanceInfo, BackendError> {
        let f = sym!(self.nvml.lib(), nvmlComputeInstanceGetInfo_v2);
        // SAFETY: plain C struct (pointers and integers); all-zero is valid.
        let mut info: nv::nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `ci` is a compute-instance handle NVML returned in this call
        // of ours; `info` is valid and writable.
        let rc = unsafe { f(ci, &raw mut info) };
        check("nvmlComputeInstanceGetInfo_v2", rc, || {
            format!("GPU {gpu} GPU instance {gi_id}")
        })?;
        let mig_uuid = if info.device.is_null() {
            None
        } else {
            self.uuid_of(info.device)?
        };
        Ok(ComputeInstanceInfo {
            id: info.id,
            profile_id: info.profileId,
            mig_uuid,
        })
    }

    fn compute_instances(
        &self,
        gpu: u32,
        gi_id: u32,
        gi: nv::nvmlGpuInstance_t,
    ) -> Result<Vec<ComputeInstanceInfo>, BackendError> {
        let f = sym!(self.nvml.lib(), nvmlGpuInstanceGetComputeInstances);
        let mut out = Vec::new();
        for p in self.ci_profiles(gpu, gi_id, gi)? {
            let mut buf: Vec<nv::nvmlComputeInstance_t> =
                vec![std::ptr::null_mut(); p.instanceCount.max(1) as usize];
            let mut count: c_uint = 0;
            // SAFETY: `gi` is live; `buf` holds the profile's instanceCount
            // handles, the most NVML returns for it; `count` is a valid out pointer.
            let rc = unsafe { f(gi, p.id, buf.as_mut_ptr(), &raw mut count) };
            check("nvmlGpuInstanceGetComputeInstances", rc, || {
                format!("GPU {gpu} GPU instance {gi_id} CI profile {}", p.id)
            })?;
            for &ci in buf.iter().take(count as usize) {
                out.push(self.ci_info(gpu, gi_id, ci)?);
            }
        }
        out.sort_by_key(|c| c.id);
        Ok(out)
    }

    fn gpu_info(&self, index: u32) -> Result<GpuInfo, BackendError> {
        let d = self
            .nvml
            .device_by_index(index)
            .map_err(|e| wrapper_err("nvmlDeviceGetHandleByIndex_v2", e, format!("GPU {index}")))?;
        let w = |call: &'static str| move |e| wrapper_err(call, e, format!("GPU {index}"));
        // An NVML without the MIG calls: the GPU may well be MIG-capable, but
        // `profiles` reports the missing symbol for it, so it is served whole.
        let mut mig_symbols_missing = false;
        let mig_mode = match d.mig_mode() {
            Ok(m) => Some(MigMode {
                current: m.current == nv::NVML_DEVICE_MIG_ENABLE,
                pending: m.pending == nv::NVML_DEVICE_MIG_ENABLE,
            }),
            Err(NvmlError::NotSupported) => None,
            Err(NvmlError::FailedToLoadSymbol(_)) => {
                mig_symbols_missing = true;
                None
            }
            Err(e) => return Err(w("nvmlDeviceGetMigMode")(e)),
        };
        let cc = d
            .cuda_compute_capability()
            .map_err(w("nvmlDeviceGetCudaComputeCapability"))?;
        let architecture = match d.architecture().map_err(w("nvmlDeviceGetArchitecture"))? {
            DeviceArchitecture::Ampere => Architecture::Ampere,
            DeviceArchitecture::Hopper => Architecture::Hopper,
            DeviceArchitecture::Blackwell => Architecture::Blackwell,
            _ => Architecture::Other,
        };
        let dev = self.dev(index)?;
        let multiprocessors = match self.attributes(dev)? {
            Some(a) => a.multiprocessorCount,
            None => self
                .raw_profiles(index, dev)?
                .iter()
                .map(|p| p.info.multiprocessorCount)
                .max()
                .unwrap_or(0),
        };
        Ok(GpuInfo {
            index,
            minor: d.minor_number().map_err(w("nvmlDeviceGetMinorNumber"))?,
            uuid: d.uuid().map_err(w("nvmlDeviceGetUUID"))?,
            name: d.name().map_err(w("nvmlDeviceGetName"))?,
            architecture,
            cuda_compute_capability: (
                u32::try_from(cc.major).unwrap_or(0),
                u32::try_from(cc.minor).unwrap_or(0),
            ),
            driver_version: self
                .nvml
                .sys_driver_version()
                .map_err(|e| wrapper_err("nvmlSystemGetDriverVersion", e, String::new()))?,
            pci_bus_id: normalise_bus_id(
                &d.pci_info().map_err(w("nvmlDeviceGetPciInfo_v3"))?.bus_id,
            ),
            memory_mib: d
                .memory_info()
                .map_err(w("nvmlDeviceGetMemoryInfo_v2"))?
                .total
                / (1024 * 1024),
            multiprocessors,
            mig_capable: mig_mode.is_some() || mig_symbols_missing,
            mig_mode,
        })
    }

    /// `nvmlDeviceGetAttributes_v2`, or `None` where the library or device does
    /// not provide it (NVML documents it for MIG device handles).
    fn attributes(
        &self,
        dev: nv::nvmlDevice_t,
    ) -> Result<Option<nv::nvmlDeviceAttributes_t>, BackendError> {
        let Ok(f) = self.nvml.lib().nvmlDeviceGetAttributes_v2.as_ref() else {
            return Ok(None);
        };
        // SAFETY: plain C struct of integers; all-zero is valid.
        let mut a: nv::nvmlDeviceAttributes_t = unsafe { std::mem::zeroed() };
        // SAFETY: `dev` is a live handle; `a` is valid and writable.
        let rc = unsafe { f(dev, &raw mut a) };
        match rc {
            nv::nvmlReturn_enum_NVML_SUCCESS => Ok(Some(a)),
            nv::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED
            | nv::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => Ok(None),
            rc => Err(code_err("nvmlDeviceGetAttributes_v2", rc, "GPU".into())),
        }
    }
}

impl GpuBackend for NvmlBackend {
    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError> {
        let n = self
            .nvml
            .device_count()
            .map_err(|e| wrapper_err("nvmlDeviceGetCount_v2", e, String::new()))?;
        (0..n).map(|i| self.gpu_info(i)).collect()
    }

    fn profiles(&self, gpu: u32) -> Result<Vec<MigProfile>, BackendError> {
        let info = self.gpu_info(gpu)?;
        if !info.mig_capable {
            return Ok(Vec::new());
        }
        self.check_mig_symbols()?;
        let dev = self.dev(gpu)?;
        let profiles = self
            .raw_profiles(gpu, dev)?
            .iter()
            .map(|r| self.mig_profile(gpu, dev, r))
            .collect::<Result<Vec<_>, _>>()?;
        let spec = info.spec(profiles);
        spec.validate().map_err(|e| BackendError::Inconsistent {
            gpu,
            reason: e.to_string(),
        })?;
        Ok(spec.profiles)
    }

    fn mig_mode(&self, gpu: u32) -> Result<MigMode, BackendError> {
        let d = self
            .nvml
            .device_by_index(gpu)
            .map_err(|e| wrapper_err("nvmlDeviceGetHandleByIndex_v2", e, format!("GPU {gpu}")))?;
        let m = d
            .mig_mode()
            .map_err(|e| wrapper_err("nvmlDeviceGetMigMode", e, format!("GPU {gpu}")))?;
        Ok(MigMode {
            current: m.current == nv::NVML_DEVICE_MIG_ENABLE,
            pending: m.pending == nv::NVML_DEVICE_MIG_ENABLE,
        })
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<MigMode, BackendError> {
        let d = self
            .nvml
            .device_by_index(gpu)
            .map_err(|e| wrapper_err("nvmlDeviceGetHandleByIndex_v2", e, format!("GPU {gpu}")))?;
        let status = d.set_mig_mode(enabled).map_err(|e| {
            wrapper_err(
                "nvmlDeviceSetMigMode",
                e,
                format!("GPU {gpu} MIG mode {}", if enabled { "on" } else { "off" }),
            )
        })?;
        tracing::info!(gpu, enabled, activation_status = status, "MIG mode set");
        self.mig_mode(gpu)
    }

    fn gpu_instances(&self, gpu: u32) -> Result<Vec<GpuInstanceInfo>, BackendError> {
        match self.mig_mode(gpu) {
            Ok(m) if m.current => {}
            Ok(_) | Err(BackendError::NotSupported { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        }
        let dev = self.dev(gpu)?;
        let f = sym!(self.nvml.lib(), nvmlDeviceGetGpuInstances);
        let mut out = Vec::new();
        for p in self.raw_profiles(gpu, dev)? {
            let mut buf: Vec<nv::nvmlGpuInstance_t> =
                vec![std::ptr::null_mut(); p.info.instanceCount.max(1) as usize];
            let mut count: c_uint = 0;
            // SAFETY: `dev` is live; `buf` holds the profile's instanceCount
            // handles, the most NVML returns for it; `count` is a valid out pointer.
            let rc = unsafe { f(dev, p.info.id, buf.as_mut_ptr(), &raw mut count) };
            check("nvmlDeviceGetGpuInstances", rc, || {
                format!("GPU {gpu} profile id {}", p.info.id)
            })?;
            for &gi in buf.iter().take(count as usize) {
                let info = self.gi_info(gpu, gi)?;
                out.push(GpuInstanceInfo {
                    gpu,
                    id: info.id,
                    profile_id: info.profileId,
                    placement: Placement::new(
                        info.placement.start as u8,
                        info.placement.size as u8,
                    ),
                    compute_instances: self.compute_instances(gpu, info.id, gi)?,
                });
            }
        }
        out.sort_by_key(|g| g.id);
        Ok(out)
    }

    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        placement: Placement,
    ) -> Result<GpuInstanceInfo, BackendError> {
        let dev = self.dev(gpu)?;
        let f = sym!(self.nvml.lib(), nvmlDeviceCreateGpuInstanceWithPlacement);
        let pl = nv::nvmlGpuInstancePlacement_t {
            start: c_uint::from(placement.start),
            size: c_uint::from(placement.size),
        };
        let mut gi: nv::nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: `dev` is live; `pl` is a valid placement read by NVML; `gi` is
        // a valid out pointer.
        let rc = unsafe { f(dev, profile_id, &raw const pl, &raw mut gi) };
        check("nvmlDeviceCreateGpuInstanceWithPlacement", rc, || {
            format!("GPU {gpu} profile id {profile_id} at {placement}")
        })?;
        let info = self.gi_info(gpu, gi)?;
        tracing::info!(gpu, gi = info.id, profile_id, %placement, "GPU instance created");
        Ok(GpuInstanceInfo {
            gpu,
            id: info.id,
            profile_id: info.profileId,
            placement: Placement::new(info.placement.start as u8, info.placement.size as u8),
            compute_instances: Vec::new(),
        })
    }

    fn create_compute_instance(
        &self,
        gpu: u32,
        gi: u32,
    ) -> Result<ComputeInstanceInfo, BackendError> {
        let dev = self.dev(gpu)?;
        let h = self.gi_by_id(gpu, dev, gi)?;
        let info = self.gi_info(gpu, h)?;
        let slices = self
            .raw_profiles(gpu, dev)?
            .iter()
            .find(|p| p.info.id == info.profileId)
            .map(|p| p.info.sliceCount)
            .ok_or_else(|| BackendError::Inconsistent {
                gpu,
                reason: format!(
                    "GPU instance {gi} has unknown profile id {}",
                    info.profileId
                ),
            })?;
        let cp = self
            .ci_profiles(gpu, gi, h)?
            .into_iter()
            .find(|p| p.sliceCount == slices)
            .ok_or_else(|| BackendError::Inconsistent {
                gpu,
                reason: format!(
                    "GPU instance {gi}: no compute-instance profile spans its {slices} slices"
                ),
            })?;
        let f = sym!(self.nvml.lib(), nvmlGpuInstanceCreateComputeInstance);
        let mut ci: nv::nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: `h` is a live GPU-instance handle; `ci` is a valid out pointer.
        let rc = unsafe { f(h, cp.id, &raw mut ci) };
        check("nvmlGpuInstanceCreateComputeInstance", rc, || {
            format!("GPU {gpu} GPU instance {gi} CI profile {}", cp.id)
        })?;
        let c = self.ci_info(gpu, gi, ci)?;
        tracing::info!(gpu, gi, ci = c.id, "compute instance created");
        Ok(c)
    }

    fn destroy_compute_instance(&self, gpu: u32, gi: u32, ci: u32) -> Result<(), BackendError> {
        let dev = self.dev(gpu)?;
        let h = self.gi_by_id(gpu, dev, gi)?;
        let what = || format!("GPU {gpu} GPU instance {gi} compute instance {ci}");
        let c = self.ci_by_id(gpu, gi, h, ci)?;
        let f = sym!(self.nvml.lib(), nvmlComputeInstanceDestroy);
        // SAFETY: `c` is the compute-instance handle NVML just returned.
        let rc = unsafe { f(c) };
        check("nvmlComputeInstanceDestroy", rc, what)?;
        tracing::info!(gpu, gi, ci, "compute instance destroyed");
        Ok(())
    }

    fn destroy_gpu_instance(&self, gpu: u32, gi: u32) -> Result<(), BackendError> {
        let dev = self.dev(gpu)?;
        let h = self.gi_by_id(gpu, dev, gi)?;
        let f = sym!(self.nvml.lib(), nvmlGpuInstanceDestroy);
        // SAFETY: `h` is the GPU-instance handle NVML just returned.
        let rc = unsafe { f(h) };
        check("nvmlGpuInstanceDestroy", rc, || {
            format!("GPU {gpu} GPU instance {gi}")
        })?;
        tracing::info!(gpu, gi, "GPU instance destroyed");
        Ok(())
    }

    fn capability_minor(
        &self,
        gpu_minor: u32,
        gi: u32,
        ci: Option<u32>,
    ) -> Result<u32, BackendError> {
        capability_minor(&self.proc_root, gpu_minor, gi, ci)
    }

    fn compute_mode(&self, target: ComputeTarget) -> Result<ComputeMode, BackendError> {
        let (gpu, dev) = self.compute_target(target)?;
        let f = sym!(self.nvml.lib(), nvmlDeviceGetComputeMode);
        let mut mode: nv::nvmlComputeMode_t = 0;
        // SAFETY: `dev` is a live GPU or MIG device handle; `mode` is a valid out pointer.
        let rc = unsafe { f(dev, &raw mut mode) };
        check("nvmlDeviceGetComputeMode", rc, || format!("{target:?}"))?;
        match mode {
            nv::nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT => Ok(ComputeMode::Default),
            nv::nvmlComputeMode_enum_NVML_COMPUTEMODE_PROHIBITED => Ok(ComputeMode::Prohibited),
            nv::nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_PROCESS => {
                Ok(ComputeMode::ExclusiveProcess)
            }
            m => Err(BackendError::Inconsistent {
                gpu,
                reason: format!("{target:?}: unknown compute mode {m}"),
            }),
        }
    }

    fn set_compute_mode(
        &self,
        target: ComputeTarget,
        mode: ComputeMode,
    ) -> Result<(), BackendError> {
        let (_, dev) = self.compute_target(target)?;
        let f = sym!(self.nvml.lib(), nvmlDeviceSetComputeMode);
        let m = match mode {
            ComputeMode::Default => nv::nvmlComputeMode_enum_NVML_COMPUTEMODE_DEFAULT,
            ComputeMode::Prohibited => nv::nvmlComputeMode_enum_NVML_COMPUTEMODE_PROHIBITED,
            ComputeMode::ExclusiveProcess => {
                nv::nvmlComputeMode_enum_NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
            }
        };
        // SAFETY: `dev` is a live GPU or MIG device handle; `m` is a valid mode.
        let rc = unsafe { f(dev, m) };
        check("nvmlDeviceSetComputeMode", rc, || {
            format!("{target:?} to {mode:?}")
        })?;
        tracing::info!(?target, ?mode, "compute mode set");
        Ok(())
    }
}

/// Read `<root>/capabilities/gpu<minor>/mig/gi<gi>[/ci<ci>]/access` and return
/// its `DeviceFileMinor`.
///
/// # Errors
/// [`BackendError::Io`] naming the file when it is missing, unreadable or has
/// no valid `DeviceFileMinor:` line.
pub fn capability_minor(
    root: &Path,
    gpu_minor: u32,
    gi: u32,
    ci: Option<u32>,
) -> Result<u32, BackendError> {
    let mut path = root
        .join("capabilities")
        .join(format!("gpu{gpu_minor}"))
        .join("mig")
        .join(format!("gi{gi}"));
    if let Some(ci) = ci {
        path.push(format!("ci{ci}"));
    }
    path.push("access");
    let text = std::fs::read_to_string(&path).map_err(|source| BackendError::Io {
        path: path.clone(),
        source,
    })?;
    text.lines()
        .find_map(|l| l.strip_prefix("DeviceFileMinor:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| BackendError::Io {
            path,
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "no valid `DeviceFileMinor: <N>` line",
            ),
        })
}

/// Everything a backend reads about one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeGpu {
    /// Identity and MIG mode.
    pub info: GpuInfo,
    /// MIG profiles with index, id, slices, SMs, memory, engines, max and placements.
    pub profiles: Vec<MigProfile>,
    /// Existing GPU instances with their compute instances.
    pub gpu_instances: Vec<GpuInstanceInfo>,
}

/// Everything a backend reads about the node's GPUs (`carve nvml-probe`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Probe {
    /// GPUs in index order.
    pub gpus: Vec<ProbeGpu>,
}

/// Read everything `backend` exposes.
///
/// # Errors
/// The first backend failure.
pub fn probe(backend: &dyn GpuBackend) -> Result<Probe, BackendError> {
    let gpus = backend
        .gpus()?
        .into_iter()
        .map(|info| {
            Ok(ProbeGpu {
                profiles: backend.profiles(info.index)?,
                gpu_instances: backend.gpu_instances(info.index)?,
                info,
            })
        })
        .collect::<Result<Vec<_>, BackendError>>()?;
    Ok(Probe { gpus })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_id_is_normalised() {
        assert_eq!(normalise_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalise_bus_id("0000:3b:00.0"), "0000:3b:00.0");
    }

    #[test]
    fn codes_map_to_typed_errors() {
        assert!(matches!(
            code_err(
                "x",
                nv::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES,
                String::new()
            ),
            BackendError::InsufficientResources { .. }
        ));
        assert!(matches!(
            code_err("x", nv::nvmlReturn_enum_NVML_ERROR_IN_USE, String::new()),
            BackendError::InUse { .. }
        ));
        assert!(matches!(
            code_err(
                "x",
                nv::nvmlReturn_enum_NVML_ERROR_GPU_IS_LOST,
                String::new()
            ),
            BackendError::Nvml { code: 15, .. }
        ));
        assert!(matches!(
            wrapper_err("x", NvmlError::UnexpectedVariant(23), String::new()),
            BackendError::InsufficientResources { .. }
        ));
    }

    #[test]
    fn capability_file_without_minor_is_an_error_naming_the_file() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("capabilities/gpu0/mig/gi1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("access"), "DeviceFileMode: 292\n").unwrap();
        let e = capability_minor(d.path(), 0, 1, None).unwrap_err();
        assert!(e.to_string().contains("gi1/access"), "{e}");
        std::fs::write(dir.join("access"), "DeviceFileMinor: 42\n").unwrap();
        assert_eq!(capability_minor(d.path(), 0, 1, None).unwrap(), 42);
    }
}
