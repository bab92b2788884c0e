//! The request as routing sees it, and the types shared by the code that reads it: the input
//! [`Limits`], the [`RequestError`] values, and the [`Prompt`] that [`crate::scan`] produces and
//! [`crate::layout`] lays out.

use std::fmt;

/// Input limits. Every field has a default that is safe inside a proxy.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest body accepted, in bytes (default 32 MiB).
    pub max_body_bytes: usize,
    /// Most media items (images, audio, video) in one request (default 64).
    pub max_media_items: usize,
    /// Deepest JSON nesting of arrays and objects (default 32; chat bodies need about 6).
    pub max_nesting: usize,
    /// Most tokens all the media of one request may take (default 1,048,576; Qwen2.5-VL's
    /// largest image is 16,384). A profile without a cap (`factor:1`) and a header claiming
    /// 65535×65535 would otherwise lay out billions of tokens.
    pub max_media_tokens: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 32 << 20,
            max_media_items: 64,
            max_nesting: 32,
            max_media_tokens: 1 << 20,
        }
    }
}

/// Which API a body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    /// `/v1/chat/completions`: `messages`.
    Chat,
    /// `/v1/completions`: `prompt`.
    Completion,
}

/// What kind of media a part carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MediaKind {
    Image,
    Video,
    Audio,
    /// `image_embeds` or `audio_embeds`: precomputed embeddings; no file to read.
    Embeds,
}

/// The prompt of a request: what the engine renders into tokens, with media by reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub api: ApiKind,
    /// The `model` field (it also names a LoRA adapter).
    pub model: String,
    /// vLLM's `cache_salt`: requests with different salts never share cache.
    pub cache_salt: Option<String>,
    /// Chat messages in order; a completion prompt is one message with role `prompt`.
    pub messages: Vec<Message>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Text(String),
    /// The media item with this index (request order, from 0).
    Media(usize),
}

/// Why a body could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestError {
    TooLarge {
        bytes: usize,
        limit: usize,
    },
    TooDeep {
        limit: usize,
    },
    TooManyMedia {
        limit: usize,
    },
    /// Not JSON at all (syntax error or truncated).
    Json(String),
    /// JSON, but not the shape of a request (a field of the wrong type).
    Shape(String),
    MissingField(&'static str),
    /// A content part the mock worker's strict parser does not understand, or one that lacks
    /// its payload (the router's scanner skips such parts instead).
    BadPart {
        message: usize,
        part: usize,
        reason: String,
    },
}

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RequestError::TooLarge { bytes, limit } => {
                write!(f, "body of {bytes} bytes is over the limit of {limit}")
            }
            RequestError::TooDeep { limit } => write!(f, "JSON nested deeper than {limit}"),
            RequestError::TooManyMedia { limit } => {
                write!(f, "more than {limit} media items in one request")
            }
            RequestError::Json(e) => write!(f, "body is not valid JSON: {e}"),
            RequestError::Shape(e) => write!(f, "body is not a chat or completions request: {e}"),
            RequestError::MissingField(name) => write!(f, "body has no `{name}`"),
            RequestError::BadPart {
                message,
                part,
                reason,
            } => write!(f, "message {message}, part {part}: {reason}"),
        }
    }
}

impl std::error::Error for RequestError {}
