//! The engine side of a LEASE: the daemon's shared host arena mapped read-only in the engine
//! process, and a session's block runs read in place through the lease's table.
//!
//! The daemon keeps every extent a lease names where it is until RELEASE or until the
//! connection closes (docs/protocol.md, LEASE); after either, a view taken earlier may show
//! other data. Rows past a layer's `tokens` may change (appends write them).

use std::io;
use std::os::fd::OwnedFd;

use memmap2::{Mmap, MmapOptions};

use crate::types::{LeaseLayer, LeaseReply};

/// The daemon's host arena, mapped read-only.
pub struct ArenaView {
    map: Mmap,
}

impl std::fmt::Debug for ArenaView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaView")
            .field("bytes", &self.map.len())
            .finish()
    }
}

impl ArenaView {
    /// Maps the arena descriptor a LEASE reply carried. Fails if the descriptor holds fewer
    /// bytes than the lease says the arena has.
    pub fn map(fd: OwnedFd, lease: &LeaseReply) -> io::Result<Self> {
        let file = std::fs::File::from(fd);
        let len = file.metadata()?.len();
        if len < lease.arena_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the arena descriptor holds {len} bytes, the lease says {}",
                    lease.arena_bytes
                ),
            ));
        }
        // SAFETY: a read-only shared view of the daemon's memfd, which is sealed against
        // shrinking (the mapping can never be cut short). Its bytes change under us only
        // where the lease rules allow (extents not named by a held lease, rows past `tokens`);
        // readers take them as plain bytes, never as references to typed data.
        let map = unsafe {
            MmapOptions::new()
                .len(lease.arena_bytes as usize)
                .map(&file)?
        };
        Ok(ArenaView { map })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Start address of the mapping (to register it with a GPU driver in this process).
    pub fn as_ptr(&self) -> *const u8 {
        self.map.as_ptr()
    }

    /// The run of `(layer, block)` as `lease` maps it: None for a cold block, an index out of
    /// range, or an offset the arena does not hold (a lease from another daemon instance).
    pub fn run(&self, lease: &LeaseReply, layer: usize, block: usize) -> Option<&[u8]> {
        let at = *lease.layers.get(layer)?.offsets.get(block)?;
        if at == LeaseLayer::COLD {
            return None;
        }
        let end = at.checked_add(lease.run_bytes)?;
        self.map.get(at as usize..usize::try_from(end).ok()?)
    }
}
