//! trace-blocks: what the mock worker would compute for a request, without serving it.
//!
//! The routing-quality harness (benches/compare) needs every request's KV block hashes to
//! compute its offline bounds (benches/compare/sim.py), and the answer the mock would stream,
//! to build the next turn of a conversation before the replay. This reads one chat request
//! body (JSON) per stdin line and writes one JSON line per request:
//!
//! ```text
//! {"prompt_tokens": 812, "max_tokens": 64, "images": 1,
//!  "blocks": ["9f3c...", ...],        // the prompt's full blocks, in order (64-bit ids)
//!  "finish_blocks": ["...", ...],     // the further full blocks cached when it finishes
//!  "output": "the image shows ..."}   // the text the mock streams back
//! ```
//! or `{"error": "..."}` for a body the mock would refuse.
//!
//! The prompt is rendered by the mock's own template code (`src/bin/mock_worker/prompt.rs`,
//! included below), with the core's pseudo-tokenizer and image token profiles. The block
//! hashes follow the mock's rules (`prefix_cache.rs`, after vLLM's `hash_request_tokens`):
//! only full blocks, each hash chained on its parent's, an extra key `(identifier,
//! placeholder start - block start)` per image overlapping the block and the cache salt on
//! the first block. The hash function and the image identifier are this tool's own (xxh3 over
//! a framing of the same inputs), so the ids differ from the mock's, but two blocks get equal
//! ids here exactly when the mock gives them equal hashes, which is all a cache simulation
//! needs. The harness checks that against the mock (one worker, unbounded cache: simulated
//! cached tokens per request = reported ones).
//!
//! `cargo build --release --features native --example trace-blocks`, then
//! `trace-blocks [--block-size 16] [--profile qwen2.5-vl]`.

#[allow(dead_code)]
#[path = "../../src/bin/mock_worker/prompt.rs"]
mod prompt;

/// The mock's own request parser (the shape its templates render).
#[allow(dead_code)]
#[path = "../../src/bin/mock_worker/request.rs"]
mod request;

/// What `prompt.rs` needs from the mock's `prefix_cache` module.
mod prefix_cache {
    /// A multimodal item's placeholder range in the token sequence.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct MmRange {
        pub identifier: String,
        pub offset: usize,
        pub length: usize,
    }
}

use mmrouter::identity::decode_base64;
use mmrouter::image_header::read_image_header;
use mmrouter::request::Limits;
use mmrouter::tokens::Profile;
use prefix_cache::MmRange;
use prompt::{PlacedImage, output_token, render};
use request::{MediaSource, parse};
use std::io::{BufRead, Write};
use xxhash_rust::xxh3::{Xxh3, xxh3_64, xxh3_128};

/// The mock's `--default-max-tokens` default: the output length when a body sets none.
const DEFAULT_MAX_TOKENS: usize = 16;

struct Options {
    block_size: usize,
    profile: Profile,
}

fn parse_args() -> Result<Options, String> {
    let mut block_size = 16usize;
    let mut profile = "qwen2.5-vl".to_string();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--block-size" => {
                block_size = value()?.parse().map_err(|e| format!("--block-size: {e}"))?;
                if block_size == 0 {
                    return Err("--block-size must be > 0".into());
                }
            }
            "--profile" => profile = value()?,
            "-h" | "--help" => {
                return Err(
                    "usage: trace-blocks [--block-size N] [--profile SPEC] < bodies.jsonl".into(),
                );
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let profile = Profile::parse(&profile).map_err(|e| format!("--profile {profile}: {e}"))?;
    Ok(Options {
        block_size,
        profile,
    })
}

