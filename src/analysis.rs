//! One request body through the first five steps: scan (which identifies and sizes every
//! inline image as its bytes arrive), count tokens, lay out.
//!
//! The result is everything routing needs (the block keys) and everything a person wants to
//! see (`mmrouter inspect`, the browser demo). [`analyze`] takes a body held whole;
//! [`Analyzer`] takes it in pieces as a proxy receives it (the profile, which depends on the
//! `model` field that may come last, is applied at [`Analyzer::finish`]).
//!
//! A proxy that fetches http(s) images splits the end in two: [`Analyzer::finish_scan`] gives
//! the [`Scanned`] body (nothing left to read), [`Scanned::url_images`] names the images to
//! fetch, and [`Scanned::finish`] describes them from what was fetched ([`FetchedImage`]: the
//! same content identity and header size as an inline image of the same bytes) before the
//! layout, which needs every item's identity and tokens.

use crate::config::RouterConfig;
use crate::identity::{DecodeError, MediaId};
use crate::image_header::{HeaderError, HeaderReader, ImageFormat, ImageInfo, read_image_header};
use crate::layout::{Layout, PlacedMedia, layout};
use crate::request::{MediaKind, RequestError};
use crate::scan::{BodyScanner, MediaContent, MediaSite, ScannedBody, ScannedMedia, SkippedPart};
use crate::tokens::{ImageTokens, Profile, TokenError};
use std::fmt;
use xxhash_rust::xxh3::Xxh3;

/// Re-exported where it used to live: the defaults belong to token estimation.
pub use crate::tokens::MediaDefaults;

/// What the router knows about one media item.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MediaReport {
    pub index: usize,
    pub kind: MediaKind,
    pub id: MediaId,
    /// Format and size read from the file header (images with bytes only).
    pub format: Option<ImageFormat>,
    pub width: Option<u32>,
    pub height: Option<u32>,
    /// Decoded size of inline data, in bytes.
    pub bytes: Option<usize>,
    pub tokens: ImageTokens,
}

/// A request analysed: its profile, media and block layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Analysis {
    pub model: String,
    pub profile: Profile,
    pub stream: bool,
    pub media: Vec<MediaReport>,
    pub layout: Layout,
    /// Where each media item's part sits in the body (`sites[i]` is `media[i]`'s), for
    /// stamping a `uuid` into it.
    pub sites: Vec<MediaSite>,
    /// Content parts that were skipped (the first [`crate::scan::MAX_SKIPPED_KEPT`]), and how
    /// many there were in all.
    pub skipped: Vec<SkippedPart>,
    pub skipped_count: usize,
}

/// Why a media item could not be analysed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MediaError {
    Decode(DecodeError),
    Header(HeaderError),
    Tokens(TokenError),
}

impl fmt::Display for MediaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MediaError::Decode(e) => e.fmt(f),
            MediaError::Header(e) => e.fmt(f),
            MediaError::Tokens(e) => e.fmt(f),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnalyzeError {
    Request(RequestError),
    Profile(TokenError),
    /// Media item `index` (request order, from 0) of kind `kind`.
    Media {
        index: usize,
        kind: MediaKind,
        error: MediaError,
    },
}

impl AnalyzeError {
    /// A short, stable name for metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            AnalyzeError::Request(RequestError::TooLarge { .. }) => "too_large",
            AnalyzeError::Request(RequestError::Json(_)) => "bad_json",
            AnalyzeError::Request(RequestError::Shape(_)) => "bad_shape",
            AnalyzeError::Request(_) => "bad_request",
            AnalyzeError::Profile(_) => "bad_profile",
            AnalyzeError::Media {
                error: MediaError::Decode(_),
                ..
            } => "bad_base64",
            AnalyzeError::Media {
                error: MediaError::Header(_),
                ..
            } => "bad_image",
            AnalyzeError::Media {
                error: MediaError::Tokens(_),
                ..
            } => "bad_image_size",
        }
    }
}

