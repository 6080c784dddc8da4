//! On-disk page format: a 64-byte header followed by the payload, zero padded to the page
//! size. All integers little-endian.
//!
//! | offset | field |
//! |---|---|
//! | 0 | magic u32 `KVTP` |
//! | 4 | format version u16 (1) |
//! | 6 | reserved u16 (0) |
//! | 8 | session u64 |
//! | 16 | layer u32 |
//! | 20 | block u32 |
//! | 24 | generation u64 |
//! | 32 | payload_len u32 |
//! | 36 | crc32c u32 over bytes 0..36, 40..64 and the payload |
//! | 40 | reserved (0) |

use super::error::CorruptReason;

pub const PAGE_MAGIC: u32 = u32::from_le_bytes(*b"KVTP");
pub const PAGE_VERSION: u16 = 1;
pub const HEADER_LEN: usize = 64;

/// What a page holds: one (layer, block) run of a session, at a generation (bumped on every
/// rewrite so a stale copy can never pass for the current one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageId {
    pub session: u64,
    pub layer: u32,
    pub block: u32,
    pub generation: u64,
}

fn crc(page: &[u8], payload_len: usize) -> u32 {
    let c = crc32c::crc32c(&page[..36]);
    let c = crc32c::crc32c_append(c, &page[40..HEADER_LEN]);
    crc32c::crc32c_append(c, &page[HEADER_LEN..HEADER_LEN + payload_len])
}

/// Writes header + payload into `page` (whose tail past the payload is zeroed). Returns the
/// checksum. The caller guarantees `HEADER_LEN + payload.len() <= page.len()`.
pub fn encode(page: &mut [u8], id: PageId, payload: &[u8]) -> u32 {
    assert!(HEADER_LEN + payload.len() <= page.len(), "payload too big");
    page[..HEADER_LEN].fill(0);
    page[0..4].copy_from_slice(&PAGE_MAGIC.to_le_bytes());
    page[4..6].copy_from_slice(&PAGE_VERSION.to_le_bytes());
    page[8..16].copy_from_slice(&id.session.to_le_bytes());
    page[16..20].copy_from_slice(&id.layer.to_le_bytes());
    page[20..24].copy_from_slice(&id.block.to_le_bytes());
    page[24..32].copy_from_slice(&id.generation.to_le_bytes());
    page[32..36].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    page[HEADER_LEN..HEADER_LEN + payload.len()].copy_from_slice(payload);
    page[HEADER_LEN + payload.len()..].fill(0);
    let c = crc(page, payload.len());
    page[36..40].copy_from_slice(&c.to_le_bytes());
    c
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Reads the identity stored in a page header (unverified).
pub fn stored_id(page: &[u8]) -> PageId {
    PageId {
        session: u64_at(page, 8),
        layer: u32_at(page, 16),
        block: u32_at(page, 20),
        generation: u64_at(page, 24),
    }
}

/// Verifies magic, version, length, checksum and identity. Returns (payload_len, crc).
pub fn verify(page: &[u8], expected: PageId) -> Result<(usize, u32), CorruptReason> {
    let magic = u32_at(page, 0);
    if magic != PAGE_MAGIC {
        return Err(CorruptReason::BadMagic { found: magic });
    }
    let version = u16::from_le_bytes([page[4], page[5]]);
    if version != PAGE_VERSION {
        return Err(CorruptReason::BadVersion { found: version });
    }
    let len = u32_at(page, 32);
    let max = page.len() - HEADER_LEN;
    if len as usize > max {
        return Err(CorruptReason::BadLength { found: len, max });
    }
    let stored = u32_at(page, 36);
    let computed = crc(page, len as usize);
    if stored != computed {
        return Err(CorruptReason::Checksum { stored, computed });
    }
    // Identity after the checksum: a bit flip in the header is a checksum error, a
    // well-formed page of another block/generation is a misdirected or stale page.
    let found = stored_id(page);
    if found != expected {
        return Err(CorruptReason::WrongIdentity { expected, found });
    }
    Ok((len as usize, stored))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: PageId = PageId {
        session: 7,
        layer: 3,
        block: 11,
        generation: 2,
    };

    fn page() -> Vec<u8> {
        let mut p = vec![0u8; 4096];
        encode(&mut p, ID, &[0xAB; 1000]);
        p
    }

    #[test]
    fn roundtrip() {
        let p = page();
        let (len, _) = verify(&p, ID).unwrap();
        assert_eq!(len, 1000);
        assert_eq!(&p[HEADER_LEN..HEADER_LEN + len], &[0xAB; 1000][..]);
    }

    #[test]
    fn every_single_bit_flip_in_header_and_payload_is_caught() {
        let p = page();
        for bit in 0..(HEADER_LEN + 1000) * 8 {
            let mut q = p.clone();
            q[bit / 8] ^= 1 << (bit % 8);
            assert!(verify(&q, ID).is_err(), "bit {bit} undetected");
        }
    }

    #[test]
    fn bad_cases_are_typed() {
        let p = page();
        let other = PageId {
            generation: 3,
            ..ID
        };
        assert!(matches!(
            verify(&p, other),
            Err(CorruptReason::WrongIdentity { .. })
        ));
        let zero = vec![0u8; 4096];
        assert!(matches!(
            verify(&zero, ID),
            Err(CorruptReason::BadMagic { found: 0 })
        ));
        let mut q = p.clone();
        q[4] = 9;
        assert!(matches!(
            verify(&q, ID),
            Err(CorruptReason::BadVersion { found: 9 })
        ));
        let mut q = p.clone();
        q[32..36].copy_from_slice(&5000u32.to_le_bytes());
        assert!(matches!(
            verify(&q, ID),
            Err(CorruptReason::BadLength { found: 5000, .. })
        ));
    }
}
