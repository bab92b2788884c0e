//! The host on a small hand-written proxy-wasm module (WebAssembly text): the order of its
//! callbacks, what reaches upstream, the host calls it counts, and a trap on an import the
//! host does not implement.

use proxy_wasm_host::{
    Action, Callback, Host, HostError, LogLevel, LogSource, Response, VmConfig, WasmModule,
};
use std::time::Duration;

/// A module that logs "configured" and sets a 1 s tick on configure, logs "tick" on each
/// tick, reads `:path` and adds `x-added: 1` on request headers, reads the body and logs
/// "body" on each body chunk, and calls `proxy_call_foreign_function` (not implemented by the
/// host) on response headers.
const MODULE: &str = r#"
(module
  (import "env" "proxy_log" (func $log (param i32 i32 i32) (result i32)))
  (import "env" "proxy_get_header_map_value"
    (func $get_header (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_add_header_map_value"
    (func $add_header (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_get_buffer_bytes"
    (func $get_buffer (param i32 i32 i32 i32 i32) (result i32)))
  (import "env" "proxy_set_tick_period_milliseconds" (func $set_tick (param i32) (result i32)))
  (import "env" "proxy_call_foreign_function"
    (func $foreign (param i32 i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 16) ":path")
  (data (i32.const 32) "x-added")
  (data (i32.const 48) "1")
  (data (i32.const 64) "configured")
  (data (i32.const 80) "body")
  (data (i32.const 96) "tick")
  (global $heap (mut i32) (i32.const 1024))
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_memory_allocate") (param $size i32) (result i32)
    (local $at i32)
    (local.set $at (global.get $heap))
    (global.set $heap (i32.add (global.get $heap) (local.get $size)))
    (local.get $at))
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) (i32.const 1))
  (func (export "proxy_on_configure") (param i32 i32) (result i32)
    (drop (call $log (i32.const 2) (i32.const 64) (i32.const 10)))
    (drop (call $set_tick (i32.const 1000)))
    (i32.const 1))
  (func (export "proxy_on_tick") (param i32)
    (drop (call $log (i32.const 2) (i32.const 96) (i32.const 4))))
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32)
    (drop (call $get_header (i32.const 0) (i32.const 16) (i32.const 5) (i32.const 200) (i32.const 204)))
    (drop (call $add_header (i32.const 0) (i32.const 32) (i32.const 7) (i32.const 48) (i32.const 1)))
    (i32.const 0))
  (func (export "proxy_on_request_body") (param i32 i32 i32) (result i32)
    (drop (call $get_buffer (i32.const 0) (i32.const 0) (local.get 1) (i32.const 200) (i32.const 204)))
    (drop (call $log (i32.const 2) (i32.const 80) (i32.const 4)))
    (i32.const 0))
  (func (export "proxy_on_response_headers") (param i32 i32 i32) (result i32)
    (drop (call $foreign (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0) (i32.const 0)))
    (i32.const 0))
)
"#;

fn host() -> Host {
    let wasm = wat::parse_str(MODULE).expect("the test module is valid WebAssembly text");
    let module = WasmModule::from_bytes("hosting-test", &wasm).expect("compiles");
    Host::new(&module).expect("links")
}

#[test]
fn a_request_runs_through_the_callbacks_and_its_host_calls_are_counted_per_callback() {
    let host = host();
    let vm = host.vm(VmConfig::new("")).expect("starts");
    let configured = vm.root_host_calls();
    assert_eq!(configured.total(), 2, "{configured:?}");
    let in_configure = configured.in_callback("proxy_on_configure");
    assert_eq!(in_configure.count("proxy_log"), 1);
    assert_eq!(in_configure.count("proxy_set_tick_period_milliseconds"), 1);

    let s = vm
        .request()
        .header(":path", "/v1/chat/completions")
        .body("ab")
        .body("cd")
        .send_request()
        .expect("runs");
    assert!(s.forwarded_upstream());
    assert_eq!(s.request_header("x-added"), Some("1"));
    assert_eq!(s.upstream_body(), b"abcd");
    assert_eq!(
        s.actions(),
        [
            (Callback::RequestHeaders, Action::Continue),
            (Callback::RequestBody, Action::Continue),
            (Callback::RequestBody, Action::Continue),
        ]
    );
    let calls = s.host_calls();
    assert_eq!(calls.total(), 6, "{calls:?}");
    let headers = calls.in_callback("proxy_on_request_headers");
    assert_eq!(headers.count("proxy_get_header_map_value"), 1);
    assert_eq!(headers.count("proxy_add_header_map_value"), 1);
    let body = calls.in_callback("proxy_on_request_body");
    assert_eq!(body.count("proxy_get_buffer_bytes"), 2, "one per chunk");
    assert_eq!(body.count("proxy_log"), 2);
    assert_eq!(
        calls.by_import().get("proxy_log"),
        Some(&2),
        "the stream's calls only: configure's log is the root context's"
    );
    assert_eq!(
        vm.root_host_calls(),
        configured,
        "no root calls for a stream"
    );

    // A tick is a root-context call.
    host.advance(Duration::from_millis(1000)).expect("ticks");
    let tick = vm.root_host_calls().since(&configured);
    assert_eq!(tick.total(), 1);
    assert_eq!(tick.in_callback("proxy_on_tick").count("proxy_log"), 1);
    let logs: Vec<(LogLevel, String, LogSource)> = vm
        .logs()
        .into_iter()
        .map(|l| (l.level, l.message, l.source))
        .collect();
    assert_eq!(
        logs,
        [
            (LogLevel::Info, "configured".into(), LogSource::ProxyLog),
            (LogLevel::Info, "body".into(), LogSource::ProxyLog),
            (LogLevel::Info, "body".into(), LogSource::ProxyLog),
            (LogLevel::Info, "tick".into(), LogSource::ProxyLog),
        ]
    );
}

#[test]
fn an_import_the_host_does_not_implement_traps_with_its_name_and_fails_the_vm() {
    let host = host();
    let vm = host.vm(VmConfig::new("")).expect("starts");
    let open = vm.request().send_request().expect("request runs");
    let err = vm
        .respond(open.id(), Response::new(200))
        .expect_err("the response headers callback traps");
    match &err {
        HostError::Trap {
            callback, message, ..
        } => {
            assert_eq!(callback, "proxy_on_response_headers");
            assert!(
                message.contains("env::proxy_call_foreign_function"),
                "{message}"
            );
        }
        other => panic!("not a trap: {other}"),
    }
    assert!(vm.failure().is_some());
    assert!(matches!(vm.request().send(), Err(HostError::VmFailed(_))));
}
