//! An incremental JSON lexer: the body in pieces of any size in, events out to a [`Handler`].
//!
//! It accepts and rejects what `serde_json::from_slice` did for the request structs it
//! replaces, with the two validation regimes serde_json has:
//!
//! - **strict** (what serde_json parses into a value: the keys and values of the request
//!   structs, and everything inside `content` and `prompt`, which were buffered whole for
//!   untagged enums): strings must be UTF-8 and `\u` escapes must pair surrogates; numbers must
//!   fit an `f64` (serde_json's `number out of range`).
//! - **lax** (what serde_json skipped as `IgnoredAny`: unknown fields of the body and of the
//!   messages): escapes must be well formed and control characters are refused, but bytes are
//!   not checked as UTF-8, surrogates are not paired and numbers are not range-checked.
//!
//! Either way the syntax is JSON's, as serde_json reads it (no leading zeros, a digit after `.`
//! and after the exponent mark, `true`/`false`/`null` spelled out, white space = space, tab,
//! line feed, carriage return, nothing after the top-level value but white space).
//!
//! State between pieces: the container stack (one byte per level, bounded by the nesting limit,
//! which is enforced here), the lexer state (inside a string, an escape, a number, a literal)
//! and at most 3 bytes of a UTF-8 sequence cut by a piece boundary.

use crate::request::RequestError;

/// The kind of a value that starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Object,
    Array,
    String,
    Number,
    True,
    False,
    Null,
}

/// How the handler wants a value (or key) read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mode {
    /// Strict validation (module docs).
    pub strict: bool,
    /// Deliver the string's content ([`Handler::string_bytes`], [`Handler::string_char`]).
    pub content: bool,
    /// Deliver the value's raw JSON text ([`Handler::raw`]), start to end.
    pub raw: bool,
    /// Deliver the string's runs between escapes unchecked ([`Handler::string_run`]): the
    /// handler checks what it can while it reads them (base64 symbols are plain ASCII) and the
    /// lexer checks the rest, so a megabyte of base64 is not scanned twice.
    pub bulk: bool,
}

impl Mode {
    pub(crate) const LAX: Mode = Mode {
        strict: false,
        content: false,
        raw: false,
        bulk: false,
    };
    pub(crate) const STRICT: Mode = Mode {
        strict: true,
        content: false,
        raw: false,
        bulk: false,
    };
    pub(crate) const CONTENT: Mode = Mode {
        strict: true,
        content: true,
        raw: false,
        bulk: false,
    };
    pub(crate) const BULK: Mode = Mode {
        strict: true,
        content: true,
        raw: false,
        bulk: true,
    };
}

