//! I/O drivers: positional reads and writes of aligned buffers on [`DirectFile`]s.
//!
//! An operation owns its buffer from submission to completion and hands it back in the
//! [`IoCompletion`], so no buffer can be freed or touched while the kernel may still write it.
//! A completion is `Ok` only when every byte was transferred: short transfers are resubmitted
//! or turned into [`NvmeError::ShortRead`]/[`NvmeError::ShortWrite`].

mod faulty;
mod pread;
mod uring;

use std::sync::Arc;
use std::time::Instant;

pub use faulty::{Fault, FaultRule, FaultyDriver, Trigger};
pub use pread::PreadDriver;
pub use uring::{UringConfig, UringDriver};

use super::buf::{AlignedBuf, DirectFile};
use super::NvmeError;

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    Read,
    Write,
}

/// One positional transfer of a whole aligned buffer. Built only through the checked
/// constructors, so alignment is guaranteed when an driver sees it.
#[derive(Debug)]
pub struct IoRequest {
    file: Arc<DirectFile>,
    kind: OpKind,
    offset: u64,
    buf: AlignedBuf,
    /// When the driver first handed the operation to the kernel (None until then).
    started: Option<Instant>,
}

impl IoRequest {
    /// Reads `buf.len()` bytes at `offset` into `buf`.
    pub fn read(file: Arc<DirectFile>, offset: u64, buf: AlignedBuf) -> Result<Self, NvmeError> {
        Self::new(file, OpKind::Read, offset, buf)
    }

    /// Writes all of `buf` at `offset`.
    pub fn write(file: Arc<DirectFile>, offset: u64, buf: AlignedBuf) -> Result<Self, NvmeError> {
        Self::new(file, OpKind::Write, offset, buf)
    }

    pub fn new(
        file: Arc<DirectFile>,
        kind: OpKind,
        offset: u64,
        buf: AlignedBuf,
    ) -> Result<Self, NvmeError> {
        let oa = file.offset_align() as u64;
        if !offset.is_multiple_of(oa) {
            return Err(NvmeError::Misaligned {
                what: "file offset",
                value: offset,
                align: oa,
            });
        }
        if buf.align() < file.mem_align() {
            return Err(NvmeError::Misaligned {
                what: "buffer alignment",
                value: buf.align() as u64,
                align: file.mem_align() as u64,
            });
        }
        if !(buf.len() as u64).is_multiple_of(oa) {
            return Err(NvmeError::Misaligned {
                what: "transfer length",
                value: buf.len() as u64,
                align: oa,
            });
        }
        if buf.len() > u32::MAX as usize / 2 {
            return Err(NvmeError::invalid(format!(
                "transfer of {} bytes is too large for one operation",
                buf.len()
            )));
        }
        Ok(Self {
            file,
            kind,
            offset,
            buf,
            started: None,
        })
    }

    pub fn kind(&self) -> OpKind {
        self.kind
    }

    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn file(&self) -> &Arc<DirectFile> {
        &self.file
    }

    /// Gives the buffer back (e.g. when a request is dropped before submission).
    pub fn into_buf(self) -> AlignedBuf {
        self.buf
    }

    pub(crate) fn buf_mut(&mut self) -> &mut AlignedBuf {
        &mut self.buf
    }

    pub(crate) fn buf(&self) -> &AlignedBuf {
        &self.buf
    }

    /// Records that the operation was handed to the kernel now (the first time only: a
    /// resubmitted remainder keeps its original start).
    pub(crate) fn mark_started(&mut self) {
        self.started.get_or_insert_with(Instant::now);
    }

    pub(crate) fn complete(self, result: Result<(), NvmeError>) -> IoCompletion {
        let finished = Instant::now();
        IoCompletion {
            kind: self.kind,
            offset: self.offset,
            buf: self.buf,
            result,
            started: self.started.unwrap_or(finished),
            finished,
        }
    }
}

/// The outcome of one request, with its buffer handed back.
#[derive(Debug)]
pub struct IoCompletion {
    pub kind: OpKind,
    pub offset: u64,
    pub buf: AlignedBuf,
    /// `Ok` only if all `buf.len()` bytes were transferred.
    pub result: Result<(), NvmeError>,
    /// When the operation was first handed to the kernel (= `finished` for one that never
    /// was, e.g. an injected failure).
    pub started: Instant,
    /// When its final result was known. `started..finished` is the time the device had it,
    /// which is what online bandwidth tracking measures.
    pub finished: Instant,
}

/// A positional I/O driver. `submit` sends a batch and waits for all of it; completions come
/// back in request order. Drivers are shared between threads; concurrent batches proceed in
/// parallel where the driver can (io_uring interleaves them in one ring).
pub trait IoDriver: Send + Sync {
    /// Submits every request and waits for all completions. The outer error means the driver
    /// itself is gone; per-request failures are in each completion's `result`.
    fn submit(&self, reqs: Vec<IoRequest>) -> Result<Vec<IoCompletion>, NvmeError>;

    /// Short name for logs and benchmark tables.
    fn name(&self) -> &'static str;
}

impl<E: IoDriver + ?Sized> IoDriver for Arc<E> {
    fn submit(&self, reqs: Vec<IoRequest>) -> Result<Vec<IoCompletion>, NvmeError> {
        (**self).submit(reqs)
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
}

impl<E: IoDriver + ?Sized> IoDriver for Box<E> {
    fn submit(&self, reqs: Vec<IoRequest>) -> Result<Vec<IoCompletion>, NvmeError> {
        (**self).submit(reqs)
    }
    fn name(&self) -> &'static str {
        (**self).name()
    }
}

/// io_uring where the kernel allows it, otherwise pread/pwrite, with the reason logged.
pub fn open_best_driver(cfg: UringConfig) -> Arc<dyn IoDriver> {
    match UringDriver::new(cfg) {
        Ok(e) => Arc::new(e),
        Err(err) => {
            tracing::warn!(error = %err, "io_uring unavailable, falling back to pread/pwrite");
            Arc::new(PreadDriver::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_rejects_misalignment() {
        let dir = std::env::temp_dir().join(format!("kvtier-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = Arc::new(DirectFile::open(&dir.join("f")).unwrap());
        let buf = AlignedBuf::new(4096, 4096).unwrap();
        let err = IoRequest::read(f.clone(), 100, buf).unwrap_err();
        assert!(matches!(
            err,
            NvmeError::Misaligned {
                what: "file offset",
                ..
            }
        ));
        let small = AlignedBuf::new(512, 512).unwrap();
        let err = IoRequest::read(f, 0, small).unwrap_err();
        assert!(matches!(err, NvmeError::Misaligned { .. }));
        std::fs::remove_dir_all(dir).unwrap();
    }
}
