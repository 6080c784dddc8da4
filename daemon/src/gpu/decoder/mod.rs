//! The CUDA decoder (feature `cuda`): lanes of device state per (geometry, policy) backend,
//! the delta uploads of each step, the cold-block plan and the CPU answer after a device
//! failure (see the module docs of [`super`]).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use kvtier_kernels::cuda::{
    device_context, CudaBackend, CudaConfig, CudaError, DecodeItem, LaunchMode, LayerMirror,
    LayerTarget, PinnedRegion, Summaries, SummaryDtype,
};
use kvtier_kernels::select::KeepSet;
use kvtier_kernels::{Appended, Attended, Backend, DecodeEntry, KernelError};
use kvtier_storage::{Extent, Geometry, HostArena, KvCache, LayerView, Policy};

pub use kvtier_kernels::cuda::device_available;

use super::{device_extents, GpuError, GpuSettings};
use crate::config::LaunchSetting;

mod step;

struct GpuSession {
    backend: usize,
    slot: u32,
    geometry: Geometry,
    policy: Policy,
    layers: Vec<LayerMirror>,
}

struct DeviceBackend {
    geometry: Geometry,
    policy: Policy,
    be: CudaBackend,
    free_slots: Vec<u32>,
}

/// One decoder on the device: its own backends (streams, call buffers) and its share of the
/// session slots. A lane runs one device call at a time; lanes run theirs at once.
struct Lane {
    /// The decoder's settings with this lane's share of `max_sessions`.
    settings: GpuSettings,
    backends: Vec<DeviceBackend>,
    sessions: HashMap<u64, GpuSession>,
    region: Arc<PinnedRegion>,
    /// Arena offset of the decoder's zero extent.
    zero: u64,
}

/// The CUDA decode path for one arena (see the module docs): `Sync`, each lane behind its own
/// lock, so the steps of sessions on different lanes run at once.
pub struct GpuDecoder {
    device_name: String,
    lanes: Vec<Mutex<Lane>>,
    /// The lane each open session is on. Never locked while waiting for a lane.
    placement: Mutex<HashMap<u64, usize>>,
    /// Testing aid ([`GpuDecoder::fault_leave_cold`]): keep-set blocks to leave unpromoted.
    #[cfg(any(debug_assertions, feature = "test-faults"))]
    leave_cold: std::sync::atomic::AtomicU32,
    /// Zero-filled extent every cold block is mapped to on the device (lanes hold its offset);
    /// never written, held for the decoder's life so its address is never reused while the
    /// device may read it.
    _zero: Extent,
    /// The registration, also held by every lane's backends: unregistered after the last.
    _region: Arc<PinnedRegion>,
    /// Keeps the registered mapping alive until `_region` (declared above) is unregistered.
    _arena: HostArena,
}

impl std::fmt::Debug for GpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDecoder")
            .field("device", &self.device_name)
            .field("lanes", &self.lanes.len())
            .field("sessions", &self.placement.lock().len())
            .finish()
    }
}

