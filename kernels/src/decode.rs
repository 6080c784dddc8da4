//! One decode step of one layer for a batch of sessions on the CPU: append the new token's K/V,
//! select each kv-head's keep-set from the key bounds, attend over it.

use std::time::Instant;

use rayon::prelude::*;

use kvtier_storage::{ColdSource, KvCache, Policy};

use crate::attention::attend_keep_sets;
use crate::error::{KernelError, Result};
use crate::select::{check_query, select_head, KeepSet, SelectScratch};

/// One session's part of a batched decode step.
pub struct DecodeEntry<'a> {
    pub kv: &'a mut KvCache,
    pub policy: Policy,
    /// Position of the new token: the layer's current length.
    pub position: u64,
    /// `[q_heads][head_dim]` f32.
    pub q: &'a [f32],
    /// The new token's `[kv_heads][head_dim]` K and V in the session dtype.
    pub k: &'a [u8],
    pub v: &'a [u8],
    /// Where cold blocks of this session are read from (None: every block is resident).
    pub cold: Option<&'a dyn ColdSource>,
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
    /// Blocks of the keep-set that were cold and read back from the colder tier.
    pub blocks_promoted: u32,
    /// Bytes those reads brought into the host tier (whole block runs).
    pub bytes_promoted: u64,
    /// The keep-set, per kv-head.
    pub keep: KeepSet,
}

/// Wall time of one batched step's stages, for the daemon's latency metrics. Measured around
/// whole stages (a few clock reads per call), so the hot loops carry no timing cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageTimings {
    /// Validating, reserving frames and appending the new token's K/V (and its key bounds).
    pub append_ns: u64,
    /// Scoring blocks and building every kv-head's keep-set.
    pub select_ns: u64,
    /// Reading cold keep-set blocks back from the colder tier (0 when all were resident).
    pub fetch_ns: u64,
    /// Attention over the keep-sets, including the log-sum-exp merge.
    pub attend_ns: u64,
}

/// Below this many scored blocks the selection stays on the calling thread.
const PARALLEL_MIN_BLOCKS: usize = 256;

