//! The CUDA backend: device-side layer state and the select -> gather -> attend pipeline.

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    LaunchConfig, PushKernelArg, ValidAsZeroBits,
};

use super::config::{bf16_outward, CudaConfig, Derived, SCORE_NB, SCORE_THREADS};
use super::error::{CudaError, Result};
use super::module::{compile, Kernels};
use super::pinned::PinnedRegion;

mod dense;
pub use dense::{DenseKv, DeviceKv};

/// Is a CUDA driver with at least one device present? Never panics.
pub fn device_available() -> bool {
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    matches!(CudaContext::device_count(), Ok(n) if n > 0)
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
    /// Per layer: per block bit 0 = summary uploaded, bit 1 = host frame mapped.
    flags: Vec<Vec<u8>>,
    /// Per layer: leading blocks that have both.
    ready: Vec<u32>,
}

impl Session {
    /// The blocks of layer `l` up to its token count, or [`CudaError::NotReady`] when some lack
    /// a summary or a host frame.
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
    stamp: u32,
    timers: Option<Timers>,
    poison: bool,
    /// [`summary_order`] for this geometry, used by every summary upload.
    sum_order: Vec<usize>,
    last_batch: usize,
    // Device state.
    sums: DevBuf<u8>,
    pages: DevBuf<u64>,
    tags: DevBuf<u32>,
    stamps: DevBuf<u32>,
    cache: DevBuf<u8>,
    // Per-call scratch.
    q: DevBuf<f32>,
    sess: DevBuf<u32>,
    ntok: DevBuf<u32>,
    /// Selector scratch: candidate lists or scores ([`Derived::score_scratch`]).
    scores: DevBuf<u8>,
    /// Per (batch item, kv head): select_score thread blocks done (zero between launches).
    done: DevBuf<u32>,
    /// Per (batch item, kv head): the stamps of the layer whose fixed part and distant part are
    /// planned (layer_fused's handoffs from planning roles to tile roles).
    ready: DevBuf<u32>,
    /// layer_fused's ticket counter (one u32).
    tickets: DevBuf<u32>,
    table: DevBuf<u32>,
    counts: DevBuf<u32>,
    slot_of: DevBuf<u32>,
    miss_src: DevBuf<u64>,
    part_acc: DevBuf<f32>,
    part_ml: DevBuf<f32>,
    out: DevBuf<f32>,
    stats: DevBuf<u64>,
}

