//! Injected NVML events: a JSON-lines file next to the state file that tests
//! append to ([`inject_event`]) and the library reads at each
//! `nvmlEventSetWait_v2`, from where each event set last stopped.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use nvml_wrapper_sys::bindings as nv;
use serde::{Deserialize, Serialize};

use crate::config::{SimConfig, SimError};

/// One event as NVML would deliver it (`nvmlEventData_t` without the handle).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SimEvent {
    /// GPU index.
    pub gpu: u32,
    /// `nvmlEventType*` bit, e.g. 8 for an XID.
    pub event_type: u64,
    /// `eventData`: the XID for XID events.
    #[serde(default)]
    pub data: u64,
    /// GPU-instance id; `None` is reported as `0xFFFFFFFF` (whole device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gi: Option<u32>,
    /// Compute-instance id; `None` is reported as `0xFFFFFFFF`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ci: Option<u32>,
}

impl SimEvent {
    /// An XID on the whole GPU.
    #[must_use]
    pub fn xid(gpu: u32, xid: u64) -> Self {
        Self {
            gpu,
            event_type: u64::from(nv::nvmlEventTypeXidCriticalError),
            data: xid,
            gi: None,
            ci: None,
        }
    }

    /// A double-bit ECC error on the whole GPU.
    #[must_use]
    pub fn dbe(gpu: u32) -> Self {
        Self {
            event_type: u64::from(nv::nvmlEventTypeDoubleBitEccError),
            data: 0,
            ..Self::xid(gpu, 0)
        }
    }

    /// A single-bit ECC error on the whole GPU.
    #[must_use]
    pub fn sbe(gpu: u32) -> Self {
        Self {
            event_type: u64::from(nv::nvmlEventTypeSingleBitEccError),
            data: 0,
            ..Self::xid(gpu, 0)
        }
    }

    /// The same event on GPU instance `gi`, compute instance `ci`.
    #[must_use]
    pub fn on_instance(self, gi: u32, ci: u32) -> Self {
        Self {
            gi: Some(gi),
            ci: Some(ci),
            ..self
        }
    }
}

/// Event types the simulator supports on a GPU that supports events.
pub const SUPPORTED_EVENT_TYPES: u64 = (nv::nvmlEventTypeSingleBitEccError
    | nv::nvmlEventTypeDoubleBitEccError
    | nv::nvmlEventTypeXidCriticalError) as u64;

impl SimConfig {
    /// The injected-events file: `<state file>.events` (JSON lines of [`SimEvent`]).
    #[must_use]
    pub fn events_file(&self) -> PathBuf {
        let mut p = self.state_file.clone().into_os_string();
        p.push(".events");
        p.into()
    }
}

/// Append `event` to the events file of `cfg` (one `write` of one line, so a
/// reader sees the whole line or none of it). A running library delivers it to
/// event sets that have `event.gpu` registered for its type.
///
/// # Errors
/// The file cannot be opened or written.
pub fn inject_event(cfg: &SimConfig, event: &SimEvent) -> Result<(), SimError> {
    let path = cfg.events_file();
    let io = |source| SimError::Io {
        path: path.clone(),
        source,
    };
    let mut line = serde_json::to_vec(event).map_err(|source| SimError::Json {
        path: path.clone(),
        source,
    })?;
    line.push(b'\n');
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io)?;
    f.write_all(&line).map_err(io)
}

/// Length of the events file now (0 when it does not exist): where a new event
/// set starts reading.
pub(crate) fn events_end(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// The complete lines of `path` from byte `offset`, parsed, and the offset after
/// the last complete line. A missing file has no events.
///
/// # Errors
/// [`SimError::BadEvent`] naming the file and the line's offset when a line is
/// not a [`SimEvent`]; nothing is consumed then.
pub fn read_events(path: &Path, offset: u64) -> Result<(Vec<SimEvent>, u64), SimError> {
    let io = |source| SimError::Io {
        path: path.into(),
        source,
    };
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), offset)),
        Err(e) => return Err(io(e)),
    };
    f.seek(SeekFrom::Start(offset)).map_err(io)?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).map_err(io)?;
    let mut out = Vec::new();
    let mut pos = 0usize;
    while let Some(nl) = buf[pos..].iter().position(|&b| b == b'\n') {
        let line = &buf[pos..pos + nl];
        if !line.iter().all(u8::is_ascii_whitespace) {
            let ev = serde_json::from_slice(line).map_err(|source| SimError::BadEvent {
                path: path.into(),
                offset: offset + pos as u64,
                source,
            })?;
            out.push(ev);
        }
        pos += nl + 1;
    }
    Ok((out, offset + pos as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::GpuEntry;

    #[test]
    fn injected_events_read_back_in_order_from_an_offset() {
        let d = tempfile::tempdir().unwrap();
        let cfg = SimConfig::new("n", vec![GpuEntry::new("h100", 2, true)], d.path());
        let path = cfg.events_file();
        assert_eq!(read_events(&path, 0).unwrap(), (Vec::new(), 0));
        inject_event(&cfg, &SimEvent::xid(1, 79)).unwrap();
        inject_event(&cfg, &SimEvent::xid(0, 31).on_instance(2, 0)).unwrap();
        let (evs, off) = read_events(&path, 0).unwrap();
        assert_eq!(
            evs,
            [SimEvent::xid(1, 79), SimEvent::xid(0, 31).on_instance(2, 0)]
        );
        assert_eq!(off, events_end(&path));
        inject_event(&cfg, &SimEvent::dbe(0)).unwrap();
        assert_eq!(read_events(&path, off).unwrap().0, [SimEvent::dbe(0)]);
        // A partly written line waits for its newline.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(br#"{"gpu":0,"#).unwrap();
        let end = events_end(&path);
        let (evs, off2) = read_events(&path, off).unwrap();
        assert_eq!((evs.len(), off2), (1, end - 9));
    }

    #[test]
    fn a_bad_line_names_file_and_offset_and_consumes_nothing() {
        let d = tempfile::tempdir().unwrap();
        let cfg = SimConfig::new("n", vec![GpuEntry::new("h100", 1, true)], d.path());
        inject_event(&cfg, &SimEvent::sbe(0)).unwrap();
        let good = events_end(&cfg.events_file());
        std::fs::OpenOptions::new()
            .append(true)
            .open(cfg.events_file())
            .unwrap()
            .write_all(b"{\"gpu\":0,\"eventTyp\":8}\n")
            .unwrap();
        let e = read_events(&cfg.events_file(), 0).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(".events")
                && msg.contains(&format!("offset {good}"))
                && msg.contains("eventTyp"),
            "{msg}"
        );
    }
}