impl GpuDecoder {
    /// Opens device `cfg.device` and registers the whole arena with it. One decoder per arena:
    /// a second registration of the same memory fails ([`CudaError::Pin`]). `cfg.lanes`
    /// lanes (at least 1, at most `cfg.max_sessions`) share the registration and the session
    /// slots; each creates its backends when its first session of a (geometry, policy) opens.
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
        // Whole segments per chunk: an extent never crosses a segment, so every block run
        // lies inside one registered chunk (one device mapping).
        let seg = arena.segment_bytes();
        let chunk = (cfg.register_chunk.0 as usize / seg).max(1) * seg;
        // SAFETY: [base, base + len) is the arena's live anonymous mapping; `self.arena` (a
        // clone sharing it) is dropped after `self.region` and every lane's clone of it
        // (lanes are declared first), so the mapping outlives the registration. The pointer is
        // only used by the driver and the device, which read extents while a lane holds the
        // owning sessions' `&mut KvCache`.
        let region = unsafe { PinnedRegion::register_chunked(&ctx, base.cast_mut(), len, chunk) }?;
        let region = Arc::new(region);
        // Taken after the registration succeeded, so a failed start holds no extent.
        // Cold blocks map here: as large as the largest run, so any session's read of a
        // cold-mapped block stays inside it.
        let zero = arena.alloc(arena.max_run_bytes())?;
        let lanes = lane_slots(cfg.max_sessions, cfg.lanes)
            .into_iter()
            .map(|max_sessions| {
                Mutex::new(Lane {
                    settings: GpuSettings {
                        max_sessions,
                        ..cfg.clone()
                    },
                    backends: Vec::new(),
                    sessions: HashMap::new(),
                    region: region.clone(),
                    zero: zero.offset() as u64,
                })
            })
            .collect::<Vec<_>>();
        tracing::info!(
            device = %device_name,
            pinned = len,
            chunks = region.chunk_count(),
            lanes = lanes.len(),
            "cuda: host arena registered"
        );
        Ok(GpuDecoder {
            device_name,
            lanes,
            placement: Mutex::new(HashMap::new()),
            #[cfg(any(debug_assertions, feature = "test-faults"))]
            leave_cold: std::sync::atomic::AtomicU32::new(0),
            _zero: zero,
            _region: region,
            _arena: arena.clone(),
        })
    }

    /// e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// How many lanes the decoder runs (steps on different lanes run at once).
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// The lane `session` is open on, if it is open here.
    pub fn lane_of(&self, session: u64) -> Option<usize> {
        self.placement.lock().get(&session).copied()
    }

    /// Testing aid, the only way to reach the divergence check: on the next step with cold
    /// blocks, up to `blocks` cold keep-set blocks per entry (the last ones) stay cold through
    /// the device step, as if the device had selected blocks the CPU did not. Not for
    /// production use: only in debug builds and builds with the `test-faults` feature.
    #[doc(hidden)]
    #[cfg(any(debug_assertions, feature = "test-faults"))]
    pub fn fault_leave_cold(&self, blocks: u32) {
        self.leave_cold
            .store(blocks, std::sync::atomic::Ordering::Relaxed);
    }

    /// Why sessions of this (geometry, policy) cannot run on the GPU, if they cannot: the
    /// kernels cannot run it, or no lane has its backend or room for one.
    pub fn check_support(&self, geo: &Geometry, policy: &Policy) -> Result<(), GpuError> {
        let mut last = Ok(());
        for lane in &self.lanes {
            last = lane.lock().check_support(geo, policy);
            if last.is_ok() {
                break;
            }
        }
        last
    }

    /// Whether sessions of this (geometry, policy) can run on the GPU.
    pub fn supports(&self, geo: &Geometry, policy: &Policy) -> bool {
        self.check_support(geo, policy).is_ok()
    }

    /// Gives session `session` device state on the least loaded lane that can take it
    /// (creating that lane's backend on first use). On error the session stays on the CPU
    /// path; the reason is logged.
    pub fn open(&self, session: u64, geo: &Geometry, policy: &Policy) -> Result<(), GpuError> {
        let r = self.open_inner(session, geo, policy);
        if let Err(e) = &r {
            tracing::info!(session, error = %e, "cuda: session stays on the CPU path");
        }
        r
    }

    fn open_inner(&self, session: u64, geo: &Geometry, policy: &Policy) -> Result<(), GpuError> {
        let order = {
            let placement = self.placement.lock();
            if placement.contains_key(&session) {
                return Err(GpuError::AlreadyOpen { session });
            }
            lane_order(self.lanes.len(), placement.values().copied())
        };
        let mut last = Err(GpuError::Unsupported {
            reason: "no lane".into(),
        });
        for l in order {
            let mut lane = self.lanes[l].lock();
            last = lane.open(session, geo, policy);
            match &last {
                Ok(()) => {
                    self.placement.lock().insert(session, l);
                    return Ok(());
                }
                // Another lane may have a free slot, or room for this backend.
                Err(GpuError::SessionsFull { .. } | GpuError::Unsupported { .. }) => {}
                Err(_) => return last,
            }
        }
        last
    }

    /// Releases the session's device state.
    pub fn close(&self, session: u64) -> Result<(), GpuError> {
        let l = self
            .placement
            .lock()
            .remove(&session)
            .ok_or(GpuError::UnknownSession { session })?;
        self.lanes[l].lock().close(session)
    }

    /// Whether `session` is open on the GPU.
    pub fn is_open(&self, session: u64) -> bool {
        self.lane_of(session).is_some()
    }

    /// Forgets what the device holds for `session` (call after truncating its cache): the
    /// next decode re-uploads everything and its GPU tile cache starts empty.
    pub fn invalidate(&self, session: u64) -> Result<(), GpuError> {
        let l = self
            .lane_of(session)
            .ok_or(GpuError::UnknownSession { session })?;
        self.lanes[l].lock().invalidate(session)
    }

    /// Per lane, the indices of the entries whose sessions are on it (lanes in ascending
    /// order); the index and error of an entry not open here.
    fn by_lane(
        &self,
        sessions: impl Iterator<Item = u64>,
    ) -> Result<Vec<LaneEntries>, (usize, GpuError)> {
        let placement = self.placement.lock();
        let mut lanes: Vec<LaneEntries> = Vec::new();
        for (i, session) in sessions.enumerate() {
            let l = *placement
                .get(&session)
                .ok_or((i, GpuError::UnknownSession { session }))?;
            match lanes.iter_mut().find(|g| g.0 == l) {
                Some(g) => g.1.push(i),
                None => lanes.push((l, vec![i])),
            }
        }
        lanes.sort_by_key(|g| g.0);
        Ok(lanes)
    }
}

