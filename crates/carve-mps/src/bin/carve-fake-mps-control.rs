//! `carve-fake-mps-control`: the test stand-in for `nvidia-cuda-mps-control`
//! ([`carve_mps::fake`]), as a binary of its own for the tests of this crate.
//! Run as `carve-fake-mps-control --carve-mps-exec …` it is the MPS
//! launcher instead ([`carve_mps::launcher::exec_main`]), as the `carve` binary is
//! in the plugin, so tests can use it as [`carve_mps::MpsConfig::shm_launcher`].

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    carve_mps::fake::main(&args)
}
