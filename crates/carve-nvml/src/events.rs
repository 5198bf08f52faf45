//! [`GpuEvents`] over the NVML event API: one event set for all GPUs, created
//! and registered at the first wait, freed when the backend drops.

use std::ffi::{c_uint, c_ulonglong};
use std::time::{Duration, SystemTime};

use carve_gpu::{BackendError, EventKind, GpuEvent, GpuEvents};
use nvml_wrapper_sys::bindings as nv;

use crate::{NvmlBackend, check, code_err, wrapper_err};

/// The event types carve watches.
const WANTED: c_ulonglong = (nv::nvmlEventTypeXidCriticalError
    | nv::nvmlEventTypeDoubleBitEccError
    | nv::nvmlEventTypeSingleBitEccError) as c_ulonglong;

/// `gpuInstanceId` / `computeInstanceId` of an event that affects the whole device.
const WHOLE_DEVICE: c_uint = 0xFFFF_FFFF;

/// Most events returned by one wait.
const MAX_BATCH: usize = 256;

/// An NVML event set handle.
#[derive(Debug)]
pub(crate) struct EventSet(nv::nvmlEventSet_t);

// SAFETY: the handle is an opaque token of the NVML library, which is
// thread-safe; it is only used while the owning `EventWatch` mutex is held (or
// through `&mut` in Drop), so no two threads use it at once, and it is freed
// exactly once (`take_set` moves it out).
unsafe impl Send for EventSet {}

/// State of the event watch.
#[derive(Debug, Default)]
pub(crate) struct EventWatch {
    /// Whether watching has started (registration was attempted and reported).
    started: bool,
    /// The event set; `None` when no GPU could be registered.
    set: Option<EventSet>,
    /// Registered GPUs: device handle address and NVML index.
    gpus: Vec<(usize, u32)>,
}

impl EventWatch {
    /// Move the event set out (to free it).
    pub(crate) fn take_set(&mut self) -> Option<EventSet> {
        self.set.take()
    }
}

impl NvmlBackend {
    /// Free an event set, logging (not failing) when NVML refuses.
    pub(crate) fn free_event_set(&self, set: EventSet) {
        let Ok(f) = self.nvml.lib().nvmlEventSetFree.as_ref() else {
            return;
        };
        // SAFETY: `set` was returned by `nvmlEventSetCreate` of this NVML
        // instance, is still initialised (we hold `self`), and is freed once:
        // `set` is consumed here.
        let rc = unsafe { f(set.0) };
        if rc != nv::nvmlReturn_enum_NVML_SUCCESS {
            tracing::warn!(code = rc, "nvmlEventSetFree failed");
        }
    }

    /// Register GPU `gpu` in `set`: its handle address, or why it cannot be
    /// watched (`NOT_SUPPORTED`, no wanted event type).
    fn register_gpu(
        &self,
        gpu: u32,
        set: nv::nvmlEventSet_t,
    ) -> Result<Result<usize, String>, BackendError> {
        let l = self.nvml.lib();
        let register = sym!(l, nvmlDeviceRegisterEvents);
        let dev = self.dev(gpu)?;
        let mut mask = WANTED;
        if let Ok(f) = l.nvmlDeviceGetSupportedEventTypes.as_ref() {
            let mut supported: c_ulonglong = 0;
            // SAFETY: `dev` is a live handle of this NVML instance; `supported`
            // is a valid out pointer.
            let rc = unsafe { f(dev, &raw mut supported) };
            match rc {
                nv::nvmlReturn_enum_NVML_SUCCESS => mask &= supported,
                nv::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => {
                    return Ok(Err("nvmlDeviceGetSupportedEventTypes: not supported".into()));
                }
                rc => {
                    return Err(code_err(
                        "nvmlDeviceGetSupportedEventTypes",
                        rc,
                        format!("GPU {gpu}"),
                    ));
                }
            }
            if mask == 0 {
                return Ok(Err(
                    "supports none of the XID and ECC event types".to_string()
                ));
            }
        }
        // SAFETY: `dev` is a live handle and `set` a live event set of this
        // NVML instance; `mask` is a plain bit mask.
        let rc = unsafe { register(dev, mask, set) };
        match rc {
            nv::nvmlReturn_enum_NVML_SUCCESS => Ok(Ok(dev.addr())),
            nv::nvmlReturn_enum_NVML_ERROR_NOT_SUPPORTED => {
                Ok(Err("nvmlDeviceRegisterEvents: not supported".into()))
            }
            rc => Err(code_err(
                "nvmlDeviceRegisterEvents",
                rc,
                format!("GPU {gpu} event mask {mask:#x}"),
            )),
        }
    }

