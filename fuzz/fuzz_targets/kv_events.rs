#![no_main]
//! `cargo fuzz run kv_events`: see fuzz/src (the checks) and docs/FUZZING.md.
use libfuzzer_sys::{Corpus, fuzz_target};

fuzz_target!(|data: &[u8]| -> Corpus {
    if mmrouter_fuzz::run_named("kv_events", data) {
        Corpus::Keep
    } else {
        Corpus::Reject
    }
});
