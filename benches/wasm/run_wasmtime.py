"""Runs a wasm32-wasip1 command under Wasmtime (PyPI `wasmtime`, Cranelift, default config:
SIMD enabled, opt level "speed"); arguments after the .wasm are passed to the program.

    python run_wasmtime.py PROGRAM.wasm [ARGS...]

Prints the Wasmtime version on stderr. Compilation happens before the program starts, so the
program's own timings contain no compile time.
"""

import importlib.metadata
import sys

import wasmtime


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    path = sys.argv[1]
    config = wasmtime.Config()
    config.cranelift_opt_level = "speed"
    engine = wasmtime.Engine(config)
    module = wasmtime.Module.from_file(engine, path)
    linker = wasmtime.Linker(engine)
    linker.define_wasi()
    store = wasmtime.Store(engine)
    wasi = wasmtime.WasiConfig()
    wasi.argv = [path] + sys.argv[2:]
    wasi.inherit_stdout()
    wasi.inherit_stderr()
    store.set_wasi(wasi)
    print(f"wasmtime (PyPI) {importlib.metadata.version('wasmtime')}", file=sys.stderr)
    instance = linker.instantiate(store, module)
    start = instance.exports(store)["_start"]
    try:
        start(store)
    except wasmtime.ExitTrap as e:
        return e.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
