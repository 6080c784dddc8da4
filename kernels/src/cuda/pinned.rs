//! Page-locked, device-mapped host memory: the host arena registered with CUDA so that the
//! gather kernel can read its extents directly over PCIe (zero-copy).

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaEvent, DriverError};

use super::error::{CudaError, Result};

/// Largest single cuMemHostRegister call; bigger regions are registered in chunks.
pub const MAX_REGISTER_CHUNK: usize = 64 << 30;

const PAGE: usize = 4096;

/// An owned anonymous private mapping (for tests, benchmarks and simple arenas).
pub struct AnonMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; access goes through &/&mut self.
unsafe impl Send for AnonMapping {}
// SAFETY: shared access only hands out shared slices.
unsafe impl Sync for AnonMapping {}

impl AnonMapping {
    /// Maps `len` bytes of zeroed anonymous memory (transparent huge pages requested).
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(CudaError::EmptyRegion);
        }
        // SAFETY: anonymous private mapping with no address hint; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CudaError::Mmap {
                len,
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: p is a live mapping of len bytes; the advice is only a hint, failure is fine.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(CudaError::EmptyRegion)?;
        Ok(AnonMapping { ptr, len })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty mappings are rejected at creation.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is live, readable and len bytes long for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AnonMapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly what mmap returned; nothing borrows the mapping any more.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        if rc != 0 {
            eprintln!(
                "kvtier cuda: munmap of {} bytes failed: {}",
                self.len,
                std::io::Error::last_os_error()
            );
        }
    }
}

struct Chunk {
    host: *mut u8,
    len: usize,
    dev: u64,
}

/// A host range registered with cuMemHostRegister(DEVICEMAP | PORTABLE), unregistered in Drop.
pub struct PinnedRegion {
    base: NonNull<u8>,
    len: usize,
    chunk_len: usize,
    chunks: Vec<Chunk>,
    ctx: Arc<CudaContext>,
    /// Registered `CU_MEMHOSTREGISTER_READ_ONLY`: copies into it are refused.
    read_only: bool,
    // Dropped after Drop::drop has unregistered the range.
    owned: Option<AnonMapping>,
}

// SAFETY: the region only stores addresses; host access goes through &/&mut self and device
// access is ordered by the CUDA stream that uses the addresses.
unsafe impl Send for PinnedRegion {}
// SAFETY: shared access never writes.
unsafe impl Sync for PinnedRegion {}

fn memlock_limit() -> String {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return "unknown".into();
    }
    if r.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else {
        format!("{} bytes (raise LimitMEMLOCK / ulimit -l)", r.rlim_cur)
    }
}

fn check(rc: sys::CUresult) -> std::result::Result<(), DriverError> {
    rc.result()
}

impl PinnedRegion {
    /// Registers `[base, base + len)` in chunks of at most [`MAX_REGISTER_CHUNK`] bytes.
    ///
    /// # Safety
    /// The range must be a live read/write mapping that stays mapped, and is not registered
    /// elsewhere, until the returned region is dropped.
    pub unsafe fn register(ctx: &Arc<CudaContext>, base: *mut u8, len: usize) -> Result<Self> {
        // SAFETY: forwarded caller contract.
        unsafe { Self::register_chunked(ctx, base, len, MAX_REGISTER_CHUNK) }
    }

    /// As [`PinnedRegion::register`] with an explicit chunk size (a page multiple).
    ///
    /// # Safety
    /// Same contract as [`PinnedRegion::register`].
    pub unsafe fn register_chunked(
        ctx: &Arc<CudaContext>,
        base: *mut u8,
        len: usize,
        chunk_len: usize,
    ) -> Result<Self> {
        // SAFETY: forwarded caller contract.
        unsafe { Self::register_chunked_with(ctx, base, len, chunk_len, false) }
    }

