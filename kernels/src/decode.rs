//! The decode step, once: one step for a batch of (session, layer) entries — validate, reserve
//! the extents the appends need, select, promote cold keep-set blocks, append the new token's
//! K/V, attend, count — with what differs between the CPU and a device behind [`Backend`].
//! The entries of one step may be at different layers (a daemon coalesces whatever its
//! clients sent meanwhile); a device runs them as one call.
//!
//! The daemon (on either backend), the CPU benchmarks and any in-engine library call
//! [`decode_step`]; [`decode_cpu`] is its CPU form.
//!
//! # Order, and why
//!
//! Every check and every fallible read happens before the first append, so an error leaves
//! every session as it was (a promoted block is only a cache fill) and names its entry:
//! 1. per entry: query and payload sizes, the append's position and extents ([`KvCache`]), then
//!    the backend's own checks ([`Backend::check`]);
//! 2. a cold partial tail block is promoted (the append writes into it), the extents the appends
//!    need are reserved;
//! 3. keep-sets are selected on the CPU before the append, over the block count the layer will
//!    have after it ([`select_head`]; the tail block is always kept, so this is the keep-set of
//!    the appended layer). A backend that selects by itself ([`Backend::selects_itself`], the
//!    GPU) needs this only for layers with cold blocks, whose keep-set blocks must be read back
//!    from the colder tier before the device may read them;
//! 4. cold keep-set blocks are promoted through the entry's [`ColdSource`];
//! 5. the appends (cannot fail: validated and reserved), then [`Backend::attend`].
//!
//! After the appends the call must answer. If the backend fails there (a driver error), or its
//! own keep-set names a block that is still cold (its selector diverged from the CPU's; the
//! output may hold zero tiles), the CPU answers the appended batch over the CPU keep-sets and
//! the backend forgets those sessions' device state ([`Backend::discard`]); the report says so.

use std::time::Instant;

use rayon::prelude::*;

use kvtier_storage::sketch::code_bytes;
use kvtier_storage::{ColdSource, Geometry, KvCache, Policy, Selector, StorageError};

use crate::attention::attend_keep_sets;
use crate::error::{KernelError, Result};
use crate::select::{check_query, select_head, KeepSet, SelectScratch};

/// One session's part of a batched decode step.
pub struct DecodeEntry<'a> {
    /// The session's id, for a backend that keeps per-session state (the CPU ignores it).
    pub session: u64,
    /// The model layer this entry decodes.
    pub layer: u32,
    pub kv: &'a mut KvCache,
    pub policy: Policy,
    /// Position of the new token: the layer's current length.
    pub position: u64,
    /// `[q_heads][head_dim]` f32.
    pub q: &'a [f32],
    /// The new token's `[kv_heads][head_dim]` K and V in the session dtype.
    pub k: &'a [u8],
    pub v: &'a [u8],
    /// Where cold blocks of this session are read from (None: a step that needs a cold block
    /// is refused with [`StorageError::NotResident`]).
    pub cold: Option<&'a dyn ColdSource>,
}

impl DecodeEntry<'_> {
    /// This entry's keep-set by its policy over its layer as it stands (the CPU's selection).
    pub fn select(&self, scratch: &mut SelectScratch) -> Result<KeepSet> {
        let mut keep = KeepSet::new();
        crate::select::select(
            self.q,
            &self.kv.layer(self.layer)?,
            &self.policy,
            scratch,
            &mut keep,
        )?;
        Ok(keep)
    }
}

/// What one entry's step read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Blocks in the layer after the append.
    pub blocks_total: u32,
    /// Selected (block, kv-head) tiles over all kv-heads.
    pub tiles_selected: u32,
    /// Bytes read to answer: the summaries scanned plus the valid K/V rows of selected tiles.
    pub bytes_touched: u64,
    /// Blocks read back from the colder tier for this step (keep-set and tail).
    pub blocks_promoted: u32,
    /// Bytes those reads brought into the host tier (whole block runs).
    pub bytes_promoted: u64,
    /// The keep-set per kv-head: always on the CPU; from a device when asked for (one extra
    /// readback) or when the step checked it (the layer had cold blocks).
    pub keep: Option<KeepSet>,
}

/// What a batched step did: per entry, and what the backend counted for the whole call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepReport {
    pub entries: Vec<StepStats>,
    /// Tiles found in a device tile cache (0 on the CPU).
    pub cache_hits: u64,
    /// Tiles read from host memory by a device (0 on the CPU, which reads in place).
    pub cache_misses: u64,
    /// Bytes a device moved host -> device (0 on the CPU).
    pub bytes_moved: u64,
    /// The backend failed after the appends, or diverged, and the CPU answered.
    pub cpu_fallback: bool,
    /// Entries whose device keep-set named a block that was still cold.
    pub cold_divergences: u32,
}

