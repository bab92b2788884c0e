//! vLLM's KV-cache events: decoder and encoder of the msgpack wire format (no I/O).
//!
//! The format comes from vLLM 0.33.0, `vllm/distributed/kv_events.py` (PyPI wheel
//! `vllm-0.33.0`), and its positional predecessor from vLLM 0.23.0 (the last release that
//! sent events as arrays; 0.24.0 switched to maps). Checked against the classes of both
//! wheels by `scripts/make-kv-event-fixtures.py`, whose output `tests/kv_events.rs` decodes.
//!
//! ## Frames (`ZmqEventPublisher`)
//! A ZMQ PUB socket sends multipart messages `[topic, seq, payload]`: `topic` is the
//! configured topic's UTF-8 bytes (default empty), `seq` a counter from 0 as 8 bytes
//! big-endian, `payload` one msgpack-encoded `EventBatch` ([`decode_message`]). The optional
//! replay ROUTER socket takes a request whose last frame is the start sequence number (8 bytes
//! big-endian; a REQ socket adds the empty delimiter frame itself, a DEALER must send it),
//! answers every buffered `(seq, payload)` with `seq >= start` as `[topic, seq, payload]`
//! (after the empty delimiter), then `["", -1 as 8 bytes signed big-endian, ""]`
//! ([`is_replay_end`]).
//!
//! ## Payload
//! `EventBatch` is a msgspec struct with `array_like=True`: `[ts, events, data_parallel_rank]`
//! (msgspec writes all three even though the struct says `omit_defaults`; the publisher fills
//! in its data-parallel rank when the engine left it `None`). Each event is a msgspec struct
//! tagged with its class name:
//!
//! - vLLM >= 0.24 (current): a map whose `"type"` key holds the tag (`"BlockStored"`,
//!   `"BlockRemoved"`, `"AllBlocksCleared"`), then the fields; fields without a default are
//!   always written (`lora_id: None` included), fields equal to their default are omitted.
//! - vLLM <= 0.23 (legacy, `array_like=True`): an array whose first element is the tag, then
//!   every field in declaration order. `BlockStored`: `block_hashes, parent_block_hash,
//!   token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx,
//!   kv_cache_spec_kind, kv_cache_spec_sliding_window`; `BlockRemoved`: `block_hashes, medium,
//!   group_idx`. Older releases had fewer trailing fields; missing ones take their defaults.
//!
//! This decoder accepts an array or a map at both levels, fields in any order, unknown
//! fields (skipped), and unknown event types ([`KvEvent::Unknown`]).
//!
//! Block hashes (`ExternalBlockHash = bytes | int`): with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`
//! (the default) the low 64 bits of the hash as an unsigned int (msgpack uint64 when large);
//! older vLLM sent Python `hash()` values (signed); with the variable at 0 the raw digest
//! bytes (32 for sha256). [`EngineHash`] folds all of them into 64 bits.
//!
//! `extra_keys` holds one entry per block: `None`, or the block's keys in the order vLLM
//! hashed them, untagged: the LoRA name (a string), `(mm_identifier, offset)` pairs for the
//! multimodal items overlapping the block (offset = item start - block start), the cache
//! salt (a string, first block only) and prompt-embeds digests (bytes).
//!
//! ## Bounds
//! Every declared length is checked against the bytes that remain before anything is
//! allocated; counts are capped by [`KvEventLimits`]; and the decoded size is capped at
//! 16 times the payload plus 64 KiB, so no input makes the decoder allocate much more than it
//! read. Nothing here panics on any input.

mod decode;
mod encode;
#[cfg(test)]
mod tests;

pub use decode::decode_batch;
pub use encode::encode_batch;
use std::fmt;

/// An engine block hash as 64 bits: an int hash as its two's-complement low 64 bits; a bytes
/// hash as its last 8 bytes, big-endian (llm-d's convention; shorter bytes are left-padded).
pub type EngineHash = u64;