    /// As [`PinnedRegion::register_chunked`] for a read-only mapping (another process's
    /// memory, mapped `PROT_READ`): registered `CU_MEMHOSTREGISTER_READ_ONLY`, the device only
    /// reads it. [`PinnedRegion::host_mut`] stays None.
    ///
    /// # Safety
    /// The range must be a live (at least readable) mapping that stays mapped, and is not
    /// registered elsewhere in this process, until the returned region is dropped.
    pub unsafe fn register_chunked_read_only(
        ctx: &Arc<CudaContext>,
        base: *const u8,
        len: usize,
        chunk_len: usize,
    ) -> Result<Self> {
        // SAFETY: forwarded caller contract; with read_only the driver and device never write.
        unsafe { Self::register_chunked_with(ctx, base.cast_mut(), len, chunk_len, true) }
    }

    /// # Safety
    /// See the callers.
    unsafe fn register_chunked_with(
        ctx: &Arc<CudaContext>,
        base: *mut u8,
        len: usize,
        chunk_len: usize,
        read_only: bool,
    ) -> Result<Self> {
        let base = NonNull::new(base).ok_or(CudaError::EmptyRegion)?;
        if len == 0 {
            return Err(CudaError::EmptyRegion);
        }
        if !(base.as_ptr() as usize).is_multiple_of(PAGE) {
            return Err(CudaError::Misaligned {
                what: "base",
                value: base.as_ptr() as usize,
                page: PAGE,
            });
        }
        if chunk_len == 0 || !chunk_len.is_multiple_of(PAGE) {
            return Err(CudaError::Misaligned {
                what: "chunk length",
                value: chunk_len,
                page: PAGE,
            });
        }
        ctx.bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let mut region = PinnedRegion {
            base,
            len,
            chunk_len,
            chunks: Vec::new(),
            ctx: ctx.clone(),
            read_only,
            owned: None,
        };
        let mut flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        if read_only {
            flags |= sys::CU_MEMHOSTREGISTER_READ_ONLY;
        }
        let mut offset = 0;
        while offset < len {
            let clen = chunk_len.min(len - offset);
            // SAFETY: offset < len, so the pointer stays inside the caller's mapping.
            let host = unsafe { base.as_ptr().add(offset) };
            // SAFETY: the caller guarantees [host, host + clen) is a live mapping.
            let reg =
                check(unsafe { sys::cuMemHostRegister_v2(host.cast::<c_void>(), clen, flags) });
            let pin_err = |source| CudaError::Pin {
                base: base.as_ptr() as usize,
                len,
                offset,
                chunk_len: clen,
                memlock: memlock_limit(),
                source,
            };
            // On error `region` drops here and unregisters the chunks already registered.
            reg.map_err(pin_err)?;
            let mut dev: sys::CUdeviceptr = 0;
            // SAFETY: host was just registered with DEVICEMAP; dev is a valid out pointer.
            let got = check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) });
            if let Err(source) = got {
                // SAFETY: this chunk was registered above and is not yet tracked by region.
                let _ = unsafe { sys::cuMemHostUnregister(host.cast()) };
                return Err(CudaError::Driver {
                    call: "cuMemHostGetDevicePointer",
                    source,
                });
            }
            region.chunks.push(Chunk {
                host,
                len: clen,
                dev,
            });
            offset += clen;
        }
        Ok(region)
    }

    /// Registers an owned anonymous mapping; the region keeps it alive.
    pub fn register_owned(ctx: &Arc<CudaContext>, mut mapping: AnonMapping) -> Result<Self> {
        let base = mapping.as_mut_slice().as_mut_ptr();
        let len = mapping.len();
        // SAFETY: the mapping is live and moves into the region, so it outlives the registration.
        let mut region = unsafe { Self::register(ctx, base, len) }?;
        region.owned = Some(mapping);
        Ok(region)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty regions are rejected.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Number of cuMemHostRegister chunks.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The context the region is registered in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Device address of `[offset, offset + len)`, which must lie inside one chunk.
    pub fn device_addr(&self, offset: u64, len: u64) -> Result<u64> {
        let err = || CudaError::HostRange {
            offset,
            len,
            region_len: self.len,
        };
        let end = offset.checked_add(len).ok_or_else(err)?;
        if len == 0 || end > self.len as u64 {
            return Err(err());
        }
        let ci = (offset / self.chunk_len as u64) as usize;
        let c = &self.chunks[ci];
        let within = offset - (ci * self.chunk_len) as u64;
        if within + len > c.len as u64 {
            return Err(err());
        }
        Ok(c.dev + within)
    }

    /// The owned mapping's bytes, for filling extents (None for a borrowed registration).
    /// Writers must not change extents that an in-flight decode may be reading.
    pub fn host_mut(&mut self) -> Option<&mut [u8]> {
        self.owned.as_mut().map(AnonMapping::as_mut_slice)
    }

    /// The owned mapping's bytes.
    pub fn host(&self) -> Option<&[u8]> {
        self.owned.as_ref().map(AnonMapping::as_slice)
    }

    /// Host address of the region start.
    pub fn base_addr(&self) -> usize {
        self.base.as_ptr() as usize
    }

    /// Whether the device may only read the region (`CU_MEMHOSTREGISTER_READ_ONLY`).
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Enqueues on `stream` one DMA copy from device memory into the region: `height` rows
    /// of `width` bytes, read at `src + i * src_pitch` and written at `offset + i *
    /// dst_pitch` (inside one registration chunk). Returns without waiting.
    ///
    /// # Safety
    /// `src`'s rows are device memory of the region's context that stays allocated and
    /// unchanged until `stream` has passed the copy; `stream` is a live stream of that
    /// context; nothing reads or writes the destination rows until then (in tierd's arena:
    /// rows this process RESERVEd).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn enqueue_copy_in(
        &self,
        offset: u64,
        dst_pitch: u64,
        src: u64,
        src_pitch: u64,
        width: u64,
        height: u64,
        stream: sys::CUstream,
    ) -> Result<()> {
        if self.read_only {
            return Err(CudaError::ReadOnlyRegion);
        }
        let bad = || CudaError::HostRange {
            offset,
            len: width,
            region_len: self.len,
        };
        if width == 0 || height == 0 || width > dst_pitch || width > src_pitch {
            return Err(bad());
        }
        let span = (height - 1)
            .checked_mul(dst_pitch)
            .and_then(|s| s.checked_add(width))
            .ok_or_else(bad)?;
        // In range and inside one chunk (the checks of device_addr).
        self.device_addr(offset, span)?;
        self.ctx
            .bind_to_thread()
            .map_err(CudaError::driver("cuCtxSetCurrent"))?;
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            // SAFETY: offset + span <= len (checked above), inside the registered mapping.
            dstHost: unsafe { self.base.as_ptr().add(offset as usize) }.cast(),
            dstDevice: 0,
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch as usize,
            WidthInBytes: width as usize,
            Height: height as usize,
        };
        // SAFETY: the destination rows lie in this registered (writable) region (checked);
        // the source and the stream are the caller's contract.
        check(unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream) })
            .map_err(CudaError::driver("cuMemcpy2DAsync"))
    }

    /// An event recorded on `stream` behind what is enqueued there so far (copies into this
    /// region): its `synchronize` waits for that work alone, not for what the stream takes
    /// later.
    ///
    /// # Safety
    /// `stream` is a live stream of the region's context.
    pub unsafe fn fence(&self, stream: sys::CUstream) -> Result<CudaEvent> {
        let event = self
            .ctx
            // Blocking: its waiter is the engine's committer thread, which should sleep
            // while the model computes rather than spin a core the COMMITs want.
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(CudaError::driver("cuEventCreate"))?;
        // SAFETY: the event is of this context; the stream is the caller's contract.
        check(unsafe { sys::cuEventRecord(event.cu_event(), stream) })
            .map_err(CudaError::driver("cuEventRecord"))?;
        Ok(event)
    }
}

impl std::fmt::Debug for PinnedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedRegion")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("chunks", &self.chunks.len())
            .field("owned", &self.owned.is_some())
            .finish()
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind_to_thread() {
            eprintln!("kvtier cuda: cannot bind context to unregister host memory: {e}");
        }
        for c in self.chunks.drain(..) {
            // SAFETY: c.host was registered by this region and is unregistered exactly once.
            if let Err(e) = check(unsafe { sys::cuMemHostUnregister(c.host.cast()) }) {
                eprintln!(
                    "kvtier cuda: cuMemHostUnregister({:p}, {} bytes) failed: {e}",
                    c.host, c.len
                );
            }
        }
    }
}