/// What the lexer tells the scanner. Any error stops the lexer.
pub(crate) trait Handler {
    /// A value starts; `at` is the body offset of its first byte.
    fn value_start(&mut self, kind: Kind, at: usize) -> Result<Mode, RequestError>;
    /// An object key starts.
    fn key_start(&mut self) -> Mode;
    /// Content of the current string: never a quote, backslash or control byte; a UTF-8
    /// sequence may be cut between two calls.
    fn string_bytes(&mut self, bytes: &[u8]) -> Result<(), RequestError>;
    /// Content of the current string (read with [`Mode::bulk`]) that the lexer has not checked:
    /// no quote or backslash, but possibly control bytes and invalid UTF-8. Returns the index
    /// of the first byte the handler did not find to be printable ASCII; the lexer checks the
    /// run from there (and reports a bad byte as the JSON error it is).
    fn string_run(&mut self, run: &[u8]) -> Result<Option<usize>, RequestError>;
    /// A character written as an escape in the current string.
    fn string_char(&mut self, c: char) -> Result<(), RequestError>;
    /// The current string (key or value) ended.
    fn string_end(&mut self) -> Result<(), RequestError>;
    /// A number ended; `unsigned` is its value when it is an integer that fits a `u64`, as
    /// serde_json reads it (no sign, fraction or exponent).
    fn number_end(&mut self, unsigned: Option<u64>) -> Result<(), RequestError>;
    /// `true`, `false` or `null` ended.
    fn literal_end(&mut self, kind: Kind) -> Result<(), RequestError>;
    /// The innermost object or array ended.
    fn container_end(&mut self) -> Result<(), RequestError>;
    /// Raw JSON text of a value started with [`Mode::raw`], in order, in one or more calls,
    /// before the value's end event.
    fn raw(&mut self, bytes: &[u8]);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Expecting a value (at the top, after `:`, after `,` in an array).
    Value,
    /// After `[`: a value or `]`.
    ArrayFirst,
    /// After `{`: a key or `}`.
    ObjectFirst,
    /// After `,` in an object: a key.
    Key,
    Colon,
    /// After a value inside a container: `,` or the closer.
    AfterValue,
    /// After the top-level value.
    End,
    Str {
        key: bool,
    },
    Escape {
        key: bool,
    },
    /// `\u`: `got` hex digits read into `acc`; `high` is a leading surrogate before it.
    Unicode {
        key: bool,
        got: u8,
        acc: u16,
        high: Option<u16>,
    },
    /// After a leading surrogate escape (strict): `\` then `u` must follow.
    LowBackslash {
        key: bool,
        high: u16,
    },
    LowU {
        key: bool,
        high: u16,
    },
    Number(Num),
    Literal {
        kind: Kind,
        got: u8,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NumPhase {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    ExpMark,
    ExpSign,
    Exp,
}

/// A number as serde_json reads it: significand digits into a `u64` (later digits move the
/// exponent or are dropped), the exponent into an `i32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Num {
    phase: NumPhase,
    negative: bool,
    significand: u64,
    /// An integer digit overflowed the significand: later integer digits scale the exponent
    /// (serde_json's `parse_long_integer`).
    long: bool,
    /// A fraction digit overflowed it: later fraction digits are dropped
    /// (`parse_decimal_overflow`).
    dropping: bool,
    /// Exponent from integer digits past the significand and taken fraction digits.
    scale: i32,
    exp: i32,
    exp_negative: bool,
    exp_overflow: bool,
    fraction_or_exponent: bool,
}

/// The raw text of a value being delivered.
#[derive(Debug, Clone, Copy)]
struct Raw {
    /// Index in the current piece where the undelivered text starts.
    from: usize,
    /// Stack depth before the value: it ends when the stack is back there.
    depth: usize,
}

/// Incremental UTF-8 validation of strict strings: what the next continuation bytes must be.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Utf8 {
    need: u8,
    lo: u8,
    hi: u8,
}

impl Utf8 {
    /// Takes one byte (>= 0x80, or any byte while a sequence is open); false when invalid.
    fn byte(&mut self, b: u8) -> bool {
        if self.need > 0 {
            if b < self.lo || b > self.hi {
                return false;
            }
            self.need -= 1;
            self.lo = 0x80;
            self.hi = 0xBF;
            return true;
        }
        let (need, lo, hi) = match b {
            0x00..=0x7F => return true,
            0xC2..=0xDF => (1, 0x80, 0xBF),
            0xE0 => (2, 0xA0, 0xBF),
            0xE1..=0xEC | 0xEE..=0xEF => (2, 0x80, 0xBF),
            0xED => (2, 0x80, 0x9F),
            0xF0 => (3, 0x90, 0xBF),
            0xF1..=0xF3 => (3, 0x80, 0xBF),
            0xF4 => (3, 0x80, 0x8F),
            _ => return false,
        };
        *self = Utf8 { need, lo, hi };
        true
    }
}

#[derive(Debug)]
pub(crate) struct Lexer {
    max_depth: usize,
    /// One entry per open container: true for an object.
    stack: Vec<bool>,
    state: State,
    /// Body offset of the next piece's first byte.
    offset: usize,
    /// Mode of the string or number being read.
    mode: Mode,
    utf8: Utf8,
    raw: Option<Raw>,
}

fn syntax(message: &str, at: usize) -> RequestError {
    RequestError::Json(format!("{message} at byte {at}"))
}

/// Length of the prefix of `b` with no quote, backslash or control byte, nor (when `ascii`)
/// a byte >= 0x80.
///
/// 32 bytes at a time with a branch-free test that the compiler vectorises (SSE2 natively,
/// simd128 in wasm built with it); in wasm without SIMD, eight bytes at a time in a `u64`, as
/// serde_json scans strings.
#[cfg(not(all(target_arch = "wasm32", not(target_feature = "simd128"))))]
fn plain_len(b: &[u8], ascii: bool) -> usize {
    plain_len_blocks(b, ascii)
}

