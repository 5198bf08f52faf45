//! Atomic file replacement.
//!
//! [`atomic_write`]: write a temp file next to the target, rename it over the
//! target (CDI specs, the boot marker). [`exchange_write`] (the checkpoint,
//! rewritten on every prepare and unprepare): write the bytes into a spare
//! file next to the target, in place, and swap the two names in one
//! `renameat2(RENAME_EXCHANGE)`; the replaced content becomes the next spare.
//!
//! Why two ways: on ext4 (default `auto_da_alloc`) replacing a file by a
//! rename over it, or truncating one and writing it again, starts the new
//! data's writeback inside the rename or close, which waits for the block
//! device: 0.2-0.3 ms p50 per write on a test VM's virtio disk, against
//! 0.02 ms for an in-place write and an exchange (2000 writes of each in a C
//! loop; `carve bench prepare --files-dir /dev/shm` takes the disk out of
//! the plugin's figures).
//! The exchange gives readers the same guarantee as the rename: the name
//! points at the old or the new complete file, never at a partial one.
//!
//! A write is fsynced before the rename or exchange (the data reaches the disk
//! before the name points at it) only when the caller asks for it: checkpoint
//! writes that record state a reboot does not undo, and the boot marker (see
//! the `checkpoint` module docs for which and why). CDI specs are never
//! fsynced: `/var/run/cdi` is empty after a reboot. A durable write also
//! fsyncs the directory after the rename, so that the new name survives a
//! power loss too. A crash of the plugin process itself loses nothing the
//! page cache holds. This keeps `fsync` (milliseconds on a busy disk) off
//! the prepare path.
//!
//! What a write that is not fsynced may leave after a power loss differs: a
//! renamed temp file may be empty or garbage; an exchanged spare may also
//! hold what the spare held on disk before, an older complete checkpoint.
//! The driver therefore also fsyncs a checkpoint write whose spare may hold
//! a body that must not come back after a reboot (`checkpoint` module docs).

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
            sync_dir(dir, kind, synced)?;
        }
        Ok(())
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// The spare file [`exchange_write`] keeps next to `path`: `.<name>.spare`.
pub(crate) fn spare_path(path: &Path) -> PathBuf {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    dir.join(format!(".{name}.spare"))
}

/// Replace `path` with `bytes` atomically: write them into the spare file
/// ([`spare_path`]) in place (no truncation to zero, so no ext4
/// replace-via-truncate flush), fsync it when `durable`, and exchange the
/// spare and `path` (`renameat2(RENAME_EXCHANGE)`), after which the spare
/// holds the previous content. Where `path` does not exist yet, or the file
/// system cannot exchange names, the spare is renamed over `path` instead (as
/// [`atomic_write`]). On error `path` is untouched; the spare may hold
/// anything (it is never read).
///
/// Callers serialize writes of one `path` (the driver's state lock, and the
/// host lock across plugin processes): the spare is shared.
pub(crate) fn exchange_write(
    path: &Path,
    bytes: &[u8],
    kind: FileKind,
    durable: bool,
    fault: Option<WriteFault>,
) -> std::io::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let dir = path.parent().unwrap_or(Path::new("."));
    let spare = spare_path(path);
    let open = |o: &mut std::fs::OpenOptions| {
        o.write(true)
            .truncate(false)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&spare)
    };
    // Never written through a symlink: one in the spare's place (a symlinked
    // checkpoint exchanged out, or planted) is removed and a file made anew.
    let f = match open(std::fs::OpenOptions::new().create(true)) {
        Err(e) if e.raw_os_error() == Some(nix::libc::ELOOP) => {
            std::fs::remove_file(&spare)?;
            open(std::fs::OpenOptions::new().create_new(true))?
        }
        r => r?,
    };
    // Truncated only when the new content is shorter: on ext4 every
    // ftruncate is a journalled inode change, even to the same size.
    let old_len = f.metadata()?.len();
    f.write_all_at(bytes, 0)?;
    if old_len > bytes.len() as u64 {
        f.set_len(bytes.len() as u64)?;
    }
    let mut synced = Duration::ZERO;
    if durable {
        synced += timed(|| f.sync_all())?;
    }
    drop(f);
    maybe_abort(kind, fault);
    if !exchange(&spare, path)? {
        std::fs::rename(&spare, path)?;
    }
    if durable {
        sync_dir(dir, kind, synced)?;
    }
    Ok(())
}

