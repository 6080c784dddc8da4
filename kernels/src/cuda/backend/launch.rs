//! Kernel launches (plain, or dependent on the kernel ahead: programmatic dependent launch),
//! the timing events, and the kernels' diagnostic globals.

use std::ptr::null_mut;
use std::sync::Arc;

use cudarc::driver::{sys, CudaFunction, CudaStream, LaunchConfig};

use super::CudaBackend;
use crate::cuda::error::{CudaError, Result};
use crate::cuda::params::KernelParams;

impl CudaBackend {
    /// Launches `f`, the kernel `P` belongs to, with `params`' fields as its parameters
    /// (kernels/src/cuda/params).
    pub(super) fn launch<P: KernelParams>(
        &self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &P,
    ) -> Result<()> {
        self.launch_after(stream, f, cfg, params, false)
    }

    /// [`Self::launch`]; `after_kernel`: the stream's previous operation is a kernel of this
    /// call (nothing between them), so with dependent launch on this launch may start before
    /// that kernel ends (programmatic stream serialization: the kernels' `pdl_wait` keeps
    /// their dependent reads and writes behind it, kernels/cuda/common.cuh).
    pub(super) fn launch_after<P: KernelParams>(
        &self,
        stream: &Arc<CudaStream>,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &P,
        after_kernel: bool,
    ) -> Result<()> {
        let name = P::KERNEL;
        if after_kernel && self.dependent_launch() {
            let mut args = params.arg_ptrs();
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
            // SAFETY: as for `launch` below (same parameters and grids); `args` points into
            // `params`, and `lc` and `attr` live until the call returns (the driver copies the
            // parameters at launch). The attribute is set only on compute capability 9.0+
            // ([`Self::dependent_launch`]).
            unsafe { sys::cuLaunchKernelEx(&lc, f.cu_function(), args.as_mut_ptr(), null_mut()) }
                .result()
                .map_err(|source| CudaError::Driver { call: name, source })?;
            return Ok(());
        }
        let mut lb = stream.launch_builder(f);
        params.push_args(&mut lb);
        // SAFETY: each kernel in kernels/cuda/*.cu is declared with the C parameter list
        // generated from its `P` (kernels/src/cuda/params; its tests check the lists against
        // the Rust fields and the kernels' signatures), `P` pushes its fields in that order,
        // and callers pass `f` the kernel `P` belongs to. Pointer fields are device addresses
        // of buffers this backend owns, sized from the same validated config the kernels were
        // compiled with; grids are bounded by max_batch, kv_heads and the keep-set size, so
        // every index a kernel forms is inside those sizes. Launch-configuration errors come
        // back as the launch status.
        unsafe { lb.launch(cfg) }.map_err(|source| CudaError::Driver { call: name, source })?;
        Ok(())
    }

    /// Records layer `l`'s mark `i` (with [`Timing::Layers`](super::Timing::Layers)).
    pub(super) fn record(&self, l: usize, i: usize) -> Result<()> {
        if let Some(m) = self.timers.as_ref().and_then(|t| t.marks.as_ref()) {
            m[l][i]
                .record(&self.stream)
                .map_err(CudaError::driver("cuEventRecord"))?;
        }
        Ok(())
    }

    /// Records the call's start (`i` = 0) or end (1) when timing.
    pub(super) fn record_step(&self, i: usize) -> Result<()> {
        if let Some(t) = &self.timers {
            t.step[i]
                .record(&self.stream)
                .map_err(CudaError::driver("cuEventRecord"))?;
        }
        Ok(())
    }

    /// A diagnostic global of the kernels compiled with `-DSEL_TRACE=1` (see
    /// [`crate::cuda::module::EXTRA_OPTIONS_ENV`] and kernels/cuda/common.cuh), zeroed after
    /// reading so that the next read holds only later launches: `sel_trace` (select_score's
    /// phase stamps, 16 values per thread block) or `k_trace` (each kernel's latest start and
    /// end).
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
}
