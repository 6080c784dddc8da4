//! The CUDA decode path: [`GpuDecoder`] wraps `kvtier_kernels::cuda` for the engine.
//!
//! # Layout
//!
//! - this file: the decoder's interface types (entries, outputs, errors) and the CPU-side logic
//!   it needs (the cold-block plan, promotions, the device mapping of blocks), tested without a
//!   device;
//! - `decoder` (feature `cuda`, on by default): [`GpuDecoder`] over `CudaBackend`s;
//! - `stub` (without the feature): a [`GpuDecoder`] no value of which can exist, so every
//!   session runs on the CPU backend, as candle does without its `cuda` feature.
//!
//! # Model
//!
//! - The whole host arena is registered once (pinned, device-mapped, in chunks that are whole
//!   numbers of frames, so no block run straddles a registration). The GPU reads a session's
//!   frames in place over PCIe (zero-copy); nothing is copied into a staging buffer.
//! - A `CudaBackend` is compiled for ONE (geometry, policy): kernel loop bounds are NVRTC
//!   defines. Backends are created lazily, when the first session of a (geometry, policy) is
//!   [opened](GpuDecoder::open), up to `max_backends`; they share the registered arena. A session
//!   whose geometry/policy the kernels cannot run, or that would need a backend beyond the cap,
//!   is refused by [`GpuDecoder::supports`] / [`GpuDecoder::open`] and stays on the CPU path
//!   (`open` logs why). Creating a backend compiles the kernels (about a second), which is why
//!   it happens at session creation, not in a decode.
//! - Per (session, layer) the decoder remembers what the device has: the token count, how many
//!   leading blocks have final (full-block) summaries uploaded, and the arena frame each block
//!   is mapped to. Each [`GpuDecoder::decode`] uploads only the delta: summaries of new blocks
//!   and of the tail block (it changes with every token), page-table entries of new blocks or of
//!   blocks whose frame changed (a cold block promoted, or a block demoted), the token count.
//!
//! # Cold (NVMe) blocks
//!
//! The device selects on its own, so before a step the host must know which blocks it will
//! pick. For an entry whose layer has cold blocks, the decoder computes the keep-set on the CPU
//! exactly as `kvtier_kernels::decode_layer` does ([`plan_cold`]: `select_head` over the
//! post-append block count; the CPU and GPU selectors score in the same lane order with the
//! same tie rule, so both pick the same blocks) and promotes its cold blocks through the
//! entry's [`ColdSource`] before any append; a cold partial tail block is promoted first, since
//! the append writes into it. Blocks that stay cold are mapped on the device to one zero-filled
//! arena frame the decoder owns for its whole life, so even a selection that diverged from the
//! CPU's could never read an unmapped or reused address; once such a block is promoted the frame
//! change re-maps it.
//!
//! After the device step the decoder reads back the keep-sets of those entries and checks that
//! none names a block that is still cold. If one does (it should never), that step's output is
//! not trusted: the call is answered on the CPU over the CPU keep-sets (promoting any cold
//! block among them), a warning is logged and counted ([`GpuDecoder::cold_divergences`]), and
//! the diverging sessions' device state is dropped (their tile cache may hold zero tiles).
//!
//! # Errors and the CPU fallback
//!
//! Every check happens before the first append, as in `kvtier_kernels::decode_layer`: an
//! error from [`GpuDecoder::decode`] leaves every session unchanged (a promoted block is only a
//! cache fill), and the engine may answer the same request with the CPU path. A block a step
//! needs that is cold while the entry has no [`ColdSource`] is refused with
//! [`GpuError::NotResident`]; a failed read is the entry's [`StorageError::ColdRead`].
//! A device failure after the appends (a driver error mid-call) cannot be undone per layer, so
//! the decoder then answers that call on the CPU itself (select + attend over the appended
//! layer, the same result `decode_layer` gives), drops the device state of the batch's
//! sessions (re-uploaded on their next call) and reports `cpu_fallback` in the output.
//!
//! Rewriting positions (a rollback truncating a session and appending other tokens) is
//! invisible to the length bookkeeping when the length grows back: the engine calls
//! [`GpuDecoder::invalidate`] after any truncation.

