//! Image size from the file header, without decoding pixels. (Contract stub: being filled in.)

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    Png,
    Jpeg,
    Webp,
    Gif,
}

impl fmt::Display for ImageFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ImageFormat::Png => "PNG",
            ImageFormat::Jpeg => "JPEG",
            ImageFormat::Webp => "WebP",
            ImageFormat::Gif => "GIF",
        })
    }
}

/// Size as the model's image processor sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ImageInfo {
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderError {
    /// Not PNG, JPEG, WebP or GIF.
    Unrecognised,
    /// The header ends before the size is known: `truncated PNG header`.
    Truncated(ImageFormat),
    /// The header is there but wrong.
    Corrupt(ImageFormat, String),
}

impl fmt::Display for HeaderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeaderError::Unrecognised => f.write_str("unrecognised image format"),
            HeaderError::Truncated(fmt) => write!(f, "truncated {fmt} header"),
            HeaderError::Corrupt(fmt, why) => write!(f, "corrupt {fmt} header: {why}"),
        }
    }
}

impl std::error::Error for HeaderError {}

/// Reads format, width and height from the start of an image file.
pub fn read_image_header(bytes: &[u8]) -> Result<ImageInfo, HeaderError> {
    let _ = bytes;
    Err(HeaderError::Unrecognised)
}
