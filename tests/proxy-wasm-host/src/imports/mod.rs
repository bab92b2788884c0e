//! The host functions a module imports: proxy-wasm ABI 0.2.1 (module `env`,
//! [`proxy_wasm`]) and the WASI preview1 subset that a proxy-wasm module built for
//! wasm32-wasip1 imports ([`wasi`]). Any other import the module declares is linked to a
//! function that traps with the import's name. Every call of a defined import is counted (see
//! [`HostCalls`](crate::HostCalls)).

mod memory;
mod proxy_wasm;
mod wasi;

use crate::vm::VmState;
use wasmtime::{Engine, Linker, Module, format_err};

/// Defines the host function `$module::$name` from a closure over the caller (always
/// `mut`) and the call's arguments, and counts each call under `$name` for the context the
/// call is made for ([`VmState::count_host_call`]). Taking the name once keeps the counted
/// name and the linked one the same.
macro_rules! host_fn {
    ($linker:expr, $module:expr, $name:literal,
     |$c:ident $(, $arg:ident: $ty:ty)* $(,)?| $(-> $ret:ty)? $body:block $(,)?) => {
        $linker.func_wrap(
            $module,
            $name,
            |mut $c: $crate::imports::memory::C<'_> $(, $arg: $ty)*| $(-> $ret)? {
                $c.data_mut().count_host_call($name);
                $body
            },
        )
    };
}
pub(crate) use host_fn;

/// The linker for `module`: every proxy-wasm and WASI function this host implements, and a
/// trapping stand-in for each other function the module imports.
pub(crate) fn linker(engine: &Engine, module: &Module) -> wasmtime::Result<Linker<VmState>> {
    let mut l: Linker<VmState> = Linker::new(engine);
    proxy_wasm::define(&mut l)?;
    wasi::define(&mut l)?;
    // Every other import traps loudly, naming itself.
    for import in module.imports() {
        if let wasmtime::ExternType::Func(ty) = import.ty() {
            let m = import.module().to_string();
            let n = import.name().to_string();
            let what = format!("{m}::{n}");
            // Errors here only mean "already defined by us".
            let _ = l.func_new(&m, &n, ty.clone(), move |_, _, _| {
                Err(format_err!(
                    "proxy-wasm-host: unimplemented import `{what}` was called"
                ))
            });
        }
    }
    Ok(l)
}
