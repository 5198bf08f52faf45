//! The exported NVML C ABI. Each function takes the process-wide lock, counts the
//! call for fault injection, and delegates to [`crate::sim::Sim`].
//!
//! Pointer contract (the NVML ABI): every pointer argument is either null or
//! valid, aligned and writable/readable for one value of its type (or for the
//! documented element count of a buffer); the simulator checks null and reports
//! `NVML_ERROR_INVALID_ARGUMENT`. Handles are opaque integers, never dereferenced.
//! So every function that takes a pointer other than a handle is an `unsafe
//! extern "C" fn` whose `# Safety` states that contract, and reaches the
//! pointer only through the `unsafe` helpers `put`, `get`, `put_all` and
//! `put_str`; the functions that take only handles and integers are safe.

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use carve_model::Placement;
use nvml_wrapper_sys::bindings as nv;

use crate::config::{CONFIG_ENV, FaultAction, SIDECAR_SUFFIX};
use crate::sim::{
    E_DRIVER_NOT_LOADED, E_INSUFFICIENT_SIZE, E_INVALID_ARGUMENT, E_NOT_SUPPORTED, E_TIMEOUT,
    E_UNINITIALIZED, E_VERSION_MISMATCH, Handle, Ret, SUCCESS, Sim,
};

static SIM: Mutex<Option<Sim>> = Mutex::new(None);

fn lock() -> MutexGuard<'static, Option<Sim>> {
    SIM.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Run `f` on the initialised simulator, applying the fault configured for
/// this call of `name`.
fn api(name: &str, f: impl FnOnce(&mut Sim) -> Result<(), Ret>) -> Ret {
    let mut g = lock();
    let Some(sim) = g.as_mut() else {
        return E_UNINITIALIZED;
    };
    let after = match sim.fault(name) {
        Some(FaultAction::Fail { code }) => return code,
        Some(FaultAction::AbortBefore) => std::process::abort(),
        Some(FaultAction::AbortAfter) => true,
        None => false,
    };
    let r = f(sim);
    if after {
        std::process::abort();
    }
    r.err().unwrap_or(SUCCESS)
}

/// Run `f` on the initialised simulator without counting a call (the later
/// polls of one `nvmlEventSetWait_v2`).
fn api_uncounted(f: impl FnOnce(&mut Sim) -> Result<(), Ret>) -> Ret {
    let mut g = lock();
    let Some(sim) = g.as_mut() else {
        return E_UNINITIALIZED;
    };
    f(sim).err().unwrap_or(SUCCESS)
}

fn handle<T>(p: *mut T) -> Result<Handle, Ret> {
    Handle::decode(p.addr()).ok_or(E_INVALID_ARGUMENT)
}

fn to_ptr<T>(h: Handle) -> *mut T {
    std::ptr::without_provenance_mut(h.encode())
}

/// Write `v` to the caller's `p`.
///
/// # Safety
///
/// `p` is null (refused) or valid and aligned for writing one `T`.
unsafe fn put<T>(p: *mut T, v: T) -> Result<(), Ret> {
    if p.is_null() {
        return Err(E_INVALID_ARGUMENT);
    }
    // SAFETY: `p` is non-null; by the NVML ABI contract the caller passes a
    // pointer valid, aligned and writable for one `T`. `write` does not read or
    // drop the old value, so uninitialised memory is fine.
    unsafe { p.write(v) };
    Ok(())
}

/// Read one `T` from the caller's `p`.
///
/// # Safety
///
/// `p` is null (refused) or valid and aligned for reading one initialised `T`.
unsafe fn get<T: Copy>(p: *const T) -> Result<T, Ret> {
    if p.is_null() {
        return Err(E_INVALID_ARGUMENT);
    }
    // SAFETY: `p` is non-null; by the NVML ABI contract the caller passes a
    // pointer valid, aligned and readable for one initialised `T` (T is Copy, a
    // plain C integer or struct).
    Ok(unsafe { p.read() })
}

/// Write `items` into the caller's buffer `p`, which holds at least `cap` elements.
///
/// # Safety
///
/// `p` is null (refused) or valid and aligned for writing `cap` elements.
unsafe fn put_all<T: Copy>(p: *mut T, cap: usize, items: &[T]) -> Result<(), Ret> {
    if items.is_empty() {
        return Ok(());
    }
    if p.is_null() {
        return Err(E_INVALID_ARGUMENT);
    }
    if items.len() > cap {
        return Err(E_INSUFFICIENT_SIZE);
    }
    // SAFETY: `p` is non-null and, by the NVML ABI contract, valid, aligned and
    // writable for `cap >= items.len()` elements; `items` is a distinct Rust
    // slice, so the regions do not overlap.
    unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), p, items.len()) };
    Ok(())
}

fn fill(dst: &mut [c_char], s: &str) -> Result<(), Ret> {
    if s.len() + 1 > dst.len() {
        return Err(E_INSUFFICIENT_SIZE);
    }
    for (d, b) in dst.iter_mut().zip(s.bytes()) {
        *d = b as c_char;
    }
    dst[s.len()] = 0;
    Ok(())
}

/// Copy `s` with its NUL into the caller's buffer of `len` bytes.
///
/// # Safety
///
/// `buf` is null (refused) or valid for writing `len` bytes.
unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> Result<(), Ret> {
    if buf.is_null() {
        return Err(E_INVALID_ARGUMENT);
    }
    let mut tmp = vec![0 as c_char; s.len() + 1];
    fill(&mut tmp, s)?;
    // SAFETY: `buf` is valid for `len` bytes, by this function's contract.
    unsafe { put_all(buf, len as usize, &tmp) }
}

