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

/// Decodes one msgpack `EventBatch` payload.
pub fn decode_batch(payload: &[u8], limits: &KvEventLimits) -> Result<EventBatch, KvEventError> {
    if payload.len() > limits.max_payload_bytes {
        return Err(KvEventError::PayloadTooLarge {
            len: payload.len(),
            max: limits.max_payload_bytes,
        });
    }
    let mut r = Reader::new(payload, limits);
    let batch = r.batch()?;
    if r.pos < payload.len() {
        return Err(KvEventError::TrailingBytes {
            offset: r.pos,
            extra: payload.len() - r.pos,
        });
    }
    Ok(batch)
}

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

// ---------------------------------------------------------------------------------------
// Reading msgpack

/// The head of one msgpack value: its type and, for strings, binaries, extensions and
/// containers, its declared length (not yet checked against the remaining bytes).
#[derive(Debug, Clone, Copy)]
enum Head {
    Nil,
    Bool,
    Int(i128),
    Float(f64),
    Str(u64),
    Bin(u64),
    /// Extension: data length (the type byte is already consumed).
    Ext(u64),
    Array(u64),
    Map(u64),
}

impl Head {
    fn name(self) -> &'static str {
        match self {
            Head::Nil => "nil",
            Head::Bool => "a boolean",
            Head::Int(_) => "an integer",
            Head::Float(_) => "a float",
            Head::Str(_) => "a string",
            Head::Bin(_) => "binary data",
            Head::Ext(_) => "an extension value",
            Head::Array(_) => "an array",
            Head::Map(_) => "a map",
        }
    }
}

/// Which field of an event a position holds (positional form) or a key names (map form).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraName,
    Medium,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    /// Known or not, this decoder does not keep it.
    Skip,
}

const STORED_POSITIONS: &[Field] = &[
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::Skip, // lora_id (deprecated)
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::KvCacheSpecKind,
];
const REMOVED_POSITIONS: &[Field] = &[Field::BlockHashes, Field::Medium, Field::GroupIdx];
/// vLLM's `AllBlocksCleared` has no fields; a medium written by [`encode_batch`] comes first.
const CLEARED_POSITIONS: &[Field] = &[Field::Medium];

