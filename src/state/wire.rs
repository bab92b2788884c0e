//! Little-endian reading of the state plane's values: every read is bounds-checked and a short
//! or malformed value reads as None (the caller then treats it as empty), never a panic.

pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len()
    }

    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.bytes.split_at_checked(n)?;
        self.bytes = tail;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.take(N)?.try_into().ok()
    }

    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|[b]| b)
    }

    pub(crate) fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    pub(crate) fn u128(&mut self) -> Option<u128> {
        self.array().map(u128::from_le_bytes)
    }

    pub(crate) fn f32(&mut self) -> Option<f32> {
        self.array().map(f32::from_le_bytes)
    }

    /// A string of at most 255 bytes, prefixed by its length (u8).
    pub(crate) fn short_str(&mut self) -> Option<&'a str> {
        let n = usize::from(self.u8()?);
        std::str::from_utf8(self.take(n)?).ok()
    }
}

/// Appends a string of at most 255 bytes (longer ones are cut at a char boundary).
pub(crate) fn put_short_str(out: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let s = s.get(..end).unwrap_or("");
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}
