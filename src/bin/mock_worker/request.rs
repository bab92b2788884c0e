//! The mock worker's request parser: serde structs over the whole body, strict like vLLM's own
//! parsing (a content part of an unknown type, or without its payload, fails the request).
//!
//! This is the parser the router itself used before its streaming scanner (`mmrouter::scan`);
//! the router's differential tests (`tests/scan.rs`) include this file as their reference.
//!
//! It keeps the model, the prompt as an ordered list of text and media parts (per chat message,
//! with its role), `cache_salt`, and any client `uuid` on a media part. Strings are borrowed
//! from the body where JSON allows it (no escapes). Limits: the body size, the number of media
//! items and the JSON nesting depth, checked before or while parsing.

use mmrouter::request::{ApiKind, Limits, MediaKind, RequestError};
use serde::Deserialize;
use std::borrow::Cow;

/// A parsed request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request<'a> {
    pub api: ApiKind,
    pub model: Cow<'a, str>,
    /// vLLM's `cache_salt`: requests with different salts never share cache.
    pub cache_salt: Option<Cow<'a, str>>,
    pub stream: bool,
    /// Chat messages in order; a completion prompt is one message with role `prompt`.
    pub messages: Vec<Message<'a>>,
}

impl<'a> Request<'a> {
    /// Every media part in request order.
    pub fn media(&self) -> impl Iterator<Item = &MediaPart<'a>> {
        self.messages.iter().flat_map(|m| {
            m.parts.iter().filter_map(|p| match p {
                Part::Media(media) => Some(media),
                Part::Text(_) => None,
            })
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Message<'a> {
    pub role: Cow<'a, str>,
    pub parts: Vec<Part<'a>>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Part<'a> {
    Text(Cow<'a, str>),
    Media(MediaPart<'a>),
}

/// Where a media part's bytes are.
#[derive(Debug, Clone, PartialEq)]
pub enum MediaSource<'a> {
    /// A `data:` URL. `base64` is false for a non-base64 data URL (an error when read).
    DataUrl {
        mime: Cow<'a, str>,
        base64: bool,
        payload: Cow<'a, str>,
    },
    /// An `http(s)://` (or other scheme) URL, verbatim.
    Url(Cow<'a, str>),
    /// Base64 data without a URL wrapper (`input_audio.data`).
    Base64(Cow<'a, str>),
    /// The JSON text of a value the router does not decode (`image_embeds`): hashed as is.
    RawJson(&'a str),
}

#[derive(Debug, Clone, PartialEq)]
pub struct MediaPart<'a> {
    /// Position among all media parts of the request, from 0.
    pub index: usize,
    pub kind: MediaKind,
    pub source: MediaSource<'a>,
    /// The client's `uuid` on the part; vLLM uses it verbatim as the item's cache identity.
    pub uuid: Option<Cow<'a, str>>,
}

// ---- wire shapes -------------------------------------------------------------------------

#[derive(Deserialize)]
struct WireBody<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    messages: Option<Vec<WireMessage<'a>>>,
    #[serde(borrow, default)]
    prompt: Option<WirePrompt<'a>>,
    #[serde(borrow, default)]
    cache_salt: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
struct WireMessage<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<WireContent<'a>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum WireContent<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Parts(#[serde(borrow)] Vec<WirePart<'a>>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum WirePrompt<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Texts(#[serde(borrow)] Vec<Cow<'a, str>>),
    /// Token ids: counted as their own tokens by the layout (rendered as text digits here).
    Tokens(Vec<u64>),
}

/// `{"url": "...", "detail": ...}` or a bare string.
#[derive(Deserialize)]
#[serde(untagged)]
enum WireUrl<'a> {
    Bare(#[serde(borrow)] Cow<'a, str>),
    Object {
        #[serde(borrow)]
        url: Cow<'a, str>,
    },
}

impl<'a> WireUrl<'a> {
    fn into_url(self) -> Cow<'a, str> {
        match self {
            WireUrl::Bare(u) | WireUrl::Object { url: u } => u,
        }
    }
}

#[derive(Deserialize)]
struct WireAudio<'a> {
    #[serde(borrow)]
    data: Cow<'a, str>,
}

#[derive(Deserialize)]
struct WirePart<'a> {
    #[serde(borrow, rename = "type", default)]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    image_url: Option<WireUrl<'a>>,
    #[serde(borrow, default)]
    video_url: Option<WireUrl<'a>>,
    #[serde(borrow, default)]
    audio_url: Option<WireUrl<'a>>,
    #[serde(borrow, default)]
    input_audio: Option<WireAudio<'a>>,
    #[serde(borrow, default)]
    image_embeds: Option<&'a serde_json::value::RawValue>,
    #[serde(borrow, default)]
    uuid: Option<Cow<'a, str>>,
}

// ---- parsing -----------------------------------------------------------------------------

/// Parses a chat-completions or completions body. A body with `messages` is a chat request,
/// one with `prompt` a completion request.
pub fn parse<'a>(body: &'a [u8], limits: &Limits) -> Result<Request<'a>, RequestError> {
    if body.len() > limits.max_body_bytes {
        return Err(RequestError::TooLarge {
            bytes: body.len(),
            limit: limits.max_body_bytes,
        });
    }
    check_nesting(body, limits.max_nesting)?;
    let wire: WireBody<'_> = serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => RequestError::Shape(e.to_string()),
        _ => RequestError::Json(e.to_string()),
    })?;
    let model = wire.model.ok_or(RequestError::MissingField("model"))?;
    let stream = wire.stream.unwrap_or(false);
    let mut media_count = 0usize;
    let (api, messages) = match (wire.messages, wire.prompt) {
        (Some(messages), _) => {
            let mut out = Vec::with_capacity(messages.len());
            for (mi, m) in messages.into_iter().enumerate() {
                out.push(convert_message(mi, m, &mut media_count, limits)?);
            }
            (ApiKind::Chat, out)
        }
        (None, Some(prompt)) => {
            let text = match prompt {
                WirePrompt::Text(t) => t,
                WirePrompt::Texts(ts) => Cow::Owned(ts.concat()),
                WirePrompt::Tokens(ids) => {
                    let mut s = String::with_capacity(ids.len() * 6);
                    for id in ids {
                        s.push_str(&id.to_string());
                        s.push(' ');
                    }
                    Cow::Owned(s)
                }
            };
            (
                ApiKind::Completion,
                vec![Message {
                    role: Cow::Borrowed("prompt"),
                    parts: vec![Part::Text(text)],
                }],
            )
        }
        (None, None) => return Err(RequestError::MissingField("messages")),
    };
    Ok(Request {
        api,
        model,
        cache_salt: wire.cache_salt,
        stream,
        messages,
    })
}

