//! A session's side of host-tier compaction ([`crate::arena::Relocation`]): which runs it
//! holds where, and moving one.

use super::{KvCache, Slot};
use crate::arena::Extent;

impl KvCache {
    /// `(layer, block, offset)` of every resident run: where in the arena its bytes are.
    pub fn resident_runs(&self) -> impl Iterator<Item = (u32, u32, usize)> + '_ {
        self.layers.iter().enumerate().flat_map(|(l, layer)| {
            layer
                .slots
                .iter()
                .enumerate()
                .filter_map(move |(b, s)| s.extent().map(|f| (l as u32, b as u32, f.offset())))
        })
    }

    /// Moves the run of `(layer, block)` into `to` ([`Extent::move_to`]) if it is resident
    /// at byte offset `from`; otherwise (freed, demoted or moved since it was planned) gives
    /// `to` back.
    pub fn move_run(
        &mut self,
        layer: u32,
        block: u32,
        from: usize,
        to: Extent,
    ) -> Result<(), Extent> {
        let slot = self
            .layers
            .get_mut(layer as usize)
            .and_then(|l| l.slots.get_mut(block as usize));
        match slot {
            Some(Slot::Hot(f)) if f.offset() == from && f.len() == to.len() => {
                f.move_to(to);
                Ok(())
            }
            _ => Err(to),
        }
    }
}
