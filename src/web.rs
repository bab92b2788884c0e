//! The browser shell: wasm-bindgen exports over the core, for the demo page in `web/`.
//!
//! Built with `cargo build --lib --target wasm32-unknown-unknown --features web --profile wasm`
//! and `wasm-bindgen --target web` (see `scripts/build-web`). Every export takes and returns
//! plain JavaScript values (strings, numbers, `Uint8Array`); structured results are JSON text,
//! so the page does `JSON.parse` on them. Errors are thrown as JavaScript `Error`s whose
//! message is the core's `Display` text.
//!
//! Nothing here does I/O: the page reads files locally and hands their bytes in.

use crate::analysis::describe_image as describe_one;
use crate::identity::MediaId;
use crate::image_header::read_image_header;
use crate::report::inspect_json;
use crate::shell::{InspectOptions, builtin_profiles};
use crate::tokens::Profile;
use serde_json::{Value, json};
use wasm_bindgen::prelude::*;

/// The `mmrouter inspect` report of a request body.
///
/// - `body_json`: the OpenAI request body (chat or completions) as text.
/// - `profile`: a profile spec (e.g. `qwen2.5-vl`, `fixed:576`); empty means "resolve from the
///   model name" with the default configuration (default profile `qwen2.5-vl`).
/// - `block_size`: tokens per KV block; 0 means the default (16, vLLM's).
///
/// Returns the report as JSON text (see [`crate::report`]).
#[wasm_bindgen]
pub fn inspect(body_json: &str, profile: &str, block_size: u32) -> Result<String, JsError> {
    inspect_text(body_json, profile, block_size).map_err(|e| JsError::new(&e))
}

/// Identity, format, size and per-profile token counts of one image file.
///
/// `profiles` lists profile specs; an empty list means every spec of [`profiles()`]. The result
/// is JSON text: `{"id", "source": "inline", "format", "width", "height", "bytes",
/// "profiles": [{"profile", "tokens", "markers"} | {"profile", "error"}]}`. A profile that
/// refuses the size (e.g. an aspect ratio above 200 for Qwen) is reported in its entry; bytes
/// that are not a PNG/JPEG/WebP/GIF header throw.
#[wasm_bindgen]
pub fn describe_image(bytes: &[u8], profiles: Vec<String>) -> Result<String, JsError> {
    describe_text(bytes, &profiles).map_err(|e| JsError::new(&e))
}

/// The profile specs the demo offers ([`crate::shell::KNOWN_PROFILES`]), as a JSON array of
/// strings.
#[wasm_bindgen]
pub fn profiles() -> String {
    Value::from(builtin_profiles()).to_string()
}

/// [`inspect`] without the JavaScript error type (testable natively).
pub fn inspect_text(body_json: &str, profile: &str, block_size: u32) -> Result<String, String> {
    let options = InspectOptions {
        profile: Some(profile),
        block_size: (block_size != 0).then_some(block_size as usize),
        ..InspectOptions::default()
    };
    let analysis = crate::shell::inspect(body_json.as_bytes(), options)?;
    Ok(inspect_json(&analysis).to_string())
}

/// [`describe_image`] without the JavaScript error type (testable natively).
pub fn describe_text(bytes: &[u8], profiles: &[String]) -> Result<String, String> {
    let info = read_image_header(bytes).map_err(|e| e.to_string())?;
    let specs = if profiles.is_empty() {
        builtin_profiles()
    } else {
        profiles.to_vec()
    };
    let per_profile: Vec<Value> = specs
        .iter()
        .map(|spec| {
            let result = Profile::parse(spec)
                .map_err(|e| e.to_string())
                .and_then(|p| describe_one(bytes, &p).map_err(|e| e.to_string()));
            match result {
                Ok(report) => json!({
                    "profile": spec,
                    "tokens": report.tokens.tokens,
                    "markers": report.tokens.markers,
                }),
                Err(error) => json!({"profile": spec, "error": error}),
            }
        })
        .collect();
    let id = MediaId::of_bytes(bytes);
    Ok(json!({
        "id": id.id,
        "source": id.source,
        "format": info.format,
        "width": info.width,
        "height": info.height,
        "bytes": bytes.len(),
        "profiles": per_profile,
    })
    .to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inspect_text_reports_the_same_keys_as_the_core() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"a prompt that is long enough to fill more than one block of sixteen tokens, surely"}]}"#;
        let text = inspect_text(body, "", 0).unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        let config = crate::config::RouterConfig::default();
        let analysis = crate::analysis::analyze(body.as_bytes(), &config).unwrap();
        let keys: Vec<String> = analysis
            .layout
            .keys
            .iter()
            .map(|k| format!("{k:016x}"))
            .collect();
        assert!(!keys.is_empty());
        let shown: Vec<String> = v["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["key"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(shown, keys);
        assert_eq!(v["block_size"], 16);
        let v8: Value = serde_json::from_str(&inspect_text(body, "", 8).unwrap()).unwrap();
        assert_eq!(v8["block_size"], 8);
        assert!(v8["blocks"].as_array().unwrap().len() > keys.len());
    }

    #[test]
    fn inspect_text_refuses_bad_input_with_a_message() {
        assert!(inspect_text("{not json", "", 0).is_err());
        assert!(inspect_text(r#"{"model":"m","messages":[]}"#, "", 5000).is_err());
    }

    #[test]
    fn describe_text_refuses_non_images() {
        let e = describe_text(b"hello, not an image", &[]).unwrap_err();
        assert!(e.contains("unrecognised"), "{e}");
    }
}
