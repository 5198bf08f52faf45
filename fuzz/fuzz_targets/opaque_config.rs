#![no_main]
//! See `carve_plugin::fuzzing::opaque_config`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| carve_plugin::fuzzing::opaque_config(data));
