//! The floor filter (see Cargo.toml): what any body-routing proxy-wasm filter pays in Envoy.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};
use std::cell::Cell;
use std::rc::Rc;

/// The header mmrouter's rendered Envoy routes on (envoy/render.py).
const DESTINATION: &str = "x-gateway-destination-endpoint";

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| Box::new(Root::default()));
}}

#[derive(Default)]
struct Root {
    workers: Rc<Vec<String>>,
    next: Rc<Cell<usize>>,
    routed: Option<u32>,
}

impl Context for Root {}

impl RootContext for Root {
    /// The same plugin configuration as mmrouter's: only `workers[].address` is read.
    fn on_configure(&mut self, _size: usize) -> bool {
        let config = hostcalls::get_buffer(
            proxy_wasm::types::BufferType::PluginConfiguration,
            0,
            usize::MAX,
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        let value: serde_json::Value = serde_json::from_slice(&config).unwrap_or_default();
        let workers: Vec<String> = value
            .get("workers")
            .and_then(|w| w.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|w| w.get("address")?.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        self.workers = Rc::new(workers);
        // Counted under the name the benchmark checks for a routed request.
        self.routed = hostcalls::define_metric(MetricType::Counter, "mmrouter.routed.floor").ok();
        !self.workers.is_empty()
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream {
            workers: self.workers.clone(),
            next: self.next.clone(),
            routed: self.routed,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Stream {
    workers: Rc<Vec<String>>,
    next: Rc<Cell<usize>>,
    routed: Option<u32>,
}

impl Context for Stream {}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            Action::Continue
        } else {
            Action::Pause
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        // The body into the VM once, as a router that reads it must (a host call: never
        // optimised away).
        let _body = self.get_http_request_body(0, body_size);
        if self.workers.is_empty() {
            return Action::Continue;
        }
        let i = self.next.get() % self.workers.len();
        self.next.set(i + 1);
        if let Some(address) = self.workers.get(i) {
            self.set_http_request_header(DESTINATION, Some(address));
        }
        if let Some(id) = self.routed {
            let _ = hostcalls::increment_metric(id, 1);
        }
        Action::Continue
    }
}
