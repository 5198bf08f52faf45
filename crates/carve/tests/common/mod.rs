//! What the carve crate's command tests share: running the built `carve`
//! binary as a user runs it, and writing the files they hand it.

#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// What one run of the binary gave.
pub struct Run {
    /// Exit status; -1 when a signal ended it.
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    fn of(out: &Output) -> Run {
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    /// Exit status, stdout and stderr, for a failed assertion.
    pub fn context(&self) -> String {
        format!(
            "exit {}\nstdout:\n{}\nstderr:\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// `carve ARGS` in this process's environment.
pub fn carve(args: &[&str]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(args)
        .output()
        .expect("running the carve binary");
    Run::of(&out)
}

/// `carve ARGS` with a `TMPDIR` of its own (removed after the run) and none
/// of the simulator's configuration variables inherited.
pub fn carve_isolated(args: &[&str]) -> Run {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(args)
        .env("TMPDIR", tmp.path())
        .env_remove("CARVE_NVML_SIM_CONFIG")
        .env_remove("CARVE_NVML_SIM_FAULTS")
        .output()
        .expect("running the carve binary");
    Run::of(&out)
}

/// Write `text` to `dir/name`; its path.
pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}