impl fmt::Display for AnalyzeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AnalyzeError::Request(e) => e.fmt(f),
            AnalyzeError::Profile(e) => e.fmt(f),
            AnalyzeError::Media { index, kind, error } => {
                let kind = match kind {
                    MediaKind::Image => "image",
                    MediaKind::Video => "video",
                    MediaKind::Audio => "audio",
                    MediaKind::Embeds => "image_embeds",
                };
                write!(f, "{kind} {index}: {error}")
            }
        }
    }
}

impl std::error::Error for AnalyzeError {}

/// What a caller can impose on an analysis instead of what the body says.
#[derive(Debug, Clone, Copy, Default)]
pub struct Overrides<'a> {
    /// Analyse as if the body named this model (profile rules and key chain follow it).
    pub model: Option<&'a str>,
    /// Use this profile instead of the model-name rules.
    pub profile: Option<&'a Profile>,
}

/// Analyses a body with the profile its model resolves to.
pub fn analyze(body: &[u8], config: &RouterConfig) -> Result<Analysis, AnalyzeError> {
    analyze_with(body, config, Overrides::default())
}

/// Analyses a body with caller overrides.
pub fn analyze_with(
    body: &[u8],
    config: &RouterConfig,
    overrides: Overrides<'_>,
) -> Result<Analysis, AnalyzeError> {
    let mut analyzer = Analyzer::new(config);
    analyzer.feed(body)?;
    analyzer.finish_with(config, overrides)
}

/// An analysis fed the body in pieces as it arrives: every piece is scanned (and its image
/// bytes hashed) when it is fed, so [`Analyzer::finish`] has only the layout left to do.
///
/// Memory: what [`crate::scan`] documents; the body itself is never held.
#[derive(Debug)]
pub struct Analyzer {
    scanner: BodyScanner,
}

impl Analyzer {
    /// Starts an analysis under `config.limits`.
    pub fn new(config: &RouterConfig) -> Analyzer {
        Analyzer {
            scanner: BodyScanner::new(&config.limits),
        }
    }

    /// The next piece of the body. An error is final: every later call returns it again.
    pub fn feed(&mut self, piece: &[u8]) -> Result<(), AnalyzeError> {
        self.scanner.feed(piece).map_err(AnalyzeError::Request)
    }

    /// Bytes fed so far.
    pub fn bytes_seen(&self) -> usize {
        self.scanner.bytes_seen()
    }

    /// The end of the body: profile, tokens and layout. `config` should be the one the
    /// analyzer was started with.
    pub fn finish(self, config: &RouterConfig) -> Result<Analysis, AnalyzeError> {
        self.finish_with(config, Overrides::default())
    }

    /// [`Analyzer::finish`] with caller overrides.
    pub fn finish_with(
        self,
        config: &RouterConfig,
        overrides: Overrides<'_>,
    ) -> Result<Analysis, AnalyzeError> {
        self.finish_scan()?.finish(config, overrides, &[])
    }

    /// The end of the body, before tokens and layout: what is left needs no byte of the body.
    pub fn finish_scan(self) -> Result<Scanned, AnalyzeError> {
        Ok(Scanned {
            body: self.scanner.finish().map_err(AnalyzeError::Request)?,
        })
    }
}

/// A body scanned to its end ([`Analyzer::finish_scan`]): its prompt text and media, before
/// tokens and layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Scanned {
    body: ScannedBody,
}

impl Scanned {
    /// The images given by URL (not inline), with their media index, in request order: the
    /// ones a proxy can fetch. The URL is as the client wrote it (any scheme).
    pub fn url_images(&self) -> Vec<(usize, &str)> {
        self.body
            .media
            .iter()
            .filter(|m| m.kind == MediaKind::Image)
            .filter_map(|m| match &m.content {
                MediaContent::Url(url) => Some((m.index, url.as_str())),
                _ => None,
            })
            .collect()
    }

