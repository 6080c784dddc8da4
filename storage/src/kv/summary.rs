//! A block's summary as bytes: everything selection reads of a block (its key bounds and, for
//! a session that keeps them, its key sketches), so that a node can select over a session
//! whose runs it has not read yet and fetch only the keep-set (a resume from the remote tier).
//!
//! Layout, little-endian: the block's bounds (`[kv_head][max|min][D]` f32), then, with
//! sketches, its key codes (`[kv_head][B][code bytes]`), channel scales (`[kv_head][D]` f32) and
//! quarter bounds (`[kv_head][quarter][max|min][D]` bf16 bits). Quarter codes are not stored:
//! they are a function of the quarter bounds, recomputed on restore.

use super::{KvCache, Slot};
use crate::error::{Result, StorageError};
use crate::geometry::Geometry;
use crate::sketch::{code_bytes, quarters};

/// Bytes of one block's summary for `geo`, with or without sketches.
pub fn summary_bytes(geo: &Geometry, sketches: bool) -> usize {
    let (hkv, bt, d) = (
        geo.kv_heads as usize,
        geo.block_tokens as usize,
        geo.head_dim as usize,
    );
    let bounds = 4 * geo.summary_floats_per_block();
    let sketch = hkv * bt * code_bytes(d) + 4 * hkv * d + 2 * hkv * quarters(bt) * 2 * d;
    bounds + if sketches { sketch } else { 0 }
}

impl KvCache {
    /// The summary of `(layer, block)` as bytes (module docs); resident or cold alike.
    pub fn block_summary(&self, layer: u32, block: u32) -> Result<Vec<u8>> {
        let geo = self.geo;
        let l = self.layer_kv(layer)?;
        let b = block as usize;
        if b >= l.slots.len() {
            return Err(StorageError::BlockOutOfRange {
                layer,
                block,
                blocks: l.slots.len(),
            });
        }
        let spb = geo.summary_floats_per_block();
        let mut out = Vec::with_capacity(summary_bytes(&geo, l.sketches.is_some()));
        for x in &l.summaries[b * spb..(b + 1) * spb] {
            out.extend_from_slice(&x.to_le_bytes());
        }
        if let Some(sk) = &l.sketches {
            let s = sk.range(&geo, b..b + 1);
            out.extend_from_slice(s.codes);
            for x in s.channel_scales {
                out.extend_from_slice(&x.to_le_bytes());
            }
            for x in s.quarters {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Ok(out)
    }

    /// Appends a block to `layer` cold, from its summary bytes ([`KvCache::block_summary`]
    /// of the session it was taken from) and its count of valid tokens: selection over it is
    /// bit-identical to the session's, and its run is read from a colder tier when a step
    /// keeps it. The layer's length must be a multiple of the block size, as for
    /// [`KvCache::restore_block`].
    pub fn restore_summary(&mut self, layer: u32, summary: &[u8], valid: usize) -> Result<()> {
        let geo = self.geo;
        self.check_block_start(layer, valid)?;
        let want = summary_bytes(&geo, self.has_sketches());
        if summary.len() != want {
            return Err(StorageError::PayloadSize {
                what: "block summary",
                expected: want,
                got: summary.len(),
            });
        }
        let spb = geo.summary_floats_per_block();
        let (bounds, rest) = summary.split_at(4 * spb);
        let l = &mut self.layers[layer as usize];
        l.summaries.extend(
            bounds
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))),
        );
        if let Some(sk) = &mut l.sketches {
            let block = sk.blocks(&geo);
            sk.open_block(&geo);
            let mut s = sk.blocks_mut(&geo, block).next().expect("opened above");
            let (codes, rest) = rest.split_at(s.codes.len());
            let (scales, quarter_bounds) = rest.split_at(4 * s.channel_scales.len());
            s.codes.copy_from_slice(codes);
            for (o, c) in s.channel_scales.iter_mut().zip(scales.chunks_exact(4)) {
                *o = f32::from_le_bytes(c.try_into().expect("4 bytes"));
            }
            for (o, c) in s.quarters.iter_mut().zip(quarter_bounds.chunks_exact(2)) {
                *o = u16::from_le_bytes([c[0], c[1]]);
            }
            s.quantize(&geo);
        }
        l.slots.push(Slot::Cold);
        l.tokens += valid as u64;
        Ok(())
    }
}