const fn v2<T>() -> c_uint {
    (std::mem::size_of::<T>() as c_uint) | (2 << 24)
}

/// The library's own path, from `/proc/self/maps`.
fn own_path() -> Option<PathBuf> {
    let addr = (own_path as fn() -> Option<PathBuf>) as usize;
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    for line in maps.lines() {
        let mut f = line.splitn(6, ' ');
        let range = f.next()?;
        let (a, b) = range.split_once('-')?;
        let (a, b) = (
            usize::from_str_radix(a, 16).ok()?,
            usize::from_str_radix(b, 16).ok()?,
        );
        if (a..b).contains(&addr) {
            let path = f.nth(4)?.trim();
            return (!path.is_empty()).then(|| PathBuf::from(path));
        }
    }
    None
}

#[cfg(test)]
static TEST_CONFIG: Mutex<Option<PathBuf>> = Mutex::new(None);

fn config_path() -> Option<PathBuf> {
    #[cfg(test)]
    if let Some(p) = TEST_CONFIG.lock().ok()?.clone() {
        return Some(p);
    }
    if let Some(p) = std::env::var_os(CONFIG_ENV) {
        return Some(PathBuf::from(p));
    }
    let mut p = own_path()?.into_os_string();
    p.push(SIDECAR_SUFFIX);
    let p = PathBuf::from(p);
    p.exists().then_some(p)
}

fn init() -> Ret {
    let mut g = lock();
    if let Some(sim) = g.as_mut() {
        sim.refcount += 1;
        return SUCCESS;
    }
    let Some(path) = config_path() else {
        eprintln!(
            "nvml-sim: no configuration: set {CONFIG_ENV} or put <library>{SIDECAR_SUFFIX} next to the library"
        );
        return E_DRIVER_NOT_LOADED;
    };
    let mut sim = match Sim::load(&path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("nvml-sim: {e}");
            return E_DRIVER_NOT_LOADED;
        }
    };
    match sim.fault("nvmlInit_v2") {
        Some(FaultAction::Fail { code }) => return code,
        Some(FaultAction::AbortBefore | FaultAction::AbortAfter) => std::process::abort(),
        None => {}
    }
    *g = Some(sim);
    SUCCESS
}

/// `nvmlInit_v2`: load the configuration and the persisted state (reference-counted).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nv::nvmlReturn_t {
    init()
}

/// `nvmlInitWithFlags`: as [`nvmlInit_v2`]; flags are ignored.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nv::nvmlReturn_t {
    init()
}

/// `nvmlShutdown`: drop one reference; the last one unloads the state.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nv::nvmlReturn_t {
    let mut g = lock();
    let Some(sim) = g.as_mut() else {
        return E_UNINITIALIZED;
    };
    sim.refcount -= 1;
    if sim.refcount == 0 {
        *g = None;
    }
    SUCCESS
}

/// `nvmlErrorString`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nv::nvmlReturn_t) -> *const c_char {
    let s: &'static CStr = match result {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        9 => c"Driver Not Loaded",
        10 => c"Timeout",
        15 => c"GPU is lost",
        16 => c"GPU requires reset",
        19 => c"In use by another client",
        23 => c"Insufficient resources",
        25 => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    s.as_ptr()
}

/// `nvmlSystemGetDriverVersion`.
///
/// # Safety
///
/// `version`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `version` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlSystemGetDriverVersion", |s| {
            put_str(version, length, &s.cfg.driver_version)
        })
    }
}

/// `nvmlDeviceGetCount_v2`.
///
/// # Safety
///
/// `count`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nv::nvmlReturn_t {
    // SAFETY: `count` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetCount_v2", |s| {
            put(count, s.gpus.len() as c_uint)
        })
    }
}

/// `nvmlDeviceGetHandleByIndex_v2`.
///
/// # Safety
///
/// `device`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nv::nvmlDevice_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `device` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetHandleByIndex_v2", |s| {
            s.gpu(Handle::Gpu(index))?;
            put(device, to_ptr(Handle::Gpu(index)))
        })
    }
}

/// `nvmlDeviceGetUUID`: `GPU-…` for a GPU, `MIG-…` for a MIG device.
///
/// # Safety
///
/// `uuid`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nv::nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `uuid` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetUUID", |s| {
            let u = match handle(device)? {
                Handle::Mig(serial) => s.ci(serial)?.1.uuid.clone(),
                h => s.gpu(h)?.1.uuid.clone(),
            };
            put_str(uuid, length, &u)
        })
    }
}

/// `nvmlDeviceGetName`.
///
/// # Safety
///
/// `name`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nv::nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `name` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetName", |s| {
            let (_, g, mig) = s.device(handle(device)?)?;
            let n = match mig {
                Some(v) => format!("{} {}", g.spec.product_name, s.mig_profile(&v)?.name),
                None => g.spec.product_name.clone(),
            };
            put_str(name, length, &n)
        })
    }
}

