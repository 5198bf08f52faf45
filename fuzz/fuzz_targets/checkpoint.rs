#![no_main]
//! See `carve_plugin::fuzzing::checkpoint`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| carve_plugin::fuzzing::checkpoint(data));
