//! Where an MPS control daemon runs: a cgroup of its own per unit, outside
//! the plugin container's, so that ending the container does not end it.
//!
//! A container runtime stops a container by killing every process in its
//! cgroup (runc: `cgroup.kill` on cgroup v2 where the kernel has it, else a
//! signal to each pid the cgroup lists, with the v1 freezer), and the kernel
//! ends every process of a PID namespace when its init exits. A daemon
//! forked by the plugin inherits both, so a container restart or a rolling
//! update of the plugin would take every unit's daemon, and MPS for every
//! running share, with it. With [`crate::MpsConfig::daemon_cgroup`] set, the
//! launcher ([`crate::launcher`]) moves itself, before it execs the control
//! binary, into `<cgroup root>/<daemon cgroup>/<unit>` of every hierarchy
//! ([`hierarchies`]), and into a session of its own (so the plugin's process
//! group and terminal signals do not reach it either); the daemon and the
//! servers it forks stay there. The PID namespace is the deployment's part:
//! the plugin must run in the host's (`hostPID: true`), as it must to adopt
//! the daemons by pid after a restart anyway.
//!
//! The unit's cgroup directories are made before the daemon starts, recorded
//! in its [`crate::DaemonIdentity`], and removed when it stops or when a
//! start fails. The cost: a daemon there is outside the plugin pod's CPU and
//! memory accounting and limits.

use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use crate::error::MpsError;
use crate::proc;

/// The file a pid is written to, to move the process into a cgroup (v1 and v2).
pub const PROCS: &str = "cgroup.procs";

/// The cgroup hierarchies mounted at `root`: `root` itself when it is one
/// (cgroup v2, or a single v1 hierarchy: it has `cgroup.procs`), else every
/// directory below it that is one (v1: one per controller, a named
/// `systemd` one, and in hybrid mode `unified`; links such as `cpu` to
/// `cpu,cpuacct` are skipped, they name a hierarchy already listed).
/// Sorted.
///
/// # Errors
/// [`MpsError::DaemonCgroup`] naming `root` when it cannot be read or holds
/// no hierarchy.
pub fn hierarchies(root: &Path, unit: &str) -> Result<Vec<PathBuf>, MpsError> {
    if root.join(PROCS).is_file() {
        return Ok(vec![root.to_path_buf()]);
    }
    let err = |op: &'static str, source: std::io::Error| MpsError::DaemonCgroup {
        unit: unit.to_string(),
        op,
        path: root.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for e in std::fs::read_dir(root).map_err(|e| err("read the cgroup root", e))? {
        let e = e.map_err(|e| err("read the cgroup root", e))?;
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && e.path().join(PROCS).is_file() {
            out.push(e.path());
        }
    }
    if out.is_empty() {
        return Err(err(
            "find a cgroup hierarchy (a cgroup.procs file) at or below",
            std::io::Error::new(std::io::ErrorKind::NotFound, "none mounted there"),
        ));
    }
    out.sort();
    Ok(out)
}

/// Whether `dir` can name a cgroup below the root: relative, not empty,
/// only plain names between single slashes (no `..`, no `.`, which `Path`
/// would drop silently in the middle, no `//`, no trailing `/`).
#[must_use]
pub fn valid_dir(dir: &Path) -> bool {
    dir.to_str().is_some_and(|s| {
        s.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
            && dir.components().all(|c| matches!(c, Component::Normal(_)))
    })
}

/// The unit's cgroup in every hierarchy at `root`: `<hierarchy>/<dir>/<unit>`.
///
/// # Errors
/// `dir` is not [`valid_dir`], or as [`hierarchies`].
pub(crate) fn unit_dirs(root: &Path, dir: &Path, unit: &str) -> Result<Vec<PathBuf>, MpsError> {
    if !valid_dir(dir) {
        return Err(MpsError::BadCgroupDir {
            path: dir.to_path_buf(),
        });
    }
    Ok(hierarchies(root, unit)?
        .into_iter()
        .map(|h| h.join(dir).join(unit))
        .collect())
}

