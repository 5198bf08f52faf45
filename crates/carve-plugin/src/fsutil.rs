//! Atomic file replacement: write a temp file next to the target, rename it
//! over the target.
//!
//! A write is fsynced before the rename (the data reaches the disk before the
//! name points at it) only when the caller asks for it: checkpoint writes
//! that record state a reboot does not undo, and the boot marker (see the
//! `checkpoint` module docs for which and why). CDI specs are never fsynced:
//! `/var/run/cdi` is empty after a reboot. A durable write also fsyncs the
//! directory after the rename, so that the new name survives a power loss
//! too. A crash of the plugin process itself loses nothing the page cache
//! holds. This keeps `fsync` (milliseconds on a busy disk) off the
//! prepare path.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::WriteFault;

/// Which kind of file a write is, for fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FileKind {
    Checkpoint,
    Cdi,
    /// The checkpoint's boot marker (no fault injection).
    Marker,
}

static CHECKPOINT_WRITES: AtomicU64 = AtomicU64::new(0);
static CDI_WRITES: AtomicU64 = AtomicU64::new(0);
static SYNCS: AtomicU64 = AtomicU64::new(0);
static SYNC_NANOS: AtomicU64 = AtomicU64::new(0);

/// Durable checkpoint writes done by [`atomic_write`] in this process so far
/// (each an fsync of the file and one of its directory), and the time spent in
/// those fsyncs (for `carve bench prepare`, which reports overhead with and
/// without the disk's flush time).
pub(crate) fn sync_totals() -> (u64, Duration) {
    (
        SYNCS.load(Ordering::Relaxed),
        Duration::from_nanos(SYNC_NANOS.load(Ordering::Relaxed)),
    )
}

/// Run `f`, returning how long it took.
fn timed(f: impl FnOnce() -> std::io::Result<()>) -> std::io::Result<Duration> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed())
}

/// Abort the process if `fault` names this write (the Nth write of this kind in
/// this process). Used only by crash tests, configured through
/// [`crate::PluginConfig::write_fault`].
fn maybe_abort(kind: FileKind, fault: Option<WriteFault>) {
    let counter = match kind {
        FileKind::Checkpoint => &CHECKPOINT_WRITES,
        FileKind::Cdi => &CDI_WRITES,
        FileKind::Marker => return,
    };
    let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
    let hit = match fault {
        Some(WriteFault::Checkpoint(at)) => kind == FileKind::Checkpoint && at == n,
        Some(WriteFault::Cdi(at)) => kind == FileKind::Cdi && at == n,
        None => false,
    };
    if hit {
        tracing::error!(
            ?kind,
            write = n,
            "write fault injected: aborting before rename"
        );
        std::process::abort();
    }
}

/// Replace `path` with `bytes` atomically, fsyncing the data before the
/// rename when `durable`. On error the target is untouched and the temp file
/// removed.
pub(crate) fn atomic_write(
    path: &Path,
    bytes: &[u8],
    kind: FileKind,
    durable: bool,
    fault: Option<WriteFault>,
) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    let tmp: PathBuf = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let res = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        let mut synced = Duration::ZERO;
        if durable {
            synced += timed(|| f.sync_all())?;
        }
        drop(f);
        maybe_abort(kind, fault);
        std::fs::rename(&tmp, path)?;
        if durable {
            // The new name reaches the disk only with its directory.
            synced += timed(|| std::fs::File::open(dir)?.sync_all())?;
            if kind == FileKind::Checkpoint {
                let ns = u64::try_from(synced.as_nanos()).unwrap_or(u64::MAX);
                SYNC_NANOS.fetch_add(ns, Ordering::Relaxed);
                SYNCS.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(())
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// Remove a file; a missing file counts as removed.
pub(crate) fn remove_file(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_and_leaves_no_temp() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.json");
        atomic_write(&p, b"one", FileKind::Cdi, false, None).unwrap();
        atomic_write(&p, b"two", FileKind::Cdi, false, None).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn failed_write_keeps_old_content() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub");
        std::fs::create_dir(&p).unwrap();
        // Renaming a file over a non-empty directory fails.
        std::fs::write(p.join("x"), b"x").unwrap();
        assert!(atomic_write(&p, b"two", FileKind::Cdi, false, None).is_err());
        assert_eq!(std::fs::read(p.join("x")).unwrap(), b"x");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }
}
