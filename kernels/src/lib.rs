//! kvtier kernels: the block selector and gather-decode attention, with the CPU backend as the
//! reference implementation.
//!
//! # Layout
//!
//! - [`select`]: key-bound block scoring and per-kv-head keep-sets ([`KeepSet`]).
//! - [`attention`]: split-k gather-decode attention with an fp32 online softmax and a
//!   log-sum-exp merge.
//! - [`decode`]: the decode step, once: one layer for a batch of sessions (validate, select,
//!   promote, append, attend, count), with the CPU or a device behind [`Backend`].
//! - [`dense`]: the f64 softmax-attention oracle every kernel is tested against.
//! - [`simd`]: the vectorisable inner loops (dot products, bounds, exp).
//! - `cuda` (feature `cuda`, on by default; needs no toolkit to build): the GPU backend —
//!   pinned mapped host regions, fused selector, zero-copy keep-set gather, block cache and
//!   split-k attention, compiled with NVRTC at run time.

pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decode;
pub mod dense;
pub mod error;
pub mod remap;
pub mod select;
pub mod simd;

pub use decode::{
    decode_cpu, decode_cpu_timed, decode_step, Appended, Attended, Backend, Cpu, DecodeEntry,
    StageTimings, StepReport, StepStats,
};
pub use error::{KernelError, Result};
pub use select::{select, KeepSet, SelectScratch};

/// Sizes the compute pool that selection and attention run on (call once, before any decode).
pub fn set_compute_threads(threads: usize) -> std::result::Result<(), String> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("kvtier-compute-{i}"))
        .build_global()
        .map_err(|e| e.to_string())
}
