//! The driver's checkpointed state: the in-memory [`CheckpointBody`], its
//! writes to the checkpoint file (durable only while it records a MIG mode
//! the plugin enabled), and the cross-process host lock under which a
//! rolling update's two plugin pods share it. The file format itself is the
//! `checkpoint` module's.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use super::{ClaimError, Driver, blocking};
use crate::checkpoint::{self, Checkpoint, CheckpointBody, CheckpointError, PreparedKind};
use crate::claim::ClaimRef;

/// The cross-process checkpoint lock ([`Driver::host_lock`]): released on drop.
pub(super) struct HostLock {
    _file: std::fs::File,
    _local: tokio::sync::OwnedMutexGuard<()>,
}

/// What this process last wrote to or read from the checkpoint file.
#[derive(Debug)]
pub(super) struct DiskCopy {
    /// The file's bytes and their body (kept only with a pod UID, for
    /// [`Driver::host_lock`]: a file with these bytes needs no parsing).
    file: Option<(Arc<[u8]>, CheckpointBody)>,
    /// The file may record a GPU in `mig_enabled_by_plugin`, so replacing it
    /// must be durable ([`Driver::persist`], `checkpoint` module docs).
    records_mig: bool,
    /// The same for the spare file the next write overwrites in place (what
    /// the last write replaced; `fsutil::exchange_write`): after a power
    /// loss a write that was not fsynced may show the spare's old content.
    spare_records_mig: bool,
}

impl DiskCopy {
    /// Before this process has read or written anything: both files may
    /// record anything.
    pub(super) fn unknown() -> Self {
        Self {
            file: None,
            records_mig: true,
            spare_records_mig: true,
        }
    }
}

/// Who put the checkpoint file's content there ([`Driver::remember`]).
#[derive(Clone, Copy)]
pub(super) enum Source {
    Written,
    Read,
}

/// The checkpoint as [`Driver::host_lock`] found it.
pub(super) enum Reread {
    /// The bytes this process last wrote or read: nothing to parse.
    Unchanged(CheckpointBody),
    /// Written by another process (or first read).
    Changed(Arc<[u8]>, Box<Checkpoint>),
    /// No file.
    Missing,
}

/// Run file writes `f`: on a blocking thread when they fsync (milliseconds on
/// a busy disk), else right here. Without fsync a checkpoint write is an
/// in-place write and a name exchange (`fsutil::exchange_write`), and a CDI
/// spec a new file on a tmpfs: tens of microseconds, less than the two
/// thread hand-offs of a blocking hop.
async fn on_disk<T: Send + 'static>(
    durable: bool,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    if durable { blocking(f).await } else { Ok(f()) }
}

impl Driver {
    pub(super) fn disk(&self) -> std::sync::MutexGuard<'_, DiskCopy> {
        self.disk
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Note what the checkpoint file now holds: written by this process
    /// (`Source::Written`: the file it replaced is the spare now) or read
    /// after another process wrote it (whose spare this process knows
    /// nothing about).
    pub(super) fn remember(&self, bytes: Arc<[u8]>, body: &CheckpointBody, source: Source) {
        let mut d = self.disk();
        d.spare_records_mig = match source {
            Source::Written => d.records_mig,
            Source::Read => true,
        };
        d.records_mig = !body.mig_enabled_by_plugin.is_empty();
        if self.config.pod_uid.is_some() {
            d.file = Some((bytes, body.clone()));
        }
    }

    /// Write the checkpoint: serialized here, fsynced only when the new body
    /// or the file it replaces (or the spare it overwrites) records a GPU
    /// whose MIG mode the plugin enabled (the only state in it that a reboot
    /// does not undo; see the `checkpoint` module docs).
    pub(super) async fn persist(&self, body: &CheckpointBody) -> Result<(), CheckpointError> {
        let path = self.config.checkpoint_path.clone();
        let (bytes, durable) = self.encode(body)?;
        let fault = self.config.write_fault;
        let b = bytes.clone();
        on_disk(durable, move || {
            checkpoint::store_bytes(&b, &path, durable, fault)
        })
        .await
        .map_err(|e| CheckpointError::Io {
            path: self.config.checkpoint_path.clone(),
            source: std::io::Error::other(e),
        })??;
        self.written(bytes, body);
        Ok(())
    }

