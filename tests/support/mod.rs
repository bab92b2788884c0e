//! Test support for the tests of the real filter `.wasm`: the test command builds it.

#![allow(dead_code)]

use proxy_wasm_host::{HostError, WasmBuild, WasmModule};
use std::path::PathBuf;
use std::sync::OnceLock;

/// Builds the filter (`cargo build --profile wasm --target wasm32-wasip1 --features filter
/// --lib`) into `<CARGO_TARGET_DIR or target>/filter-wasm` — a target dir of its own, so this
/// nested cargo never waits for the lock held by the cargo running the tests — once per test
/// binary, and returns the `.wasm` path.
pub fn filter_wasm() -> Result<PathBuf, HostError> {
    static BUILT: OnceLock<Result<PathBuf, HostError>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            WasmBuild::new(env!("CARGO_MANIFEST_DIR"), "mmrouter")
                .feature("filter")
                .profile("wasm")
                .target("wasm32-wasip1")
                .run()
        })
        .clone()
}

/// The compiled filter module (compiled once per test binary).
pub fn filter_module() -> WasmModule {
    let path = filter_wasm().unwrap_or_else(|e| panic!("{e}"));
    WasmModule::load(&path).unwrap_or_else(|e| panic!("{e}"))
}
