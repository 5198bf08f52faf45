#![no_main]
//! See `carve_plugin::fuzzing::cdi_spec`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| carve_plugin::fuzzing::cdi_spec(data));
