//! Loading a request's images: bytes, size, token cost and cache identifier.
//!
//! - Bytes: `data:` URLs must be base64 (as in vLLM) and are decoded with
//!   [`mmrouter::identity::decode_base64`]; `http://` URLs are fetched ([`crate::fetch`]).
//! - Size: [`mmrouter::image_header::read_image_header`]; an unreadable image is a 400.
//! - Tokens: the configured [`mmrouter::tokens::Profile`].
//! - Identifier: the part's `uuid` verbatim when present (vLLM does the same); otherwise
//!   xxh3-128 over the model id and the file bytes, as 32 hex characters. vLLM uses blake3
//!   over a framed serialization of the model id and the original encoded bytes: the mock
//!   keeps that structure (the same image under the same model gets the same identifier on
//!   every worker) with a hash already in the dependency tree.

use crate::fetch::{FetchError, fetch_http};
use crate::prompt::PlacedImage;
use crate::request::{MediaSource, Request};
use mmrouter::identity::{DecodeError, decode_base64};
use mmrouter::image_header::{HeaderError, read_image_header};
use mmrouter::request::MediaKind;
use mmrouter::tokens::{Profile, TokenError};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use xxhash_rust::xxh3::Xxh3;

/// Why an image could not be loaded (all are HTTP 400).
#[derive(Debug, Clone, PartialEq)]
pub enum MediaError {
    /// Audio, video, embeddings: the mock serves an image model.
    Unsupported {
        index: usize,
        kind: MediaKind,
    },
    Decode {
        index: usize,
        err: DecodeError,
    },
    Fetch {
        index: usize,
        err: FetchError,
    },
    Header {
        index: usize,
        err: HeaderError,
    },
    Tokens {
        index: usize,
        err: TokenError,
    },
}

impl fmt::Display for MediaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MediaError::Unsupported { index, kind } => write!(
                f,
                "media item {index}: {kind:?} input is not supported by this model (images only)"
            ),
            MediaError::Decode { index, err } => {
                write!(f, "media item {index}: failed to load image: {err}")
            }
            MediaError::Fetch { index, err } => {
                write!(f, "media item {index}: failed to fetch image: {err}")
            }
            MediaError::Header { index, err } => {
                write!(f, "media item {index}: invalid image: {err}")
            }
            MediaError::Tokens { index, err } => write!(f, "media item {index}: {err}"),
        }
    }
}

/// Identifier of an image without a uuid: xxh3-128 over (model id, bytes), length-framed.
pub fn content_identifier(model: &str, bytes: &[u8]) -> String {
    let mut h = Xxh3::new();
    h.update(b"model_id\0");
    h.update(&(model.len() as u64).to_le_bytes());
    h.update(model.as_bytes());
    h.update(b"image\0");
    h.update(&(bytes.len() as u64).to_le_bytes());
    h.update(bytes);
    format!("{:032x}", h.digest128())
}

/// Loads every media part of `request`, in order (`result[i]` is the part with index `i`).
/// `fetches` counts http fetches.
pub async fn load_images(
    request: &Request<'_>,
    model: &str,
    profile: &Profile,
    fetches: &AtomicU64,
) -> Result<Vec<PlacedImage>, MediaError> {
    let mut out = Vec::new();
    for part in request.media() {
        let index = part.index;
        if part.kind != MediaKind::Image {
            return Err(MediaError::Unsupported {
                index,
                kind: part.kind,
            });
        }
        let bytes: Vec<u8> = match &part.source {
            MediaSource::DataUrl { base64: false, .. } => {
                return Err(MediaError::Decode {
                    index,
                    err: DecodeError::NotBase64,
                });
            }
            MediaSource::DataUrl { payload, .. } | MediaSource::Base64(payload) => {
                decode_base64(payload).map_err(|err| MediaError::Decode { index, err })?
            }
            MediaSource::Url(url) => {
                let is_http = url
                    .get(..7)
                    .is_some_and(|s| s.eq_ignore_ascii_case("http://"));
                if is_http {
                    fetches.fetch_add(1, Ordering::Relaxed);
                }
                fetch_http(url)
                    .await
                    .map_err(|err| MediaError::Fetch { index, err })?
                    .to_vec()
            }
            MediaSource::RawJson(_) => {
                return Err(MediaError::Unsupported {
                    index,
                    kind: MediaKind::Embeds,
                });
            }
        };
        let info = read_image_header(&bytes).map_err(|err| MediaError::Header { index, err })?;
        let tokens = profile
            .image_tokens(info.width, info.height)
            .map_err(|err| MediaError::Tokens { index, err })?;
        let identifier = match &part.uuid {
            Some(uuid) => uuid.to_string(),
            None => content_identifier(model, &bytes),
        };
        out.push(PlacedImage { identifier, tokens });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_identifier_depends_on_model_and_bytes() {
        let a = content_identifier("m", b"png bytes");
        assert_eq!(a.len(), 32);
        assert_eq!(a, content_identifier("m", b"png bytes"));
        assert_ne!(a, content_identifier("n", b"png bytes"));
        assert_ne!(a, content_identifier("m", b"png bytez"));
        // Framing: moving a byte between model and bytes changes the identifier.
        assert_ne!(
            content_identifier("ab", b"c"),
            content_identifier("a", b"bc")
        );
    }
}
