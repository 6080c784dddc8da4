//! O_DIRECT building blocks: aligned buffers and files opened for direct I/O.
//!
//! O_DIRECT needs the buffer address, the length and the file offset aligned to the device's
//! direct-I/O alignment. [`AlignedBuf`] can only be built with an aligned address and a length
//! that is a multiple of its alignment, and [`DirectFile`] knows its file's alignment, so the
//! I/O request constructors can check the rest before anything reaches the kernel.

use std::alloc::{self, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use super::NvmeError;

/// Alignment used when the kernel does not report one (and the floor we never go below).
pub const DEFAULT_ALIGN: usize = 4096;

/// A zeroed, heap-allocated byte buffer whose address and length are multiples of its
/// alignment (a power of two >= 512). Owned, `Send`, freed on drop.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    align: usize,
}

// SAFETY: AlignedBuf uniquely owns its allocation (like Box<[u8]>); no interior sharing.
unsafe impl Send for AlignedBuf {}
// SAFETY: &AlignedBuf only gives out &[u8]; mutation needs &mut.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to `align`. `len` must be a non-zero multiple of
    /// `align`, and `align` a power of two of at least 512.
    pub fn new(len: usize, align: usize) -> Result<Self, NvmeError> {
        if !align.is_power_of_two() || align < 512 {
            return Err(NvmeError::invalid(format!(
                "buffer alignment {align} must be a power of two >= 512"
            )));
        }
        if len == 0 {
            return Err(NvmeError::invalid("zero-length aligned buffer"));
        }
        if !len.is_multiple_of(align) {
            return Err(NvmeError::Misaligned {
                what: "buffer length",
                value: len as u64,
                align: align as u64,
            });
        }
        let layout = Layout::from_size_align(len, align)
            .map_err(|e| NvmeError::invalid(format!("buffer layout {len}/{align}: {e}")))?;
        // SAFETY: layout has a non-zero size (checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout);
        };
        Ok(Self { ptr, len, align })
    }

    /// A buffer of `len` bytes suitable for direct I/O on `file`.
    pub fn for_file(file: &DirectFile, len: usize) -> Result<Self, NvmeError> {
        Self::new(len, file.mem_align())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: zero-length buffers cannot be built.
    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn align(&self) -> usize {
        self.align
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is a live allocation of len initialised (zeroed) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this size and alignment (validated there).
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, self.align),
            )
        };
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("align", &self.align)
            .finish()
    }
}

/// A regular file or block device opened with O_DIRECT, with its direct-I/O alignments.
#[derive(Debug)]
pub struct DirectFile {
    file: File,
    path: PathBuf,
    mem_align: usize,
    offset_align: usize,
    is_block_device: bool,
}

