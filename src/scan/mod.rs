//! The request body, read once as it arrives: a hand-written incremental scanner over
//! `/v1/chat/completions` and `/v1/completions` bodies that keeps only what routing needs and
//! hashes every inline image while its base64 streams by.
//!
//! ```text
//! let mut s = BodyScanner::new(&limits);
//! s.feed(chunk)?;   // as often as the body arrives, in pieces of any size
//! let body = s.finish()?;
//! ```
//!
//! # What it finds
//!
//! `model`, `cache_salt`, `stream`; `messages` with each message's `role` and `content` (a
//! string, or parts: text, and media of every shape vLLM accepts); or `prompt` (a string, a
//! list of strings, or token ids). Everything else is skipped without building values, but
//! still validated as JSON with serde_json's rules (module `json`), so a body that was bad JSON is
//! still an error. Keys come in any order: `model` may follow `messages`.
//!
//! Media parts (vLLM's `vllm/entrypoints/chat_utils.py`): `image_url` (an object with `url`, or
//! a bare string), `input_image` (Responses API: `image_url` string or object), `video_url`,
//! `audio_url` (object or string), `input_audio` (`{"data": base64}`), `image_embeds` and
//! `audio_embeds` (any JSON value: its text is hashed), `image_pil` (only meaningful in JSON
//! with a `uuid`). A part without `type` is typed by its keys, in vLLM's order. A media part
//! with no payload but a `uuid` is kept: vLLM looks the item up by its uuid. Text parts:
//! `text`, `input_text`, `output_text` (`text`), `thinking`, `refusal`, `tool_reference`
//! (`name`), and a bare string in the content list.
//!
//! A part that is none of these, or lacks what its type needs, or has a field of the wrong JSON
//! type, is skipped and counted ([`ScannedBody::skipped`]); the rest of the request keeps its
//! cache affinity. (The serde parser this replaced refused the whole body instead; vLLM refuses
//! such a request too, so routing it anywhere is harmless.)
//!
//! For each `data:...;base64,` payload the base64 is decoded in 3 KiB steps straight into an
//! xxh3-128 hasher ([`MediaContent::Inline`], the same [`crate::identity::MediaId`] as hashing
//! the whole decoded file) and, for images, into the incremental header reader
//! ([`crate::image_header::HeaderReader`]); the decoded bytes are never held.
//!
//! # Limits, enforced inside the pass
//!
//! The body size (`max_body_bytes`, counted as pieces arrive), the nesting depth
//! (`max_nesting`, on every `[` and `{`) and the media count (`max_media_items`: no payload is
//! decoded past it, and the next media part is an error). Errors are [`RequestError`] values;
//! the first one stops the scan and is returned again by every later call.
//!
//! # Memory
//!
//! Per scan, independent of the body size except for the text that routing keeps:
//!
//! - kept text: model, `cache_salt`, roles, text parts, the prompt, media URLs and uuids (at
//!   most the body size; no base64 payload, decoded byte, or skipped value is ever kept);
//! - per media item: a [`ScannedMedia`] (under 100 bytes plus its URL/uuid);
//! - skipped parts: the count, and the first [`MAX_SKIPPED_KEPT`] reasons (each at most
//!   [`MAX_TYPE_KEPT`] bytes of text);
//! - the JSON lexer: one byte per open container (at most `max_nesting`) and a few bytes of
//!   state, including up to 3 bytes of a UTF-8 sequence cut between pieces;
//! - the part being read: its fields (text fields kept until the part's type is known);
//! - the payload being read (one at a time): the base64 state and a 3 KiB output buffer, the
//!   xxh3 state (~600 bytes), and the image header reader: a 12-33 byte prefix, at most one
//!   EXIF payload of at most 64 KiB while it streams by, or the `gif` crate's decoder state.
//!
//! # For body rewriting
//!
//! Each media item records [`MediaSite`]: the body offset just after its part object's `{`
//! and whether the part has a `uuid` key, so a `"uuid": "...",` can be inserted there.
//!
//! # Against the serde parser it replaced
//!
//! On every body that parser accepted, the scan gives the same prompt and media, and the
//! analysis the same reports and block keys (`tests/scan.rs` checks it against that parser,
//! kept as the mock worker's, on generated bodies and every fixture, whole and in pieces).
//! Where it differs, on purpose:
//!
//! - content parts it refused are skipped (above), and the part shapes it did not know are read;
//! - an array where a struct was expected (serde's positional form, `["model", [...]]`) is a
//!   `Shape` error: no client sends one, and vLLM refuses it;
//! - the first error in the body's order is reported. The old parser ran its nesting check over
//!   the whole body before parsing, and judged `content`/`prompt` only once read whole, so on a
//!   body with two faults it may have named the other one; a body with one fault gets the same
//!   [`crate::analysis::AnalyzeError::reason`]. `TooManyMedia` comes as the part over the limit
//!   closes, not after the whole body;
//! - `Json` and `Shape` messages are the scanner's own (with the byte offset); base64 and image
//!   header errors are word for word the same.

mod base64;
mod json;
mod part;
mod payload;
mod shape;

use crate::identity::DecodeError;
use crate::image_header::{HeaderError, ImageInfo};
use crate::request::{Limits, MediaKind, Prompt, RequestError};
use std::fmt;

/// Skipped parts whose reasons are kept (the count goes on).
pub const MAX_SKIPPED_KEPT: usize = 16;
/// Bytes of an unknown part type kept for its skip reason.
pub const MAX_TYPE_KEPT: usize = 64;

