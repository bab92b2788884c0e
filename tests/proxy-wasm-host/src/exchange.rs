//! The test's side of a stream: [`RequestBuilder`] sends a request through a VM, the
//! [`Response`] is what upstream answers, and an [`Exchange`] is what happened to the stream
//! (what went upstream and downstream, each callback's action, the host calls).

use crate::abi::{Action, HeaderMap, StreamType};
use crate::error::HostError;
use crate::host::lock;
use crate::host_calls::HostCalls;
use crate::stream::StreamRecord;
use crate::vm::{ROOT_CONTEXT_ID, Vm};

/// A stream callback whose action is recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Callback {
    /// `proxy_on_request_headers`.
    RequestHeaders,
    /// `proxy_on_request_body`.
    RequestBody,
    /// `proxy_on_response_headers`.
    ResponseHeaders,
    /// `proxy_on_response_body`.
    ResponseBody,
}

/// A reply the filter sent with `proxy_send_local_response`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalResponse {
    /// The HTTP status code.
    pub status: u32,
    /// Envoy's response code details (`details` argument).
    pub details: String,
    /// The response body.
    pub body: Vec<u8>,
    /// The extra response headers.
    pub headers: HeaderMap,
    /// The gRPC status (-1: none).
    pub grpc_status: i32,
}

/// Properties: path parts → value.
type Properties = Vec<(Vec<String>, Vec<u8>)>;

/// The upstream response a stream receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The response headers, `:status` included.
    pub headers: HeaderMap,
    /// The body, chunk by chunk: each chunk is one `proxy_on_response_body`.
    pub chunks: Vec<Vec<u8>>,
}

impl Response {
    /// A response with `:status` set and no body.
    pub fn new(status: u16) -> Response {
        let mut headers = HeaderMap::new();
        headers.add(":status", status.to_string().as_bytes());
        Response {
            headers,
            chunks: Vec::new(),
        }
    }
    /// Adds a response header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.add(name, value.as_bytes());
        self
    }
    /// Appends a body chunk (each chunk is one `proxy_on_response_body`).
    pub fn body(mut self, chunk: impl Into<Vec<u8>>) -> Self {
        self.chunks.push(chunk.into());
        self
    }
}

impl Vm {
    /// Starts building a request on a new stream.
    pub fn request(&self) -> RequestBuilder<'_> {
        RequestBuilder {
            vm: self,
            headers: Vec::new(),
            chunks: Vec::new(),
            chunk_size: None,
            properties: Vec::new(),
            response: None,
        }
    }

    fn open_stream(
        &self,
        headers: HeaderMap,
        chunks: Vec<Vec<u8>>,
        properties: Vec<(Vec<String>, Vec<u8>)>,
        response: Option<Response>,
    ) -> Result<Exchange, HostError> {
        self.with(|vm| {
            vm.check_alive()?;
            let id = vm.next_context;
            vm.next_context = vm.next_context.wrapping_add(1).max(ROOT_CONTEXT_ID + 1);
            let rec = StreamRecord {
                id,
                request_headers: headers,
                pending_request_chunks: chunks.into_iter().collect(),
                properties: properties.into_iter().collect(),
                response,
                ..StreamRecord::default()
            };
            vm.store.data_mut().streams.insert(id, rec);
            let root = vm.store.data().root_context;
            vm.call("proxy_on_context_create", id, &[id as i32, root as i32])?;
            vm.drive(id)?;
            vm.settle()?;
            Ok(id)
        })
        .and_then(|id| self.snapshot(id))
    }

    fn snapshot(&self, id: u32) -> Result<Exchange, HostError> {
        let mut g = lock(&self.inner);
        if let Some(rec) = g.completed.remove(&id) {
            return Ok(Exchange { record: rec });
        }
        match g.store.data().streams.get(&id) {
            Some(rec) => Ok(Exchange {
                record: rec.clone(),
            }),
            None => Err(HostError::UnknownStream(id)),
        }
    }

    /// The current state of a stream: a copy while it is open; once complete, the record is
    /// handed over (and forgotten by the VM).
    pub fn stream(&self, id: u32) -> Result<Exchange, HostError> {
        self.snapshot(id)
    }

    /// Context ids of the streams still open (waiting for the filter or for a response).
    pub fn open_streams(&self) -> Vec<u32> {
        self.read(|vm| vm.store.data().streams.keys().copied().collect())
    }

    /// Gives an open stream its upstream response and runs it to completion (as far as the
    /// filter lets it).
    pub fn respond(&self, id: u32, response: Response) -> Result<Exchange, HostError> {
        self.with(|vm| {
            let rec = vm.rec(id).ok_or(HostError::UnknownStream(id))?;
            rec.response = Some(response);
            vm.drive(id)?;
            vm.settle()
        })?;
        self.snapshot(id)
    }

    /// Resets an open stream (client went away, upstream reset): `proxy_on_log`,
    /// `proxy_on_done`, `proxy_on_delete`, with no (further) response.
    pub fn reset(&self, id: u32) -> Result<Exchange, HostError> {
        self.with(|vm| {
            let rec = vm.rec(id).ok_or(HostError::UnknownStream(id))?;
            rec.reset = true;
            vm.drive(id)?;
            vm.settle()
        })?;
        self.snapshot(id)
    }
}

