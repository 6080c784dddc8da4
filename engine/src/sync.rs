//! Following tierd's block tables on the device: the summaries (bounds or sketches) of the blocks
//! that took keys, recomputed from the runs with the daemon's own functions, then each layer's
//! device mirror (`kvtier_kernels::cuda::LayerMirror`, the daemon's too) brought up to date.

use kvtier_kernels::cuda::{CudaBackend, LayerMirror, LayerTarget};
use kvtier_protocol::lease::ArenaView;
use kvtier_protocol::{Geometry, LeaseLayer, LeaseReply};
use kvtier_storage::kv::refold_bounds;
use kvtier_storage::sketch::{self, BlockSketch, BlockSketches};
use kvtier_storage::zip_mut;

use crate::{EngineError, Result};

/// Blocks (over all layers) from which a sync recomputes bounds on every core.
const PARALLEL_BOUNDS_FROM: usize = 64;

/// The part of every block run an engine reads: its shard's heads, `geo.block_bytes()` from
/// `offset`.
pub(crate) struct Part {
    pub(crate) offset: u64,
    pub(crate) geo: Geometry,
}

/// What the device selects by, for one layer's blocks from its first non-final one on: their
/// bounds `[block][kv_head][max|min][D]`, or with the sketch selector their sketches
/// (kvtier_storage::sketch's layout). Empty where nothing changed.
pub(crate) enum Summaries {
    Bounds(Vec<f32>),
    Sketches(BlockSketches),
}

impl Summaries {
    fn is_empty(&self) -> bool {
        match self {
            Summaries::Bounds(b) => b.is_empty(),
            Summaries::Sketches(s) => s.quarter_scales.is_empty(),
        }
    }
}

/// One block's share of [`new_summaries`]' output.
enum BlockOut<'a> {
    Bounds(&'a mut [f32]),
    Sketch(BlockSketch<'a>),
}

/// The summaries of every layer's blocks from its first non-final one on, recomputed from the
/// runs with the daemon's functions (so they are the daemon's bit for bit), for the layers from
/// `first` on that `finals` covers (each layer's final blocks, whose summaries the device holds
/// already: [`LayerMirror::final_blocks`]), in one pass over all of them.
pub(crate) fn new_summaries(
    view: &ArenaView,
    lease: &LeaseReply,
    part: &Part,
    sketches: bool,
    first: usize,
    finals: &[usize],
) -> Result<Vec<Summaries>> {
    let geo = &part.geo;
    let (at, len) = (part.offset as usize, geo.block_bytes());
    let (bt, spb) = (geo.block_tokens as u64, geo.summary_floats_per_block());
    let mut out = Vec::with_capacity(finals.len());
    let mut runs = Vec::new(); // (valid rows, run), in the order of `out`'s blocks
    for (layer, (&held, want)) in (first..).zip(finals.iter().zip(&lease.layers[first..])) {
        let nb = want.offsets.len();
        let from = held.min(nb);
        out.push(if sketches {
            Summaries::Sketches(BlockSketches::new(geo, nb - from))
        } else {
            Summaries::Bounds(vec![0f32; (nb - from) * spb])
        });
        for blk in from..nb {
            let run = view
                .run(lease, layer, blk)
                .and_then(|r| r.get(at..at + len))
                .ok_or(EngineError::Unmapped { layer, block: blk })?;
            runs.push(((want.tokens - blk as u64 * bt).min(bt) as usize, run));
        }
    }
    // A first sync of a long session or a prefill recomputes many blocks: on every core. The
    // usual sync (a block or two per layer) runs inline: spawning a thread per core would cost
    // more than the blocks.
    let threads = if runs.len() >= PARALLEL_BOUNDS_FROM {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        1
    };
    let mut outs: Vec<Option<BlockOut<'_>>> = out
        .iter_mut()
        .flat_map(|s| -> Box<dyn Iterator<Item = Option<BlockOut<'_>>> + '_> {
            match s {
                Summaries::Bounds(b) => {
                    Box::new(b.chunks_mut(spb).map(|c| Some(BlockOut::Bounds(c))))
                }
                Summaries::Sketches(s) => {
                    Box::new(s.blocks_mut(geo).map(|b| Some(BlockOut::Sketch(b))))
                }
            }
        })
        .collect();
    zip_mut(
        &mut outs,
        &runs,
        threads,
        "kvtier-bounds",
        |out, &(valid, run)| match out.take().expect("each block once") {
            BlockOut::Bounds(b) => refold_bounds(geo, run, valid, b),
            BlockOut::Sketch(s) => sketch::sketch_block(geo, run, valid, s),
        },
    );
    Ok(out)
}

/// Uploads what changed in one session layer: runs of new or moved blocks, the summaries
/// [`new_summaries`] computed for it, the token count.
pub(crate) fn sync_layer(
    be: &mut CudaBackend,
    part: &Part,
    slot: u32,
    layer: usize,
    ls: &mut LayerMirror,
    want: &LeaseLayer,
    sums: &Summaries,
) -> Result<()> {
    let summaries = match sums {
        _ if sums.is_empty() => None,
        Summaries::Bounds(b) => Some(kvtier_kernels::cuda::Summaries::Bounds(b)),
        Summaries::Sketches(s) => Some(kvtier_kernels::cuda::Summaries::Sketches(s.as_ref())),
    };
    let to = LayerTarget {
        extents: &want.offsets,
        base: part.offset,
        tokens: want.tokens,
        summaries,
    };
    ls.sync(be, slot, layer as u32, &to)?;
    Ok(())
}
