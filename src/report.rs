//! The `inspect` report: one JSON object per analysed request. The CLI, the browser demo and
//! the WIT component all print this shape, so it is built in one place.
//!
//! ```json
//! {"model": "...", "profile": "qwen2.5-vl",
//!  "images": [{"index": 0, "kind": "image", "id": "…32 hex…", "source": "inline",
//!              "format": "png", "width": 640, "height": 480, "tokens": 391, "markers": 2}],
//!  "prompt_tokens": 420, "block_size": 16,
//!  "blocks": [{"key": "…16 hex…", "images": [{"id": "…", "offset": 5}]}]}
//! ```
//! Block keys are 16 lowercase hex characters (u64 does not survive a JavaScript number).
//! `images` lists every media item in request order (kind `image`, `video`, `audio` or
//! `embeds`); `width`/`height`/`format` are null where the bytes were not seen.

use crate::analysis::Analysis;
use serde_json::{Value, json};

/// The report of one analysis.
pub fn inspect_json(analysis: &Analysis) -> Value {
    let images: Vec<Value> = analysis
        .media
        .iter()
        .map(|m| {
            json!({
                "index": m.index,
                "kind": m.kind,
                "id": m.id.id,
                "source": m.id.source,
                "format": m.format,
                "width": m.width,
                "height": m.height,
                "tokens": m.tokens.tokens,
                "markers": m.tokens.markers,
            })
        })
        .collect();
    let layout = &analysis.layout;
    let blocks: Vec<Value> = layout
        .keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let overlaps: Vec<Value> = layout
                .media_of(i)
                .map(|o| {
                    let id = analysis
                        .media
                        .get(o.media as usize)
                        .map(|m| m.id.id.as_str())
                        .unwrap_or("");
                    json!({"id": id, "offset": o.offset})
                })
                .collect();
            json!({"key": format!("{key:016x}"), "images": overlaps})
        })
        .collect();
    json!({
        "model": analysis.model,
        "profile": analysis.profile.spec,
        "images": images,
        "prompt_tokens": layout.prompt_tokens,
        "block_size": layout.block_size,
        "blocks": blocks,
    })
}