/// Builds one request. Pseudo-headers `:method` (POST), `:scheme` (http), `:authority`
/// (localhost) and `:path` (/) are added first when not given.
pub struct RequestBuilder<'a> {
    vm: &'a Vm,
    headers: Vec<(String, String)>,
    chunks: Vec<Vec<u8>>,
    chunk_size: Option<usize>,
    properties: Vec<(Vec<String>, Vec<u8>)>,
    response: Option<Response>,
}

impl RequestBuilder<'_> {
    /// Adds a request header (duplicates kept, name lower-cased).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }
    /// Appends a body chunk: each chunk is one `proxy_on_request_body` call.
    pub fn body(mut self, chunk: impl AsRef<[u8]>) -> Self {
        self.chunks.push(chunk.as_ref().to_vec());
        self
    }
    /// Re-splits the whole body into chunks of `size` bytes (the last may be shorter).
    pub fn chunk_size(mut self, size: usize) -> Self {
        self.chunk_size = Some(size.max(1));
        self
    }
    /// A property visible to `proxy_get_property` from this stream.
    pub fn property(mut self, path: &[&str], value: impl Into<Vec<u8>>) -> Self {
        self.properties
            .push((path.iter().map(|s| s.to_string()).collect(), value.into()));
        self
    }
    /// The upstream response [`send`](Self::send) delivers (default: 200, no body).
    pub fn response(mut self, response: Response) -> Self {
        self.response = Some(response);
        self
    }

    fn parts(self) -> (HeaderMap, Vec<Vec<u8>>, Properties) {
        let mut map = HeaderMap::new();
        let given = |n: &str| self.headers.iter().any(|(k, _)| k.eq_ignore_ascii_case(n));
        for (name, default) in [
            (":method", "POST"),
            (":scheme", "http"),
            (":authority", "localhost"),
            (":path", "/"),
        ] {
            if !given(name) {
                map.add(name, default.as_bytes());
            }
        }
        for (k, v) in &self.headers {
            map.add(k, v.as_bytes());
        }
        let chunks = match self.chunk_size {
            Some(size) => {
                let all: Vec<u8> = self.chunks.concat();
                all.chunks(size).map(|c| c.to_vec()).collect()
            }
            None => self.chunks.into_iter().filter(|c| !c.is_empty()).collect(),
        };
        (map, chunks, self.properties)
    }

    /// Runs the whole stream: request headers and body, then (once the filter has let the
    /// request go upstream) the response, then `proxy_on_log`/`on_done`/`on_delete`. If the
    /// filter holds the request (waiting for an HTTP call, say) the stream stays open and the
    /// returned [`Exchange`] says so; it completes when the filter resumes it.
    pub fn send(mut self) -> Result<Exchange, HostError> {
        let vm = self.vm;
        let response = self.response.take().unwrap_or_else(|| Response::new(200));
        let (headers, chunks, props) = self.parts();
        vm.open_stream(headers, chunks, props, Some(response))
    }

    /// Sends only the request; the stream stays open until [`Vm::respond`] or [`Vm::reset`].
    pub fn send_request(self) -> Result<Exchange, HostError> {
        let vm = self.vm;
        let (headers, chunks, props) = self.parts();
        vm.open_stream(headers, chunks, props, None)
    }
}

