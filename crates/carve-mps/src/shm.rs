//! The `/dev/shm` an MPS server shares with its clients.
//!
//! An MPS server and its clients meet in `/dev/shm` as well as in the pipe
//! directory: a running MPS client needs a small `cuda.shm.<uid>.<n>.1` file
//! there, at that fixed path (reported in NVIDIA/k8s-device-plugin issue
//! #467). NVIDIA's drivers therefore give the control daemon and every
//! client container the same tmpfs as `/dev/shm`:
//! - NVIDIA's DRA driver (`k8s-dra-driver-gpu`,
//!   `cmd/gpu-kubelet-plugin/sharing.go`) mounts a tmpfs per control daemon
//!   at `<mps root>/<id>/shm` (`mount -t tmpfs shm <dir> -o
//!   rw,nosuid,nodev,noexec,relatime,size=<half of MemTotal>`, 65536k when
//!   `/proc/meminfo` is unreadable), mounts it as the daemon pod's `/dev/shm`,
//!   and gives each claim's containers a CDI bind mount of it at `/dev/shm`
//!   (options `rw,nosuid,nodev,bind`); it unmounts and removes it when the
//!   daemon stops. Its daemon is per claim, so the tmpfs is too.
//! - NVIDIA's device plugin makes one such tmpfs (`/run/nvidia/mps/shm`) for
//!   its daemon and mounts it as `/dev/shm` in every pod sharing the GPU.
//!
//! carve runs one control daemon per shared unit (a whole GPU or a MIG
//! instance), serving every claim share on it, and the server it starts
//! reads the daemon's `/dev/shm`. So the tmpfs is per unit, like NVIDIA's is
//! per daemon: `<unit dir>/shm`, mounted before the daemon starts, given to
//! the daemon as its `/dev/shm` (the daemon runs in a mount namespace of its
//! own, see [`crate::launcher`]), bind-mounted at `/dev/shm` into every share's
//! containers ([`crate::cdi`]), and unmounted and removed when the daemon
//! stops. The cost: the pods of different claims on one unit see each
//! other's POSIX shared memory (their `/dev/shm` is the unit's), as pods
//! sharing a GPU under NVIDIA's device plugin do. A per-claim directory the
//! server does not see would not let a client reach the server.
//!
//! The mounts need `CAP_SYS_ADMIN` (the plugin runs privileged for MPS), and
//! the unit directory must reach the host through a `Bidirectional` mount of
//! the MPS root, so that the container runtime bind-mounts the tmpfs and not
//! the empty directory below it (NVIDIA mounts its MPS root so as well).

use std::path::Path;

use nix::mount::{MntFlags, MsFlags};

use crate::error::{MpsError, io};

/// The unit's tmpfs directory, under the unit directory.
pub const SHM_DIR: &str = "shm";
pub use crate::launcher::{EXEC_FLAG, exec_main};
/// Where the daemon and the clients see the tmpfs.
pub const DEV_SHM: &str = "/dev/shm";
/// NVIDIA DRA driver's size when `/proc/meminfo` cannot be read (`sharing.go`).
const FALLBACK_SIZE: &str = "65536k";

/// `size=` of the tmpfs: half of `MemTotal` (`/proc/meminfo`), as NVIDIA's
/// DRA driver sizes it (`getDefaultShmSize`); tmpfs takes memory only as used.
#[must_use]
pub fn tmpfs_size(meminfo: &str) -> String {
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|rest| {
            let mut w = rest.split_whitespace();
            let kib: u64 = w.next()?.parse().ok()?;
            // `/proc/meminfo` gives kB; tmpfs reads a `k` suffix as KiB.
            (w.next() == Some("kB")).then(|| format!("{}k", kib / 2))
        })
        .unwrap_or_else(|| FALLBACK_SIZE.to_string())
}

/// Undo the octal escapes of a `/proc/self/mountinfo` path (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 4])
                .ok()
                .and_then(|t| u8::from_str_radix(t, 8).ok())
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The filesystem type mounted at `dir` in this process's mount namespace
/// (the last mount there wins), from `/proc/self/mountinfo`.
#[must_use]
pub fn mounted_fs(dir: &Path) -> Option<String> {
    let dir = std::fs::canonicalize(dir).ok()?;
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut found = None;
    for line in text.lines() {
        // `<id> <parent> <maj:min> <root> <mount point> <opts> [tags…] - <fstype> …`
        let mut f = line.split(' ');
        let Some(point) = f.nth(4) else { continue };
        let Some((_, after)) = line.split_once(" - ") else {
            continue;
        };
        if Path::new(&unescape(point)) == dir {
            found = after.split(' ').next().map(str::to_string);
        }
    }
    found
}

/// Mount the unit's tmpfs at `dir` (created, mode 0755 as NVIDIA's is) with
/// NVIDIA's options; a tmpfs already mounted there (a daemon adopted or
/// restarted) is kept.
///
/// # Errors
/// The directory cannot be made, or the mount fails (without `CAP_SYS_ADMIN`).
pub(crate) fn mount(dir: &Path) -> Result<(), MpsError> {
    std::fs::create_dir_all(dir).map_err(io("create directory", dir))?;
    if mounted_fs(dir).as_deref() == Some("tmpfs") {
        return Ok(());
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let data = format!("size={}", tmpfs_size(&meminfo));
    nix::mount::mount(
        Some("shm"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC | MsFlags::MS_RELATIME,
        Some(data.as_str()),
    )
    .map_err(|e| MpsError::Io {
        op: "mount a tmpfs (rw,nosuid,nodev,noexec,relatime; needs CAP_SYS_ADMIN) on",
        path: dir.to_path_buf(),
        source: e.into(),
    })
}

/// Unmount the unit's tmpfs (every mount stacked at `dir`) and remove the
/// directory. Nothing there is fine.
///
/// # Errors
/// The unmount or the removal fails.
pub(crate) fn unmount(dir: &Path) -> Result<(), MpsError> {
    if !dir.exists() {
        return Ok(());
    }
    while mounted_fs(dir).is_some() {
        nix::mount::umount2(dir, MntFlags::MNT_DETACH).map_err(|e| MpsError::Io {
            op: "unmount",
            path: dir.to_path_buf(),
            source: e.into(),
        })?;
    }
    std::fs::remove_dir(dir).map_err(io("remove directory", dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_is_half_of_memtotal_or_nvidias_fallback() {
        assert_eq!(
            tmpfs_size("MemTotal:       49367168 kB\nMemFree: 1 kB\n"),
            "24683584k"
        );
        assert_eq!(tmpfs_size(""), "65536k");
        assert_eq!(tmpfs_size("MemTotal: lots\n"), "65536k");
        assert_eq!(tmpfs_size("MemTotal: 100 MB\n"), "65536k");
    }

    #[test]
    fn mountinfo_paths_are_unescaped() {
        assert_eq!(unescape("/a\\040b/c"), "/a b/c");
        assert_eq!(unescape("/plain"), "/plain");
        assert_eq!(unescape("/end\\"), "/end\\");
    }

    #[test]
    fn dev_shm_and_root_are_seen_as_mounts() {
        assert!(mounted_fs(Path::new("/")).is_some());
        let d = tempfile::tempdir().unwrap();
        assert_eq!(mounted_fs(d.path()), None);
    }
}
