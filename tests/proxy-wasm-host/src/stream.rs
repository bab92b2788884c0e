//! The host's side of a stream: everything it knows about one HTTP request/response
//! ([`StreamRecord`]), and how it drives the stream through the module's callbacks in Envoy's
//! order, with Envoy's pausing and body buffering.

use crate::abi::{Action, HeaderMap, StreamType};
use crate::error::HostError;
use crate::exchange::{Callback, LocalResponse, Response};
use crate::host::MAX_PENDING_EVENTS;
use crate::host_calls::HostCalls;
use crate::vm::{VmInner, len_i32};
use std::collections::{HashMap, VecDeque};

/// Everything the host knows about one HTTP stream (one request/response).
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamRecord {
    pub(crate) id: u32,
    pub(crate) request_headers: HeaderMap,
    pub(crate) request_trailers: HeaderMap,
    /// `HTTP_REQUEST_BODY` as the filter sees it (accumulates while the filter pauses).
    pub(crate) request_body: Vec<u8>,
    pub(crate) pending_request_chunks: VecDeque<Vec<u8>>,
    pub(crate) request_headers_delivered: bool,
    pub(crate) request_paused: bool,
    pub(crate) stop_all: bool,
    pub(crate) resume_request: bool,
    pub(crate) upstream_headers: Option<HeaderMap>,
    pub(crate) upstream_body: Vec<u8>,
    pub(crate) response: Option<Response>,
    pub(crate) response_headers: HeaderMap,
    pub(crate) response_trailers: HeaderMap,
    pub(crate) response_body: Vec<u8>,
    pub(crate) pending_response_chunks: VecDeque<Vec<u8>>,
    pub(crate) response_headers_delivered: bool,
    pub(crate) response_paused: bool,
    pub(crate) resume_response: bool,
    pub(crate) downstream_headers: Option<HeaderMap>,
    pub(crate) downstream_body: Vec<u8>,
    pub(crate) local_response: Option<LocalResponse>,
    pub(crate) closed: Option<StreamType>,
    pub(crate) reset: bool,
    pub(crate) actions: Vec<(Callback, Action)>,
    pub(crate) properties: HashMap<Vec<String>, Vec<u8>>,
    pub(crate) log_called: bool,
    pub(crate) done_called: bool,
    pub(crate) done_pending: bool,
    pub(crate) complete: bool,
    pub(crate) cancelled_calls: Vec<u32>,
    /// Host calls made for this stream.
    pub(crate) host_calls: HostCalls,
}

impl VmInner {
    /// `proxy_done` was called for stream `id`: if `proxy_on_done` had deferred its deletion,
    /// `proxy_on_delete` now.
    pub(crate) fn proxy_done_for(&mut self, id: u32) -> Result<(), HostError> {
        let pending = self
            .store
            .data()
            .streams
            .get(&id)
            .is_some_and(|s| s.done_pending);
        if pending {
            self.call("proxy_on_delete", id, &[id as i32])?;
            self.complete_stream(id);
        }
        Ok(())
    }

    /// Moves a finished stream to the completed records, cancelling its pending HTTP calls.
    fn complete_stream(&mut self, id: u32) {
        let state = self.store.data_mut();
        if let Some(mut rec) = state.streams.remove(&id) {
            rec.complete = true;
            rec.done_pending = false;
            // Envoy cancels a context's in-flight calls when it is destroyed.
            let cancelled: Vec<u32> = state
                .http_calls
                .iter()
                .filter(|(_, c)| c.context_id == id)
                .map(|(t, _)| *t)
                .collect();
            for t in &cancelled {
                state.http_calls.remove(t);
            }
            rec.cancelled_calls = cancelled;
            self.completed.insert(id, rec);
        }
    }

    /// The open stream `id`.
    pub(crate) fn rec(&mut self, id: u32) -> Option<&mut StreamRecord> {
        self.store.data_mut().streams.get_mut(&id)
    }