fn field_named(name: &[u8]) -> Field {
    match name {
        b"block_hashes" => Field::BlockHashes,
        b"parent_block_hash" => Field::ParentBlockHash,
        b"token_ids" => Field::TokenIds,
        b"block_size" => Field::BlockSize,
        b"lora_name" => Field::LoraName,
        b"medium" => Field::Medium,
        b"extra_keys" => Field::ExtraKeys,
        b"group_idx" => Field::GroupIdx,
        b"kv_cache_spec_kind" => Field::KvCacheSpecKind,
        _ => Field::Skip,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn kind_of(tag: &[u8]) -> Kind {
    match tag {
        b"BlockStored" => Kind::Stored,
        b"BlockRemoved" => Kind::Removed,
        b"AllBlocksCleared" => Kind::Cleared,
        _ => Kind::Unknown,
    }
}

/// The fields of one event as they are read.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineHash>>,
    parent_block_hash: Option<EngineHash>,
    token_ids: Vec<u32>,
    block_size: u32,
    lora_name: Option<String>,
    medium: Option<String>,
    extra_keys: Vec<Vec<ExtraKey>>,
    group_idx: Option<i64>,
    kv_cache_spec_kind: Option<String>,
}

// Depths of the values vLLM sends (the batch is 1).
const DEPTH_EVENTS: usize = 2;
const DEPTH_EVENT: usize = 3;
const DEPTH_FIELD: usize = 4;
const DEPTH_EXTRA_ENTRY: usize = 5;
const DEPTH_EXTRA_ITEM: usize = 6;

/// Elements reserved up front at most, whatever a length says (the rest grows as read).
const PREALLOC: usize = 1024;

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: &'a KvEventLimits,
    /// Bytes the decoded values may still take (see the module docs).
    budget: usize,
    /// Block hashes read so far in this batch.
    hashes: usize,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], limits: &'a KvEventLimits) -> Reader<'a> {
        Reader {
            buf,
            pos: 0,
            limits,
            budget: buf.len().saturating_mul(16).saturating_add(64 << 10),
            hashes: 0,
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn malformed(&self, at: usize, message: impl Into<String>) -> KvEventError {
        KvEventError::Malformed {
            offset: at,
            message: message.into(),
        }
    }

    fn unexpected(&self, at: usize, what: &str, expected: &str, found: Head) -> KvEventError {
        self.malformed(
            at,
            format!("{what}: expected {expected}, found {}", found.name()),
        )
    }

    fn charge(&mut self, bytes: usize) -> Result<(), KvEventError> {
        match self.budget.checked_sub(bytes) {
            Some(left) => {
                self.budget = left;
                Ok(())
            }
            None => Err(KvEventError::Limit {
                what: "bytes of decoded values (16 times the payload plus 64 KiB)",
                limit: self.buf.len().saturating_mul(16).saturating_add(64 << 10),
            }),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], KvEventError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(KvEventError::Truncated {
                offset: self.buf.len(),
            })?;
        let s = self.buf.get(self.pos..end).ok_or(KvEventError::Truncated {
            offset: self.buf.len(),
        })?;
        self.pos = end;
        Ok(s)
    }

    fn byte(&mut self) -> Result<u8, KvEventError> {
        let b = *self.buf.get(self.pos).ok_or(KvEventError::Truncated {
            offset: self.buf.len(),
        })?;
        self.pos += 1;
        Ok(b)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], KvEventError> {
        let s = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn head(&mut self) -> Result<Head, KvEventError> {
        let at = self.pos;
        let m = self.byte()?;
        Ok(match m {
            0x00..=0x7f => Head::Int(i128::from(m)),
            0x80..=0x8f => Head::Map(u64::from(m & 0x0f)),
            0x90..=0x9f => Head::Array(u64::from(m & 0x0f)),
            0xa0..=0xbf => Head::Str(u64::from(m & 0x1f)),
            0xc0 => Head::Nil,
            0xc1 => return Err(self.malformed(at, "the reserved marker 0xc1")),
            0xc2 | 0xc3 => Head::Bool,
            0xc4 => Head::Bin(u64::from(self.byte()?)),
            0xc5 => Head::Bin(u64::from(u16::from_be_bytes(self.be()?))),
            0xc6 => Head::Bin(u64::from(u32::from_be_bytes(self.be()?))),
            0xc7 => {
                let n = u64::from(self.byte()?);
                self.byte()?;
                Head::Ext(n)
            }
            0xc8 => {
                let n = u64::from(u16::from_be_bytes(self.be()?));
                self.byte()?;
                Head::Ext(n)
            }
            0xc9 => {
                let n = u64::from(u32::from_be_bytes(self.be()?));
                self.byte()?;
                Head::Ext(n)
            }
            0xca => Head::Float(f64::from(f32::from_be_bytes(self.be()?))),
            0xcb => Head::Float(f64::from_be_bytes(self.be()?)),
            0xcc => Head::Int(i128::from(self.byte()?)),
            0xcd => Head::Int(i128::from(u16::from_be_bytes(self.be()?))),
            0xce => Head::Int(i128::from(u32::from_be_bytes(self.be()?))),
            0xcf => Head::Int(i128::from(u64::from_be_bytes(self.be()?))),
            0xd0 => Head::Int(i128::from(i8::from_be_bytes(self.be()?))),
            0xd1 => Head::Int(i128::from(i16::from_be_bytes(self.be()?))),
            0xd2 => Head::Int(i128::from(i32::from_be_bytes(self.be()?))),
            0xd3 => Head::Int(i128::from(i64::from_be_bytes(self.be()?))),
            0xd4..=0xd8 => {
                self.byte()?;
                Head::Ext(1u64 << (m - 0xd4))
            }
            0xd9 => Head::Str(u64::from(self.byte()?)),
            0xda => Head::Str(u64::from(u16::from_be_bytes(self.be()?))),
            0xdb => Head::Str(u64::from(u32::from_be_bytes(self.be()?))),
            0xdc => Head::Array(u64::from(u16::from_be_bytes(self.be()?))),
            0xdd => Head::Array(u64::from(u32::from_be_bytes(self.be()?))),
            0xde => Head::Map(u64::from(u16::from_be_bytes(self.be()?))),
            0xdf => Head::Map(u64::from(u32::from_be_bytes(self.be()?))),
            0xe0..=0xff => Head::Int(i128::from(m as i8)),
        })
    }

    /// Checks that `n` items of at least `min_bytes` each fit in what remains.
    fn fits(&self, at: usize, n: u64, min_bytes: u64) -> Result<usize, KvEventError> {
        let need = n.saturating_mul(min_bytes);
        if need > self.remaining() as u64 {
            return Err(KvEventError::LengthBeyondEnd {
                offset: at,
                declared: n,
                remaining: self.remaining(),
            });
        }
        usize::try_from(n).map_err(|_| KvEventError::LengthBeyondEnd {
            offset: at,
            declared: n,
            remaining: self.remaining(),
        })
    }

    fn depth_ok(&self, depth: usize) -> Result<(), KvEventError> {
        if depth > self.limits.max_depth {
            return Err(KvEventError::Limit {
                what: "levels of nesting",
                limit: self.limits.max_depth,
            });
        }
        Ok(())
    }

    /// Reads an array head (checked against the remaining bytes) at nesting `depth`.
    fn array(&mut self, what: &str, depth: usize) -> Result<usize, KvEventError> {
        let at = self.pos;
        match self.head()? {
            Head::Array(n) => {
                self.depth_ok(depth)?;
                self.fits(at, n, 1)
            }
            h => Err(self.unexpected(at, what, "an array", h)),
        }
    }

    /// Skips one value whose head is `h` (already read) at nesting `depth`, without
    /// recursion: `stack` holds what is left of each open container.
    fn skip_after(&mut self, at: usize, h: Head, depth: usize) -> Result<(), KvEventError> {
        let mut stack: Vec<u64> = Vec::new();
        let mut left: u64 = 0;
        let mut next = Some((at, h));
        loop {
            let (at, h) = match next.take() {
                Some(x) => x,
                None => {
                    while left == 0 {
                        match stack.pop() {
                            Some(l) => left = l,
                            None => return Ok(()),
                        }
                    }
                    left -= 1;
                    let at = self.pos;
                    (at, self.head()?)
                }
            };
            let items = match h {
                Head::Str(n) | Head::Bin(n) | Head::Ext(n) => {
                    let n = self.fits(at, n, 1)?;
                    self.take(n)?;
                    0
                }
                Head::Array(n) => n,
                Head::Map(n) => n.saturating_mul(2),
                Head::Nil | Head::Bool | Head::Int(_) | Head::Float(_) => 0,
            };
            if items > 0 {
                self.depth_ok(depth + stack.len())?;
                self.fits(at, items, 1)?;
                stack.push(left);
                left = items;
            }
        }
    }

    fn skip(&mut self, depth: usize) -> Result<(), KvEventError> {
        let at = self.pos;
        let h = self.head()?;
        self.skip_after(at, h, depth)
    }

    /// A string's bytes (no allocation, so no limit but the payload's).
    fn str_bytes(&mut self, what: &'static str) -> Result<&'a [u8], KvEventError> {
        let at = self.pos;
        match self.head()? {
            Head::Str(n) => {
                let n = self.fits(at, n, 1)?;
                self.take(n)
            }
            h => Err(self.unexpected(at, what, "a string", h)),
        }
    }

    fn str_body(
        &mut self,
        at: usize,
        n: u64,
        what: &'static str,
    ) -> Result<&'a [u8], KvEventError> {
        let n = self.fits(at, n, 1)?;
        if n > self.limits.max_string_bytes {
            return Err(KvEventError::Limit {
                what,
                limit: self.limits.max_string_bytes,
            });
        }
        self.take(n)
    }

    fn owned(&mut self, at: usize, bytes: &[u8], what: &str) -> Result<String, KvEventError> {
        let s = std::str::from_utf8(bytes)
            .map_err(|_| self.malformed(at, format!("{what}: not valid UTF-8")))?;
        self.charge(s.len())?;
        Ok(s.to_string())
    }

    fn opt_string(&mut self, what: &'static str) -> Result<Option<String>, KvEventError> {
        let at = self.pos;
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Str(n) => {
                let b = self.str_body(at, n, what)?;
                self.owned(at, b, what).map(Some)
            }
            h => Err(self.unexpected(at, what, "a string or nil", h)),
        }
    }

    fn int(&mut self, what: &str) -> Result<i128, KvEventError> {
        let at = self.pos;
        match self.head()? {
            Head::Int(v) => Ok(v),
            h => Err(self.unexpected(at, what, "an integer", h)),
        }
    }

    fn opt_i64(&mut self, what: &str) -> Result<Option<i64>, KvEventError> {
        let at = self.pos;
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Int(v) => i64::try_from(v)
                .map(Some)
                .map_err(|_| self.malformed(at, format!("{what}: {v} is out of range"))),
            h => Err(self.unexpected(at, what, "an integer or nil", h)),
        }
    }

    fn u32(&mut self, what: &str) -> Result<u32, KvEventError> {
        let at = self.pos;
        let v = self.int(what)?;
        u32::try_from(v).map_err(|_| self.malformed(at, format!("{what}: {v} is out of range")))
    }

    fn float(&mut self, what: &str) -> Result<f64, KvEventError> {
        let at = self.pos;
        match self.head()? {
            Head::Float(v) => Ok(v),
            Head::Int(v) => Ok(v as f64),
            h => Err(self.unexpected(at, what, "a number", h)),
        }
    }

    /// An engine hash from an int or bytes whose head is `h`.
    fn hash_after(&mut self, at: usize, h: Head, what: &str) -> Result<EngineHash, KvEventError> {
        match h {
            // Two's-complement low 64 bits (the truncation is the point).
            Head::Int(v) => Ok(v as u64),
            Head::Bin(n) => {
                let n = self.fits(at, n, 1)?;
                let b = self.take(n)?;
                let tail = b.get(b.len().saturating_sub(8)..).unwrap_or(b);
                Ok(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
            }
            h => Err(self.unexpected(at, what, "an integer or bytes hash", h)),
        }
    }

    fn opt_hash(&mut self, what: &str) -> Result<Option<EngineHash>, KvEventError> {
        let at = self.pos;
        match self.head()? {
            Head::Nil => Ok(None),
            h => self.hash_after(at, h, what).map(Some),
        }
    }

    fn hashes(&mut self) -> Result<Vec<EngineHash>, KvEventError> {
        let n = self.array("block_hashes", DEPTH_FIELD)?;
        self.hashes = self.hashes.saturating_add(n);
        if self.hashes > self.limits.max_hashes {
            return Err(KvEventError::Limit {
                what: "block hashes in one batch",
                limit: self.limits.max_hashes,
            });
        }
        self.charge(n.saturating_mul(8))?;
        let mut out = Vec::with_capacity(n.min(PREALLOC));
        for _ in 0..n {
            let at = self.pos;
            let h = self.head()?;
            out.push(self.hash_after(at, h, "block_hashes")?);
        }
        Ok(out)
    }

    fn token_ids(&mut self) -> Result<Vec<u32>, KvEventError> {
        let n = self.array("token_ids", DEPTH_FIELD)?;
        self.charge(n.saturating_mul(4))?;
        let mut out = Vec::with_capacity(n.min(PREALLOC));
        for _ in 0..n {
            out.push(self.u32("token_ids")?);
        }
        Ok(out)
    }

    fn extra_keys(&mut self) -> Result<Vec<Vec<ExtraKey>>, KvEventError> {
        let at = self.pos;
        let n = match self.head()? {
            Head::Nil => return Ok(Vec::new()),
            Head::Array(n) => {
                self.depth_ok(DEPTH_FIELD)?;
                self.fits(at, n, 1)?
            }
            h => return Err(self.unexpected(at, "extra_keys", "an array or nil", h)),
        };
        if n > self.limits.max_hashes {
            return Err(KvEventError::Limit {
                what: "extra_keys entries in one event",
                limit: self.limits.max_hashes,
            });
        }
        self.charge(n.saturating_mul(std::mem::size_of::<Vec<ExtraKey>>()))?;
        let mut out = Vec::with_capacity(n.min(PREALLOC));
        for _ in 0..n {
            let at = self.pos;
            let m = match self.head()? {
                Head::Nil => {
                    out.push(Vec::new());
                    continue;
                }
                Head::Array(m) => {
                    self.depth_ok(DEPTH_EXTRA_ENTRY)?;
                    self.fits(at, m, 1)?
                }
                h => return Err(self.unexpected(at, "extra_keys entry", "an array or nil", h)),
            };
            self.charge(m.saturating_mul(std::mem::size_of::<ExtraKey>()))?;
            let mut keys = Vec::with_capacity(m.min(PREALLOC));
            for _ in 0..m {
                keys.push(self.extra_key()?);
            }
            out.push(keys);
        }
        Ok(out)
    }

    /// `(identifier, offset)` → `Mm`, a string → `Text`, anything else → `Other`.
    fn extra_key(&mut self) -> Result<ExtraKey, KvEventError> {
        let at = self.pos;
        let h = self.head()?;
        match h {
            Head::Str(n) => {
                let n = self.fits(at, n, 1)?;
                let b = self.take(n)?;
                match std::str::from_utf8(b) {
                    Ok(s) if s.len() <= self.limits.max_string_bytes => {
                        self.charge(s.len())?;
                        Ok(ExtraKey::Text(s.to_string()))
                    }
                    _ => Ok(ExtraKey::Other),
                }
            }
            Head::Array(2) => {
                self.depth_ok(DEPTH_EXTRA_ITEM)?;
                let first = self.pos;
                if let Some(key) = self.mm_pair()? {
                    return Ok(key);
                }
                // Not an (identifier, offset) pair: skip it from its first element.
                self.pos = first;
                self.skip_after(at, Head::Array(2), DEPTH_EXTRA_ITEM)?;
                Ok(ExtraKey::Other)
            }
            h => {
                self.skip_after(at, h, DEPTH_EXTRA_ITEM)?;
                Ok(ExtraKey::Other)
            }
        }
    }

    /// The two elements of an `(identifier, offset)` pair, or `None` if they are not that.
    fn mm_pair(&mut self) -> Result<Option<ExtraKey>, KvEventError> {
        let at = self.pos;
        let Head::Str(n) = self.head()? else {
            return Ok(None);
        };
        let n = self.fits(at, n, 1)?;
        let b = self.take(n)?;
        let Ok(id) = std::str::from_utf8(b) else {
            return Ok(None);
        };
        if id.len() > self.limits.max_string_bytes {
            return Ok(None);
        }
        let Head::Int(v) = self.head()? else {
            return Ok(None);
        };
        let Ok(offset) = i64::try_from(v) else {
            return Ok(None);
        };
        self.charge(id.len())?;
        Ok(Some(ExtraKey::Mm {
            identifier: id.to_string(),
            offset,
        }))
    }

    fn field(&mut self, f: &mut Fields, which: Field) -> Result<(), KvEventError> {
        match which {
            Field::BlockHashes => f.block_hashes = Some(self.hashes()?),
            Field::ParentBlockHash => f.parent_block_hash = self.opt_hash("parent_block_hash")?,
            Field::TokenIds => f.token_ids = self.token_ids()?,
            Field::BlockSize => f.block_size = self.u32("block_size")?,
            Field::LoraName => f.lora_name = self.opt_string("bytes of lora_name")?,
            Field::Medium => f.medium = self.opt_string("bytes of medium")?,
            Field::ExtraKeys => f.extra_keys = self.extra_keys()?,
            Field::GroupIdx => f.group_idx = self.opt_i64("group_idx")?,
            Field::KvCacheSpecKind => {
                f.kv_cache_spec_kind = self.opt_string("bytes of kv_cache_spec_kind")?
            }
            Field::Skip => self.skip(DEPTH_FIELD)?,
        }
        Ok(())
    }

    fn event(&mut self) -> Result<KvEvent, KvEventError> {
        self.charge(std::mem::size_of::<KvEvent>())?;
        let at = self.pos;
        let h = self.head()?;
        let mut f = Fields::default();
        let (kind, tag) = match h {
            Head::Array(n) => {
                self.depth_ok(DEPTH_EVENT)?;
                let n = self.fits(at, n, 1)?;
                if n == 0 {
                    return Err(self.malformed(at, "an event array without its type"));
                }
                let tag = self.str_bytes("event type")?;
                let kind = kind_of(tag);
                let positions = match kind {
                    Kind::Stored => STORED_POSITIONS,
                    Kind::Removed => REMOVED_POSITIONS,
                    Kind::Cleared => CLEARED_POSITIONS,
                    Kind::Unknown => &[],
                };
                for i in 0..n - 1 {
                    let which = positions.get(i).copied().unwrap_or(Field::Skip);
                    self.field(&mut f, which)?;
                }
                (kind, tag)
            }
            Head::Map(n) => {
                self.depth_ok(DEPTH_EVENT)?;
                let n = self.fits(at, n, 2)?;
                let body = self.pos;
                let tag = self.find_tag(at, n)?;
                let kind = kind_of(tag);
                self.pos = body;
                for _ in 0..n {
                    let key = self.str_bytes("event field name")?;
                    let which = if key == b"type" || kind == Kind::Unknown {
                        Field::Skip
                    } else {
                        field_named(key)
                    };
                    self.field(&mut f, which)?;
                }
                (kind, tag)
            }
            h => return Err(self.unexpected(at, "event", "a map or an array", h)),
        };
        let missing =
            |r: &Self, name: &str| r.malformed(at, format!("{name} event without block_hashes"));
        Ok(match kind {
            Kind::Stored => {
                let block_hashes = f.block_hashes.ok_or_else(|| missing(self, "BlockStored"))?;
                // One entry per block: pad what the event left out, drop entries for blocks
                // it does not have.
                let mut extra_keys = f.extra_keys;
                extra_keys.resize_with(block_hashes.len(), Vec::new);
                KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash: f.parent_block_hash,
                    token_ids: f.token_ids,
                    block_size: f.block_size,
                    lora_name: f.lora_name,
                    medium: f.medium,
                    extra_keys,
                    group_idx: f.group_idx,
                    kv_cache_spec_kind: f.kv_cache_spec_kind,
                })
            }
            Kind::Removed => KvEvent::BlockRemoved {
                block_hashes: f
                    .block_hashes
                    .ok_or_else(|| missing(self, "BlockRemoved"))?,
                medium: f.medium,
                group_idx: f.group_idx,
            },
            Kind::Cleared => KvEvent::AllBlocksCleared { medium: f.medium },
            Kind::Unknown => {
                if tag.len() > self.limits.max_string_bytes {
                    return Err(KvEventError::Limit {
                        what: "bytes of an event type",
                        limit: self.limits.max_string_bytes,
                    });
                }
                KvEvent::Unknown {
                    kind: self.owned(at, tag, "event type")?,
                }
            }
        })
    }

    /// The value of the `"type"` key of an event map of `n` entries starting here.
    fn find_tag(&mut self, at: usize, n: usize) -> Result<&'a [u8], KvEventError> {
        for _ in 0..n {
            let key = self.str_bytes("event field name")?;
            if key == b"type" {
                return self.str_bytes("event type");
            }
            self.skip(DEPTH_FIELD)?;
        }
        Err(self.malformed(at, "an event map without a \"type\" key"))
    }

    fn events(&mut self) -> Result<Vec<KvEvent>, KvEventError> {
        let n = self.array("events", DEPTH_EVENTS)?;
        if n > self.limits.max_events {
            return Err(KvEventError::Limit {
                what: "events in one batch",
                limit: self.limits.max_events,
            });
        }
        let mut out = Vec::with_capacity(n.min(PREALLOC));
        for _ in 0..n {
            out.push(self.event()?);
        }
        Ok(out)
    }

    fn batch(&mut self) -> Result<EventBatch, KvEventError> {
        let at = self.pos;
        match self.head()? {
            Head::Array(n) => {
                self.depth_ok(1)?;
                let n = self.fits(at, n, 1)?;
                if n < 2 {
                    return Err(self.malformed(
                        at,
                        format!("an event batch array needs [ts, events, ...], got {n} elements"),
                    ));
                }
                let ts = self.float("ts")?;
                let events = self.events()?;
                let data_parallel_rank = if n >= 3 {
                    self.opt_i64("data_parallel_rank")?
                } else {
                    None
                };
                for _ in 3..n {
                    self.skip(DEPTH_EVENTS)?;
                }
                Ok(EventBatch {
                    ts,
                    events,
                    data_parallel_rank,
                })
            }
            Head::Map(n) => {
                self.depth_ok(1)?;
                let n = self.fits(at, n, 2)?;
                let (mut ts, mut events, mut dp) = (None, None, None);
                for _ in 0..n {
                    match self.str_bytes("event batch key")? {
                        b"ts" => ts = Some(self.float("ts")?),
                        b"events" => events = Some(self.events()?),
                        b"data_parallel_rank" => dp = self.opt_i64("data_parallel_rank")?,
                        _ => self.skip(DEPTH_EVENTS)?,
                    }
                }
                match (ts, events) {
                    (Some(ts), Some(events)) => Ok(EventBatch {
                        ts,
                        events,
                        data_parallel_rank: dp,
                    }),
                    _ => Err(self.malformed(at, "an event batch map needs \"ts\" and \"events\"")),
                }
            }
            h => Err(self.unexpected(at, "event batch", "an array or a map", h)),
        }
    }
}

