//! The analysis pipeline as it was before the streaming scanner (`src/analysis.rs` and
//! `src/layout.rs` at the commit before the scanner branch): the serde parser (the mock
//! worker's, `src/bin/mock_worker/request.rs`), `decode_base64` of every payload, the slice
//! header reader, and the layout over the parsed request. The oracle of `tests/scan.rs`.
//!
//! The test crate declares `reference_request` and `reference_header` next to this module.

#![allow(dead_code)]

use crate::reference_header::read_image_header;
use crate::reference_request::{MediaPart, MediaSource, Part, Request, parse};
use mmrouter::analysis::{AnalyzeError, MediaDefaults, MediaError, MediaReport, Overrides};
use mmrouter::config::RouterConfig;
use mmrouter::identity::{DecodeError, MediaId, decode_base64};
use mmrouter::layout::{BlockMedia, Layout, PlacedMedia, chain_seed, pseudo_tokens};
use mmrouter::request::{ApiKind, MediaKind};
use mmrouter::tokens::{ImageTokens, Profile};
use xxhash_rust::xxh3::xxh3_64;

/// What the old `analyze` returned (the fields `Analysis` had).
#[derive(Debug, Clone, PartialEq)]
pub struct OldAnalysis {
    pub model: String,
    pub profile: Profile,
    pub stream: bool,
    pub media: Vec<MediaReport>,
    pub layout: Layout,
}

pub fn analyze(body: &[u8], config: &RouterConfig) -> Result<OldAnalysis, AnalyzeError> {
    analyze_with(body, config, Overrides::default())
}

pub fn analyze_with(
    body: &[u8],
    config: &RouterConfig,
    overrides: Overrides<'_>,
) -> Result<OldAnalysis, AnalyzeError> {
    let mut request = parse(body, &config.limits).map_err(AnalyzeError::Request)?;
    if let Some(model) = overrides.model {
        request.model = model.into();
    }
    let profile = match overrides.profile {
        Some(p) => p.clone(),
        None => config
            .profiles
            .resolve(&request.model)
            .map_err(AnalyzeError::Profile)?,
    };
    let mut media = Vec::new();
    for part in request.media() {
        let report =
            describe_part(part, &profile, &config.media).map_err(|error| AnalyzeError::Media {
                index: part.index,
                kind: part.kind,
                error,
            })?;
        media.push(report);
    }
    let placed: Vec<PlacedMedia> = media
        .iter()
        .map(|m| PlacedMedia {
            key: m.id.key64(),
            tokens: m.tokens,
        })
        .collect();
    let layout = layout(&request, &placed, config.block_size);
    Ok(OldAnalysis {
        model: request.model.into_owned(),
        profile,
        stream: request.stream,
        media,
        layout,
    })
}

/// Identity, format, size and tokens of one image file.
fn describe_image(bytes: &[u8], profile: &Profile) -> Result<MediaReport, MediaError> {
    let info = read_image_header(bytes).map_err(MediaError::Header)?;
    let tokens = profile
        .image_tokens(info.width, info.height)
        .map_err(MediaError::Tokens)?;
    Ok(MediaReport {
        index: 0,
        kind: MediaKind::Image,
        id: MediaId::of_bytes(bytes),
        format: Some(info.format),
        width: Some(info.width),
        height: Some(info.height),
        bytes: Some(bytes.len()),
        tokens,
    })
}

fn describe_part(
    part: &MediaPart<'_>,
    profile: &Profile,
    defaults: &MediaDefaults,
) -> Result<MediaReport, MediaError> {
    let fixed = |tokens: u32| ImageTokens { tokens, markers: 2 };
    let mut report = match (&part.source, part.kind) {
        (MediaSource::DataUrl { base64: false, .. }, _) => {
            return Err(MediaError::Decode(DecodeError::NotBase64));
        }
        (MediaSource::DataUrl { payload, .. }, MediaKind::Image) => {
            let bytes = decode_base64(payload).map_err(MediaError::Decode)?;
            describe_image(&bytes, profile)?
        }
        (MediaSource::Url(url), MediaKind::Image) => {
            let tokens = profile
                .image_tokens(defaults.url_image_width, defaults.url_image_height)
                .map_err(MediaError::Tokens)?;
            MediaReport {
                index: 0,
                kind: MediaKind::Image,
                id: MediaId::of_url(url),
                format: None,
                width: None,
                height: None,
                bytes: None,
                tokens,
            }
        }
        (source, kind) => {
            let (id, bytes) = match source {
                MediaSource::DataUrl { payload, .. } | MediaSource::Base64(payload)
                    if !payload.is_empty() =>
                {
                    let bytes = decode_base64(payload).map_err(MediaError::Decode)?;
                    (MediaId::of_bytes(&bytes), Some(bytes.len()))
                }
                MediaSource::Url(url) => (MediaId::of_url(url), None),
                MediaSource::RawJson(raw) => (MediaId::of_bytes(raw.as_bytes()), None),
                MediaSource::DataUrl { .. } | MediaSource::Base64(_) => {
                    return Err(MediaError::Decode(DecodeError::Empty));
                }
            };
            let tokens = match kind {
                MediaKind::Video => defaults.video_tokens,
                MediaKind::Audio => defaults.audio_tokens,
                MediaKind::Embeds | MediaKind::Image => defaults.embeds_tokens,
            };
            MediaReport {
                index: 0,
                kind,
                id,
                format: None,
                width: None,
                height: None,
                bytes,
                tokens: fixed(tokens),
            }
        }
    };
    report.index = part.index;
    report.kind = part.kind;
    if let Some(uuid) = &part.uuid {
        report.id = MediaId::of_uuid(uuid);
    }
    Ok(report)
}

const IM_START: u32 = u32::MAX;
const IM_END: u32 = u32::MAX - 1;
const MEDIA_START: u32 = u32::MAX - 2;
const MEDIA_END: u32 = u32::MAX - 3;
const MEDIA_PAD: u32 = u32::MAX - 4;
const NEWLINE: u32 = u32::MAX - 5;

/// A run of placeholder tokens in the virtual sequence.
#[derive(Debug, Clone, Copy)]
struct Span {
    start: usize,
    len: usize,
    media: u32,
    key: u64,
}

pub fn layout(request: &Request<'_>, media: &[PlacedMedia], block_size: usize) -> Layout {
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
        if preamble_tokens.is_none() && !matches!(&*message.role, "system" | "developer") {
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
                Part::Media(m) => {
                    let Some(placed) = media.get(m.index) else {
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
                        media: u32::try_from(m.index).unwrap_or(u32::MAX),
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
