//! kvtier-engine: the in-engine data path. An engine process leases sessions from tierd
//! (LEASE, docs/protocol.md §5.10), maps tierd's shared host arena, registers it with its own
//! CUDA context and runs the selector, the gather and the attention on its own device over the
//! leased block runs, read in place over PCIe. No tensor crosses the socket, which carries
//! control (LEASE, PROMOTE, RESERVE / COMMIT) and appends whose rows are not on the device
//! (APPEND_KV).
//!
//! ```text
//! engine process                                   tierd
//!   InEngine ──LEASE(session)──────────────────▶  block table + arena memfd (SCM_RIGHTS)
//!     ArenaView (read-only map) ── cuMemHostRegister(READ_ONLY) ── CudaBackend
//!       (read-write map and registration with in-place appends)
//!     sync: map new runs, bounds of new blocks (from the runs), token counts
//!     decode_layer / decode_step: select, gather, attend on the engine's device
//!     append_from_device ──RESERVE──▶ run offsets; DMA device -> arena; ──COMMIT──▶
//!     begin_append_by_layer, copy_layer, commit_layers: the same, a layer at a time, the
//!       COMMITs and summaries on a committer thread beside the model's forward
//! ```
//!
//! The lease keeps every run the engine maps where it is (tierd refuses DEMOTE, CLOSE and
//! EVICT of a leased session and passes over it under memory pressure) until the engine's
//! connection closes. Block bounds (the selector's summaries) are recomputed here from the
//! runs, with the daemon's own function, so selection is bit-identical to tierd's CUDA path.
//!
//! Two ways to decode. With host slices (`decode_layer`, `decode_step`) each call uploads q and
//! waits for the output. The device path takes the engine's own device buffers: `bind` fixes a
//! batch (its token counts uploaded once), then `decode_layer_device` enqueues a layer behind
//! the engine's stream and returns at once, writing the output and its log-sum-exp, so the
//! engine can merge attention over tokens it still holds itself (the Python package's
//! `kvtier.engine.DeviceBatch` keeps each session's newest tokens on the GPU that way and hands
//! them to tierd a block at a time).
//!
//! Appends from the device: with in-place appends enabled (before the first attach; the arena
//! is then mapped and registered read-write), `append_from_device` RESERVEs the rows' place in
//! each session's runs, copies them there by DMA from the engine's device memory and COMMITs
//! them: the rows never pass through the engine's host memory or the socket, and the device
//! state is updated from the RESERVE reply instead of a new LEASE of the whole table.
//!
//! CUDA graphs: a bound batch's layer calls (`decode_layer_device`) may be captured on the
//! caller's stream and replayed until the next bind (kvtier.engine's `CapturedStep` does, with
//! the model's own kernels around them).

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_kernels::cuda::{
    CUstream, CudaBackend, CudaConfig, CudaError, DecodeItem, DeviceIo, LayerMirror, LayerOutput,
    LayerStats, StepItem, StepOutput, Timing,
};
use kvtier_protocol::client::{Client, ClientError};
use kvtier_protocol::{Geometry, LeaseLayer, LeaseReply};

mod append;
mod arena;
mod by_layer;
mod sync;

pub use append::{AppendTiming, DeviceRows};
use arena::{shared_arena, Mapped};
use sync::{new_summaries, sync_layer, Part};

/// New blocks whose bounds a sync computes in one parallel pass (and holds in host memory:
/// 4 MiB at Qwen2.5-7B's geometry).
const BOUNDS_GROUP_BLOCKS: usize = 1024;