fn convert_message<'a>(
    mi: usize,
    m: WireMessage<'a>,
    media_count: &mut usize,
    limits: &Limits,
) -> Result<Message<'a>, RequestError> {
    let role = m.role.unwrap_or(Cow::Borrowed("user"));
    let parts = match m.content {
        None => Vec::new(),
        Some(WireContent::Text(t)) => vec![Part::Text(t)],
        Some(WireContent::Parts(parts)) => {
            let mut out = Vec::with_capacity(parts.len());
            for (pi, p) in parts.into_iter().enumerate() {
                out.push(convert_part(mi, pi, p, media_count, limits)?);
            }
            out
        }
    };
    Ok(Message { role, parts })
}

fn convert_part<'a>(
    mi: usize,
    pi: usize,
    p: WirePart<'a>,
    media_count: &mut usize,
    limits: &Limits,
) -> Result<Part<'a>, RequestError> {
    let bad = |reason: &str| RequestError::BadPart {
        message: mi,
        part: pi,
        reason: reason.to_string(),
    };
    let kind = p.kind.as_deref().unwrap_or("");
    let (media_kind, source) = match kind {
        "text" | "input_text" => {
            return p
                .text
                .map(Part::Text)
                .ok_or_else(|| bad("text part without `text`"));
        }
        "image_url" | "input_image" => {
            let url = p
                .image_url
                .ok_or_else(|| bad("image part without `image_url`"))?;
            (MediaKind::Image, url_source(url.into_url()))
        }
        "video_url" => {
            let url = p
                .video_url
                .ok_or_else(|| bad("video part without `video_url`"))?;
            (MediaKind::Video, url_source(url.into_url()))
        }
        "audio_url" => {
            let url = p
                .audio_url
                .ok_or_else(|| bad("audio part without `audio_url`"))?;
            (MediaKind::Audio, url_source(url.into_url()))
        }
        "input_audio" => {
            let audio = p
                .input_audio
                .ok_or_else(|| bad("input_audio part without `input_audio`"))?;
            (MediaKind::Audio, MediaSource::Base64(audio.data))
        }
        "image_embeds" => {
            let raw = p
                .image_embeds
                .ok_or_else(|| bad("image_embeds part without `image_embeds`"))?;
            (MediaKind::Embeds, MediaSource::RawJson(raw.get()))
        }
        "" => return Err(bad("content part without `type`")),
        other => return Err(bad(&format!("unsupported content part type `{other}`"))),
    };
    let index = *media_count;
    *media_count += 1;
    if *media_count > limits.max_media_items {
        return Err(RequestError::TooManyMedia {
            limit: limits.max_media_items,
        });
    }
    Ok(Part::Media(MediaPart {
        index,
        kind: media_kind,
        source,
        uuid: p.uuid,
    }))
}

