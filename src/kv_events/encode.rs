//! Writing msgpack as msgspec writes it (the smallest form of each int, floats as float64):
//! what vLLM would send, for the mock worker and the round-trip tests.

use super::{EngineHash, EventBatch, ExtraKey, HashEncoding, KvEvent, WireForm};

pub(super) struct Writer {
    pub(super) out: Vec<u8>,
    pub(super) hashes: HashEncoding,
}

impl Writer {
    fn nil(&mut self) {
        self.out.push(0xc0);
    }

    pub(super) fn uint(&mut self, v: u64) {
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

    pub(super) fn int(&mut self, v: i64) {
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
