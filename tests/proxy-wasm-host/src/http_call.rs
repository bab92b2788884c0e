//! Outbound HTTP calls (`proxy_http_call`): what the module asked for ([`HttpCall`]), how the
//! test settles them (answer, fail, a scripted responder, or a timeout on the virtual clock),
//! and their delivery as `proxy_on_http_call_response`.

use crate::abi::HeaderMap;
use crate::error::HostError;
use crate::vm::{Vm, VmInner, len_i32};
use std::time::Duration;

/// An outbound call the module made with `proxy_http_call`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    /// The call's token (never 0), as returned to the module.
    pub token: u32,
    /// The context that made the call (the root context or a stream).
    pub context_id: u32,
    /// The cluster name (Envoy: an upstream cluster).
    pub upstream: String,
    /// The request headers (`:method`, `:path` and `:authority` included).
    pub headers: HeaderMap,
    /// The request body.
    pub body: Vec<u8>,
    /// The request trailers.
    pub trailers: HeaderMap,
    /// The timeout the module gave.
    pub timeout: Duration,
    /// Virtual time at which the call times out.
    pub deadline: Duration,
}

/// The answer to an [`HttpCall`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    /// The response headers, `:status` included.
    pub headers: HeaderMap,
    /// The response body.
    pub body: Vec<u8>,
    /// The response trailers.
    pub trailers: HeaderMap,
}

impl HttpResponse {
    /// A response with `:status` set.
    pub fn new(status: u16) -> HttpResponse {
        let mut headers = HeaderMap::new();
        headers.add(":status", status.to_string().as_bytes());
        HttpResponse {
            headers,
            body: Vec::new(),
            trailers: HeaderMap::new(),
        }
    }
    /// Adds a response header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.add(name, value.as_bytes());
        self
    }
    /// Sets the body.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }
    /// Adds a response trailer.
    pub fn trailer(mut self, name: &str, value: &str) -> Self {
        self.trailers.add(name, value.as_bytes());
        self
    }
}

/// How a scripted responder settles a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HttpCallOutcome {
    /// Deliver this response.
    Respond(HttpResponse),
    /// Deliver a failure now (Envoy: connection failure/reset → 0 headers, 0 body).
    Fail,
    /// Leave it pending (it times out when the clock passes its deadline, or the test answers
    /// it with [`Vm::answer_http_call`]).
    Pending,
}

/// A scripted responder ([`Vm::set_http_responder`]).
pub(crate) type Responder = Box<dyn FnMut(&HttpCall) -> HttpCallOutcome + Send>;

impl VmInner {
    /// Delivers call `token`'s answer (None: a failure, 0 headers and 0 body) to the context
    /// that made it, as `proxy_on_http_call_response`.
    pub(crate) fn deliver_call(
        &mut self,
        token: u32,
        response: Option<HttpResponse>,
    ) -> Result<(), HostError> {
        let Some(call) = self.store.data_mut().http_calls.remove(&token) else {
            return Err(HostError::UnknownHttpCall(token));
        };
        let (nh, nb, nt) = match &response {
            Some(r) => (
                len_i32(r.headers.len()),
                len_i32(r.body.len()),
                len_i32(r.trailers.len()),
            ),
            None => (0, 0, 0),
        };
        self.store.data_mut().call_response = response;
        let r = self.call(
            "proxy_on_http_call_response",
            call.context_id,
            &[call.context_id as i32, token as i32, nh, nb, nt],
        );
        self.store.data_mut().call_response = None;
        r?;
        Ok(())
    }
}

impl Vm {
    /// Outbound calls not yet answered, oldest first.
    pub fn http_calls(&self) -> Vec<HttpCall> {
        self.read(|vm| vm.store.data().http_calls.values().cloned().collect())
    }

    /// Answers a pending call (`proxy_on_http_call_response` with the response's sizes).
    pub fn answer_http_call(&self, token: u32, response: HttpResponse) -> Result<(), HostError> {
        self.with(|vm| {
            vm.deliver_call(token, Some(response))?;
            vm.settle()
        })
    }

    /// Fails a pending call (as Envoy reports a reset or connection failure: 0 headers).
    pub fn fail_http_call(&self, token: u32) -> Result<(), HostError> {
        self.with(|vm| {
            vm.deliver_call(token, None)?;
            vm.settle()
        })
    }

    /// Answers every future call (and every call still unoffered) with `f`, asynchronously:
    /// after the callback that made the call returns, as Envoy's event loop would.
    pub fn set_http_responder(
        &self,
        f: impl FnMut(&HttpCall) -> HttpCallOutcome + Send + 'static,
    ) -> Result<(), HostError> {
        self.with(|vm| {
            vm.responder = Some(Box::new(f));
            let pending: Vec<u32> = vm.store.data().http_calls.keys().copied().collect();
            vm.store.data_mut().unoffered_calls = pending;
            vm.settle()
        })
    }
}
