#![no_main]
// The logic and its description are in tprun_rank::fuzzing::safetensors; stable tests replay this
// target's corpus through the same function.
libfuzzer_sys::fuzz_target!(|data: &[u8]| tprun_rank::fuzzing::safetensors(data));