/// Failures of the in-engine path.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A request to tierd failed (its error reply, or the connection).
    #[error("tierd: {0}")]
    Daemon(#[from] ClientError),
    /// The device side.
    #[error("cuda: {0}")]
    Cuda(#[from] CudaError),
    /// tierd restarted since this engine mapped its arena: every mapping and table is stale.
    #[error("tierd restarted (instance {old:016x}, now {new:016x}): open a new engine")]
    Restarted { old: u64, new: u64 },
    /// A session of another geometry than this engine's backend, or no free device slot.
    #[error("session {session}: {reason}")]
    Session { session: u64, reason: String },
    #[error("mapping the arena: {0}")]
    Map(#[from] std::io::Error),
    /// A lease names a run outside the mapped arena (a table of another arena).
    #[error("layer {layer} block {block}: the lease names a run outside the mapped arena")]
    Unmapped { layer: usize, block: usize },
    /// An in-place append this engine cannot make (not enabled, a head shard, bad rows).
    #[error("in-place append: {0}")]
    InPlace(String),
    /// A head shard that does not divide the geometry's KV heads.
    #[error(
        "head shard {rank} of {world}: needs rank < world and world dividing {kv_heads} KV heads"
    )]
    Shard {
        rank: u32,
        world: u32,
        kv_heads: u32,
    },
}

/// The KV heads an engine attends, for tensor parallelism: rank `rank` of `world` takes the
/// session's KV heads `[rank * n, (rank + 1) * n)` with `n = kv_heads / world`, and their query
/// heads (the same range times the GQA group: query head `i` reads KV head `i / group`). A block
/// run holds its KV heads' tiles back to back, so a shard's part of every run is one contiguous
/// range: the shard's backend maps that range and runs the session's geometry with its heads
/// divided. Selection and attention are per KV head, so the shards' outputs, concatenated by
/// head, are the whole engine's, bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadShard {
    pub rank: u32,
    pub world: u32,
}

impl HeadShard {
    /// Every head: one engine per session.
    pub const WHOLE: HeadShard = HeadShard { rank: 0, world: 1 };

    /// The geometry this shard's backend runs for sessions of geometry `full`.
    pub fn geometry(&self, full: &Geometry) -> Result<Geometry> {
        let ok = self.world >= 1 && self.rank < self.world && full.kv_heads % self.world == 0;
        if !ok {
            return Err(EngineError::Shard {
                rank: self.rank,
                world: self.world,
                kv_heads: full.kv_heads,
            });
        }
        let mut g = *full;
        g.kv_heads = full.kv_heads / self.world;
        g.q_heads = full.q_heads / self.world;
        Ok(g)
    }

    /// Byte offset of this shard's heads inside a block run of the full geometry.
    fn run_offset(&self, shard: &Geometry) -> u64 {
        u64::from(self.rank) * shard.block_bytes() as u64
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

#[derive(Debug)]
struct EngineSession {
    slot: u32,
    layers: Vec<LayerMirror>,
}

/// One engine's in-process decode path over tierd's arena, for sessions of one geometry and
/// policy (`CudaConfig`), on one device; all of their KV heads or one shard of them.
pub struct InEngine {
    /// None while an append by layer's committer holds it.
    client: Option<Client>,
    /// tierd's socket, which names its arena among the shared ones ([`arena::shared_arena`]).
    socket: std::path::PathBuf,
    be: CudaBackend,
    /// The sessions' geometry (the backend's is the shard's).
    full: Geometry,
    shard: HeadShard,
    sessions: HashMap<u64, EngineSession>,
    free_slots: Vec<u32>,
    mapped: Option<Arc<Mapped>>,
    /// What mapping the arena cost this engine: the wall time of its first lease's mapping and
    /// registration (near 0 when an earlier engine's was reused), and whether it was reused.
    registered: Option<(Duration, bool)>,
    /// Map and register the arena read-write ([`InEngine::enable_in_place_appends`]).
    in_place: bool,
    /// Where the last append from the device spent its time.
    last_append: Option<AppendTiming>,
    /// The append [`InEngine::begin_append_by_layer`] opened, until its last layer's COMMIT.
    by_layer: Option<by_layer::ByLayer>,
}

impl std::fmt::Debug for InEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InEngine")
            .field("sessions", &self.sessions.len())
            .field("mapped", &self.mapped.as_ref().map(|m| m.view.len()))
            .finish()
    }
}

impl InEngine {
    /// Connects to tierd at `socket` (as an admin peer or tierd's own uid: LEASE maps the
    /// whole arena) and creates the device backend on CUDA device `device`.
    pub fn connect(socket: &Path, device: usize, cfg: CudaConfig) -> Result<Self> {
        Self::connect_shard(socket, device, cfg, HeadShard::WHOLE)
    }

