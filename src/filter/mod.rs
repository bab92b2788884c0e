//! The proxy-wasm filter: in Envoy, buffer each chat-completion body, analyse it, and send it
//! to the worker that already holds the longest prefix of its KV blocks, weighed against load.
//!
//! - [`config`]: the plugin configuration (workers, mode, paths, state, and the core's
//!   [`crate::config::RouterConfig`] fields), validated in `on_configure`.
//! - [`shared_state`]: the load table and decision log every VM shares through proxy-wasm
//!   shared data (how concurrent VMs update it without losing updates is explained there).
//! - [`router`]: one VM's router: replay the log into its prefix index, analyse, match, score,
//!   record. Host-independent and tested natively.
//! - `proxy` and `metrics` (feature `filter`, wasm only): the proxy-wasm callbacks and metrics.
//!
//! Request path, for a POST on a routed path:
//! 1. `on_http_request_headers`: remove any client-sent `x-gateway-destination-endpoint` and
//!    `x-envoy-original-dst-host` (always, on every request, so a client can never steer), then
//!    pause. Envoy must be configured with `allow_on_headers_stop_iteration: true`.
//! 2. `on_http_request_body`: wait for the end of the stream, read the body once, decide, set
//!    `x-gateway-destination-endpoint: ip:port` for the ORIGINAL_DST cluster, log
//!    `[ROUTING] Best: <worker> with X/Y blocks overlap`.
//! 3. `on_http_response_headers`: `x-mmrouter-worker` and `x-mmrouter-overlap` on the response;
//!    the worker's prefill blocks are released (first byte means prefill is done).
//! 4. `on_log` (every stream end, resets included): in-flight count released, once.
//!
//! Fail open: a body that is not JSON, over the size limit, or that fails analysis (corrupt
//! image, bad base64, ...) is routed to the least-loaded worker and counted by reason. The
//! filter never answers a request itself.

pub mod config;
#[cfg(all(feature = "filter", target_arch = "wasm32"))]
mod metrics;
#[cfg(all(feature = "filter", target_arch = "wasm32"))]
mod proxy;
pub mod router;
pub mod shared_state;
