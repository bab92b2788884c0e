//! The proxy-wasm ABI 0.2.1 constants and wire formats the host speaks.
//!
//! Numbers are those of the spec (`proxy-wasm/spec`, `abi-versions/v0.2.1/README.md`) and of the
//! Rust SDK 0.2.5 (`src/types.rs`).

use std::fmt;

/// `proxy_status_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Status {
    /// `OK`: success.
    Ok = 0,
    /// `NOT_FOUND`: no such key, map, context or queue.
    NotFound = 1,
    /// `BAD_ARGUMENT`: an argument is invalid.
    BadArgument = 2,
    /// `SERIALIZATION_FAILURE`.
    SerializationFailure = 3,
    /// `PARSE_FAILURE`.
    ParseFailure = 4,
    /// `INVALID_MEMORY_ACCESS`: a pointer/size outside the linear memory.
    InvalidMemoryAccess = 6,
    /// `EMPTY`: the queue is empty.
    Empty = 7,
    /// `CAS_MISMATCH`: the shared-data CAS is stale.
    CasMismatch = 8,
    /// `INTERNAL_FAILURE`.
    InternalFailure = 10,
    /// `UNIMPLEMENTED`: not supported by this host.
    Unimplemented = 12,
}

impl Status {
    /// The value returned to the guest.
    pub fn code(self) -> i32 {
        self as i32
    }
}

/// `proxy_log_level_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u32)]
pub enum LogLevel {
    /// `TRACE` (0).
    Trace = 0,
    /// `DEBUG` (1).
    Debug = 1,
    /// `INFO` (2).
    Info = 2,
    /// `WARN` (3).
    Warn = 3,
    /// `ERROR` (4).
    Error = 4,
    /// `CRITICAL` (5).
    Critical = 5,
}

impl LogLevel {
    /// The level with this ABI value.
    pub fn from_u32(v: u32) -> Option<LogLevel> {
        Some(match v {
            0 => LogLevel::Trace,
            1 => LogLevel::Debug,
            2 => LogLevel::Info,
            3 => LogLevel::Warn,
            4 => LogLevel::Error,
            5 => LogLevel::Critical,
            _ => return None,
        })
    }
}

/// `proxy_action_t`: what a stream callback asks the host to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// `CONTINUE` (0): pass the headers/body on.
    Continue,
    /// `PAUSE` (1): hold the stream (Envoy: StopIteration / StopIterationAndBuffer).
    Pause,
}

impl Action {
    /// The value with this ABI number.
    pub fn from_i32(v: i32) -> Option<Action> {
        match v {
            0 => Some(Action::Continue),
            1 => Some(Action::Pause),
            _ => None,
        }
    }
}

/// `proxy_map_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MapType {
    /// `HTTP_REQUEST_HEADERS` (0).
    RequestHeaders,
    /// `HTTP_REQUEST_TRAILERS` (1).
    RequestTrailers,
    /// `HTTP_RESPONSE_HEADERS` (2).
    ResponseHeaders,
    /// `HTTP_RESPONSE_TRAILERS` (3).
    ResponseTrailers,
    /// `GRPC_RECEIVE_INITIAL_METADATA` (4).
    GrpcInitialMetadata,
    /// `GRPC_RECEIVE_TRAILING_METADATA` (5).
    GrpcTrailingMetadata,
    /// `HTTP_CALL_RESPONSE_HEADERS` (6).
    HttpCallResponseHeaders,
    /// `HTTP_CALL_RESPONSE_TRAILERS` (7).
    HttpCallResponseTrailers,
}

impl MapType {
    /// The value with this ABI number.
    pub fn from_i32(v: i32) -> Option<MapType> {
        Some(match v {
            0 => MapType::RequestHeaders,
            1 => MapType::RequestTrailers,
            2 => MapType::ResponseHeaders,
            3 => MapType::ResponseTrailers,
            4 => MapType::GrpcInitialMetadata,
            5 => MapType::GrpcTrailingMetadata,
            6 => MapType::HttpCallResponseHeaders,
            7 => MapType::HttpCallResponseTrailers,
            _ => return None,
        })
    }
}

