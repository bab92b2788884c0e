//! The request's shape over the lexer's events: which value is the model, a message, a part,
//! a payload; what is skipped; which shape errors the serde structs this replaces reported.
//!
//! Errors follow serde_json's derive semantics for the body and message objects: a field of
//! the wrong JSON type or a field given twice is a `Shape` error, `null` is an absent field,
//! unknown fields are skipped. A value of the wrong type is read to its end before its `Shape`
//! error, so that the nesting limit inside it still wins, as the old parser's nesting pre-pass
//! made it win. Content parts never fail the body: they are skipped. An array where the old
//! parser's structs took a sequence (serde's positional form of a struct: `[model, messages]`)
//! is a `Shape` error: no client sends one, and vLLM refuses it.

use super::json::{Handler, Kind, Mode};
use super::part::{Field, FieldShape, PartState, Resolved, Value};
use super::payload::Payload;
use super::{
    MAX_SKIPPED_KEPT, MediaContent, MediaSite, ScannedBody, ScannedMedia, SkipReason, SkippedPart,
};
use crate::request::{ApiKind, Message, Part, Prompt, RequestError};
use std::fmt;
use xxhash_rust::xxh3::Xxh3;

/// A container the scanner knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    Body,
    Messages,
    Message,
    Content,
    Part,
    /// `{"url": ...}` of a part field.
    UrlObject(Field),
    /// `{"data": ...}` of `input_audio`.
    AudioObject,
    Prompt,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyKey {
    Model = 1,
    Messages = 2,
    Prompt = 4,
    CacheSalt = 8,
    Stream = 16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MessageKey {
    Role = 1,
    Content = 2,
}

/// The key of the value about to start, in the innermost known object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    None,
    Other,
    Body(BodyKey),
    Message(MessageKey),
    Part(Field),
    /// A part field given a second time.
    PartAgain(Field),
    /// `url` or `data` in a payload object.
    Payload,
    PayloadAgain,
}

/// What happens when a skipped value ends.
#[derive(Debug, Clone, PartialEq)]
enum Then {
    Nothing,
    Shape(String),
    /// A content list item that is not a part.
    SkipItem,
    SetField(Field, Value),
    Embeds(Field),
    PromptToken,
    PromptBad,
}

/// A value being skipped.
#[derive(Debug)]
struct Skip {
    /// Containers open inside it (0 for a scalar).
    depth: usize,
    strict: bool,
    then: Then,
}

/// Where a captured string goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Model,
    CacheSalt,
    Role,
    ContentText,
    ContentItem,
    Prompt,
    PromptItem,
    Field(Field),
}

enum Sink {
    None,
    Capture(Target),
    Payload { field: Field, payload: Payload },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PromptKind {
    Unknown,
    Strings,
    Tokens,
}

const KEY_MAX: usize = 16;

pub(super) struct Shape {
    max_media: usize,
    frames: Vec<Frame>,
    skip: Option<Skip>,
    key: Key,
    reading_key: bool,
    key_buf: [u8; KEY_MAX],
    key_len: usize,
    key_long: bool,
    sink: Sink,
    text: Vec<u8>,
    raw: Option<Xxh3>,
    // the body
    body_seen: u8,
    model: Option<String>,
    cache_salt: Option<String>,
    stream: bool,
    messages: Option<Vec<Message>>,
    prompt: Option<String>,
    prompt_kind: PromptKind,
    prompt_bad: bool,
    // the message being read
    message_count: usize,
    message_seen: u8,
    role: Option<String>,
    parts: Vec<Part>,
    items: usize,
    part: Option<Box<PartState>>,
    payload_seen: bool,
    // results
    media: Vec<ScannedMedia>,
    media_failed: bool,
    skipped: Vec<SkippedPart>,
    skipped_count: usize,
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shape")
            .field("frames", &self.frames)
            .field("media", &self.media.len())
            .finish_non_exhaustive()
    }
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Object => "map",
        Kind::Array => "sequence",
        Kind::String => "string",
        Kind::Number => "number",
        Kind::True | Kind::False => "boolean",
        Kind::Null => "null",
    }
}

