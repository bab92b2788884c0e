//! The proxy-wasm filter: in Envoy, read each chat-completion body, analyse it, and send it to
//! the worker whose KV cache holds the longest prefix of its blocks, unless waiting there
//! costs more than recomputing elsewhere.
//!
//! - [`config`]: the plugin configuration (static workers or a sidecar, paths, state sizes,
//!   and the core's [`crate::config::RouterConfig`] fields), validated in `on_configure`.
//! - [`router`]: one VM's request path over the shared state ([`crate::state`]): match,
//!   score ([`crate::scoring`]), record; release a request's load as its phases end.
//! - [`poller`]: the state writer's tick on the VM that holds the lease: membership,
//!   decisions into the block buckets, `/metrics` polls; [`feed_apply`]: the sidecar's feed;
//!   [`events`]: what they report for the shell to count and log.
//! - [`fetch`]: images by URL fetched through an Envoy cluster and identified by their bytes;
//!   [`fetch::guard`] decides which URLs may be fetched.
//! - [`stamp`]: vLLM's per-item `uuid` written into image parts, so the engine's KV events
//!   name images as the router does (precise mode).
//! - `proxy` and `metrics` (feature `filter`, wasm only): the proxy-wasm callbacks and metrics.
//!
//! Request path, for a POST on a routed path:
//! 1. `on_http_request_headers`: remove any client-sent `x-gateway-destination-endpoint` and
//!    `x-envoy-original-dst-host` (always, on every request, so a client can never steer), then
//!    pause. Envoy must be configured with `allow_on_headers_stop_iteration: true`.
//! 2. `on_http_request_body`: each piece of the body as it arrives goes through the incremental
//!    analysis (images hashed as their base64 is decoded, nothing kept but what routing
//!    needs); at the end of the stream, with `fetch.enabled`, the images given by URL are
//!    fetched ([`fetch`]: SSRF guard, shared URL cache, `dispatch_http_call`s in parallel)
//!    while the request stays paused; then (or at the fetch deadline) decide, stamp image uuids (precise mode), set
//!    `x-gateway-destination-endpoint: ip:port` for the ORIGINAL_DST cluster, log
//!    `[ROUTING] Best: <worker> with X/Y blocks overlap; wait .., prefill .., recompute ..`.
//! 3. `on_http_response_headers`: optionally `x-mmrouter-worker`, `x-mmrouter-overlap` and
//!    `x-mmrouter-decision`. A non-streamed answer that arrives before its estimated end of
//!    prefill corrects the worker's queue clock.
//! 4. `on_http_response_body`: a stream's first chunk is the end of its prefill (vLLM sends the
//!    response headers before prefill, the first chunk after it): the queue clock is corrected.
//! 5. `on_log` (every stream end, resets included): in-flight count released, once; a request
//!    reset before its prefill ended leaves the queue.
//!
//! Fail open: a body that is not JSON, over the size limit, or that fails analysis (corrupt
//! image, bad base64, ...) is routed to the least-loaded worker and counted by reason; with no
//! worker known (a sidecar not heard from yet) the request takes Envoy's default route. The
//! filter never answers a request itself.

pub mod config;
pub mod events;
pub mod feed_apply;
pub mod fetch;
#[cfg(all(feature = "filter", target_arch = "wasm32"))]
mod metrics;
pub mod poller;
#[cfg(all(feature = "filter", target_arch = "wasm32"))]
mod proxy;
pub mod router;
pub mod stamp;
