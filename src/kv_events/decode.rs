//! Reading msgpack: the decoder behind [`super::decode_batch`]. Every declared length is
//! checked against the bytes that remain before anything is allocated (see "Bounds" in
//! [`super`]).

use super::{BlockStored, EngineHash, EventBatch, ExtraKey, KvEvent, KvEventError, KvEventLimits};

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
