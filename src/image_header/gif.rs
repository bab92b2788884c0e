//! GIF: the `gif` crate's streaming decoder, fed as the bytes arrive, with the event handling of
//! `DecodeOptions::read_info` + `Decoder::next_frame_info` replayed here (those two read from an
//! `io::Read`, which a stream of pieces is not).
//!
//! Size: the logical screen size, enlarged to contain the first frame: Pillow's
//! `GifImageFile._seek(0)` grows the size to `max(screen, frame left + width, frame top +
//! height)`. Pillow keeps no EXIF or XMP for GIF, so GIF is never transposed.

use super::{HeaderError, ImageFormat};
use ::gif::streaming_decoder::{Block, Decoded, OutputBuffer, StreamingDecoder};

const F: ImageFormat = ImageFormat::Gif;
/// `Decoder`'s limit on XMP/ICC application data that the slice reader set (1 MiB, plus the
/// one byte that makes the `NonZeroU64` of the crate's API).
const METADATA_LIMIT: usize = (1 << 20) + 1;
const APPLICATION: u8 = 0xFF;

pub(super) struct GifReader {
    decoder: StreamingDecoder,
    phase: Phase,
    has_global_palette: bool,
    /// The application extension being read, as `Decoder::read_application_extension` tracks
    /// it, and the bytes its XMP or ICC data would take.
    app: App,
    app_bytes: usize,
}

impl std::fmt::Debug for GifReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GifReader")
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
enum Phase {
    /// `read_info`: up to the end of the header (screen descriptor, palette, extensions).
    Info,
    /// `next_frame_info`: up to the first image descriptor.
    Frame,
    Done(Result<(u32, u32), HeaderError>),
}

#[derive(Debug, Clone, Copy)]
enum App {
    None,
    Netscape,
    Xmp,
    Icc,
    Skip,
}

fn map(e: ::gif::DecodingError) -> HeaderError {
    match e {
        ::gif::DecodingError::UnexpectedEof => HeaderError::Truncated(F),
        ::gif::DecodingError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            HeaderError::Truncated(F)
        }
        e => HeaderError::Corrupt(F, e.to_string()),
    }
}

impl GifReader {
    pub(super) fn new() -> GifReader {
        GifReader {
            decoder: StreamingDecoder::new(),
            phase: Phase::Info,
            has_global_palette: false,
            app: App::None,
            app_bytes: 0,
        }
    }

    pub(super) fn feed(&mut self, mut input: &[u8]) {
        while !input.is_empty() && !matches!(self.phase, Phase::Done(_)) {
            let (used, event) = match self.decoder.update(input, &mut OutputBuffer::None) {
                Ok(r) => r,
                Err(e) => {
                    self.phase = Phase::Done(Err(map(e)));
                    return;
                }
            };
            input = input.get(used..).unwrap_or_default();
            let progressed = used > 0 || !matches!(event, Decoded::Nothing);
            self.event(event);
            if !progressed {
                break;
            }
        }
    }

    fn event(&mut self, event: Decoded) {
        let done = |r| Phase::Done(r);
        match (&self.phase, event) {
            (Phase::Done(_), _) => {}
            // `ReadDecoder::decode_next` swallows the trailer and reports the end of the file.
            (Phase::Info, Decoded::BlockStart(Block::Trailer)) => {
                self.phase = done(Err(HeaderError::Corrupt(
                    F,
                    "file does not contain any image data".into(),
                )));
            }
            (Phase::Frame, Decoded::BlockStart(Block::Trailer)) => {
                self.phase = done(Err(HeaderError::Corrupt(F, "no image in file".into())));
            }
            (Phase::Info, Decoded::GlobalPalette(palette)) => {
                self.has_global_palette = !palette.is_empty();
            }
            (Phase::Info, Decoded::SubBlock { ext, is_last }) if ext.0 == APPLICATION => {
                if let Err(e) = self.application_sub_block(is_last) {
                    self.phase = done(Err(e));
                }
            }
            (Phase::Info, Decoded::HeaderEnd) => self.phase = Phase::Frame,
            (Phase::Frame, Decoded::FrameMetadata(_)) => {
                let frame = self.decoder.current_frame();
                if frame.palette.is_none() && !self.has_global_palette {
                    self.phase = done(Err(HeaderError::Corrupt(
                        F,
                        "no color table available for current frame".into(),
                    )));
                    return;
                }
                let right = u32::from(frame.left) + u32::from(frame.width);
                let bottom = u32::from(frame.top) + u32::from(frame.height);
                let screen_w = u32::from(self.decoder.width());
                let screen_h = u32::from(self.decoder.height());
                self.phase = done(Ok((screen_w.max(right), screen_h.max(bottom))));
            }
            _ => {}
        }
    }

    /// `Decoder::read_application_extension`, counting instead of keeping the data.
    fn application_sub_block(&mut self, is_last: bool) -> Result<(), HeaderError> {
        let data = self.decoder.last_ext_sub_block();
        let len = data.len();
        match self.app {
            App::None => {
                self.app = match data {
                    b"NETSCAPE2.0" => App::Netscape,
                    b"XMP DataXMP" => App::Xmp,
                    b"ICCRGBG1012" => App::Icc,
                    _ => App::Skip,
                };
                self.app_bytes = 0;
            }
            App::Netscape => self.app = App::Skip,
            App::Xmp | App::Icc => {
                // XMP keeps each sub-block's length byte too.
                let add = if matches!(self.app, App::Xmp) {
                    len + 1
                } else {
                    len
                };
                let total = self.app_bytes.saturating_add(add);
                if total > METADATA_LIMIT {
                    return Err(map(::gif::DecodingError::MemoryLimit));
                }
                self.app_bytes = total;
            }
            App::Skip => {}
        }
        if is_last {
            self.app = App::None;
        }
        Ok(())
    }

    pub(super) fn finish(self) -> Result<(u32, u32), HeaderError> {
        match self.phase {
            Phase::Done(result) => result,
            // `decode_next` found no more bytes.
            Phase::Info | Phase::Frame => Err(HeaderError::Truncated(F)),
        }
    }
}