/// The device order of one (block, kv head) summary record (select.cu, "Device summary
/// layout"): entry e is the index into the CPU's [max; D] ++ [min; D] record. Thread j of a
/// scoring octet owns the CPU's SIMD lane j (dims j + 8s); its (max, min) pairs for increasing
/// s fill 16-byte vectors of `p` pairs, and its vector u is the record's vector u * 8 + j.
fn summary_order(d: usize, bf16: bool) -> Vec<usize> {
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
fn device_records<T: Copy + Default>(
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
    /// Opens device `ordinal`, compiles the kernels for `cfg` and allocates all device state.
    pub fn new(ordinal: usize, cfg: CudaConfig) -> Result<Self> {
        let derived = cfg.validate()?;
        // SAFETY: only probes whether the shared library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        let count =
            CudaContext::device_count().map_err(CudaError::driver("cuDeviceGetCount"))? as usize;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx =
            CudaContext::new(ordinal).map_err(CudaError::driver("cuDevicePrimaryCtxRetain"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(CudaError::driver("cuDeviceGetAttribute"))?;
        if major < 7 {
            return Err(CudaError::ComputeCapability { major, minor });
        }
        // SAFETY: the backend orders its two streams explicitly (the fork/join events of
        // run_layer; both are drained before results are read), so cudarc's cross-stream event
        // tracking is not needed (and would add event records).
        unsafe { ctx.disable_event_tracking() };
        let new_stream = || {
            ctx.new_stream()
                .map_err(CudaError::driver("cuStreamCreate"))
        };
        let (stream, side) = (new_stream()?, new_stream()?);
        let new_event = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(CudaError::driver("cuEventCreate"))
        };
        let (fork, join) = (new_event()?, new_event()?);
        let k = compile(&ctx, &cfg, &derived)?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(CudaError::driver("cuDeviceGetAttribute"))?
            .max(1) as u32;

        let g = &cfg.geometry;
        let (s, l, mb) = (
            cfg.max_sessions as usize,
            g.layers as usize,
            cfg.max_blocks as usize,
        );
        let (hkv, hq, d) = (g.kv_heads as usize, g.q_heads as usize, g.head_dim as usize);
        let (c, ks, bmax) = (
            cfg.cache_slots as usize,
            derived.keep_max as usize,
            cfg.max_batch as usize,
        );
        let sum_elem = if cfg.summaries_bf16() { 2 } else { 4 };
        let z8 = |n| DevBuf::<u8>::zeros(&stream, n);
        let z32 = |n| DevBuf::<u32>::zeros(&stream, n);
        let zf = |n| DevBuf::<f32>::zeros(&stream, n);
        let z64 = |n| DevBuf::<u64>::zeros(&stream, n);
        let backend = CudaBackend {
            sums: z8(s * l * mb * g.summary_floats_per_block() * sum_elem)?,
            pages: z64(s * l * mb)?,
            tags: z32(s * l * hkv * c)?,
            stamps: z32(s * l * hkv * c)?,
            cache: z8(s * l * hkv * c * g.tile_bytes())?,
            q: zf(l * bmax * hq * d)?,
            sess: z32(bmax)?,
            ntok: z32(l * bmax)?,
            scores: z8(bmax * hkv * derived.score_scratch)?,
            done: z32(bmax * hkv)?,
            ready: z32(bmax * hkv * 2)?,
            tickets: z32(1)?,
            table: z32(l * bmax * hkv * ks)?,
            counts: z32(l * bmax * hkv)?,
            slot_of: z32(bmax * hkv * ks)?,
            miss_src: z64(bmax * hkv * ks)?,
            part_acc: zf(bmax * hkv * ks * g.group() * d)?,
            part_ml: zf(bmax * hkv * ks * g.group() * 2)?,
            out: zf(l * bmax * hq * d)?,
            stats: z64(l * 4)?,
            cfg,
            derived,
            ctx,
            stream,
            side,
            fork,
            join,
            sms,
            mode: LaunchMode::Auto,
            pdl: true,
            dense: None,
            fused: vec![false; l],
            hit_share: vec![0.0; l],
            tickets_issued: 0,
            k,
            host: None,
            sessions: (0..s).map(|_| None).collect(),
            stamp: 0,
            timers: None,
            poison: false,
            sum_order: summary_order(g.head_dim as usize, cfg.summaries_bf16()),
            last_batch: 0,
        };
        backend.sync()?;
        Ok(backend)
    }

    /// The validated configuration.
    pub fn config(&self) -> &CudaConfig {
        &self.cfg
    }

    /// Free and total device memory in bytes.
    pub fn device_memory(&self) -> Result<(usize, usize)> {
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        cudarc::driver::result::mem_get_info().map_err(CudaError::driver("cuMemGetInfo"))
    }

    /// The CUDA context (for registering host memory).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Device name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> Result<String> {
        self.ctx
            .name()
            .map_err(CudaError::driver("cuDeviceGetName"))
    }

    /// Attaches the pinned host arena that page-table entries point into (once). Takes a
    /// region or an `Arc` of one shared with other backends of the same device.
    pub fn attach_host(&mut self, region: impl Into<Arc<PinnedRegion>>) -> Result<()> {
        let region = region.into();
        if self.host.is_some() {
            return Err(CudaError::HostRegionAttached);
        }
        if !Arc::ptr_eq(region.context(), &self.ctx)
            && region.context().cu_ctx() != self.ctx.cu_ctx()
        {
            return Err(CudaError::InvalidConfig {
                reason: "host region registered in another context".into(),
            });
        }
        self.host = Some(region);
        Ok(())
    }

    /// Detaches the host region (to reuse it with another backend). Refused while sessions
    /// are open, since their page tables point into it.
    pub fn detach_host(&mut self) -> Result<Arc<PinnedRegion>> {
        let open = self.sessions.iter().flatten().count();
        if open > 0 {
            return Err(CudaError::SessionsOpen { open });
        }
        self.sync()?;
        self.host.take().ok_or(CudaError::NoHostRegion)
    }

    /// The attached host region (mutable, to write frames between decode calls); None when
    /// none is attached or it is shared with another backend.
    pub fn host_mut(&mut self) -> Option<&mut PinnedRegion> {
        self.host.as_mut().and_then(Arc::get_mut)
    }

    /// Chooses what outputs report of device time ([`Timing`]).
    pub fn set_timing(&mut self, timing: Timing) -> Result<()> {
        if timing == Timing::Off {
            self.timers = None;
            return Ok(());
        }
        let mk = || {
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(CudaError::driver("cuEventCreate"))
        };
        let marks = if timing == Timing::Layers {
            let mut marks = Vec::with_capacity(self.cfg.geometry.layers as usize);
            for _ in 0..self.cfg.geometry.layers {
                marks.push([mk()?, mk()?, mk()?]);
            }
            Some(marks)
        } else {
            None
        };
        self.timers = Some(Timers {
            step: [mk()?, mk()?],
            marks,
        });
        Ok(())
    }

    /// Chooses how layers are launched ([`LaunchMode`]; `Auto` by default).
    pub fn set_launch_mode(&mut self, mode: LaunchMode) {
        self.mode = mode;
    }

    /// Whether layer `l` runs as one launch (layer_fused) under the current mode.
    fn fuse_layer(&self, l: usize) -> bool {
        self.k.layer_fused.is_some()
            && match self.mode {
                LaunchMode::Fused => true,
                LaunchMode::Split => false,
                LaunchMode::Auto => self.hit_share[l] < FUSE_BELOW_HIT_SHARE,
            }
    }

    /// Chooses whether, within a call, a layer's merge and the next layer's layer_fused may
    /// start before the kernel ahead of them ends (programmatic dependent launch; on by
    /// default where the device has it, compute capability 9.0+): once the previous layer's
    /// last tile has arrived, the next layer plans and reads host frames while that tile is
    /// attended and merged; everything that depends on the previous layer waits for it inside
    /// the kernels (kernels/cuda/common.cuh). On an H200 a cold k=8 batch-1 step is 5% faster
    /// (bench/gpu/NOTES.md v30).
    pub fn set_dependent_launch(&mut self, on: bool) {
        self.pdl = on;
    }

    /// Whether a layer's first kernel is launched dependent on the previous layer's merge now:
    /// where the device has it (compute capability 9.0+), unless turned off
    /// ([`Self::set_dependent_launch`]) or per-layer events sit between the kernels
    /// ([`Timing::Layers`]).
    pub fn dependent_launch(&self) -> bool {
        self.pdl && self.k.pdl && self.timers.as_ref().is_none_or(|t| t.marks.is_none())
    }

    /// Test aid: fill outputs and partials with NaN before every call so unwritten elements show.
    pub fn set_poison_outputs(&mut self, on: bool) {
        self.poison = on;
    }

    fn check_slot(&self, slot: u32) -> Result<usize> {
        if slot >= self.cfg.max_sessions {
            return Err(CudaError::SlotOutOfRange {
                slot,
                max: self.cfg.max_sessions,
            });
        }
        Ok(slot as usize)
    }

    fn check_layer(&self, layer: u32) -> Result<usize> {
        if layer >= self.cfg.geometry.layers {
            return Err(CudaError::LayerOutOfRange {
                layer,
                layers: self.cfg.geometry.layers,
            });
        }
        Ok(layer as usize)
    }

    fn session_mut(&mut self, slot: u32) -> Result<&mut Session> {
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

    fn advance_ready(sess: &mut Session, l: usize) {
        let f = &sess.flags[l];
        let mut r = sess.ready[l] as usize;
        while r < f.len() && f[r] == 3 {
            r += 1;
        }
        sess.ready[l] = r as u32;
    }

    /// Uploads block summaries [n][kv_head][2][D] f32 (index 0 = max, 1 = min) for blocks
    /// `first_block..first_block + n` of one session layer. Re-uploading a block (the tail
    /// block after appends) replaces it.
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
        let sess = self.session_mut(slot)?;
        for f in &mut sess.flags[l][first_block as usize..first_block as usize + n] {
            *f |= 1;
        }
        Self::advance_ready(sess, l);
        Ok(())
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
        let sess = self.session_mut(slot)?;
        for f in &mut sess.flags[l][first_block as usize..first_block as usize + addrs.len()] {
            *f |= 2;
        }
        Self::advance_ready(sess, l);
        Ok(())
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

    /// Validates a batch for `layer`; returns its token counts.
    fn check_batch(&self, layer: usize, slots: &[u32]) -> Result<Vec<u32>> {
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
        let l = self.check_layer(layer)?;
        let hqd = (self.cfg.geometry.q_heads * self.cfg.geometry.head_dim) as usize;
        let slots: Vec<u32> = items.iter().map(|it| it.slot).collect();
        let ntok = self.check_batch(l, &slots)?;
        for it in items {
            self.check_q(it.q, hqd)?;
        }
        let q: Vec<f32> = items.iter().flat_map(|it| it.q.iter().copied()).collect();
        let nb = self.blocks_of(&ntok);
        self.prepare(&slots, &[(l, ntok, q)])?;
        self.record_step(0)?;
        self.run_layer(l, 0, items.len(), nb)?;
        self.record_step(1)?;
        self.finish(&[l], items.len()).map(|mut s| LayerOutput {
            out: std::mem::take(&mut s.out),
            stats: s.stats[0],
            timing: s.timing.map(|t| t[0]),
        })
    }

    /// Runs all layers (in order) for a batch of sessions with one synchronization at the end.
    pub fn decode_step(&mut self, items: &[StepItem<'_>]) -> Result<StepOutput> {
        let layers = self.cfg.geometry.layers as usize;
        let slots: Vec<u32> = items.iter().map(|it| it.slot).collect();
        let per_layer = self.step_inputs(items)?;
        self.prepare(&slots, &per_layer)?;
        self.record_step(0)?;
        for (li, (l, ntok, _)) in per_layer.iter().enumerate() {
            let nb = self.blocks_of(ntok);
            self.run_layer(*l, li, items.len(), nb)?;
        }
        self.record_step(1)?;
        let all: Vec<usize> = (0..layers).collect();
        self.finish(&all, items.len())
    }

    /// Checks a step's batch and queries and splits them by layer: per layer, its index, the
    /// batch's token counts and the batch's queries ([batch][Hq x D]), as [`Self::prepare`]
    /// takes them.
    fn step_inputs(&self, items: &[StepItem<'_>]) -> Result<Vec<LayerInput>> {
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
                Ok((l, ntok, q))
            })
            .collect()
    }

    /// Fewest and most blocks of the batch sessions.
    fn blocks_of(&self, ntok: &[u32]) -> (u32, u32) {
        let bt = self.cfg.geometry.block_tokens;
        let nb = ntok.iter().map(|n| n.div_ceil(bt));
        (nb.clone().min().unwrap_or(1), nb.max().unwrap_or(1))
    }

    /// Uploads the batch description and zeroes the statistics.
    fn prepare(&mut self, slots: &[u32], layers: &[LayerInput]) -> Result<()> {
        let b = slots.len();
        let g = &self.cfg.geometry;
        let hqd = (g.q_heads * g.head_dim) as usize;
        let bmax = self.cfg.max_batch as usize;
        debug_assert!(layers.len() * b <= self.cfg.geometry.layers as usize * bmax);
        // Dense per-call layout [call layer][batch][..]: one upload each for q and counts.
        let mut q_all = Vec::with_capacity(layers.len() * b * hqd);
        let mut n_all = Vec::with_capacity(layers.len() * b);
        for (_, ntok, q) in layers {
            debug_assert!(q.len() == b * hqd && ntok.len() == b);
            q_all.extend_from_slice(q);
            n_all.extend_from_slice(ntok);
        }
        self.htod(self.sess.ptr, slots)?;
        self.htod(self.ntok.ptr, &n_all)?;
        self.htod(self.q.ptr, &q_all)?;
        self.memset_u32(self.stats.ptr, 0, self.stats.slice.len() * 2)?;
        if self.poison {
            let nan = 0x7fc0_0000;
            self.memset_u32(self.out.ptr, nan, self.out.slice.len())?;
            self.memset_u32(self.part_acc.ptr, nan, self.part_acc.slice.len())?;
            self.memset_u32(self.part_ml.ptr, nan, self.part_ml.slice.len())?;
            self.memset_u32(self.table.ptr, u32::MAX, self.table.slice.len())?;
        }
        self.last_batch = b;
        Ok(())
    }

    fn launch(
        &self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        name: &'static str,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_after(stream, f, name, cfg, args, false)
    }

    /// [`Self::launch`]; `after_kernel`: the stream's previous operation is a kernel of this
    /// call (nothing between them), so with dependent launch on this launch may start before
    /// that kernel ends (programmatic stream serialization: the kernels' `pdl_wait` keeps
    /// their dependent reads and writes behind it, kernels/cuda/common.cuh).
    fn launch_after(
        &self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        name: &'static str,
        cfg: LaunchConfig,
        args: &[Arg],
        after_kernel: bool,
    ) -> Result<()> {
        if after_kernel && self.dependent_launch() {
            let mut params: Vec<*mut c_void> = args
                .iter()
                .map(|a| match a {
                    Arg::P(v) => v as *const u64 as *mut c_void,
                    Arg::U(v) => v as *const u32 as *mut c_void,
                    Arg::F(v) => v as *const f32 as *mut c_void,
                })
                .collect();
            // SAFETY: a plain-old-data C struct (ids and a union of integers) for which all
            // zero bytes is a valid value; both fields used are set below.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let lc = sys::CUlaunchConfig {
                gridDimX: cfg.grid_dim.0,
                gridDimY: cfg.grid_dim.1,
                gridDimZ: cfg.grid_dim.2,
                blockDimX: cfg.block_dim.0,
                blockDimY: cfg.block_dim.1,
                blockDimZ: cfg.block_dim.2,
                sharedMemBytes: cfg.shared_mem_bytes,
                hStream: stream.cu_stream(),
                attrs: &mut attr,
                numAttrs: 1,
            };
            self.ctx
                .bind_to_thread()
                .map_err(CudaError::driver("cuCtxSetCurrent"))?;
            // SAFETY: as for `launch` below (same argument lists and grids); `params` points
            // into `args`, and `lc` and `attr` live until the call returns (the driver copies
            // the parameters at launch). The attribute is set only on compute capability 9.0+
            // ([`Self::dependent_launch`]).
            unsafe { sys::cuLaunchKernelEx(&lc, f.cu_function(), params.as_mut_ptr(), null_mut()) }
                .result()
                .map_err(|source| CudaError::Driver { call: name, source })?;
            return Ok(());
        }
        let mut lb = stream.launch_builder(f);
        for a in args {
            match a {
                Arg::P(v) => lb.arg(v),
                Arg::U(v) => lb.arg(v),
                Arg::F(v) => lb.arg(v),
            };
        }
        // SAFETY: argument lists match the kernel signatures in kernels/cuda/*.cu (pointer
        // arguments are device addresses of buffers this backend owns, sized from the same
        // validated config the kernels were compiled with); grids are bounded by max_batch,
        // kv_heads and the keep-set size, so every index a kernel forms is inside those sizes.
        // Launch-configuration errors come back as the launch status.
        unsafe { lb.launch(cfg) }.map_err(|source| CudaError::Driver { call: name, source })?;
        Ok(())
    }

    /// Records layer `l`'s mark `i` (with [`Timing::Layers`]).
    fn record(&self, l: usize, i: usize) -> Result<()> {
        if let Some(m) = self.timers.as_ref().and_then(|t| t.marks.as_ref()) {
            m[l][i]
                .record(&self.stream)
                .map_err(CudaError::driver("cuEventRecord"))?;
        }
        Ok(())
    }

    /// Records the call's start (`i` = 0) or end (1) when timing.
    fn record_step(&self, i: usize) -> Result<()> {
        if let Some(t) = &self.timers {
            t.step[i]
                .record(&self.stream)
                .map_err(CudaError::driver("cuEventRecord"))?;
        }
        Ok(())
    }

    /// Enqueues one layer: in parallel, the fixed part of the keep-set (sink and local window:
    /// known before any scoring; planned, fetched and attended) on the side stream and the
    /// selector (scoring, top-k and the distant plan: one launch for top_k <= 32) on the main
    /// one; then the distant tiles and, once both are done, the merge.
    /// `l`: model layer; `li`: its index within this call (offset into the dense q/out); `nb`:
    /// fewest and most blocks of any batch session at layer `l`.
    fn run_layer(&mut self, l: usize, li: usize, b: usize, nb: (u32, u32)) -> Result<()> {
        // Never 0: layer_fused's ready flags start at 0 and must not match a fresh layer.
        self.stamp = self.stamp.wrapping_add(1).max(1);
        self.fused[l] = self.fuse_layer(l);
        match self.enqueue_layer(l, li, b, nb) {
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

    /// Enqueues layer `l`; returns the tickets its layer_fused launch takes (0 unfused).
    fn enqueue_layer(
        &self,
        l: usize,
        li: usize,
        b: usize,
        (min_nb, max_nb): (u32, u32),
    ) -> Result<u32> {
        use Arg::{F, P, U};
        let g = self.cfg.geometry;
        let p = self.cfg.policy;
        let bmax = self.cfg.max_batch as usize;
        let ks = self.derived.keep_max;
        let hkv = g.kv_heads;
        let hqd = (g.q_heads * g.head_dim) as usize;
        let bu = b as u32;
        let layer = l as u32;
        let mb = self.cfg.max_blocks;
        let q = self.q.at(li * b * hqd);
        let ntok = self.ntok.at(li * b);
        let table = self.table.at(l * bmax * (hkv * ks) as usize);
        let counts = self.counts.at(l * bmax * hkv as usize);
        let out = self.out.at(li * b * hqd);
        let sess = self.sess.ptr;
        let cfg = |grid: (u32, u32, u32), threads: u32| LaunchConfig {
            grid_dim: grid,
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let k = &self.k;
        let (main, side) = (&self.stream, &self.side);
        // Cache bookkeeping arguments shared by both planning kernels.
        let plan_args = [
            P(sess),
            U(layer),
            P(self.tags.ptr),
            P(self.stamps.ptr),
            P(self.pages.ptr),
            P(self.slot_of.ptr),
            P(self.miss_src.ptr),
            P(self.stats.ptr),
            U(self.stamp),
        ];
        let scale = (1.0 / (g.head_dim as f64).sqrt()) as f32;
        let attend = |stream: &Arc<CudaStream>, part: u32, tiles: u32| {
            self.launch(
                stream,
                &k.attend_tile,
                "attend_tile",
                LaunchConfig {
                    grid_dim: (tiles, hkv, bu),
                    block_dim: (self.derived.att_threads, 1, 1),
                    shared_mem_bytes: self.derived.att_dyn_smem,
                },
                &[
                    P(q),
                    P(sess),
                    P(ntok),
                    U(layer),
                    P(table),
                    P(self.slot_of.ptr),
                    P(self.miss_src.ptr),
                    P(self.cache.ptr),
                    F(scale),
                    P(self.part_acc.ptr),
                    P(self.part_ml.ptr),
                    U(part),
                ],
            )
        };

        // Score roles: blocks per octet and thread blocks (candidate lists) per kv head.
        let nbo = self.score_blocks_per_octet(max_nb, hkv * bu);
        let lists = max_nb.div_ceil(nbo * (SCORE_THREADS / 8));
        // select_score's arguments, which layer_fused's begin with.
        let score_args = || {
            let mut a = vec![
                P(q),
                P(self.sums.ptr),
                P(sess),
                P(ntok),
                U(layer),
                U(mb),
                U(nbo),
                P(self.scores.ptr),
                P(self.done.ptr),
                P(table),
            ];
            a.extend_from_slice(&plan_args[2..]);
            a
        };

        self.record(l, 0)?;
        if let (true, Some(fused)) = (self.fused[l], &k.layer_fused) {
            // Everything but the merge in one launch on the main stream (select.cu).
            // A short layer's fixed part is all its blocks, up to KSEL tiles.
            let nfixed = if min_nb <= ks {
                ks
            } else {
                p.sink_blocks + p.local_blocks
            };
            let ctas = (1 + nfixed + lists + p.top_k) * hkv * bu;
            let mut args = score_args();
            args.extend_from_slice(&[
                P(counts),
                P(self.cache.ptr),
                F(scale),
                P(self.part_acc.ptr),
                P(self.part_ml.ptr),
                P(self.ready.ptr),
                P(self.tickets.ptr),
                U(self.tickets_issued),
                U(lists),
                U(nfixed),
                U(bu),
            ]);
            // Within a call every layer ends with its merge on the main stream, and with
            // dependent launch no event sits between (dependent_launch).
            self.launch_after(
                main,
                fused,
                "layer_fused",
                LaunchConfig {
                    grid_dim: (ctas, 1, 1),
                    block_dim: (SCORE_THREADS, 1, 1),
                    shared_mem_bytes: self.derived.att_dyn_smem,
                },
                &args,
                li > 0,
            )?;
            self.record(l, 1)?;
            self.merge(l, bu, counts, out, true)?;
            return Ok(ctas);
        }
        let rec = |e: &CudaEvent, st: &Arc<CudaStream>| {
            e.record(st).map_err(CudaError::driver("cuEventRecord"))
        };
        let wait = |st: &Arc<CudaStream>, e: &CudaEvent| {
            st.wait(e).map_err(CudaError::driver("cuStreamWaitEvent"))
        };
        // Side: plan the fixed part, then fetch + attend it, while main selects.
        rec(&self.fork, main)?;
        wait(side, &self.fork)?;
        let mut args = vec![P(ntok), U(mb), P(table), P(counts)];
        args.extend_from_slice(&plan_args);
        self.launch(
            side,
            &k.plan_fixed,
            "plan_fixed",
            cfg((hkv, bu, 1), 128),
            &args,
        )?;
        attend(side, 0, ks)?;
        rec(&self.join, side)?;

        self.launch(
            main,
            &k.select_score,
            "select_score",
            cfg((lists, hkv, bu), SCORE_THREADS),
            &score_args(),
        )?;
        if !self.derived.topk_merge {
            let mut args = vec![P(self.scores.ptr), P(ntok), U(mb), P(table)];
            args.extend_from_slice(&plan_args);
            self.launch(
                main,
                &k.select_topk,
                "select_topk",
                cfg((hkv, bu, 1), 1024),
                &args,
            )?;
        }
        self.record(l, 1)?;
        attend(main, 1, p.top_k.max(1))?;
        wait(main, &self.join)?;
        self.merge(l, bu, counts, out, false)?;
        Ok(0)
    }

    /// The layer's last launch: the log-sum-exp merge of its partials into `out`;
    /// `after_kernel` as in [`Self::launch_after`].
    fn merge(&self, l: usize, bu: u32, counts: u64, out: u64, after_kernel: bool) -> Result<()> {
        let g = self.cfg.geometry;
        self.launch_after(
            &self.stream,
            &self.k.attend_merge,
            "attend_merge",
            LaunchConfig {
                grid_dim: (g.q_heads, bu, 1),
                block_dim: (g.head_dim, 1, 1),
                shared_mem_bytes: 0,
            },
            &[
                Arg::P(counts),
                Arg::P(self.part_acc.ptr),
                Arg::P(self.part_ml.ptr),
                Arg::P(out),
            ],
            after_kernel,
        )?;
        self.record(l, 2)
    }

    /// Blocks each select_score octet scores: the most (fewest candidate lists to merge, the
    /// query loaded once per more blocks) that still gives every multiprocessor a thread block.
    fn score_blocks_per_octet(&self, max_nb: u32, heads: u32) -> u32 {
        let octets = SCORE_THREADS / 8;
        let mut nbo = SCORE_NB;
        while nbo > 1 && max_nb.div_ceil(nbo * octets) * heads < self.sms {
            nbo /= 2;
        }
        nbo
    }

    /// A diagnostic global of the kernels compiled with `-DSEL_TRACE=1` (see
    /// [`super::module::EXTRA_OPTIONS_ENV`] and kernels/cuda/common.cuh), zeroed after reading
    /// so that the next read holds only later launches: `sel_trace` (select_score's phase
    /// stamps, 16 values per thread block) or `k_trace` (each kernel's latest start and end).
    /// `None` when the kernels were compiled without it. Diagnostics only.
    pub fn trace(&self, name: &str) -> Result<Option<Vec<u64>>> {
        let Ok(mut view) = self.k.module.get_global(name, &self.stream) else {
            return Ok(None);
        };
        self.sync()?;
        let mut bytes = vec![0u8; view.len()];
        self.stream
            .memcpy_dtoh(&view, &mut bytes)
            .map_err(CudaError::driver("cuMemcpyDtoHAsync"))?;
        self.stream
            .memcpy_htod(&vec![0u8; bytes.len()], &mut view)
            .map_err(CudaError::driver("cuMemcpyHtoDAsync"))?;
        self.sync()?;
        Ok(Some(
            bytes
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")))
                .collect(),
        ))
    }

    /// Waits for the enqueued layers and reads outputs, statistics and timings.
    fn finish(&mut self, layers: &[usize], b: usize) -> Result<StepOutput> {
        let g = self.cfg.geometry;
        let hqd = (g.q_heads * g.head_dim) as usize;
        let nl = layers.len();
        // One readback for every layer of the call ([call layer][batch][Hq x D] on the device).
        let mut rows = vec![0f32; nl * b * hqd];
        self.dtoh(&mut rows, self.out.ptr)?;
        let mut out = vec![0f32; b * nl * hqd];
        for li in 0..nl {
            for i in 0..b {
                out[(i * nl + li) * hqd..(i * nl + li + 1) * hqd]
                    .copy_from_slice(&rows[(li * b + i) * hqd..(li * b + i + 1) * hqd]);
            }
        }
        let mut raw = vec![0u64; g.layers as usize * 4];
        self.dtoh(&mut raw, self.stats.ptr)?;
        let stats = layers
            .iter()
            .map(|&l| LayerStats {
                hits: raw[l * 4],
                misses: raw[l * 4 + 1],
                bytes_moved: raw[l * 4 + 2],
                tiles: raw[l * 4 + 3],
            })
            .collect::<Vec<LayerStats>>();
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

    /// Keep-sets of the last call at `layer`: [batch][kv_head] -> ascending block ids.
    pub fn last_keep_sets(&self, layer: u32) -> Result<Vec<Vec<Vec<u32>>>> {
        let l = self.check_layer(layer)?;
        let g = self.cfg.geometry;
        let (bmax, hkv, ks) = (
            self.cfg.max_batch as usize,
            g.kv_heads as usize,
            self.derived.keep_max as usize,
        );
        let b = self.last_batch;
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

/// One layer of a call's inputs: the model layer, the batch's token counts there and the batch's
/// queries ([batch][Hq x D]).
type LayerInput = (usize, Vec<u32>, Vec<f32>);

/// A kernel argument: device pointer, u32 or f32.
#[derive(Clone, Copy)]
enum Arg {
    P(u64),
    U(u32),
    F(f32),
}

#[cfg(test)]
mod tests {
    use super::{device_records, summary_order};
    use crate::cuda::bf16_outward;

    /// Every CPU value lands once, and the values a scoring thread reads (16-byte vectors
    /// u * 8 + j of its record) are lane j's (max, min) pairs for dims j, j + 8, ... in order.
    #[test]
    fn summary_order_gives_each_lane_its_dims_in_order() {
        for (d, bf16) in [
            (32, true),
            (32, false),
            (64, true),
            (128, true),
            (128, false),
            (256, false),
        ] {
            let order = summary_order(d, bf16);
            let mut seen = order.clone();
            seen.sort_unstable();
            assert_eq!(
                seen,
                (0..2 * d).collect::<Vec<_>>(),
                "d {d}: not a permutation"
            );
            let per_vec = if bf16 { 8 } else { 4 };
            let vecs = 2 * d / per_vec / 8;
            for j in 0..8 {
                let lane: Vec<usize> = (0..vecs)
                    .flat_map(|u| {
                        let v = u * 8 + j;
                        order[v * per_vec..(v + 1) * per_vec].to_vec()
                    })
                    .collect();
                let want: Vec<usize> = (0..d / 8)
                    .flat_map(|s| [j + 8 * s, d + j + 8 * s])
                    .collect();
                assert_eq!(lane, want, "d {d} bf16 {bf16} lane {j}");
            }
        }
    }

    /// Each record is permuted on its own, and the conversion sees the CPU index (bf16: max
    /// rounded up, min rounded down).
    #[test]
    fn device_records_permute_each_record_and_round_outward() {
        let d = 32;
        let order = summary_order(d, true);
        let cpu: Vec<f32> = (0..3 * 2 * d).map(|i| 1.0 + i as f32 * 1e-3).collect();
        let dev = device_records(&cpu, &order, |x, o| bf16_outward(x, o < d));
        for r in 0..3 {
            for (e, &o) in order.iter().enumerate() {
                assert_eq!(dev[r * 2 * d + e], bf16_outward(cpu[r * 2 * d + o], o < d));
            }
        }
        let same = device_records(&cpu, &summary_order(d, false), |x, _| x);
        assert_eq!(same.len(), cpu.len());
        assert_eq!(same[1], cpu[d], "entry 1 is lane 0's first min");
    }
}