/// `nvmlDeviceGetPciInfo_v3`.
///
/// # Safety
///
/// `pci`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nv::nvmlDevice_t,
    pci: *mut nv::nvmlPciInfo_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `pci` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetPciInfo_v3", |s| {
            let (_, g, _) = s.device(handle(device)?)?;
            let mut info = nv::nvmlPciInfo_t {
                busIdLegacy: [0; 16],
                domain: 0,
                bus: g.bus,
                device: 0,
                pciDeviceId: 0x2330_10de,
                pciSubSystemId: 0x16c1_10de,
                busId: [0; 32],
            };
            fill(&mut info.busIdLegacy, &format!("0000:{:02x}:00.0", g.bus))?;
            fill(&mut info.busId, &format!("00000000:{:02x}:00.0", g.bus))?;
            put(pci, info)
        })
    }
}

/// `nvmlDeviceGetMemoryInfo_v2`: whole GPU, or the GPU instance of a MIG device.
///
/// # Safety
///
/// `memory`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nv::nvmlDevice_t,
    memory: *mut nv::nvmlMemory_v2_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `memory` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetMemoryInfo_v2", |s| {
            let version = get(memory.cast::<c_uint>().cast_const())?;
            if version != v2::<nv::nvmlMemory_v2_t>() {
                return Err(E_VERSION_MISMATCH);
            }
            let (_, g, mig) = s.device(handle(device)?)?;
            let mib = match mig {
                Some(v) => s.mig_profile(&v)?.memory_mib,
                None => g.spec.memory_mib,
            };
            let total = mib * 1024 * 1024;
            let reserved = total / 100;
            put(
                memory,
                nv::nvmlMemory_v2_t {
                    version,
                    total,
                    reserved,
                    free: total - reserved,
                    used: reserved,
                },
            )
        })
    }
}

/// `nvmlDeviceGetMinorNumber`.
///
/// # Safety
///
/// `minor`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nv::nvmlDevice_t,
    minor: *mut c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `minor` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetMinorNumber", |s| {
            let (_, g) = s.gpu(handle(device)?)?;
            put(minor, g.minor)
        })
    }
}

/// `nvmlDeviceGetArchitecture`.
///
/// # Safety
///
/// `arch`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: nv::nvmlDevice_t,
    arch: *mut nv::nvmlDeviceArchitecture_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `arch` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetArchitecture", |s| {
            let (_, g, _) = s.device(handle(device)?)?;
            put(arch, Sim::architecture(g))
        })
    }
}

/// `nvmlDeviceGetCudaComputeCapability`.
///
/// # Safety
///
/// `major`, `minor`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCudaComputeCapability(
    device: nv::nvmlDevice_t,
    major: *mut c_int,
    minor: *mut c_int,
) -> nv::nvmlReturn_t {
    // SAFETY: `major`, `minor` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetCudaComputeCapability", |s| {
            let (_, g, _) = s.device(handle(device)?)?;
            let (a, b) = g.spec.cuda_compute_capability;
            put(major, a as c_int)?;
            put(minor, b as c_int)
        })
    }
}

/// `nvmlDeviceGetAttributes_v2`: for a MIG device its GPU instance's resources;
/// for a whole GPU its totals (real NVML documents MIG handles only; the
/// simulator also answers for whole GPUs unless `attributesMigOnly` is set).
///
/// # Safety
///
/// `attributes`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nv::nvmlDevice_t,
    attributes: *mut nv::nvmlDeviceAttributes_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `attributes` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetAttributes_v2", |s| {
            let (_, g, mig) = s.device(handle(device)?)?;
            let a = match mig {
                Some(v) => {
                    let p = s.mig_profile(&v)?;
                    nv::nvmlDeviceAttributes_t {
                        multiprocessorCount: p.multiprocessors * v.slices / p.slice_count.max(1),
                        sharedCopyEngineCount: p.copy,
                        sharedDecoderCount: p.decoders,
                        sharedEncoderCount: p.encoders,
                        sharedJpegCount: p.jpeg,
                        sharedOfaCount: p.ofa,
                        gpuInstanceSliceCount: p.slice_count,
                        computeInstanceSliceCount: v.slices,
                        memorySizeMB: p.memory_mib as c_ulonglong,
                    }
                }
                None if s.cfg.attributes_mig_only => return Err(E_NOT_SUPPORTED),
                None => nv::nvmlDeviceAttributes_t {
                    multiprocessorCount: g.spec.multiprocessors,
                    sharedCopyEngineCount: g.spec.engines.copy,
                    sharedDecoderCount: g.spec.engines.decoders,
                    sharedEncoderCount: g.spec.engines.encoders,
                    sharedJpegCount: g.spec.engines.jpeg,
                    sharedOfaCount: g.spec.engines.ofa,
                    gpuInstanceSliceCount: u32::from(g.spec.memory_slices),
                    computeInstanceSliceCount: u32::from(g.spec.compute_slices),
                    memorySizeMB: g.spec.memory_mib as c_ulonglong,
                },
            };
            put(attributes, a)
        })
    }
}

/// `nvmlDeviceGetComputeMode`: a MIG device, or a whole GPU without MIG mode.
///
/// # Safety
///
/// `mode`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: nv::nvmlDevice_t,
    mode: *mut nv::nvmlComputeMode_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `mode` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetComputeMode", |s| {
            let m = s.compute_mode(handle(device)?)?;
            put(mode, m)
        })
    }
}

/// `nvmlDeviceSetComputeMode`: a MIG device, or a whole GPU without MIG mode
/// (`NVML_ERROR_NOT_SUPPORTED` for a whole GPU in MIG mode).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetComputeMode(
    device: nv::nvmlDevice_t,
    mode: nv::nvmlComputeMode_t,
) -> nv::nvmlReturn_t {
    api("nvmlDeviceSetComputeMode", |s| {
        s.set_compute_mode(handle(device)?, mode)
    })
}

