//! The prompt as KV blocks.
//!
//! The router cannot run the model's tokenizer inside the proxy (it is megabytes of vocabulary
//! and differs per model), and it does not need to: it needs block keys that two requests share
//! exactly when the engine's blocks would be shared, and block counts close to the engine's.
//!
//! ## Virtual tokens
//! The prompt is rendered the way chat templates render it (Qwen/ChatML-style): for every
//! message a start marker, the role, a newline, the content, an end marker; a chat request ends
//! with the generation prompt for `assistant`. Text becomes pseudo-tokens:
//!
//! - a run of letters, with the one space before it, is split into pieces of at most
//!   [`MAX_WORD_PIECE`] bytes (BPE vocabularies average about four bytes of English per token);
//! - a run of digits into pieces of at most three digits (as Llama 3 / Qwen tokenizers split
//!   numbers);
//! - every other character (punctuation, a CJK character, a newline) is one token; runs of
//!   spaces are one token.
//!
//! A piece's id is xxh3-64 of its bytes, folded to 32 bits. The scheme is local: the pseudo
//! tokens of a text prefix do not depend on what follows it (up to the last piece boundary),
//! which is the property BPE tokenizers have at word boundaries and the one prefix caching
//! relies on. The density is set to BPE's on English (about four bytes per token): the test
//! sentence "The quick brown fox jumps over the lazy dog." is 10 tokens for GPT-4's and Qwen's
//! tokenizers and 13 pseudo-tokens here. The engine's real count is not needed for matching
//! (keys only have to agree between requests); it matters for the prefill estimate in the
//! load terms, where an error of this size shifts every worker alike.
//!
//! ## Media
//! An image becomes its marker tokens (e.g. Qwen's `<|vision_start|>`/`<|vision_end|>`) around
//! `tokens` placeholder tokens, all with the same id, as in the engine. Like vLLM's block extra
//! keys, every block that overlaps an image's placeholders carries `(image identity, offset)`,
//! where offset = placeholder start − block start (0, −16, −32, … for an image spanning blocks;
//! several images may share a block).
//!
//! ## Keys
//! The chain starts from a seed over the model name and `cache_salt` (the model field also names
//! a LoRA adapter, so adapters never share keys with their base). A full block's key is xxh3-64
//! over: parent key (u64 LE), the block's token ids (u32 LE), then for each overlapping image its
//! 64-bit identity key and offset (both LE). Only full blocks are keyed, as in vLLM.

use crate::request::{ApiKind, Part, Prompt};
use crate::tokens::ImageTokens;
use xxhash_rust::xxh3::xxh3_64;

/// Longest run of letters in one pseudo-token, in bytes (including a leading space).
pub const MAX_WORD_PIECE: usize = 5;
/// Default KV block size, as vLLM's.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

// Special pseudo-token ids: the top of the u32 range, away from folded piece ids
// (pieces are folded into 0..2^31).
const IM_START: u32 = u32::MAX;
const IM_END: u32 = u32::MAX - 1;
const MEDIA_START: u32 = u32::MAX - 2;
const MEDIA_END: u32 = u32::MAX - 3;
const MEDIA_PAD: u32 = u32::MAX - 4;
const NEWLINE: u32 = u32::MAX - 5;

/// A media item placed in the prompt: its identity key and its token cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedMedia {
    /// [`crate::identity::MediaId::key64`] of the item.
    pub key: u64,
    pub tokens: ImageTokens,
}

/// One image overlapping one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct BlockMedia {
    pub block: u32,
    /// Index of the media item in the request (request order, from 0).
    pub media: u32,
    /// Placeholder start minus block start, in tokens.
    pub offset: i64,
}

/// The prompt cut into keyed blocks.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Layout {
    pub block_size: usize,
    /// Virtual prompt length in tokens (full blocks plus the unkeyed tail).
    pub prompt_tokens: usize,
    /// Full blocks before the last `assistant` message (0 when there is none): the previous
    /// turn's prompt of the conversation this request continues. A worker that holds them
    /// holds that conversation.
    pub continued_blocks: usize,
    /// Full blocks of the leading `system` / `developer` messages (0 when the prompt does not
    /// start with one): the preamble that the conversations of one application share.
    pub preamble_blocks: usize,
    /// One chained key per full block.
    pub keys: Vec<u64>,
    /// Media overlaps, sorted by block.
    pub media: Vec<BlockMedia>,
}