    /// [`InEngine::connect`] for one head shard of sessions of geometry `cfg.geometry`: q and
    /// the outputs are then the shard's query heads (`q_heads / world` per session).
    pub fn connect_shard(
        socket: &Path,
        device: usize,
        cfg: CudaConfig,
        shard: HeadShard,
    ) -> Result<Self> {
        let full = cfg.geometry;
        let cfg = CudaConfig {
            geometry: shard.geometry(&full)?,
            ..cfg
        };
        let client = Client::connect_as(socket, "kvtier-engine")?;
        let be = CudaBackend::new(device, cfg)?;
        let free_slots = (0..be.config().max_sessions).rev().collect();
        Ok(InEngine {
            client: Some(client),
            socket: socket.to_path_buf(),
            be,
            full,
            shard,
            sessions: HashMap::new(),
            free_slots,
            mapped: None,
            registered: None,
            in_place: false,
            last_append: None,
            by_layer: None,
        })
    }

    /// The control connection, for appends (APPEND_KV) and the other requests; an append by
    /// layer holds it from its first [`InEngine::commit_layers`] to its last.
    pub fn client(&mut self) -> Result<&mut Client> {
        self.client.as_mut().ok_or_else(|| {
            EngineError::InPlace(
                "an append by layer holds the connection until its last layer is committed".into(),
            )
        })
    }

    /// The backend's configuration: its geometry is this engine's shard of the sessions'.
    pub fn config(&self) -> &CudaConfig {
        self.be.config()
    }

    /// Which KV heads of its sessions this engine attends.
    pub fn shard(&self) -> HeadShard {
        self.shard
    }

    /// Device slot of an attached session (for [`DecodeItem`]/[`StepItem`]).
    pub fn slot(&self, session: u64) -> Option<u32> {
        self.sessions.get(&session).map(|s| s.slot)
    }

    /// Leases `session` and gives it device state, synced ([`InEngine::sync`]).
    pub fn attach(&mut self, session: u64) -> Result<u32> {
        if let Some(s) = self.sessions.get(&session) {
            return Ok(s.slot);
        }
        let info = self.client()?.session_info(session)?;
        let cfg = *self.be.config();
        // The keep-set policy is the engine's own (its CudaConfig); the session's is what
        // tierd uses when it decodes the session itself.
        if info.geometry != self.full {
            return Err(EngineError::Session {
                session,
                reason: format!(
                    "geometry {:?} is not this engine's ({:?})",
                    info.geometry, self.full
                ),
            });
        }
        let slot = self.free_slots.pop().ok_or_else(|| EngineError::Session {
            session,
            reason: format!("all {} device slots are in use", cfg.max_sessions),
        })?;
        if let Err(e) = self.be.open_session(slot) {
            self.free_slots.push(slot);
            return Err(e.into());
        }
        let layers = vec![LayerMirror::default(); cfg.geometry.layers as usize];
        self.sessions
            .insert(session, EngineSession { slot, layers });
        if let Err(e) = self.sync(session) {
            // Undo the attach and report why it failed: the lease may never have been taken
            // (LEASE refused), so a failed RELEASE here says nothing new.
            let _ = self.forget(session);
            if let Ok(c) = self.client() {
                let _ = c.release(session);
            }
            return Err(e);
        }
        Ok(slot)
    }

    /// Releases `session` and frees its device slot.
    pub fn detach(&mut self, session: u64) -> Result<()> {
        if self.forget(session)? {
            self.client()?.release(session)?;
        }
        Ok(())
    }

    /// Drops `session`'s device state and frees its slot; whether it was attached.
    fn forget(&mut self, session: u64) -> Result<bool> {
        let Some(s) = self.sessions.remove(&session) else {
            return Ok(false);
        };
        self.free_slots.push(s.slot);
        self.be.close_session(s.slot)?;
        Ok(true)
    }

