#![no_main]
//! See `carve_plugin::fuzzing::claim_json`.

libfuzzer_sys::fuzz_target!(|data: &[u8]| carve_plugin::fuzzing::claim_json(data));
