#![no_main]
//! See `carve_plugin::fuzzing::kubelet_claim`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| carve_plugin::fuzzing::kubelet_claim(data));