/// Caps on what one payload may make the decoder hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventLimits {
    /// Largest payload decoded at all.
    pub max_payload_bytes: usize,
    /// Events in one batch.
    pub max_events: usize,
    /// Block hashes in one batch (all events together), and `extra_keys` entries per event.
    pub max_hashes: usize,
    /// Bytes of one string (medium, LoRA name, mm identifier, event type, topic). An
    /// extra-key string longer than this becomes [`ExtraKey::Other`] instead of an error.
    pub max_string_bytes: usize,
    /// Nesting depth of arrays and maps (the batch itself is depth 1; vLLM's deepest value,
    /// an mm extra key, is at depth 6).
    pub max_depth: usize,
}

impl Default for KvEventLimits {
    /// 32 MiB payloads, 65,536 events and 1,048,576 block hashes per batch, 64 KiB strings,
    /// depth 16. A vLLM step stores at most `max_num_batched_tokens / block_size` new blocks
    /// (512 at 8,192 tokens and 16-token blocks) and evicts as many, far below these; the
    /// caps only stop hostile or corrupt input.
    fn default() -> Self {
        KvEventLimits {
            max_payload_bytes: 32 << 20,
            max_events: 1 << 16,
            max_hashes: 1 << 20,
            max_string_bytes: 64 << 10,
            max_depth: 16,
        }
    }
}

/// One `EventBatch`: the events of one engine step.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Seconds since the Unix epoch when the step published (`time.time()`).
    pub ts: f64,
    pub events: Vec<KvEvent>,
    /// The publishing engine's data-parallel rank (`None` when the batch carries none).
    pub data_parallel_rank: Option<i64>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved {
        block_hashes: Vec<EngineHash>,
        medium: Option<String>,
        /// The KV-cache group the blocks belonged to (vLLM 0.23 and 0.33 write it, 0.11 did
        /// not; hybrid models have several groups that store and remove the same hashes
        /// independently).
        group_idx: Option<i64>,
    },
    AllBlocksCleared {
        medium: Option<String>,
    },
    /// An event type this decoder does not know (counted and skipped, never an error).
    Unknown {
        kind: String,
    },
}

/// Blocks whose KV content entered the cache, in sequence order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineHash>,
    /// The hash of the block before the first one (`None` at the start of a sequence).
    pub parent_block_hash: Option<EngineHash>,
    /// The tokens of all the blocks, concatenated.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_name: Option<String>,
    /// Where the blocks live: `"GPU"`, `"CPU"`, `"STORAGE"` (offloading tiers), ...
    pub medium: Option<String>,
    /// One entry per block (empty when the event has none for that block).
    pub extra_keys: Vec<Vec<ExtraKey>>,
    /// The KV-cache group (see [`KvEvent::BlockRemoved`]).
    pub group_idx: Option<i64>,
    /// The group's cache spec kind, e.g. `"full_attention"`, `"sliding_window"`.
    pub kv_cache_spec_kind: Option<String>,
}

/// One extra key of a block, as published (untagged).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A multimodal item overlapping the block: its identifier and placeholder start minus
    /// block start (0, -16, -32, ...).
    Mm { identifier: String, offset: i64 },
    /// A bare string key (a LoRA name or a cache salt: the wire does not tag which).
    Text(String),
    /// Anything else (prompt-embeds digests, ints), kept opaque.
    Other,
}

/// One ZMQ message of the event stream.
#[derive(Debug, Clone, PartialEq)]
pub struct KvMessage {
    pub topic: Vec<u8>,
    pub seq: u64,
    pub batch: EventBatch,
}

/// The forms vLLM has sent: `Tagged` (maps tagged by "type", current) and `Positional` (arrays).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireForm {
    Tagged,
    Positional,
}

/// How [`encode_batch`] writes block hashes: `Int` as vLLM's default (an unsigned msgpack
/// int), `Bytes` as an 8-byte big-endian bin (vLLM sends the whole digest; its last 8 bytes
/// are what [`EngineHash`] keeps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashEncoding {
    Int,
    Bytes,
}

