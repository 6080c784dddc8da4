//! Batches of page reads, each page verified (magic, identity, crc32c) before it is data.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::links::OpTiming;
use super::{PageRead, PageStore};
use crate::nvme::buf::{AlignedBuf, BufPool};
use crate::nvme::io::{IoCompletion, IoRequest, OpKind};
use crate::nvme::page::{self, HEADER_LEN};
use crate::nvme::{CorruptReason, NvmeError};

/// A verified page, payload in an aligned buffer (no copy after the read). The buffer goes
/// back to the store's pool on drop.
#[derive(Debug)]
pub struct PageData {
    buf: Option<AlignedBuf>,
    pool: Arc<BufPool>,
    len: usize,
    crc: u32,
}

impl PageData {
    pub fn payload(&self) -> &[u8] {
        let buf = self.buf.as_ref().expect("present until drop");
        &buf[HEADER_LEN..HEADER_LEN + self.len]
    }

    pub fn crc(&self) -> u32 {
        self.crc
    }

    /// Takes the whole page buffer out of the pool's cycle.
    pub fn into_buf(mut self) -> AlignedBuf {
        self.buf.take().expect("present until drop")
    }
}

impl Drop for PageData {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.put(b);
        }
    }
}

/// One result per page of a read batch.
pub type PageResults = Vec<Result<PageData, NvmeError>>;

impl PageStore {
    /// Reads and verifies pages in one batch, each exactly its extent (`addr.units` units).
    /// The outer error is for bad arguments or a dead driver; each page has its own result. A
    /// page that fails verification is `NvmeError::Corrupt`, never data.
    pub fn read_pages(&self, reads: &[PageRead]) -> Result<PageResults, NvmeError> {
        for r in reads {
            self.device(r.addr)?;
        }
        let parts = self.per_chunk(reads.iter().map(|r| r.addr), |r| self.read_chunk(&reads[r]));
        let mut out = Vec::with_capacity(reads.len());
        let mut timings = Vec::with_capacity(reads.len());
        let mut outer = None;
        for part in parts {
            match part {
                Ok((pages, t)) => {
                    out.extend(pages);
                    timings.extend(t);
                }
                Err(e) => {
                    outer.get_or_insert(e);
                }
            }
        }
        self.account(OpKind::Read, &timings);
        match outer {
            None => Ok(out),
            Some(e) => Err(e),
        }
    }

    /// Reads and verifies one chunk. The outer error is a dead driver.
    fn read_chunk(&self, reads: &[PageRead]) -> Result<(PageResults, Vec<OpTiming>), NvmeError> {
        let mut reqs = Vec::with_capacity(reads.len());
        for r in reads {
            let file = &self.devices[r.addr.device as usize].file;
            // Validated by read_pages: the length is a whole number of units.
            let buf = self.pool.get(self.addr_bytes(r.addr) as usize)?;
            reqs.push(IoRequest::read(file.clone(), self.offset(r.addr), buf)?);
        }
        let done = self.driver.submit(reqs)?;
        let timings = done
            .iter()
            .zip(reads)
            .map(|(c, r)| OpTiming::of(c, r.addr.device))
            .collect();
        let pages = done
            .into_iter()
            .zip(reads)
            .map(|(c, r)| self.verify(c, r))
            .collect();
        Ok((pages, timings))
    }

    /// Turns a read completion into verified page data (or the typed error), recycling the
    /// buffer of a failed one.
    fn verify(&self, c: IoCompletion, r: &PageRead) -> Result<PageData, NvmeError> {
        if let Err(e) = c.result {
            self.pool.put(c.buf);
            return Err(e);
        }
        self.bytes_read
            .fetch_add(c.buf.len() as u64, Ordering::Relaxed);
        let checked = page::verify(&c.buf, r.id).and_then(|(len, crc)| match r.expected_crc {
            Some(expected) if expected != crc => Err(CorruptReason::UnexpectedChecksum {
                expected,
                found: crc,
            }),
            _ => Ok((len, crc)),
        });
        match checked {
            Ok((len, crc)) => Ok(PageData {
                buf: Some(c.buf),
                pool: self.pool.clone(),
                len,
                crc,
            }),
            Err(reason) => {
                self.pool.put(c.buf);
                self.corrupt_pages.fetch_add(1, Ordering::Relaxed);
                Err(NvmeError::Corrupt {
                    device: r.addr.device,
                    page: r.addr.page,
                    reason,
                })
            }
        }
    }
}