impl Lane {
    /// The backend configuration a (geometry, policy) would run with, validated.
    fn config_for(&self, geo: &Geometry, policy: &Policy) -> Result<CudaConfig, GpuError> {
        let s = &self.settings;
        // CudaConfig::new's tile cache (twice the keep-set) unless configured, and its tensor
        // cores where the geometry allows (outputs within ~2e-6 of the fp32 path, hot steps
        // ~20% faster: bench/gpu/NOTES.md v27). f32 summaries: selection bit-identical to the
        // CPU selector (bf16 would select differently, and is slower on the GPU today).
        let base = CudaConfig::new(
            *geo,
            *policy,
            s.max_blocks,
            s.max_sessions,
            SummaryDtype::F32,
        );
        let cfg = CudaConfig {
            max_batch: s.max_batch.min(s.max_sessions),
            cache_slots: if s.cache_slots == 0 {
                base.cache_slots
            } else {
                s.cache_slots
            },
            ..base
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn backend_of(&self, geo: &Geometry, policy: &Policy) -> Option<usize> {
        self.backends
            .iter()
            .position(|b| b.geometry == *geo && b.policy == *policy)
    }

    /// Why sessions of this (geometry, policy) cannot run on this lane, if they cannot.
    fn check_support(&self, geo: &Geometry, policy: &Policy) -> Result<(), GpuError> {
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

    fn open(&mut self, session: u64, geo: &Geometry, policy: &Policy) -> Result<(), GpuError> {
        if self.sessions.contains_key(&session) {
            return Err(GpuError::AlreadyOpen { session });
        }
        self.check_support(geo, policy)?;
        let bi = match self.backend_of(geo, policy) {
            Some(i) => i,
            None => {
                let cfg = self.config_for(geo, policy)?;
                let mut be = CudaBackend::new(self.settings.device, cfg)?;
                be.attach_host(self.region.clone())?;
                be.set_launch_mode(match self.settings.launch {
                    LaunchSetting::Auto => LaunchMode::Auto,
                    LaunchSetting::Fused => LaunchMode::Fused,
                    LaunchSetting::Split => LaunchMode::Split,
                });
                tracing::info!(?geo, ?policy, "cuda: backend compiled");
                self.backends.push(DeviceBackend {
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
                layers: vec![LayerMirror::default(); geo.layers as usize],
            },
        );
        Ok(())
    }

    fn close(&mut self, session: u64) -> Result<(), GpuError> {
        let s = self
            .sessions
            .remove(&session)
            .ok_or(GpuError::UnknownSession { session })?;
        let b = &mut self.backends[s.backend];
        b.free_slots.push(s.slot);
        b.be.close_session(s.slot)?;
        Ok(())
    }

    fn invalidate(&mut self, session: u64) -> Result<(), GpuError> {
        let s = self
            .sessions
            .get_mut(&session)
            .ok_or(GpuError::UnknownSession { session })?;
        reset(&mut self.backends[s.backend].be, s)
    }

    /// Drops the device state of `session` (re-uploaded on its next call), logging a failure.
    fn reset_session(&mut self, session: u64) {
        if let Some(s) = self.sessions.get_mut(&session) {
            if let Err(r) = reset(&mut self.backends[s.backend].be, s) {
                tracing::warn!(session, error = %r, "cuda: session reset failed");
            }
        }
    }

    /// The checks of [`Backend::check`] for one entry of this lane.
    fn check(&self, e: &DecodeEntry<'_>) -> Result<(), GpuError> {
        let max_blocks = self.settings.max_blocks;
        let s = self
            .sessions
            .get(&e.session)
            .ok_or(GpuError::UnknownSession { session: e.session })?;
        if *e.kv.geometry() != s.geometry || e.policy != s.policy {
            return Err(GpuError::GeometryMismatch { session: e.session });
        }
        let after = e.kv.geometry().blocks_for(e.position + 1);
        if after > max_blocks as u64 {
            return Err(GpuError::TooManyBlocks {
                layer: e.layer,
                blocks: after,
                max: max_blocks,
            });
        }
        Ok(())
    }

    /// Syncs the items' layer state to the device and runs them: one device call per backend
    /// (each of its layers a group; more calls only when a layer has more than `max_batch`
    /// entries). Keep-sets are read back for every group when `want_keep`, else for groups
    /// holding an item marked in `checked`.
    fn run_device(
        &mut self,
        items: &[Item<'_>],
        out: &mut [f32],
        want_keep: bool,
        checked: &[bool],
    ) -> Result<Attended, GpuError> {
        let mut offsets = Vec::with_capacity(items.len() + 1);
        offsets.push(0usize);
        for (i, e) in items.iter().enumerate() {
            let geo = e.kv.geometry();
            offsets.push(offsets[i] + (geo.q_heads * geo.head_dim) as usize);
        }
        let mut result = Attended {
            keeps: vec![None; items.len()],
            ..Attended::default()
        };
        let zero = self.zero;
        // Per backend, per layer (in order of first appearance), item indices in batch order.
        let mut groups: Vec<(usize, Vec<LayerGroup>)> = Vec::new();
        for (i, e) in items.iter().enumerate() {
            let bi = self.sessions[&e.session].backend;
            let layers = match groups.iter_mut().find(|g| g.0 == bi) {
                Some(g) => &mut g.1,
                None => {
                    groups.push((bi, Vec::new()));
                    &mut groups.last_mut().expect("pushed").1
                }
            };
            match layers.iter_mut().find(|l| l.0 == e.layer) {
                Some(l) => l.1.push(i),
                None => layers.push((e.layer, vec![i])),
            }
        }
        for (bi, layers) in groups {
            let max_batch = self.backends[bi].be.config().max_batch as usize;
            for call in device_calls(&layers, max_batch) {
                let mut dev_items = Vec::with_capacity(call.len());
                for &(layer, chunk) in &call {
                    let mut group = Vec::with_capacity(chunk.len());
                    for &i in chunk {
                        let e = &items[i];
                        let s = self.sessions.get_mut(&e.session).expect("checked");
                        let view = e.kv.layer(layer)?;
                        sync_layer(&mut self.backends[bi].be, zero, s, layer, &view)?;
                        group.push(DecodeItem {
                            slot: s.slot,
                            q: e.q,
                        });
                    }
                    dev_items.push((layer, group));
                }
                let be = &mut self.backends[bi].be;
                let refs: Vec<(u32, &[DecodeItem<'_>])> =
                    dev_items.iter().map(|(l, g)| (*l, g.as_slice())).collect();
                let outs = be.decode_layers(&refs)?;
                for (&(layer, chunk), lo) in call.iter().zip(outs) {
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
                        if let Some(k) = &keeps {
                            let mut ks = KeepSet::new();
                            for head in &k[ci] {
                                ks.push_head(head.iter().copied());
                            }
                            result.keeps[i] = Some(ks);
                        }
                    }
                    result.cache_hits += lo.stats.hits;
                    result.cache_misses += lo.stats.misses;
                    result.bytes_moved += lo.stats.bytes_moved;
                }
            }
        }
        Ok(result)
    }
}

/// What a lane's device call reads of a step's entry: its session and layer, the appended
/// cache and the query. (`DecodeEntry` itself cannot cross to a lane's thread: its cold
/// source need not be `Sync`.)
#[derive(Clone, Copy)]
struct Item<'a> {
    session: u64,
    layer: u32,
    kv: &'a KvCache,
    q: &'a [f32],
}

/// The lanes to try for a new session, given the lane of every open one: least loaded first,
/// then in index order.
fn lane_order(lanes: usize, placed: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut load = vec![0usize; lanes];
    for l in placed {
        load[l] += 1;
    }
    let mut order: Vec<usize> = (0..lanes).collect();
    order.sort_by_key(|&l| (load[l], l));
    order
}

/// `max_sessions` slots over `lanes` lanes (at least 1, at most one per slot): as equal as
/// can be, the first lanes one more.
fn lane_slots(max_sessions: u32, lanes: u32) -> Vec<u32> {
    let lanes = lanes.clamp(1, max_sessions.max(1));
    (0..lanes)
        .map(|l| max_sessions / lanes + u32::from(l < max_sessions % lanes))
        .collect()
}

/// A lane and the indices of a step's entries whose sessions are on it.
type LaneEntries = (usize, Vec<usize>);

/// A layer of a step and the indices of its entries.
type LayerGroup = (u32, Vec<usize>);

/// The device calls for one backend's layer groups: call `c` takes the `c`-th `max_batch`
/// chunk of every layer (one call unless a layer has more entries than `max_batch`).
fn device_calls(layers: &[LayerGroup], max_batch: usize) -> Vec<Vec<(u32, &[usize])>> {
    let calls = layers
        .iter()
        .map(|(_, idx)| idx.len().div_ceil(max_batch))
        .max()
        .unwrap_or(0);
    (0..calls)
        .map(|c| {
            layers
                .iter()
                .filter_map(|(l, idx)| idx.chunks(max_batch).nth(c).map(|chunk| (*l, chunk)))
                .collect()
        })
        .collect()
}

/// Closes and reopens the session's slot (clearing its tile cache) and forgets its layers.
fn reset(be: &mut CudaBackend, s: &mut GpuSession) -> Result<(), GpuError> {
    for l in &mut s.layers {
        *l = LayerMirror::default();
    }
    be.close_session(s.slot)?;
    be.open_session(s.slot)?;
    Ok(())
}

/// Uploads what changed in one session layer since the last call: page-table entries of new
/// or moved blocks (a cold block maps to the `zero` extent), summaries (or, for the sketch
/// selector, sketches) from the first non-final block on, the token count.
fn sync_layer(
    be: &mut CudaBackend,
    zero: u64,
    s: &mut GpuSession,
    layer: u32,
    view: &LayerView<'_>,
) -> Result<(), GpuError> {
    if view.tokens() < s.layers[layer as usize].tokens() {
        // Truncated behind our back: start over for the whole session.
        reset(be, s)?;
    }
    let (nb, from) = (view.blocks(), s.layers[layer as usize].final_blocks());
    let spb = view.geometry().summary_floats_per_block();
    let summaries = (from < nb).then(|| {
        match view
            .sketch_blocks(from..nb)
            .filter(|_| s.policy.selector.needs_sketches())
        {
            Some(sketches) => Summaries::Sketches(sketches),
            None => Summaries::Bounds(&view.summaries()[from * spb..nb * spb]),
        }
    });
    let extents = device_extents(view, zero);
    let to = LayerTarget {
        extents: &extents,
        base: 0,
        tokens: view.tokens(),
        summaries,
    };
    s.layers[layer as usize].sync(be, s.slot, layer, &to)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{device_calls, lane_order, lane_slots};

    /// New sessions go to the least loaded lane, ties to the lowest index.
    #[test]
    fn new_sessions_try_the_least_loaded_lane_first() {
        assert_eq!(lane_order(4, [].into_iter()), vec![0, 1, 2, 3]);
        assert_eq!(lane_order(4, [0, 1].into_iter()), vec![2, 3, 0, 1]);
        assert_eq!(lane_order(3, [2, 2, 0, 1, 1].into_iter()), vec![0, 1, 2]);
        assert_eq!(lane_order(1, [0, 0].into_iter()), vec![0]);
    }

    /// Slots are shared out as evenly as can be; never more lanes than slots, never none.
    #[test]
    fn lanes_share_the_slots() {
        assert_eq!(lane_slots(8, 4), vec![2, 2, 2, 2]);
        assert_eq!(lane_slots(8, 3), vec![3, 3, 2]);
        assert_eq!(lane_slots(8, 1), vec![8]);
        assert_eq!(lane_slots(2, 4), vec![1, 1]);
        assert_eq!(lane_slots(5, 0), vec![5]);
    }

    /// One call takes every layer's first chunk; a layer over max_batch spills into more.
    #[test]
    fn a_call_takes_one_chunk_of_every_layer() {
        let layers = vec![(0, (0..10).collect::<Vec<usize>>()), (3, vec![10, 11])];
        let calls = device_calls(&layers, 4);
        let want: Vec<Vec<(u32, &[usize])>> = vec![
            vec![(0, &[0, 1, 2, 3]), (3, &[10, 11])],
            vec![(0, &[4, 5, 6, 7])],
            vec![(0, &[8, 9])],
        ];
        assert_eq!(calls, want);
        assert!(device_calls(&[], 4).is_empty());
        assert_eq!(
            device_calls(&layers[1..], 8),
            vec![vec![(3, &[10usize, 11][..])]]
        );
    }
}