    /// Brings the device up to date with `session` as tierd holds it now: one LEASE (the
    /// table), then the runs of new or moved blocks mapped, bounds of blocks that grew
    /// uploaded, token counts set. Blocks on NVMe are promoted first (one PROMOTE), since the
    /// device may select any block.
    pub fn sync(&mut self, session: u64) -> Result<()> {
        let mut lease = self.lease(session)?;
        if lease
            .layers
            .iter()
            .any(|l| l.offsets.contains(&LeaseLayer::COLD))
        {
            self.client()?.promote(session)?;
            lease = self.lease(session)?;
        }
        self.apply(session, &lease, 0..lease.layers.len())
    }

    /// Drops `session`'s device state and syncs it anew from tierd's table, in the same slot:
    /// for a device state ahead of tierd's.
    fn resync(&mut self, session: u64) -> Result<()> {
        let s = self.sessions.get_mut(&session).expect("attached");
        self.be.close_session(s.slot)?;
        self.be.open_session(s.slot)?;
        s.layers.fill(LayerMirror::default());
        self.sync(session)
    }

    /// The part of every block run this engine reads (its shard's heads).
    fn part(&self) -> Part {
        let geo = self.be.config().geometry;
        Part {
            offset: self.shard.run_offset(&geo),
            geo,
        }
    }

    /// Brings the device's state of `session`'s layers `layers` to `lease`'s table.
    fn apply(&mut self, session: u64, lease: &LeaseReply, layers: Range<usize>) -> Result<()> {
        let part = self.part();
        let view = &self.mapped.as_ref().expect("mapped by lease").view;
        let s = self.sessions.get_mut(&session).expect("attached");
        // Layers in groups of at least BOUNDS_GROUP_BLOCKS new blocks: a prefill's chunk is
        // ~128 blocks per layer, too few for every core, and a first sync of a 1M session is
        // 8K per layer, whose bounds for all layers at once would be ~1 GiB of host memory.
        let mut first = layers.start;
        while first < layers.end {
            let mut end = first;
            let mut blocks = 0;
            while end < layers.end && blocks < BOUNDS_GROUP_BLOCKS {
                let nb = lease.layers[end].offsets.len();
                blocks += nb - s.layers[end].final_blocks().min(nb);
                end += 1;
            }
            let sketches = self.be.config().sketch();
            let finals: Vec<usize> = s.layers[first..end]
                .iter()
                .map(|l| l.final_blocks())
                .collect();
            let sums = new_summaries(view, lease, &part, sketches, first, &finals)?;
            for (l, sums) in (first..end).zip(&sums) {
                let (ls, want) = (&mut s.layers[l], &lease.layers[l]);
                sync_layer(&mut self.be, &part, s.slot, l, ls, want, sums)?;
            }
            first = end;
        }
        Ok(())
    }

    /// One layer of attention for a batch of attached sessions, each `(session, q)` with q
    /// `[q_heads x head_dim]`. Call [`InEngine::sync`] after appending.
    pub fn decode_layer(&mut self, layer: u32, items: &[(u64, &[f32])]) -> Result<LayerOutput> {
        let items = self.by_slot(items, |slot, q| DecodeItem { slot, q })?;
        Ok(self.be.decode_layer(layer, &items)?)
    }

    /// Every layer for a batch, `(session, q)` with q `[layers x q_heads x head_dim]`, with
    /// one synchronization at the end.
    pub fn decode_step(&mut self, items: &[(u64, &[f32])]) -> Result<StepOutput> {
        let items = self.by_slot(items, |slot, q| StepItem { slot, q })?;
        Ok(self.be.decode_step(&items)?)
    }

