//! The device-resident call, for an engine: q, the output and its log-sum-exp are the engine's
//! device buffers, and a layer is enqueued behind the engine's own stream with no host
//! synchronization, so an engine can interleave kvtier's layers with its own kernels.
//!
//! The batch is bound once ([`CudaBackend::bind_batch`]: slots and every layer's token counts
//! uploaded, statistics zeroed) and stays bound until a session changes (tokens, maps,
//! summaries, slots) or a host-slice call runs; each layer is then only launches, two event
//! hand-offs and two small memsets ([`CudaBackend::enqueue_layer_device`]), all of which a
//! CUDA graph can capture: an engine may capture its whole step and replay it while the batch
//! stays bound (the memsets reset what a replay would find stale, `LayerStart::Replayable`).

use cudarc::driver::sys;

use super::step::{LayerIo, LayerStart};
use super::{CudaBackend, LayerStats};
use crate::cuda::error::{CudaError, Result};

/// The batch later device calls run: its slots and, per layer, the fewest and most blocks of
/// any of its sessions.
pub(super) struct BoundBatch {
    slots: Vec<u32>,
    blocks: Vec<(u32, u32)>,
}

/// Device addresses of one layer call's buffers in the backend's context (an engine's tensors):
/// `q` and `out` are `[batch][Hq x D]` f32, `lse` `[batch][Hq]` f32 (the log-sum-exp of each
/// output's scaled scores, natural log) or 0 for none; `tail`, tokens the engine holds itself,
/// attended in the same call (or none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceIo {
    pub q: u64,
    pub out: u64,
    pub lse: u64,
    pub tail: DeviceTail,
}

/// Tokens an engine holds in device memory after each session's stored ones (those it decoded
/// since it last handed them to tierd), attended with the stored tokens' keep-set in the same
/// call: the output is attention over both, merged by log-sum-exp in the layer's last kernel,
/// so the engine launches nothing of its own for them. `kv`: per batch item `[kv_heads][K,
/// V][block_tokens][head_dim]` in the sessions' dtype (a block run's layout), item after item,
/// 16-byte aligned; `last`: `[batch]` i64, each item's newest row (rows `0..=last` are
/// attended, at most a block; negative: none). Both 0 (the default): no tail.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceTail {
    pub kv: u64,
    pub last: u64,
}

impl CudaBackend {
    /// Binds `slots` (in this order) for [`Self::enqueue_layer_device`]: checks every layer of
    /// every session (open, tokens, every block ready), uploads the slots and token counts and
    /// zeroes the statistics. Enqueued behind earlier work of the backend's stream.
    pub fn bind_batch(&mut self, slots: &[u32]) -> Result<()> {
        self.bound = None;
        let layers = self.cfg.geometry.layers as usize;
        let mut ntok = Vec::with_capacity(layers * slots.len());
        let mut blocks = Vec::with_capacity(layers);
        for l in 0..layers {
            let n = self.check_batch(l, slots)?;
            blocks.push(self.blocks_of(&n));
            ntok.extend_from_slice(&n);
        }
        self.htod(self.sess.ptr, slots)?;
        self.htod(self.ntok.ptr, &ntok)?;
        self.memset_u32(self.stats.ptr, 0, self.stats.len * 2)?;
        self.batch_of.fill(slots.len());
        self.bound = Some(BoundBatch {
            slots: slots.to_vec(),
            blocks,
        });
        Ok(())
    }

    /// Enqueues `layer` for the bound batch: the backend's stream waits for the work `caller`
    /// has enqueued so far, runs select, gather, attention and merge, and `caller` waits for
    /// that before anything it enqueues next. Returns at once (no host synchronization).
    ///
    /// # Safety
    /// `io`'s addresses must be device memory of this backend's context (the device's primary
    /// context), `q` (and the tail unless 0) readable and `out` (and `lse` unless 0) writable
    /// for the bound batch's sizes, and stay allocated until `caller` has passed this work. `caller` must be a live
    /// stream of that context (0 is the legacy default stream).
    pub unsafe fn enqueue_layer_device(
        &mut self,
        layer: u32,
        io: DeviceIo,
        caller: sys::CUstream,
    ) -> Result<()> {
        let l = self.check_layer(layer)?;
        let bound = self.bound.as_ref().ok_or(CudaError::NotBound)?;
        let (b, nb) = (bound.slots.len(), bound.blocks[l]);
        if io.q == 0 || io.out == 0 {
            return Err(CudaError::NullBuffer);
        }
        if (io.tail.kv == 0) != (io.tail.last == 0) {
            return Err(CudaError::BadTail(
                "needs both its rows and its last-row indices",
            ));
        }
        if !io.tail.kv.is_multiple_of(16) || !io.tail.last.is_multiple_of(8) {
            return Err(CudaError::BadTail(
                "its rows must be 16-byte aligned and its indices 8-byte aligned",
            ));
        }
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // Raw handles (the events live as long as the backend): run_layer borrows it mutably.
        let (inbound, outbound) = (self.handoff[0].cu_event(), self.handoff[1].cu_event());
        // SAFETY: the events are this backend's, `caller` is a live stream of its context (the
        // caller's contract) and `self.stream` is the backend's own.
        unsafe {
            sys::cuEventRecord(inbound, caller)
                .result()
                .map_err(CudaError::driver("cuEventRecord"))?;
            sys::cuStreamWaitEvent(self.stream.cu_stream(), inbound, 0)
                .result()
                .map_err(CudaError::driver("cuStreamWaitEvent"))?;
        }
        let io = LayerIo {
            sess: self.sess.ptr,
            q: io.q,
            ntok: self.ntok.at(l * b),
            out: io.out,
            lse: io.lse,
            tail: io.tail,
        };
        // Not chained: the stream's previous operation is the event wait, not this call's
        // last kernel, so no dependent launch across it. Replayable: an engine may capture
        // its step, this layer included, in a CUDA graph.
        self.run_layer(l, io, b, nb, LayerStart::Replayable)?;
        // SAFETY: as above.
        unsafe {
            sys::cuEventRecord(outbound, self.stream.cu_stream())
                .result()
                .map_err(CudaError::driver("cuEventRecord"))?;
            sys::cuStreamWaitEvent(caller, outbound, 0)
                .result()
                .map_err(CudaError::driver("cuStreamWaitEvent"))?;
        }
        Ok(())
    }

    /// Waits on the host until `caller` has run everything enqueued on it so far.
    ///
    /// # Safety
    /// `caller` is a live stream of the backend's context (0 is the legacy default stream).
    pub unsafe fn synchronize_caller(&self, caller: sys::CUstream) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: the caller's contract.
        unsafe { sys::cuStreamSynchronize(caller) }
            .result()
            .map_err(CudaError::driver("cuStreamSynchronize"))
    }

    /// Statistics of every device call since [`Self::bind_batch`], per layer (summed over
    /// calls). Waits for the backend's work; the block-cache hit shares that
    /// [`LaunchMode::Auto`](super::LaunchMode::Auto) reads are updated from them.
    pub fn bound_stats(&mut self) -> Result<Vec<LayerStats>> {
        let stats = self.read_stats()?;
        for (share, st) in self.hit_share.iter_mut().zip(&stats) {
            if st.tiles > 0 {
                *share = st.hits as f32 / st.tiles as f32;
            }
        }
        Ok(stats)
    }
}