    /// [`Self::persist`] after `first` (another file write), on the same
    /// thread; nothing is written to the checkpoint if `first` fails.
    pub(super) async fn persist_after(
        &self,
        body: &CheckpointBody,
        first: impl FnOnce() -> Result<(), ClaimError> + Send + 'static,
    ) -> Result<(), ClaimError> {
        let path = self.config.checkpoint_path.clone();
        let (bytes, durable) = self.encode(body)?;
        let fault = self.config.write_fault;
        let b = bytes.clone();
        on_disk(durable, move || -> Result<(), ClaimError> {
            first()?;
            Ok(checkpoint::store_bytes(&b, &path, durable, fault)?)
        })
        .await
        .map_err(ClaimError::Task)??;
        self.written(bytes, body);
        Ok(())
    }

    /// The file's bytes for `body`, and whether writing them must be durable.
    pub(super) fn encode(
        &self,
        body: &CheckpointBody,
    ) -> Result<(Arc<[u8]>, bool), CheckpointError> {
        let bytes = checkpoint::encode_body(body, &self.config.checkpoint_path)?.into();
        let d = self.disk();
        let durable =
            !body.mig_enabled_by_plugin.is_empty() || d.records_mig || d.spare_records_mig;
        Ok((bytes, durable))
    }

    pub(super) fn written(&self, bytes: Arc<[u8]>, body: &CheckpointBody) {
        self.remember(bytes, body, Source::Written);
        if let Some(m) = &self.config.metrics {
            m.inc_checkpoint_writes();
        }
    }

    /// With a pod UID (rolling update: two plugin pods may run at once) every
    /// operation holds an exclusive lock on `<checkpoint>.lock` and first
    /// reloads the checkpoint another pod may have written. Without one, the
    /// in-memory state is authoritative and no file lock is taken.
    ///
    /// The reload reads the file's bytes; when they are exactly the bytes
    /// this process last wrote or read, the in-memory state is reset to the
    /// body it kept for them (as parsing them would) without parsing and
    /// verifying them again. Only a file another process wrote is parsed.
    ///
    /// This process's operations queue on an async mutex first, so at most one
    /// blocking thread ever waits in `flock` (the others wait as tasks): with
    /// the blocking pool bounded, claims that all waited in `flock` would leave
    /// the lock holder no thread for its NVML and file work, and nothing would
    /// move.
    pub(super) async fn host_lock(&self) -> std::io::Result<Option<HostLock>> {
        if self.config.pod_uid.is_none() {
            return Ok(None);
        }
        let local = self.host_mutex.clone().lock_owned().await;
        let mut name = self.config.checkpoint_path.as_os_str().to_owned();
        name.push(".lock");
        let path = PathBuf::from(name);
        let cp = self.config.checkpoint_path.clone();
        let known = self.disk().file.clone();
        let reread = move |f: std::fs::File| (f, reread(&cp, known));
        // Opening, an uncontended lock and rereading a file of a few KB are
        // a handful of syscalls: done here. Only a lock held by the other
        // plugin pod of a rolling update is waited for, on a blocking thread.
        let f = open_lock_file(&path)?;
        let (file, loaded) = match f.try_lock() {
            Ok(()) => reread(f),
            Err(std::fs::TryLockError::WouldBlock) => blocking(move || -> std::io::Result<_> {
                f.lock()?;
                Ok(reread(f))
            })
            .await
            .map_err(std::io::Error::other)??,
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        };
        self.take_reread(loaded).await;
        Ok(Some(HostLock {
            _file: file,
            _local: local,
        }))
    }

