// Runs a wasm32-wasip1 command under V8, through Node's WASI (node:wasi, preview1); arguments
// after the .wasm are passed to the program. V8 is the engine Envoy embeds for Wasm filters;
// Node's V8 is not Envoy's build, so these numbers are a proxy too.
//
//     node run_v8.mjs PROGRAM.wasm [ARGS...]
//
// The module is compiled before the program starts (V8 still tiers up from Liftoff to
// TurboFan while it runs; the program's warm-up absorbs that).
import { readFile } from "node:fs/promises";
import { WASI } from "node:wasi";
import process from "node:process";

const [path, ...args] = process.argv.slice(2);
if (!path) {
  console.error("usage: node run_v8.mjs PROGRAM.wasm [ARGS...]");
  process.exit(2);
}
console.error(`node ${process.version}, V8 ${process.versions.v8}`);
const wasi = new WASI({ version: "preview1", args: [path, ...args], env: {}, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(path));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
process.exitCode = wasi.start(instance);
