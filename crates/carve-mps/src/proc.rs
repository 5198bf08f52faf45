//! Process helpers: liveness and start time from `/proc`, signals through
//! `kill(2)` (nix) to a recorded process identity, commands with a deadline,
//! bounded waits on files.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// Poll interval of the bounded waits.
const POLL: Duration = Duration::from_millis(5);

/// State letter and start time (clock ticks since boot, field 22 of
/// `/proc/<pid>/stat`) of a process; `None` if there is no such process.
pub(crate) fn stat(pid: u32) -> Option<(char, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `comm` may contain spaces and parentheses: fields start after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let state = f.first()?.chars().next()?;
    let start = f.get(19)?.parse().ok()?;
    Some((state, start))
}

/// Whether `pid` runs and is the process that started at `start_time`
/// (not a zombie, not a recycled pid).
pub(crate) fn alive(pid: u32, start_time: u64) -> bool {
    matches!(stat(pid), Some((s, t)) if s != 'Z' && s != 'X' && t == start_time)
}

/// Wait until `f` holds or `timeout` passes; whether it held.
pub(crate) fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(POLL);
    }
}

/// What a finished command returned.
#[derive(Debug)]
pub(crate) struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    /// Start time of the command's process (as [`stat`]); what it forks
    /// starts no earlier.
    pub started: Option<u64>,
}

/// Run `cmd` with `stdin` as its input; kill it after `timeout`.
///
/// # Errors
/// Spawn failure (as text), or `"timed out"`.
pub(crate) fn run(mut cmd: Command, stdin: &str, timeout: Duration) -> Result<Output, String> {
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // ETXTBSY: the binary was just written and another thread's fork still
    // holds it open for writing (tests write wrapper scripts); it clears at
    // that child's exec, so retry briefly.
    let mut tries = 0;
    let mut child = loop {
        match cmd.spawn() {
            Ok(c) => break c,
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 20 => {
                tries += 1;
                thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(format!("spawn: {e}")),
        }
    };
    let started = stat(child.id()).map(|(_, t)| t);
    if let Some(mut w) = child.stdin.take() {
        // A command that exits without reading gives EPIPE; its status says more.
        let _ = w.write_all(stdin.as_bytes());
    }
    let pipe = |r: Option<Box<dyn Read + Send>>| {
        thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = pipe(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = pipe(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < deadline => thread::sleep(POLL),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("timed out after {} ms", timeout.as_millis()));
            }
            Err(e) => return Err(format!("wait: {e}")),
        }
    };
    Ok(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
        started,
    })
}

/// Why [`kill`] sent nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SignalRefused {
    /// 0, 1, carve itself or beyond `pid_t`: `kill(2)` would reach a process
    /// group, init or carve.
    #[error("pid {0} is not a process carve may signal")]
    NotAProcess(u32),
    /// No process with that pid started at the recorded time: it exited and
    /// the pid may belong to another process now.
    #[error("pid {pid} is not the process carve recorded (start time {start_time}): not signalled")]
    NotTheRecorded {
        /// The pid.
        pid: u32,
        /// The recorded start time.
        start_time: u64,
    },
    /// `kill(2)` failed.
    #[error("kill({pid}, SIGKILL): {errno}")]
    Failed {
        /// The pid.
        pid: u32,
        /// What the kernel said.
        errno: nix::errno::Errno,
    },
}

/// Send SIGKILL to the process carve recorded as `pid` started at
/// `start_time` (`/proc/<pid>/stat` field 22), through `kill(2)` (nix): no
/// `kill` binary on `PATH` is needed (the distroless image has none). A pid
/// that no longer runs with that start time (exited, recycled) is refused, as
/// are pids 0 and 1, negative `pid_t` (process groups) and carve's own.
///
/// # Errors
/// [`SignalRefused`].
pub(crate) fn kill(pid: u32, start_time: u64) -> Result<(), SignalRefused> {
    let raw = i32::try_from(pid).map_err(|_| SignalRefused::NotAProcess(pid))?;
    if raw <= 1 || pid == std::process::id() {
        return Err(SignalRefused::NotAProcess(pid));
    }
    if !alive(pid, start_time) {
        return Err(SignalRefused::NotTheRecorded { pid, start_time });
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(raw),
        nix::sys::signal::Signal::SIGKILL,
    )
    .map_err(|errno| SignalRefused::Failed { pid, errno })
}

/// Whether `path` is an executable regular file.
pub(crate) fn executable(path: &Path) -> Result<(), &'static str> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::metadata(path) {
        Err(_) => Err("does not exist"),
        Ok(m) if !m.is_file() => Err("is not a file"),
        Ok(m) if m.permissions().mode() & 0o111 == 0 => Err("is not executable"),
        Ok(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt as _;

    #[test]
    fn kill_signals_only_the_recorded_process_through_kill_2() {
        let mut child = Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        let (_, start) = stat(pid).unwrap();
        // Another start time: a recycled pid, not the process carve started.
        assert_eq!(
            kill(pid, start + 1),
            Err(SignalRefused::NotTheRecorded {
                pid,
                start_time: start + 1
            })
        );
        assert!(alive(pid, start));
        for p in [0, 1, std::process::id(), u32::MAX] {
            assert_eq!(kill(p, start), Err(SignalRefused::NotAProcess(p)));
        }
        kill(pid, start).unwrap();
        assert_eq!(child.wait().unwrap().signal(), Some(9));
        // Gone: nothing to signal.
        assert!(matches!(
            kill(pid, start),
            Err(SignalRefused::NotTheRecorded { .. })
        ));
    }
}