#[cfg(all(target_arch = "wasm32", not(target_feature = "simd128")))]
fn plain_len(b: &[u8], ascii: bool) -> usize {
    plain_len_swar(b, ascii)
}

fn is_special(c: u8, ascii: bool) -> bool {
    c < 0x20 || c == b'"' || c == b'\\' || (ascii && c >= 0x80)
}

#[cfg_attr(
    all(target_arch = "wasm32", not(target_feature = "simd128")),
    allow(dead_code)
)]
fn plain_len_blocks(b: &[u8], ascii: bool) -> usize {
    let high: u8 = if ascii { 0x80 } else { 0 };
    let mut i = 0;
    for chunk in b.chunks_exact(32) {
        let mut hits = 0u8;
        for &c in chunk {
            hits |= u8::from(c < 0x20) | u8::from(c == b'"') | u8::from(c == b'\\') | (c & high);
        }
        if hits != 0 {
            break;
        }
        i += 32;
    }
    i + b
        .get(i..)
        .unwrap_or_default()
        .iter()
        .take_while(|&&c| !is_special(c, ascii))
        .count()
}

const fn repeat(b: u8) -> u64 {
    u64::from_ne_bytes([b; 8])
}

#[cfg_attr(
    not(all(target_arch = "wasm32", not(target_feature = "simd128"))),
    allow(dead_code)
)]
fn plain_len_swar(b: &[u8], ascii: bool) -> usize {
    const ONES: u64 = repeat(0x01);
    const HIGH: u64 = repeat(0x80);
    let high = if ascii { HIGH } else { 0 };
    let mut i = 0;
    for chunk in b.chunks_exact(8) {
        let Ok(bytes) = <[u8; 8]>::try_from(chunk) else {
            break;
        };
        let x = u64::from_le_bytes(bytes);
        // Bytes below 0x20, equal to `"`, equal to `\`: the lowest flagged byte is exact.
        let ctrl = x.wrapping_sub(repeat(0x20)) & !x;
        let q = x ^ repeat(b'"');
        let quote = q.wrapping_sub(ONES) & !q;
        let s = x ^ repeat(b'\\');
        let slash = s.wrapping_sub(ONES) & !s;
        let hits = ((ctrl | quote | slash) & HIGH) | (x & high);
        if hits != 0 {
            return i + (hits.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    i + b
        .get(i..)
        .unwrap_or_default()
        .iter()
        .take_while(|&&c| !is_special(c, ascii))
        .count()
}

impl Lexer {
    pub(crate) fn new(max_depth: usize) -> Lexer {
        Lexer {
            max_depth,
            stack: Vec::new(),
            state: State::Value,
            offset: 0,
            mode: Mode::LAX,
            utf8: Utf8::default(),
            raw: None,
        }
    }

    /// The next piece of the body.
    pub(crate) fn feed<H: Handler>(&mut self, piece: &[u8], h: &mut H) -> Result<(), RequestError> {
        if let Some(raw) = &mut self.raw {
            raw.from = 0;
        }
        let mut i = 0;
        while let Some(&b) = piece.get(i) {
            i = self.step(piece, i, b, h)?;
        }
        if let Some(raw) = self.raw {
            h.raw(piece.get(raw.from..).unwrap_or_default());
        }
        self.offset += piece.len();
        Ok(())
    }

    /// The end of the body.
    pub(crate) fn finish<H: Handler>(&mut self, h: &mut H) -> Result<(), RequestError> {
        if let State::Number(num) = self.state
            && matches!(
                num.phase,
                NumPhase::Zero | NumPhase::Int | NumPhase::Frac | NumPhase::Exp
            )
        {
            // Its text went out with the last piece.
            self.raw = None;
            self.end_number(num, self.offset, h)?;
        }
        let at = self.offset;
        match self.state {
            State::End => Ok(()),
            State::Str { .. }
            | State::Escape { .. }
            | State::Unicode { .. }
            | State::LowBackslash { .. }
            | State::LowU { .. } => Err(syntax("EOF while parsing a string", at)),
            State::Number(_) | State::Literal { .. } | State::Value if self.stack.is_empty() => {
                Err(syntax("EOF while parsing a value", at))
            }
            State::ObjectFirst | State::Key | State::Colon => {
                Err(syntax("EOF while parsing an object", at))
            }
            _ => match self.stack.last() {
                Some(true) => Err(syntax("EOF while parsing an object", at)),
                _ => Err(syntax("EOF while parsing a list", at)),
            },
        }
    }

    /// Handles the byte `b` at `piece[i]`; returns the index of the next byte to look at.
    fn step<H: Handler>(
        &mut self,
        piece: &[u8],
        i: usize,
        b: u8,
        h: &mut H,
    ) -> Result<usize, RequestError> {
        let at = self.offset + i;
        match self.state {
            State::Str { key } => return self.string(piece, i, key, h),
            State::Number(num) => return self.number(piece, num, i, b, h),
            State::Escape { key } => {
                let c = match b {
                    b'"' => '"',
                    b'\\' => '\\',
                    b'/' => '/',
                    b'b' => '\u{8}',
                    b'f' => '\u{c}',
                    b'n' => '\n',
                    b'r' => '\r',
                    b't' => '\t',
                    b'u' => {
                        self.state = State::Unicode {
                            key,
                            got: 0,
                            acc: 0,
                            high: None,
                        };
                        return Ok(i + 1);
                    }
                    _ => return Err(syntax("invalid escape", at)),
                };
                if self.mode.content {
                    h.string_char(c)?;
                }
                self.state = State::Str { key };
            }
            State::Unicode {
                key,
                got,
                acc,
                high,
            } => {
                let Some(d) = char::from(b).to_digit(16) else {
                    return Err(syntax("invalid escape", at));
                };
                let acc = (acc << 4) | d as u16;
                if got < 3 {
                    self.state = State::Unicode {
                        key,
                        got: got + 1,
                        acc,
                        high,
                    };
                    return Ok(i + 1);
                }
                self.state = State::Str { key };
                if !self.mode.strict {
                    // serde_json's ignore_str only checks the four hex digits.
                    return Ok(i + 1);
                }
                let c = match (high, acc) {
                    (None, 0xDC00..=0xDFFF) => {
                        return Err(syntax("lone leading surrogate in hex escape", at));
                    }
                    (None, 0xD800..=0xDBFF) => {
                        self.state = State::LowBackslash { key, high: acc };
                        return Ok(i + 1);
                    }
                    (None, n) => char::from_u32(u32::from(n)),
                    (Some(high), 0xDC00..=0xDFFF) => char::from_u32(
                        0x1_0000 + ((u32::from(high) - 0xD800) << 10) + (u32::from(acc) - 0xDC00),
                    ),
                    (Some(_), _) => {
                        return Err(syntax("lone leading surrogate in hex escape", at));
                    }
                };
                let Some(c) = c else {
                    return Err(syntax("invalid unicode code point", at));
                };
                if self.mode.content {
                    h.string_char(c)?;
                }
            }
            State::LowBackslash { key, high } => {
                if b != b'\\' {
                    return Err(syntax("unexpected end of hex escape", at));
                }
                self.state = State::LowU { key, high };
            }
            State::LowU { key, high } => {
                if b != b'u' {
                    return Err(syntax("unexpected end of hex escape", at));
                }
                self.state = State::Unicode {
                    key,
                    got: 0,
                    acc: 0,
                    high: Some(high),
                };
            }
            State::Literal { kind, got } => {
                let word: &[u8] = match kind {
                    Kind::True => b"true",
                    Kind::False => b"false",
                    _ => b"null",
                };
                if word.get(usize::from(got)) != Some(&b) {
                    return Err(syntax("expected ident", at));
                }
                if usize::from(got) + 1 < word.len() {
                    self.state = State::Literal { kind, got: got + 1 };
                } else {
                    self.end_raw(piece, i + 1, h);
                    h.literal_end(kind)?;
                    self.value_done();
                }
            }
            State::Value | State::ArrayFirst => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b']' if self.state == State::ArrayFirst => self.close(false, piece, i, h)?,
                _ => self.value(i, b, h)?,
            },
            State::ObjectFirst | State::Key => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b'"' => {
                    self.mode = h.key_start();
                    self.state = State::Str { key: true };
                }
                b'}' if self.state == State::ObjectFirst => self.close(true, piece, i, h)?,
                b'}' => return Err(syntax("trailing comma", at)),
                _ => return Err(syntax("key must be a string", at)),
            },
            State::Colon => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b':' => self.state = State::Value,
                _ => return Err(syntax("expected `:`", at)),
            },
            State::AfterValue => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                b',' => {
                    self.state = if self.stack.last() == Some(&true) {
                        State::Key
                    } else {
                        State::Value
                    }
                }
                b'}' | b']' => {
                    let object = b == b'}';
                    if self.stack.last() != Some(&object) {
                        return Err(syntax(
                            if object {
                                "expected `,` or `]`"
                            } else {
                                "expected `,` or `}`"
                            },
                            at,
                        ));
                    }
                    self.close(object, piece, i, h)?;
                }
                _ => {
                    return Err(syntax(
                        if self.stack.last() == Some(&true) {
                            "expected `,` or `}`"
                        } else {
                            "expected `,` or `]`"
                        },
                        at,
                    ));
                }
            },
            State::End => match b {
                b' ' | b'\t' | b'\n' | b'\r' => {}
                _ => return Err(syntax("trailing characters", at)),
            },
        }
        Ok(i + 1)
    }

    /// A value starts with `b` at `piece[i]`.
    fn value<H: Handler>(&mut self, i: usize, b: u8, h: &mut H) -> Result<(), RequestError> {
        let at = self.offset + i;
        let kind = match b {
            b'{' => Kind::Object,
            b'[' => Kind::Array,
            b'"' => Kind::String,
            b'-' | b'0'..=b'9' => Kind::Number,
            b't' => Kind::True,
            b'f' => Kind::False,
            b'n' => Kind::Null,
            _ => return Err(syntax("expected value", at)),
        };
        if matches!(kind, Kind::Object | Kind::Array) && self.stack.len() >= self.max_depth {
            return Err(RequestError::TooDeep {
                limit: self.max_depth,
            });
        }
        let mode = h.value_start(kind, at)?;
        self.mode = mode;
        if mode.raw {
            self.raw = Some(Raw {
                from: i,
                depth: self.stack.len(),
            });
        }
        self.state = match kind {
            Kind::Object => {
                self.stack.push(true);
                State::ObjectFirst
            }
            Kind::Array => {
                self.stack.push(false);
                State::ArrayFirst
            }
            Kind::String => State::Str { key: false },
            Kind::Number => {
                let mut num = Num {
                    phase: NumPhase::Minus,
                    negative: b == b'-',
                    significand: 0,
                    long: false,
                    dropping: false,
                    scale: 0,
                    exp: 0,
                    exp_negative: false,
                    exp_overflow: false,
                    fraction_or_exponent: false,
                };
                if b != b'-' {
                    num.phase = if b == b'0' {
                        NumPhase::Zero
                    } else {
                        NumPhase::Int
                    };
                    num.significand = u64::from(b - b'0');
                }
                State::Number(num)
            }
            Kind::True | Kind::False | Kind::Null => State::Literal { kind, got: 1 },
        };
        Ok(())
    }

    /// A closer at `piece[i]` for the innermost container.
    fn close<H: Handler>(
        &mut self,
        object: bool,
        piece: &[u8],
        i: usize,
        h: &mut H,
    ) -> Result<(), RequestError> {
        debug_assert_eq!(self.stack.last(), Some(&object));
        self.stack.pop();
        self.end_raw(piece, i + 1, h);
        h.container_end()?;
        self.value_done();
        Ok(())
    }

    /// Delivers the raw text of the value that ends just before `piece[end]`, if the value
    /// that ends there is the one that started raw (not a value inside it).
    fn end_raw<H: Handler>(&mut self, piece: &[u8], end: usize, h: &mut H) {
        if let Some(raw) = self.raw
            && raw.depth == self.stack.len()
        {
            self.raw = None;
            h.raw(piece.get(raw.from..end).unwrap_or_default());
        }
    }

    fn value_done(&mut self) {
        self.state = if self.stack.is_empty() {
            State::End
        } else {
            State::AfterValue
        };
    }

    /// Inside a string, at `piece[i]`.
    fn string<H: Handler>(
        &mut self,
        piece: &[u8],
        i: usize,
        key: bool,
        h: &mut H,
    ) -> Result<usize, RequestError> {
        let rest = piece.get(i..).unwrap_or_default();
        let strict = self.mode.strict;
        if strict && self.utf8.need > 0 {
            // A sequence cut by the end of the previous piece (or an escape) must go on.
            return self.non_ascii(piece, i, h);
        }
        if self.mode.bulk {
            let end = memchr::memchr2(b'"', b'\\', rest).unwrap_or(rest.len());
            if end > 0 {
                let run = rest.get(..end).unwrap_or_default();
                if let Some(k) = h.string_run(run)? {
                    self.check(run.get(k..).unwrap_or_default(), self.offset + i + k)?;
                }
                return Ok(i + end);
            }
        }
        let n = plain_len(rest, strict);
        if n > 0 {
            if self.mode.content {
                h.string_bytes(rest.get(..n).unwrap_or_default())?;
            }
            return Ok(i + n);
        }
        let at = self.offset + i;
        match rest.first() {
            Some(b'"') => {
                if !key {
                    self.end_raw(piece, i + 1, h);
                }
                h.string_end()?;
                if key {
                    self.state = State::Colon;
                } else {
                    self.value_done();
                }
                Ok(i + 1)
            }
            Some(b'\\') => {
                self.state = State::Escape { key };
                Ok(i + 1)
            }
            Some(&c) if c < 0x20 => Err(syntax(
                "control character (\\u0000-\\u001F) found while parsing a string",
                at,
            )),
            Some(_) => self.non_ascii(piece, i, h),
            None => Ok(i),
        }
    }

    /// Strict strings: validates the run of bytes >= 0x80 at `piece[i]` as UTF-8.
    fn non_ascii<H: Handler>(
        &mut self,
        piece: &[u8],
        i: usize,
        h: &mut H,
    ) -> Result<usize, RequestError> {
        let rest = piece.get(i..).unwrap_or_default();
        let n = self.utf8_run(rest, self.offset + i)?;
        if self.mode.content {
            h.string_bytes(rest.get(..n).unwrap_or_default())?;
        }
        Ok(i + n)
    }

    /// Validates the bytes >= 0x80 at the start of `rest` (body offset `at`) as UTF-8, going
    /// on from a sequence cut before them; returns how many there are. A sequence may stay
    /// open at the end of `rest` only: the next byte decides.
    fn utf8_run(&mut self, rest: &[u8], at: usize) -> Result<usize, RequestError> {
        let n = rest.iter().take_while(|&&c| c >= 0x80).count();
        for (k, &c) in rest.iter().take(n).enumerate() {
            if !self.utf8.byte(c) {
                return Err(syntax("invalid unicode code point", at + k));
            }
        }
        if self.utf8.need > 0 && n < rest.len() {
            // The sequence stops at an ASCII byte.
            return Err(syntax("invalid unicode code point", at + n));
        }
        Ok(n)
    }

    /// Checks string content a handler took unchecked (`at`: body offset of `run`): no control
    /// byte, and UTF-8 when strict.
    fn check(&mut self, run: &[u8], at: usize) -> Result<(), RequestError> {
        let strict = self.mode.strict;
        let mut k = 0;
        while let Some(rest) = run.get(k..).filter(|r| !r.is_empty()) {
            if strict && self.utf8.need > 0 {
                k += self.utf8_run(rest, at + k)?;
                continue;
            }
            let n = plain_len(rest, strict);
            k += n;
            match rest.get(n) {
                None => break,
                Some(&c) if c < 0x20 => {
                    return Err(syntax(
                        "control character (\\u0000-\\u001F) found while parsing a string",
                        at + k,
                    ));
                }
                Some(_) => k += self.utf8_run(run.get(k..).unwrap_or_default(), at + k)?,
            }
        }
        Ok(())
    }

    /// Inside a number, at byte `b` (`piece[i]`).
    fn number<H: Handler>(
        &mut self,
        piece: &[u8],
        mut num: Num,
        i: usize,
        b: u8,
        h: &mut H,
    ) -> Result<usize, RequestError> {
        let at = self.offset + i;
        let digit = b.is_ascii_digit();
        let d = u64::from(b.wrapping_sub(b'0'));
        num.phase = match (num.phase, b) {
            (NumPhase::Minus, b'0') => NumPhase::Zero,
            (NumPhase::Minus, _) if digit => {
                num.significand = d;
                NumPhase::Int
            }
            (NumPhase::Minus, _) => return Err(syntax("invalid number", at)),
            (NumPhase::Zero, _) if digit => return Err(syntax("invalid number", at)),
            (NumPhase::Int, _) if digit => {
                match num
                    .significand
                    .checked_mul(10)
                    .and_then(|s| s.checked_add(d))
                {
                    Some(s) if !num.long => num.significand = s,
                    _ => {
                        num.long = true;
                        num.scale = num.scale.saturating_add(1);
                    }
                }
                NumPhase::Int
            }
            (NumPhase::Zero | NumPhase::Int, b'.') => {
                num.fraction_or_exponent = true;
                NumPhase::Dot
            }
            (NumPhase::Dot | NumPhase::Frac, _) if digit => {
                match num
                    .significand
                    .checked_mul(10)
                    .and_then(|s| s.checked_add(d))
                {
                    Some(s) if !num.dropping => {
                        num.significand = s;
                        num.scale = num.scale.saturating_sub(1);
                    }
                    _ => num.dropping = true,
                }
                NumPhase::Frac
            }
            (NumPhase::Dot, _) => return Err(syntax("invalid number", at)),
            (NumPhase::Zero | NumPhase::Int | NumPhase::Frac, b'e' | b'E') => {
                num.fraction_or_exponent = true;
                NumPhase::ExpMark
            }
            (NumPhase::ExpMark, b'+' | b'-') => {
                num.exp_negative = b == b'-';
                NumPhase::ExpSign
            }
            (NumPhase::ExpMark | NumPhase::ExpSign | NumPhase::Exp, _) if digit => {
                if !num.exp_overflow {
                    match num
                        .exp
                        .checked_mul(10)
                        .and_then(|e| e.checked_add(d as i32))
                    {
                        Some(e) => num.exp = e,
                        None => num.exp_overflow = true,
                    }
                }
                NumPhase::Exp
            }
            (NumPhase::ExpMark | NumPhase::ExpSign, _) => {
                return Err(syntax("invalid number", at));
            }
            // Any other byte ends the number; it is read again in the state after it.
            (NumPhase::Zero | NumPhase::Int | NumPhase::Frac | NumPhase::Exp, _) => {
                self.end_raw(piece, i, h);
                self.end_number(num, at, h)?;
                return Ok(i);
            }
        };
        self.state = State::Number(num);
        Ok(i + 1)
    }

    /// The number ends before body offset `at`.
    fn end_number<H: Handler>(
        &mut self,
        num: Num,
        at: usize,
        h: &mut H,
    ) -> Result<(), RequestError> {
        if self.mode.strict && out_of_range(&num) {
            return Err(syntax("number out of range", at));
        }
        let unsigned =
            (!num.negative && !num.fraction_or_exponent && !num.long).then_some(num.significand);
        h.number_end(unsigned)?;
        self.value_done();
        Ok(())
    }
}