/// Wall time of one batched step's stages, for the daemon's latency metrics. Measured around
/// whole stages (a few clock reads per call), so the hot loops carry no timing cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageTimings {
    /// Validating, reserving extents and appending the new token's K/V (and its key bounds).
    pub append_ns: u64,
    /// Scoring blocks and building every kv-head's keep-set (on the CPU).
    pub select_ns: u64,
    /// Reading cold blocks back from the colder tier (0 when all were resident).
    pub fetch_ns: u64,
    /// The backend's attention (with a device's own selection), including the merge.
    pub attend_ns: u64,
}

/// What [`Backend::attend`] returns.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attended {
    /// Per entry, the keep-set the backend selected by itself, when it read it back; None where
    /// it attended the step's planned keep-set, which then stands (see [`Backend::attend`]).
    pub keeps: Vec<Option<KeepSet>>,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub bytes_moved: u64,
}

/// An appended batch, handed to [`Backend::attend`]; each entry at its own layer.
pub struct Appended<'s, 'a> {
    pub entries: &'s [DecodeEntry<'a>],
    /// The keep-set the step selected per entry: every entry when the backend does not select
    /// itself, else those whose layer had cold blocks.
    pub planned: &'s [Option<KeepSet>],
    /// Report every entry's keep-set (else only the planned entries', which the step checks).
    pub want_keep: bool,
}

/// Where keep-sets are attended: the CPU ([`Cpu`]) or a device. Entries reach a backend
/// validated, with their layer appended and every block of their CPU keep-set resident.
pub trait Backend {
    /// Whether it selects keep-sets by itself from the appended layer (a device does). The step
    /// then selects on the CPU only for layers with cold blocks, to promote them first.
    fn selects_itself(&self) -> bool;

    /// Checks that read nothing and change nothing (a session not open on the device, a
    /// capacity). An error here means the backend cannot take this batch, nothing has changed
    /// and another backend may answer it; wrap it in [`KernelError::Unavailable`].
    fn check(&self, _entries: &[DecodeEntry<'_>]) -> Result<()> {
        Ok(())
    }

    /// Attends every entry's appended layer into `out` (`[entry][q_heads][head_dim]`).
    /// A backend that selects by itself returns the keep-set it selected for every planned
    /// entry (the step checks it against what is resident) and, with `want_keep`, for every
    /// entry; None where it attended the planned keep-set.
    fn attend(&mut self, batch: &Appended<'_, '_>, out: &mut [f32]) -> Result<Attended>;

    /// Forgets any device state of these sessions (re-uploaded on their next step): after a
    /// failure or a divergence, their device caches may hold tiles that are not theirs.
    fn discard(&mut self, _sessions: &[u64]) {}

    /// Testing aid: cold keep-set blocks per entry (the last ones) the step leaves unpromoted,
    /// as if the device had selected blocks the CPU did not. Read once per step with cold
    /// blocks. Only in debug builds and builds with the `test-hooks` feature.
    #[doc(hidden)]
    #[cfg(any(debug_assertions, feature = "test-hooks"))]
    fn take_leave_cold(&mut self) -> u32 {
        0
    }
}

/// The CPU backend: attends the keep-sets the step selected, in place in the host tier.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

impl Backend for Cpu {
    fn selects_itself(&self) -> bool {
        false
    }

