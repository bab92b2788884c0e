//! The prompt as the engine sees it: a chat template rendered to token ids, images expanded to
//! their placeholder tokens, and the deterministic output text.
//!
//! Chat requests are rendered with a Qwen/ChatML-style template: for each message
//! `<|im_start|>{role}\n{content}<|im_end|>\n`, then the generation prompt
//! `<|im_start|>assistant\n`. An image inside the content becomes `<|vision_start|>`, its
//! placeholder tokens (`<|image_pad|>`), `<|vision_end|>` when the profile has two marker
//! tokens (more markers: the first before, the rest after; none: just the placeholders). Unlike
//! the real Qwen2.5-VL template, no default system message is inserted. Completion prompts are
//! tokenised as they are, with no template.
//!
//! Text is tokenised with the core's deterministic pseudo-tokenizer
//! ([`mmrouter::layout::pseudo_tokens`]); special tokens use Qwen2.5's real ids.

use crate::prefix_cache::MmRange;
use crate::request::{Part, Request};
use mmrouter::layout::pseudo_tokens;
use mmrouter::request::ApiKind;
use mmrouter::tokens::ImageTokens;

/// Qwen2.5 special token ids.
pub const IM_START: u32 = 151_644;
pub const IM_END: u32 = 151_645;
pub const VISION_START: u32 = 151_652;
pub const VISION_END: u32 = 151_653;
pub const IMAGE_PAD: u32 = 151_655;

/// An image ready to be placed: its cache identifier and its token cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacedImage {
    pub identifier: String,
    pub tokens: ImageTokens,
}

/// The rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    pub tokens: Vec<u32>,
    /// Placeholder ranges, in prompt order.
    pub mm: Vec<MmRange>,
}

/// Renders `request`; `images[i]` is the media part with `index == i`.
pub fn render(request: &Request<'_>, images: &[PlacedImage]) -> Rendered {
    let chat = request.api == ApiKind::Chat;
    let mut tokens = Vec::with_capacity(256);
    let mut mm = Vec::with_capacity(images.len());
    let mut newline = Vec::with_capacity(1);
    pseudo_tokens("\n", &mut newline);
    for message in &request.messages {
        if chat {
            tokens.push(IM_START);
            pseudo_tokens(&message.role, &mut tokens);
            tokens.extend_from_slice(&newline);
        }
        for part in &message.parts {
            match part {
                Part::Text(text) => pseudo_tokens(text, &mut tokens),
                Part::Media(m) => {
                    let Some(img) = images.get(m.index) else {
                        continue;
                    };
                    let markers = img.tokens.markers;
                    if markers > 0 {
                        tokens.push(VISION_START);
                    }
                    let len = img.tokens.tokens as usize;
                    mm.push(MmRange {
                        identifier: img.identifier.clone(),
                        offset: tokens.len(),
                        length: len,
                    });
                    tokens.extend(std::iter::repeat_n(IMAGE_PAD, len));
                    let after = markers.saturating_sub(1) as usize;
                    tokens.extend(std::iter::repeat_n(VISION_END, after));
                }
            }
        }
        if chat {
            tokens.push(IM_END);
            tokens.extend_from_slice(&newline);
        }
    }
    if chat {
        tokens.push(IM_START);
        pseudo_tokens("assistant", &mut tokens);
        tokens.extend_from_slice(&newline);
    }
    Rendered { tokens, mm }
}

const WORDS: &[&str] = &[
    "the",
    "image",
    "shows",
    "a",
    "small",
    "scene",
    "with",
    "several",
    "objects",
    "in",
    "soft",
    "light",
    "and",
    "clear",
    "detail",
    "near",
    "its",
    "centre",
    "while",
    "background",
    "stays",
    "quiet",
    "calm",
    "plain",
    "under",
    "open",
    "sky",
    "mock",
    "worker",
    "answer",
];

/// Output token `i` of a sequence seeded by `seed`: its text (a word, space-separated after
/// the first) and its token id. Deterministic: the same prompt gets the same answer on every
/// worker, as greedy decoding would.
pub fn output_token(seed: u64, i: usize) -> (String, u32) {
    let n = WORDS.len() as u64;
    let idx = (seed.wrapping_add(i as u64 * 7)) % n;
    let word = WORDS.get(idx as usize).copied().unwrap_or("mock");
    let text = if i == 0 {
        word.to_string()
    } else {
        format!(" {word}")
    };
    // Word ids live below the special tokens, in a range pseudo-tokens rarely use.
    (text, 200_000 + idx as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse;
    use mmrouter::request::Limits;

    #[test]
    fn chat_template_places_image_placeholders_between_markers() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":[
            {"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AA=="}}]}]}"#;
        let req = parse(body, &Limits::default()).unwrap();
        let img = PlacedImage {
            identifier: "x".into(),
            tokens: ImageTokens {
                tokens: 4,
                markers: 2,
            },
        };
        let r = render(&req, &[img]);
        let mut nl = Vec::new();
        pseudo_tokens("\n", &mut nl);
        let mut user = Vec::new();
        pseudo_tokens("user", &mut user);
        let mut hi = Vec::new();
        pseudo_tokens("hi", &mut hi);
        let mut expect = vec![IM_START];
        expect.extend(&user);
        expect.extend(&nl);
        expect.extend(&hi);
        expect.push(VISION_START);
        let start = expect.len();
        expect.extend([IMAGE_PAD; 4]);
        expect.push(VISION_END);
        expect.push(IM_END);
        expect.extend(&nl);
        expect.push(IM_START);
        pseudo_tokens("assistant", &mut expect);
        expect.extend(&nl);
        assert_eq!(r.tokens, expect);
        assert_eq!(
            r.mm,
            vec![MmRange {
                identifier: "x".into(),
                offset: start,
                length: 4
            }]
        );
    }

    #[test]
    fn completion_prompt_has_no_template_and_output_is_deterministic() {
        let req = parse(br#"{"model":"m","prompt":"hello"}"#, &Limits::default()).unwrap();
        let r = render(&req, &[]);
        let mut expect = Vec::new();
        pseudo_tokens("hello", &mut expect);
        assert_eq!(r.tokens, expect);
        assert_eq!(output_token(3, 5), output_token(3, 5));
        assert!(output_token(3, 1).0.starts_with(' '));
        assert!(!output_token(3, 0).0.starts_with(' '));
    }
}
