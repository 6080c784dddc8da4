//! The CUDA decode path: [`GpuDecoder`] wraps `kvtier_kernels::cuda` for the engine.
//!
//! # Model
//!
//! - The whole host arena is registered once (pinned, device-mapped, in chunks that are whole
//!   numbers of frames, so no block run straddles a registration). The GPU reads a session's
//!   frames in place over PCIe (zero-copy); nothing is copied into a staging buffer.
//! - A [`CudaBackend`] is compiled for ONE (geometry, policy): kernel loop bounds are NVRTC
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

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use kvtier_kernels::attention::attend_keep_sets;
use kvtier_kernels::cuda::{
    device_context, AttentionMath, CudaBackend, CudaConfig, CudaError, CudaGeometry, DecodeItem,
    KvDtype, PinnedRegion, SelectPolicy, SummaryDtype,
};
use kvtier_kernels::select::{check_query, select, select_head, KeepSet, SelectScratch};
use kvtier_kernels::KernelError;
use kvtier_storage::{
    ColdSource, DType, Frame, Geometry, HostArena, KvCache, LayerView, Policy, StorageError,
};

/// Sizing of the CUDA path (`[backend.cuda]` in the config).
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSettings {
    /// CUDA device ordinal.
    pub device: usize,
    /// Distinct (geometry, policy) backends at most; each holds its own device state.
    pub max_backends: usize,
    /// Sessions per backend with device state.
    pub max_sessions: u32,
    /// Blocks per session layer at most (context capacity = max_blocks x block_tokens).
    pub max_blocks: u32,
    /// Sessions per device call; larger batches are split.
    pub max_batch: u32,
    /// GPU tile-cache slots per (session, layer, kv head); 0 = twice the keep-set size.
    pub cache_slots: u32,
    /// Bytes per cuMemHostRegister call (rounded down to whole frames, at least one).
    pub register_chunk: usize,
}

impl Default for GpuSettings {
    fn default() -> Self {
        GpuSettings {
            device: 0,
            max_backends: 2,
            max_sessions: 8,
            // 1M tokens at B = 128.
            max_blocks: 8192,
            max_batch: 8,
            cache_slots: 0,
            register_chunk: 1 << 30,
        }
    }
}

/// Failures of the CUDA decode path.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
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

/// Device-side bookkeeping of one session layer.
#[derive(Debug, Clone, Default)]
struct LayerSync {
    /// Token count the device has.
    tokens: u64,
    /// Leading blocks whose (full, final) summaries are on the device.
    final_blocks: usize,
    /// Arena frame each block is mapped to on the device.
    frames: Vec<u32>,
}

struct GpuSession {
    backend: usize,
    slot: u32,
    geometry: Geometry,
    policy: Policy,
    layers: Vec<LayerSync>,
}

struct Backend {
    geometry: Geometry,
    policy: Policy,
    be: CudaBackend,
    free_slots: Vec<u32>,
}

/// The CUDA decode path for one arena (see the module docs). Not `Sync`: the engine keeps it
/// behind a mutex, so device calls are serialised.
pub struct GpuDecoder {
    settings: GpuSettings,
    device_name: String,
    backends: Vec<Backend>,
    sessions: HashMap<u64, GpuSession>,
    /// Zero-filled frame every cold block is mapped to on the device; never written, held for
    /// the decoder's life so its address is never reused while the device may read it.
    zero: Frame,
    /// Steps whose device keep-set named a block that was still cold.
    cold_divergences: u64,
    /// Testing aid ([`GpuDecoder::fault_leave_cold`]): keep-set blocks to leave unpromoted.
    leave_cold: u32,
    region: Arc<PinnedRegion>,
    /// Keeps the registered mapping alive until `region` (declared above) is unregistered.
    arena: HostArena,
}

impl std::fmt::Debug for GpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDecoder")
            .field("device", &self.device_name)
            .field("backends", &self.backends.len())
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

fn kv_dtype(d: DType) -> KvDtype {
    match d {
        DType::Bf16 => KvDtype::Bf16,
        DType::F16 => KvDtype::F16,
        DType::F32 => KvDtype::F32,
    }
}