    /// Profile, tokens and layout. An image given by URL whose index is in `fetched` is
    /// described from its fetched bytes (content identity, header size); the others get the
    /// URL identity and the configured size, as without fetching.
    pub fn finish(
        self,
        config: &RouterConfig,
        overrides: Overrides<'_>,
        fetched: &[(usize, FetchedImage)],
    ) -> Result<Analysis, AnalyzeError> {
        analysis_of(self.body, config, overrides, fetched)
    }
}

/// An image fetched from its URL: what the router needs of its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FetchedImage {
    /// xxh3-128 of the bytes: the same content identity as the image sent inline.
    pub digest: u128,
    /// Format and size from the header (after EXIF orientation, as for inline images).
    pub info: ImageInfo,
    /// Length of the file in bytes.
    pub bytes: u32,
}

impl FetchedImage {
    /// The identity and size of an image file held whole.
    pub fn of_bytes(bytes: &[u8]) -> Result<FetchedImage, HeaderError> {
        let mut d = ImageDigest::new();
        d.feed(bytes);
        d.finish()
    }
}

/// An image file read in pieces (a fetched body copied out of the proxy a chunk at a time):
/// hashed and its header read as the pieces come, nothing kept.
pub struct ImageDigest {
    hasher: Xxh3,
    header: HeaderReader,
    bytes: u64,
}

impl fmt::Debug for ImageDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImageDigest")
            .field("bytes", &self.bytes)
            .finish_non_exhaustive()
    }
}

impl Default for ImageDigest {
    fn default() -> Self {
        ImageDigest::new()
    }
}

impl ImageDigest {
    pub fn new() -> ImageDigest {
        ImageDigest {
            hasher: Xxh3::new(),
            header: HeaderReader::new(),
            bytes: 0,
        }
    }

    pub fn feed(&mut self, piece: &[u8]) {
        self.hasher.update(piece);
        self.header.feed(piece);
        self.bytes = self.bytes.saturating_add(piece.len() as u64);
    }