/// What a scan found.
#[derive(Debug, Clone, PartialEq)]
pub struct ScannedBody {
    /// The prompt: API, model, `cache_salt`, messages with text parts and media references.
    pub prompt: Prompt,
    pub stream: bool,
    /// Media items in request order (`media[i].index == i`), each referenced once by a
    /// [`crate::request::Part::Media`] of the prompt.
    pub media: Vec<ScannedMedia>,
    /// The first [`MAX_SKIPPED_KEPT`] skipped parts.
    pub skipped: Vec<SkippedPart>,
    /// All skipped parts.
    pub skipped_count: usize,
}

/// One media item.
#[derive(Debug, Clone, PartialEq)]
pub struct ScannedMedia {
    /// Position among the media items of the request, from 0.
    pub index: usize,
    pub kind: MediaKind,
    /// The client's `uuid`: vLLM uses it verbatim as the item's cache identity.
    pub uuid: Option<String>,
    pub content: MediaContent,
    pub site: MediaSite,
}

/// Where a media item's bytes are, as far as the scan saw them.
#[derive(Debug, Clone, PartialEq)]
pub enum MediaContent {
    /// Inline base64 (a data URL or `input_audio.data`), decoded as it streamed.
    Inline {
        /// xxh3-128 of the decoded bytes.
        hash: u128,
        /// Decoded length.
        bytes: usize,
        /// The image header (images only).
        header: Option<Result<ImageInfo, HeaderError>>,
    },
    /// An http(s) (or other) URL, verbatim.
    Url(String),
    /// `image_embeds`/`audio_embeds`: xxh3-128 of the value's JSON text.
    Embeds { hash: u128 },
    /// No payload: only the client's uuid names the item.
    UuidOnly,
    /// Inline data that is not valid base64, or a data URL that is not base64.
    Invalid(DecodeError),
    /// Not decoded: an earlier media item already failed, so the analysis fails there.
    Unread,
}

/// Where a media part sits in the body, for inserting a `uuid` into it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediaSite {
    /// Body offset just after the part object's `{`.
    pub offset: usize,
    /// The part object has a `uuid` key (of any value).
    pub has_uuid: bool,
}

/// A content part that was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedPart {
    /// Index of the message, and of the part in its content list.
    pub message: usize,
    pub part: usize,
    pub reason: SkipReason,
}

/// Why a content part was skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkipReason {
    /// A `type` this router does not route on (at most [`MAX_TYPE_KEPT`] bytes of it).
    UnsupportedType(String),
    /// No `type`, and no key that tells it.
    MissingType,
    /// `type` is not a string.
    TypeNotString,
    /// The field the part's type needs is missing or null (and there is no `uuid`).
    MissingField(&'static str),
    /// A field has the wrong JSON type or shape, or appears twice.
    BadField(&'static str),
    /// A content list item that is neither an object nor a string.
    NotAnObject,
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipReason::UnsupportedType(t) => write!(f, "unsupported content part type `{t}`"),
            SkipReason::MissingType => f.write_str("content part without `type`"),
            SkipReason::TypeNotString => f.write_str("content part `type` is not a string"),
            SkipReason::MissingField(name) => write!(f, "content part without `{name}`"),
            SkipReason::BadField(name) => write!(f, "content part with a malformed `{name}`"),
            SkipReason::NotAnObject => f.write_str("content part is not an object or a string"),
        }
    }
}

impl fmt::Display for SkippedPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "message {}, part {}: {}",
            self.message, self.part, self.reason
        )
    }
}

/// The scanner: feed it the body in pieces, then finish.
#[derive(Debug)]
pub struct BodyScanner {
    limits: Limits,
    lexer: json::Lexer,
    shape: shape::Shape,
    seen: usize,
    error: Option<RequestError>,
}

impl BodyScanner {
    pub fn new(limits: &Limits) -> BodyScanner {
        BodyScanner {
            limits: limits.clone(),
            lexer: json::Lexer::new(limits.max_nesting),
            shape: shape::Shape::new(limits.max_media_items),
            seen: 0,
            error: None,
        }
    }

    /// The next piece of the body. Never needs an earlier piece again.
    pub fn feed(&mut self, piece: &[u8]) -> Result<(), RequestError> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        let allowed = self.limits.max_body_bytes.saturating_sub(self.seen);
        self.seen = self.seen.saturating_add(piece.len());
        let result = if piece.len() > allowed {
            // The bytes under the limit are read first, so that an error in them is the
            // body's error however it was cut into pieces (found by the fuzz target
            // `analyze`: a body given whole said "too large", the same body in pieces named
            // the invalid JSON before the limit).
            let under = piece.get(..allowed).unwrap_or(piece);
            self.lexer
                .feed(under, &mut self.shape)
                .and(Err(RequestError::TooLarge {
                    bytes: self.seen,
                    limit: self.limits.max_body_bytes,
                }))
        } else {
            self.lexer.feed(piece, &mut self.shape)
        };
        if let Err(e) = &result {
            self.error = Some(e.clone());
        }
        result
    }

    /// Bytes fed so far.
    pub fn bytes_seen(&self) -> usize {
        self.seen
    }

    /// The end of the body.
    pub fn finish(mut self) -> Result<ScannedBody, RequestError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        self.lexer.finish(&mut self.shape)?;
        self.shape.finish()
    }
}

/// Scans a body held whole: [`BodyScanner`] fed once.
pub fn scan(body: &[u8], limits: &Limits) -> Result<ScannedBody, RequestError> {
    let mut s = BodyScanner::new(limits);
    s.feed(body)?;
    s.finish()
}
