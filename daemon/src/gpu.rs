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
//!   blocks whose frame changed (a cold block promoted into another frame), the token count.
//!
//! # Errors and the CPU fallback
//!
//! Every check happens before the first append, as in `kvtier_kernels::decode_layer`: an
//! error from [`GpuDecoder::decode`] leaves every session unchanged, and the engine may answer
//! the same request with the CPU path. In particular a layer with a block that is not resident
//! in the arena (the NVMe tier's cold blocks) is refused with [`GpuError::NotResident`]: the GPU
//! selects on the device, any block may be picked, and an unmapped block must never be read.
//! A device failure after the appends (a driver error mid-call) cannot be undone per layer, so
//! the decoder then answers that call on the CPU itself (select + attend over the appended
//! layer, the same result `decode_layer` gives), drops the device state of the batch's
//! sessions (re-uploaded on their next call) and reports `cpu_fallback` in the output.
//!
//! Rewriting positions (a rollback truncating a session and appending other tokens) is
//! invisible to the length bookkeeping when the length grows back: the engine calls
//! [`GpuDecoder::invalidate`] after any truncation.

use std::collections::HashMap;
use std::sync::Arc;

use kvtier_kernels::attention::{attend, AttendItem};
use kvtier_kernels::cuda::{
    device_context, CudaBackend, CudaConfig, CudaError, CudaGeometry, DecodeItem, KvDtype,
    PinnedRegion, SelectPolicy, SummaryDtype,
};
use kvtier_kernels::select::{check_query, select, KeepSet, SelectScratch};
use kvtier_kernels::KernelError;
use kvtier_storage::{DType, Geometry, HostArena, KvCache, Policy, StorageError};

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
    /// A block of the layer is not in the arena (cold): the CPU path answers.
    #[error("layer {layer} block {block} is not resident in host memory")]
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
}