    /// Moves a stream forward as far as Envoy would without outside events.
    pub(crate) fn drive(&mut self, id: u32) -> Result<(), HostError> {
        let allow = self.store.data().config.allow_on_headers_stop_iteration;
        for _ in 0..MAX_PENDING_EVENTS {
            let Some(rec) = self.rec(id) else {
                return Ok(());
            };
            if rec.done_pending {
                return Ok(());
            }
            if rec.local_response.is_some() || rec.closed.is_some() || rec.reset {
                return self.finish(id);
            }
            // Request path.
            if !rec.request_headers_delivered {
                rec.request_headers_delivered = true;
                let eos = rec.pending_request_chunks.is_empty();
                let n = len_i32(rec.request_headers.len());
                let action =
                    self.call_action("proxy_on_request_headers", id, &[id as i32, n, eos as i32])?;
                let Some(rec) = self.rec(id) else {
                    return Ok(());
                };
                rec.actions.push((Callback::RequestHeaders, action));
                match action {
                    Action::Continue => rec.upstream_headers = Some(rec.request_headers.clone()),
                    Action::Pause => {
                        rec.request_paused = true;
                        rec.stop_all = !allow;
                    }
                }
                continue;
            }
            if rec.resume_request {
                rec.resume_request = false;
                if rec.request_paused {
                    rec.request_paused = false;
                    rec.stop_all = false;
                    release_request(rec);
                }
                continue;
            }
            if !rec.stop_all
                && let Some(chunk) = rec.pending_request_chunks.pop_front()
            {
                rec.request_body.extend_from_slice(&chunk);
                let eos = rec.pending_request_chunks.is_empty();
                let size = len_i32(rec.request_body.len());
                let action =
                    self.call_action("proxy_on_request_body", id, &[id as i32, size, eos as i32])?;
                let Some(rec) = self.rec(id) else {
                    return Ok(());
                };
                rec.actions.push((Callback::RequestBody, action));
                match action {
                    Action::Continue => {
                        rec.request_paused = false;
                        release_request(rec);
                    }
                    Action::Pause => rec.request_paused = true,
                }
                continue;
            }
            let request_done = rec.upstream_headers.is_some()
                && rec.pending_request_chunks.is_empty()
                && !rec.request_paused;
            if !request_done {
                return Ok(()); // the filter holds the request
            }
            // Response path.
            if !rec.response_headers_delivered {
                let Some(resp) = rec.response.take() else {
                    return Ok(()); // waiting for the test to respond
                };
                rec.response_headers = resp.headers;
                rec.pending_response_chunks = resp.chunks.into_iter().collect();
                rec.response_headers_delivered = true;
                let eos = rec.pending_response_chunks.is_empty();
                let n = len_i32(rec.response_headers.len());
                let action =
                    self.call_action("proxy_on_response_headers", id, &[id as i32, n, eos as i32])?;
                let Some(rec) = self.rec(id) else {
                    return Ok(());
                };
                rec.actions.push((Callback::ResponseHeaders, action));
                match action {
                    Action::Continue => rec.downstream_headers = Some(rec.response_headers.clone()),
                    Action::Pause => rec.response_paused = true,
                }
                continue;
            }
            if rec.resume_response {
                rec.resume_response = false;
                if rec.response_paused {
                    rec.response_paused = false;
                    release_response(rec);
                }
                continue;
            }
            if let Some(chunk) = rec.pending_response_chunks.pop_front() {
                rec.response_body.extend_from_slice(&chunk);
                let eos = rec.pending_response_chunks.is_empty();
                let size = len_i32(rec.response_body.len());
                let action =
                    self.call_action("proxy_on_response_body", id, &[id as i32, size, eos as i32])?;
                let Some(rec) = self.rec(id) else {
                    return Ok(());
                };
                rec.actions.push((Callback::ResponseBody, action));
                match action {
                    Action::Continue => {
                        rec.response_paused = false;
                        release_response(rec);
                    }
                    Action::Pause => rec.response_paused = true,
                }
                continue;
            }
            if rec.downstream_headers.is_some() && !rec.response_paused {
                return self.finish(id);
            }
            return Ok(()); // the filter holds the response
        }
        Err(HostError::Runaway(format!("stream {id} never settles")))
    }

    /// The end of a stream: `proxy_on_log`, `proxy_on_done`, then `proxy_on_delete` (or, when
    /// `proxy_on_done` returned false, when the module calls `proxy_done`).
    fn finish(&mut self, id: u32) -> Result<(), HostError> {
        let Some(rec) = self.rec(id) else {
            return Ok(());
        };
        if !rec.log_called {
            rec.log_called = true;
            self.call("proxy_on_log", id, &[id as i32])?;
        }
        let Some(rec) = self.rec(id) else {
            return Ok(());
        };
        if !rec.done_called {
            rec.done_called = true;
            let done = self.call("proxy_on_done", id, &[id as i32])?;
            if done == Some(0) {
                if let Some(rec) = self.rec(id) {
                    rec.done_pending = true;
                }
                return Ok(());
            }
        }
        self.call("proxy_on_delete", id, &[id as i32])?;
        self.complete_stream(id);
        Ok(())
    }
}

fn release_request(rec: &mut StreamRecord) {
    if rec.upstream_headers.is_none() {
        rec.upstream_headers = Some(rec.request_headers.clone());
    }
    let body = std::mem::take(&mut rec.request_body);
    rec.upstream_body.extend_from_slice(&body);
}

fn release_response(rec: &mut StreamRecord) {
    if rec.downstream_headers.is_none() {
        rec.downstream_headers = Some(rec.response_headers.clone());
    }
    let body = std::mem::take(&mut rec.response_body);
    rec.downstream_body.extend_from_slice(&body);
}