use std::ops::Range;

use rayon::prelude::*;

use kvtier_kernels::select::{select_head, KeepSet, SelectScratch};
use kvtier_kernels::KernelError;
use kvtier_storage::{ColdSource, Frame, KvCache, LayerView, Policy, StorageError};

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
    /// The entry's KV cache does not have the geometry the session was opened with.
    #[error("session {session}: KV cache geometry differs from the one opened on the GPU")]
    GeometryMismatch { session: u64 },
    /// A block the step needs (its keep-set, or the tail block the append writes into) is
    /// cold and the entry has no [`ColdSource`] to read it from.
    #[error("layer {layer} block {block} is not resident in host memory and the entry has no colder tier to read it from")]
    NotResident { layer: u32, block: u32 },
    /// The layer would outgrow the configured device capacity.
    #[error("layer {layer} would hold {blocks} blocks, more than the CUDA max_blocks {max}")]
    TooManyBlocks { layer: u32, blocks: u64, max: u32 },
    /// `out` has the wrong length.
    #[error("output buffer has {got} floats, the batch needs {expected}")]
    OutputSize { expected: usize, got: usize },
    /// Empty batch.
    #[error("empty GPU decode batch")]
    EmptyBatch,
    /// The failure of one batch entry.
    #[error("batch entry {entry}: {source}")]
    Entry {
        entry: usize,
        #[source]
        source: Box<GpuError>,
    },
}

impl GpuError {
    /// The error without the batch-entry wrapper.
    pub fn root(&self) -> &GpuError {
        match self {
            GpuError::Entry { source, .. } => source.root(),
            e => e,
        }
    }

    /// The batch entry the error belongs to, if it names one.
    pub fn entry(&self) -> Option<usize> {
        match self {
            GpuError::Entry { entry, .. } => Some(*entry),
            _ => None,
        }
    }

    /// Whether the device or driver failed (rather than the step being one the GPU path does
    /// not take).
    pub fn is_device_failure(&self) -> bool {
        #[cfg(feature = "cuda")]
        return matches!(self.root(), GpuError::Cuda(_));
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// The storage failure at the root, if that is what it is (a full arena, a failed read).
    pub fn storage(&self) -> Option<&StorageError> {
        match self.root() {
            GpuError::Storage(s) => Some(s),
            _ => None,
        }
    }
}

/// One session's part of a GPU decode step (the GPU twin of `kvtier_kernels::DecodeEntry`).
pub struct GpuEntry<'a> {
    /// Session id given to [`GpuDecoder::open`].
    pub session: u64,
    pub kv: &'a mut KvCache,
    /// Position of the new token: the layer's current length.
    pub position: u64,
    /// `[q_heads][head_dim]` f32.
    pub q: &'a [f32],
    /// The new token's `[kv_heads][head_dim]` K and V in the session dtype.
    pub k: &'a [u8],
    pub v: &'a [u8],
    /// Where cold blocks of this session are read from (None: a step that needs a cold block
    /// is refused with [`GpuError::NotResident`]).
    pub cold: Option<&'a dyn ColdSource>,
}

/// What one entry's step did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuEntryStats {
    /// Blocks in the layer after the append.
    pub blocks_total: u32,
    /// Selected (block, kv-head) tiles over all kv-heads.
    pub tiles_selected: u32,
    /// The keep-set per kv-head, when asked for (one extra device readback) and for every
    /// entry whose layer had cold blocks (read back to check it).
    pub keep: Option<KeepSet>,
    /// Blocks read back from the colder tier for this step (keep-set and tail).
    pub blocks_promoted: u32,
    /// Bytes those reads brought into the host tier (whole block runs).
    pub bytes_promoted: u64,
}

