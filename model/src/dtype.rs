//! Element types of stored K/V and their conversions to and from f32.
//!
//! Stored bytes are little-endian. Conversions are written as plain loops over slices so the
//! compiler vectorises them; bf16 and f16 rounding is round-to-nearest-even (the `half` crate).

use half::{bf16, f16};

/// Element type of stored keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(rename_all = "lowercase")
)]
pub enum DType {
    #[default]
    Bf16,
    F16,
    F32,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }

    /// Wire code (docs/protocol.md): 0 bf16, 1 f16, 2 f32.
    pub const fn code(self) -> u8 {
        match self {
            DType::Bf16 => 0,
            DType::F16 => 1,
            DType::F32 => 2,
        }
    }

    pub const fn from_code(code: u8) -> Option<DType> {
        match code {
            0 => Some(DType::Bf16),
            1 => Some(DType::F16),
            2 => Some(DType::F32),
            _ => None,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
        }
    }

    /// Decodes `out.len()` elements from `bytes` (which must hold exactly that many).
    #[inline]
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        debug_assert_eq!(bytes.len(), out.len() * self.size());
        match self {
            DType::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    // bf16 is the top half of an f32: widening is exact and branch-free.
                    *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
                }
            }
            DType::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
                }
            }
            DType::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
    }

    /// Encodes `values` into `out` (exactly `values.len() * size()` bytes), rounding to nearest
    /// even for the 16-bit types.
    pub fn encode(self, values: &[f32], out: &mut [u8]) {
        assert_eq!(
            out.len(),
            values.len() * self.size(),
            "encode: output size mismatch"
        );
        match self {
            DType::Bf16 => {
                for (v, o) in values.iter().zip(out.chunks_exact_mut(2)) {
                    o.copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
                }
            }
            DType::F16 => {
                for (v, o) in values.iter().zip(out.chunks_exact_mut(2)) {
                    o.copy_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes());
                }
            }
            DType::F32 => {
                for (v, o) in values.iter().zip(out.chunks_exact_mut(4)) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
    }

    /// Encodes a slice into a fresh byte vector (convenience for tests, benches and clients).
    pub fn encode_vec(self, values: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; values.len() * self.size()];
        self.encode(values, &mut out);
        out
    }

    /// Decodes a byte slice into a fresh f32 vector.
    pub fn decode_vec(self, bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; bytes.len() / self.size()];
        self.decode(bytes, &mut out);
        out
    }

    /// Index of the first NaN or infinity in `bytes` (whole elements), read from the bit
    /// pattern alone: all exponent bits set. Scans in branch-free blocks (the inner loop
    /// vectorises; an early-exit scan element by element does not) and locates the element
    /// only inside a block that has one.
    pub fn first_non_finite(self, bytes: &[u8]) -> Option<usize> {
        const BLOCK: usize = 256;
        let size = self.size();
        let whole = bytes.len() - bytes.len() % size;
        let mut at = 0;
        while at < whole {
            let end = (at + BLOCK).min(whole);
            let block = &bytes[at..end];
            if self.any_non_finite(block) {
                let i = self.position_non_finite(block).expect("the block has one");
                return Some(at / size + i);
            }
            at = end;
        }
        None
    }

    /// Whether `bytes` (whole elements) holds a NaN or infinity; no early exit.
    #[inline]
    fn any_non_finite(self, bytes: &[u8]) -> bool {
        match self {
            DType::Bf16 | DType::F16 => {
                let exp = self.exp_mask16();
                bytes.chunks_exact(2).fold(false, |any, b| {
                    any | (u16::from_le_bytes([b[0], b[1]]) & exp == exp)
                })
            }
            DType::F32 => bytes.chunks_exact(4).fold(false, |any, b| {
                any | (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7F80_0000 == 0x7F80_0000)
            }),
        }
    }

    fn position_non_finite(self, bytes: &[u8]) -> Option<usize> {
        match self {
            DType::Bf16 | DType::F16 => {
                let exp = self.exp_mask16();
                bytes
                    .chunks_exact(2)
                    .position(|b| u16::from_le_bytes([b[0], b[1]]) & exp == exp)
            }
            DType::F32 => bytes.chunks_exact(4).position(|b| {
                u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7F80_0000 == 0x7F80_0000
            }),
        }
    }

    fn exp_mask16(self) -> u16 {
        if self == DType::Bf16 {
            0x7F80
        } else {
            0x7C00
        }
    }

    /// Rounds an f32 to this type's precision and back (what storing it would keep).
    pub fn round(self, v: f32) -> f32 {
        match self {
            DType::Bf16 => bf16::from_f32(v).to_f32(),
            DType::F16 => f16::from_f32(v).to_f32(),
            DType::F32 => v,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bf16" => Ok(DType::Bf16),
            "f16" | "fp16" => Ok(DType::F16),
            "f32" | "fp32" => Ok(DType::F32),
            other => Err(format!(
                "unknown dtype {other:?} (expected bf16, f16 or f32)"
            )),
        }
    }
}