fn invalid_type(kind: Kind, expected: &str) -> String {
    format!("invalid type: {}, expected {expected}", kind_name(kind))
}

fn is_container(kind: Kind) -> bool {
    matches!(kind, Kind::Object | Kind::Array)
}

const RAW: Mode = Mode {
    strict: true,
    content: false,
    raw: true,
    bulk: false,
};

impl Shape {
    pub(super) fn new(max_media: usize) -> Shape {
        Shape {
            max_media,
            frames: Vec::new(),
            skip: None,
            key: Key::None,
            reading_key: false,
            key_buf: [0; KEY_MAX],
            key_len: 0,
            key_long: false,
            sink: Sink::None,
            text: Vec::new(),
            raw: None,
            body_seen: 0,
            model: None,
            cache_salt: None,
            stream: false,
            messages: None,
            prompt: None,
            prompt_kind: PromptKind::Unknown,
            prompt_bad: false,
            message_count: 0,
            message_seen: 0,
            role: None,
            parts: Vec::new(),
            items: 0,
            part: None,
            payload_seen: false,
            media: Vec::new(),
            media_failed: false,
            skipped: Vec::new(),
            skipped_count: 0,
        }
    }

    /// Skips the value that starts (a scalar, or a container with everything in it).
    fn skip(&mut self, kind: Kind, strict: bool, then: Then) -> Mode {
        self.skip = Some(Skip {
            depth: usize::from(is_container(kind)),
            strict,
            then,
        });
        if strict { Mode::STRICT } else { Mode::LAX }
    }

    fn capture(&mut self, target: Target) -> Mode {
        self.text.clear();
        self.sink = Sink::Capture(target);
        Mode::CONTENT
    }

    fn push(&mut self, frame: Frame) -> Mode {
        self.frames.push(frame);
        Mode::STRICT
    }

    /// Media payloads are decoded while no media item failed and the limit is not reached.
    fn decoding(&self) -> bool {
        !self.media_failed && self.media.len() < self.max_media
    }

    fn part_mut(&mut self) -> Option<&mut PartState> {
        self.part.as_deref_mut()
    }

    fn skip_part(&mut self, message: usize, part: usize, reason: SkipReason) {
        self.skipped_count += 1;
        if self.skipped.len() < MAX_SKIPPED_KEPT {
            self.skipped.push(SkippedPart {
                message,
                part,
                reason,
            });
        }
    }

    fn top(&mut self, kind: Kind) -> Result<Mode, RequestError> {
        match kind {
            Kind::Object => Ok(self.push(Frame::Body)),
            _ => Ok(self.skip(
                kind,
                true,
                Then::Shape(invalid_type(kind, "a request object")),
            )),
        }
    }

    fn body_value(&mut self, key: Key, kind: Kind) -> Result<Mode, RequestError> {
        let Key::Body(field) = key else {
            return Ok(self.skip(kind, false, Then::Nothing));
        };
        let expected = match field {
            BodyKey::Model | BodyKey::CacheSalt => "a string",
            BodyKey::Messages => "a sequence",
            BodyKey::Prompt => "a string or a sequence",
            BodyKey::Stream => "a boolean",
        };
        Ok(match (field, kind) {
            (_, Kind::Null) => self.skip(kind, true, Then::Nothing),
            (BodyKey::Model, Kind::String) => self.capture(Target::Model),
            (BodyKey::CacheSalt, Kind::String) => self.capture(Target::CacheSalt),
            (BodyKey::Messages, Kind::Array) => {
                self.messages = Some(Vec::new());
                self.push(Frame::Messages)
            }
            (BodyKey::Prompt, Kind::String) => self.capture(Target::Prompt),
            (BodyKey::Prompt, Kind::Array) => {
                self.prompt = Some(String::new());
                self.push(Frame::Prompt)
            }
            (BodyKey::Stream, Kind::True | Kind::False) => {
                self.stream = kind == Kind::True;
                self.skip(kind, true, Then::Nothing)
            }
            _ => self.skip(kind, true, Then::Shape(invalid_type(kind, expected))),
        })
    }