/// `proxy_buffer_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufferType {
    /// `HTTP_REQUEST_BODY` (0).
    RequestBody,
    /// `HTTP_RESPONSE_BODY` (1).
    ResponseBody,
    /// `DOWNSTREAM_DATA` (2).
    DownstreamData,
    /// `UPSTREAM_DATA` (3).
    UpstreamData,
    /// `HTTP_CALL_RESPONSE_BODY` (4).
    HttpCallResponseBody,
    /// `GRPC_RECEIVE_BUFFER` (5).
    GrpcReceiveBuffer,
    /// `VM_CONFIGURATION` (6).
    VmConfiguration,
    /// `PLUGIN_CONFIGURATION` (7).
    PluginConfiguration,
    /// `CALL_DATA` (8).
    CallData,
}

impl BufferType {
    /// The value with this ABI number.
    pub fn from_i32(v: i32) -> Option<BufferType> {
        Some(match v {
            0 => BufferType::RequestBody,
            1 => BufferType::ResponseBody,
            2 => BufferType::DownstreamData,
            3 => BufferType::UpstreamData,
            4 => BufferType::HttpCallResponseBody,
            5 => BufferType::GrpcReceiveBuffer,
            6 => BufferType::VmConfiguration,
            7 => BufferType::PluginConfiguration,
            8 => BufferType::CallData,
            _ => return None,
        })
    }
}

/// `proxy_stream_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamType {
    /// `HTTP_REQUEST` (0).
    HttpRequest,
    /// `HTTP_RESPONSE` (1).
    HttpResponse,
    /// `DOWNSTREAM` (2).
    Downstream,
    /// `UPSTREAM` (3).
    Upstream,
}

impl StreamType {
    /// The value with this ABI number.
    pub fn from_i32(v: i32) -> Option<StreamType> {
        Some(match v {
            0 => StreamType::HttpRequest,
            1 => StreamType::HttpResponse,
            2 => StreamType::Downstream,
            3 => StreamType::Upstream,
            _ => return None,
        })
    }
}

/// `proxy_metric_type_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetricKind {
    /// `COUNTER` (0).
    Counter,
    /// `GAUGE` (1).
    Gauge,
    /// `HISTOGRAM` (2).
    Histogram,
}

impl MetricKind {
    /// The value with this ABI number.
    pub fn from_i32(v: i32) -> Option<MetricKind> {
        Some(match v {
            0 => MetricKind::Counter,
            1 => MetricKind::Gauge,
            2 => MetricKind::Histogram,
            _ => return None,
        })
    }
}

/// An ordered multimap of header names to values, as Envoy keeps them: names are lower-cased
/// on the way in, duplicates are allowed, order is preserved. Values are bytes (HTTP allows
/// non-UTF-8 octets); [`HeaderMap::get`] gives them as `&str` when they are UTF-8.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeaderMap {
    pairs: Vec<(String, Vec<u8>)>,
}

impl HeaderMap {
    /// An empty map.
    pub fn new() -> HeaderMap {
        HeaderMap::default()
    }