/// `nvmlDeviceGetMigMode`: `NVML_ERROR_NOT_SUPPORTED` on GPUs without MIG.
///
/// # Safety
///
/// `current`, `pending`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: nv::nvmlDevice_t,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `current`, `pending` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetMigMode", |s| {
            let (c, p) = s.mig_mode(handle(device)?)?;
            put(current, c_uint::from(c))?;
            put(pending, c_uint::from(p))
        })
    }
}

/// `nvmlDeviceSetMigMode`: `NVML_ERROR_IN_USE` while GPU instances exist; on
/// Ampere the change stays pending (activation status `RESET_REQUIRED`).
///
/// # Safety
///
/// `status`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMigMode(
    device: nv::nvmlDevice_t,
    mode: c_uint,
    status: *mut nv::nvmlReturn_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `status` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceSetMigMode", |s| {
            let on = match mode {
                nv::NVML_DEVICE_MIG_DISABLE => false,
                nv::NVML_DEVICE_MIG_ENABLE => true,
                _ => return Err(E_INVALID_ARGUMENT),
            };
            if status.is_null() {
                return Err(E_INVALID_ARGUMENT);
            }
            let st = s.set_mig_mode(handle(device)?, on)?;
            put(status, st)
        })
    }
}

/// `nvmlDeviceGetGpuInstanceProfileInfoV` (v2 struct only).
///
/// # Safety
///
/// `info`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceProfileInfoV(
    device: nv::nvmlDevice_t,
    profile: c_uint,
    info: *mut nv::nvmlGpuInstanceProfileInfo_v2_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `info` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetGpuInstanceProfileInfoV", |s| {
            let version = get(info.cast::<c_uint>().cast_const())?;
            if version != v2::<nv::nvmlGpuInstanceProfileInfo_v2_t>() {
                return Err(E_VERSION_MISMATCH);
            }
            let p = s.gi_profile(handle(device)?, profile)?;
            let mut out = nv::nvmlGpuInstanceProfileInfo_v2_t {
                version,
                id: p.id,
                isP2pSupported: 0,
                sliceCount: p.slice_count,
                instanceCount: p.instance_count,
                multiprocessorCount: p.multiprocessors,
                copyEngineCount: p.copy,
                decoderCount: p.decoders,
                encoderCount: p.encoders,
                jpegCount: p.jpeg,
                ofaCount: p.ofa,
                memorySizeMB: p.memory_mib as c_ulonglong,
                name: [0; 96],
            };
            fill(&mut out.name, &p.name)?;
            put(info, out)
        })
    }
}

fn c_placement(p: Placement) -> nv::nvmlGpuInstancePlacement_t {
    nv::nvmlGpuInstancePlacement_t {
        start: c_uint::from(p.start),
        size: c_uint::from(p.size),
    }
}

/// `nvmlDeviceGetGpuInstancePossiblePlacements_v2`: every placement of the
/// profile, occupied or not; a null buffer returns the count.
///
/// # Safety
///
/// `placements`, `count`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstancePossiblePlacements_v2(
    device: nv::nvmlDevice_t,
    profile_id: c_uint,
    placements: *mut nv::nvmlGpuInstancePlacement_t,
    count: *mut c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `placements`, `count` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetGpuInstancePossiblePlacements_v2", |s| {
            let all: Vec<_> = s
                .placements(handle(device)?, profile_id)?
                .into_iter()
                .map(c_placement)
                .collect();
            if placements.is_null() {
                return put(count, all.len() as c_uint);
            }
            let cap = get(count.cast_const())? as usize;
            put(count, all.len() as c_uint)?;
            put_all(placements, cap, &all)
        })
    }
}

/// `nvmlDeviceGetGpuInstanceRemainingCapacity`.
///
/// # Safety
///
/// `count`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceRemainingCapacity(
    device: nv::nvmlDevice_t,
    profile_id: c_uint,
    count: *mut c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `count` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetGpuInstanceRemainingCapacity", |s| {
            let n = s.remaining_capacity(handle(device)?, profile_id)?;
            put(count, n)
        })
    }
}

/// `nvmlDeviceCreateGpuInstanceWithPlacement`: `NVML_ERROR_INSUFFICIENT_RESOURCES`
/// on overlap, exhausted compute slices, instance limit or media extensions.
///
/// # Safety
///
/// `placement`, `gpu_instance`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceCreateGpuInstanceWithPlacement(
    device: nv::nvmlDevice_t,
    profile_id: c_uint,
    placement: *const nv::nvmlGpuInstancePlacement_t,
    gpu_instance: *mut nv::nvmlGpuInstance_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `placement`, `gpu_instance` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceCreateGpuInstanceWithPlacement", |s| {
            let pl = get(placement)?;
            if gpu_instance.is_null() {
                return Err(E_INVALID_ARGUMENT);
            }
            let (Ok(start), Ok(size)) = (u8::try_from(pl.start), u8::try_from(pl.size)) else {
                return Err(E_INVALID_ARGUMENT);
            };
            let serial = s.create_gi(handle(device)?, profile_id, Placement::new(start, size))?;
            put(gpu_instance, to_ptr(Handle::Gi(serial)))
        })
    }
}

fn gi_serial(p: nv::nvmlGpuInstance_t) -> Result<u64, Ret> {
    match handle(p)? {
        Handle::Gi(s) => Ok(s),
        _ => Err(E_INVALID_ARGUMENT),
    }
}

