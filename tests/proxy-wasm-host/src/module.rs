//! [`WasmModule`]: a compiled `.wasm`, compiled once per process and cached on disk.

use crate::error::HostError;
use crate::host::lock;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The engine shared by every module of this process (a `Module` belongs to one engine).
pub(crate) fn engine() -> &'static wasmtime::Engine {
    static ENGINE: OnceLock<wasmtime::Engine> = OnceLock::new();
    ENGINE.get_or_init(wasmtime::Engine::default)
}

/// A compiled module. [`WasmModule::load`] compiles each path once per process and then hands
/// out clones (cheap: the compiled code is shared).
#[derive(Clone)]
pub struct WasmModule {
    pub(crate) module: wasmtime::Module,
    name: String,
}

impl fmt::Debug for WasmModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WasmModule")
            .field("name", &self.name)
            .finish()
    }
}

impl WasmModule {
    /// Compiles `path`, or returns the module compiled earlier from the same path.
    pub fn load(path: impl AsRef<Path>) -> Result<WasmModule, HostError> {
        static CACHE: OnceLock<Mutex<HashMap<PathBuf, WasmModule>>> = OnceLock::new();
        let path = path.as_ref();
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
        if let Some(m) = lock(cache).get(&key) {
            return Ok(m.clone());
        }
        let bytes = std::fs::read(path).map_err(|e| HostError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let name = path.display().to_string();
        let module = match compiled_cache_path(path, &bytes) {
            Some(cwasm) => load_or_compile_cached(&name, &bytes, &cwasm)?,
            None => WasmModule::from_bytes(&name, &bytes)?,
        };
        lock(cache).insert(key, module.clone());
        Ok(module)
    }

    /// Compiles a module from bytes (not cached).
    pub fn from_bytes(name: &str, bytes: &[u8]) -> Result<WasmModule, HostError> {
        let module = wasmtime::Module::new(engine(), bytes).map_err(|e| HostError::Load {
            path: name.to_string(),
            message: format!("{e:#}"),
        })?;
        Ok(WasmModule {
            module,
            name: name.to_string(),
        })
    }

    /// The module's imports as `module::name`, for diagnostics.
    pub fn imports(&self) -> Vec<String> {
        self.module
            .imports()
            .map(|i| format!("{}::{}", i.module(), i.name()))
            .collect()
    }

    /// The module's exports.
    pub fn exports(&self) -> Vec<String> {
        self.module
            .exports()
            .map(|e| e.name().to_string())
            .collect()
    }
}

/// Where [`WasmModule::load`] keeps the compiled code of `wasm`: beside it, named after the
/// xxh3-128 of its bytes and the engine's compatibility hash, so a changed module or another
/// wasmtime never reads a stale file. `None` (no disk cache) when the environment variable
/// `PROXY_HOST_NO_CACHE` is set.
fn compiled_cache_path(wasm: &Path, bytes: &[u8]) -> Option<PathBuf> {
    use std::hash::{Hash, Hasher};
    if std::env::var_os("PROXY_HOST_NO_CACHE").is_some() {
        return None;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    engine().precompile_compatibility_hash().hash(&mut h);
    let engine_hash = h.finish();
    let wasm_hash = xxhash_rust::xxh3::xxh3_128(bytes);
    let file = wasm.file_name()?.to_string_lossy().into_owned();
    Some(wasm.with_file_name(format!("{file}.{wasm_hash:032x}.{engine_hash:016x}.cwasm")))
}

/// Compiling a filter with a debug build of Cranelift takes tens of seconds; the compiled
/// code is reused across test runs through `cwasm`.
fn load_or_compile_cached(name: &str, bytes: &[u8], cwasm: &Path) -> Result<WasmModule, HostError> {
    if cwasm.exists() {
        // SAFETY: `cwasm` is only ever written below, by `Module::serialize` of this same
        // engine configuration, under a name that carries the hash of the source bytes and of
        // the engine's compatibility settings; wasmtime re-checks its header on load.
        let loaded = unsafe { wasmtime::Module::deserialize_file(engine(), cwasm) };
        if let Ok(module) = loaded {
            return Ok(WasmModule {
                module,
                name: name.to_string(),
            });
        }
    }
    let module = WasmModule::from_bytes(name, bytes)?;
    if let Ok(serialized) = module.module.serialize() {
        // Write-then-rename so a concurrent reader never sees half a file; failures only
        // cost the next run a compile.
        let tmp = cwasm.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, serialized).is_ok() {
            let _ = std::fs::rename(&tmp, cwasm);
        }
    }
    Ok(module)
}