    fn message_value(&mut self, kind: Kind) -> Result<Mode, RequestError> {
        self.message_count += 1;
        match kind {
            Kind::Object => {
                self.message_seen = 0;
                self.role = None;
                self.parts.clear();
                self.items = 0;
                Ok(self.push(Frame::Message))
            }
            _ => Ok(self.skip(
                kind,
                true,
                Then::Shape(invalid_type(kind, "a message object")),
            )),
        }
    }

    fn message_field(&mut self, key: Key, kind: Kind) -> Result<Mode, RequestError> {
        Ok(match (key, kind) {
            (Key::Message(_), Kind::Null) => self.skip(kind, true, Then::Nothing),
            (Key::Message(MessageKey::Role), Kind::String) => self.capture(Target::Role),
            (Key::Message(MessageKey::Role), _) => {
                self.skip(kind, true, Then::Shape(invalid_type(kind, "a string")))
            }
            (Key::Message(MessageKey::Content), Kind::String) => self.capture(Target::ContentText),
            (Key::Message(MessageKey::Content), Kind::Array) => self.push(Frame::Content),
            (Key::Message(MessageKey::Content), _) => self.skip(
                kind,
                true,
                Then::Shape(invalid_type(kind, "a string or a list of parts")),
            ),
            _ => self.skip(kind, false, Then::Nothing),
        })
    }

    fn content_item(&mut self, kind: Kind, at: usize) -> Mode {
        let index = self.items;
        self.items += 1;
        match kind {
            Kind::Object => {
                let message = self.message_count.saturating_sub(1);
                self.part = Some(Box::new(PartState::new(message, index, at + 1)));
                self.push(Frame::Part)
            }
            Kind::String => self.capture(Target::ContentItem),
            _ => self.skip(kind, true, Then::SkipItem),
        }
    }

    fn part_field(&mut self, key: Key, kind: Kind) -> Mode {
        let field = match key {
            Key::Part(f) => f,
            Key::PartAgain(f) => return self.skip(kind, true, Then::SetField(f, Value::Bad)),
            _ => return self.skip(kind, true, Then::Nothing),
        };
        match (field.shape(), kind) {
            (_, Kind::Null) => self.skip(kind, true, Then::SetField(field, Value::Null)),
            (FieldShape::Text, Kind::String) => self.capture(Target::Field(field)),
            (FieldShape::Url, Kind::String) => {
                self.sink = Sink::Payload {
                    field,
                    payload: Payload::url(self.decoding()),
                };
                Mode::BULK
            }
            (FieldShape::Url, Kind::Object) => {
                self.payload_seen = false;
                self.push(Frame::UrlObject(field))
            }
            (FieldShape::Audio, Kind::Object) => {
                self.payload_seen = false;
                self.push(Frame::AudioObject)
            }
            (FieldShape::Raw, _) => {
                self.raw = Some(Xxh3::new());
                self.skip(kind, true, Then::Embeds(field));
                RAW
            }
            (FieldShape::Presence, _) => {
                self.skip(kind, true, Then::SetField(field, Value::Present))
            }
            _ => self.skip(kind, true, Then::SetField(field, Value::Bad)),
        }
    }

    /// `url` of an `image_url`/`video_url`/`audio_url` object, `data` of `input_audio`.
    fn payload_field(&mut self, field: Field, key: Key, kind: Kind) -> Mode {
        match (key, kind) {
            (Key::PayloadAgain, _) => self.skip(kind, true, Then::SetField(field, Value::Bad)),
            (Key::Payload, Kind::Null) => self.skip(kind, true, Then::SetField(field, Value::Null)),
            (Key::Payload, Kind::String) => {
                let decode = self.decoding();
                let payload = if field == Field::InputAudio {
                    Payload::base64(decode)
                } else {
                    Payload::url(decode)
                };
                self.sink = Sink::Payload { field, payload };
                Mode::BULK
            }
            (Key::Payload, _) => self.skip(kind, true, Then::SetField(field, Value::Bad)),
            _ => self.skip(kind, true, Then::Nothing),
        }
    }

    fn prompt_item(&mut self, kind: Kind) -> Mode {
        match kind {
            Kind::String if !self.prompt_bad => self.capture(Target::PromptItem),
            Kind::Number => self.skip(kind, true, Then::PromptToken),
            _ => self.skip(kind, true, Then::PromptBad),
        }
    }