/// The end of a durable write, after its rename or exchange: fsync the
/// directory (the new name reaches the disk only with it), and count a
/// checkpoint's fsyncs with their time (`file_sync` spent on the file's).
fn sync_dir(dir: &Path, kind: FileKind, file_sync: Duration) -> std::io::Result<()> {
    let synced = file_sync + timed(|| std::fs::File::open(dir)?.sync_all())?;
    if kind == FileKind::Checkpoint {
        let ns = u64::try_from(synced.as_nanos()).unwrap_or(u64::MAX);
        SYNC_NANOS.fetch_add(ns, Ordering::Relaxed);
        SYNCS.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Swap the names `a` and `b` atomically; `Ok(false)` where that cannot be
/// done and a rename must do: `b` does not exist, or the file system (or
/// platform) has no `RENAME_EXCHANGE`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn exchange(a: &Path, b: &Path) -> std::io::Result<bool> {
    use nix::errno::Errno;
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    match renameat2(AT_FDCWD, a, AT_FDCWD, b, RenameFlags::RENAME_EXCHANGE) {
        Ok(()) => Ok(true),
        Err(Errno::ENOENT | Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn exchange(_a: &Path, _b: &Path) -> std::io::Result<bool> {
    Ok(false)
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
    fn exchange_keeps_the_replaced_content_as_the_spare() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.json");
        let w = |b: &[u8]| exchange_write(&p, b, FileKind::Cdi, false, None).unwrap();
        // No file yet: the spare is renamed into place.
        w(b"one");
        assert_eq!(std::fs::read(&p).unwrap(), b"one");
        assert!(!spare_path(&p).exists());
        w(b"two, longer");
        w(b"3");
        assert_eq!(std::fs::read(&p).unwrap(), b"3", "shorter content is cut");
        assert_eq!(std::fs::read(spare_path(&p)).unwrap(), b"two, longer");
        // The checkpoint's inode alternates between two files, no temp left.
        let ino = |q: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(q).unwrap());
        let (a, b) = (ino(&p), ino(&spare_path(&p)));
        w(b"four");
        assert_eq!((ino(&p), ino(&spare_path(&p))), (b, a));
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2);
        // Content as long as the spare's, and longer: written over it whole.
        w(b"5");
        assert_eq!(std::fs::read(&p).unwrap(), b"5");
        w(b"six!");
        assert_eq!(std::fs::read(&p).unwrap(), b"six!");
        w(b"seven, longest");
        assert_eq!(std::fs::read(&p).unwrap(), b"seven, longest");
    }

    #[test]
    fn a_spare_that_is_a_symlink_is_replaced_not_written_through() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.json");
        let elsewhere = d.path().join("elsewhere");
        std::fs::write(&elsewhere, b"keep").unwrap();
        exchange_write(&p, b"one", FileKind::Cdi, false, None).unwrap();
        std::os::unix::fs::symlink(&elsewhere, spare_path(&p)).unwrap();
        exchange_write(&p, b"two", FileKind::Cdi, false, None).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(std::fs::read(&elsewhere).unwrap(), b"keep");
        assert!(std::fs::symlink_metadata(&p).unwrap().is_file());
        // A symlinked checkpoint: exchanged out, it is the spare next time.
        std::fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &p).unwrap();
        exchange_write(&p, b"three", FileKind::Cdi, false, None).unwrap();
        exchange_write(&p, b"four", FileKind::Cdi, false, None).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"four");
        assert_eq!(std::fs::read(&elsewhere).unwrap(), b"keep");
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