    /// Builds a map from pairs, lower-casing the names.
    pub fn from_pairs<K: AsRef<str>, V: AsRef<[u8]>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.add(k.as_ref(), v.as_ref());
        }
        map
    }

    /// Number of (name, value) pairs, duplicates counted.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// No pairs.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Every pair in order, names lower-cased.
    pub fn pairs(&self) -> &[(String, Vec<u8>)] {
        &self.pairs
    }

    /// The first value of `name` (case-insensitive), as UTF-8; `None` when absent or not UTF-8.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.get_bytes(name)
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    /// The first value of `name` (case-insensitive). Envoy's `proxy_get_header_map_value`
    /// returns the first of several values too.
    pub fn get_bytes(&self, name: &str) -> Option<&[u8]> {
        let name = name.to_ascii_lowercase();
        self.pairs
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_slice())
    }

    /// Every value of `name`, in order.
    pub fn get_all(&self, name: &str) -> Vec<&[u8]> {
        let name = name.to_ascii_lowercase();
        self.pairs
            .iter()
            .filter(|(k, _)| *k == name)
            .map(|(_, v)| v.as_slice())
            .collect()
    }

    /// `name` has at least one value.
    pub fn contains(&self, name: &str) -> bool {
        self.get_bytes(name).is_some()
    }

    /// Appends a value (duplicates kept).
    pub fn add(&mut self, name: &str, value: &[u8]) {
        self.pairs.push((name.to_ascii_lowercase(), value.to_vec()));
    }

    /// Sets `name` to exactly one value: the first occurrence is overwritten in place, the
    /// others removed; appended when absent.
    pub fn replace(&mut self, name: &str, value: &[u8]) {
        let name = name.to_ascii_lowercase();
        let mut seen = false;
        self.pairs.retain_mut(|(k, v)| {
            if *k != name {
                return true;
            }
            if seen {
                return false;
            }
            seen = true;
            *v = value.to_vec();
            true
        });
        if !seen {
            self.pairs.push((name, value.to_vec()));
        }
    }

    /// Removes every value of `name`.
    pub fn remove(&mut self, name: &str) {
        let name = name.to_ascii_lowercase();
        self.pairs.retain(|(k, _)| *k != name);
    }

    /// The ABI serialisation: u32 count, then (u32 key_len, u32 value_len) per pair, then each
    /// key and each value followed by a NUL byte. All integers little-endian.
    pub fn serialize(&self) -> Vec<u8> {
        serialize_pairs(self.pairs.iter().map(|(k, v)| (k.as_bytes(), v.as_slice())))
    }

    /// Parses the ABI serialisation (names lower-cased).
    pub fn deserialize(bytes: &[u8]) -> Result<HeaderMap, MapDecodeError> {
        let pairs = deserialize_pairs(bytes)?;
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            let key = String::from_utf8(k).map_err(|_| MapDecodeError::KeyNotUtf8)?;
            map.add(&key, &v);
        }
        Ok(map)
    }
}

/// Serialises key/value pairs in the ABI map format (see [`HeaderMap::serialize`]).
pub fn serialize_pairs<'a>(pairs: impl Iterator<Item = (&'a [u8], &'a [u8])> + Clone) -> Vec<u8> {
    let mut count: u32 = 0;
    let mut size = 4usize;
    for (k, v) in pairs.clone() {
        count = count.saturating_add(1);
        size = size.saturating_add(k.len() + v.len() + 10);
    }
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&count.to_le_bytes());
    for (k, v) in pairs.clone() {
        out.extend_from_slice(&len_u32(k.len()).to_le_bytes());
        out.extend_from_slice(&len_u32(v.len()).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
    out
}

fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Why a serialised map was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MapDecodeError {
    /// Fewer bytes than the header or the declared lengths need.
    Truncated,
    /// A key or value is not followed by its NUL terminator.
    MissingNul,
    /// Bytes left over after the last value.
    TrailingBytes(usize),
    /// A header name is not UTF-8.
    KeyNotUtf8,
}

impl fmt::Display for MapDecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MapDecodeError::Truncated => write!(f, "serialised map is truncated"),
            MapDecodeError::MissingNul => {
                write!(f, "serialised map entry is not NUL-terminated")
            }
            MapDecodeError::TrailingBytes(n) => {
                write!(f, "serialised map has {n} trailing bytes")
            }
            MapDecodeError::KeyNotUtf8 => write!(f, "serialised map has a non-UTF-8 name"),
        }
    }
}

impl std::error::Error for MapDecodeError {}

/// Key/value pairs as bytes.
pub type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// Parses the ABI map format. An empty input is an empty map (the SDK sends nothing for it).
pub fn deserialize_pairs(bytes: &[u8]) -> Result<Pairs, MapDecodeError> {
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let count = read_u32(bytes, 0).ok_or(MapDecodeError::Truncated)? as usize;
    let header_end = count
        .checked_mul(8)
        .and_then(|n| n.checked_add(4))
        .ok_or(MapDecodeError::Truncated)?;
    if header_end > bytes.len() {
        return Err(MapDecodeError::Truncated);
    }
    let mut out = Vec::with_capacity(count);
    let mut p = header_end;
    for i in 0..count {
        let at = 4 + i * 8;
        let klen = read_u32(bytes, at).ok_or(MapDecodeError::Truncated)? as usize;
        let vlen = read_u32(bytes, at + 4).ok_or(MapDecodeError::Truncated)? as usize;
        let key = take_nul_terminated(bytes, &mut p, klen)?;
        let value = take_nul_terminated(bytes, &mut p, vlen)?;
        out.push((key, value));
    }
    if p != bytes.len() {
        return Err(MapDecodeError::TrailingBytes(bytes.len() - p));
    }
    Ok(out)
}