    /// Create the event set and register every GPU. Returns one
    /// [`EventKind::Unmonitored`] event per GPU that cannot be watched. On an
    /// error nothing stays registered and watching has not started.
    fn start_watch(&self, w: &mut EventWatch) -> Result<Vec<GpuEvent>, BackendError> {
        let now = SystemTime::now();
        let n = self
            .nvml
            .device_count()
            .map_err(|e| wrapper_err("nvmlDeviceGetCount_v2", e, String::new()))?;
        let unmonitored = |gpu: u32, reason: String| {
            tracing::warn!(gpu, %reason, "GPU health events not monitored");
            GpuEvent {
                gpu,
                kind: EventKind::Unmonitored { reason },
                gi: None,
                ci: None,
                at: now,
            }
        };
        let l = self.nvml.lib();
        let api = (
            l.nvmlEventSetCreate.as_ref(),
            l.nvmlDeviceRegisterEvents.as_ref(),
            l.nvmlEventSetWait_v2.as_ref(),
            l.nvmlEventSetFree.as_ref(),
        );
        let (Ok(create), Ok(_), Ok(_), Ok(_)) = api else {
            w.started = true;
            return Ok((0..n)
                .map(|g| unmonitored(g, format!("{} lacks the NVML event API", self.lib)))
                .collect());
        };
        let mut raw: nv::nvmlEventSet_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out pointer; NVML is initialised (`self`).
        let rc = unsafe { create(&raw mut raw) };
        check("nvmlEventSetCreate", rc, || {
            "event set for GPU health".into()
        })?;
        let set = EventSet(raw);
        let mut gpus = Vec::new();
        let mut out = Vec::new();
        for gpu in 0..n {
            match self.register_gpu(gpu, set.0) {
                Ok(Ok(handle)) => gpus.push((handle, gpu)),
                Ok(Err(reason)) => out.push(unmonitored(gpu, reason)),
                Err(e) => {
                    self.free_event_set(set);
                    return Err(e);
                }
            }
        }
        if gpus.is_empty() {
            self.free_event_set(set);
        } else {
            w.set = Some(set);
        }
        w.gpus = gpus;
        w.started = true;
        tracing::info!(
            watched = w.gpus.len(),
            unmonitored = out.len(),
            "watching GPU health events"
        );
        Ok(out)
    }

    /// The events one `nvmlEventData_t` stands for: one, or one per watched GPU
    /// when the device handle is not one carve registered (cannot be narrowed).
    fn to_events(w: &EventWatch, d: &nv::nvmlEventData_t) -> Vec<GpuEvent> {
        let at = SystemTime::now();
        let id = |v: c_uint| (v != WHOLE_DEVICE).then_some(v);
        let kind = match d.eventType {
            t if t == c_ulonglong::from(nv::nvmlEventTypeXidCriticalError) => {
                EventKind::Xid(d.eventData)
            }
            t if t == c_ulonglong::from(nv::nvmlEventTypeDoubleBitEccError) => {
                EventKind::DoubleBitEcc
            }
            t if t == c_ulonglong::from(nv::nvmlEventTypeSingleBitEccError) => {
                EventKind::SingleBitEcc
            }
            t => EventKind::Other {
                event_type: t,
                data: d.eventData,
            },
        };
        match w.gpus.iter().find(|(h, _)| *h == d.device.addr()) {
            Some(&(_, gpu)) => vec![GpuEvent {
                gpu,
                kind,
                gi: id(d.gpuInstanceId),
                ci: id(d.computeInstanceId),
                at,
            }],
            None => {
                tracing::warn!(
                    ?kind,
                    "event for an unknown device handle: applies to every watched GPU"
                );
                w.gpus
                    .iter()
                    .map(|&(_, gpu)| GpuEvent {
                        gpu,
                        kind: kind.clone(),
                        gi: None,
                        ci: None,
                        at,
                    })
                    .collect()
            }
        }
    }
}

impl GpuEvents for NvmlBackend {
    fn wait_events(&self, timeout: Duration) -> Result<Vec<GpuEvent>, BackendError> {
        let mut w = self
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !w.started {
            let first = self.start_watch(&mut w)?;
            if !first.is_empty() {
                return Ok(first);
            }
        }
        let Some(set) = w.set.as_ref().map(|s| s.0) else {
            // Nothing can be watched: a wait just waits.
            drop(w);
            std::thread::sleep(timeout);
            return Ok(Vec::new());
        };
        let f = sym!(self.nvml.lib(), nvmlEventSetWait_v2);
        let mut ms = c_uint::try_from(timeout.as_millis()).unwrap_or(c_uint::MAX);
        let mut out = Vec::new();
        while out.len() < MAX_BATCH {
            // SAFETY: plain C struct (a pointer and integers); all-zero is valid.
            let mut data: nv::nvmlEventData_t = unsafe { std::mem::zeroed() };
            // SAFETY: `set` is the live event set owned by `w`, which stays
            // locked for the call; `data` is valid and writable.
            let rc = unsafe { f(set, &raw mut data, ms) };
            match rc {
                nv::nvmlReturn_enum_NVML_SUCCESS => out.extend(Self::to_events(&w, &data)),
                nv::nvmlReturn_enum_NVML_ERROR_TIMEOUT => break,
                rc if out.is_empty() => {
                    return Err(code_err(
                        "nvmlEventSetWait_v2",
                        rc,
                        "waiting for GPU health events".into(),
                    ));
                }
                // Deliver what arrived; the error recurs at the next wait.
                _ => break,
            }
            // Drain what is already there without waiting again.
            ms = 0;
        }
        Ok(out)
    }
}