/// Result of [`GpuDecoder::decode`]. Cache counters are per call (the device counts them for
/// the whole batch), summed over the device calls a batch was split into.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuDecodeOutput {
    pub entries: Vec<GpuEntryStats>,
    /// Tiles found in the GPU tile cache.
    pub cache_hits: u64,
    /// Tiles read from pinned host memory.
    pub cache_misses: u64,
    /// Bytes moved host -> GPU.
    pub bytes_moved: u64,
    /// The device failed after the appends, or selected a block that was still cold, and the
    /// CPU answered (see the module docs).
    pub cpu_fallback: bool,
    /// Entries whose device keep-set named a block that was still cold (0 unless the device
    /// and CPU selectors diverged).
    pub cold_divergences: u32,
}

/// What a step of one layer with cold blocks must read back before its append: the keep-set
/// `decode_layer` selects (which the device selects too) and the cold blocks among it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColdPlan {
    pub keep: KeepSet,
    /// Cold blocks of `keep`, ascending.
    pub promote: Vec<u32>,
}

/// Below this many scored blocks [`plan_cold`] stays on the calling thread.
const PARALLEL_MIN_BLOCKS: usize = 256;

/// The keep-set `kvtier_kernels::decode_layer` selects for a step at `position` (before the
/// append, over the post-append block count) and its cold blocks, or None when every block of
/// the layer is resident (the device then needs no help). `q` must have passed `check_query`
/// and `position` must be the layer's length.
pub fn plan_cold(
    kv: &KvCache,
    layer: u32,
    position: u64,
    q: &[f32],
    policy: &Policy,
) -> Result<Option<ColdPlan>, GpuError> {
    let view = kv.layer(layer)?;
    if (0..view.blocks()).all(|b| view.frame(b).is_some()) {
        return Ok(None);
    }
    if position != view.tokens() {
        return Err(StorageError::PositionMismatch {
            layer,
            expected: view.tokens(),
            got: position,
        }
        .into());
    }
    let geo = view.geometry();
    let after = geo.blocks_for(position + 1) as usize;
    let select_one = |scratch: &mut SelectScratch, h: usize| {
        let mut blocks = Vec::new();
        select_head(q, &view, after, policy, h, scratch, &mut blocks);
        blocks
    };
    let heads = 0..geo.kv_heads as usize;
    // Scoring a long layer's heads is the one CPU cost a cold GPU step adds: spread it out.
    let per_head: Vec<Vec<u32>> = if after * geo.kv_heads as usize >= PARALLEL_MIN_BLOCKS {
        heads
            .into_par_iter()
            .map_init(SelectScratch::default, select_one)
            .collect()
    } else {
        let mut scratch = SelectScratch::default();
        heads.map(|h| select_one(&mut scratch, h)).collect()
    };
    let mut keep = KeepSet::new();
    for blocks in per_head {
        keep.push_head(blocks);
    }
    let promote = kv.cold_among(layer, &keep.union());
    Ok(Some(ColdPlan { keep, promote }))
}

/// Wraps an error as batch entry `entry`'s.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the decoder's; tested here
fn at(entry: usize) -> impl Fn(GpuError) -> GpuError {
    move |e| GpuError::Entry {
        entry,
        source: Box::new(e),
    }
}

/// Promotes `blocks` (cold ones of `layer`) through the entry's colder tier; returns how many
/// were read. All-or-nothing, like [`KvCache::promote`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the decoder's; tested here
fn promote(layer: u32, e: &mut GpuEntry<'_>, blocks: &[u32]) -> Result<u32, GpuError> {
    let Some(&first) = blocks.first() else {
        return Ok(0);
    };
    let source = e.cold.ok_or(GpuError::NotResident {
        layer,
        block: first,
    })?;
    Ok(e.kv.promote(layer, blocks, source)? as u32)
}

