//! Compaction of the host tier: when the free bytes would hold a run but no free range does,
//! runs whose owners let them move are copied out of one window of the arena, which then
//! holds the run. The plan is the NVMe tier's (`Space::window`); the owners (sessions) do
//! the moves, because only they hold the [`Extent`] handles and know whether a reader outside
//! the daemon (a lease, a reservation) has a run's address.

use std::collections::HashSet;

use super::{extent_bytes, Extent, HostArena, EXTENT_ALIGN};
use crate::space::Occupant;

/// Moves that make room for one more run: each `(from, to)`, `from` the byte offset of a
/// movable run and `to` an extent already taken outside the window for it. The owner of the
/// run at `from` moves it ([`Extent::move_to`]); a `to` not used (its run was freed or changed
/// meanwhile) goes back to the arena when dropped.
#[derive(Debug)]
pub struct Relocation {
    pub moves: Vec<(usize, Extent)>,
}

impl HostArena {
    /// Plans room for one more run of `bytes` where the free bytes hold it but no free range
    /// does: of the windows of the arena that hold only free space and runs whose offsets are
    /// in `movable`, the one with the fewest bytes to move, each of its runs given an extent
    /// outside it. None when a free range already holds the run, or no window's runs fit
    /// elsewhere.
    pub fn plan_relocation(&self, bytes: usize, movable: &HashSet<usize>) -> Option<Relocation> {
        let units = (extent_bytes(bytes) / EXTENT_ALIGN) as u64;
        if bytes == 0 || bytes > self.inner.max_run_bytes {
            return None;
        }
        let mut space = self.inner.space.lock();
        if space.largest_free() >= units {
            return None;
        }
        let occupant = |unit: u64| {
            if movable.contains(&(unit as usize * EXTENT_ALIGN)) {
                Occupant::Movable
            } else {
                Occupant::Fixed
            }
        };
        let window = space.window(units, occupant)?;
        let to = space.place_outside(units, &window)?;
        Some(Relocation {
            moves: window
                .moves
                .iter()
                .zip(to)
                .map(|(&(from, n), to)| {
                    let extent = Extent {
                        arena: self.inner.clone(),
                        // Charged to nobody: after the move this handle holds the old
                        // extent, and the run's own handle keeps its quota and length.
                        quota: None,
                        unit: to as u32,
                        units: n,
                    };
                    (from as usize * EXTENT_ALIGN, extent)
                })
                .collect(),
        })
    }
}

impl Extent {
    /// Moves the run to `to`'s extent (of the same length): its bytes are copied, this handle
    /// then names the new extent (keeping its quota), and the old extent is freed.
    /// Panics if the lengths differ.
    pub fn move_to(&mut self, mut to: Extent) {
        assert_eq!(
            self.len(),
            to.len(),
            "a run moves to an extent of its length"
        );
        to.as_mut_slice().copy_from_slice(self.as_slice());
        std::mem::swap(&mut self.unit, &mut to.unit);
        // `to` now names the old extent and is charged to nobody: dropping it frees the
        // extent and refunds nothing.
        drop(to);
    }
}