/// Make the unit's cgroups (and the parents below each hierarchy's root).
/// On error, the ones made are removed again.
///
/// # Errors
/// [`MpsError::DaemonCgroup`] naming the unit and the directory.
pub(crate) fn create(unit: &str, dirs: &[PathBuf]) -> Result<(), MpsError> {
    for (i, d) in dirs.iter().enumerate() {
        let made = std::fs::create_dir_all(d)
            .map_err(|e| ("create the MPS daemon cgroup", e))
            .and_then(|()| fill_cpuset(d).map_err(|e| ("give the MPS daemon cgroup its parent's CPUs and memory nodes (cgroup v1 cpuset)", e)));
        if let Err((op, source)) = made {
            let _ = remove(unit, &dirs[..=i], Duration::ZERO);
            return Err(MpsError::DaemonCgroup {
                unit: unit.to_string(),
                op,
                path: d.clone(),
                source,
            });
        }
    }
    Ok(())
}

/// cgroup v1's cpuset controller refuses a process in a cgroup whose
/// `cpuset.cpus` or `cpuset.mems` is empty (the write to `cgroup.procs`
/// fails with `ENOSPC`), and a new cgroup starts with both empty unless its
/// parent has `cgroup.clone_children` set (kernel
/// `Documentation/admin-guide/cgroup-v1/cpusets.rst`). So each empty level
/// from `d` up gets its parent's values, top-down, as runc and systemd do.
/// A directory without `cpuset.cpus` (another controller, or cgroup v2
/// without cpuset) is left alone; on v2 an empty value means "the parent's"
/// and copying it changes nothing.
fn fill_cpuset(d: &Path) -> std::io::Result<()> {
    const FILES: [&str; 2] = ["cpuset.cpus", "cpuset.mems"];
    let empty = |p: &Path| -> std::io::Result<bool> {
        for f in FILES {
            if std::fs::read_to_string(p.join(f))?.trim().is_empty() {
                return Ok(true);
            }
        }
        Ok(false)
    };
    let mut chain = Vec::new();
    let mut at = d;
    while at.join(FILES[0]).is_file() && empty(at)? {
        chain.push(at);
        match at.parent() {
            Some(p) => at = p,
            None => return Ok(()),
        }
    }
    if !at.join(FILES[0]).is_file() {
        return Ok(());
    }
    for c in chain.into_iter().rev() {
        let parent = c.parent().unwrap_or(c);
        for f in FILES {
            if std::fs::read_to_string(c.join(f))?.trim().is_empty() {
                std::fs::write(c.join(f), std::fs::read_to_string(parent.join(f))?.trim())?;
            }
        }
    }
    Ok(())
}

/// Remove the unit's cgroups (not their parents, which other units share).
/// A cgroup still listing processes (a daemon's last server exiting) is
/// retried until `timeout`. Missing ones are fine.
///
/// # Errors
/// [`MpsError::DaemonCgroup`] naming the unit and the directory that stays.
pub(crate) fn remove(unit: &str, dirs: &[PathBuf], timeout: Duration) -> Result<(), MpsError> {
    for d in dirs {
        let mut last = None;
        let gone = proc::wait_until(timeout, || match std::fs::remove_dir(d) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
            Err(e) => {
                last = Some(e);
                false
            }
        });
        if !gone {
            return Err(MpsError::DaemonCgroup {
                unit: unit.to_string(),
                op: "remove the MPS daemon cgroup",
                path: d.clone(),
                source: last.unwrap_or_else(|| std::io::Error::other("still there")),
            });
        }
    }
    Ok(())
}

