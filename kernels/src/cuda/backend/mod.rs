//! The CUDA backend: device-side layer state and the select -> gather -> attend pipeline.
//!
//! # Files
//!
//! - `mod.rs`: the public types, the backend's state, device memory helpers.
//! - `setup.rs`: opening the device, allocating the state; settings (timing, launch mode,
//!   dependent launch) and the attached host region.
//! - `sessions.rs`: session slots, block summaries (in the device's order), page tables, token
//!   counts.
//! - `step.rs`: a call: checking the batch, uploading it (one copy), enqueueing each layer's
//!   kernels, reading back statistics and outputs (one copy, one synchronisation) and timings.
//! - `launch.rs`: kernel launches (plain or dependent), timing events, diagnostic globals.
//! - `dense.rs`: dense attention, the benchmark's baseline.

use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits,
};

use super::config::{CudaConfig, Derived};
use super::error::{CudaError, Result};
use super::module::Kernels;
use super::pinned::PinnedRegion;

mod dense;
pub use dense::{DenseKv, DeviceKv};
mod device;
mod enqueue;
pub use device::{DeviceIo, DeviceTail};
mod launch;
mod sessions;
mod setup;
mod step;
#[cfg(test)]
mod tests;

/// Is a CUDA driver with at least one device present? Never panics.
pub fn device_available() -> bool {
    device_count() > 0
}

/// CUDA devices present (0 without a driver). Never panics.
pub fn device_count() -> usize {
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

/// Retains device `ordinal`'s primary context, the one every backend on that device uses (so a
/// host region registered in it can be attached to any of them). Never panics.
pub fn device_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    let count =
        CudaContext::device_count().map_err(CudaError::driver("cuDeviceGetCount"))? as usize;
    if ordinal >= count {
        return Err(CudaError::NoDevice { ordinal, count });
    }
    CudaContext::new(ordinal).map_err(CudaError::driver("cuDevicePrimaryCtxRetain"))
}

/// layer_fused's ready flags per (batch item, kv head) (select.cu `READY_FLAGS`).
const READY_FLAGS: usize = 3;

/// One device buffer with its raw address cached for kernel arguments (event tracking off: the
/// backend orders every use itself, see [`CudaBackend`]'s streams).
struct DevBuf<T> {
    slice: CudaSlice<T>,
    ptr: u64,
}

impl<T: DeviceRepr + ValidAsZeroBits> DevBuf<T> {
    fn zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let slice = stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(CudaError::driver("cuMemAlloc"))?;
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(stream);
            ptr
        };
        Ok(DevBuf { slice, ptr })
    }

    fn at(&self, elem: usize) -> u64 {
        self.ptr + (elem * std::mem::size_of::<T>()) as u64
    }
}

/// A fixed part of one device allocation ([`CudaBackend`]'s call buffers share two, so that a
/// call uploads its inputs in one copy and reads its results back in one).
#[derive(Clone, Copy, Debug)]
struct DevView<T> {
    ptr: u64,
    /// Elements.
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T> DevView<T> {
    fn new(ptr: u64, len: usize) -> Self {
        DevView {
            ptr,
            len,
            _t: std::marker::PhantomData,
        }
    }

    fn at(&self, elem: usize) -> u64 {
        self.ptr + (elem * std::mem::size_of::<T>()) as u64
    }
}

/// Allocates one device buffer of `parts.len()` parts, each `parts[i]` bytes rounded up to 256
/// (every part aligned for any element type): the buffer and each part's byte offset.
fn packed(stream: &Arc<CudaStream>, parts: &[usize]) -> Result<(DevBuf<u8>, Vec<u64>)> {
    let mut offsets = Vec::with_capacity(parts.len());
    let mut at = 0usize;
    for &p in parts {
        offsets.push(at as u64);
        at += p.div_ceil(256) * 256;
    }
    let buf = DevBuf::<u8>::zeros(stream, at)?;
    let base = buf.ptr;
    Ok((buf, offsets.into_iter().map(|o| base + o).collect()))
}

/// One batch entry for [`CudaBackend::decode_layer`].
#[derive(Clone, Copy, Debug)]
pub struct DecodeItem<'a> {
    /// Session slot.
    pub slot: u32,
    /// Query [Hq x D] f32 for this layer.
    pub q: &'a [f32],
}

