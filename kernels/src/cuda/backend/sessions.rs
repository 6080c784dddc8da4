//! Session slots and what the device holds of each: block summaries (in the device's order),
//! page-table entries into the host region, token counts.

use super::{CudaBackend, Session};
use crate::cuda::bf16_outward;
use crate::cuda::error::{CudaError, Result};
use kvtier_storage::sketch::{padded_dims, BlockSketchesRef};

/// The device order of one (block, kv head) summary record (select.cu, "Device summary
/// layout"): entry e is the index into the CPU's [max; D] ++ [min; D] record. Thread j of a
/// scoring octet owns the CPU's SIMD lane j (dims j + 8s); its (max, min) pairs for increasing
/// s fill 16-byte vectors of `p` pairs, and its vector u is the record's vector u * 8 + j.
pub(super) fn summary_order(d: usize, bf16: bool) -> Vec<usize> {
    let p = if bf16 { 4 } else { 2 };
    let mut order = vec![0; 2 * d];
    for dim in 0..d {
        let (j, s) = (dim % 8, dim / 8);
        let (u, w) = (s / p, s % p);
        let at = (u * 8 + j) * 2 * p + 2 * w;
        order[at] = dim;
        order[at + 1] = d + dim;
    }
    order
}

/// CPU summary records (each [max; D] ++ [min; D]) in the device order `order`
/// ([`summary_order`]), each value passed through `conv` with its CPU index in the record.
pub(super) fn device_records<T: Copy + Default>(
    summaries: &[f32],
    order: &[usize],
    conv: impl Fn(f32, usize) -> T,
) -> Vec<T> {
    let mut dev = vec![T::default(); summaries.len()];
    for (dst, src) in dev
        .chunks_exact_mut(order.len())
        .zip(summaries.chunks_exact(order.len()))
    {
        for (x, &o) in dst.iter_mut().zip(order) {
            *x = conv(src[o], o);
        }
    }
    dev
}

impl CudaBackend {
    pub(super) fn check_slot(&self, slot: u32) -> Result<usize> {
        if slot >= self.cfg.max_sessions {
            return Err(CudaError::SlotOutOfRange {
                slot,
                max: self.cfg.max_sessions,
            });
        }
        Ok(slot as usize)
    }

    pub(super) fn check_layer(&self, layer: u32) -> Result<usize> {
        if layer >= self.cfg.geometry.layers {
            return Err(CudaError::LayerOutOfRange {
                layer,
                layers: self.cfg.geometry.layers,
            });
        }
        Ok(layer as usize)
    }

    /// A session to change: the bound batch (if any) no longer describes it.
    fn session_mut(&mut self, slot: u32) -> Result<&mut Session> {
        self.bound = None;
        let s = self.check_slot(slot)?;
        self.sessions[s]
            .as_mut()
            .ok_or(CudaError::SessionNotOpen { slot })
    }

    /// Opens a session slot: no tokens, nothing mapped, its cache entries cleared.
    pub fn open_session(&mut self, slot: u32) -> Result<()> {
        let s = self.check_slot(slot)?;
        if self.sessions[s].is_some() {
            return Err(CudaError::SessionAlreadyOpen { slot });
        }
        self.bound = None;
        let l = self.cfg.geometry.layers as usize;
        let per = self.cfg.geometry.kv_heads as usize * self.cfg.cache_slots as usize;
        let (start, len) = (s * l * per, l * per);
        self.memset_u32(self.tags.at(start), 0, len)?;
        self.sessions[s] = Some(Session {
            n_tokens: vec![0; l],
            flags: vec![vec![0; self.cfg.max_blocks as usize]; l],
            ready: vec![0; l],
        });
        Ok(())
    }

    /// Closes a session slot; its device state is reused by the next open.
    pub fn close_session(&mut self, slot: u32) -> Result<()> {
        let s = self.check_slot(slot)?;
        self.bound = None;
        if self.sessions[s].take().is_none() {
            return Err(CudaError::SessionNotOpen { slot });
        }
        Ok(())
    }

    /// Empties the GPU block cache of every session (the next call runs cold).
    pub fn flush_cache(&mut self) -> Result<()> {
        let n = self.tags.slice.len();
        self.memset_u32(self.tags.ptr, 0, n)?;
        // Nothing will hit: LaunchMode::Auto fuses the next call of every layer.
        self.hit_share.fill(0.0);
        Ok(())
    }

