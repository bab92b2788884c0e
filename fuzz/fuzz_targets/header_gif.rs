#![no_main]
//! `cargo fuzz run header_gif`: see fuzz/src (the checks) and docs/FUZZING.md.
use libfuzzer_sys::{Corpus, fuzz_target};

fuzz_target!(|data: &[u8]| -> Corpus {
    if mmrouter_fuzz::run_named("header_gif", data) {
        Corpus::Keep
    } else {
        Corpus::Reject
    }
});