/// One batch entry for [`CudaBackend::decode_step`]: queries of every layer.
#[derive(Clone, Copy, Debug)]
pub struct StepItem<'a> {
    /// Session slot.
    pub slot: u32,
    /// Queries [layers x Hq x D] f32.
    pub q: &'a [f32],
}

/// Transfer statistics of one layer of one call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Tiles in the keep-sets (all sessions, all kv heads).
    pub tiles: u64,
    /// Tiles found in the GPU block cache.
    pub hits: u64,
    /// Tiles fetched from pinned host memory.
    pub misses: u64,
    /// Bytes moved host -> GPU.
    pub bytes_moved: u64,
}

/// Per-layer device time (CUDA events), when timing is enabled.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerTiming {
    /// Scoring, top-k and the block-cache plan (hits, victims, miss addresses). `None` when
    /// the layer ran as one launch (layer_fused), which leaves no kernel boundary after the
    /// selector to time ([`LaunchMode`]).
    pub select_ms: Option<f32>,
    /// Fetching misses from host memory fused with attention, then the LSE merge kernel;
    /// `None` when the layer ran as one launch.
    pub fetch_attend_ms: Option<f32>,
    /// The whole layer.
    pub layer_ms: f32,
}

/// What [`CudaBackend`] times with CUDA events ([`CudaBackend::set_timing`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Timing {
    /// Nothing (the decode path's setting).
    #[default]
    Off,
    /// The step only ([`StepOutput::step_ms`]): one event before the first launch and one
    /// after the last, so the step runs as it does untimed.
    Step,
    /// The step and each layer ([`LayerTiming`]): three events per layer on the main stream.
    /// Each event between two kernels delays the second (by ~1-2 us on an H200,
    /// bench/gpu/NOTES.md v25), so a step timed this way is slower than it runs untimed.
    Layers,
}

/// How a layer's kernels are launched.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LaunchMode {
    /// Fused while the layer's last call found fewer than [`FUSE_BELOW_HIT_SHARE`] of its
    /// tiles in the block cache, split otherwise (and always split where fusing is
    /// unavailable). On an H200 (bench/gpu/NOTES.md v24) fusing saved 3-4% of a cold step at
    /// batch 1 and cost 7-9% of a step whose tiles all hit; at a 69% hit share they were even.
    #[default]
    Auto,
    /// One launch for everything but the merge (layer_fused: planning, selector and every
    /// tile's fetch + attend; no kernel boundary between the selector and the distant gather),
    /// where the geometry allows it.
    Fused,
    /// plan_fixed and the fixed tiles on a second stream beside select_score, then the
    /// distant tiles: the per-kernel selector and attention times of [`LayerTiming`].
    Split,
}

/// [`LaunchMode::Auto`] fuses a layer whose last call hit fewer than this share of its tiles.
pub const FUSE_BELOW_HIT_SHARE: f32 = 0.75;

/// Result of [`CudaBackend::decode_layer`].
#[derive(Clone, Debug)]
pub struct LayerOutput {
    /// [batch x Hq x D] f32.
    pub out: Vec<f32>,
    pub stats: LayerStats,
    /// With [`Timing::Layers`].
    pub timing: Option<LayerTiming>,
}

/// Result of [`CudaBackend::decode_step`].
#[derive(Clone, Debug)]
pub struct StepOutput {
    /// [batch x layers x Hq x D] f32.
    pub out: Vec<f32>,
    /// Per layer.
    pub stats: Vec<LayerStats>,
    /// Per layer, with [`Timing::Layers`].
    pub timing: Option<Vec<LayerTiming>>,
    /// Device time of the whole step (first launch to last), with [`Timing::Step`] or
    /// [`Timing::Layers`].
    pub step_ms: Option<f32>,
}

