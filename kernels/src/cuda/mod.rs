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
//!   and the per-layer pipeline of four launches: `select_score` -> `select_topk` (top-k,
//!   then the block-cache plan) -> `attend_tile` (fetch fused with attention) -> `attend_merge`.
//! - `module`: NVRTC compilation; [`error`]: [`CudaError`].
//!
//! # Per layer, per decode call
//! 1. Selector: one thread per block keeps the G query heads' bound sums in registers, in the
//!    CPU selector's order (8 lanes, d -> lane d % 8, then `simd::reduce`'s tree; no FMA), so
//!    scores are bit-identical to `select::block_score`, reading the summaries in coalesced
//!    chunks through shared memory. For top_k <= 32 each thread block also reduces its 128
//!    blocks to a sorted list of its 32 best distant candidates and `select_topk` merges a kv
//!    head's lists (warp bitonic networks); for larger top_k a radix select over every score.
//!    Either way the top-k distant blocks, ties to the lower index, written ascending.
//! 2. Cache plan (same thread block as the top-k): a per-(session, layer, kv head) LRU tile
//!    cache on the GPU decides hits and victim slots; only misses are read from host memory.
//! 3. Fetch + attention: one thread block per (session, kv head, tile) stages the tile in shared
//!    memory (cp.async, 16 bytes per copy, all in flight: from the cache slot on a hit, over
//!    PCIe from the host frame on a miss, then written back to the slot), attends it for its G
//!    query heads (fp32 softmax), writes (m, l, acc); a merge kernel combines them (LSE).
//!    (Merging in the last thread block of each (session, kv head) was measured slower.)

pub mod backend;
pub mod config;
pub mod error;
mod module;
pub mod pinned;

pub use backend::{
    device_available, device_context, CudaBackend, DecodeItem, LayerOutput, LayerStats,
    LayerTiming, StepItem, StepOutput,
};
pub use config::{bf16_outward, CudaConfig, CudaGeometry, KvDtype, SelectPolicy, SummaryDtype};
pub use cudarc::driver::CudaContext;
pub use error::CudaError;
pub use module::{compile_check, KERNEL_SOURCE};
pub use pinned::{AnonMapping, PinnedRegion, MAX_REGISTER_CHUNK};
