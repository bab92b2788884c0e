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
//! 6. [`index`]: find which worker holds the longest prefix of those blocks.
//! 7. [`scoring`]: weigh that against each worker's load and choose; [`worker_metrics`] reads
//!    the engine's own load (vLLM's `/metrics`) for it.
//!
//! [`analysis`] runs steps 1-5 for one body, [`report`] turns that into the `inspect` JSON;
//! [`config`] is the router's configuration.
//! None of these do I/O, so the same code runs natively, in Envoy, in a browser and in any
//! Wasm host. [`filter`] holds the proxy-wasm filter's host-independent parts (configuration,
//! shared state, per-VM router); the shells around the core are behind features: `filter`
//! (the proxy-wasm callbacks), `web` (wasm-bindgen), `component` (WIT), `proxy-host` (a
//! Wasmtime host for proxy-wasm modules), `native` (the mock vLLM worker).
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
pub mod filter;
pub mod identity;
pub mod image_header;
pub mod index;
pub mod layout;
#[cfg(feature = "proxy-host")]
pub mod proxy_host;
pub mod report;
pub mod request;
pub mod scan;
pub mod scoring;
#[cfg(any(feature = "web", feature = "component"))]
pub mod shell;
pub mod tokens;
#[cfg(feature = "web")]
pub mod web;
pub mod worker_metrics;