    /// Make what [`Self::host_lock`] reread the in-memory state (keeping
    /// this boot's id); a file that could not be read leaves it as it is.
    async fn take_reread(&self, loaded: Result<Reread, CheckpointError>) {
        let body = match loaded {
            Ok(Reread::Unchanged(body)) => Some(body),
            Ok(Reread::Changed(bytes, c)) => {
                self.remember(bytes, &c.body, Source::Read);
                Some(c.body)
            }
            Ok(Reread::Missing) => None,
            Err(e) => {
                tracing::warn!(error = %e, "reloading checkpoint under the host lock failed; keeping in-memory state");
                None
            }
        };
        if let Some(body) = body {
            let mut st = self.state.lock().await;
            let boot_id = std::mem::take(&mut st.boot_id);
            *st = CheckpointBody { boot_id, ..body };
        }
    }

    /// [`Self::host_lock`] for a claim's operation: a failure is that claim's error.
    pub(super) async fn host_lock_for_claim(&self) -> Result<Option<HostLock>, ClaimError> {
        self.host_lock()
            .await
            .map_err(|source| ClaimError::host_lock(self.config.checkpoint_path.clone(), source))
    }

    /// Forget a claim whose prepare failed after the hardware step began:
    /// drop its record and the compute modes no share uses any more, and
    /// write the checkpoint (an error is logged: the prepare's error is what
    /// the kubelet sees, and recovery sweeps what stays).
    pub(super) async fn forget_failed(&self, claim: &ClaimRef) {
        let mut st = self.state.lock().await;
        st.claims.remove(&claim.uid);
        prune_compute_modes(&mut st);
        // Limits the rollback cleared are forgotten; one still set (its
        // clear failed) stays recorded for recovery to clear.
        if let Some(m) = &self.config.mps {
            let root = m.config.cgroup_root.clone();
            st.memory_limits_set_by_plugin
                .retain(|l| l.claim_uid != claim.uid || !crate::mps::memory_cleared(&root, l));
        }
        if let Err(e) = self.persist(&st).await {
            tracing::error!(claim.uid = %claim.uid, error = %e, "checkpoint after rollback");
        }
    }

    /// Write recovery's checkpoint and make it the in-memory state: always
    /// durable, since it may replace a file of an earlier boot.
    pub(super) async fn store_recovered(
        &self,
        body: CheckpointBody,
    ) -> Result<(), CheckpointError> {
        let path = &self.config.checkpoint_path;
        let bytes: Arc<[u8]> = checkpoint::encode_body(&body, path)?.into();
        checkpoint::store_bytes(&bytes, path, true, self.config.write_fault)?;
        self.written(bytes, &body);
        *self.state.lock().await = body;
        Ok(())
    }
}

/// Open (creating) the host lock's file. Its directory is made when the
/// file cannot be (the first time, or after an administrator removed it),
/// not on every call.
fn open_lock_file(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
    };
    match open() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            open()
        }
        r => r,
    }
}

/// The checkpoint at `cp`, parsed only when its bytes are not `known` (the
/// bytes this process last wrote or read, with their body).
fn reread(
    cp: &std::path::Path,
    known: Option<(Arc<[u8]>, CheckpointBody)>,
) -> Result<Reread, CheckpointError> {
    match checkpoint::read_bytes(cp)? {
        Some(bytes) => match known {
            Some((k, body)) if *k == *bytes => Ok(Reread::Unchanged(body)),
            _ => Checkpoint::decode(cp, &bytes).map(|c| Reread::Changed(bytes.into(), Box::new(c))),
        },
        None => Ok(Reread::Missing),
    }
}

/// Forget compute modes carve set on units that no prepared share uses any
/// more (their daemons are gone; [`crate::mps::detach`] restored them).
pub(super) fn prune_compute_modes(st: &mut CheckpointBody) {
    let used: BTreeSet<String> = st
        .claims
        .values()
        .flat_map(|c| c.devices.iter())
        .filter_map(|d| match &d.kind {
            PreparedKind::Mps { .. } => Some(d.gpu_uuid.clone()),
            PreparedKind::Mig {
                mps: Some(_),
                mig_uuid,
                ..
            } => mig_uuid.clone(),
            _ => None,
        })
        .collect();
    st.compute_mode_set_by_plugin.retain(|u| used.contains(u));
}