impl Layout {
    /// The media overlapping block `block`.
    pub fn media_of(&self, block: usize) -> impl Iterator<Item = &BlockMedia> {
        let start = self.media.partition_point(|m| (m.block as usize) < block);
        self.media
            .get(start..)
            .unwrap_or(&[])
            .iter()
            .take_while(move |m| m.block as usize == block)
    }
}

/// A run of placeholder tokens in the virtual sequence.
#[derive(Debug, Clone, Copy)]
struct Span {
    start: usize,
    len: usize,
    media: u32,
    key: u64,
}

/// Lays `request` out in blocks of `block_size` tokens. `media` holds one entry per media item,
/// in request order (`Part::Media` index); a part without an entry is laid out as zero tokens.
pub fn layout(request: &Prompt, media: &[PlacedMedia], block_size: usize) -> Layout {
    let block_size = block_size.max(1);
    let mut tokens: Vec<u32> = Vec::with_capacity(256);
    let mut spans: Vec<Span> = Vec::new();
    let mut continued_tokens = 0usize;
    let mut preamble_tokens = None;
    for message in &request.messages {
        let chat = request.api == ApiKind::Chat;
        if message.role == "assistant" {
            continued_tokens = tokens.len();
        }
        if preamble_tokens.is_none() && !matches!(message.role.as_str(), "system" | "developer") {
            preamble_tokens = Some(tokens.len());
        }
        if chat {
            tokens.push(IM_START);
            pseudo_tokens(&message.role, &mut tokens);
            tokens.push(NEWLINE);
        }
        for part in &message.parts {
            match part {
                Part::Text(text) => pseudo_tokens(text, &mut tokens),
                Part::Media(index) => {
                    let Some(placed) = media.get(*index) else {
                        continue;
                    };
                    let markers = placed.tokens.markers;
                    if markers > 0 {
                        tokens.push(MEDIA_START);
                    }
                    let len = placed.tokens.tokens as usize;
                    spans.push(Span {
                        start: tokens.len(),
                        len,
                        media: u32::try_from(*index).unwrap_or(u32::MAX),
                        key: placed.key,
                    });
                    tokens.resize(tokens.len() + len, MEDIA_PAD);
                    // The end marker; markers beyond the first pair (rare) count as more of them.
                    let ends = markers.saturating_sub(1) as usize;
                    tokens.resize(tokens.len() + ends, MEDIA_END);
                }
            }
        }
        if chat {
            tokens.push(IM_END);
            tokens.push(NEWLINE);
        }
    }
    if request.api == ApiKind::Chat {
        tokens.push(IM_START);
        pseudo_tokens("assistant", &mut tokens);
        tokens.push(NEWLINE);
    }

    let full_blocks = tokens.len() / block_size;
    let mut keys = Vec::with_capacity(full_blocks);
    let mut overlaps = Vec::new();
    let mut buf: Vec<u8> = Vec::with_capacity(8 + block_size * 4 + 64);
    let mut parent = chain_seed(&request.model, request.cache_salt.as_deref());
    let mut first_span = 0usize;
    for (block, chunk) in tokens.chunks_exact(block_size).enumerate() {
        let block_start = block * block_size;
        let block_end = block_start + block_size;
        buf.clear();
        buf.extend_from_slice(&parent.to_le_bytes());
        for t in chunk {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        // Spans are in token order: skip those that ended before this block.
        while spans
            .get(first_span)
            .is_some_and(|s| s.start + s.len <= block_start)
        {
            first_span += 1;
        }
        for span in spans.get(first_span..).unwrap_or(&[]) {
            if span.start >= block_end {
                break;
            }
            if span.len == 0 || span.start + span.len <= block_start {
                continue;
            }
            let offset = span.start as i64 - block_start as i64;
            buf.extend_from_slice(&span.key.to_le_bytes());
            buf.extend_from_slice(&offset.to_le_bytes());
            overlaps.push(BlockMedia {
                block: u32::try_from(block).unwrap_or(u32::MAX),
                media: span.media,
                offset,
            });
        }
        parent = xxh3_64(&buf);
        keys.push(parent);
    }
    Layout {
        block_size,
        prompt_tokens: tokens.len(),
        continued_blocks: continued_tokens / block_size,
        preamble_blocks: preamble_tokens.unwrap_or(tokens.len()) / block_size,
        keys,
        media: overlaps,
    }
}

/// The root of a request's key chain.
pub fn chain_seed(model: &str, cache_salt: Option<&str>) -> u64 {
    let mut buf = Vec::with_capacity(model.len() + 32);
    buf.extend_from_slice(b"mmrouter/v1\0");
    buf.extend_from_slice(model.as_bytes());
    buf.push(0);
    if let Some(salt) = cache_salt {
        buf.push(1);
        buf.extend_from_slice(salt.as_bytes());
    }
    xxh3_64(&buf)
}

/// Appends the pseudo-tokens of `text` (see the module docs).
pub fn pseudo_tokens(text: &str, out: &mut Vec<u32>) {
    let bytes = text.as_bytes();
    let mut i = 0usize;
    while let Some(&b) = bytes.get(i) {
        let start = i;
        if b == b'\n' {
            out.push(NEWLINE);
            i += 1;
            continue;
        }
        if b == b' ' {
            // A single space followed by a letter or digit is the start of a word piece.
            let next = bytes.get(i + 1).copied();
            if next.is_some_and(|n| n.is_ascii_alphanumeric()) {
                i += 1;
            } else {
                while bytes.get(i) == Some(&b' ') {
                    i += 1;
                }
                push_piece(bytes.get(start..i).unwrap_or(&[]), out);
                continue;
            }
        }
        match bytes.get(i) {
            Some(c) if c.is_ascii_alphabetic() => {
                let word_start = start;
                let mut end = i;
                while bytes.get(end).is_some_and(u8::is_ascii_alphabetic) {
                    end += 1;
                }
                let mut p = word_start;
                while p < end {
                    let q = (p + MAX_WORD_PIECE).min(end);
                    push_piece(bytes.get(p..q).unwrap_or(&[]), out);
                    p = q;
                }
                i = end;
            }
            Some(c) if c.is_ascii_digit() => {
                if start < i {
                    push_piece(bytes.get(start..i).unwrap_or(&[]), out);
                }
                let mut end = i;
                while bytes.get(end).is_some_and(u8::is_ascii_digit) {
                    end += 1;
                }
                let mut p = i;
                while p < end {
                    let q = (p + 3).min(end);
                    push_piece(bytes.get(p..q).unwrap_or(&[]), out);
                    p = q;
                }
                i = end;
            }
            Some(&c) => {
                // One character: ASCII punctuation/control, or a whole UTF-8 sequence.
                let len = utf8_len(c);
                let end = (i + len).min(bytes.len());
                push_piece(bytes.get(i..end).unwrap_or(&[]), out);
                i = end;
            }
            None => {
                if start < i {
                    push_piece(bytes.get(start..i).unwrap_or(&[]), out);
                }
            }
        }
    }
}

fn utf8_len(first: u8) -> usize {
    match first {
        0xF0..=0xF7 => 4,
        0xE0..=0xEF => 3,
        0xC0..=0xDF => 2,
        _ => 1,
    }
}

fn push_piece(piece: &[u8], out: &mut Vec<u32>) {
    if piece.is_empty() {
        return;
    }
    let h = xxh3_64(piece);
    out.push(((h ^ (h >> 32)) as u32) & 0x7fff_ffff);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::Limits;
    use crate::scan::scan;

    fn tokens(text: &str) -> Vec<u32> {
        let mut v = Vec::new();
        pseudo_tokens(text, &mut v);
        v
    }

    #[test]
    fn pseudo_tokens_are_prefix_stable_and_reasonably_dense() {
        let a = tokens("The quick brown fox jumps over the lazy dog.");
        let b = tokens("The quick brown fox jumps over the lazy dog. And then more text.");
        assert_eq!(&b[..a.len()], &a[..]);
        // 44 bytes of English: GPT-4's and Qwen's tokenizers give 10 (the module docs quote 13).
        assert_eq!(a.len(), 13);
        assert_eq!(tokens("1234567").len(), 3);
        assert_eq!(tokens("日本語").len(), 3);
        assert_ne!(tokens("cat"), tokens("cap"));
    }

    fn chat(images: &[&str], text: &str) -> String {
        let mut parts = vec![format!(r#"{{"type":"text","text":"{text}"}}"#)];
        for u in images {
            parts.push(format!(
                r#"{{"type":"image_url","image_url":{{"url":"{u}"}}}}"#
            ));
        }
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{}]}}]}}"#,
            parts.join(",")
        )
    }

    fn placed(keys: &[u64], n: u32) -> Vec<PlacedMedia> {
        keys.iter()
            .map(|&key| PlacedMedia {
                key,
                tokens: ImageTokens {
                    tokens: n,
                    markers: 2,
                },
            })
            .collect()
    }

    fn lay(body: &str, media: &[PlacedMedia], bs: usize) -> Layout {
        let req = scan(body.as_bytes(), &Limits::default()).expect("scan");
        layout(&req.prompt, media, bs)
    }

    #[test]
    fn images_appear_in_every_block_they_overlap_with_offsets() {
        let l = lay(&chat(&["a"], "hi"), &placed(&[7], 40), 16);
        // IM_START user NL "hi" MEDIA_START = 5 tokens, then 40 pads from position 5.
        let offsets: Vec<(u32, i64)> = l.media.iter().map(|m| (m.block, m.offset)).collect();
        assert_eq!(offsets, vec![(0, 5), (1, -11), (2, -27)]);
        assert_eq!(l.media_of(1).count(), 1);
        // ... MEDIA_END, IM_END, NL, then IM_START "assi" "stant" NL.
        assert_eq!(l.prompt_tokens, 5 + 40 + 1 + 2 + 4);
        assert_eq!(l.keys.len(), l.prompt_tokens / 16);
    }

    #[test]
    fn shared_prefix_shares_keys_and_swapping_images_diverges() {
        let body2 = chat(&["a", "b"], "describe");
        let ab = lay(&body2, &placed(&[1, 2], 64), 16);
        let ba = lay(&body2, &placed(&[2, 1], 64), 16);
        assert_eq!(ab.keys.len(), ba.keys.len());
        assert_ne!(ab.keys[0], ba.keys[0], "first block holds image 0 already");
        let longer = chat(&["a", "b"], "describe");
        let ab2 = lay(
            &longer.replace(
                "]}]}",
                "]},{\"role\":\"assistant\",\"content\":\"ok, more words here to fill blocks\"}]}",
            ),
            &placed(&[1, 2], 64),
            16,
        );
        let shared = ab.keys.len() - 1; // the generation prompt tail differs
        assert_eq!(&ab2.keys[..shared], &ab.keys[..shared]);
        // The follow-up continues the first request: the blocks before its assistant
        // message are the first request's prompt without its generation prompt.
        assert_eq!(ab.continued_blocks, 0, "no assistant message");
        assert_eq!(ab2.continued_blocks, (ab.prompt_tokens - 4) / 16);
        assert!(ab2.continued_blocks <= ab.keys.len());
        // Same bytes under the same positions: identical layouts.
        assert_eq!(lay(&body2, &placed(&[1, 2], 64), 16), ab);
    }

    #[test]
    fn the_preamble_is_the_leading_system_messages() {
        let words = "you are a careful assistant who answers briefly ".repeat(12);
        let body = |system: &str, user: &str| {
            format!(r#"{{"model":"m","messages":[{system}{{"role":"user","content":"{user}"}}]}}"#)
        };
        let with = |role: &str| format!(r#"{{"role":"{role}","content":"{words}"}},"#);
        let plain = lay(&body("", "hello there"), &[], 16);
        assert_eq!(plain.preamble_blocks, 0, "no system message");
        let a = lay(&body(&with("system"), "hello there"), &[], 16);
        let b = lay(&body(&with("system"), "something else entirely"), &[], 16);
        // The system message's tokens: its role and text between the chat markers.
        let system_tokens = 3 + tokens(&words).len() + 2;
        assert_eq!(a.preamble_blocks, system_tokens / 16);
        assert!(a.preamble_blocks >= 3);
        // Two conversations of one application share the preamble's blocks.
        let p = a.preamble_blocks;
        assert_eq!(a.keys[..p], b.keys[..p]);
        let two = lay(
            &body(&format!("{}{}", with("system"), with("developer")), "hi"),
            &[],
            16,
        );
        assert_eq!(two.preamble_blocks, 2 * system_tokens / 16);
    }

    #[test]
    fn model_and_salt_seed_the_chain() {
        let body = chat(
            &[],
            "a long enough prompt to fill at least one block of sixteen",
        );
        let salted = body.replacen(
            "{\"model\":\"m\"",
            "{\"model\":\"m\",\"cache_salt\":\"x\"",
            1,
        );
        let other = body.replacen("\"model\":\"m\"", "\"model\":\"n\"", 1);
        let k = lay(&body, &[], 16).keys;
        assert!(!k.is_empty());
        assert_ne!(lay(&salted, &[], 16).keys[0], k[0]);
        assert_ne!(lay(&other, &[], 16).keys[0], k[0]);
    }
}