    /// The key just read, in the innermost known object.
    fn end_key(&mut self) -> Result<(), RequestError> {
        let key = if self.key_long {
            &[][..]
        } else {
            self.key_buf.get(..self.key_len).unwrap_or_default()
        };
        self.key = match self.frames.last() {
            Some(Frame::Body) => {
                let field = match key {
                    b"model" => Some(BodyKey::Model),
                    b"messages" => Some(BodyKey::Messages),
                    b"prompt" => Some(BodyKey::Prompt),
                    b"cache_salt" => Some(BodyKey::CacheSalt),
                    b"stream" => Some(BodyKey::Stream),
                    _ => None,
                };
                match field {
                    Some(f) => {
                        if self.body_seen & (f as u8) != 0 {
                            return Err(duplicate(key));
                        }
                        self.body_seen |= f as u8;
                        Key::Body(f)
                    }
                    None => Key::Other,
                }
            }
            Some(Frame::Message) => {
                let field = match key {
                    b"role" => Some(MessageKey::Role),
                    b"content" => Some(MessageKey::Content),
                    _ => None,
                };
                match field {
                    Some(f) => {
                        if self.message_seen & (f as u8) != 0 {
                            return Err(duplicate(key));
                        }
                        self.message_seen |= f as u8;
                        Key::Message(f)
                    }
                    None => Key::Other,
                }
            }
            Some(Frame::Part) => match (Field::from_key(key), self.part.as_deref_mut()) {
                (Some(f), Some(part)) => {
                    if f == Field::Uuid {
                        part.has_uuid_key = true;
                    }
                    if part.seen(f) {
                        Key::PartAgain(f)
                    } else {
                        Key::Part(f)
                    }
                }
                _ => Key::Other,
            },
            Some(Frame::UrlObject(_)) | Some(Frame::AudioObject) => {
                let wanted: &[u8] = if self.frames.last() == Some(&Frame::AudioObject) {
                    b"data"
                } else {
                    b"url"
                };
                if key != wanted {
                    Key::Other
                } else if self.payload_seen {
                    Key::PayloadAgain
                } else {
                    self.payload_seen = true;
                    Key::Payload
                }
            }
            _ => Key::Other,
        };
        Ok(())
    }

    /// A skipped value ended.
    fn end_skip(&mut self, then: Then, unsigned: Option<u64>) -> Result<(), RequestError> {
        match then {
            Then::Nothing => {}
            Then::Shape(message) => return Err(RequestError::Shape(message)),
            Then::SkipItem => {
                let message = self.message_count.saturating_sub(1);
                let part = self.items.saturating_sub(1);
                self.skip_part(message, part, SkipReason::NotAnObject);
            }
            Then::SetField(f, v) => {
                if let Some(part) = self.part_mut() {
                    part.set(f, v);
                }
            }
            Then::Embeds(f) => {
                let hash = self.raw.take().map(|h| h.digest128()).unwrap_or(0);
                if let Some(part) = self.part_mut() {
                    part.set(f, Value::Media(MediaContent::Embeds { hash }));
                }
            }
            Then::PromptToken => match (unsigned, self.prompt_kind) {
                (Some(n), PromptKind::Unknown | PromptKind::Tokens) if !self.prompt_bad => {
                    self.prompt_kind = PromptKind::Tokens;
                    if let Some(p) = &mut self.prompt {
                        p.push_str(&n.to_string());
                        p.push(' ');
                    }
                }
                _ => self.prompt_bad = true,
            },
            Then::PromptBad => self.prompt_bad = true,
        }
        Ok(())
    }