impl GpuDecoder {
    /// Opens device `cfg.device` and registers the whole arena with it. One decoder per arena:
    /// a second registration of the same memory fails ([`CudaError::Pin`]).
    pub fn new(arena: &HostArena, cfg: &GpuSettings) -> Result<Self, GpuError> {
        let unsupported = |reason: String| GpuError::Unsupported { reason };
        if cfg.max_backends == 0 {
            return Err(unsupported("max_backends must be at least 1".into()));
        }
        let ctx = device_context(cfg.device)?;
        let device_name = ctx.name().map_err(|source| CudaError::Driver {
            call: "cuDeviceGetName",
            source,
        })?;
        let (base, len) = arena.region();
        let fb = arena.frame_bytes();
        let chunk = (cfg.register_chunk / fb).max(1) * fb;
        // SAFETY: [base, base + len) is the arena's live anonymous mapping; `self.arena` (a
        // clone sharing it) is dropped after `self.region`, so the mapping outlives the
        // registration. The pointer is only used by the driver and the device, which read
        // frames while the decoder holds the owning sessions' `&mut KvCache`.
        let region = unsafe { PinnedRegion::register_chunked(&ctx, base.cast_mut(), len, chunk) }?;
        // Taken after the registration succeeded, so a failed start holds no frame.
        let zero = arena.alloc()?;
        tracing::info!(
            device = %device_name,
            pinned = len,
            chunks = region.chunk_count(),
            "cuda: host arena registered"
        );
        Ok(GpuDecoder {
            settings: cfg.clone(),
            device_name,
            backends: Vec::new(),
            sessions: HashMap::new(),
            zero,
            cold_divergences: 0,
            leave_cold: 0,
            region: Arc::new(region),
            arena: arena.clone(),
        })
    }

    /// e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Steps so far whose device keep-set named a block that was still cold (each was answered
    /// on the CPU; see the module docs). Nonzero means the selectors diverged.
    pub fn cold_divergences(&self) -> u64 {
        self.cold_divergences
    }

    /// Testing aid, the only way to reach the divergence check: on the next step with cold
    /// blocks, up to `blocks` cold keep-set blocks per entry (the last ones) stay cold through
    /// the device step, as if the device had selected blocks the CPU did not. Not for
    /// production use.
    #[doc(hidden)]
    pub fn fault_leave_cold(&mut self, blocks: u32) {
        self.leave_cold = blocks;
    }

