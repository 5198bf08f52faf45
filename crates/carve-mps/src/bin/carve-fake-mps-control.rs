//! `carve-fake-mps-control`: the test stand-in for `nvidia-cuda-mps-control`
//! ([`carve_mps::fake`]), as a binary of its own for the tests of this crate.
//! Run through a link named `nvidia-smi` it is the `nvidia-smi memory-limits`
//! double ([`carve_mps::fake_smi`]).
//! Run as `carve-fake-mps-control --carve-mps-exec …` it is the MPS
//! launcher instead ([`carve_mps::launcher::exec_main`]), as the `carve` binary is
//! in the plugin, so tests can use it as [`carve_mps::MpsConfig::shm_launcher`].

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut all = std::env::args_os();
    let argv0 = all.next().unwrap_or_default();
    let args: Vec<std::ffi::OsString> = all.collect();
    // Run through a link named `nvidia-smi`: the memory-limits double.
    if carve_mps::fake_smi::invoked_as(&argv0) {
        return carve_mps::fake_smi::main(&argv0, &args);
    }
    carve_mps::fake::main(&args)
}