    /// A captured or payload string ended.
    fn end_string(&mut self) -> Result<(), RequestError> {
        match std::mem::replace(&mut self.sink, Sink::None) {
            Sink::None => {}
            Sink::Capture(target) => {
                let text = match String::from_utf8(std::mem::take(&mut self.text)) {
                    Ok(t) => t,
                    // The lexer validated strict strings already.
                    Err(_) => return Err(RequestError::Json("invalid unicode code point".into())),
                };
                match target {
                    Target::Model => self.model = Some(text),
                    Target::CacheSalt => self.cache_salt = Some(text),
                    Target::Role => self.role = Some(text),
                    Target::ContentText => self.parts = vec![Part::Text(text)],
                    Target::ContentItem => self.parts.push(Part::Text(text)),
                    Target::Prompt => self.prompt = Some(text),
                    Target::PromptItem => {
                        if self.prompt_kind == PromptKind::Tokens {
                            self.prompt_bad = true;
                        } else {
                            self.prompt_kind = PromptKind::Strings;
                            if let Some(p) = &mut self.prompt {
                                p.push_str(&text);
                            }
                        }
                    }
                    Target::Field(f) => {
                        if let Some(part) = self.part_mut() {
                            part.set(f, Value::Text(text));
                        }
                    }
                }
            }
            Sink::Payload { field, payload } => {
                let content = payload.finish().unwrap_or(MediaContent::Unread);
                if let Some(part) = self.part_mut() {
                    part.set(field, Value::Media(content));
                }
            }
        }
        Ok(())
    }

    /// A known container ended.
    fn end_frame(&mut self) -> Result<(), RequestError> {
        match self.frames.pop() {
            Some(Frame::Message) => {
                let role = self.role.take().unwrap_or_else(|| "user".to_string());
                let parts = std::mem::take(&mut self.parts);
                if let Some(m) = &mut self.messages {
                    m.push(Message { role, parts });
                }
            }
            Some(Frame::Part) => {
                if let Some(part) = self.part.take() {
                    self.end_part(*part)?;
                }
            }
            Some(Frame::UrlObject(field)) => {
                if !self.payload_seen
                    && let Some(part) = self.part_mut()
                {
                    part.set(field, Value::Null);
                }
            }
            Some(Frame::AudioObject) => {
                if !self.payload_seen
                    && let Some(part) = self.part_mut()
                {
                    part.set(Field::InputAudio, Value::Null);
                }
            }
            Some(Frame::Prompt) => {
                if self.prompt_bad {
                    return Err(RequestError::Shape(
                        "data did not match any variant of untagged enum WirePrompt".into(),
                    ));
                }
            }
            Some(Frame::Body | Frame::Messages | Frame::Content) | None => {}
        }
        Ok(())
    }

    fn end_part(&mut self, part: PartState) -> Result<(), RequestError> {
        let (message, index) = (part.message, part.index);
        let site = MediaSite {
            offset: part.offset,
            has_uuid: part.has_uuid_key,
        };
        match part.resolve() {
            Resolved::Text(t) => self.parts.push(Part::Text(t)),
            Resolved::Skip(reason) => self.skip_part(message, index, reason),
            Resolved::Media {
                kind,
                uuid,
                content,
            } => {
                if self.media.len() >= self.max_media {
                    return Err(RequestError::TooManyMedia {
                        limit: self.max_media,
                    });
                }
                let failed = match &content {
                    MediaContent::Invalid(_) => true,
                    MediaContent::Inline { header, .. } => matches!(header, Some(Err(_))),
                    _ => false,
                };
                let index = self.media.len();
                self.media.push(ScannedMedia {
                    index,
                    kind,
                    uuid,
                    content,
                    site,
                });
                self.parts.push(Part::Media(index));
                self.media_failed |= failed;
            }
        }
        Ok(())
    }

    pub(super) fn finish(self) -> Result<ScannedBody, RequestError> {
        let model = self.model.ok_or(RequestError::MissingField("model"))?;
        let (api, messages) = match (self.messages, self.prompt) {
            (Some(messages), _) => (ApiKind::Chat, messages),
            (None, Some(prompt)) => (
                ApiKind::Completion,
                vec![Message {
                    role: "prompt".to_string(),
                    parts: vec![Part::Text(prompt)],
                }],
            ),
            (None, None) => return Err(RequestError::MissingField("messages")),
        };
        Ok(ScannedBody {
            prompt: Prompt {
                api,
                model,
                cache_salt: self.cache_salt,
                messages,
            },
            stream: self.stream,
            media: self.media,
            skipped: self.skipped,
            skipped_count: self.skipped_count,
        })
    }
}