fn take_nul_terminated(bytes: &[u8], p: &mut usize, len: usize) -> Result<Vec<u8>, MapDecodeError> {
    let end = p.checked_add(len).ok_or(MapDecodeError::Truncated)?;
    let data = bytes.get(*p..end).ok_or(MapDecodeError::Truncated)?;
    match bytes.get(end) {
        Some(0) => {}
        Some(_) => return Err(MapDecodeError::MissingNul),
        None => return Err(MapDecodeError::Truncated),
    }
    *p = end + 1;
    Ok(data.to_vec())
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    let arr: [u8; 4] = b.try_into().ok()?;
    Some(u32::from_le_bytes(arr))
}

/// Splits a property path as the SDK serialises it (parts joined by NUL).
pub fn split_property_path(path: &[u8]) -> Vec<String> {
    if path.is_empty() {
        return Vec::new();
    }
    path.split(|b| *b == 0)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_map_serialisation_matches_the_abi_layout_byte_for_byte() {
        let map = HeaderMap::from_pairs([(":method", "GET"), ("x-a", "")]);
        let bytes = map.serialize();
        let mut expected = vec![2, 0, 0, 0, 7, 0, 0, 0, 3, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0];
        expected.extend_from_slice(b":method\0GET\0x-a\0\0");
        assert_eq!(bytes, expected);
    }

    #[test]
    fn header_map_round_trips_through_the_abi_serialisation() {
        let map = HeaderMap::from_pairs([
            (":path", "/v1/chat/completions".as_bytes()),
            ("x-dup", b"1".as_slice()),
            ("x-dup", b"2".as_slice()),
            ("bin", &[0xff, 0x00, 0x41][..]),
        ]);
        let back = HeaderMap::deserialize(&map.serialize()).unwrap();
        assert_eq!(back, map);
        assert_eq!(
            back.get_all("X-Dup"),
            vec![b"1".as_slice(), b"2".as_slice()]
        );
        assert_eq!(back.get_bytes("bin"), Some(&[0xff, 0x00, 0x41][..]));
        assert_eq!(back.get("bin"), None, "not UTF-8");
    }

    #[test]
    fn empty_input_is_an_empty_map_and_zero_count_round_trips() {
        assert!(deserialize_pairs(&[]).unwrap().is_empty());
        let empty = HeaderMap::new().serialize();
        assert_eq!(empty, vec![0, 0, 0, 0]);
        assert!(HeaderMap::deserialize(&empty).unwrap().is_empty());
    }

    #[test]
    fn malformed_maps_are_refused_with_the_reason() {
        let good = HeaderMap::from_pairs([("a", "b")]).serialize();
        assert_eq!(
            deserialize_pairs(&good[..good.len() - 1]),
            Err(MapDecodeError::Truncated)
        );
        let mut no_nul = good.clone();
        let last = no_nul.len() - 1;
        no_nul[last] = b'x';
        assert_eq!(deserialize_pairs(&no_nul), Err(MapDecodeError::MissingNul));
        let mut trailing = good.clone();
        trailing.push(7);
        assert_eq!(
            deserialize_pairs(&trailing),
            Err(MapDecodeError::TrailingBytes(1))
        );
        // a count that cannot fit
        assert_eq!(
            deserialize_pairs(&[0xff, 0xff, 0xff, 0x7f]),
            Err(MapDecodeError::Truncated)
        );
    }

    #[test]
    fn replace_keeps_one_value_in_the_first_position_and_names_are_case_insensitive() {
        let mut map = HeaderMap::from_pairs([("A", "1"), ("b", "2"), ("a", "3")]);
        map.replace("a", b"9");
        assert_eq!(map.pairs().len(), 2);
        assert_eq!(map.pairs()[0], ("a".to_string(), b"9".to_vec()));
        map.remove("A");
        assert!(!map.contains("a"));
        map.replace("new", b"x");
        assert_eq!(map.get("NEW"), Some("x"));
    }

    #[test]
    fn property_paths_split_on_nul() {
        assert_eq!(
            split_property_path(b"plugin_root_id"),
            vec!["plugin_root_id".to_string()]
        );
        assert_eq!(
            split_property_path(b"request\0path"),
            vec!["request".to_string(), "path".to_string()]
        );
        assert!(split_property_path(b"").is_empty());
    }
}
