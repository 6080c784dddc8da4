//! One call: the batch checked and uploaded, each layer's kernels enqueued (fused, or split
//! over two streams), then outputs, statistics and timings read back.

use cudarc::driver::CudaEvent;

use super::device::DeviceTail;
use super::{
    CudaBackend, DecodeItem, LayerInput, LayerOutput, LayerStats, LayerTiming, StepItem, StepOutput,
};
use crate::cuda::error::{CudaError, Result};

/// What precedes a layer's first launch on the main stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum LayerStart {
    /// This call's previous layer (its merge): dependent launch may overlap it.
    Chained,
    /// Other work (a call's first layer).
    Fresh,
    /// Other work, and the layer may be captured in a CUDA graph and replayed (a device
    /// call): its fused launch resets the state a replay would find stale (see
    /// `enqueue_layer`).
    Replayable,
}

/// Device addresses of one layer call's buffers: the batch's slots, q and out `[batch][Hq x D]`
/// f32, the batch's token counts at the layer, lse `[batch][Hq]` f32 or 0, and an engine's
/// tail (none: zeros).
#[derive(Clone, Copy, Debug)]
pub(super) struct LayerIo {
    pub sess: u64,
    pub q: u64,
    pub ntok: u64,
    pub out: u64,
    pub lse: u64,
    pub tail: DeviceTail,
}

impl CudaBackend {
    /// Validates a batch for `layer`; returns its token counts.
    pub(super) fn check_batch(&self, layer: usize, slots: &[u32]) -> Result<Vec<u32>> {
        if slots.is_empty() {
            return Err(CudaError::EmptyBatch);
        }
        if slots.len() > self.cfg.max_batch as usize {
            return Err(CudaError::BatchTooLarge {
                got: slots.len(),
                max: self.cfg.max_batch,
            });
        }
        let bt = self.cfg.geometry.block_tokens;
        let mut seen = vec![false; self.cfg.max_sessions as usize];
        let mut ntok = Vec::with_capacity(slots.len());
        for &slot in slots {
            let s = self.check_slot(slot)?;
            if std::mem::replace(&mut seen[s], true) {
                return Err(CudaError::DuplicateSession { slot });
            }
            let sess = self.sessions[s]
                .as_ref()
                .ok_or(CudaError::SessionNotOpen { slot })?;
            let n = sess.n_tokens[layer];
            if n == 0 {
                return Err(CudaError::EmptySession {
                    slot,
                    layer: layer as u32,
                });
            }
            sess.blocks_ready(slot, layer, bt)?;
            ntok.push(n);
        }
        Ok(ntok)
    }

    fn check_q(&self, q: &[f32], expected: usize) -> Result<()> {
        if q.len() != expected {
            return Err(CudaError::BadLength {
                what: "q",
                got: q.len(),
                expected,
            });
        }
        if let Some(index) = q.iter().position(|x| !x.is_finite()) {
            return Err(CudaError::NonFinite { what: "q", index });
        }
        Ok(())
    }