/// The sequence number of the replay end marker (-1 as 8 signed big-endian bytes).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// Why a payload or message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventError {
    /// The payload is larger than [`KvEventLimits::max_payload_bytes`].
    PayloadTooLarge { len: usize, max: usize },
    /// The payload ends in the middle of a value.
    Truncated { offset: usize },
    /// A length or count that the remaining bytes cannot hold.
    LengthBeyondEnd {
        offset: usize,
        declared: u64,
        remaining: usize,
    },
    /// A value of the wrong type or shape for its place.
    Malformed { offset: usize, message: String },
    /// A cap of [`KvEventLimits`] (or the decoded-size cap) was reached.
    Limit { what: &'static str, limit: usize },
    /// Bytes after the batch.
    TrailingBytes { offset: usize, extra: usize },
    /// The ZMQ frames are not `[topic, seq, payload]`.
    Frames { message: String },
}

impl fmt::Display for KvEventError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvEventError::PayloadTooLarge { len, max } => write!(
                f,
                "KV-event payload of {len} bytes is over the limit of {max} bytes"
            ),
            KvEventError::Truncated { offset } => {
                write!(
                    f,
                    "KV-event payload ends in the middle of a value at byte {offset}"
                )
            }
            KvEventError::LengthBeyondEnd {
                offset,
                declared,
                remaining,
            } => write!(
                f,
                "KV-event payload declares a length of {declared} at byte {offset} but only \
                 {remaining} bytes remain"
            ),
            KvEventError::Malformed { offset, message } => {
                write!(f, "malformed KV-event payload at byte {offset}: {message}")
            }
            KvEventError::Limit { what, limit } => {
                write!(f, "KV-event payload exceeds the limit of {limit} {what}")
            }
            KvEventError::TrailingBytes { offset, extra } => write!(
                f,
                "KV-event payload has {extra} bytes after the event batch (from byte {offset})"
            ),
            KvEventError::Frames { message } => write!(f, "KV-event message: {message}"),
        }
    }
}

impl std::error::Error for KvEventError {}

/// Decodes one ZMQ message: `[topic, seq, payload]` as the PUB socket sends it, or
/// `["", topic, seq, payload]` as a DEALER receives a replayed one. The replay end marker
/// carries no batch and is an error here: test for it first with [`is_replay_end`].
pub fn decode_message(frames: &[&[u8]], limits: &KvEventLimits) -> Result<KvMessage, KvEventError> {
    let (topic, seq, payload) = match frames {
        [topic, seq, payload] => (*topic, *seq, *payload),
        [[], topic, seq, payload] => (*topic, *seq, *payload),
        _ => {
            return Err(KvEventError::Frames {
                message: format!(
                    "expected 3 frames [topic, seq, payload], got {}",
                    frames.len()
                ),
            });
        }
    };
    let seq = seq_of(seq)?;
    if seq == REPLAY_END_SEQ && payload.is_empty() {
        return Err(KvEventError::Frames {
            message: "the replay end marker (seq -1) carries no batch".into(),
        });
    }
    if topic.len() > limits.max_string_bytes {
        return Err(KvEventError::Limit {
            what: "bytes of topic",
            limit: limits.max_string_bytes,
        });
    }
    Ok(KvMessage {
        topic: topic.to_vec(),
        seq,
        batch: decode_batch(payload, limits)?,
    })
}

/// Whether `frames` is the replay end marker `[topic, -1, ""]` (or `["", topic, -1, ""]`).
pub fn is_replay_end(frames: &[&[u8]]) -> bool {
    let (seq, payload) = match frames {
        [_, seq, payload] => (*seq, *payload),
        [[], _, seq, payload] => (*seq, *payload),
        _ => return false,
    };
    payload.is_empty() && seq_of(seq) == Ok(REPLAY_END_SEQ)
}

fn seq_of(frame: &[u8]) -> Result<u64, KvEventError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| KvEventError::Frames {
        message: format!(
            "the sequence frame has {} bytes, expected 8 (big-endian)",
            frame.len()
        ),
    })?;
    Ok(u64::from_be_bytes(bytes))
}
