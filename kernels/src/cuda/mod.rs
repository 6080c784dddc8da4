//! CUDA backend: block selection, zero-copy gather and split-k gather-decode attention on an
//! NVIDIA GPU, for KV blocks that live in pinned host RAM.
//!
//! Built with cudarc's dynamic loading, so the crate compiles without a CUDA toolkit; libcuda
//! and libnvrtc are needed only at run time. Kernel sources (kernels/cuda/*.cu) are embedded
//! and compiled with NVRTC for the backend's geometry when [`CudaBackend::new`] runs.
//!
//! # Layout
//! - [`config`]: geometry, policy and capacity, validated before any device work.
//! - [`pinned`]: [`PinnedRegion`], the host arena registered with CUDA (mapped, pinned).
//! - [`backend`]: [`CudaBackend`], device-side layer state (summaries, page table, tile cache)
//!   and the per-layer pipeline: `plan_fixed` + `attend_tile` (sink and local window) on a side
//!   stream while `select_score` (scoring, top-k and the plan of the distant tiles; plus
//!   `select_topk` when top_k > 32) runs, then `attend_tile` (distant tiles) -> `attend_merge`.
//! - `module`: NVRTC compilation; [`error`]: [`CudaError`].
//! - `params`: each kernel's parameters as one `#[repr(C)]` struct, declared once for Rust and
//!   CUDA (the kernels' C parameter lists are generated from it).
//!
//! # Per layer, per decode call
//! 1. Selector: an octet of threads per block, thread j keeping lane j of the CPU's 8-lane bound
//!    sums (dims j + 8s) for each query head, folded across the octet in `simd::reduce`'s order
//!    (no FMA), so scores are bit-identical to `select::block_score`. For top_k <= 32 each thread
//!    block reduces its blocks to a sorted list of its 32 best distant candidates and the kv
//!    head's last thread block merges the lists (warp bitonic networks); for larger top_k a
//!    radix select over every score. Either way the top-k distant blocks, ties to the lower
//!    index, written ascending.
//! 2. Cache plan (same thread block as the top-k): a per-(session, layer, kv head) LRU tile
//!    cache on the GPU, with separate slot regions for the fixed and the distant part, decides
//!    hits and victim slots; only misses are read from host memory. Recency is the device's
//!    global timer at planning, so replays of a captured launch keep LRU order.
//! 3. Fetch + attention: one thread block per (session, kv head, tile) loads the tile with
//!    16-byte loads, K and V all in flight (from the cache slot on a hit, over PCIe from the
//!    mapped host extent on a miss, then written back to the slot); K is staged in shared memory
//!    and scored while V is still arriving; the tile is attended for its G query heads (fp32
//!    softmax) and writes (m, l, acc); a merge kernel combines them (LSE). For bf16 KV the
//!    products run on tensor cores (bf16 MMAs, the fp32 factors split into bf16 high and low
//!    parts: [`AttentionMath`]); otherwise fp32 FMAs, each lane holding its slice of the G
//!    query heads in registers.
//!    (Merging in the last thread block of each (session, kv head) was measured slower.)

pub mod backend;
pub mod config;
pub mod error;
pub mod mirror;
mod module;
mod params;
pub mod pinned;

pub use backend::{
    device_available, device_context, device_count, CudaBackend, DecodeItem, DenseKv, DeviceIo,
    DeviceKv, DeviceTail, LaunchMode, LayerOutput, LayerStats, LayerTiming, StepItem, StepOutput,
    Timing, FUSE_BELOW_HIT_SHARE,
};
pub use config::{AttentionMath, CudaConfig, SummaryDtype, MAX_CANDIDATES, MAX_CANDIDATE_UNITS};
pub use cudarc::driver::{sys::CUstream, CudaContext, CudaEvent};
pub use error::CudaError;
pub use kvtier_storage::dtype::bf16_outward;
pub use mirror::{LayerMirror, LayerTarget, Summaries};
pub use module::{compile_check, KERNEL_SOURCE};
pub use pinned::{AnonMapping, PinnedRegion, MAX_REGISTER_CHUNK};
