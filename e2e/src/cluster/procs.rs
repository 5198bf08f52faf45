//! The cluster's processes: each started in a process group of its own with
//! its output in a log file, stopped with SIGTERM and, after a grace period,
//! SIGKILL to its group.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::ClusterError;

/// A running component.
#[derive(Debug)]
pub struct Proc {
    /// Its name in errors and logs.
    pub name: String,
    /// Its output.
    pub log: PathBuf,
    child: Child,
}

impl Proc {
    /// Starts `cmd` with stdout and stderr appended to `log`.
    ///
    /// # Errors
    /// The log cannot be opened or the program cannot start.
    pub fn start(name: &str, mut cmd: Command, log: &Path) -> Result<Self, ClusterError> {
        use std::os::unix::process::CommandExt as _;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(ClusterError::io("opening", log))?;
        let err = out.try_clone().map_err(ClusterError::io("opening", log))?;
        cmd.stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let program = PathBuf::from(cmd.get_program());
        let child = cmd
            .spawn()
            .map_err(ClusterError::io("starting", &program))?;
        Ok(Proc {
            name: name.to_string(),
            log: log.to_path_buf(),
            child,
        })
    }

    /// The exit status, if it has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Its process id.
    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last `lines` lines of its log.
    #[must_use]
    pub fn tail(&self, lines: usize) -> String {
        tail(&self.log, lines)
    }

    /// SIGTERM to its group, then SIGKILL after `grace`; waits for it.
    pub fn stop(&mut self, grace: Duration) {
        self.signal_group(nix::sys::signal::Signal::SIGTERM);
        let start = Instant::now();
        while self.exited().is_none() && start.elapsed() < grace {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.signal_group(nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }

    /// SIGKILL to its group at once (a crash), and wait.
    pub fn kill(&mut self) {
        self.signal_group(nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
    }

    fn signal_group(&self, sig: nix::sys::signal::Signal) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), sig);
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.exited().is_none() {
            self.stop(Duration::from_secs(5));
        }
    }
}

/// The last `lines` lines of the file at `path` (empty if unreadable).
#[must_use]
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs `cmd` to completion; its stdout, or an error with its output.
///
/// # Errors
/// It cannot start or exits non-zero.
pub fn run(what: &str, mut cmd: Command) -> Result<String, ClusterError> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| ClusterError::Command {
            what: what.to_string(),
            output: format!("could not start {:?}: {e}", cmd.get_program()),
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(ClusterError::Command {
            what: format!("{what} ({})", out.status),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        })
    }
}
