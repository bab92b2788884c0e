//! mmrouter: send each multimodal LLM request to the inference worker that already holds its
//! KV cache.
//!
//! The modules follow the data flow of one request:
//!
//! 1. [`scan`]: read the OpenAI body in one pass as it arrives, into messages, text and media
//!    parts ([`request`] holds the types); inline images are decoded and hashed while their
//!    base64 streams by, for steps 2 and 3.
//! 2. [`identity`]: give each image a content identity (xxh3-128 of its bytes).
//! 3. [`image_header`]: read its size from the file header.
//! 4. [`tokens`]: estimate the tokens the model spends on it.
//! 5. [`layout`]: lay the prompt out as KV blocks whose keys carry the image identities.
//! 6. [`state`]: find which worker holds the longest prefix of those blocks, in the state
//!    kept once per Envoy process in proxy-wasm shared data ([`state::lookup`]).
//! 7. [`scoring`]: weigh the wait there against recomputing elsewhere, in seconds, and
//!    choose; [`worker_metrics`] reads the engine's own load (vLLM's `/metrics`) for it.
//!
//! [`feed`] is the binary answer of the sidecar (`mmrouter-sidecar`) that the filter polls.
//! [`analysis`] runs steps 1-5 for one body, [`report`] turns that into the `inspect` JSON;
//! [`config`] is the router's configuration; [`kv_events`] decodes vLLM's KV-cache events. None of
//! these do I/O, so the same code runs natively, in Envoy, in a browser and in any Wasm host (the
//! map: `docs/ARCHITECTURE.md`). [`filter`] holds the proxy-wasm filter's host-independent parts
//! (configuration, shared state, per-VM router); the shells around the core are behind features:
//! `filter` (the proxy-wasm callbacks), `web` (wasm-bindgen), `component` (WIT), `native` (the mock
//! vLLM worker and `mmrouter-sidecar`). The tests run the real filter `.wasm` on `proxy-wasm-host`,
//! a Wasmtime proxy-wasm host that is a crate of its own (`tests/proxy-wasm-host`).
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

pub mod analysis;
#[cfg(feature = "component")]
pub mod component;
pub mod config;
pub mod config_error;
pub mod feed;
pub mod filter;
pub mod identity;
pub mod image_header;
pub mod kv_events;
pub mod layout;
pub mod report;
pub mod request;
pub mod scan;
pub mod scoring;
pub mod shell;
pub mod state;
pub mod tokens;
#[cfg(feature = "web")]
pub mod web;
pub mod worker_metrics;