fn ci_serial(p: nv::nvmlComputeInstance_t) -> Result<u64, Ret> {
    match handle(p)? {
        Handle::Ci(s) => Ok(s),
        _ => Err(E_INVALID_ARGUMENT),
    }
}

/// `nvmlGpuInstanceDestroy`: `NVML_ERROR_IN_USE` while compute instances exist,
/// `NVML_ERROR_INVALID_ARGUMENT` for a destroyed instance's handle.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlGpuInstanceDestroy(gpu_instance: nv::nvmlGpuInstance_t) -> nv::nvmlReturn_t {
    api("nvmlGpuInstanceDestroy", |s| {
        s.destroy_gi(gi_serial(gpu_instance)?)
    })
}

/// `nvmlDeviceGetGpuInstances`: the buffer must hold the profile's `instanceCount`.
///
/// # Safety
///
/// `gpu_instances`, `count`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstances(
    device: nv::nvmlDevice_t,
    profile_id: c_uint,
    gpu_instances: *mut nv::nvmlGpuInstance_t,
    count: *mut c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `gpu_instances`, `count` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetGpuInstances", |s| {
            let h = handle(device)?;
            let gis: Vec<nv::nvmlGpuInstance_t> = s
                .gis_of_profile(h, profile_id)?
                .into_iter()
                .map(|g| to_ptr(Handle::Gi(g)))
                .collect();
            if gpu_instances.is_null() || count.is_null() {
                return Err(E_INVALID_ARGUMENT);
            }
            put_all(gpu_instances, gis.len(), &gis)?;
            put(count, gis.len() as c_uint)
        })
    }
}

/// `nvmlDeviceGetGpuInstanceById`: `NVML_ERROR_NOT_FOUND` when no such instance.
///
/// # Safety
///
/// `gpu_instance`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceById(
    device: nv::nvmlDevice_t,
    id: c_uint,
    gpu_instance: *mut nv::nvmlGpuInstance_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `gpu_instance` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetGpuInstanceById", |s| {
            let g = s.gi_by_id(handle(device)?, id)?;
            put(gpu_instance, to_ptr(Handle::Gi(g)))
        })
    }
}

/// `nvmlGpuInstanceGetInfo`.
///
/// # Safety
///
/// `info`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetInfo(
    gpu_instance: nv::nvmlGpuInstance_t,
    info: *mut nv::nvmlGpuInstanceInfo_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `info` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlGpuInstanceGetInfo", |s| {
            let (gpu, gi) = s.gi(gi_serial(gpu_instance)?)?;
            let pl = s.gi_placement(gpu, gi);
            put(
                info,
                nv::nvmlGpuInstanceInfo_t {
                    device: to_ptr(Handle::Gpu(gpu)),
                    id: gi.id,
                    profileId: gi.profile_id,
                    placement: c_placement(pl),
                },
            )
        })
    }
}

/// `nvmlGpuInstanceGetComputeInstanceProfileInfoV` (v2 struct, shared engines only).
///
/// # Safety
///
/// `info`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceProfileInfoV(
    gpu_instance: nv::nvmlGpuInstance_t,
    profile: c_uint,
    eng_profile: c_uint,
    info: *mut nv::nvmlComputeInstanceProfileInfo_v2_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `info` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlGpuInstanceGetComputeInstanceProfileInfoV", |s| {
            let version = get(info.cast::<c_uint>().cast_const())?;
            if version != v2::<nv::nvmlComputeInstanceProfileInfo_v2_t>() {
                return Err(E_VERSION_MISMATCH);
            }
            let p = s.ci_profile(gi_serial(gpu_instance)?, profile, eng_profile)?;
            let mut out = nv::nvmlComputeInstanceProfileInfo_v2_t {
                version,
                id: p.id,
                sliceCount: p.slice_count,
                instanceCount: p.instance_count,
                multiprocessorCount: p.multiprocessors,
                sharedCopyEngineCount: p.gi.copy,
                sharedDecoderCount: p.gi.decoders,
                sharedEncoderCount: p.gi.encoders,
                sharedJpegCount: p.gi.jpeg,
                sharedOfaCount: p.gi.ofa,
                name: [0; 96],
            };
            fill(&mut out.name, &p.name)?;
            put(info, out)
        })
    }
}

/// `nvmlGpuInstanceCreateComputeInstance`.
///
/// # Safety
///
/// `compute_instance`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceCreateComputeInstance(
    gpu_instance: nv::nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instance: *mut nv::nvmlComputeInstance_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `compute_instance` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlGpuInstanceCreateComputeInstance", |s| {
            if compute_instance.is_null() {
                return Err(E_INVALID_ARGUMENT);
            }
            let c = s.create_ci(gi_serial(gpu_instance)?, profile_id)?;
            put(compute_instance, to_ptr(Handle::Ci(c)))
        })
    }
}

/// `nvmlComputeInstanceDestroy`: `NVML_ERROR_INVALID_ARGUMENT` for a destroyed
/// instance's handle.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlComputeInstanceDestroy(
    compute_instance: nv::nvmlComputeInstance_t,
) -> nv::nvmlReturn_t {
    api("nvmlComputeInstanceDestroy", |s| {
        s.destroy_ci(ci_serial(compute_instance)?)
    })
}