    /// Runs select -> gather -> attend for one layer and a batch of sessions.
    pub fn decode_layer(&mut self, layer: u32, items: &[DecodeItem<'_>]) -> Result<LayerOutput> {
        Ok(self.decode_layers(&[(layer, items)])?.remove(0))
    }

    /// Runs several layers at once, each for its own batch (`(layer, items)`, the layers
    /// distinct): what a daemon's coalesced step holds when its clients are at different
    /// layers. One upload, the layers enqueued back to back, one synchronization; per group
    /// its [`LayerOutput`].
    pub fn decode_layers(
        &mut self,
        groups: &[(u32, &[DecodeItem<'_>])],
    ) -> Result<Vec<LayerOutput>> {
        if groups.is_empty() {
            return Err(CudaError::EmptyBatch);
        }
        let hqd = (self.cfg.geometry.q_heads * self.cfg.geometry.head_dim) as usize;
        let mut seen = vec![false; self.cfg.geometry.layers as usize];
        let mut inputs = Vec::with_capacity(groups.len());
        for &(layer, items) in groups {
            let l = self.check_layer(layer)?;
            if std::mem::replace(&mut seen[l], true) {
                return Err(CudaError::DuplicateLayer { layer });
            }
            let slots: Vec<u32> = items.iter().map(|it| it.slot).collect();
            let ntok = self.check_batch(l, &slots)?;
            for it in items {
                self.check_q(it.q, hqd)?;
            }
            let q = items.iter().flat_map(|it| it.q.iter().copied()).collect();
            inputs.push(LayerInput {
                layer: l,
                slots,
                ntok,
                q,
            });
        }
        let mut all = self.run_inputs(&inputs)?;
        let hqd = (self.cfg.geometry.q_heads * self.cfg.geometry.head_dim) as usize;
        let mut rows = all.out.chunks_exact(hqd);
        Ok(inputs
            .iter()
            .enumerate()
            .map(|(gi, input)| LayerOutput {
                out: rows
                    .by_ref()
                    .take(input.slots.len())
                    .flatten()
                    .copied()
                    .collect(),
                stats: all.stats[gi],
                timing: all.timing.as_mut().map(|t| t[gi]),
            })
            .collect())
    }

    /// Runs all layers (in order) for a batch of sessions with one synchronization at the end.
    pub fn decode_step(&mut self, items: &[StepItem<'_>]) -> Result<StepOutput> {
        let layers = self.cfg.geometry.layers as usize;
        let b = items.len();
        let per_layer = self.step_inputs(items)?;
        let mut out = self.run_inputs(&per_layer)?;
        out.out = by_batch(
            &out.out,
            layers,
            b,
            (self.cfg.geometry.q_heads * self.cfg.geometry.head_dim) as usize,
        );
        Ok(out)
    }

    /// Uploads checked layer inputs, enqueues them in order (each chained after the previous
    /// one's merge on the main stream), waits, and reads the outputs in the call's order
    /// ([input][batch][Hq x D]), statistics and timings.
    fn run_inputs(&mut self, inputs: &[LayerInput]) -> Result<StepOutput> {
        self.prepare(inputs)?;
        self.record_step(0)?;
        let mut at = 0;
        for (i, input) in inputs.iter().enumerate() {
            let (b, nb) = (input.slots.len(), self.blocks_of(&input.ntok));
            let start = if i > 0 {
                LayerStart::Chained
            } else {
                LayerStart::Fresh
            };
            self.run_layer(input.layer, self.host_io(at), b, nb, start)?;
            at += b;
        }
        self.record_step(1)?;
        let layers: Vec<usize> = inputs.iter().map(|i| i.layer).collect();
        self.finish(&layers, at)
    }

    /// Checks a step's batch and queries and splits them by layer: per layer, its index, the
    /// batch's slots, token counts and queries ([batch][Hq x D]), as [`Self::prepare`] takes
    /// them.
    pub(super) fn step_inputs(&self, items: &[StepItem<'_>]) -> Result<Vec<LayerInput>> {
        let layers = self.cfg.geometry.layers as usize;
        let hqd = (self.cfg.geometry.q_heads * self.cfg.geometry.head_dim) as usize;
        let slots: Vec<u32> = items.iter().map(|it| it.slot).collect();
        for it in items {
            self.check_q(it.q, layers * hqd)?;
        }
        (0..layers)
            .map(|l| {
                let ntok = self.check_batch(l, &slots)?;
                let q: Vec<f32> = items
                    .iter()
                    .flat_map(|it| it.q[l * hqd..(l + 1) * hqd].iter().copied())
                    .collect();
                Ok(LayerInput {
                    layer: l,
                    slots: slots.clone(),
                    ntok,
                    q,
                })
            })
            .collect()
    }

    /// Fewest and most blocks of the batch sessions.
    pub(super) fn blocks_of(&self, ntok: &[u32]) -> (u32, u32) {
        let bt = self.cfg.geometry.block_tokens;
        let nb = ntok.iter().map(|n| n.div_ceil(bt));
        (nb.clone().min().unwrap_or(1), nb.max().unwrap_or(1))
    }

    /// The buffers of a host-slice call's layer whose batch starts at entry `at` of the call
    /// (the dense per-call layout [`Self::prepare`] uploads).
    fn host_io(&self, at: usize) -> LayerIo {
        let hqd = (self.cfg.geometry.q_heads * self.cfg.geometry.head_dim) as usize;
        LayerIo {
            sess: self.sess.at(at),
            q: self.q.at(at * hqd),
            ntok: self.ntok.at(at),
            out: self.out.at(at * hqd),
            lse: 0,
            tail: DeviceTail::default(),
        }
    }

    /// Uploads the call's layers (each its batch's slots, token counts and queries) and zeroes
    /// the statistics (unbinding any bound batch: the same buffers).
    pub(super) fn prepare(&mut self, layers: &[LayerInput]) -> Result<()> {
        self.bound = None;
        let g = &self.cfg.geometry;
        let hqd = (g.q_heads * g.head_dim) as usize;
        let bmax = self.cfg.max_batch as usize;
        let total: usize = layers.iter().map(|i| i.slots.len()).sum();
        debug_assert!(total <= self.cfg.geometry.layers as usize * bmax);
        // Dense per-call layout [call layer][batch][..], staged for one upload (each is a
        // driver call and a staging of pageable memory): the slot and count regions whole,
        // then as many queries as the call has.
        let word = |ptr: u64| ((ptr - self.inputs.ptr) / 4) as usize;
        let (n0, q0) = (word(self.ntok.ptr), word(self.q.ptr));
        let mut words = vec![0u32; q0 + total * hqd];
        let mut at = 0;
        for input in layers {
            let b = input.slots.len();
            debug_assert!(b <= bmax && input.q.len() == b * hqd && input.ntok.len() == b);
            words[at..at + b].copy_from_slice(&input.slots);
            words[n0 + at..n0 + at + b].copy_from_slice(&input.ntok);
            let q = &mut words[q0 + at * hqd..q0 + (at + b) * hqd];
            for (w, x) in q.iter_mut().zip(&input.q) {
                *w = x.to_bits();
            }
            self.batch_of[input.layer] = b;
            at += b;
        }
        self.htod(self.inputs.ptr, &words)?;
        self.memset_u32(self.stats.ptr, 0, self.stats.len * 2)?;
        if self.poison {
            let nan = 0x7fc0_0000;
            self.memset_u32(self.out.ptr, nan, self.out.len)?;
            self.memset_u32(self.part_acc.ptr, nan, self.part_acc.slice.len())?;
            self.memset_u32(self.part_ml.ptr, nan, self.part_ml.slice.len())?;
            self.memset_u32(self.table.ptr, u32::MAX, self.table.slice.len())?;
        }
        Ok(())
    }

    /// Enqueues one layer: in parallel, the fixed part of the keep-set (sink and local window:
    /// known before any scoring; planned, fetched and attended) on the side stream and the
    /// selector (scoring, top-k and the distant plan: one launch for top_k <= 32) on the main
    /// one; then the distant tiles and, once both are done, the merge.
    /// `l`: model layer; `io`: its buffers; `nb`: fewest and most blocks of any batch session
    /// at layer `l`; `start`: what the main stream's previous operation is.
    pub(super) fn run_layer(
        &mut self,
        l: usize,
        io: LayerIo,
        b: usize,
        nb: (u32, u32),
        start: LayerStart,
    ) -> Result<()> {
        // Never 0: layer_fused's ready flags start at 0 and must not match a fresh layer.
        self.stamp = self.stamp.wrapping_add(1).max(1);
        self.fused[l] = self.fuse_layer(l);
        match self.enqueue_layer(l, io, b, nb, start) {
            Ok(tickets) => {
                self.tickets_issued = self.tickets_issued.wrapping_add(tickets);
                Ok(())
            }
            Err(e) => {
                // Something was refused mid-layer: drain both streams so that no later use of
                // the shared scratch races tiles still in flight, and restart the ticket count
                // (a launch may or may not have taken its tickets).
                let _ = self.side.synchronize();
                let _ = self.stream.synchronize();
                if self.memset_u32(self.tickets.ptr, 0, 1).is_ok() {
                    self.tickets_issued = 0;
                }
                Err(e)
            }
        }
    }

    /// Attention's softmax scale, 1 / sqrt(head_dim), for every kernel that scores.
    pub(super) fn softmax_scale(&self) -> f32 {
        (1.0 / (self.cfg.geometry.head_dim as f64).sqrt()) as f32
    }

    /// Waits for the enqueued layers and reads outputs (`rows` of them, in the call's order:
    /// [call layer][batch][Hq x D]), statistics and timings.
    pub(super) fn finish(&mut self, layers: &[usize], rows: usize) -> Result<StepOutput> {
        let g = self.cfg.geometry;
        let hqd = (g.q_heads * g.head_dim) as usize;
        let nl = layers.len();
        // One readback (one synchronisation) for every layer's statistics and the call's
        // outputs, which follow them.
        let out0 = ((self.out.ptr - self.results.ptr) / 4) as usize;
        let mut words = vec![0u32; out0 + rows * hqd];
        self.dtoh(&mut words, self.results.ptr)?;
        // The counters are u64, read as pairs of little-endian u32 (the device's byte order and
        // that of every host this runs on).
        let raw: Vec<u64> = words[..self.stats.len * 2]
            .chunks_exact(2)
            .map(|w| u64::from(w[0]) | u64::from(w[1]) << 32)
            .collect();
        let all = layer_stats(&raw);
        let out: Vec<f32> = words[out0..].iter().map(|&w| f32::from_bits(w)).collect();
        let stats: Vec<LayerStats> = layers.iter().map(|&l| all[l]).collect();
        for (&l, st) in layers.iter().zip(&stats) {
            self.hit_share[l] = st.hits as f32 / st.tiles.max(1) as f32;
        }
        let ms = |a: &CudaEvent, z: &CudaEvent| {
            a.elapsed_ms(z)
                .map_err(CudaError::driver("cuEventElapsedTime"))
        };
        let (timing, step_ms) = match &self.timers {
            None => (None, None),
            Some(t) => {
                let timing = match &t.marks {
                    None => None,
                    Some(marks) => {
                        let mut v = Vec::with_capacity(nl);
                        for &l in layers {
                            let m = &marks[l];
                            let (sel, rest) = (ms(&m[0], &m[1])?, ms(&m[1], &m[2])?);
                            let split = !self.fused[l];
                            v.push(LayerTiming {
                                select_ms: split.then_some(sel),
                                fetch_attend_ms: split.then_some(rest),
                                layer_ms: ms(&m[0], &m[2])?,
                            });
                        }
                        Some(v)
                    }
                };
                (timing, Some(ms(&t.step[0], &t.step[1])?))
            }
        };
        Ok(StepOutput {
            out,
            stats,
            timing,
            step_ms,
        })
    }

    /// Every layer's statistics since they were last zeroed (the device's `[layer][hits,
    /// misses, bytes, tiles]` counters); waits for the backend's work.
    pub(super) fn read_stats(&self) -> Result<Vec<LayerStats>> {
        let mut raw = vec![0u64; self.stats.len];
        self.dtoh(&mut raw, self.stats.ptr)?;
        Ok(layer_stats(&raw))
    }

    /// Keep-sets of the last call at `layer`: [batch][kv_head] -> ascending block ids (that
    /// call's batch at `layer`).
    pub fn last_keep_sets(&self, layer: u32) -> Result<Vec<Vec<Vec<u32>>>> {
        let l = self.check_layer(layer)?;
        let g = self.cfg.geometry;
        let (bmax, hkv, ks) = (
            self.cfg.max_batch as usize,
            g.kv_heads as usize,
            self.derived.keep_max as usize,
        );
        let b = self.batch_of[l];
        let mut counts = vec![0u32; b * hkv];
        let mut table = vec![0u32; b * hkv * ks];
        if b == 0 {
            return Ok(Vec::new());
        }
        self.dtoh(&mut counts, self.counts.at(l * bmax * hkv))?;
        self.dtoh(&mut table, self.table.at(l * bmax * hkv * ks))?;
        Ok((0..b)
            .map(|i| {
                (0..hkv)
                    .map(|h| {
                        let ih = i * hkv + h;
                        table[ih * ks..ih * ks + counts[ih] as usize].to_vec()
                    })
                    .collect()
            })
            .collect())
    }
}

/// The device's `[layer][hits, misses, bytes, tiles]` counters, per layer.
fn layer_stats(raw: &[u64]) -> Vec<LayerStats> {
    raw.chunks_exact(4)
        .map(|r| LayerStats {
            hits: r[0],
            misses: r[1],
            bytes_moved: r[2],
            tiles: r[3],
        })
        .collect()
}

/// A call's outputs `[layer][batch][hqd]` reordered as `[batch][layer][hqd]` (a step's order).
pub(super) fn by_batch(rows: &[f32], layers: usize, b: usize, hqd: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows.len()];
    for li in 0..layers {
        for i in 0..b {
            out[(i * layers + li) * hqd..(i * layers + li + 1) * hqd]
                .copy_from_slice(&rows[(li * b + i) * hqd..(li * b + i + 1) * hqd]);
        }
    }
    out
}
