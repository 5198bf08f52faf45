//! Process helpers without `libc`: liveness and start time from `/proc`,
//! commands with a deadline, bounded waits on files.

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
    })
}

/// Send SIGKILL to `pid` through `kill(1)` (no `libc` in this crate).
pub(crate) fn kill(pid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
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
