//! The host behind the traits the core is written against: proxy-wasm shared data and queues
//! ([`SharedStore`]), HTTP calls ([`Dispatcher`]), the log and the clock. Every call checks the
//! host's status (see the module above).

use super::super::poller::Dispatcher;
use crate::state::{SharedStore, StoreError};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{LogLevel, Status};
use std::cell::RefCell;
use std::collections::HashMap;
use std::time::{Duration, UNIX_EPOCH};

/// proxy-wasm shared data and queues through the host calls.
#[derive(Default)]
pub(super) struct HostStore {
    /// Queue name → token (registered once per VM).
    queues: RefCell<HashMap<String, u32>>,
}

impl HostStore {
    fn queue(&self, name: &str) -> Result<u32, StoreError> {
        if let Some(t) = self.queues.borrow().get(name) {
            return Ok(*t);
        }
        let token =
            hostcalls::register_shared_queue(name).map_err(|s| StoreError::Host(s as u32))?;
        self.queues.borrow_mut().insert(name.to_string(), token);
        Ok(token)
    }
}

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), Some(cas))) => Ok(Some((bytes, cas))),
            Ok((Some(bytes), None)) => Ok(Some((bytes, 0))),
            Ok((None, _)) => Ok(None),
            Err(status) => Err(StoreError::Host(status as u32)),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), StoreError> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(status) => Err(StoreError::Host(status as u32)),
        }
    }

    fn enqueue(&self, queue: &str, value: &[u8]) -> Result<(), StoreError> {
        let token = self.queue(queue)?;
        hostcalls::enqueue_shared_queue(token, Some(value)).map_err(|s| StoreError::Host(s as u32))
    }

    fn dequeue(&self, queue: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let token = self.queue(queue)?;
        hostcalls::dequeue_shared_queue(token).map_err(|s| StoreError::Host(s as u32))
    }
}

/// HTTP calls through `dispatch_http_call`.
pub(super) struct HostDispatcher;

impl Dispatcher for HostDispatcher {
    fn get(
        &mut self,
        cluster: &str,
        authority: &str,
        path: &str,
        header: Option<(&str, &str)>,
        timeout_ms: u64,
    ) -> Option<u32> {
        let mut headers = vec![
            (":method", "GET"),
            (":path", path),
            (":authority", authority),
        ];
        if let Some(h) = header {
            headers.push(h);
        }
        hostcalls::dispatch_http_call(
            cluster,
            headers,
            None,
            vec![],
            Duration::from_millis(timeout_ms),
        )
        .ok()
    }
}

pub(super) fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

pub(super) fn now_us() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}