/// `nvmlGpuInstanceGetComputeInstances`: the buffer must hold the CI profile's
/// `instanceCount`.
///
/// # Safety
///
/// `compute_instances`, `count`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstances(
    gpu_instance: nv::nvmlGpuInstance_t,
    profile_id: c_uint,
    compute_instances: *mut nv::nvmlComputeInstance_t,
    count: *mut c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `compute_instances`, `count` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlGpuInstanceGetComputeInstances", |s| {
            let cis: Vec<nv::nvmlComputeInstance_t> = s
                .cis_of_profile(gi_serial(gpu_instance)?, profile_id)?
                .into_iter()
                .map(|c| to_ptr(Handle::Ci(c)))
                .collect();
            if compute_instances.is_null() || count.is_null() {
                return Err(E_INVALID_ARGUMENT);
            }
            put_all(compute_instances, cis.len(), &cis)?;
            put(count, cis.len() as c_uint)
        })
    }
}

/// `nvmlGpuInstanceGetComputeInstanceById`: `NVML_ERROR_NOT_FOUND` when absent.
///
/// # Safety
///
/// `compute_instance`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlGpuInstanceGetComputeInstanceById(
    gpu_instance: nv::nvmlGpuInstance_t,
    id: c_uint,
    compute_instance: *mut nv::nvmlComputeInstance_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `compute_instance` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlGpuInstanceGetComputeInstanceById", |s| {
            let c = s.ci_by_id(gi_serial(gpu_instance)?, id)?;
            put(compute_instance, to_ptr(Handle::Ci(c)))
        })
    }
}

/// `nvmlComputeInstanceGetInfo_v2`: `device` is the MIG device handle.
///
/// # Safety
///
/// `info`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlComputeInstanceGetInfo_v2(
    compute_instance: nv::nvmlComputeInstance_t,
    info: *mut nv::nvmlComputeInstanceInfo_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `info` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlComputeInstanceGetInfo_v2", |s| {
            let serial = ci_serial(compute_instance)?;
            let (v, _) = s.ci(serial)?;
            put(
                info,
                nv::nvmlComputeInstanceInfo_t {
                    device: to_ptr(Handle::Mig(serial)),
                    gpuInstance: to_ptr(Handle::Gi(v.gi_serial)),
                    id: v.id,
                    profileId: v.profile_id,
                    placement: nv::nvmlComputeInstancePlacement_t {
                        start: v.start,
                        size: v.slices,
                    },
                },
            )
        })
    }
}

/// `nvmlDeviceGetMaxMigDeviceCount`: the GPU's compute slices.
///
/// # Safety
///
/// `count`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nv::nvmlDevice_t,
    count: *mut c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `count` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetMaxMigDeviceCount", |s| {
            let (_, g) = s.gpu(handle(device)?)?;
            if !g.spec.mig_capable {
                return Err(E_NOT_SUPPORTED);
            }
            put(count, c_uint::from(g.spec.compute_slices))
        })
    }
}

/// `nvmlDeviceGetMigDeviceHandleByIndex`: MIG devices ordered by GI id, CI id.
///
/// # Safety
///
/// `mig_device`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nv::nvmlDevice_t,
    index: c_uint,
    mig_device: *mut nv::nvmlDevice_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `mig_device` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetMigDeviceHandleByIndex", |s| {
            let all = s.mig_devices(handle(device)?)?;
            let serial = *all.get(index as usize).ok_or(crate::sim::E_NOT_FOUND)?;
            put(mig_device, to_ptr(Handle::Mig(serial)))
        })
    }
}

/// `nvmlDeviceIsMigDeviceHandle`.
///
/// # Safety
///
/// `is_mig`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nv::nvmlDevice_t,
    is_mig: *mut c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `is_mig` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceIsMigDeviceHandle", |s| {
            let (_, _, mig) = s.device(handle(device)?)?;
            put(is_mig, c_uint::from(mig.is_some()))
        })
    }
}

/// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`.
///
/// # Safety
///
/// `device`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig_device: nv::nvmlDevice_t,
    device: *mut nv::nvmlDevice_t,
) -> nv::nvmlReturn_t {
    // SAFETY: `device` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", |s| match s
            .device(handle(mig_device)?)?
        {
            (gpu, _, Some(_)) => put(device, to_ptr(Handle::Gpu(gpu))),
            _ => Err(E_INVALID_ARGUMENT),
        })
    }
}

/// `nvmlDeviceGetGpuInstanceId` (MIG device handles only).
///
/// # Safety
///
/// `id`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuInstanceId(
    device: nv::nvmlDevice_t,
    id: *mut c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `id` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetGpuInstanceId", |s| {
            match s.device(handle(device)?)? {
                (_, _, Some(v)) => put(id, s.gi(v.gi_serial)?.1.id),
                _ => Err(E_NOT_SUPPORTED),
            }
        })
    }
}

/// `nvmlDeviceGetComputeInstanceId` (MIG device handles only).
///
/// # Safety
///
/// `id`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeInstanceId(
    device: nv::nvmlDevice_t,
    id: *mut c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `id` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetComputeInstanceId", |s| {
            match s.device(handle(device)?)? {
                (_, _, Some(v)) => put(id, v.id),
                _ => Err(E_NOT_SUPPORTED),
            }
        })
    }
}

fn event_set(p: nv::nvmlEventSet_t) -> Result<u64, Ret> {
    match handle(p)? {
        Handle::EventSet(s) => Ok(s),
        _ => Err(E_INVALID_ARGUMENT),
    }
}