    /// The backend configuration a (geometry, policy) would run with, validated.
    fn config_for(&self, geo: &Geometry, policy: &Policy) -> Result<CudaConfig, GpuError> {
        let s = &self.settings;
        let sp = SelectPolicy {
            sink_blocks: policy.sink_blocks,
            local_blocks: policy.local_blocks,
            top_k: policy.top_k,
        };
        let cfg = CudaConfig {
            geometry: CudaGeometry {
                layers: geo.layers,
                q_heads: geo.q_heads,
                kv_heads: geo.kv_heads,
                head_dim: geo.head_dim,
                block_tokens: geo.block_tokens,
                dtype: kv_dtype(geo.dtype),
            },
            policy: sp,
            max_sessions: s.max_sessions,
            max_blocks: s.max_blocks,
            max_batch: s.max_batch.min(s.max_sessions),
            cache_slots: if s.cache_slots == 0 {
                2 * sp.keep_max()
            } else {
                s.cache_slots
            },
            // f32: selection bit-identical to the CPU selector (bf16 summaries would select
            // differently from the CPU path, and are slower on the GPU today: bench/gpu/NOTES).
            summary_dtype: SummaryDtype::F32,
            // Tensor cores where the geometry allows (outputs within ~2e-6 of the fp32 path,
            // hot steps ~20% faster: bench/gpu/NOTES.md v27); fp32 FMAs elsewhere.
            attention: AttentionMath::TensorCores,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn backend_of(&self, geo: &Geometry, policy: &Policy) -> Option<usize> {
        self.backends
            .iter()
            .position(|b| b.geometry == *geo && b.policy == *policy)
    }

    /// Why sessions of this (geometry, policy) cannot run on the GPU, if they cannot.
    pub fn check(&self, geo: &Geometry, policy: &Policy) -> Result<(), GpuError> {
        self.config_for(geo, policy)
            .map_err(|e| GpuError::Unsupported {
                reason: e.to_string(),
            })?;
        if self.backend_of(geo, policy).is_none()
            && self.backends.len() >= self.settings.max_backends
        {
            return Err(GpuError::Unsupported {
                reason: format!(
                    "max_backends = {} distinct geometries/policies already in use",
                    self.settings.max_backends
                ),
            });
        }
        Ok(())
    }

    /// Whether sessions of this (geometry, policy) can run on the GPU.
    pub fn supports(&self, geo: &Geometry, policy: &Policy) -> bool {
        self.check(geo, policy).is_ok()
    }

    /// Gives session `session` device state (creating its backend on first use). On error the
    /// session stays on the CPU path; the reason is logged.
    pub fn open(&mut self, session: u64, geo: &Geometry, policy: &Policy) -> Result<(), GpuError> {
        let r = self.open_inner(session, geo, policy);
        if let Err(e) = &r {
            tracing::info!(session, error = %e, "cuda: session stays on the CPU path");
        }
        r
    }

    fn open_inner(
        &mut self,
        session: u64,
        geo: &Geometry,
        policy: &Policy,
    ) -> Result<(), GpuError> {
        if self.sessions.contains_key(&session) {
            return Err(GpuError::AlreadyOpen { session });
        }
        self.check(geo, policy)?;
        let bi = match self.backend_of(geo, policy) {
            Some(i) => i,
            None => {
                let cfg = self.config_for(geo, policy)?;
                let mut be = CudaBackend::new(self.settings.device, cfg)?;
                be.attach_host(self.region.clone())?;
                tracing::info!(?geo, ?policy, "cuda: backend compiled");
                self.backends.push(Backend {
                    geometry: *geo,
                    policy: *policy,
                    be,
                    free_slots: (0..cfg.max_sessions).rev().collect(),
                });
                self.backends.len() - 1
            }
        };
        let b = &mut self.backends[bi];
        let slot = b.free_slots.pop().ok_or(GpuError::SessionsFull {
            max: b.be.config().max_sessions,
        })?;
        if let Err(e) = b.be.open_session(slot) {
            b.free_slots.push(slot);
            return Err(e.into());
        }
        self.sessions.insert(
            session,
            GpuSession {
                backend: bi,
                slot,
                geometry: *geo,
                policy: *policy,
                layers: vec![LayerSync::default(); geo.layers as usize],
            },
        );
        Ok(())
    }

    /// Releases the session's device state.
    pub fn close(&mut self, session: u64) -> Result<(), GpuError> {
        let s = self
            .sessions
            .remove(&session)
            .ok_or(GpuError::UnknownSession { session })?;
        let b = &mut self.backends[s.backend];
        b.free_slots.push(s.slot);
        b.be.close_session(s.slot)?;
        Ok(())
    }

    /// Whether `session` is open on the GPU.
    pub fn is_open(&self, session: u64) -> bool {
        self.sessions.contains_key(&session)
    }

    /// Forgets what the device holds for `session` (call after truncating its cache): the
    /// next decode re-uploads everything and its GPU tile cache starts empty.
    pub fn invalidate(&mut self, session: u64) -> Result<(), GpuError> {
        let s = self
            .sessions
            .get_mut(&session)
            .ok_or(GpuError::UnknownSession { session })?;
        reset(&mut self.backends[s.backend].be, s)
    }

    /// One decode step of `layer` for every entry; `out` receives `[entry][q_heads][head_dim]`.
    /// Validates like `decode_layer`, promotes what the step needs from each entry's colder
    /// tier, and fails before any append (see the module docs); `want_keep` also reads the
    /// keep-sets back.
    pub fn decode(
        &mut self,
        layer: u32,
        entries: &mut [GpuEntry<'_>],
        out: &mut [f32],
        want_keep: bool,
    ) -> Result<GpuDecodeOutput, GpuError> {
        if entries.is_empty() {
            return Err(GpuError::EmptyBatch);
        }
        let mut offsets = Vec::with_capacity(entries.len() + 1);
        offsets.push(0usize);
        for (i, e) in entries.iter().enumerate() {
            self.check_entry(layer, e, &entries[..i]).map_err(at(i))?;
            let geo = e.kv.geometry();
            offsets.push(offsets[i] + (geo.q_heads * geo.head_dim) as usize);
        }
        let expected = offsets[entries.len()];
        if out.len() != expected {
            return Err(GpuError::OutputSize {
                expected,
                got: out.len(),
            });
        }
        let mut promoted = vec![0u32; entries.len()];
        for (i, e) in entries.iter_mut().enumerate() {
            promoted[i] = promote_tail(layer, e).map_err(at(i))?;
        }
        let mut needs = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter().enumerate() {
            needs.push(
                e.kv.check_layer_append(layer, e.position, e.k, e.v)
                    .map_err(|s| at(i)(s.into()))?,
            );
        }
        let mut reserved = Vec::with_capacity(entries.len());
        for (i, (e, &n)) in entries.iter().zip(&needs).enumerate() {
            reserved.push(e.kv.arena().alloc_many(n).map_err(|s| at(i)(s.into()))?);
        }
        // Layers with cold blocks: the keep-set the device will select, its cold blocks read
        // back now, before the append, so a failed read still changes nothing.
        let mut plans: Vec<Option<ColdPlan>> = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter_mut().enumerate() {
            let policy = self.sessions[&e.session].policy;
            let plan = plan_cold(e.kv, layer, e.position, e.q, &policy).map_err(at(i))?;
            if let Some(p) = &plan {
                let leave = (self.leave_cold as usize).min(p.promote.len());
                let wanted = &p.promote[..p.promote.len() - leave];
                promoted[i] += promote(layer, e, wanted).map_err(at(i))?;
            }
            plans.push(plan);
        }
        if plans.iter().any(Option::is_some) {
            self.leave_cold = 0;
        }
        // Nothing has changed so far (a promoted block is only a cache fill). From here on the
        // call succeeds.
        for (e, frames) in entries.iter_mut().zip(&mut reserved) {
            e.kv.append_layer_reserved(layer, e.position, e.k, e.v, frames)
                .expect("validated append cannot fail");
        }
        let checked: Vec<bool> = plans.iter().map(Option::is_some).collect();
        let mut result = match self.run_device(layer, entries, &offsets, out, want_keep, &checked) {
            Ok(o) => {
                let diverged: Vec<usize> = (0..entries.len())
                    .filter(|&i| {
                        checked[i] && {
                            let keep = o.entries[i].keep.as_ref().expect("read back when checked");
                            !entries[i].kv.cold_among(layer, &keep.union()).is_empty()
                        }
                    })
                    .collect();
                if diverged.is_empty() {
                    o
                } else {
                    self.cold_divergences += diverged.len() as u64;
                    tracing::warn!(
                        layer,
                        entries = ?diverged,
                        "cuda: the device selected blocks that are still on NVMe; its output is discarded and the CPU answers"
                    );
                    // Their tile caches may now hold tiles read from the zero frame.
                    for &i in &diverged {
                        self.reset_session(entries[i].session);
                    }
                    let mut f = self.cpu_fallback(layer, entries, out, &plans)?;
                    f.cold_divergences = diverged.len() as u32;
                    f
                }
            }
            Err(err) => {
                tracing::warn!(layer, error = %err, "cuda: device step failed after the appends; answering on the CPU");
                for e in entries.iter() {
                    self.reset_session(e.session);
                }
                self.cpu_fallback(layer, entries, out, &plans)?
            }
        };
        for ((st, e), p) in result.entries.iter_mut().zip(entries.iter()).zip(promoted) {
            st.blocks_promoted += p;
            st.bytes_promoted = st.blocks_promoted as u64 * e.kv.geometry().block_bytes() as u64;
        }
        Ok(result)
    }

    /// Drops the device state of `session` (re-uploaded on its next call), logging a failure.
    fn reset_session(&mut self, session: u64) {
        if let Some(s) = self.sessions.get_mut(&session) {
            if let Err(r) = reset(&mut self.backends[s.backend].be, s) {
                tracing::warn!(session, error = %r, "cuda: session reset failed");
            }
        }
    }

    /// Every check of one entry that needs no device and reads nothing: session, geometry,
    /// query, payload sizes and capacity.
    fn check_entry(
        &self,
        layer: u32,
        e: &GpuEntry<'_>,
        before: &[GpuEntry<'_>],
    ) -> Result<(), GpuError> {
        let s = self
            .sessions
            .get(&e.session)
            .ok_or(GpuError::UnknownSession { session: e.session })?;
        if before.iter().any(|b| b.session == e.session) {
            return Err(GpuError::DuplicateSession { session: e.session });
        }
        let geo = e.kv.geometry();
        if *geo != s.geometry {
            return Err(GpuError::GeometryMismatch { session: e.session });
        }
        check_query(geo, e.q)?;
        let one = geo.token_bytes();
        for (what, bytes) in [("k", e.k), ("v", e.v)] {
            if bytes.len() != one {
                return Err(StorageError::PayloadSize {
                    what,
                    expected: one,
                    got: bytes.len(),
                }
                .into());
            }
        }
        e.kv.layer(layer)?;
        let after = geo.blocks_for(e.position + 1);
        if after > self.settings.max_blocks as u64 {
            return Err(GpuError::TooManyBlocks {
                layer,
                blocks: after,
                max: self.settings.max_blocks,
            });
        }
        Ok(())
    }

    /// Syncs the batch's layer state to the device and runs it, one device call per (backend,
    /// max_batch chunk). Keep-sets are read back for every chunk when `want_keep`, else for
    /// chunks holding an entry marked in `checked`.
    fn run_device(
        &mut self,
        layer: u32,
        entries: &[GpuEntry<'_>],
        offsets: &[usize],
        out: &mut [f32],
        want_keep: bool,
        checked: &[bool],
    ) -> Result<GpuDecodeOutput, GpuError> {
        let mut result = GpuDecodeOutput {
            entries: vec![
                GpuEntryStats {
                    blocks_total: 0,
                    tiles_selected: 0,
                    keep: None,
                    blocks_promoted: 0,
                    bytes_promoted: 0,
                };
                entries.len()
            ],
            ..Default::default()
        };
        let zero = self.zero.id();
        // Entry indices per backend, in batch order.
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let bi = self.sessions[&e.session].backend;
            match groups.iter_mut().find(|g| g.0 == bi) {
                Some(g) => g.1.push(i),
                None => groups.push((bi, vec![i])),
            }
        }
        for (bi, idx) in groups {
            let max_batch = self.backends[bi].be.config().max_batch as usize;
            for chunk in idx.chunks(max_batch) {
                let mut items = Vec::with_capacity(chunk.len());
                for &i in chunk {
                    let e = &entries[i];
                    let s = self.sessions.get_mut(&e.session).expect("checked");
                    let view = e.kv.layer(layer)?;
                    sync_layer(
                        &mut self.backends[bi].be,
                        &self.arena,
                        zero,
                        s,
                        layer,
                        &view,
                    )?;
                    items.push(DecodeItem {
                        slot: s.slot,
                        q: e.q,
                    });
                }
                let be = &mut self.backends[bi].be;
                let lo = be.decode_layer(layer, &items)?;
                let keeps = if want_keep || chunk.iter().any(|&i| checked[i]) {
                    Some(be.last_keep_sets(layer)?)
                } else {
                    None
                };
                let mut at = 0;
                for (ci, &i) in chunk.iter().enumerate() {
                    let n = offsets[i + 1] - offsets[i];
                    out[offsets[i]..offsets[i + 1]].copy_from_slice(&lo.out[at..at + n]);
                    at += n;
                    let geo = entries[i].kv.geometry();
                    let policy = self.sessions[&entries[i].session].policy;
                    let blocks = entries[i].kv.layer(layer)?.blocks() as u64;
                    let per_head = if blocks <= policy.budget() {
                        blocks
                    } else {
                        policy.budget()
                    };
                    let st = &mut result.entries[i];
                    st.blocks_total = blocks as u32;
                    st.tiles_selected = (per_head * geo.kv_heads as u64) as u32;
                    if let Some(k) = &keeps {
                        let mut ks = KeepSet::new();
                        for head in &k[ci] {
                            ks.push_head(head.iter().copied());
                        }
                        st.keep = Some(ks);
                    }
                }
                result.cache_hits += lo.stats.hits;
                result.cache_misses += lo.stats.misses;
                result.bytes_moved += lo.stats.bytes_moved;
            }
        }
        Ok(result)
    }

    /// Answers an appended batch on the CPU: the keep-set of an entry that had cold blocks is
    /// its [`ColdPlan`]'s (what `decode_layer` selected before the append); any other entry
    /// selects over the appended layer (the tail block is in the local window, so that is the
    /// same keep-set). Cold blocks among a keep-set are promoted through the entry's source
    /// before attending. The plans' blocks were promoted before the append, so this reads
    /// only what the device step left cold on purpose (the testing aid); should a read fail
    /// here, the error is returned with the layer already appended, and logged.
    fn cpu_fallback(
        &self,
        layer: u32,
        entries: &mut [GpuEntry<'_>],
        out: &mut [f32],
        plans: &[Option<ColdPlan>],
    ) -> Result<GpuDecodeOutput, GpuError> {
        let mut scratch = SelectScratch::default();
        let mut keeps = Vec::with_capacity(entries.len());
        let mut promoted = vec![0u32; entries.len()];
        for (i, (e, plan)) in entries.iter_mut().zip(plans).enumerate() {
            let keep = match plan {
                Some(p) => p.keep.clone(),
                None => {
                    let policy = self.sessions[&e.session].policy;
                    let mut keep = KeepSet::new();
                    select(e.q, &e.kv.layer(layer)?, &policy, &mut scratch, &mut keep)?;
                    keep
                }
            };
            let cold = e.kv.cold_among(layer, &keep.union());
            promoted[i] = promote(layer, e, &cold).map_err(|err| {
                tracing::error!(layer, entry = i, error = %err, "cuda: CPU answer could not read a keep-set block after the append");
                at(i)(err)
            })?;
            keeps.push(keep);
        }
        let views: Vec<_> = entries
            .iter()
            .map(|e| e.kv.layer(layer).expect("layer was validated"))
            .collect();
        attend_keep_sets(entries.iter().map(|e| e.q), &views, &keeps, out);
        Ok(GpuDecodeOutput {
            entries: views
                .iter()
                .zip(keeps)
                .zip(promoted)
                .map(|((v, keep), blocks_promoted)| GpuEntryStats {
                    blocks_total: v.blocks() as u32,
                    tiles_selected: keep.tiles() as u32,
                    keep: Some(keep),
                    blocks_promoted,
                    bytes_promoted: 0,
                })
                .collect(),
            cpu_fallback: true,
            ..Default::default()
        })
    }
}

/// Wraps an error as batch entry `entry`'s.
fn at(entry: usize) -> impl Fn(GpuError) -> GpuError {
    move |e| GpuError::Entry {
        entry,
        source: Box::new(e),
    }
}

/// Promotes `blocks` (cold ones of `layer`) through the entry's colder tier; returns how many
/// were read. All-or-nothing, like [`KvCache::promote`].
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

/// Closes and reopens the session's slot (clearing its tile cache) and forgets its layers.
fn reset(be: &mut CudaBackend, s: &mut GpuSession) -> Result<(), GpuError> {
    for l in &mut s.layers {
        *l = LayerSync::default();
    }
    be.close_session(s.slot)?;
    be.open_session(s.slot)?;
    Ok(())
}

/// Uploads what changed in one session layer since the last call: page-table entries of new
/// or moved blocks (a cold block maps to the `zero` frame), summaries from the first non-final
/// block on, the token count.
fn sync_layer(
    be: &mut CudaBackend,
    arena: &HostArena,
    zero: u32,
    s: &mut GpuSession,
    layer: u32,
    view: &LayerView<'_>,
) -> Result<(), GpuError> {
    if view.tokens() < s.layers[layer as usize].tokens {
        // Truncated behind our back: start over for the whole session.
        reset(be, s)?;
    }
    let geo = view.geometry();
    let ls = &mut s.layers[layer as usize];
    let nb = view.blocks();
    let want = device_frames(view, zero);
    for run in stale_runs(&ls.frames, &want) {
        let offs: Vec<u64> = want[run.clone()]
            .iter()
            .map(|&f| arena.frame_offset(f) as u64)
            .collect();
        be.map_blocks(s.slot, layer, run.start as u32, &offs)?;
        ls.frames.resize(ls.frames.len().max(run.end), u32::MAX);
        ls.frames[run.clone()].copy_from_slice(&want[run]);
    }
    let spb = geo.summary_floats_per_block();
    if ls.final_blocks < nb {
        let sums = &view.summaries()[ls.final_blocks * spb..nb * spb];
        be.upload_summaries(s.slot, layer, ls.final_blocks as u32, sums)?;
    }
    ls.final_blocks = (view.tokens() / geo.block_tokens as u64) as usize;
    if view.tokens() != ls.tokens {
        be.set_tokens(s.slot, layer, view.tokens() as u32)?;
        ls.tokens = view.tokens();
    }
    Ok(())
}

/// The arena frame the device must map each block of `view` to: the block's own frame, or
/// `zero` while it is cold.
fn device_frames(view: &LayerView<'_>, zero: u32) -> Vec<u32> {
    (0..view.blocks())
        .map(|b| view.frame(b).map_or(zero, Frame::id))
        .collect()
}

/// Maximal runs of blocks whose wanted frame differs from the mapped one (`have` is shorter
/// than `want` when blocks are new).
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
    use kvtier_storage::ArenaOptions;

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