    /// `(session, q)` pairs as the backend's batch items (by device slot).
    fn by_slot<'q, T>(
        &self,
        items: &[(u64, &'q [f32])],
        item: impl Fn(u32, &'q [f32]) -> T,
    ) -> Result<Vec<T>> {
        items
            .iter()
            .map(|&(session, q)| Ok(item(self.slot_of(session)?, q)))
            .collect()
    }

    /// Binds the batch of later [`InEngine::decode_layer_device`] calls: `sessions` (attached,
    /// synced) in this order. Bind again after any [`InEngine::sync`], attach or detach.
    pub fn bind(&mut self, sessions: &[u64]) -> Result<()> {
        let slots = sessions
            .iter()
            .map(|&s| self.slot_of(s))
            .collect::<Result<Vec<_>>>()?;
        Ok(self.be.bind_batch(&slots)?)
    }

    /// One layer for the bound batch on the engine's device buffers, enqueued behind `stream`'s
    /// work so far and ahead of what `stream` gets next; returns without waiting. `io.q` and
    /// `io.out` are `[batch][q_heads x head_dim]` f32, `io.lse` `[batch][q_heads]` f32 (or 0).
    /// May be captured in a CUDA graph on `stream` and replayed until the next bind (capture
    /// again after it: docs/architecture.md, "The device path").
    ///
    /// # Safety
    /// As [`CudaBackend::enqueue_layer_device`]: the addresses are live device buffers of the
    /// device's primary context of at least those sizes, until `stream` has passed this work;
    /// `stream` is a live stream of that context.
    pub unsafe fn decode_layer_device(
        &mut self,
        layer: u32,
        io: DeviceIo,
        stream: CUstream,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        Ok(unsafe { self.be.enqueue_layer_device(layer, io, stream) }?)
    }

    /// Per-layer statistics of the device calls since [`InEngine::bind`] (waits for them).
    pub fn bound_stats(&mut self) -> Result<Vec<LayerStats>> {
        Ok(self.be.bound_stats()?)
    }

    /// Device timing of later calls (`Timing::Step`: `StepOutput::step_ms`).
    pub fn set_timing(&mut self, timing: Timing) -> Result<()> {
        Ok(self.be.set_timing(timing)?)
    }

    /// Empties the device's block cache (the next step reads every kept tile over PCIe).
    pub fn flush_cache(&mut self) -> Result<()> {
        Ok(self.be.flush_cache()?)
    }

    /// Whether the arena is registered read-only (`CU_MEMHOSTREGISTER_READ_ONLY`) rather than
    /// over a read-write mapping; None before the first lease.
    pub fn registered_read_only(&self) -> Option<bool> {
        self.mapped.as_ref().map(|m| m.read_only)
    }

    /// Bytes of tierd's arena mapped and registered, and how long that took this engine
    /// (near 0 when it reused an earlier engine's: [`InEngine::arena_reused`]); None before
    /// the first lease.
    pub fn registration(&self) -> Option<(usize, Duration)> {
        let (m, (t, _)) = self.mapped.as_ref().zip(self.registered)?;
        Some((m.view.len(), t))
    }

    /// Whether this engine reused the arena mapping and registration of an earlier engine of
    /// this process (same device and tierd instance); None before the first lease.
    pub fn arena_reused(&self) -> Option<bool> {
        self.registered.map(|(_, reused)| reused)
    }

    /// Keep-sets of the last call at `layer`: `[batch][kv_head]` ascending block ids.
    pub fn last_keep_sets(&self, layer: u32) -> Result<Vec<Vec<Vec<u32>>>> {
        Ok(self.be.last_keep_sets(layer)?)
    }

    fn slot_of(&self, session: u64) -> Result<u32> {
        self.slot(session).ok_or_else(|| EngineError::Session {
            session,
            reason: "not attached to this engine".into(),
        })
    }

    /// LEASE, mapping and registering the arena on the first one; a reply from another
    /// daemon instance than the mapped one is [`EngineError::Restarted`].
    fn lease(&mut self, session: u64) -> Result<LeaseReply> {
        let (lease, fd) = self.client()?.lease(session)?;
        match &self.mapped {
            Some(m) if m.instance != lease.instance => Err(EngineError::Restarted {
                old: m.instance,
                new: lease.instance,
            }),
            Some(_) => Ok(lease),
            None => {
                let t = Instant::now();
                let (m, reused) = shared_arena(&self.be, &self.socket, fd, &lease, self.in_place)?;
                self.be.attach_host(m.region.clone())?;
                self.mapped = Some(m);
                self.registered = Some((t.elapsed(), reused));
                Ok(lease)
            }
        }
    }
}
