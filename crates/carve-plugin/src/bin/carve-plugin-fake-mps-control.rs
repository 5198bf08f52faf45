//! The test stand-in for `nvidia-cuda-mps-control` ([`carve_mps::fake`]) as a
//! binary of this crate, so the plugin's integration tests can start it
//! (`CARGO_BIN_EXE_…` names only a package's own binaries). Built only with
//! the `testing` feature. Run through a link named `nvidia-smi` it is the
//! `nvidia-smi memory-limits` double ([`carve_mps::fake_smi`]).

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