/// Splits a `data:` URL into MIME label, base64 flag and payload; anything else is a URL.
fn url_source(url: Cow<'_, str>) -> MediaSource<'_> {
    let is_data = url
        .get(..5)
        .is_some_and(|s| s.eq_ignore_ascii_case("data:"));
    if !is_data {
        return MediaSource::Url(url);
    }
    let split = |s: &str| -> Option<(usize, bool, usize)> {
        let comma = s.find(',')?;
        let meta = s.get(5..comma)?;
        let base64 = meta
            .rsplit(';')
            .next()
            .is_some_and(|p| p.trim().eq_ignore_ascii_case("base64"));
        let mime_end = 5 + meta.find(';').unwrap_or(meta.len());
        Some((mime_end, base64, comma))
    };
    match (&url, split(&url)) {
        (Cow::Borrowed(s), Some((mime_end, base64, comma))) => MediaSource::DataUrl {
            mime: Cow::Borrowed(s.get(5..mime_end).unwrap_or("")),
            base64,
            payload: Cow::Borrowed(s.get(comma + 1..).unwrap_or("")),
        },
        (Cow::Owned(s), Some((mime_end, base64, comma))) => MediaSource::DataUrl {
            mime: Cow::Owned(s.get(5..mime_end).unwrap_or("").to_string()),
            base64,
            payload: Cow::Owned(s.get(comma + 1..).unwrap_or("").to_string()),
        },
        (_, None) => MediaSource::DataUrl {
            mime: Cow::Borrowed(""),
            base64: false,
            payload: Cow::Borrowed(""),
        },
    }
}

/// Rejects bodies nested deeper than `limit` without building anything: a scan that tracks
/// string state and bracket depth. serde_json has its own fixed limit (128); this one is the
/// configurable, lower one. Inside a string it jumps to the next `"` or `\` with memchr, so a
/// megabyte of base64 costs a vectorised search, not a byte-by-byte walk.
fn check_nesting(body: &[u8], limit: usize) -> Result<(), RequestError> {
    let mut depth = 0usize;
    let mut i = 0usize;
    while let Some(&b) = body.get(i) {
        match b {
            b'"' => {
                // Skip the string: find its closing quote, stepping over escapes.
                let mut j = i + 1;
                loop {
                    let Some(rest) = body.get(j..) else {
                        return Ok(());
                    };
                    match memchr::memchr2(b'"', b'\\', rest) {
                        Some(k) if rest.get(k) == Some(&b'\\') => j += k + 2,
                        Some(k) => {
                            j += k;
                            break;
                        }
                        // Unterminated string: serde_json reports it.
                        None => return Ok(()),
                    }
                }
                i = j;
            }
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return Err(RequestError::TooDeep { limit });
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(body: &str) -> Request<'_> {
        match parse(body.as_bytes(), &Limits::default()) {
            Ok(r) => r,
            Err(e) => panic!("parse failed: {e}"),
        }
    }

    #[test]
    fn chat_with_string_and_parts_content() {
        let r = parse_ok(
            r#"{"model":"m","messages":[{"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"what is this"},
            {"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo=","detail":"high"}},
            {"type":"image_url","image_url":"https://example.com/a.png","uuid":"abc"}]}]}"#,
        );
        assert_eq!(r.api, ApiKind::Chat);
        assert_eq!(r.model, "m");
        assert_eq!(r.messages.len(), 2);
        assert_eq!(r.messages[0].parts, vec![Part::Text("be brief".into())]);
        let media: Vec<_> = r.media().collect();
        assert_eq!(media.len(), 2);
        assert_eq!(media[0].index, 0);
        assert!(matches!(
            &media[0].source,
            MediaSource::DataUrl { mime, base64: true, payload }
                if mime == "image/png" && payload == "iVBORw0KGgo="
        ));
        assert_eq!(
            media[1].source,
            MediaSource::Url("https://example.com/a.png".into())
        );
        assert_eq!(media[1].uuid.as_deref(), Some("abc"));
    }

    #[test]
    fn inline_payload_is_borrowed_from_the_body() {
        let r = parse_ok(
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,AAAA"}}]}]}"#,
        );
        let media: Vec<_> = r.media().collect();
        assert!(matches!(
            &media[0].source,
            MediaSource::DataUrl {
                payload: Cow::Borrowed(_),
                ..
            }
        ));
    }

    #[test]
    fn media_kinds_and_completion_prompt() {
        let r = parse_ok(
            r#"{"model":"m","cache_salt":"s1","stream":true,"messages":[{"role":"user","content":[
            {"type":"input_image","image_url":"https://x/y.jpg"},
            {"type":"video_url","video_url":{"url":"https://x/v.mp4"}},
            {"type":"audio_url","audio_url":{"url":"https://x/a.wav"}},
            {"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}}]}]}"#,
        );
        let kinds: Vec<_> = r.media().map(|m| m.kind).collect();
        assert_eq!(
            kinds,
            vec![
                MediaKind::Image,
                MediaKind::Video,
                MediaKind::Audio,
                MediaKind::Audio
            ]
        );
        assert_eq!(r.cache_salt.as_deref(), Some("s1"));
        assert!(r.stream);
        let c = parse_ok(r#"{"model":"m","prompt":"hello"}"#);
        assert_eq!(c.api, ApiKind::Completion);
        assert_eq!(c.messages[0].parts, vec![Part::Text("hello".into())]);
    }

    #[test]
    fn errors_are_typed() {
        let l = Limits::default();
        assert!(matches!(parse(b"{", &l), Err(RequestError::Json(_))));
        assert_eq!(
            parse(br#"{"messages":[]}"#, &l),
            Err(RequestError::MissingField("model"))
        );
        assert_eq!(
            parse(br#"{"model":"m"}"#, &l),
            Err(RequestError::MissingField("messages"))
        );
        assert!(matches!(
            parse(
                br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                &l
            ),
            Err(RequestError::BadPart {
                message: 0,
                part: 0,
                ..
            })
        ));
        let deep = format!("{}{}", "[".repeat(40), "]".repeat(40));
        assert_eq!(
            parse(deep.as_bytes(), &l),
            Err(RequestError::TooDeep { limit: 32 })
        );
        let small = Limits {
            max_body_bytes: 10,
            ..Limits::default()
        };
        assert!(matches!(
            parse(br#"{"model":"mmmmmmmmmm"}"#, &small),
            Err(RequestError::TooLarge { .. })
        ));
        let one = Limits {
            max_media_items: 1,
            ..Limits::default()
        };
        assert_eq!(
            parse(
                br#"{"model":"m","messages":[{"content":[{"type":"image_url","image_url":"a"},{"type":"image_url","image_url":"b"}]}]}"#,
                &one
            ),
            Err(RequestError::TooManyMedia { limit: 1 })
        );
    }

    #[test]
    fn brackets_inside_strings_do_not_count_as_nesting() {
        let text = "[".repeat(100);
        let body = format!(r#"{{"model":"m","messages":[{{"content":"{text}"}}]}}"#);
        assert!(parse(body.as_bytes(), &Limits::default()).is_ok());
        // Escaped quotes and backslashes do not end a string early.
        let tricky = format!(r#"{{"model":"m\\","messages":[{{"content":"a\"{text}\\"}}]}}"#);
        assert!(parse(tricky.as_bytes(), &Limits::default()).is_ok());
        assert_eq!(check_nesting(br#"["\"[[[["]"#, 2), Ok(()));
        assert_eq!(
            check_nesting(br#"["\\"[[[["]"#, 2),
            Err(RequestError::TooDeep { limit: 2 })
        );
        assert_eq!(
            check_nesting(br#"[[[ "unterminated \"#, 2),
            Err(RequestError::TooDeep { limit: 2 })
        );
        assert_eq!(check_nesting(br#"[[ "unterminated \"#, 2), Ok(()));
    }
}
