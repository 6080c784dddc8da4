//! What the device holds of one session layer, and bringing it up to date: the one device
//! mirror of a session, which tierd's CUDA decoder and the in-engine library (`kvtier-engine`)
//! both keep per session layer, so each step uploads only what changed.

use std::borrow::Cow;

use kvtier_storage::sketch::BlockSketchesRef;

use super::error::Result;
use super::CudaBackend;
use crate::remap::stale_runs;

/// What the device selects a layer's blocks by, for the blocks from the mirror's first
/// non-final one ([`LayerMirror::final_blocks`]) on.
pub enum Summaries<'a> {
    /// Key bounds, `[block][kv_head][max|min][D]`.
    Bounds(&'a [f32]),
    /// The sketch selector's per-token sketches and quarter codes.
    Sketches(BlockSketchesRef<'a>),
}

/// A session layer as its owner wants the device to hold it.
pub struct LayerTarget<'a> {
    /// Per block, the offset in the registered host memory its run starts at, less `base`.
    pub extents: &'a [u64],
    /// Added to every extent when mapped (an engine's head shard within each run; else 0).
    pub base: u64,
    pub tokens: u64,
    /// From [`LayerMirror::final_blocks`] on; None when no block took keys.
    pub summaries: Option<Summaries<'a>>,
}

/// What the device holds of one session layer.
#[derive(Debug, Clone, Default)]
pub struct LayerMirror {
    /// Token count the device has.
    tokens: u64,
    /// Leading blocks whose (full, final) summaries are on the device.
    final_blocks: usize,
    /// Per block, the extent it is mapped to (as in [`LayerTarget::extents`]).
    extents: Vec<u64>,
}

impl LayerMirror {
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Leading blocks that are full and whose summaries the device has: the summaries a sync
    /// needs start here.
    pub fn final_blocks(&self) -> usize {
        self.final_blocks
    }

    /// Per block, the extent the device maps it to.
    pub fn extents(&self) -> &[u64] {
        &self.extents
    }

    /// Brings `slot`'s `layer` on `be` to `to`: maps the runs of blocks whose extent changed,
    /// uploads the summaries, sets the token count. Each part is recorded once done (each run
    /// as it is mapped), so after an error the next sync redoes what did not happen.
    pub fn sync(
        &mut self,
        be: &mut CudaBackend,
        slot: u32,
        layer: u32,
        to: &LayerTarget<'_>,
    ) -> Result<()> {
        for run in stale_runs(&self.extents, to.extents) {
            let want = &to.extents[run.clone()];
            let mapped: Cow<'_, [u64]> = if to.base == 0 {
                Cow::Borrowed(want)
            } else {
                Cow::Owned(want.iter().map(|&e| e + to.base).collect())
            };
            be.map_blocks(slot, layer, run.start as u32, &mapped)?;
            // Only what changed is copied: on tierd's decode path this runs per layer per step.
            self.extents
                .resize(self.extents.len().max(run.end), u64::MAX);
            self.extents[run].copy_from_slice(want);
        }
        self.extents.truncate(to.extents.len());
        let first = self.final_blocks as u32;
        match &to.summaries {
            None => {}
            Some(Summaries::Bounds(b)) => be.upload_summaries(slot, layer, first, b)?,
            Some(Summaries::Sketches(s)) => be.upload_sketches(slot, layer, first, s)?,
        }
        self.final_blocks = (to.tokens / u64::from(be.config().geometry.block_tokens)) as usize;
        if to.tokens != self.tokens {
            be.set_tokens(slot, layer, to.tokens as u32)?;
            self.tokens = to.tokens;
        }
        Ok(())
    }
}