/// Runs one layer's decode step for every entry; `out` receives `[entry][q_heads][head_dim]`.
///
/// Order: validate every entry and reserve every frame the appends need; select each keep-set
/// (before the append — see [`select_head`]); promote cold keep-set blocks; append the new
/// tokens; attend. Every failure happens before the first append, names its entry, and leaves
/// every session as it was (a promoted block is only a cache fill).
pub fn decode_layer(
    layer: u32,
    entries: &mut [DecodeEntry<'_>],
    out: &mut [f32],
) -> Result<Vec<StepStats>> {
    decode_layer_timed(layer, entries, out, &mut StageTimings::default())
}

/// [`decode_layer`], also reporting how long each stage of the batch took (left unchanged when
/// the step fails).
pub fn decode_layer_timed(
    layer: u32,
    entries: &mut [DecodeEntry<'_>],
    out: &mut [f32],
    timings: &mut StageTimings,
) -> Result<Vec<StepStats>> {
    let t0 = Instant::now();
    let at = |entry: usize| {
        move |e: KernelError| KernelError::Entry {
            entry,
            source: Box::new(e),
        }
    };
    let mut needs = Vec::with_capacity(entries.len());
    let mut out_len = 0;
    for (i, e) in entries.iter().enumerate() {
        let geo = e.kv.geometry();
        check_query(geo, e.q).map_err(at(i))?;
        let one = geo.token_bytes();
        for (what, bytes) in [("k", e.k), ("v", e.v)] {
            if bytes.len() != one {
                return Err(at(i)(KernelError::Storage(
                    kvtier_storage::StorageError::PayloadSize {
                        what,
                        expected: one,
                        got: bytes.len(),
                    },
                )));
            }
        }
        needs.push(
            e.kv.check_layer_append(layer, e.position, e.k, e.v)
                .map_err(|s| at(i)(s.into()))?,
        );
        out_len += geo.q_heads as usize * geo.head_dim as usize;
    }
    assert_eq!(out.len(), out_len, "decode_layer: output buffer size");
    let mut reserved = Vec::with_capacity(entries.len());
    for (i, (e, &n)) in entries.iter().zip(&needs).enumerate() {
        reserved.push(e.kv.arena().alloc_many(n).map_err(|s| at(i)(s.into()))?);
    }

    let t_reserved = t0.elapsed();
    let keeps = select_all(layer, entries);
    let t_selected = t0.elapsed();

    let mut promoted = vec![(0u32, 0u64); entries.len()];
    for (i, (e, keep)) in entries.iter_mut().zip(&keeps).enumerate() {
        let union = keep.union();
        let missing = e.kv.cold_among(layer, &union);
        if missing.is_empty() {
            continue;
        }
        let source = e.cold.ok_or_else(|| {
            at(i)(KernelError::Storage(
                kvtier_storage::StorageError::NotResident {
                    layer,
                    blocks: missing.len(),
                },
            ))
        })?;
        let n =
            e.kv.promote(layer, &missing, source)
                .map_err(|s| at(i)(s.into()))?;
        promoted[i] = (n as u32, (n * e.kv.geometry().block_bytes()) as u64);
    }

    let t_fetched = t0.elapsed();
    for (e, frames) in entries.iter_mut().zip(&mut reserved) {
        e.kv.append_layer_reserved(layer, e.position, e.k, e.v, frames)
            .expect("validated append cannot fail");
    }

    let t_appended = t0.elapsed();

    let views: Vec<_> = entries
        .iter()
        .map(|e| e.kv.layer(layer).expect("layer was validated"))
        .collect();
    attend_keep_sets(entries.iter().map(|e| e.q), &views, &keeps, out);
    let t_attended = t0.elapsed();
    let ns = |d: std::time::Duration| d.as_nanos() as u64;
    *timings = StageTimings {
        append_ns: ns(t_reserved) + ns(t_appended - t_fetched),
        select_ns: ns(t_selected - t_reserved),
        fetch_ns: ns(t_fetched - t_selected),
        attend_ns: ns(t_attended - t_appended),
    };

    Ok(views
        .iter()
        .zip(keeps)
        .zip(promoted)
        .map(|((v, keep), (blocks_promoted, bytes_promoted))| {
            let geo = v.geometry();
            let summary_bytes = v.blocks() * geo.summary_floats_per_block() * 4;
            let mut rows = 0u64;
            for h in 0..keep.heads() {
                rows += keep
                    .head(h)
                    .iter()
                    .map(|&b| v.valid_tokens(b as usize) as u64)
                    .sum::<u64>();
            }
            StepStats {
                blocks_total: v.blocks() as u32,
                tiles_selected: keep.tiles() as u32,
                bytes_touched: summary_bytes as u64 + rows * 2 * geo.row_bytes() as u64,
                blocks_promoted,
                bytes_promoted,
                keep,
            }
        })
        .collect())
}

/// Selects every entry's keep-set over the block count the layer will have after the append,
/// in parallel over (entry, kv-head) when there is enough scoring work.
fn select_all(layer: u32, entries: &[DecodeEntry<'_>]) -> Vec<KeepSet> {
    let views: Vec<_> = entries
        .iter()
        .map(|e| e.kv.layer(layer).expect("layer was validated"))
        .collect();
    let after: Vec<usize> = entries
        .iter()
        .map(|e| e.kv.geometry().blocks_for(e.position + 1) as usize)
        .collect();
    let jobs: Vec<(usize, usize)> = entries
        .iter()
        .enumerate()
        .flat_map(|(i, e)| (0..e.kv.geometry().kv_heads as usize).map(move |h| (i, h)))
        .collect();
    let select_one = |scratch: &mut SelectScratch, &(i, h): &(usize, usize)| {
        let mut blocks = Vec::new();
        let e = &entries[i];
        select_head(e.q, &views[i], after[i], &e.policy, h, scratch, &mut blocks);
        blocks
    };
    let scored: usize = after.iter().sum();
    let heads: Vec<Vec<u32>> = if scored >= PARALLEL_MIN_BLOCKS {
        jobs.par_iter()
            .map_init(SelectScratch::default, select_one)
            .collect()
    } else {
        let mut scratch = SelectScratch::default();
        jobs.iter().map(|j| select_one(&mut scratch, j)).collect()
    };
    let mut keeps = vec![KeepSet::new(); entries.len()];
    for (&(i, _), blocks) in jobs.iter().zip(heads) {
        keeps[i].push_head(blocks);
    }
    keeps
}
