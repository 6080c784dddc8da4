//! Little-endian primitives shared by every body codec. Decoding borrows from the body;
//! every length is checked against what is left before anything is allocated.

use crate::error::ProtoError;

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], ProtoError> {
        let available = self.remaining();
        if n > available {
            return Err(ProtoError::Truncated {
                what,
                needed: n,
                available,
            });
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], ProtoError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, ProtoError> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16, ProtoError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, ProtoError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, ProtoError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn bool(&mut self, what: &'static str) -> Result<bool, ProtoError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(ProtoError::BadBool { what, value }),
        }
    }

    /// A u8 of flag bits; a bit outside `known` is refused.
    pub(crate) fn flags(&mut self, what: &'static str, known: u8) -> Result<u8, ProtoError> {
        let value = self.u8(what)?;
        if value & !known != 0 {
            return Err(ProtoError::BadFlagBits { what, value });
        }
        Ok(value)
    }

    /// u32 byte length + UTF-8 bytes.
    pub(crate) fn str(&mut self, what: &'static str) -> Result<&'a str, ProtoError> {
        let len = self.u32(what)? as usize;
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes).map_err(|_| ProtoError::InvalidUtf8 { what })
    }

    /// u32 element count, checked against the bytes left given the smallest encoded size of
    /// one element, so a forged count cannot make the decoder allocate or loop for long.
    pub(crate) fn count(
        &mut self,
        what: &'static str,
        min_item_bytes: usize,
    ) -> Result<usize, ProtoError> {
        let n = self.u32(what)? as usize;
        let needed = n
            .checked_mul(min_item_bytes)
            .ok_or(ProtoError::LengthOverflow { what })?;
        let available = self.remaining();
        if needed > available {
            return Err(ProtoError::Truncated {
                what,
                needed,
                available,
            });
        }
        Ok(n)
    }

    pub(crate) fn finish(self) -> Result<(), ProtoError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(ProtoError::TrailingBytes { extra }),
        }
    }
}

pub(crate) fn put_u8(buf: &mut Vec<u8>, v: u8) {
    buf.push(v);
}

pub(crate) fn put_u16(buf: &mut Vec<u8>, v: u16) {
    buf.extend_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u32(buf: &mut Vec<u8>, v: u32) {
    buf.extend_from_slice(&v.to_le_bytes());
}

pub(crate) fn put_u64(buf: &mut Vec<u8>, v: u64) {
    buf.extend_from_slice(&v.to_le_bytes());
}

/// A u32 length or count field.
pub(crate) fn put_len(buf: &mut Vec<u8>, len: usize, what: &'static str) -> Result<(), ProtoError> {
    let v = u32::try_from(len).map_err(|_| ProtoError::TooLong { what, len })?;
    put_u32(buf, v);
    Ok(())
}

pub(crate) fn put_str(buf: &mut Vec<u8>, s: &str, what: &'static str) -> Result<(), ProtoError> {
    put_len(buf, s.len(), what)?;
    buf.extend_from_slice(s.as_bytes());
    Ok(())
}

pub(crate) fn put_f32s(buf: &mut Vec<u8>, values: &[f32]) {
    buf.reserve(values.len() * 4);
    for v in values {
        buf.extend_from_slice(&v.to_le_bytes());
    }
}

/// Iterate little-endian f32s in `bytes` (a trailing partial element is ignored; decoders
/// reject lengths that are not a multiple of 4 before handing slices out).
pub fn f32s_le(bytes: &[u8]) -> impl ExactSizeIterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// Copy little-endian f32s from `bytes` into `out`; `out` must hold exactly `bytes.len() / 4`.
pub fn read_f32s_into(bytes: &[u8], out: &mut [f32]) -> Result<(), ProtoError> {
    if bytes.len() % 4 != 0 {
        return Err(ProtoError::Misaligned {
            what: "f32 array",
            len: bytes.len(),
            multiple: 4,
        });
    }
    if out.len() != bytes.len() / 4 {
        return Err(ProtoError::Truncated {
            what: "f32 output",
            needed: bytes.len() / 4,
            available: out.len(),
        });
    }
    for (o, v) in out.iter_mut().zip(f32s_le(bytes)) {
        *o = v;
    }
    Ok(())
}

/// View f32s as their little-endian bytes: borrowed on little-endian hosts, copied otherwise.
pub fn f32_le_bytes(values: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: f32 has no padding and every byte of it is initialised; u8 has alignment 1;
        // the byte length is exactly size_of_val(values) and the borrow keeps `values` alive.
        let bytes = unsafe {
            std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
        };
        std::borrow::Cow::Borrowed(bytes)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let mut out = Vec::with_capacity(values.len() * 4);
        put_f32s(&mut out, values);
        std::borrow::Cow::Owned(out)
    }
}
