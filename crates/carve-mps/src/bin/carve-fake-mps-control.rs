//! `carve-fake-mps-control`: the test stand-in for `nvidia-cuda-mps-control`
//! ([`carve_mps::fake`]), as a binary of its own for the tests of this crate.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    carve_mps::fake::run(&args)
}