    /// Bytes fed so far.
    pub fn len(&self) -> u64 {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The end of the file: its identity and size, or why its header cannot be read.
    pub fn finish(self) -> Result<FetchedImage, HeaderError> {
        let info = self.header.finish()?;
        Ok(FetchedImage {
            digest: self.hasher.digest128(),
            info,
            bytes: u32::try_from(self.bytes).unwrap_or(u32::MAX),
        })
    }
}

fn analysis_of(
    body: ScannedBody,
    config: &RouterConfig,
    overrides: Overrides<'_>,
    fetched: &[(usize, FetchedImage)],
) -> Result<Analysis, AnalyzeError> {
    let ScannedBody {
        mut prompt,
        stream,
        media: scanned,
        skipped,
        skipped_count,
    } = body;
    if let Some(model) = overrides.model {
        prompt.model = model.into();
    }
    let profile = match overrides.profile {
        Some(p) => p.clone(),
        None => config
            .profiles
            .resolve(&prompt.model)
            .map_err(AnalyzeError::Profile)?,
    };
    let mut media = Vec::with_capacity(scanned.len());
    let mut media_tokens = 0u64;
    for item in &scanned {
        let fetched = fetched
            .iter()
            .find(|(i, _)| *i == item.index)
            .map(|(_, f)| f);
        let report = describe_media(item, &profile, &config.media, fetched).map_err(|error| {
            AnalyzeError::Media {
                index: item.index,
                kind: item.kind,
                error,
            }
        })?;
        media_tokens += u64::from(report.tokens.tokens) + u64::from(report.tokens.markers);
        if media_tokens > config.limits.max_media_tokens {
            return Err(AnalyzeError::Media {
                index: item.index,
                kind: item.kind,
                error: MediaError::Tokens(TokenError::BadSize(format!(
                    "the request's media take more than limits.max_media_tokens ({})",
                    config.limits.max_media_tokens
                ))),
            });
        }
        media.push(report);
    }
    let placed: Vec<PlacedMedia> = media
        .iter()
        .map(|m| PlacedMedia {
            key: m.id.key64(),
            tokens: m.tokens,
        })
        .collect();
    let layout = layout(&prompt, &placed, config.block_size);
    Ok(Analysis {
        model: prompt.model,
        profile,
        stream,
        media,
        layout,
        sites: scanned.iter().map(|m| m.site).collect(),
        skipped,
        skipped_count,
    })
}

/// Identity, format, size and tokens of one image file.
pub fn describe_image(bytes: &[u8], profile: &Profile) -> Result<MediaReport, MediaError> {
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

fn describe_media(
    item: &ScannedMedia,
    profile: &Profile,
    defaults: &MediaDefaults,
    fetched: Option<&FetchedImage>,
) -> Result<MediaReport, MediaError> {
    let fixed = |tokens: u32| ImageTokens { tokens, markers: 2 };
    let url_sized = || {
        profile
            .image_tokens(defaults.url_image_width, defaults.url_image_height)
            .map_err(MediaError::Tokens)
    };
    let uuid_id = || MediaId::of_uuid(item.uuid.as_deref().unwrap_or_default());
    let mut report = match (&item.content, item.kind) {
        (MediaContent::Invalid(e), _) => return Err(MediaError::Decode(e.clone())),
        // Never described: an earlier item failed, and the analysis stops there.
        (MediaContent::Unread, _) => return Err(MediaError::Decode(DecodeError::Empty)),
        (
            MediaContent::Inline {
                hash,
                bytes,
                header,
            },
            MediaKind::Image,
        ) => {
            let info = match header {
                Some(Ok(info)) => *info,
                Some(Err(e)) => return Err(MediaError::Header(e.clone())),
                None => return Err(MediaError::Header(HeaderError::Unrecognised)),
            };
            let tokens = profile
                .image_tokens(info.width, info.height)
                .map_err(MediaError::Tokens)?;
            MediaReport {
                index: 0,
                kind: MediaKind::Image,
                id: MediaId::of_digest(*hash),
                format: Some(info.format),
                width: Some(info.width),
                height: Some(info.height),
                bytes: Some(*bytes),
                tokens,
            }
        }
        // An image fetched from its URL: described by its bytes, as if it were inline.
        (MediaContent::Url(_), MediaKind::Image) if fetched.is_some() => {
            let Some(f) = fetched else {
                return Err(MediaError::Header(HeaderError::Unrecognised));
            };
            MediaReport {
                index: 0,
                kind: MediaKind::Image,
                id: MediaId::of_fetched(f.digest),
                format: Some(f.info.format),
                width: Some(f.info.width),
                height: Some(f.info.height),
                bytes: Some(f.bytes as usize),
                tokens: profile
                    .image_tokens(f.info.width, f.info.height)
                    .map_err(MediaError::Tokens)?,
            }
        }
        // An image whose bytes were not seen: the size llm-d assumes.
        (MediaContent::Url(_) | MediaContent::UuidOnly, MediaKind::Image) => MediaReport {
            index: 0,
            kind: MediaKind::Image,
            id: match &item.content {
                MediaContent::Url(url) => MediaId::of_url(url),
                _ => uuid_id(),
            },
            format: None,
            width: None,
            height: None,
            bytes: None,
            tokens: url_sized()?,
        },
        (content, kind) => {
            let (id, bytes) = match content {
                MediaContent::Inline { hash, bytes, .. } => {
                    (MediaId::of_digest(*hash), Some(*bytes))
                }
                MediaContent::Url(url) => (MediaId::of_url(url), None),
                MediaContent::Embeds { hash } => (MediaId::of_digest(*hash), None),
                _ => (uuid_id(), None),
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
    report.index = item.index;
    report.kind = item.kind;
    if let Some(uuid) = &item.uuid {
        report.id = MediaId::of_uuid(uuid);
    }
    Ok(report)
}