/// `nvmlDeviceGetSupportedEventTypes`: SBE, DBE and XID, or none for a GPU in
/// `eventsUnsupported`.
///
/// # Safety
///
/// `event_types`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nv::nvmlDevice_t,
    event_types: *mut c_ulonglong,
) -> nv::nvmlReturn_t {
    // SAFETY: `event_types` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlDeviceGetSupportedEventTypes", |s| {
            let t = s.supported_event_types(handle(device)?)?;
            put(event_types, t)
        })
    }
}

/// `nvmlEventSetCreate`: the set sees events injected from now on.
///
/// # Safety
///
/// `set`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nv::nvmlEventSet_t) -> nv::nvmlReturn_t {
    // SAFETY: `set` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        api("nvmlEventSetCreate", |s| {
            if set.is_null() {
                return Err(E_INVALID_ARGUMENT);
            }
            let id = s.create_event_set();
            put(set, to_ptr(Handle::EventSet(id)))
        })
    }
}

/// `nvmlDeviceRegisterEvents`: `NVML_ERROR_NOT_SUPPORTED` for an unsupported
/// type, a GPU without events or a MIG device handle.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nv::nvmlDevice_t,
    event_types: c_ulonglong,
    set: nv::nvmlEventSet_t,
) -> nv::nvmlReturn_t {
    api("nvmlDeviceRegisterEvents", |s| {
        s.register_events(handle(device)?, event_types, event_set(set)?)
    })
}

/// How often a waiting `nvmlEventSetWait_v2` looks at the events file.
const EVENT_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// `nvmlEventSetWait_v2`: the next injected event of a registered GPU and type,
/// waiting up to `timeoutms` (`NVML_ERROR_TIMEOUT` then). `gpuInstanceId` and
/// `computeInstanceId` are `0xFFFFFFFF` for whole-device events. The lock is
/// not held while waiting.
///
/// # Safety
///
/// `data`: null, or valid and aligned for the values this call
/// reads or writes there (the module's pointer contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nv::nvmlEventSet_t,
    data: *mut nv::nvmlEventData_t,
    timeoutms: c_uint,
) -> nv::nvmlReturn_t {
    // SAFETY: `data` come from the caller, valid by this
    // function's contract; the helpers check null.
    unsafe {
        let deadline =
            std::time::Instant::now() + std::time::Duration::from_millis(u64::from(timeoutms));
        let poll = |s: &mut Sim| {
            let id = event_set(set)?;
            if data.is_null() {
                return Err(E_INVALID_ARGUMENT);
            }
            let ev = s.next_event(id)?;
            put(
                data,
                nv::nvmlEventData_t {
                    device: to_ptr(Handle::Gpu(ev.gpu)),
                    eventType: ev.event_type,
                    eventData: ev.data,
                    gpuInstanceId: ev.gi.unwrap_or(u32::MAX),
                    computeInstanceId: ev.ci.unwrap_or(u32::MAX),
                },
            )
        };
        let mut rc = api("nvmlEventSetWait_v2", poll);
        loop {
            if rc != E_TIMEOUT {
                return rc;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return E_TIMEOUT;
            }
            std::thread::sleep((deadline - now).min(EVENT_POLL));
            rc = api_uncounted(poll);
        }
    }
}