/// Chained block ids of every full block of `tokens` (the mock's `hash_request_blocks`).
fn block_ids(tokens: &[u32], mm: &[MmRange], salt: Option<&str>, bs: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / bs);
    let mut parent = xxh3_128(b"trace-blocks/root");
    for (i, chunk) in tokens.chunks_exact(bs).enumerate() {
        let start = i * bs;
        let end = start + bs;
        let mut h = Xxh3::new();
        h.update(&parent.to_le_bytes());
        for t in chunk {
            h.update(&t.to_le_bytes());
        }
        for r in mm {
            if r.length == 0 || r.offset >= end || r.offset + r.length <= start {
                continue;
            }
            h.update(b"mm\0");
            h.update(&(r.identifier.len() as u64).to_le_bytes());
            h.update(r.identifier.as_bytes());
            h.update(&(r.offset as i64 - start as i64).to_le_bytes());
        }
        if i == 0
            && let Some(s) = salt
        {
            h.update(b"salt\0");
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        parent = h.digest128();
        out.push(parent as u64);
    }
    out
}

fn hex_list(ids: &[u64]) -> serde_json::Value {
    serde_json::Value::Array(
        ids.iter()
            .map(|id| serde_json::Value::String(format!("{id:016x}")))
            .collect(),
    )
}

fn describe(body: &[u8], opts: &Options) -> Result<serde_json::Value, String> {
    let req = parse(body, &Limits::default()).map_err(|e| format!("{e:?}"))?;
    let raw: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("invalid JSON: {e}"))?;
    let max_tokens = ["max_completion_tokens", "max_tokens"]
        .iter()
        .find_map(|k| raw.get(*k).and_then(serde_json::Value::as_u64))
        .map_or(DEFAULT_MAX_TOKENS, |n| n as usize);
    let mut images = Vec::new();
    for part in req.media() {
        let bytes = match &part.source {
            MediaSource::DataUrl {
                base64: true,
                payload,
                ..
            }
            | MediaSource::Base64(payload) => {
                decode_base64(payload).map_err(|e| format!("image {}: {e:?}", part.index))?
            }
            _ => return Err(format!("image {}: only base64 data is read", part.index)),
        };
        let info = read_image_header(&bytes).map_err(|e| format!("image {}: {e:?}", part.index))?;
        let tokens = opts
            .profile
            .image_tokens(info.width, info.height)
            .map_err(|e| format!("image {}: {e:?}", part.index))?;
        let identifier = match &part.uuid {
            Some(u) => u.to_string(),
            None => format!("{:032x}", xxh3_128(&bytes)),
        };
        images.push(PlacedImage { identifier, tokens });
    }
    let rendered = render(&req, &images);
    let n = rendered.tokens.len();
    let salt = req.cache_salt.as_deref();
    let bs = opts.block_size;
    let blocks = block_ids(&rendered.tokens, &rendered.mm, salt, bs);
    // The mock's output: word i of a sequence seeded by the prompt's token ids.
    let mut le = Vec::with_capacity(n * 4);
    for t in &rendered.tokens {
        le.extend_from_slice(&t.to_le_bytes());
    }
    let seed = xxh3_64(&le);
    let mut text = String::new();
    let mut seq = rendered.tokens.clone();
    for i in 0..max_tokens {
        let (word, id) = output_token(seed, i);
        text.push_str(&word);
        seq.push(id);
    }
    // Cached at the end: the full blocks of prompt + output but the last output token.
    let computed = n + max_tokens.saturating_sub(1);
    seq.truncate(computed / bs * bs);
    let all = block_ids(&seq, &rendered.mm, salt, bs);
    let finish = all.get(blocks.len()..).unwrap_or(&[]);
    Ok(serde_json::json!({
        "prompt_tokens": n,
        "max_tokens": max_tokens,
        "images": images.len(),
        "blocks": hex_list(&blocks),
        "finish_blocks": hex_list(finish),
        "output": text,
    }))
}

fn main() -> std::process::ExitCode {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("trace-blocks: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let stdin = std::io::stdin();
    let mut out = std::io::BufWriter::new(std::io::stdout());
    for line in stdin.lock().split(b'\n') {
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                eprintln!("trace-blocks: reading stdin: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let v = describe(&line, &opts).unwrap_or_else(|e| serde_json::json!({ "error": e }));
        // One answer per line, flushed: the harness talks to this tool line by line.
        if writeln!(out, "{v}").and_then(|()| out.flush()).is_err() {
            return std::process::ExitCode::FAILURE;
        }
    }
    std::process::ExitCode::SUCCESS
}
