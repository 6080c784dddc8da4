//! Run-time compilation (NVRTC) of the kernel sources for one backend's geometry.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use super::config::{CudaConfig, Derived};
use super::error::{CudaError, Result};
use super::params::cuda_decls;

/// All kernel sources, concatenated in dependency order: common.cuh, the kernels' parameter
/// lists (generated from their one declaration in `params`), then the kernels.
pub const KERNEL_SOURCE: &str = concat!(
    include_str!("../../cuda/common.cuh"),
    "\n// Kernel parameter lists, generated from kernels/src/cuda/params/mod.rs.\n",
    cuda_decls!(),
    "\n",
    include_str!("../../cuda/gather.cu"),
    "\n",
    include_str!("../../cuda/attend.cu"),
    "\n",
    include_str!("../../cuda/select.cu"),
);

/// Extra NVRTC options for diagnostics and experiments, whitespace-separated (for example
/// `-DSEL_TRACE=1`, read by `gpu_bench --trace`; bench/gpu/NOTES.md). Never needed in service.
pub const EXTRA_OPTIONS_ENV: &str = "KVTIER_NVRTC_DEFINES";

/// Loaded kernel functions.
pub(crate) struct Kernels {
    /// Kept for its diagnostic globals (`sel_trace`, `k_trace`).
    pub module: Arc<CudaModule>,
    pub plan_fixed: CudaFunction,
    pub select_score: CudaFunction,
    pub select_topk: CudaFunction,
    /// The sketch selector's second stage (an empty kernel without it).
    pub select_rerank: CudaFunction,
    /// Present when [`Derived::fused`].
    pub layer_fused: Option<CudaFunction>,
    pub attend_tile: CudaFunction,
    pub attend_merge: CudaFunction,
    /// Dense attention (the benchmark's baseline) and its two-step merge; copy_runs stages a
    /// session's KV in GPU memory for it.
    pub attend_dense: CudaFunction,
    pub dense_merge_part: CudaFunction,
    pub dense_merge_out: CudaFunction,
    pub copy_runs: CudaFunction,
    /// Compiled for compute capability 9.0 or later: the kernels' griddepcontrol
    /// instructions are present, so programmatic dependent launch may be used.
    pub pdl: bool,
}

fn arch_for(cc: (i32, i32)) -> Option<&'static str> {
    Some(match cc {
        (7, 0) => "compute_70",
        (7, 5) => "compute_75",
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        _ => return None,
    })
}

/// PTX already compiled in this process, by NVRTC options and architecture: backends of the
/// same configuration (a daemon's decoder lanes) compile once (about a second each).
type PtxMemo = Mutex<HashMap<(Vec<String>, Option<&'static str>), Ptx>>;

fn nvrtc(cfg: &CudaConfig, derived: &Derived, arch: Option<&'static str>) -> Result<Ptx> {
    static MEMO: OnceLock<PtxMemo> = OnceLock::new();
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(CudaError::NoNvrtc);
    }
    let mut options = cfg.defines(derived);
    if let Ok(extra) = std::env::var(EXTRA_OPTIONS_ENV) {
        options.extend(extra.split_whitespace().map(str::to_owned));
    }
    let memo = MEMO.get_or_init(Default::default);
    let key = (options, arch);
    // A panic elsewhere while holding the lock leaves the map itself whole.
    let lock = || memo.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(ptx) = lock().get(&key) {
        return Ok(ptx.clone());
    }
    let ptx = compile_source(key.0.clone(), arch)?;
    lock().insert(key, ptx.clone());
    Ok(ptx)
}

fn compile_source(options: Vec<String>, arch: Option<&'static str>) -> Result<Ptx> {
    let opts = CompileOptions {
        arch,
        options,
        name: Some("kvtier.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(KERNEL_SOURCE, opts).map_err(|e| CudaError::Compile {
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => other.to_string(),
        },
    })
}

/// Compiles the kernels for `cfg` with NVRTC for compute capability 9.0 and returns the PTX.
/// Needs libnvrtc but no GPU, so kernel sources can be checked on machines without a device.
pub fn compile_check(cfg: &CudaConfig) -> Result<String> {
    let derived = cfg.validate()?;
    Ok(nvrtc(cfg, &derived, Some("compute_90"))?.to_src())
}

/// Compiles the kernels for `cfg` and loads them into `ctx`.
pub(crate) fn compile(
    ctx: &Arc<CudaContext>,
    cfg: &CudaConfig,
    derived: &Derived,
) -> Result<Kernels> {
    let cc = ctx
        .compute_capability()
        .map_err(CudaError::driver("cuDeviceGetAttribute"))?;
    let arch = arch_for(cc);
    let ptx = nvrtc(cfg, derived, arch)?;
    let module = ctx
        .load_module(ptx)
        .map_err(CudaError::driver("cuModuleLoadData"))?;
    let f = |name: &'static str| {
        module
            .load_function(name)
            .map_err(CudaError::driver("cuModuleGetFunction"))
    };
    let attend_tile = f("attend_tile")?;
    // attend_tile stages a whole tile in shared memory: opt in above the 48 KiB default.
    let optin = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(CudaError::driver("cuDeviceGetAttribute"))?;
    if derived.att_total_smem as i32 > optin {
        return Err(CudaError::InvalidConfig {
            reason: format!(
                "attention needs {} bytes of shared memory, device allows {optin}",
                derived.att_total_smem
            ),
        });
    }
    let allow_tile_smem = |f: &CudaFunction| {
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            derived.att_dyn_smem as i32,
        )
        .map_err(CudaError::driver("cuFuncSetAttribute"))
    };
    allow_tile_smem(&attend_tile)?;
    // The fused kernel also holds the selector's static shared memory: used only where the
    // device allows the sum (otherwise layers run as split launches).
    let layer_fused = if derived.fused {
        let f = f("layer_fused")?;
        let stat = f
            .get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .map_err(CudaError::driver("cuFuncGetAttribute"))?;
        if stat + derived.att_dyn_smem as i32 <= optin {
            allow_tile_smem(&f)?;
            Some(f)
        } else {
            None
        }
    } else {
        None
    };
    let (attend_merge, plan_fixed) = (f("attend_merge")?, f("plan_fixed")?);
    let attend_dense = f("attend_dense")?;
    allow_tile_smem(&attend_dense)?;
    let (dense_merge_part, dense_merge_out) = (f("dense_merge_part")?, f("dense_merge_out")?);
    let copy_runs = f("copy_runs")?;
    let (select_score, select_topk) = (f("select_score")?, f("select_topk")?);
    let select_rerank = f("select_rerank")?;
    Ok(Kernels {
        module,
        attend_tile,
        attend_merge,
        attend_dense,
        dense_merge_part,
        dense_merge_out,
        copy_runs,
        plan_fixed,
        select_score,
        select_topk,
        select_rerank,
        layer_fused,
        pdl: arch.is_some() && cc.0 >= 9,
    })
}
