//! The engine side of a LEASE: the daemon's shared host arena mapped read-only in the engine
//! process, and a session's block runs read in place through the lease's table.
//!
//! The daemon keeps every extent a lease names where it is until RELEASE or until the
//! connection closes (docs/protocol.md, LEASE); after either, a view taken earlier may show
//! other data. Rows past a layer's `tokens` may change (appends write them).

use std::io;
use std::os::fd::OwnedFd;

use memmap2::{MmapOptions, MmapRaw};

use crate::types::{LeaseLayer, LeaseReply};

/// The daemon's host arena, mapped in this process; read only through it.
pub struct ArenaView {
    map: MmapRaw,
}

impl std::fmt::Debug for ArenaView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArenaView")
            .field("bytes", &self.map.len())
            .finish()
    }
}

impl ArenaView {
    /// Maps the arena descriptor a LEASE reply carried, read-only. Fails if the descriptor
    /// holds fewer bytes than the lease says the arena has.
    pub fn map(fd: OwnedFd, lease: &LeaseReply) -> io::Result<Self> {
        Self::map_with(fd, lease, false)
    }

    /// As [`ArenaView::map`], but mapped read-write underneath, for a GPU driver that cannot
    /// register read-only memory. This view still only reads; the engine must not write.
    pub fn map_for_registration(fd: OwnedFd, lease: &LeaseReply) -> io::Result<Self> {
        Self::map_with(fd, lease, true)
    }

    fn map_with(fd: OwnedFd, lease: &LeaseReply, writable: bool) -> io::Result<Self> {
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
        let mut opts = MmapOptions::new();
        opts.len(lease.arena_bytes as usize);
        let map = if writable {
            opts.map_raw(&file)?
        } else {
            opts.map_raw_read_only(&file)?
        };
        Ok(ArenaView { map })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
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
        let end = usize::try_from(at.checked_add(lease.run_bytes)?).ok()?;
        if end > self.map.len() {
            return None;
        }
        // SAFETY: [at, end) lies inside the live shared mapping of the daemon's memfd, which is
        // sealed against shrinking (it can never be cut short). Its bytes change under us only
        // where the lease rules allow (extents a held lease does not name, rows past
        // `tokens`); they are read as plain bytes, never as typed data with invariants.
        Some(unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().add(at as usize), end - at as usize)
        })
    }
}
