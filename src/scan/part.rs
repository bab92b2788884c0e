//! One content part: its fields as they arrive (in any order), and what the part is once its
//! object closes, by vLLM's rules (`_parse_chat_message_content_mm_part` in
//! `vllm/entrypoints/chat_utils.py`).

use super::{MAX_TYPE_KEPT, MediaContent, SkipReason};
use crate::request::MediaKind;

/// The fields of a part that the scanner reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Field {
    Type,
    Text,
    Thinking,
    Refusal,
    Name,
    Uuid,
    ImageUrl,
    VideoUrl,
    AudioUrl,
    InputAudio,
    ImageEmbeds,
    AudioEmbeds,
    ImagePil,
    PromptEmbeds,
}

impl Field {
    pub(super) fn from_key(key: &[u8]) -> Option<Field> {
        Some(match key {
            b"type" => Field::Type,
            b"text" => Field::Text,
            b"thinking" => Field::Thinking,
            b"refusal" => Field::Refusal,
            b"name" => Field::Name,
            b"uuid" => Field::Uuid,
            b"image_url" => Field::ImageUrl,
            b"video_url" => Field::VideoUrl,
            b"audio_url" => Field::AudioUrl,
            b"input_audio" => Field::InputAudio,
            b"image_embeds" => Field::ImageEmbeds,
            b"audio_embeds" => Field::AudioEmbeds,
            b"image_pil" => Field::ImagePil,
            b"prompt_embeds" => Field::PromptEmbeds,
            _ => return None,
        })
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            Field::Type => "type",
            Field::Text => "text",
            Field::Thinking => "thinking",
            Field::Refusal => "refusal",
            Field::Name => "name",
            Field::Uuid => "uuid",
            Field::ImageUrl => "image_url",
            Field::VideoUrl => "video_url",
            Field::AudioUrl => "audio_url",
            Field::InputAudio => "input_audio",
            Field::ImageEmbeds => "image_embeds",
            Field::AudioEmbeds => "audio_embeds",
            Field::ImagePil => "image_pil",
            Field::PromptEmbeds => "prompt_embeds",
        }
    }

    /// How the field's value is read.
    pub(super) fn shape(self) -> FieldShape {
        match self {
            Field::Type
            | Field::Text
            | Field::Thinking
            | Field::Refusal
            | Field::Name
            | Field::Uuid => FieldShape::Text,
            Field::ImageUrl | Field::VideoUrl | Field::AudioUrl => FieldShape::Url,
            Field::InputAudio => FieldShape::Audio,
            Field::ImageEmbeds | Field::AudioEmbeds => FieldShape::Raw,
            Field::ImagePil | Field::PromptEmbeds => FieldShape::Presence,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum FieldShape {
    /// A string.
    Text,
    /// A URL string, or an object with a `url` string.
    Url,
    /// An object with a `data` base64 string.
    Audio,
    /// Any JSON value, hashed as text.
    Raw,
    /// Any JSON value; only its presence counts.
    Presence,
}

/// A field's value as read.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) enum Value {
    #[default]
    Missing,
    /// `null`, or an object without its `url`/`data`: no payload.
    Null,
    Text(String),
    Media(MediaContent),
    Present,
    /// Wrong JSON type, wrong shape, or the key twice.
    Bad,
}

/// A part object being read.
#[derive(Debug)]
pub(super) struct PartState {
    pub message: usize,
    pub index: usize,
    /// Body offset just after the `{`.
    pub offset: usize,
    pub has_uuid_key: bool,
    fields: [Value; 14],
}

/// What a closed part is.
#[derive(Debug)]
pub(super) enum Resolved {
    Text(String),
    Media {
        kind: MediaKind,
        uuid: Option<String>,
        content: MediaContent,
    },
    Skip(SkipReason),
}

fn slot(f: Field) -> usize {
    f as usize
}

impl PartState {
    pub(super) fn new(message: usize, index: usize, offset: usize) -> PartState {
        PartState {
            message,
            index,
            offset,
            has_uuid_key: false,
            fields: Default::default(),
        }
    }

    pub(super) fn get(&self, f: Field) -> &Value {
        self.fields.get(slot(f)).unwrap_or(&Value::Missing)
    }

    /// True when the field was already given (a second occurrence makes it bad).
    pub(super) fn seen(&self, f: Field) -> bool {
        !matches!(self.get(f), Value::Missing)
    }

    pub(super) fn set(&mut self, f: Field, v: Value) {
        if let Some(s) = self.fields.get_mut(slot(f)) {
            *s = v;
        }
    }

    fn take(&mut self, f: Field) -> Value {
        self.fields
            .get_mut(slot(f))
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// The part, by its `type`, or by its keys when it has none.
    pub(super) fn resolve(mut self) -> Resolved {
        let kind = match self.take(Field::Type) {
            Value::Text(t) => t,
            Value::Missing | Value::Null => match self.inferred() {
                Some(f) => return self.media_or_skip(f),
                None => return Resolved::Skip(SkipReason::MissingType),
            },
            Value::Bad | Value::Media(_) | Value::Present => {
                return Resolved::Skip(SkipReason::TypeNotString);
            }
        };
        let field = match kind.as_str() {
            "text" | "input_text" | "output_text" => Field::Text,
            "thinking" => Field::Thinking,
            "refusal" => Field::Refusal,
            "tool_reference" => Field::Name,
            "image_url" | "input_image" => Field::ImageUrl,
            "video_url" => Field::VideoUrl,
            "audio_url" => Field::AudioUrl,
            "input_audio" => Field::InputAudio,
            "image_embeds" => Field::ImageEmbeds,
            "audio_embeds" => Field::AudioEmbeds,
            "image_pil" => Field::ImagePil,
            _ => {
                let mut end = kind.len().min(MAX_TYPE_KEPT);
                while !kind.is_char_boundary(end) {
                    end -= 1;
                }
                return Resolved::Skip(SkipReason::UnsupportedType(
                    kind.get(..end).unwrap_or_default().to_string(),
                ));
            }
        };
        match field {
            Field::Text | Field::Thinking | Field::Refusal | Field::Name => {
                match self.take(field) {
                    Value::Text(t) => Resolved::Text(t),
                    Value::Missing | Value::Null => {
                        Resolved::Skip(SkipReason::MissingField(field.name()))
                    }
                    _ => Resolved::Skip(SkipReason::BadField(field.name())),
                }
            }
            _ => self.media_or_skip(field),
        }
    }

    /// vLLM's key order for a part without `type`.
    fn inferred(&self) -> Option<Field> {
        [
            Field::ImageUrl,
            Field::ImagePil,
            Field::ImageEmbeds,
            Field::AudioEmbeds,
            Field::PromptEmbeds,
            Field::AudioUrl,
            Field::InputAudio,
            Field::VideoUrl,
        ]
        .into_iter()
        .find(|&f| match self.get(f) {
            Value::Missing => false,
            // `input_audio` counts only when not null.
            Value::Null => f != Field::InputAudio,
            _ => true,
        })
    }

    fn media_or_skip(mut self, field: Field) -> Resolved {
        let kind = match field {
            Field::ImageUrl | Field::ImagePil => MediaKind::Image,
            Field::VideoUrl => MediaKind::Video,
            Field::AudioUrl | Field::InputAudio => MediaKind::Audio,
            Field::ImageEmbeds | Field::AudioEmbeds => MediaKind::Embeds,
            _ => {
                return Resolved::Skip(SkipReason::UnsupportedType(field.name().to_string()));
            }
        };
        let uuid = match self.take(Field::Uuid) {
            Value::Text(u) => Some(u),
            Value::Missing | Value::Null => None,
            _ => return Resolved::Skip(SkipReason::BadField("uuid")),
        };
        let content = match (self.take(field), &uuid) {
            (Value::Media(c), _) => c,
            (Value::Missing | Value::Null | Value::Present, Some(_)) => MediaContent::UuidOnly,
            (Value::Missing | Value::Null, None) => {
                return Resolved::Skip(SkipReason::MissingField(field.name()));
            }
            // image_pil: a PIL image cannot travel in JSON; only its uuid names it.
            (Value::Present, None) => return Resolved::Skip(SkipReason::MissingField("uuid")),
            (Value::Bad | Value::Text(_), _) => {
                return Resolved::Skip(SkipReason::BadField(field.name()));
            }
        };
        Resolved::Media {
            kind,
            uuid,
            content,
        }
    }
}