/// serde_json's `f64_from_parts` (without `float_roundtrip`) would report `number out of
/// range`: significand × 10^exponent overflows an `f64`.
fn out_of_range(num: &Num) -> bool {
    if num.exp_overflow {
        // parse_exponent_overflow: an error only for a positive exponent and a non-zero value.
        return num.significand != 0 && !num.exp_negative;
    }
    let exponent = if num.exp_negative {
        num.scale.saturating_sub(num.exp)
    } else {
        num.scale.saturating_add(num.exp)
    };
    if num.significand == 0 || exponent <= 0 {
        return false;
    }
    let digits = num.significand.ilog10() as i64 + 1;
    let magnitude = digits - 1 + i64::from(exponent);
    if magnitude < 308 {
        return false;
    }
    if magnitude > 308 || exponent > 308 {
        return true;
    }
    // The boundary decade: serde_json multiplies the significand, as an f64, by its table's
    // power of ten, which is the correctly rounded literal `1e{exponent}`.
    let pow: f64 = format!("1e{exponent}").parse().unwrap_or(f64::INFINITY);
    (num.significand as f64 * pow).is_infinite()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn both_string_scans_stop_at_the_first_special_byte(
            b in prop::collection::vec(
                prop_oneof![8 => 0x20u8..0x7f, 1 => any::<u8>()],
                0..100,
            ),
            ascii in any::<bool>(),
        ) {
            let want = b.iter().take_while(|&&c| !is_special(c, ascii)).count();
            prop_assert_eq!(plain_len_blocks(&b, ascii), want);
            prop_assert_eq!(plain_len_swar(&b, ascii), want);
        }
    }
}
