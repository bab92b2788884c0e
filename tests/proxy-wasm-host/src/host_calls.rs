//! [`HostCalls`]: how many times the module called each host function, and from which
//! callback, so that a test can pin the host-call cost of a request.

use std::collections::BTreeMap;

/// Host calls (calls of the module's imports) counted per callback and per import.
///
/// Each call of a proxy-wasm or WASI function the host implements is counted once, under the
/// export that was running (`proxy_on_request_body`, `proxy_on_http_call_response`, ...) and
/// the import's name (`proxy_get_buffer_bytes`, `fd_write`, ...), for the context the call was
/// made for: a stream's calls are in its [`Exchange::host_calls`](crate::Exchange::host_calls)
/// (including calls made after `proxy_set_effective_context` switched to it), the rest in
/// [`Vm::root_host_calls`](crate::Vm::root_host_calls). Calls the module's allocator makes while
/// the host hands it memory count under the callback that asked for it. Imports the host does
/// not implement trap, so they are not counted.
///
/// ```
/// use proxy_wasm_host::HostCalls;
/// let calls = HostCalls::default();
/// assert_eq!(calls.total(), 0);
/// assert_eq!(calls.count("proxy_log"), 0);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostCalls {
    counts: BTreeMap<(&'static str, &'static str), u64>,
}

impl HostCalls {
    /// Counts one call of `import` made from `callback`.
    pub(crate) fn record(&mut self, callback: &'static str, import: &'static str) {
        *self.counts.entry((callback, import)).or_insert(0) += 1;
    }

    /// Every host call counted.
    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    /// Calls of `import` (e.g. `"proxy_get_shared_data"`), from any callback.
    pub fn count(&self, import: &str) -> u64 {
        self.counts
            .iter()
            .filter(|((_, i), _)| *i == import)
            .map(|(_, n)| n)
            .sum()
    }

    /// Calls per import, from any callback, sorted by import name.
    pub fn by_import(&self) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for ((_, import), n) in &self.counts {
            *out.entry(*import).or_insert(0) += n;
        }
        out
    }

    /// Only the calls made from `callback` (an export name such as
    /// `"proxy_on_request_headers"`).
    pub fn in_callback(&self, callback: &str) -> HostCalls {
        HostCalls {
            counts: self
                .counts
                .iter()
                .filter(|((c, _), _)| *c == callback)
                .map(|(k, n)| (*k, *n))
                .collect(),
        }
    }

    /// Every (callback, import, count), sorted by callback then import.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &'static str, u64)> + '_ {
        self.counts.iter().map(|((c, i), n)| (*c, *i, *n))
    }

    /// The calls counted here and not in `earlier` (a snapshot of the same counter taken
    /// before): what happened in between.
    pub fn since(&self, earlier: &HostCalls) -> HostCalls {
        HostCalls {
            counts: self
                .counts
                .iter()
                .filter_map(|(k, n)| {
                    let before = earlier.counts.get(k).copied().unwrap_or(0);
                    (*n > before).then(|| (*k, n - before))
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sum_per_import_and_split_per_callback() {
        let mut calls = HostCalls::default();
        calls.record("proxy_on_request_headers", "proxy_get_header_map_value");
        calls.record("proxy_on_request_headers", "proxy_get_header_map_value");
        calls.record("proxy_on_request_body", "proxy_get_buffer_bytes");
        calls.record("proxy_on_request_body", "proxy_get_header_map_value");
        assert_eq!(calls.total(), 4);
        assert_eq!(calls.count("proxy_get_header_map_value"), 3);
        assert_eq!(calls.count("proxy_log"), 0);
        assert_eq!(
            calls.by_import().into_iter().collect::<Vec<_>>(),
            vec![
                ("proxy_get_buffer_bytes", 1),
                ("proxy_get_header_map_value", 3)
            ]
        );
        let body = calls.in_callback("proxy_on_request_body");
        assert_eq!(body.total(), 2);
        assert_eq!(body.count("proxy_get_header_map_value"), 1);
        assert_eq!(
            calls.iter().next(),
            Some(("proxy_on_request_body", "proxy_get_buffer_bytes", 1))
        );
    }

    #[test]
    fn since_is_the_difference_of_two_snapshots() {
        let mut calls = HostCalls::default();
        calls.record("proxy_on_tick", "proxy_get_shared_data");
        let before = calls.clone();
        calls.record("proxy_on_tick", "proxy_get_shared_data");
        calls.record("proxy_on_tick", "proxy_http_call");
        let delta = calls.since(&before);
        assert_eq!(delta.total(), 2);
        assert_eq!(delta.count("proxy_get_shared_data"), 1);
        assert_eq!(delta.count("proxy_http_call"), 1);
        assert_eq!(calls.since(&calls), HostCalls::default());
    }
}