impl DirectFile {
    /// Opens (creating a regular file if missing) `path` for O_DIRECT reads and writes.
    /// EINVAL from open means the filesystem has no O_DIRECT (tmpfs): typed error.
    pub fn open(path: &Path) -> Result<Self, NvmeError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| {
                if e.raw_os_error() == Some(libc::EINVAL) {
                    NvmeError::DirectIoUnsupported { path: path.into() }
                } else {
                    NvmeError::os("open(O_DIRECT)", path, e)
                }
            })?;
        let is_block_device = file
            .metadata()
            .map_err(|e| NvmeError::os("fstat", path, e))?
            .file_type()
            .is_block_device();
        let (mem_align, offset_align) = dio_align(&file).unwrap_or((DEFAULT_ALIGN, DEFAULT_ALIGN));
        // We never go below 4 KiB: it is the page granularity everything else assumes, and
        // 4 KiB-aligned I/O avoids read-modify-write on 4Kn devices that report 512.
        Ok(Self {
            file,
            path: path.into(),
            mem_align: mem_align.max(DEFAULT_ALIGN),
            offset_align: offset_align.max(DEFAULT_ALIGN),
            is_block_device,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Required alignment of buffer addresses and lengths.
    pub fn mem_align(&self) -> usize {
        self.mem_align
    }

    /// Required alignment of file offsets (and lengths).
    pub fn offset_align(&self) -> usize {
        self.offset_align
    }

    /// The larger of the two alignments: what page sizes are rounded to.
    pub fn align(&self) -> usize {
        self.mem_align.max(self.offset_align)
    }

    pub fn is_block_device(&self) -> bool {
        self.is_block_device
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    /// Size in bytes (for a block device, its capacity).
    pub fn size(&self) -> Result<u64, NvmeError> {
        use std::io::Seek;
        if self.is_block_device {
            let mut f = &self.file;
            f.seek(io::SeekFrom::End(0))
                .map_err(|e| NvmeError::os("seek(end)", &self.path, e))
        } else {
            Ok(self
                .file
                .metadata()
                .map_err(|e| NvmeError::os("fstat", &self.path, e))?
                .len())
        }
    }

    /// Makes a regular file at least `len` bytes long with blocks allocated up front, so a
    /// later page write cannot hit ENOSPC. Block devices must already be large enough.
    pub fn ensure_len(&self, len: u64) -> Result<(), NvmeError> {
        let size = self.size()?;
        if size >= len {
            return Ok(());
        }
        if self.is_block_device {
            return Err(NvmeError::invalid(format!(
                "block device {:?} has {size} bytes, {len} needed",
                self.path
            )));
        }
        let len_off = libc::off_t::try_from(len)
            .map_err(|_| NvmeError::invalid(format!("file length {len} too large")))?;
        // SAFETY: plain syscall on an fd we own; no memory is passed.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, 0, len_off) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EOPNOTSUPP) => self
                .file
                .set_len(len)
                .map_err(|e| NvmeError::os("ftruncate", &self.path, e)),
            Some(libc::ENOSPC) => Err(NvmeError::NoSpace {
                offset: size,
                len: (len - size) as usize,
            }),
            _ => Err(NvmeError::os("fallocate", &self.path, err)),
        }
    }

    /// fdatasync: makes completed writes durable across power loss (device write cache).
    pub fn sync_data(&self) -> Result<(), NvmeError> {
        self.file
            .sync_data()
            .map_err(|e| NvmeError::os("fdatasync", &self.path, e))
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// Direct-I/O alignment (memory, offset) from statx(STATX_DIOALIGN), Linux >= 6.1. `None` if
/// the kernel or filesystem does not report it.
fn dio_align(file: &File) -> Option<(usize, usize)> {
    // SAFETY: statx is plain data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: fd is open, the empty path with AT_EMPTY_PATH names the fd itself, and stx is a
    // valid writable statx struct.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return None;
    }
    let mem = stx.stx_dio_mem_align as usize;
    let off = stx.stx_dio_offset_align as usize;
    if mem == 0 || off == 0 || !mem.is_power_of_two() || !off.is_power_of_two() {
        // 0 means "direct I/O not supported on this file" per statx(2).
        return None;
    }
    Some((mem, off))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buf_rules() {
        let b = AlignedBuf::new(8192, 4096).unwrap();
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        assert!(b.iter().all(|&x| x == 0));
        assert!(matches!(
            AlignedBuf::new(4097, 4096),
            Err(NvmeError::Misaligned { .. })
        ));
        for (len, align) in [(0, 4096), (4096, 3000), (4096, 256)] {
            assert!(
                matches!(
                    AlignedBuf::new(len, align),
                    Err(NvmeError::InvalidArgument { .. })
                ),
                "len {len} align {align}"
            );
        }
    }

    #[test]
    fn buf_pool_recycles_by_length_under_a_byte_cap() {
        assert!(BufPool::new(3000, 1 << 20).is_err());
        let pool = BufPool::new(4096, 5 * 4096).unwrap();
        assert!(matches!(pool.get(4097), Err(NvmeError::Misaligned { .. })));
        assert!(pool.get(0).is_err());
        let a = pool.get(8192).unwrap();
        let p = a.as_ptr();
        pool.put(a);
        assert_eq!((pool.idle(), pool.idle_bytes()), (1, 8192));
        assert!(
            pool.get(4096).unwrap().as_ptr() != p,
            "another length is not served"
        );
        assert_eq!(
            pool.get(8192).unwrap().as_ptr(),
            p,
            "the idle buffer is reused"
        );
        assert_eq!(pool.idle(), 0);
        pool.put(AlignedBuf::new(8192, 8192).unwrap());
        assert_eq!(pool.idle(), 0, "a buffer of another alignment is not kept");
        pool.put(AlignedBuf::new(6 * 4096, 4096).unwrap());
        assert_eq!(pool.idle(), 0, "longer than the cap");
        // Two lengths side by side, the bytes capped.
        pool.put(AlignedBuf::new(8192, 4096).unwrap());
        pool.put(AlignedBuf::new(4096, 4096).unwrap());
        assert_eq!((pool.idle(), pool.idle_bytes()), (2, 3 * 4096));
        // Room for a 12 KiB buffer is made by freeing idle buffers of other lengths (the
        // length holding the most bytes first: the 8 KiB one).
        pool.put(AlignedBuf::new(3 * 4096, 4096).unwrap());
        assert_eq!((pool.idle(), pool.idle_bytes()), (2, 4 * 4096));
        assert_eq!(pool.get(3 * 4096).unwrap().len(), 3 * 4096);
        assert_eq!((pool.idle(), pool.idle_bytes()), (1, 4096));
        // Full of one length: a further buffer of it is freed, not kept.
        for _ in 0..6 {
            pool.put(AlignedBuf::new(4096, 4096).unwrap());
        }
        assert_eq!((pool.idle(), pool.idle_bytes()), (5, 5 * 4096));
    }
}

/// A bounded free list of aligned buffers, kept per length. Fresh page-sized buffers are
/// costly (large allocations are mmap'd, page-faulted and zeroed on every use, which halved read
/// bandwidth in the page store benchmark), so hot paths recycle them. Pages differ in length
/// (one per block-run size in use), so idle buffers are kept by length, their total bytes
/// capped.
#[derive(Debug)]
pub struct BufPool {
    align: usize,
    max_bytes: usize,
    idle: parking_lot::Mutex<Idle>,
}

#[derive(Debug, Default)]
struct Idle {
    by_len: std::collections::HashMap<usize, Vec<AlignedBuf>>,
    bytes: usize,
}

impl Idle {
    /// Frees the idle buffers of the length (other than `keep`) holding the most bytes; false
    /// when only buffers of length `keep` are idle.
    fn evict_other_than(&mut self, keep: usize) -> bool {
        let victim = self
            .by_len
            .iter()
            .filter(|(&len, v)| len != keep && !v.is_empty())
            .max_by_key(|(&len, v)| (len * v.len(), len))
            .map(|(&len, _)| len);
        let Some(len) = victim else {
            return false;
        };
        let list = self.by_len.get_mut(&len).expect("just found");
        list.pop();
        if list.is_empty() {
            self.by_len.remove(&len);
        }
        self.bytes -= len;
        true
    }
}

impl BufPool {
    /// A pool of buffers aligned to `align`, keeping at most `max_bytes` of idle ones.
    pub fn new(align: usize, max_bytes: usize) -> Result<Self, NvmeError> {
        // Validate the alignment once, so `get` can only fail on its length.
        drop(AlignedBuf::new(align, align)?);
        Ok(Self {
            align,
            max_bytes,
            idle: parking_lot::Mutex::new(Idle::default()),
        })
    }

    /// A buffer of `len` bytes (a non-zero multiple of the pool's alignment). A recycled
    /// buffer holds old bytes: callers overwrite it completely (a read is only `Ok` if every
    /// byte arrived; page encoding fills the page).
    pub fn get(&self, len: usize) -> Result<AlignedBuf, NvmeError> {
        {
            let mut idle = self.idle.lock();
            if let Some(list) = idle.by_len.get_mut(&len) {
                if let Some(b) = list.pop() {
                    if list.is_empty() {
                        idle.by_len.remove(&len);
                    }
                    idle.bytes -= len;
                    return Ok(b);
                }
            }
        }
        AlignedBuf::new(len, self.align)
    }

    /// Returns a buffer. One of another alignment, or longer than the whole cap, is simply
    /// freed; to stay under the cap, idle buffers of other lengths go first (the lengths in
    /// use now are the ones worth keeping), and when only this length is idle the returned
    /// buffer is freed.
    pub fn put(&self, buf: AlignedBuf) {
        let len = buf.len();
        if buf.align() != self.align || len > self.max_bytes {
            return;
        }
        let mut idle = self.idle.lock();
        while idle.bytes + len > self.max_bytes {
            if !idle.evict_other_than(len) {
                return;
            }
        }
        idle.bytes += len;
        idle.by_len.entry(len).or_default().push(buf);
    }

    /// Idle buffers held.
    pub fn idle(&self) -> usize {
        self.idle.lock().by_len.values().map(Vec::len).sum()
    }

    /// Bytes of the idle buffers held.
    pub fn idle_bytes(&self) -> usize {
        self.idle.lock().bytes
    }
}
