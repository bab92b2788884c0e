#![no_main]
//! `cargo fuzz run config_router`: see fuzz/src (the checks) and docs/FUZZING.md.
use libfuzzer_sys::{Corpus, fuzz_target};

fuzz_target!(|data: &[u8]| -> Corpus {
    if mmrouter_fuzz::run_named("config_router", data) {
        Corpus::Keep
    } else {
        Corpus::Reject
    }
});
