//! The test stand-in for `nvidia-cuda-mps-control` ([`carve_mps::fake`]) as a
//! binary of this crate, so the plugin's integration tests can start it
//! (`CARGO_BIN_EXE_…` names only a package's own binaries). Built only with
//! the `testing` feature.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    carve_mps::fake::main(&args)
}