struct Session {
    n_tokens: Vec<u32>,
    /// Per layer: per block bit 0 = summary uploaded, bit 1 = host extent mapped.
    flags: Vec<Vec<u8>>,
    /// Per layer: leading blocks that have both.
    ready: Vec<u32>,
}

impl Session {
    /// The blocks of layer `l` up to its token count, or [`CudaError::NotReady`] when some lack
    /// a summary or a host extent.
    fn blocks_ready(&self, slot: u32, l: usize, block_tokens: u32) -> Result<u32> {
        let nb = self.n_tokens[l].div_ceil(block_tokens);
        if nb > self.ready[l] {
            return Err(CudaError::NotReady {
                slot,
                layer: l as u32,
                n_blocks: nb,
                ready: self.ready[l],
            });
        }
        Ok(nb)
    }
}

struct Timers {
    /// Before the first launch of a call and after its last.
    step: [CudaEvent; 2],
    /// Per layer, with [`Timing::Layers`]: before select, after select + plan, after fetch +
    /// attend.
    marks: Option<Vec<[CudaEvent; 3]>>,
}

/// CUDA backend for one model geometry: owns the device state of up to `max_sessions`
/// sessions and runs select -> zero-copy gather -> split-k attention per layer.
pub struct CudaBackend {
    cfg: CudaConfig,
    derived: Derived,
    ctx: Arc<CudaContext>,
    /// Everything is ordered on `stream` except the fixed part of a layer's keep-set (sink and
    /// local window), which `side` plans, fetches and attends while `stream` selects: `fork`
    /// (recorded on `stream` at the layer's start) starts it, `join` is waited for before the
    /// merge. The two parts use disjoint cache regions (gather.cu), so nothing else orders
    /// them. Both streams are drained before any result is read.
    stream: Arc<CudaStream>,
    side: Arc<CudaStream>,
    fork: CudaEvent,
    join: CudaEvent,
    /// Device calls ([`Self::enqueue_layer_device`]): recorded on the caller's stream and
    /// waited for by `stream`, then recorded on `stream` and waited for by the caller's.
    handoff: [CudaEvent; 2],
    /// The batch of device calls ([`Self::bind_batch`]); cleared by anything that changes a
    /// session's device state or reuses the batch buffers.
    bound: Option<device::BoundBatch>,
    /// Multiprocessors of the device: select_score's blocks per octet are chosen to fill them.
    sms: u32,
    /// How layers are launched; see [`LaunchMode`].
    mode: LaunchMode,
    /// Dependent launch requested ([`Self::set_dependent_launch`]).
    pdl: bool,
    /// Dense attention's partials, allocated by its first call (dense.rs).
    dense: Option<dense::DenseScratch>,
    /// Per layer: whether its last run was fused (how its timing reads).
    fused: Vec<bool>,
    /// Per layer: the share of its last call's tiles found in the block cache (0 before any).
    hit_share: Vec<f32>,
    /// Tickets layer_fused launches have taken from `tickets` (wrapping): the next launch's
    /// ticket0.
    tickets_issued: u32,
    k: Kernels,
    /// Shared so that several backends (one per geometry) can map the same registered arena.
    host: Option<Arc<PinnedRegion>>,
    sessions: Vec<Option<Session>>,
    /// Per layer call, never 0: what layer_fused's ready flags hand off with. (The tile cache's
    /// LRU order uses the device's clock instead, gather.cu: a replayed launch repeats this.)
    stamp: u32,
    timers: Option<Timers>,
    poison: bool,
    /// [`sessions::summary_order`] for this geometry, used by every summary upload.
    sum_order: Vec<usize>,
    /// Per layer: the batch size of the last call that ran it ([`Self::last_keep_sets`]).
    batch_of: Vec<usize>,
    // Device state.
    /// Per (slot, layer, block, kv head): its summary records (the block's bounds in the device
    /// order, or with the sketch selector its quarters' int8 codes).
    sums: DevBuf<u8>,
    /// Per (slot, layer, block, kv head) with the sketch selector: its quarter codes' scale.
    qscales: DevBuf<f32>,
    /// Per (slot, layer, block, kv head) with the sketch selector: its key sketch
    /// ([`CudaConfig::sketch_record_bytes`]); empty otherwise.
    sketches: DevBuf<u8>,
    pages: DevBuf<u64>,
    tags: DevBuf<u32>,
    stamps: DevBuf<u32>,
    cache: DevBuf<u8>,
    // Per-call scratch.
    /// The call's inputs in one allocation, in the order one upload writes them: `sess`, `ntok`
    /// (both whole), then `q` (as much as the call has).
    inputs: DevBuf<u8>,
    sess: DevView<u32>,
    ntok: DevView<u32>,
    q: DevView<f32>,
    /// Selector scratch: candidate lists or scores ([`Derived::score_scratch`]).
    scores: DevBuf<u8>,
    /// Per (batch item, kv head): select_score's completion counters, the head's and its merge
    /// groups' ([`Derived::score_counters`]; zero between launches).
    done: DevBuf<u32>,
    /// Per (batch item, kv head): the stamps of the layer whose fixed part and distant part are
    /// planned (layer_fused's handoffs from planning roles to tile roles).
    ready: DevBuf<u32>,
    /// layer_fused's ticket counter (one u32).
    tickets: DevBuf<u32>,
    /// The sketch selector's: per (batch item, kv head) its candidate units (`cand_stride`
    /// slots), the rerank roles' keys (32 * rerank_r) and their finished count (zero between
    /// launches).
    cands: DevBuf<u32>,
    rkeys: DevBuf<u64>,
    rdone: DevBuf<u32>,
    table: DevBuf<u32>,
    counts: DevBuf<u32>,
    slot_of: DevBuf<u32>,
    miss_src: DevBuf<u64>,
    part_acc: DevBuf<f32>,
    part_ml: DevBuf<f32>,
    /// The call's results in one allocation, in the order one readback takes them: `stats`
    /// (whole), then `out` (as much as the call has).
    results: DevBuf<u8>,
    stats: DevView<u64>,
    out: DevView<f32>,
}