/// Promotes the layer's tail block when it is partial and cold: the append writes into it.
/// Skipped when the position is wrong (the append's own check reports that).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the decoder's; tested here
fn promote_tail(layer: u32, e: &mut GpuEntry<'_>) -> Result<u32, GpuError> {
    let view = e.kv.layer(layer)?;
    let bt = view.geometry().block_tokens as u64;
    let tokens = view.tokens();
    if e.position != tokens || tokens % bt == 0 || view.frame(view.blocks() - 1).is_some() {
        return Ok(0);
    }
    let tail = view.blocks() as u32 - 1;
    promote(layer, e, &[tail])
}

/// The arena frame the device must map each block of `view` to: the block's own frame, or
/// `zero` while it is cold.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the decoder's; tested here
fn device_frames(view: &LayerView<'_>, zero: u32) -> Vec<u32> {
    (0..view.blocks())
        .map(|b| view.frame(b).map_or(zero, Frame::id))
        .collect()
}

/// Maximal runs of blocks whose wanted frame differs from the mapped one (`have` is shorter
/// than `want` when blocks are new).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the decoder's; tested here
fn stale_runs(have: &[u32], want: &[u32]) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    let mut b = 0;
    while b < want.len() {
        if have.get(b) == Some(&want[b]) {
            b += 1;
            continue;
        }
        let start = b;
        while b < want.len() && have.get(b) != Some(&want[b]) {
            b += 1;
        }
        runs.push(start..b);
    }
    runs
}

#[cfg(test)]
mod tests {
    //! What a cold GPU step reads back and how the device maps blocks: logic that needs no
    //! device, checked against the CPU decode step.

    use std::collections::HashMap;

    use kvtier_kernels::{decode_layer, DecodeEntry};
    use kvtier_storage::testing::Rng;
    use kvtier_storage::{ArenaOptions, DType, Geometry, HostArena};

    use super::*;

    const GEO: Geometry = Geometry {
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 32,
        dtype: DType::Bf16,
        block_tokens: 16,
    };

    const POLICY: Policy = Policy {
        sink_blocks: 1,
        local_blocks: 2,
        top_k: 3,
    };

    fn arena() -> HostArena {
        HostArena::new(&ArenaOptions::new(16 << 20, 4096)).unwrap()
    }

    /// Stored runs standing in for the NVMe tier (the GPU tests use the real page store).
    struct Saved(HashMap<(u32, u32), Vec<u8>>);

    impl ColdSource for Saved {
        fn read_runs(
            &self,
            layer: u32,
            blocks: &[u32],
            frames: &mut [Frame],
        ) -> kvtier_storage::Result<()> {
            for (b, f) in blocks.iter().zip(frames) {
                let run = self.0.get(&(layer, *b)).ok_or(StorageError::ColdRead {
                    layer,
                    block: *b,
                    reason: "not saved".into(),
                    corrupt: false,
                })?;
                f.put_run(run);
            }
            Ok(())
        }
    }

    fn save_all(kv: &KvCache) -> Saved {
        let mut m = HashMap::new();
        for l in 0..GEO.layers {
            for b in 0..kv.layer(l).unwrap().blocks() as u32 {
                m.insert((l, b), kv.run(l, b).unwrap().to_vec());
            }
        }
        Saved(m)
    }

    fn row(rng: &mut Rng) -> Vec<u8> {
        GEO.dtype
            .encode_vec(&rng.normals((GEO.kv_heads * GEO.head_dim) as usize))
    }

    /// Two copies of one session of `tokens` tokens: the first stays in RAM.
    fn twins(tokens: u64, rng: &mut Rng) -> (KvCache, KvCache) {
        let n = tokens as usize * (GEO.kv_heads * GEO.head_dim) as usize;
        let mut payload = Vec::new();
        for _ in 0..2 * GEO.layers {
            payload.extend(GEO.dtype.encode_vec(&rng.normals(n)));
        }
        let mut a = KvCache::new(GEO, arena()).unwrap();
        let mut b = KvCache::new(GEO, arena()).unwrap();
        a.append(0, tokens, &payload).unwrap();
        b.append(0, tokens, &payload).unwrap();
        (a, b)
    }