/// `nvmlEventSetFree`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nv::nvmlEventSet_t) -> nv::nvmlReturn_t {
    api("nvmlEventSetFree", |s| s.free_event_set(event_set(set)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{GpuEntry, SimConfig};
    use crate::sim::{E_INSUFFICIENT_RESOURCES, E_NOT_FOUND, E_RESET_REQUIRED};

    fn dev(i: u32) -> nv::nvmlDevice_t {
        // SAFETY: every pointer passed to the NVML functions below
        // points to a live local (or buffer of the stated length) of
        // the type the function writes or reads.
        unsafe {
            let mut d = std::ptr::null_mut();
            assert_eq!(nvmlDeviceGetHandleByIndex_v2(i, &raw mut d), SUCCESS);
            d
        }
    }

    fn create(d: nv::nvmlDevice_t, id: u32, start: u32, size: u32) -> (Ret, nv::nvmlGpuInstance_t) {
        // SAFETY: every pointer passed to the NVML functions below
        // points to a live local (or buffer of the stated length) of
        // the type the function writes or reads.
        unsafe {
            let pl = nv::nvmlGpuInstancePlacement_t { start, size };
            let mut gi = std::ptr::null_mut();
            let rc = nvmlDeviceCreateGpuInstanceWithPlacement(d, id, &raw const pl, &raw mut gi);
            (rc, gi)
        }
    }

    /// The C ABI directly: buffer sizing, struct versions, stale handles,
    /// capacity, MIG mode. One test because the simulator is process-wide.
    #[test]
    fn c_abi_semantics() {
        // SAFETY: every pointer passed to the NVML functions below
        // points to a live local (or buffer of the stated length) of
        // the type the function writes or reads.
        unsafe {
            let dir = tempfile::tempdir().unwrap();
            let cfg = SimConfig::new(
                "n",
                vec![
                    GpuEntry::new("h100", 1, true),
                    GpuEntry::new("a100", 1, false),
                ],
                dir.path(),
            );
            let path = dir.path().join("cfg.json");
            cfg.to_file(&path).unwrap();
            *TEST_CONFIG.lock().unwrap() = Some(path);
            let mut n: c_uint = 0;
            assert_eq!(nvmlDeviceGetCount_v2(&raw mut n), E_UNINITIALIZED);
            assert_eq!(nvmlInit_v2(), SUCCESS);
            assert_eq!(nvmlDeviceGetCount_v2(&raw mut n), SUCCESS);
            assert_eq!(n, 2);
            let h = dev(0);

            // Placements: null buffer gives the count; a short buffer is refused.
            let mut count: c_uint = 0;
            let rc = nvmlDeviceGetGpuInstancePossiblePlacements_v2(
                h,
                19,
                std::ptr::null_mut(),
                &raw mut count,
            );
            assert_eq!((rc, count), (SUCCESS, 7));
            let mut buf = [nv::nvmlGpuInstancePlacement_t { start: 0, size: 0 }; 2];
            count = 2;
            let rc = nvmlDeviceGetGpuInstancePossiblePlacements_v2(
                h,
                19,
                buf.as_mut_ptr(),
                &raw mut count,
            );
            assert_eq!((rc, count), (E_INSUFFICIENT_SIZE, 7));

            // Versioned struct with a wrong version.
            // Zeroed (inside the block's unsafe): plain C struct of integers
            // and a char array, for which zero is valid.
            let mut info: nv::nvmlGpuInstanceProfileInfo_v2_t = std::mem::zeroed();
            info.version = 1;
            assert_eq!(
                nvmlDeviceGetGpuInstanceProfileInfoV(h, 0, &raw mut info),
                E_VERSION_MISMATCH
            );
            info.version = v2::<nv::nvmlGpuInstanceProfileInfo_v2_t>();
            assert_eq!(
                nvmlDeviceGetGpuInstanceProfileInfoV(h, 0, &raw mut info),
                SUCCESS
            );
            assert_eq!((info.id, info.sliceCount, info.instanceCount), (19, 1, 7));
            assert_eq!(
                nvmlDeviceGetGpuInstanceProfileInfoV(h, 5, &raw mut info),
                E_NOT_SUPPORTED
            );

            // Remaining capacity follows state; possible placements do not.
            let mut cap: c_uint = 0;
            assert_eq!(
                nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19, &raw mut cap),
                SUCCESS
            );
            assert_eq!(cap, 7);
            let (rc, gi) = create(h, 19, 0, 1);
            assert_eq!(rc, SUCCESS);
            assert_eq!(
                nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19, &raw mut cap),
                SUCCESS
            );
            assert_eq!(cap, 6);
            assert_eq!(
                nvmlDeviceGetGpuInstanceRemainingCapacity(h, 0, &raw mut cap),
                SUCCESS
            );
            assert_eq!(cap, 0);
            let rc = nvmlDeviceGetGpuInstancePossiblePlacements_v2(
                h,
                19,
                std::ptr::null_mut(),
                &raw mut count,
            );
            assert_eq!((rc, count), (SUCCESS, 7));
            assert_eq!(create(h, 0, 0, 8).0, E_INSUFFICIENT_RESOURCES);
            assert_eq!(create(h, 19, 7, 1).0, E_INVALID_ARGUMENT);

            // A destroyed instance's handle stays invalid, even when its id is reused.
            // Zeroed (inside the block's unsafe): plain C struct (pointer and
            // integers), for which zero is valid.
            let mut gi_info: nv::nvmlGpuInstanceInfo_t = std::mem::zeroed();
            assert_eq!(nvmlGpuInstanceGetInfo(gi, &raw mut gi_info), SUCCESS);
            let id = gi_info.id;
            assert_eq!(nvmlGpuInstanceDestroy(gi), SUCCESS);
            assert_eq!(nvmlGpuInstanceDestroy(gi), E_INVALID_ARGUMENT);
            let mut again = std::ptr::null_mut();
            assert_eq!(
                nvmlDeviceGetGpuInstanceById(h, id, &raw mut again),
                E_NOT_FOUND
            );
            let (rc, gi2) = create(h, 19, 0, 1);
            assert_eq!(rc, SUCCESS);
            assert_eq!(nvmlGpuInstanceGetInfo(gi2, &raw mut gi_info), SUCCESS);
            assert_eq!(gi_info.id, id, "ids are reused");
            assert_ne!(gi, gi2, "handles are not");
            assert_eq!(
                nvmlGpuInstanceGetInfo(gi, &raw mut gi_info),
                E_INVALID_ARGUMENT
            );

            // MIG mode: Ampere goes pending; GPU-instance calls need MIG on.
            let a = dev(1);
            assert_eq!(create(a, 19, 0, 1).0, E_NOT_SUPPORTED);
            let mut st: Ret = 0;
            assert_eq!(nvmlDeviceSetMigMode(a, 1, &raw mut st), SUCCESS);
            assert_eq!(st, E_RESET_REQUIRED);
            let (mut cur, mut pend) = (9, 9);
            assert_eq!(
                nvmlDeviceGetMigMode(a, &raw mut cur, &raw mut pend),
                SUCCESS
            );
            assert_eq!((cur, pend), (0, 1));
            assert_eq!(
                nvmlDeviceSetMigMode(h, 0, &raw mut st),
                crate::sim::E_IN_USE
            );

            // Name buffers too small are refused, not truncated.
            let mut name = [0 as c_char; 4];
            assert_eq!(
                nvmlDeviceGetName(h, name.as_mut_ptr(), 4),
                E_INSUFFICIENT_SIZE
            );

            assert_eq!(nvmlShutdown(), SUCCESS);
            assert_eq!(nvmlDeviceGetCount_v2(&raw mut n), E_UNINITIALIZED);
            assert_eq!(nvmlShutdown(), E_UNINITIALIZED);
        }
    }
}
