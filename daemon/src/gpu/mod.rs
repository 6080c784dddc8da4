//! The CUDA decode path: [`GpuDecoder`] wraps `kvtier_kernels::cuda` for the service.
//!
//! # Layout
//!
//! - this file: the decoder's errors and the device mapping of blocks, tested without a device;
//! - `decoder` (feature `cuda`, on by default): [`GpuDecoder`] over `CudaBackend`s, the device
//!   behind the one decode step (`kvtier_kernels::decode_step`: it implements
//!   `kvtier_kernels::Backend`);
//! - `stub` (without the feature): a [`GpuDecoder`] no value of which can exist, so every
//!   session runs on the CPU backend, as candle does without its `cuda` feature.
//!
//! # Model
//!
//! - The whole host arena is registered once (pinned, device-mapped, in chunks that are whole
//!   numbers of extents, so no block run straddles a registration). The GPU reads a session's
//!   extents in place over PCIe (zero-copy); nothing is copied into a staging buffer.
//! - A `CudaBackend` is compiled for ONE (geometry, policy): kernel loop bounds are NVRTC
//!   defines. Backends are created lazily, when the first session of a (geometry, policy) is
//!   [opened](GpuDecoder::open), up to `max_backends`; they share the registered arena. A session
//!   whose geometry/policy the kernels cannot run, or that would need a backend beyond the cap,
//!   is refused by [`GpuDecoder::supports`] / [`GpuDecoder::open`] and stays on the CPU path
//!   (`open` logs why). Creating a backend compiles the kernels (about a second), which is why
//!   it happens at session creation, not in a decode.
//! - Lanes (`backend.cuda.lanes`): the decoder is that many independent decoders on the device,
//!   each behind its own lock with its own backends and a share of the session slots. A
//!   session stays on the lane it was opened on (the least loaded); steps of different lanes
//!   run at once, and a step spanning lanes runs one call per lane, each on its own thread.
//! - Per (session, layer) the decoder remembers what the device has: the token count, how many
//!   leading blocks have final (full-block) summaries uploaded, and the arena extent each block
//!   is mapped to. Each step ([`kvtier_kernels::Backend::attend`]) uploads only the delta: summaries of new blocks
//!   and of the tail block (it changes with every token), page-table entries of new blocks or of
//!   blocks whose extent changed (a cold block promoted, or a block demoted), the token count.
//!
//! # Cold (NVMe) blocks, errors and the CPU fallback
//!
//! The step (`kvtier_kernels::decode`) does what is common to both backends: checks, the cold
//! tail and keep-set promotions before the append (the device selects on its own, so the step
//! selects on the CPU, with the same lane order and tie rule, for layers with cold blocks), and
//! the CPU answer after a device failure or a divergence. Blocks that stay cold are mapped on
//! the device to one zero-filled arena extent the decoder owns for its whole life, so even a
//! selection that diverged from the CPU's could never read an unmapped or reused address; once
//! such a block is promoted the extent change re-maps it. [`GpuDecoder`]'s own checks (session
//! open, geometry, `max_blocks`) answer `KernelError::Unavailable`, and the service then runs the
//! same request on the CPU.
//!
//! Rewriting positions (a rollback truncating a session and appending other tokens) is
//! invisible to the length bookkeeping when the length grows back: the service calls
//! [`GpuDecoder::invalidate`] after any truncation.

use kvtier_kernels::KernelError;
use kvtier_storage::{LayerView, StorageError};

#[cfg(feature = "cuda")]
mod decoder;
#[cfg(feature = "cuda")]
pub use decoder::{device_available, GpuDecoder};
#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::{device_available, GpuDecoder};

pub use crate::config::GpuSettings;