fn duplicate(key: &[u8]) -> RequestError {
    RequestError::Shape(format!(
        "duplicate field `{}`",
        String::from_utf8_lossy(key)
    ))
}

impl Handler for Shape {
    fn value_start(&mut self, kind: Kind, at: usize) -> Result<Mode, RequestError> {
        if let Some(skip) = &mut self.skip {
            if is_container(kind) {
                skip.depth += 1;
            }
            return Ok(if skip.strict { Mode::STRICT } else { Mode::LAX });
        }
        let key = std::mem::replace(&mut self.key, Key::None);
        match self.frames.last().copied() {
            None => self.top(kind),
            Some(Frame::Body) => self.body_value(key, kind),
            Some(Frame::Messages) => self.message_value(kind),
            Some(Frame::Message) => self.message_field(key, kind),
            Some(Frame::Content) => Ok(self.content_item(kind, at)),
            Some(Frame::Part) => Ok(self.part_field(key, kind)),
            Some(Frame::UrlObject(f)) => Ok(self.payload_field(f, key, kind)),
            Some(Frame::AudioObject) => Ok(self.payload_field(Field::InputAudio, key, kind)),
            Some(Frame::Prompt) => Ok(self.prompt_item(kind)),
        }
    }

    fn key_start(&mut self) -> Mode {
        if let Some(skip) = &self.skip {
            return if skip.strict { Mode::STRICT } else { Mode::LAX };
        }
        self.reading_key = true;
        self.key_len = 0;
        self.key_long = false;
        Mode::CONTENT
    }

    fn string_bytes(&mut self, bytes: &[u8]) -> Result<(), RequestError> {
        if self.reading_key {
            match self
                .key_buf
                .get_mut(self.key_len..self.key_len + bytes.len())
            {
                Some(dst) => {
                    dst.copy_from_slice(bytes);
                    self.key_len += bytes.len();
                }
                None => self.key_long = true,
            }
            return Ok(());
        }
        match &mut self.sink {
            Sink::Capture(_) => self.text.extend_from_slice(bytes),
            Sink::Payload { field, payload } => {
                payload.feed(bytes, *field == Field::ImageUrl);
            }
            Sink::None => {}
        }
        Ok(())
    }

    fn string_run(&mut self, run: &[u8]) -> Result<Option<usize>, RequestError> {
        if let Sink::Payload { field, payload } = &mut self.sink {
            return Ok(payload.feed(run, *field == Field::ImageUrl));
        }
        self.string_bytes(run)?;
        Ok(Some(0))
    }

    fn string_char(&mut self, c: char) -> Result<(), RequestError> {
        let mut buf = [0; 4];
        self.string_bytes(c.encode_utf8(&mut buf).as_bytes())
    }

    fn string_end(&mut self) -> Result<(), RequestError> {
        if self.reading_key {
            self.reading_key = false;
            return self.end_key();
        }
        if let Some(skip) = &self.skip {
            if skip.depth == 0 {
                let then = self.skip.take().map(|s| s.then).unwrap_or(Then::Nothing);
                return self.end_skip(then, None);
            }
            return Ok(());
        }
        self.end_string()
    }

    fn number_end(&mut self, unsigned: Option<u64>) -> Result<(), RequestError> {
        if self.skip.as_ref().is_some_and(|s| s.depth == 0) {
            let then = self.skip.take().map(|s| s.then).unwrap_or(Then::Nothing);
            return self.end_skip(then, unsigned);
        }
        Ok(())
    }

    fn literal_end(&mut self, _kind: Kind) -> Result<(), RequestError> {
        self.number_end(None)
    }

    fn container_end(&mut self) -> Result<(), RequestError> {
        if let Some(skip) = &mut self.skip {
            skip.depth = skip.depth.saturating_sub(1);
            if skip.depth == 0 {
                let then = self.skip.take().map(|s| s.then).unwrap_or(Then::Nothing);
                return self.end_skip(then, None);
            }
            return Ok(());
        }
        self.end_frame()
    }

    fn raw(&mut self, bytes: &[u8]) {
        if let Some(h) = &mut self.raw {
            h.update(bytes);
        }
    }
}
