//! Opening the device and allocating the backend's state; its settings and host region.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use super::sessions::summary_order;
use super::READY_FLAGS;
use super::{
    device_context, packed, CudaBackend, DevBuf, DevView, LaunchMode, Timers, Timing,
    FUSE_BELOW_HIT_SHARE,
};
use crate::cuda::config::CudaConfig;
use crate::cuda::error::{CudaError, Result};
use crate::cuda::module::compile;
use crate::cuda::pinned::PinnedRegion;

impl CudaBackend {
    /// Opens device `ordinal`, compiles the kernels for `cfg` and allocates all device state.
    pub fn new(ordinal: usize, cfg: CudaConfig) -> Result<Self> {
        let derived = cfg.validate()?;
        let ctx = device_context(ordinal)?;
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
        let handoff = [new_event()?, new_event()?];
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
        let z8 = |n| DevBuf::<u8>::zeros(&stream, n);
        let z32 = |n| DevBuf::<u32>::zeros(&stream, n);
        let zf = |n| DevBuf::<f32>::zeros(&stream, n);
        let z64 = |n| DevBuf::<u64>::zeros(&stream, n);
        let (inputs, at) = packed(
            &stream,
            &[l * bmax * 4, l * bmax * 4, l * bmax * hq * d * 4],
        )?;
        let (results, rat) = packed(&stream, &[l * 4 * 8, l * bmax * hq * d * 4])?;
        let backend = CudaBackend {
            sums: z8(s * l * mb * hkv * cfg.summary_record_bytes())?,
            qscales: zf(if cfg.sketch() { s * l * mb * hkv } else { 0 })?,
            sketches: z8(s * l * mb * hkv * cfg.sketch_record_bytes())?,
            cands: z32(bmax * hkv * derived.cand_stride as usize)?,
            rkeys: z64(bmax * hkv * 32 * derived.rerank_r as usize)?,
            rdone: z32(bmax * hkv)?,
            pages: z64(s * l * mb)?,
            tags: z32(s * l * hkv * c)?,
            stamps: z32(s * l * hkv * c)?,
            cache: z8(s * l * hkv * c * g.tile_bytes())?,
            inputs,
            sess: DevView::new(at[0], l * bmax),
            ntok: DevView::new(at[1], l * bmax),
            q: DevView::new(at[2], l * bmax * hq * d),
            scores: z8(bmax * hkv * derived.score_scratch)?,
            done: z32(bmax * hkv * derived.score_counters)?,
            ready: z32(bmax * hkv * READY_FLAGS)?,
            tickets: z32(1)?,
            table: z32(l * bmax * hkv * ks)?,
            counts: z32(l * bmax * hkv)?,
            slot_of: z32(bmax * hkv * ks)?,
            miss_src: z64(bmax * hkv * ks)?,
            part_acc: zf(bmax * hkv * ks * g.group() * d)?,
            part_ml: zf(bmax * hkv * ks * g.group() * 2)?,
            results,
            stats: DevView::new(rat[0], l * 4),
            out: DevView::new(rat[1], l * bmax * hq * d),
            cfg,
            derived,
            ctx,
            stream,
            side,
            fork,
            join,
            handoff,
            bound: None,
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
            batch_of: vec![0; l],
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

    /// The attached host region; None when none is attached.
    pub fn host(&self) -> Option<&PinnedRegion> {
        self.host.as_deref()
    }

    /// The attached host region (mutable, to write extents between decode calls); None when
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
    pub(super) fn fuse_layer(&self, l: usize) -> bool {
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
    /// last tile has arrived, the next layer plans and reads host extents while that tile is
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
}