// ---------------------------------------------------------------------------------------
// Writing msgpack (as msgspec writes it: the smallest form of each int, floats as float64)

struct Writer {
    out: Vec<u8>,
    hashes: HashEncoding,
}

impl Writer {
    fn nil(&mut self) {
        self.out.push(0xc0);
    }

    fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.out.push(v as u8);
        } else if v <= u64::from(u8::MAX) {
            self.out.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= u64::from(u16::MAX) {
            self.out.push(0xcd);
            self.out.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u64::from(u32::MAX) {
            self.out.push(0xce);
            self.out.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.out.push(0xcf);
            self.out.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.out.push(v as i8 as u8);
        } else if v >= i64::from(i8::MIN) {
            self.out.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i64::from(i16::MIN) {
            self.out.push(0xd1);
            self.out.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            self.out.push(0xd2);
            self.out.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.out.push(0xd3);
            self.out.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn f64(&mut self, v: f64) {
        self.out.push(0xcb);
        self.out.extend_from_slice(&v.to_be_bytes());
    }

    fn len_head(&mut self, n: usize, fix: u8, fix_max: usize, m8: Option<u8>, m16: u8, m32: u8) {
        if n <= fix_max {
            self.out.push(fix | n as u8);
        } else if let Some(m8) = m8.filter(|_| n <= usize::from(u8::MAX)) {
            self.out.extend_from_slice(&[m8, n as u8]);
        } else if n <= usize::from(u16::MAX) {
            self.out.push(m16);
            self.out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.out.push(m32);
            self.out
                .extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_be_bytes());
        }
    }

    fn str(&mut self, s: &str) {
        self.len_head(s.len(), 0xa0, 31, Some(0xd9), 0xda, 0xdb);
        self.out.extend_from_slice(s.as_bytes());
    }

    fn opt_str(&mut self, s: &Option<String>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    fn opt_int(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.int(v),
            None => self.nil(),
        }
    }

    fn array(&mut self, n: usize) {
        self.len_head(n, 0x90, 15, None, 0xdc, 0xdd);
    }

    fn map(&mut self, n: usize) {
        self.len_head(n, 0x80, 15, None, 0xde, 0xdf);
    }

    fn hash(&mut self, h: EngineHash) {
        match self.hashes {
            HashEncoding::Int => self.uint(h),
            HashEncoding::Bytes => {
                self.out.extend_from_slice(&[0xc4, 8]);
                self.out.extend_from_slice(&h.to_be_bytes());
            }
        }
    }

    fn opt_hash(&mut self, h: Option<EngineHash>) {
        match h {
            Some(h) => self.hash(h),
            None => self.nil(),
        }
    }

    fn hashes(&mut self, hs: &[EngineHash]) {
        self.array(hs.len());
        for &h in hs {
            self.hash(h);
        }
    }

    fn tokens(&mut self, ts: &[u32]) {
        self.array(ts.len());
        for &t in ts {
            self.uint(u64::from(t));
        }
    }

    /// `extra_keys` as vLLM writes it: nil when the event has none, else one entry per block,
    /// nil for a block without keys. `Other` keys (whose content was not kept) become nil.
    fn extra_keys(&mut self, keys: &[Vec<ExtraKey>]) {
        if keys.is_empty() {
            return self.nil();
        }
        self.array(keys.len());
        for entry in keys {
            if entry.is_empty() {
                self.nil();
                continue;
            }
            self.array(entry.len());
            for k in entry {
                match k {
                    ExtraKey::Mm { identifier, offset } => {
                        self.array(2);
                        self.str(identifier);
                        self.int(*offset);
                    }
                    ExtraKey::Text(s) => self.str(s),
                    ExtraKey::Other => self.nil(),
                }
            }
        }
    }

    fn event(&mut self, e: &KvEvent, form: WireForm) {
        match (e, form) {
            (KvEvent::BlockStored(s), WireForm::Tagged) => {
                let n = 8
                    + usize::from(!s.extra_keys.is_empty())
                    + usize::from(s.group_idx.is_some())
                    + usize::from(s.kv_cache_spec_kind.is_some());
                // msgspec sizes a struct's map header for all its fields: BlockStored has 16
                // with the tag, so it always gets a map16 header.
                self.out.push(0xde);
                self.out.extend_from_slice(&(n as u16).to_be_bytes());
                self.str("type");
                self.str("BlockStored");
                self.str("block_hashes");
                self.hashes(&s.block_hashes);
                self.str("parent_block_hash");
                self.opt_hash(s.parent_block_hash);
                self.str("token_ids");
                self.tokens(&s.token_ids);
                self.str("block_size");
                self.uint(u64::from(s.block_size));
                self.str("lora_id");
                self.nil();
                self.str("medium");
                self.opt_str(&s.medium);
                self.str("lora_name");
                self.opt_str(&s.lora_name);
                if !s.extra_keys.is_empty() {
                    self.str("extra_keys");
                    self.extra_keys(&s.extra_keys);
                }
                if let Some(g) = s.group_idx {
                    self.str("group_idx");
                    self.int(g);
                }
                if let Some(k) = &s.kv_cache_spec_kind {
                    self.str("kv_cache_spec_kind");
                    self.str(k);
                }
            }
            (KvEvent::BlockStored(s), WireForm::Positional) => {
                // vLLM 0.23's 11 fields after the tag, all written.
                self.array(12);
                self.str("BlockStored");
                self.hashes(&s.block_hashes);
                self.opt_hash(s.parent_block_hash);
                self.tokens(&s.token_ids);
                self.uint(u64::from(s.block_size));
                self.nil(); // lora_id
                self.opt_str(&s.medium);
                self.opt_str(&s.lora_name);
                self.extra_keys(&s.extra_keys);
                self.opt_int(s.group_idx);
                self.opt_str(&s.kv_cache_spec_kind);
                self.nil(); // kv_cache_spec_sliding_window
            }
            (
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                },
                WireForm::Tagged,
            ) => {
                self.map(3 + usize::from(group_idx.is_some()));
                self.str("type");
                self.str("BlockRemoved");
                self.str("block_hashes");
                self.hashes(block_hashes);
                self.str("medium");
                self.opt_str(medium);
                if let Some(g) = group_idx {
                    self.str("group_idx");
                    self.int(*g);
                }
            }
            (
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                },
                WireForm::Positional,
            ) => {
                self.array(4);
                self.str("BlockRemoved");
                self.hashes(block_hashes);
                self.opt_str(medium);
                self.opt_int(*group_idx);
            }
            (KvEvent::AllBlocksCleared { medium }, WireForm::Tagged) => {
                self.map(1 + usize::from(medium.is_some()));
                self.str("type");
                self.str("AllBlocksCleared");
                if let Some(m) = medium {
                    self.str("medium");
                    self.str(m);
                }
            }
            (KvEvent::AllBlocksCleared { medium }, WireForm::Positional) => {
                self.array(1 + usize::from(medium.is_some()));
                self.str("AllBlocksCleared");
                if let Some(m) = medium {
                    self.str(m);
                }
            }
            (KvEvent::Unknown { kind }, WireForm::Tagged) => {
                self.map(1);
                self.str("type");
                self.str(kind);
            }
            (KvEvent::Unknown { kind }, WireForm::Positional) => {
                self.array(1);
                self.str(kind);
            }
        }
    }
}

