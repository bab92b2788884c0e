//! Token costs assumed for media whose size the router cannot read: an http(s) image whose
//! bytes were not fetched, video, audio, precomputed embeddings.

use crate::config_error::ConfigError;

/// Token costs for media whose size the router cannot read.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MediaDefaults {
    /// Size assumed for an http(s) image whose bytes were not seen (default 640×360, the size
    /// llm-d assumes). The profile turns it into tokens like any other size.
    pub url_image_width: u32,
    pub url_image_height: u32,
    /// Tokens assumed for a video item (default 2048: a few frames at video resolution; the
    /// real count depends on duration, fps and the processor's frame sampling).
    pub video_tokens: u32,
    /// Tokens assumed for an audio item (default 750: 30 s through a Whisper-style encoder
    /// pooled 2×, as Qwen2-Audio).
    pub audio_tokens: u32,
    /// Tokens assumed for `image_embeds` (default 256).
    pub embeds_tokens: u32,
}

impl Default for MediaDefaults {
    fn default() -> Self {
        MediaDefaults {
            url_image_width: 640,
            url_image_height: 360,
            video_tokens: 2048,
            audio_tokens: 750,
            embeds_tokens: 256,
        }
    }
}

impl MediaDefaults {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.url_image_width == 0 || self.url_image_height == 0 {
            return Err(ConfigError::new(
                "media.url_image_width",
                "url image size must be non-zero",
            ));
        }
        Ok(())
    }
}
