//! The WIT component: the core behind the typed interface of `wit/router.wit` (package
//! `mmrouter:core`, world `router`), for any component-model host (Wasmtime, jco, ...).
//!
//! Built with `cargo build --lib --target wasm32-wasip2 --features component --profile wasm`;
//! the cdylib `mmrouter.wasm` under `wasm32-wasip2/wasm/` is the component. `tests/component.rs`
//! instantiates it in Wasmtime and checks every export against the native core.
//!
//! The records mirror the `mmrouter inspect` JSON ([`crate::report`]) except that block keys
//! are `u64` here (JSON writes them as hex strings).

// The generated lifting/lowering code of the records takes one argument per flattened field.
#![allow(clippy::too_many_arguments)]

use crate::analysis::{MediaReport, describe_image as describe_one};
use crate::identity::IdSource as CoreIdSource;
use crate::image_header::ImageFormat as CoreImageFormat;
use crate::request::MediaKind as CoreMediaKind;
use crate::scoring::Candidate;
use crate::shell::{InspectOptions as CoreOptions, WorkerState, builtin_profiles, config_from};
use crate::tokens::Profile;

wit_bindgen::generate!({
    path: "wit",
    world: "router",
});

// `use types.{...}` in the world brings the records it names into this module.
use mmrouter::core::types::{Block, BlockImage, IdSource, ImageFormat, MediaItem, MediaKind};

struct Router;

impl Guest for Router {
    fn inspect(body: Vec<u8>, options: InspectOptions) -> Result<Inspection, String> {
        let core_options = CoreOptions {
            profile: options.profile.as_deref(),
            model: options.model.as_deref(),
            config_json: options.config_json.as_deref(),
            block_size: None,
        };
        let analysis = crate::shell::inspect(&body, core_options)?;
        let layout = &analysis.layout;
        let blocks = layout
            .keys
            .iter()
            .enumerate()
            .map(|(i, &key)| Block {
                key,
                images: layout
                    .media_of(i)
                    .map(|o| BlockImage {
                        id: analysis
                            .media
                            .get(o.media as usize)
                            .map(|m| m.id.id.clone())
                            .unwrap_or_default(),
                        offset: o.offset,
                    })
                    .collect(),
            })
            .collect();
        Ok(Inspection {
            model: analysis.model.clone(),
            profile: analysis.profile.spec.clone(),
            images: analysis.media.iter().map(media_item).collect(),
            prompt_tokens: saturate(layout.prompt_tokens),
            block_size: saturate(layout.block_size),
            blocks,
        })
    }

    fn describe_image(bytes: Vec<u8>, profile: String) -> Result<ImageInfo, String> {
        let profile = Profile::parse(profile.trim()).map_err(|e| e.to_string())?;
        let report = describe_one(&bytes, &profile).map_err(|e| e.to_string())?;
        let (Some(format), Some(width), Some(height)) =
            (report.format, report.width, report.height)
        else {
            return Err("the image header gave no size".to_string());
        };
        Ok(ImageInfo {
            id: report.id.id,
            format: image_format(format),
            width,
            height,
            bytes: saturate(bytes.len()),
            tokens: report.tokens.tokens,
            markers: report.tokens.markers,
        })
    }

    fn score(
        keys: Vec<u64>,
        workers: Vec<Worker>,
        config_json: Option<String>,
        seed: u64,
    ) -> Result<Choice, String> {
        let config = config_from(config_json.as_deref())?;
        let states: Vec<WorkerState> = workers
            .into_iter()
            .map(|w| WorkerState {
                held: w.held,
                load: Candidate {
                    matched_blocks: 0,
                    queued_s: w.queued_ms / 1000.0,
                    waiting: w.waiting,
                    running: w.running,
                    prefill_tps: w.prefill_tps,
                    // The WIT world carries no measured peak: speeds are not compared.
                    peak_prefill_tps: None,
                    footprint: w.footprint,
                    capacity_blocks: None,
                    inflight: w.inflight,
                    holds_conversation: false,
                },
            })
            .collect();
        let scored = crate::shell::score(&keys, &states, &config, seed)?;
        Ok(Choice {
            worker: saturate(scored.worker),
            matched_blocks: saturate(scored.matched_blocks),
            total_blocks: saturate(scored.total_blocks),
            matched: scored.matched.into_iter().map(saturate).collect(),
            wait_ms: scored.estimate.wait_s * 1000.0,
            prefill_ms: scored.estimate.prefill_s * 1000.0,
            recompute_ms: scored.estimate.recompute_s * 1000.0,
            cost_ms: scored.estimate.cost_s * 1000.0,
        })
    }

    fn profiles() -> Vec<String> {
        builtin_profiles()
    }
}

export!(Router);

fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn media_item(m: &MediaReport) -> MediaItem {
    MediaItem {
        index: saturate(m.index),
        kind: match m.kind {
            CoreMediaKind::Image => MediaKind::Image,
            CoreMediaKind::Video => MediaKind::Video,
            CoreMediaKind::Audio => MediaKind::Audio,
            CoreMediaKind::Embeds => MediaKind::Embeds,
        },
        id: m.id.id.clone(),
        source: match m.id.source {
            // The component never fetches; a fetched id is one of the bytes, as inline.
            CoreIdSource::Inline | CoreIdSource::Fetched => IdSource::Inline,
            CoreIdSource::Url => IdSource::Url,
            CoreIdSource::Uuid => IdSource::Uuid,
        },
        format: m.format.map(image_format),
        width: m.width,
        height: m.height,
        tokens: m.tokens.tokens,
        markers: m.tokens.markers,
    }
}

fn image_format(f: CoreImageFormat) -> ImageFormat {
    match f {
        CoreImageFormat::Png => ImageFormat::Png,
        CoreImageFormat::Jpeg => ImageFormat::Jpeg,
        CoreImageFormat::Webp => ImageFormat::Webp,
        CoreImageFormat::Gif => ImageFormat::Gif,
    }
}
