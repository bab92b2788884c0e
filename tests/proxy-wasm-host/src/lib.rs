//! A Wasmtime host for proxy-wasm modules (ABI 0.2.1), to test a compiled filter `.wasm`
//! quickly and deterministically, without Envoy.
//!
//! It emulates what Envoy does around a filter: one VM per worker thread, each with its own
//! root context and tick; ONE shared-data store, shared queues and one stats store for all of
//! them (keyed by `vm_id`); a virtual clock that only moves when the test says so; outbound
//! HTTP calls that the test answers (or fails, or lets time out); Envoy's order of callbacks
//! and its body buffering. Imports it does not implement trap with the import's name. It
//! counts the host calls the module makes, per stream, callback and import ([`HostCalls`]).
//!
//! ```no_run
//! use proxy_wasm_host::{Callback, Host, HostError, HttpResponse, Response, VmConfig, WasmModule};
//! use std::time::Duration;
//!
//! # fn main() -> Result<(), HostError> {
//! // Built beforehand, e.g. with `WasmBuild` (a cargo subprocess).
//! let module = WasmModule::load("target/wasm32-wasip1/release/my_filter.wasm")?;
//! let host = Host::new(&module)?;
//! // A VM = one Envoy worker thread: its own root context and tick; shared data, queues
//! // and metrics are shared with the host's other VMs.
//! let vm = host.vm(VmConfig::new(r#"{"some":"config"}"#).allow_on_headers_stop_iteration(true))?;
//!
//! let s = vm
//!     .request()
//!     .header(":path", "/v1/chat/completions")
//!     .body(b"{}") // each .body() is one proxy_on_request_body
//!     .response(Response::new(200).body(b"ok".to_vec()))
//!     .send()?;
//! assert!(s.is_complete());
//! assert_eq!(s.request_header("x-added"), Some("1")); // as sent upstream
//! assert_eq!(s.action(Callback::RequestHeaders), Some(proxy_wasm_host::Action::Continue));
//! assert_eq!(host.metric_value("my.requests"), Some(1));
//! // Host calls the module made for this stream, per import.
//! assert!(s.host_calls().count("proxy_get_header_map_value") <= 2);
//!
//! host.advance(Duration::from_millis(500))?; // fires ticks and call timeouts
//! for call in vm.http_calls() {
//!     vm.answer_http_call(call.token, HttpResponse::new(200).body("..."))?;
//! }
//! # Ok(()) }
//! ```
//!
//! The crate's README describes what is emulated and how, in detail.
#![deny(missing_docs)]

pub mod abi;
mod build;
mod config;
mod error;
mod exchange;
mod host;
mod host_calls;
mod http_call;
mod imports;
mod log;
mod module;
mod shared;
mod stream;
mod vm;

pub use abi::{Action, HeaderMap, LogLevel, MetricKind, Status, StreamType};
pub use build::WasmBuild;
pub use config::VmConfig;
pub use error::HostError;
pub use exchange::{Callback, Exchange, LocalResponse, RequestBuilder, Response};
pub use host::{DEFAULT_EPOCH_SECS, Host, MAX_PENDING_EVENTS};
pub use host_calls::HostCalls;
pub use http_call::{HttpCall, HttpCallOutcome, HttpResponse};
pub use log::{LogEntry, LogSource};
pub use module::WasmModule;
pub use shared::MetricValue;
pub use vm::{ROOT_CONTEXT_ID, Vm};

// The README's Rust examples compile as doctests, so they cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