    fn attend(&mut self, batch: &Appended<'_, '_>, out: &mut [f32]) -> Result<Attended> {
        let entries = batch.entries;
        let views = entries
            .iter()
            .map(|e| e.kv.layer(e.layer))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let keeps = batch
            .planned
            .iter()
            .map(|k| k.as_ref().expect("the step selects for the CPU"));
        attend_keep_sets(entries.iter().map(|e| e.q), &views, keeps, out);
        // The planned keep-sets stand: nothing to hand back.
        Ok(Attended {
            keeps: vec![None; entries.len()],
            ..Attended::default()
        })
    }
}

/// Below this many scored blocks the selection stays on the calling thread.
const PARALLEL_MIN_BLOCKS: usize = 256;

/// Runs the decode step of every entry (each at its layer) on the CPU; `out` receives
/// `[entry][q_heads][head_dim]`. See the module docs for the order.
pub fn decode_cpu(entries: &mut [DecodeEntry<'_>], out: &mut [f32]) -> Result<Vec<StepStats>> {
    decode_cpu_timed(entries, out, &mut StageTimings::default())
}

/// [`decode_cpu`], also reporting how long each stage took (unchanged when the step fails).
pub fn decode_cpu_timed(
    entries: &mut [DecodeEntry<'_>],
    out: &mut [f32],
    timings: &mut StageTimings,
) -> Result<Vec<StepStats>> {
    Ok(decode_step(&mut Cpu, entries, out, true, timings)?.entries)
}

/// The decode step of every entry (each at its layer) on `backend` (see the module docs).
/// `want_keep`: report every entry's keep-set (free on the CPU, a readback on a device).
pub fn decode_step(
    backend: &mut dyn Backend,
    entries: &mut [DecodeEntry<'_>],
    out: &mut [f32],
    want_keep: bool,
    timings: &mut StageTimings,
) -> Result<StepReport> {
    let t0 = Instant::now();
    if entries.is_empty() {
        return Err(KernelError::EmptyBatch);
    }
    let mut out_len = 0;
    for (i, e) in entries.iter().enumerate() {
        check_entry(e).map_err(at(i))?;
        let geo = e.kv.geometry();
        out_len += geo.q_heads as usize * geo.head_dim as usize;
    }
    if out.len() != out_len {
        return Err(KernelError::OutputSize {
            expected: out_len,
            got: out.len(),
        });
    }
    backend.check(entries)?;

    let mut promoted = vec![0u32; entries.len()];
    for (i, e) in entries.iter_mut().enumerate() {
        promoted[i] = promote_tail(e).map_err(at(i))?;
    }
    let mut reserved = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let need =
            e.kv.check_layer_append(e.layer, e.position, e.k, e.v)
                .map_err(|s| at(i)(s.into()))?;
        reserved.push(
            e.kv.arena()
                .alloc_many(need, e.kv.geometry().block_bytes())
                .map_err(|s| at(i)(s.into()))?,
        );
    }

    let t_reserved = t0.elapsed();
    let selects_itself = backend.selects_itself();
    let plan: Vec<bool> = entries
        .iter()
        .map(|e| !selects_itself || has_cold(e.kv, e.layer))
        .collect();
    let mut planned = select_all(entries, &plan);
    let t_selected = t0.elapsed();

    #[cfg(any(debug_assertions, feature = "test-hooks"))]
    let leave = if plan.iter().any(|&p| p) && selects_itself {
        backend.take_leave_cold() as usize
    } else {
        0
    };
    #[cfg(not(any(debug_assertions, feature = "test-hooks")))]
    let leave = 0usize;
    for (i, (e, keep)) in entries.iter_mut().zip(&planned).enumerate() {
        if let Some(keep) = keep {
            let cold = e.kv.cold_among(e.layer, &keep.union());
            let wanted = &cold[..cold.len() - leave.min(cold.len())];
            promoted[i] += promote(e, wanted).map_err(at(i))?;
        }
    }
    let t_fetched = t0.elapsed();

    // Nothing has changed so far. From here on the call answers.
    for (e, extents) in entries.iter_mut().zip(&mut reserved) {
        e.kv.append_layer_reserved(e.layer, e.position, e.k, e.v, extents)
            .expect("validated append cannot fail");
    }
    let t_appended = t0.elapsed();

    let mut report = StepReport::default();
    let batch = Appended {
        entries,
        planned: &planned,
        want_keep,
    };
    let attended = match backend.attend(&batch, out) {
        Ok(a) => {
            let diverged: Vec<usize> = (0..entries.len())
                .filter(|&i| {
                    planned[i].is_some()
                        && a.keeps[i].as_ref().is_some_and(|keep| {
                            let e = &entries[i];
                            !e.kv.cold_among(e.layer, &keep.union()).is_empty()
                        })
                })
                .collect();
            if diverged.is_empty() {
                Ok(a)
            } else {
                report.cold_divergences = diverged.len() as u32;
                let ids: Vec<u64> = diverged.iter().map(|&i| entries[i].session).collect();
                backend.discard(&ids);
                Err(format!(
                    "the device selected blocks that are still cold (entries {diverged:?})"
                ))
            }
        }
        Err(e) => {
            let ids: Vec<u64> = entries.iter().map(|e| e.session).collect();
            backend.discard(&ids);
            Err(e.to_string())
        }
    };
    let attended = match attended {
        Ok(a) => a,
        Err(why) => {
            tracing::warn!(%why, "decode step: the backend's answer is discarded; the CPU answers");
            report.cpu_fallback = true;
            let planned = std::mem::replace(&mut planned, vec![None; entries.len()]);
            cpu_answer(entries, planned, out, &mut promoted)?
        }
    };
    let t_attended = t0.elapsed();

    report.cache_hits = attended.cache_hits;
    report.cache_misses = attended.cache_misses;
    report.bytes_moved = attended.bytes_moved;
    report.entries = entries
        .iter()
        .zip(attended.keeps.into_iter().zip(planned))
        .zip(promoted)
        .map(|((e, (own, planned)), blocks_promoted)| {
            let keep = own.or(planned);
            let geo = e.kv.geometry();
            let tokens = e.position + 1;
            let mut st = stats(geo, &e.policy, tokens);
            st.blocks_promoted = blocks_promoted;
            st.bytes_promoted = blocks_promoted as u64 * geo.block_bytes() as u64;
            debug_assert!(keep
                .as_ref()
                .is_none_or(|k| k.tiles() == st.tiles_selected as usize));
            st.keep = keep;
            st
        })
        .collect();
    let ns = |d: std::time::Duration| d.as_nanos() as u64;
    *timings = StageTimings {
        append_ns: ns(t_reserved) + ns(t_appended - t_fetched),
        select_ns: ns(t_selected - t_reserved),
        fetch_ns: ns(t_fetched - t_selected),
        attend_ns: ns(t_attended - t_appended),
    };
    Ok(report)
}

/// The step's counts for a layer of `tokens` tokens after the append, from its geometry and
/// policy alone (both backends): every kv-head keeps `min(blocks, budget)` blocks, the tail
/// block among them (`local_blocks >= 1`), and only the tail can be partial.
pub fn stats(geo: &Geometry, policy: &Policy, tokens: u64) -> StepStats {
    let blocks = geo.blocks_for(tokens);
    let per_head = blocks.min(policy.budget());
    let heads = geo.kv_heads as u64;
    let bt = geo.block_tokens as u64;
    let tail_rows = tokens - (blocks - 1) * bt;
    let rows = heads * ((per_head - 1) * bt + tail_rows);
    let summaries = blocks * geo.summary_floats_per_block() as u64 * 4;
    StepStats {
        blocks_total: blocks as u32,
        tiles_selected: (per_head * heads) as u32,
        bytes_touched: summaries
            + sketch_bytes_read(geo, policy, blocks)
            + rows * 2 * geo.row_bytes() as u64,
        ..StepStats::default()
    }
}

/// The key sketches a step of the sketch selector scores, per layer of `blocks` blocks: every
/// distant block where the layer has at most [`crate::select::scan_units`] distant units, else
/// its candidates, the blocks of [`crate::select::candidate_units`] per kv-head and never more
/// than the distant blocks (a unit at an end of the distant range may hold fewer: an upper
/// bound there).
/// (Stage 1 reads the quarter codes, as many bytes as the key bound's summaries, counted with
/// them.)
pub fn sketch_bytes_read(geo: &Geometry, policy: &Policy, blocks: u64) -> u64 {
    let Selector::Sketch { candidates } = policy.selector else {
        return 0;
    };
    if blocks <= policy.budget() {
        return 0;
    }
    let distant = blocks - policy.sink_blocks as u64 - policy.local_blocks as u64;
    let bt = geo.block_tokens;
    let sink_end = policy.sink_blocks as usize;
    let units =
        crate::select::distant_units(sink_end, blocks as usize - policy.local_blocks as usize, bt);
    let scored = if units <= crate::select::scan_units(candidates, policy.top_k, bt) {
        distant
    } else {
        let g = crate::select::unit_blocks(bt);
        distant.min((crate::select::candidate_units(candidates, policy.top_k, bt) * g) as u64)
    };
    let per_block = geo.block_tokens as u64 * (code_bytes(geo.head_dim as usize) as u64 + 4);
    scored * geo.kv_heads as u64 * per_block
}

/// Checks of one entry that read nothing: query and payload sizes, the layer.
fn check_entry(e: &DecodeEntry<'_>) -> Result<()> {
    let geo = e.kv.geometry();
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
    e.kv.layer(e.layer)?;
    check_selector(e.kv, &e.policy)
}

/// A sketch selector needs a cache that keeps sketches.
pub fn check_selector(kv: &KvCache, policy: &Policy) -> Result<()> {
    if policy.selector.needs_sketches() && !kv.has_sketches() {
        return Err(KernelError::NoSketches);
    }
    Ok(())
}

/// Wraps an error as batch entry `entry`'s.
fn at(entry: usize) -> impl Fn(KernelError) -> KernelError {
    move |e| KernelError::Entry {
        entry,
        source: Box::new(e),
    }
}

fn has_cold(kv: &KvCache, layer: u32) -> bool {
    kv.layer(layer)
        .is_ok_and(|v| (0..v.blocks()).any(|b| v.extent(b).is_none()))
}

/// Promotes `blocks` (cold ones of the entry's layer) through the entry's colder tier; returns
/// how many were read. All-or-nothing, like [`KvCache::promote`].
pub fn promote(e: &mut DecodeEntry<'_>, blocks: &[u32]) -> Result<u32> {
    if blocks.is_empty() {
        return Ok(0);
    }
    let source = e.cold.ok_or(StorageError::NotResident {
        layer: e.layer,
        blocks: blocks.len(),
    })?;
    Ok(e.kv.promote(e.layer, blocks, source)? as u32)
}

/// Promotes the layer's tail block when it is partial and cold: the append writes into it.
/// Skipped when the position is wrong (the append's own check reports that).
pub fn promote_tail(e: &mut DecodeEntry<'_>) -> Result<u32> {
    let view = e.kv.layer(e.layer)?;
    let bt = view.geometry().block_tokens as u64;
    let tokens = view.tokens();
    if e.position != tokens || tokens % bt == 0 || view.extent(view.blocks() - 1).is_some() {
        return Ok(0);
    }
    let tail = view.blocks() as u32 - 1;
    promote(e, &[tail])
}

/// Selects the keep-set of every entry marked in `plan` over the block count its layer will
/// have after the append, in parallel over (entry, kv-head) when there is enough scoring work.
fn select_all(entries: &[DecodeEntry<'_>], plan: &[bool]) -> Vec<Option<KeepSet>> {
    let views: Vec<_> = entries
        .iter()
        .map(|e| e.kv.layer(e.layer).expect("layer was validated"))
        .collect();
    let after: Vec<usize> = entries
        .iter()
        .map(|e| e.kv.geometry().blocks_for(e.position + 1) as usize)
        .collect();
    let jobs: Vec<(usize, usize)> = entries
        .iter()
        .enumerate()
        .filter(|&(i, _)| plan[i])
        .flat_map(|(i, e)| (0..e.kv.geometry().kv_heads as usize).map(move |h| (i, h)))
        .collect();
    let select_one = |scratch: &mut SelectScratch, &(i, h): &(usize, usize)| {
        let mut blocks = Vec::new();
        let e = &entries[i];
        select_head(e.q, &views[i], after[i], &e.policy, h, scratch, &mut blocks);
        blocks
    };
    let scored: usize = jobs.iter().map(|&(i, _)| after[i]).sum();
    let heads: Vec<Vec<u32>> = if scored >= PARALLEL_MIN_BLOCKS {
        jobs.par_iter()
            .map_init(SelectScratch::default, select_one)
            .collect()
    } else {
        let mut scratch = SelectScratch::default();
        jobs.iter().map(|j| select_one(&mut scratch, j)).collect()
    };
    let mut keeps: Vec<Option<KeepSet>> = plan.iter().map(|&p| p.then(KeepSet::new)).collect();
    for (&(i, _), blocks) in jobs.iter().zip(heads) {
        keeps[i].as_mut().expect("planned").push_head(blocks);
    }
    keeps
}

/// The CPU's answer for an appended batch the backend could not answer: the planned keep-sets,
/// or a selection over the appended layer for an entry without one (its layer was resident, and
/// the tail block is in the local window, so that is the same keep-set). Blocks a testing aid
/// left cold are promoted first; should that read fail, the error is returned with the layer
/// already appended, and logged.
fn cpu_answer(
    entries: &mut [DecodeEntry<'_>],
    planned: Vec<Option<KeepSet>>,
    out: &mut [f32],
    promoted: &mut [u32],
) -> Result<Attended> {
    let mut scratch = SelectScratch::default();
    let mut keeps = Vec::with_capacity(entries.len());
    for (i, (e, plan)) in entries.iter_mut().zip(planned).enumerate() {
        let keep = match plan {
            Some(k) => k,
            None => e.select(&mut scratch)?,
        };
        let cold = e.kv.cold_among(e.layer, &keep.union());
        promoted[i] += promote(e, &cold).map_err(|err| {
            tracing::error!(layer = e.layer, entry = i, error = %err, "decode step: the CPU answer could not read a keep-set block after the append");
            at(i)(err)
        })?;
        keeps.push(keep);
    }
    let views = entries
        .iter()
        .map(|e| e.kv.layer(e.layer))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    attend_keep_sets(entries.iter().map(|e| e.q), &views, &keeps, out);
    Ok(Attended {
        keeps: keeps.into_iter().map(Some).collect(),
        ..Attended::default()
    })
}