/// Launcher side: move this process into each cgroup (its pid into `cgroup.procs`).
///
/// # Errors
/// Which cgroup refused, and why (text: the launcher prints it, and the
/// plugin reports it as the failed start of the unit).
pub(crate) fn join(dirs: &[PathBuf]) -> Result<(), String> {
    let pid = std::process::id().to_string();
    for d in dirs {
        let f = d.join(PROCS);
        std::fs::write(&f, &pid).map_err(|e| format!("write pid {pid} to {}: {e}", f.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On this kernel's real cgroup v1 cpuset hierarchy (root only, where
    /// one is mounted): a unit's new cgroup gets its parent's CPUs and memory
    /// nodes, so a process can join it; the dirs go again.
    #[test]
    fn a_v1_cpuset_cgroup_gets_its_parents_cpus_so_a_process_can_join() {
        let h = Path::new("/sys/fs/cgroup/cpuset");
        let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|r| r.split_whitespace().nth(1))
                == Some("0")
        });
        if !root || !h.join("cpuset.cpus").is_file() {
            eprintln!(
                "skipped: needs root and a cgroup v1 cpuset hierarchy at {}",
                h.display()
            );
            return;
        }
        let top = h.join(format!("carve-test-{}", std::process::id()));
        let d = top.join("gpu-0-mps");
        let made = create("gpu-0-mps", std::slice::from_ref(&d));
        let got: Vec<(String, String)> = ["cpuset.cpus", "cpuset.mems"]
            .iter()
            .map(|f| {
                let read = |p: &Path| std::fs::read_to_string(p.join(f)).unwrap_or_default();
                (read(h).trim().to_string(), read(&d).trim().to_string())
            })
            .collect();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let joined = std::fs::write(d.join(PROCS), child.id().to_string());
        let _ = child.kill();
        let _ = child.wait();
        let removed = remove(
            "gpu-0-mps",
            std::slice::from_ref(&d),
            Duration::from_secs(5),
        );
        let _ = std::fs::remove_dir(&top);
        made.unwrap();
        for (parent, child) in got {
            assert_eq!(child, parent);
        }
        joined.unwrap();
        removed.unwrap();
        assert!(!top.exists());
    }

    #[test]
    fn a_v2_root_is_one_hierarchy() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(PROCS), "").unwrap();
        std::fs::create_dir(d.path().join("x")).unwrap();
        std::fs::write(d.path().join("x").join(PROCS), "").unwrap();
        assert_eq!(hierarchies(d.path(), "u").unwrap(), [d.path()]);
        assert_eq!(
            unit_dirs(d.path(), Path::new("carve-mps"), "gpu-0-mps").unwrap(),
            [d.path().join("carve-mps/gpu-0-mps")]
        );
    }

    #[test]
    fn a_v1_root_lists_each_mounted_hierarchy_once() {
        let d = tempfile::tempdir().unwrap();
        for h in ["cpu,cpuacct", "memory", "systemd", "unified"] {
            std::fs::create_dir(d.path().join(h)).unwrap();
            std::fs::write(d.path().join(h).join(PROCS), "").unwrap();
        }
        std::os::unix::fs::symlink("cpu,cpuacct", d.path().join("cpu")).unwrap();
        // An empty mount point (a controller not mounted) is no hierarchy.
        std::fs::create_dir(d.path().join("rdma")).unwrap();
        let got = hierarchies(d.path(), "u").unwrap();
        let names: Vec<_> = got
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap())
            .collect();
        assert_eq!(names, ["cpu,cpuacct", "memory", "systemd", "unified"]);
    }

    #[test]
    fn no_hierarchy_and_bad_dirs_are_errors_naming_them() {
        let d = tempfile::tempdir().unwrap();
        let e = hierarchies(d.path(), "gpu-0-mps").unwrap_err();
        let t = e.to_string();
        assert!(
            t.contains("gpu-0-mps") && t.contains(&d.path().display().to_string()),
            "{t}"
        );
        let e = hierarchies(&d.path().join("missing"), "gpu-0-mps").unwrap_err();
        assert!(matches!(e, MpsError::DaemonCgroup { .. }), "{e}");
        for bad in ["", "/abs", "../up", "a/../b", "./a", "a/./b", "a//b", "a/"] {
            let e = unit_dirs(d.path(), Path::new(bad), "gpu-0-mps").unwrap_err();
            assert!(matches!(e, MpsError::BadCgroupDir { .. }), "{bad}: {e}");
        }
        assert!(valid_dir(Path::new("carve/mps")));
    }

    #[test]
    fn create_and_remove_leave_the_parent() {
        let d = tempfile::tempdir().unwrap();
        let dirs = [d.path().join("a/p/u"), d.path().join("b/p/u")];
        create("u", &dirs).unwrap();
        assert!(dirs.iter().all(|p| p.is_dir()));
        remove("u", &dirs, Duration::ZERO).unwrap();
        assert!(dirs.iter().all(|p| !p.exists()));
        assert!(d.path().join("a/p").is_dir());
        // Gone already: fine.
        remove("u", &dirs, Duration::ZERO).unwrap();
        // A directory that cannot go (here: not empty) is named.
        std::fs::create_dir_all(dirs[0].join("child")).unwrap();
        let e = remove("u", &dirs, Duration::from_millis(20)).unwrap_err();
        assert!(
            e.to_string().contains(&dirs[0].display().to_string()),
            "{e}"
        );
    }
}
