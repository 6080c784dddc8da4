//! The CUDA decoder (feature `cuda`): device state per (geometry, policy) backend, the delta
//! uploads of each step, the cold-block plan and the CPU answer after a device failure (see
//! the module docs of [`super`]).

use std::collections::HashMap;
use std::sync::Arc;

use kvtier_kernels::attention::attend_keep_sets;
use kvtier_kernels::cuda::{
    device_context, AttentionMath, CudaBackend, CudaConfig, CudaError, DecodeItem, PinnedRegion,
    SummaryDtype,
};
use kvtier_kernels::select::{check_query, select, KeepSet, SelectScratch};
use kvtier_storage::{Frame, Geometry, HostArena, LayerView, Policy, StorageError};

pub use kvtier_kernels::cuda::device_available;

use super::{
    at, device_frames, plan_cold, promote, promote_tail, stale_runs, ColdPlan, GpuDecodeOutput,
    GpuEntry, GpuEntryStats, GpuError, GpuSettings,
};

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
        let chunk = (cfg.register_chunk.0 as usize / fb).max(1) * fb;
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
        let cfg = CudaConfig {
            geometry: *geo,
            policy: *policy,
            max_sessions: s.max_sessions,
            max_blocks: s.max_blocks,
            max_batch: s.max_batch.min(s.max_sessions),
            cache_slots: if s.cache_slots == 0 {
                // Validated policy fields are at most 2^20 each: no truncation.
                (2 * policy.budget()) as u32
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
