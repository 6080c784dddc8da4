//! tierd's arena mapped into this process and registered with a CUDA context, shared by every
//! engine of the process on one device over one tierd.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvtier_kernels::cuda::{CudaBackend, CudaContext, CudaError, PinnedRegion};
use kvtier_protocol::lease::ArenaView;
use kvtier_protocol::LeaseReply;

use crate::Result;

/// Bytes per cuMemHostRegister call: tierd's arena segment (no block run crosses one).
const REGISTER_CHUNK: usize = 1 << 30;

/// The arena mapped and registered: dropped after the backends that read it (kept in
/// [`ARENAS`] while its tierd instance is the current one).
pub(crate) struct Mapped {
    pub(crate) instance: u64,
    pub(crate) read_only: bool,
    // Field order is drop order: the registration goes before the mapping it covers.
    pub(crate) region: Arc<PinnedRegion>,
    pub(crate) view: ArenaView,
}

/// Arenas mapped and registered in this process, by (CUDA device ordinal, tierd socket,
/// writable): every engine on that device over the same tierd instance shares one mapping and
/// registration, so the cuMemHostRegister of the whole arena (seconds for tens of GiB) is paid
/// once per process and device, not once per engine (a chat server opens one per
/// conversation). An entry of an older instance (that tierd restarted) is replaced at the next
/// lease from the new one, and its pinned pages are released with the last engine using it.
static ARENAS: parking_lot::Mutex<Vec<ArenaEntry>> = parking_lot::Mutex::new(Vec::new());

struct ArenaEntry {
    device: usize,
    socket: PathBuf,
    writable: bool,
    mapped: Arc<Mapped>,
}

/// The shared mapping and registration of the arena `lease` names on `be`'s device (see
/// [`ARENAS`]), made now if this process has none; and whether it was made by an earlier
/// engine.
pub(crate) fn shared_arena(
    be: &CudaBackend,
    socket: &Path,
    fd: std::os::fd::OwnedFd,
    lease: &LeaseReply,
    writable: bool,
) -> Result<(Arc<Mapped>, bool)> {
    let device = be.context().ordinal();
    let ours = |e: &ArenaEntry| e.device == device && e.socket == socket && e.writable == writable;
    // Held while registering: an engine leasing meanwhile waits for this mapping rather than
    // making its own.
    let mut arenas = ARENAS.lock();
    arenas.retain(|e| !ours(e) || e.mapped.instance == lease.instance);
    if let Some(e) = arenas.iter().find(|e| ours(e)) {
        return Ok((e.mapped.clone(), true));
    }
    let (view, region, read_only) = register(be, fd, lease, writable)?;
    let mapped = Arc::new(Mapped {
        instance: lease.instance,
        read_only,
        region,
        view,
    });
    arenas.push(ArenaEntry {
        device,
        socket: socket.to_path_buf(),
        writable,
        mapped: mapped.clone(),
    });
    Ok((mapped, false))
}

/// Maps the arena and registers it with the backend's context: read-write for in-place
/// appends (`writable`: the device writes RESERVEd rows into it by DMA); otherwise read-only
/// where the driver supports it (`CU_MEMHOSTREGISTER_READ_ONLY`), else over a read-write
/// mapping of the same memfd (the device still only reads it; this process never writes
/// through it).
fn register(
    be: &CudaBackend,
    fd: std::os::fd::OwnedFd,
    lease: &LeaseReply,
    writable: bool,
) -> Result<(ArenaView, Arc<PinnedRegion>, bool)> {
    let ctx = be.context().clone();
    if writable {
        let (view, region) = register_read_write(&ctx, fd, lease)?;
        return Ok((view, region, false));
    }
    let second = fd.try_clone()?;
    let view = ArenaView::map(fd, lease)?;
    // SAFETY: `view` is a live mapping that the caller keeps (in `Mapped`) until after the
    // registration (declared before it) is dropped; nothing else in this process registers it.
    let ro = unsafe {
        PinnedRegion::register_chunked_read_only(&ctx, view.as_ptr(), view.len(), REGISTER_CHUNK)
    };
    match ro {
        Ok(region) => Ok((view, Arc::new(region), true)),
        Err(CudaError::Pin { .. }) => {
            drop(view);
            let (view, region) = register_read_write(&ctx, second, lease)?;
            Ok((view, region, false))
        }
        Err(e) => Err(e.into()),
    }
}

/// The arena mapped read-write and registered plainly (the device may write it).
fn register_read_write(
    ctx: &Arc<CudaContext>,
    fd: std::os::fd::OwnedFd,
    lease: &LeaseReply,
) -> Result<(ArenaView, Arc<PinnedRegion>)> {
    let view = ArenaView::map_for_registration(fd, lease)?;
    // SAFETY: `view` is a live read-write mapping that the caller keeps (in `Mapped`) until
    // after the registration (declared before it) is dropped; nothing else in this process
    // registers it.
    let region = unsafe {
        PinnedRegion::register_chunked(ctx, view.as_ptr().cast_mut(), view.len(), REGISTER_CHUNK)
    }?;
    Ok((view, Arc::new(region)))
}