    #[test]
    fn the_cold_plan_is_the_cpu_steps_keep_set_and_its_cold_blocks() {
        let mut rng = Rng::new(11);
        // Below the budget, at it, full and partial tails, and long enough for the parallel
        // scoring branch (200 blocks x 2 heads).
        for tokens in [
            20u64,
            6 * 16,
            6 * 16 + 1,
            40 * 16,
            40 * 16 + 7,
            200 * 16 + 3,
        ] {
            let (mut hot, mut cold) = twins(tokens, &mut rng);
            let blocks = cold.layer(0).unwrap().blocks() as u32;
            // Every other block cold, never the tail (the append writes into it).
            for b in (0..blocks - 1).step_by(2) {
                assert!(cold.evict(0, b));
            }
            for step in 0..6 {
                let q = rng.normals((GEO.q_heads * GEO.head_dim) as usize);
                let (k, v) = (row(&mut rng), row(&mut rng));
                let pos = hot.tokens(0).unwrap();
                let plan = plan_cold(&cold, 0, pos, &q, &POLICY)
                    .unwrap()
                    .expect("the layer has cold blocks");
                let mut out = vec![0f32; q.len()];
                let stats = decode_layer(
                    0,
                    &mut [DecodeEntry {
                        kv: &mut hot,
                        policy: POLICY,
                        position: pos,
                        q: &q,
                        k: &k,
                        v: &v,
                        cold: None,
                    }],
                    &mut out,
                )
                .unwrap();
                assert_eq!(plan.keep, stats[0].keep, "{tokens} tokens, step {step}");
                let union = plan.keep.union();
                assert_eq!(plan.promote, cold.cold_among(0, &union));
                assert!(plan.promote.iter().all(|b| !cold.is_resident(0, *b)));
                if tokens >= 40 * 16 {
                    assert!(
                        union.len() < blocks as usize,
                        "a top-k step must not promote everything"
                    );
                }
                // Keep the twin in step; the plan's blocks stay cold (as if never promoted).
                cold.append_layer(0, pos, &k, &v).unwrap();
            }
        }
    }

    #[test]
    fn a_resident_layer_needs_no_plan_and_a_wrong_position_is_refused() {
        let mut rng = Rng::new(12);
        let (_, mut kv) = twins(50, &mut rng);
        let q = rng.normals((GEO.q_heads * GEO.head_dim) as usize);
        assert_eq!(plan_cold(&kv, 0, 50, &q, &POLICY).unwrap(), None);
        assert!(kv.evict(1, 0));
        assert_eq!(plan_cold(&kv, 0, 50, &q, &POLICY).unwrap(), None);
        assert!(plan_cold(&kv, 1, 50, &q, &POLICY).unwrap().is_some());
        let e = plan_cold(&kv, 1, 49, &q, &POLICY).unwrap_err();
        assert!(
            matches!(
                e,
                GpuError::Storage(StorageError::PositionMismatch {
                    expected: 50,
                    got: 49,
                    ..
                })
            ),
            "{e}"
        );
        assert!(matches!(
            plan_cold(&kv, 2, 50, &q, &POLICY),
            Err(GpuError::Storage(StorageError::LayerOutOfRange { .. }))
        ));
    }