/// Rounds an fp32 bound to bf16 bits away from the interior: `up` rounds toward +inf (for
/// k_max), otherwise toward -inf (for k_min). Finite inputs only.
#[inline(always)]
pub fn bf16_outward(x: f32, up: bool) -> u16 {
    let bits = x.to_bits();
    let trunc = (bits >> 16) as u16; // rounds toward zero
    let inexact = bits & 0xffff != 0;
    // Toward zero is toward -inf for positives and toward +inf for negatives. Branch-free, so
    // that a loop of it over a key compiles to vector code.
    let away = up != (bits >> 31 == 1);
    trunc + u16::from(inexact & away)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_all_types() {
        let xs = [0.0f32, -1.5, 3.25, 1e-3, -65504.0, 0.1];
        for dt in [DType::Bf16, DType::F16, DType::F32] {
            let bytes = dt.encode_vec(&xs);
            assert_eq!(bytes.len(), xs.len() * dt.size());
            let back = dt.decode_vec(&bytes);
            for (x, y) in xs.iter().zip(&back) {
                assert_eq!(dt.round(*x), *y, "{dt}: {x}");
            }
        }
        assert_eq!(
            DType::Bf16.round(1.0 + 1.0 / 256.0),
            1.0,
            "bf16 has 8 significant bits"
        );
        assert_eq!(DType::from_code(3), None);
    }

    /// The blocked scan agrees with a plain element-by-element scan at every position,
    /// block edge and trailing partial element.
    #[test]
    fn blocked_non_finite_scan_matches_a_plain_scan() {
        for dt in [DType::Bf16, DType::F16, DType::F32] {
            let plain = |bytes: &[u8]| {
                dt.decode_vec(&bytes[..bytes.len() - bytes.len() % dt.size()])
                    .iter()
                    .position(|x| !x.is_finite())
            };
            for n in [0usize, 1, 127, 128, 129, 300, 1000] {
                let xs: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 7.0).collect();
                let mut bytes = dt.encode_vec(&xs);
                assert_eq!(dt.first_non_finite(&bytes), None);
                for bad in (0..n).step_by(37).chain(n.checked_sub(1)) {
                    let mut b = bytes.clone();
                    dt.encode(&[f32::NAN], &mut b[bad * dt.size()..(bad + 1) * dt.size()]);
                    assert_eq!(dt.first_non_finite(&b), Some(bad), "{dt} n {n} at {bad}");
                    assert_eq!(dt.first_non_finite(&b), plain(&b));
                }
                // A trailing partial element is ignored, as before.
                bytes.push(0xFF);
                assert_eq!(dt.first_non_finite(&bytes), None, "{dt} n {n}");
            }
        }
    }

    #[test]
    fn non_finite_values_are_found_in_every_type() {
        for dt in [DType::Bf16, DType::F16, DType::F32] {
            let mut xs = vec![1.0f32, -2.0, 3.0, 0.0];
            assert_eq!(dt.first_non_finite(&dt.encode_vec(&xs)), None, "{dt}");
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                xs[2] = bad;
                assert_eq!(
                    dt.first_non_finite(&dt.encode_vec(&xs)),
                    Some(2),
                    "{dt} {bad}"
                );
            }
            xs[2] = 3.0;
        }
    }

    #[test]
    fn bf16_outward_rounding_brackets_the_value() {
        let mut x = 0x1234_5678u32;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let f = f32::from_bits(x);
            if !f.is_finite() || f.abs() > 1e38 {
                continue;
            }
            let hi = f32::from_bits((bf16_outward(f, true) as u32) << 16);
            let lo = f32::from_bits((bf16_outward(f, false) as u32) << 16);
            assert!(hi >= f && lo <= f, "{f} -> [{lo}, {hi}]");
            // One bf16 ulp apart at most.
            assert!(bf16_outward(f, true).abs_diff(bf16_outward(f, false)) <= 1 || f == 0.0);
        }
        assert_eq!(bf16_outward(1.0, true), 0x3f80);
        assert_eq!(bf16_outward(-1.0, false), 0xbf80);
    }
}
