//! The real filter `.wasm` (feature `filter`, wasm32-wasip1) on the Wasmtime proxy-wasm host.
//! The test command builds the `.wasm` itself (see `tests/support`).

mod support;

use mmrouter::proxy_host::{Host, VmConfig};

fn config() -> VmConfig {
    VmConfig::new(
        r#"{"workers":[{"name":"w0","address":"127.0.0.1:8000"},{"name":"w1","address":"127.0.0.1:8001"}]}"#,
    )
    .allow_on_headers_stop_iteration(true)
}

#[test]
fn filter_starts_and_routes_a_text_request() {
    let host = Host::new(&support::filter_module()).unwrap();
    let vm = host.vm(config()).unwrap();
    let s = vm
        .request()
        .header(":path", "/v1/chat/completions")
        .body(br#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#)
        .send()
        .unwrap();
    assert!(s.is_complete());
    assert!(s.request_header("x-gateway-destination-endpoint").is_some());
}