/// Encodes as vLLM would (the mock worker publishes with it; tests round-trip through it).
///
/// `Tagged` writes what vLLM 0.33 writes (maps, `lora_id: nil`, defaults omitted),
/// `Positional` what vLLM 0.23 wrote (arrays of every field). The batch is always
/// `[ts, events, data_parallel_rank]`. `decode_batch(encode_batch(b, ..))` gives `b` back
/// for every batch whose `extra_keys` have one entry per block (or none) and whose
/// `AllBlocksCleared` events are not `Unknown` look-alikes.
pub fn encode_batch(batch: &EventBatch, form: WireForm, hashes: HashEncoding) -> Vec<u8> {
    let mut w = Writer {
        out: Vec::with_capacity(64 + batch.events.len() * 64),
        hashes,
    };
    w.array(3);
    w.f64(batch.ts);
    w.array(batch.events.len());
    for e in &batch.events {
        w.event(e, form);
    }
    w.opt_int(batch.data_parallel_rank);
    w.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> KvEventLimits {
        KvEventLimits::default()
    }

    #[test]
    fn ints_are_written_in_their_smallest_msgpack_form() {
        let mut w = Writer {
            out: Vec::new(),
            hashes: HashEncoding::Int,
        };
        for v in [
            0i64,
            127,
            128,
            255,
            256,
            65535,
            65536,
            -1,
            -32,
            -33,
            -128,
            -129,
            i64::MIN,
        ] {
            w.int(v);
        }
        w.uint(u64::MAX);
        let expect: Vec<u8> = [
            &[0x00][..],
            &[0x7f],
            &[0xcc, 0x80],
            &[0xcc, 0xff],
            &[0xcd, 0x01, 0x00],
            &[0xcd, 0xff, 0xff],
            &[0xce, 0, 1, 0, 0],
            &[0xff],
            &[0xe0],
            &[0xd0, 0xdf],
            &[0xd0, 0x80],
            &[0xd1, 0xff, 0x7f],
            &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],
            &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
        ]
        .concat();
        assert_eq!(w.out, expect);
    }

    #[test]
    fn every_int_marker_reads_back_as_a_hash() {
        // [ts, [["BlockRemoved", [hashes...], nil]], 0] with each int form.
        let mut p = vec![0x93, 0x00, 0x91, 0x93, 0xac];
        p.extend_from_slice(b"BlockRemoved");
        p.push(0x97);
        p.extend_from_slice(&[0x05]); // fixint
        p.extend_from_slice(&[0xcc, 0xf0]); // uint8
        p.extend_from_slice(&[0xd0, 0xfe]); // int8 -2
        p.extend_from_slice(&[0xd1, 0xff, 0xfe]); // int16 -2
        p.extend_from_slice(&[0xd2, 0xff, 0xff, 0xff, 0xfe]); // int32 -2
        p.extend_from_slice(&[0xc4, 0x02, 0x01, 0x02]); // 2 bytes, left-padded
        p.extend_from_slice(&[0xc4, 0x0a, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8]); // last 8 bytes
        p.extend_from_slice(&[0xc0, 0x00]);
        let b = decode_batch(&p, &limits()).unwrap();
        let KvEvent::BlockRemoved { block_hashes, .. } = &b.events[0] else {
            panic!("{b:?}")
        };
        assert_eq!(
            block_hashes,
            &vec![
                5,
                0xf0,
                u64::MAX - 1,
                u64::MAX - 1,
                u64::MAX - 1,
                0x0102,
                0x0102030405060708
            ]
        );
        assert_eq!(b.ts, 0.0);
    }

    #[test]
    fn deep_nesting_in_a_skipped_field_hits_the_depth_limit_without_recursion() {
        // An event map with an unknown field holding 100,000 nested arrays.
        let mut p = vec![0x93, 0x00, 0x91, 0x82, 0xa4];
        p.extend_from_slice(b"type");
        p.push(0xac);
        p.extend_from_slice(b"SomethingNew");
        p.extend_from_slice(&[0xa1, b'x']);
        p.extend(std::iter::repeat_n(0x91, 100_000));
        p.push(0xc0);
        p.push(0x00);
        let e = decode_batch(&p, &limits()).unwrap_err();
        assert!(
            matches!(
                e,
                KvEventError::Limit {
                    what: "levels of nesting",
                    ..
                }
            ),
            "{e}"
        );
        let deep = KvEventLimits {
            max_depth: 200_000,
            ..limits()
        };
        let b = decode_batch(&p, &deep).unwrap();
        assert_eq!(
            b.events,
            vec![KvEvent::Unknown {
                kind: "SomethingNew".into()
            }]
        );
    }
}