    fn block_range(&self, first: u32, count: usize) -> Result<()> {
        let max = self.cfg.max_blocks;
        if count == 0 || first as u64 + count as u64 > max as u64 {
            return Err(CudaError::BlockOutOfRange {
                first,
                count: count as u32,
                max,
            });
        }
        Ok(())
    }

    /// Records that blocks `first..first + n` of a session layer have their summaries (bit
    /// value 1) or their host runs (bit value 2), and moves the layer's ready prefix past
    /// every block that has both.
    fn mark_uploaded(&mut self, slot: u32, l: usize, first: u32, n: usize, bit: u8) -> Result<()> {
        let sess = self.session_mut(slot)?;
        for f in &mut sess.flags[l][first as usize..first as usize + n] {
            *f |= bit;
        }
        let f = &sess.flags[l];
        let mut r = sess.ready[l] as usize;
        while r < f.len() && f[r] == 3 {
            r += 1;
        }
        sess.ready[l] = r as u32;
        Ok(())
    }

    /// Uploads the sketch selector's data for blocks `first_block..first_block + n` of one
    /// session layer (`sketches` holds n blocks, kvtier_storage::sketch's host layout): each
    /// (block, kv head)'s quarter codes and their scale, its keys' codes and channel scales.
    /// Re-uploading a block (the tail block after appends) replaces it. Only for a backend
    /// whose policy ranks by sketches ([`CudaConfig::sketch`]).
    pub fn upload_sketches(
        &mut self,
        slot: u32,
        layer: u32,
        first_block: u32,
        sketches: &BlockSketchesRef<'_>,
    ) -> Result<()> {
        let s = self.check_slot(slot)?;
        let l = self.check_layer(layer)?;
        if !self.cfg.sketch() {
            return Err(CudaError::InvalidConfig {
                reason: "key sketches are for the sketch selector; this backend takes summaries"
                    .into(),
            });
        }
        let g = self.cfg.geometry;
        let (hkv, bt, d) = (
            g.kv_heads as usize,
            g.block_tokens as usize,
            g.head_dim as usize,
        );
        let n = sketches.quarter_scales.len() / hkv;
        let cb = padded_dims(d) / 2;
        for (what, got, expected) in [
            ("quarter scales", sketches.quarter_scales.len(), n * hkv),
            (
                "quarter codes",
                sketches.quarter_codes.len(),
                n * hkv * self.cfg.summary_records() as usize * 2 * d,
            ),
            ("codes", sketches.codes.len(), n * hkv * bt * cb),
            ("channel scales", sketches.channel_scales.len(), n * hkv * d),
        ] {
            if n == 0 || got != expected {
                return Err(CudaError::BadLength {
                    what,
                    got,
                    expected: expected.max(1),
                });
            }
        }
        self.block_range(first_block, n)?;
        let non_finite = |what, v: &[f32]| {
            v.iter()
                .position(|x| !x.is_finite())
                .map_or(Ok(()), |index| Err(CudaError::NonFinite { what, index }))
        };
        non_finite("channel scales", sketches.channel_scales)?;
        non_finite("quarter scales", sketches.quarter_scales)?;
        self.session_mut(slot)?;
        let mb = self.cfg.max_blocks as usize;
        let rec0 = ((s * g.layers as usize + l) * mb + first_block as usize) * hkv;
        // Quarter codes as they are (maxima then minima per quarter) and their scales.
        let codes: Vec<u8> = sketches.quarter_codes.iter().map(|&c| c as u8).collect();
        self.htod(self.sums.at(rec0 * self.cfg.summary_record_bytes()), &codes)?;
        self.htod(self.qscales.at(rec0), sketches.quarter_scales)?;
        // Sketch records: each (block, kv head)'s codes, then its channel scales.
        let rb = self.cfg.sketch_record_bytes();
        let mut recs = vec![0u8; n * hkv * rb];
        for (r, rec) in recs.chunks_exact_mut(rb).enumerate() {
            let (c, sc) = rec.split_at_mut(bt * cb);
            c.copy_from_slice(&sketches.codes[r * bt * cb..(r + 1) * bt * cb]);
            for (o, x) in sc
                .chunks_exact_mut(4)
                .zip(&sketches.channel_scales[r * d..(r + 1) * d])
            {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        self.htod(self.sketches.at(rec0 * rb), &recs)?;
        self.mark_uploaded(slot, l, first_block, n, 1)
    }

    /// Uploads block summaries [n][kv_head][2][D] f32 (index 0 = max, 1 = min) for blocks
    /// `first_block..first_block + n` of one session layer. Re-uploading a block (the tail
    /// block after appends) replaces it. Not for a backend of the sketch selector, which takes
    /// [`Self::upload_sketches`].
    pub fn upload_summaries(
        &mut self,
        slot: u32,
        layer: u32,
        first_block: u32,
        summaries: &[f32],
    ) -> Result<()> {
        let s = self.check_slot(slot)?;
        let l = self.check_layer(layer)?;
        let per = self.cfg.geometry.summary_floats_per_block();
        if summaries.is_empty() || !summaries.len().is_multiple_of(per) {
            return Err(CudaError::BadLength {
                what: "summaries",
                got: summaries.len(),
                expected: per * (summaries.len() / per).max(1),
            });
        }
        let n = summaries.len() / per;
        self.block_range(first_block, n)?;
        if self.cfg.sketch() {
            return Err(CudaError::InvalidConfig {
                reason: "the sketch selector's device takes key sketches (upload_sketches), not summaries".into(),
            });
        }
        if let Some(index) = summaries.iter().position(|x| !x.is_finite()) {
            return Err(CudaError::NonFinite {
                what: "summaries",
                index,
            });
        }
        self.session_mut(slot)?;
        let mb = self.cfg.max_blocks as usize;
        let elem0 = ((s * self.cfg.geometry.layers as usize + l) * mb + first_block as usize) * per;
        if self.cfg.summaries_bf16() {
            // Outward rounding: exact for the bounds of bf16 keys (see summaries_bf16).
            let half = self.sum_order.len() / 2;
            let dev = device_records(summaries, &self.sum_order, |x, o| bf16_outward(x, o < half));
            self.htod(self.sums.at(elem0 * 2), &dev)?;
        } else {
            let dev = device_records(summaries, &self.sum_order, |x, _| x);
            self.htod(self.sums.at(elem0 * 4), &dev)?;
        }
        self.mark_uploaded(slot, l, first_block, n, 1)
    }

    /// Points blocks `first_block..` of one session layer at block runs in the attached host
    /// region, given as byte offsets into it. Each run must lie inside the region.
    pub fn map_blocks(
        &mut self,
        slot: u32,
        layer: u32,
        first_block: u32,
        host_offsets: &[u64],
    ) -> Result<()> {
        let s = self.check_slot(slot)?;
        let l = self.check_layer(layer)?;
        self.block_range(first_block, host_offsets.len())?;
        self.session_mut(slot)?;
        let host = self.host.as_ref().ok_or(CudaError::NoHostRegion)?;
        let run = self.cfg.geometry.block_bytes() as u64;
        let addrs = host_offsets
            .iter()
            .map(|&o| host.device_addr(o, run))
            .collect::<Result<Vec<u64>>>()?;
        let mb = self.cfg.max_blocks as usize;
        let idx = (s * self.cfg.geometry.layers as usize + l) * mb + first_block as usize;
        self.htod(self.pages.at(idx), &addrs)?;
        self.mark_uploaded(slot, l, first_block, addrs.len(), 2)
    }

    /// Sets a session layer's token count. Positions are append-only: it may only grow.
    pub fn set_tokens(&mut self, slot: u32, layer: u32, n_tokens: u32) -> Result<()> {
        let l = self.check_layer(layer)?;
        let capacity = self.cfg.max_blocks as u64 * self.cfg.geometry.block_tokens as u64;
        let sess = self.session_mut(slot)?;
        let current = sess.n_tokens[l];
        if n_tokens < current || n_tokens as u64 > capacity {
            return Err(CudaError::BadTokenCount {
                slot,
                layer,
                current,
                new: n_tokens,
                capacity,
            });
        }
        sess.n_tokens[l] = n_tokens;
        Ok(())
    }

    /// Token count of a session layer.
    pub fn tokens(&self, slot: u32, layer: u32) -> Result<u32> {
        let s = self.check_slot(slot)?;
        let l = self.check_layer(layer)?;
        let sess = self.sessions[s]
            .as_ref()
            .ok_or(CudaError::SessionNotOpen { slot })?;
        Ok(sess.n_tokens[l])
    }
}