impl CudaBackend {
    fn memset_u32(&self, ptr: u64, value: u32, n: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: ptr..ptr+4n lies inside a buffer this backend owns (callers compute it from
        // DevBuf::at with in-range indices); the stream orders it with every other use.
        unsafe { sys::cuMemsetD32Async(ptr, value, n, self.stream.cu_stream()) }
            .result()
            .map_err(CudaError::driver("cuMemsetD32Async"))
    }

    fn htod<T: DeviceRepr>(&self, dst: u64, src: &[T]) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: callers check that dst..dst+size_of_val(src) lies inside an owned buffer.
        // cuMemcpyHtoDAsync from pageable memory stages the source before returning.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))
    }

    fn dtoh<T: DeviceRepr>(&self, dst: &mut [T], src: u64) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        // SAFETY: callers check the source range; the stream is synchronized before dst is read.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(CudaError::driver("cuMemcpyDtoHAsync"))?;
        self.sync()
    }

    fn sync(&self) -> Result<()> {
        self.side
            .synchronize()
            .map_err(CudaError::driver("cuStreamSynchronize"))?;
        self.stream
            .synchronize()
            .map_err(CudaError::driver("cuStreamSynchronize"))
    }
}

/// One layer of a call's inputs: the model layer, the batch's slots, their token counts there
/// and their queries ([batch][Hq x D]).
struct LayerInput {
    layer: usize,
    slots: Vec<u32>,
    ntok: Vec<u32>,
    q: Vec<f32>,
}