/// What happened to one stream (a snapshot).
#[derive(Debug, Clone)]
pub struct Exchange {
    record: StreamRecord,
}

impl Exchange {
    /// The stream's context id.
    pub fn id(&self) -> u32 {
        self.record.id
    }
    /// Log/done/delete have run.
    pub fn is_complete(&self) -> bool {
        self.record.complete
    }
    /// The request went upstream entirely (headers and all of the body).
    pub fn forwarded_upstream(&self) -> bool {
        self.record.upstream_headers.is_some()
            && self.record.pending_request_chunks.is_empty()
            && !self.record.request_paused
    }
    /// A request header as it was sent UPSTREAM (what the router and ORIGINAL_DST see).
    /// `None` when absent or when the headers never went upstream. Changes the filter made
    /// after the headers went upstream are not visible here (nor in Envoy's routing).
    pub fn request_header(&self, name: &str) -> Option<&str> {
        self.record.upstream_headers.as_ref()?.get(name)
    }
    /// The request headers as sent upstream.
    pub fn upstream_request_headers(&self) -> Option<&HeaderMap> {
        self.record.upstream_headers.as_ref()
    }
    /// The request header map as the host holds it now (including late changes).
    pub fn request_headers(&self) -> &HeaderMap {
        &self.record.request_headers
    }
    /// The request body that went upstream.
    pub fn upstream_body(&self) -> &[u8] {
        &self.record.upstream_body
    }
    /// Every stream callback's action, in order.
    pub fn actions(&self) -> &[(Callback, Action)] {
        &self.record.actions
    }
    /// The action of the LAST call of `callback`.
    pub fn action(&self, callback: Callback) -> Option<Action> {
        self.record
            .actions
            .iter()
            .rev()
            .find(|(c, _)| *c == callback)
            .map(|(_, a)| *a)
    }
    /// The reply the filter sent instead of forwarding.
    pub fn local_response(&self) -> Option<&LocalResponse> {
        self.record.local_response.as_ref()
    }
    /// A response header as sent DOWNSTREAM.
    pub fn response_header(&self, name: &str) -> Option<&str> {
        self.record.downstream_headers.as_ref()?.get(name)
    }
    /// The response body sent downstream.
    pub fn downstream_body(&self) -> &[u8] {
        &self.record.downstream_body
    }
    /// The stream the filter closed with `proxy_close_stream`, if it did.
    pub fn closed_by_filter(&self) -> Option<StreamType> {
        self.record.closed
    }
    /// The test reset the stream.
    pub fn was_reset(&self) -> bool {
        self.record.reset
    }
    /// Tokens of HTTP calls of this stream cancelled when it ended.
    pub fn cancelled_calls(&self) -> &[u32] {
        &self.record.cancelled_calls
    }
    /// A property the filter set on this stream.
    pub fn property(&self, path: &[&str]) -> Option<&[u8]> {
        let key: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        self.record.properties.get(&key).map(|v| v.as_slice())
    }
    /// The host calls the module made for this stream so far, per callback and import: from
    /// the stream's own callbacks (`proxy_on_context_create` to `proxy_on_delete`) and from
    /// any callback that made it the effective context (`proxy_set_effective_context`).
    pub fn host_calls(&self) -> &HostCalls {
        &self.record.host_calls
    }
}