/// What one entry's step did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuEntryStats {
    /// Blocks in the layer after the append.
    pub blocks_total: u32,
    /// Selected (block, kv-head) tiles over all kv-heads.
    pub tiles_selected: u32,
    /// The keep-set per kv-head, when asked for (one extra device readback).
    pub keep: Option<KeepSet>,
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
    /// The device failed after the appends and the CPU answered (see the module docs).
    pub cpu_fallback: bool,
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
            region: Arc::new(region),
            arena: arena.clone(),
        })
    }

    /// e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> &str {
        &self.device_name
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
    /// Validates like `decode_layer` and fails before any append (see the module docs);
    /// `want_keep` also reads the keep-sets back.
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
        let at = |entry: usize| {
            move |e: GpuError| GpuError::Entry {
                entry,
                source: Box::new(e),
            }
        };
        let mut needs = Vec::with_capacity(entries.len());
        let mut offsets = Vec::with_capacity(entries.len() + 1);
        offsets.push(0usize);
        for (i, e) in entries.iter().enumerate() {
            self.check_entry(layer, e, &entries[..i]).map_err(at(i))?;
            needs.push(
                e.kv.check_layer_append(layer, e.position, e.k, e.v)
                    .map_err(|s| at(i)(s.into()))?,
            );
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
        let mut reserved = Vec::with_capacity(entries.len());
        for (i, (e, &n)) in entries.iter().zip(&needs).enumerate() {
            reserved.push(e.kv.arena().alloc_many(n).map_err(|s| at(i)(s.into()))?);
        }
        // Nothing has changed so far. From here on the call succeeds.
        for (e, frames) in entries.iter_mut().zip(&mut reserved) {
            e.kv.append_layer_reserved(layer, e.position, e.k, e.v, frames)
                .expect("validated append cannot fail");
        }
        match self.run_device(layer, entries, &offsets, out, want_keep) {
            Ok(o) => Ok(o),
            Err(err) => {
                tracing::warn!(layer, error = %err, "cuda: device step failed after the appends; answering on the CPU");
                for e in entries.iter() {
                    if let Some(s) = self.sessions.get_mut(&e.session) {
                        if let Err(r) = reset(&mut self.backends[s.backend].be, s) {
                            tracing::warn!(session = e.session, error = %r, "cuda: session reset failed");
                        }
                    }
                }
                Ok(self.cpu_fallback(layer, entries, out))
            }
        }
    }

    /// Every check of one entry that needs no device: session, geometry, query, payload sizes,
    /// capacity and residency.
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
        let view = e.kv.layer(layer)?;
        let after = geo.blocks_for(e.position + 1);
        if after > self.settings.max_blocks as u64 {
            return Err(GpuError::TooManyBlocks {
                layer,
                blocks: after,
                max: self.settings.max_blocks,
            });
        }
        if let Some(block) = (0..view.blocks()).find(|&b| view.frame(b).is_none()) {
            return Err(GpuError::NotResident {
                layer,
                block: block as u32,
            });
        }
        Ok(())
    }

    /// Syncs the batch's layer state to the device and runs it, one device call per (backend,
    /// max_batch chunk).
    fn run_device(
        &mut self,
        layer: u32,
        entries: &[GpuEntry<'_>],
        offsets: &[usize],
        out: &mut [f32],
        want_keep: bool,
    ) -> Result<GpuDecodeOutput, GpuError> {
        let mut result = GpuDecodeOutput {
            entries: vec![
                GpuEntryStats {
                    blocks_total: 0,
                    tiles_selected: 0,
                    keep: None,
                };
                entries.len()
            ],
            ..Default::default()
        };
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
                    sync_layer(&mut self.backends[bi].be, &self.arena, s, layer, &view)?;
                    items.push(DecodeItem {
                        slot: s.slot,
                        q: e.q,
                    });
                }
                let be = &mut self.backends[bi].be;
                let lo = be.decode_layer(layer, &items)?;
                let keeps = if want_keep {
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

    /// Answers an appended batch on the CPU: select over the appended layer (the tail block is
    /// in the local window, so this is the keep-set `decode_layer` selects before appending)
    /// and attend. Every block is resident (checked before the appends).
    fn cpu_fallback(
        &self,
        layer: u32,
        entries: &[GpuEntry<'_>],
        out: &mut [f32],
    ) -> GpuDecodeOutput {
        let mut scratch = SelectScratch::default();
        let mut keeps = Vec::with_capacity(entries.len());
        let views: Vec<_> = entries
            .iter()
            .map(|e| e.kv.layer(layer).expect("layer was validated"))
            .collect();
        for (e, view) in entries.iter().zip(&views) {
            let policy = self.sessions[&e.session].policy;
            let mut keep = KeepSet::new();
            select(e.q, view, &policy, &mut scratch, &mut keep).expect("query was validated");
            keeps.push(keep);
        }
        let items: Vec<AttendItem<'_>> = entries
            .iter()
            .zip(&views)
            .zip(&keeps)
            .map(|((e, layer), keep)| AttendItem {
                q: e.q,
                layer: *layer,
                keep,
            })
            .collect();
        attend(&items, out);
        GpuDecodeOutput {
            entries: views
                .iter()
                .zip(keeps)
                .map(|(v, keep)| GpuEntryStats {
                    blocks_total: v.blocks() as u32,
                    tiles_selected: keep.tiles() as u32,
                    keep: Some(keep),
                })
                .collect(),
            cpu_fallback: true,
            ..Default::default()
        }
    }
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
/// or moved blocks, summaries from the first non-final block on, the token count.
fn sync_layer(
    be: &mut CudaBackend,
    arena: &HostArena,
    s: &mut GpuSession,
    layer: u32,
    view: &kvtier_storage::LayerView<'_>,
) -> Result<(), GpuError> {
    if view.tokens() < s.layers[layer as usize].tokens {
        // Truncated behind our back: start over for the whole session.
        reset(be, s)?;
    }
    let geo = view.geometry();
    let ls = &mut s.layers[layer as usize];
    let nb = view.blocks();
    let frame_of = |b: usize| view.frame(b).expect("residency checked").id();
    // Runs of blocks whose mapping is new or changed.
    let mut b = 0;
    while b < nb {
        if ls.frames.get(b) == Some(&frame_of(b)) {
            b += 1;
            continue;
        }
        let start = b;
        while b < nb && ls.frames.get(b) != Some(&frame_of(b)) {
            b += 1;
        }
        let offs: Vec<u64> = (start..b)
            .map(|x| arena.frame_offset(frame_of(x)) as u64)
            .collect();
        be.map_blocks(s.slot, layer, start as u32, &offs)?;
        ls.frames.resize(ls.frames.len().max(b), u32::MAX);
        for x in start..b {
            ls.frames[x] = frame_of(x);
        }
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