/// Failures of the CUDA decode path.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[cfg(feature = "cuda")]
    #[error(transparent)]
    Cuda(#[from] kvtier_kernels::cuda::CudaError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Storage(#[from] StorageError),
    /// The kernels cannot run this geometry/policy (or the backend cap is reached).
    #[error("geometry/policy not supported by the CUDA backend: {reason}")]
    Unsupported { reason: String },
    /// Every session slot of the session's backend is taken.
    #[error("all {max} CUDA session slots of this geometry are in use")]
    SessionsFull { max: u32 },
    /// The session was never opened on the GPU (or was closed).
    #[error("session {session} is not open on the GPU")]
    UnknownSession { session: u64 },
    /// The session is already open on the GPU.
    #[error("session {session} is already open on the GPU")]
    AlreadyOpen { session: u64 },
    /// The session appears twice in one batch.
    #[error("session {session} appears twice in one GPU decode")]
    DuplicateSession { session: u64 },
    /// The entry's KV cache or policy is not the one the session was opened with.
    #[error("session {session}: geometry or policy differs from the one opened on the GPU")]
    GeometryMismatch { session: u64 },
    /// The layer would outgrow the configured device capacity.
    #[error("layer {layer} would hold {blocks} blocks, more than the CUDA max_blocks {max}")]
    TooManyBlocks { layer: u32, blocks: u64, max: u32 },
}

/// The arena extent the device must map each block of `view` to: the block's own extent, or
/// `zero` while it is cold.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the decoder's; tested here
fn device_extents(view: &LayerView<'_>, zero: u64) -> Vec<u64> {
    (0..view.blocks())
        .map(|b| view.extent(b).map_or(zero, |f| f.offset() as u64))
        .collect()
}

#[cfg(test)]
mod tests {
    //! How the device maps blocks: logic that needs no device.

    use kvtier_kernels::remap::stale_runs;
    use kvtier_storage::testing::{Rng, SavedRuns};
    use kvtier_storage::{ArenaOptions, DType, Geometry, HostArena, KvCache};

    use super::*;

    const GEO: Geometry = Geometry {
        layers: 1,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 32,
        dtype: DType::Bf16,
        block_tokens: 16,
    };

    fn session(tokens: u64, rng: &mut Rng) -> KvCache {
        let n = tokens as usize * (GEO.kv_heads * GEO.head_dim) as usize;
        let mut payload = Vec::new();
        for _ in 0..2 * GEO.layers {
            payload.extend(GEO.dtype.encode_vec(&rng.normals(n)));
        }
        let arena = HostArena::new(&ArenaOptions::new(16 << 20, 4096)).unwrap();
        let mut kv = KvCache::new(GEO, arena).unwrap();
        kv.append(0, tokens, &payload).unwrap();
        kv
    }

    #[test]
    fn cold_blocks_map_to_the_zero_extent_and_are_remapped_once_promoted() {
        let mut rng = Rng::new(15);
        let mut kv = session(5 * 16 + 3, &mut rng);
        let saved = SavedRuns::of(&kv);
        let zero = 999_999;
        let own: Vec<u64> = device_extents(&kv.layer(0).unwrap(), zero);
        assert!(own.iter().all(|&f| f != zero));
        assert_eq!(
            stale_runs(&[], &own),
            vec![0..6],
            "first sync maps everything"
        );
        assert!(stale_runs(&own, &own).is_empty());
        kv.evict(0, 1);
        kv.evict(0, 2);
        kv.evict(0, 4);
        let cold = device_extents(&kv.layer(0).unwrap(), zero);
        assert_eq!(
            cold,
            vec![own[0], zero, zero, own[3], zero, own[5]],
            "cold blocks point at the zero extent, never at a freed extent"
        );
        assert_eq!(stale_runs(&own, &cold), vec![1..3, 4..5]);
        kv.promote(0, &[2], &saved).unwrap();
        let warm = device_extents(&kv.layer(0).unwrap(), zero);
        assert_ne!(warm[2], zero);
        assert_eq!(
            stale_runs(&cold, &warm),
            vec![2..3],
            "only the promoted block"
        );
        // New blocks after an append are stale too (the mapped table is shorter).
        let mut longer = warm.clone();
        longer.extend([7, 8]);
        assert_eq!(stale_runs(&warm, &longer), vec![6..8]);
    }
}