    fn entry<'a>(
        kv: &'a mut KvCache,
        position: u64,
        q: &'a [f32],
        kv_row: &'a [u8],
        cold: Option<&'a dyn ColdSource>,
    ) -> GpuEntry<'a> {
        GpuEntry {
            session: 1,
            kv,
            position,
            q,
            k: kv_row,
            v: kv_row,
            cold,
        }
    }

    #[test]
    fn a_cold_partial_tail_is_promoted_before_the_append() {
        let mut rng = Rng::new(13);
        let (_, mut kv) = twins(40, &mut rng); // 3 blocks, the tail holds 8 tokens
        let saved = save_all(&kv);
        let q = rng.normals((GEO.q_heads * GEO.head_dim) as usize);
        let r = row(&mut rng);
        assert!(kv.evict(0, 2));
        // No colder tier: a typed refusal naming the tail.
        let e = promote_tail(0, &mut entry(&mut kv, 40, &q, &r, None)).unwrap_err();
        assert!(
            matches!(e, GpuError::NotResident { layer: 0, block: 2 }),
            "{e}"
        );
        // A wrong position reads nothing (the append check reports it).
        let n = promote_tail(0, &mut entry(&mut kv, 39, &q, &r, Some(&saved))).unwrap();
        assert_eq!((n, kv.is_resident(0, 2)), (0, false));
        let n = promote_tail(0, &mut entry(&mut kv, 40, &q, &r, Some(&saved))).unwrap();
        assert_eq!((n, kv.is_resident(0, 2)), (1, true));
        assert_eq!(kv.run(0, 2).unwrap(), &saved.0[&(0, 2)][..]);
        // A full last block is not a tail: the new token opens a fresh block.
        let (_, mut full) = twins(48, &mut rng);
        assert!(full.evict(0, 2));
        let n = promote_tail(0, &mut entry(&mut full, 48, &q, &r, None)).unwrap();
        assert_eq!((n, full.is_resident(0, 2)), (0, false));
        // A failed read is the typed storage error and changes nothing.
        let empty = Saved(HashMap::new());
        let e = promote_tail(0, &mut entry(&mut kv, 40, &q, &r, Some(&empty)));
        assert_eq!(e.unwrap(), 0, "already resident: nothing to read");
        assert!(kv.evict(0, 2));
        let e = promote_tail(0, &mut entry(&mut kv, 40, &q, &r, Some(&empty))).unwrap_err();
        assert!(
            matches!(
                e,
                GpuError::Storage(StorageError::ColdRead { block: 2, .. })
            ),
            "{e}"
        );
        assert!(!kv.is_resident(0, 2));
    }

    #[test]
    fn promote_needs_a_source_only_when_there_is_something_to_read() {
        let mut rng = Rng::new(14);
        let (_, mut kv) = twins(64, &mut rng);
        let saved = save_all(&kv);
        let q = rng.normals((GEO.q_heads * GEO.head_dim) as usize);
        let r = row(&mut rng);
        assert_eq!(
            promote(0, &mut entry(&mut kv, 64, &q, &r, None), &[]).unwrap(),
            0
        );
        kv.evict(0, 1);
        kv.evict(0, 3);
        let e = promote(0, &mut entry(&mut kv, 64, &q, &r, None), &[1, 3]).unwrap_err();
        assert!(matches!(e, GpuError::NotResident { block: 1, .. }), "{e}");
        let n = promote(0, &mut entry(&mut kv, 64, &q, &r, Some(&saved)), &[1, 3]).unwrap();
        assert_eq!(n, 2);
        assert!(kv.is_resident(0, 1) && kv.is_resident(0, 3));
    }

    #[test]
    fn cold_blocks_map_to_the_zero_frame_and_are_remapped_once_promoted() {
        let mut rng = Rng::new(15);
        let (_, mut kv) = twins(5 * 16 + 3, &mut rng);
        let saved = save_all(&kv);
        let zero = 999_999;
        let own: Vec<u32> = device_frames(&kv.layer(0).unwrap(), zero);
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
        let cold = device_frames(&kv.layer(0).unwrap(), zero);
        assert_eq!(
            cold,
            vec![own[0], zero, zero, own[3], zero, own[5]],
            "cold blocks point at the zero frame, never at a freed frame"
        );
        assert_eq!(stale_runs(&own, &cold), vec![1..3, 4..5]);
        kv.promote(0, &[2], &saved).unwrap();
        let warm = device_frames(&kv.layer(0).unwrap(), zero);
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
