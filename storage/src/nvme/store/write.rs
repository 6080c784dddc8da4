//! Batches of page writes: encoded into pooled buffers chunk by chunk on the store's workers;
//! `sync` makes them durable.

use std::sync::atomic::Ordering;

use super::links::OpTiming;
use super::{NvmeError, PageStore, PageWrite};
use crate::nvme::io::{IoRequest, OpKind};
use crate::nvme::page::{self, HEADER_LEN};

/// One written chunk: its pages' checksums, timings and first failure.
struct ChunkWritten {
    crcs: Vec<u32>,
    timings: Vec<OpTiming>,
    first_err: Option<NvmeError>,
}

impl PageStore {
    /// Writes pages (to allocated extents) in one batch, each write covering exactly its
    /// extent (header, payload, zero padding). Returns each page's checksum, for the manifest.
    /// Not durable until [`PageStore::sync`] returns. On error, pages of the batch may be
    /// partially written: the caller must not reference them. Every page is attempted; the
    /// error is that of the first page (in batch order) that failed.
    pub fn write_pages(&self, writes: &[PageWrite<'_>]) -> Result<Vec<u32>, NvmeError> {
        // Arguments first: a bad one fails the batch before any I/O.
        for w in writes {
            let dev = self.device(w.addr)?;
            if !dev.alloc.lock().is_page(w.addr.page, w.addr.units) {
                return Err(NvmeError::invalid(format!(
                    "write to unallocated page {:?}",
                    w.addr
                )));
            }
            if w.payload.len() > self.max_payload
                || (HEADER_LEN + w.payload.len()) as u64 > self.addr_bytes(w.addr)
            {
                return Err(NvmeError::invalid(format!(
                    "payload of {} bytes does not fit the page {:?} ({} bytes with the header; largest payload {})",
                    w.payload.len(),
                    w.addr,
                    self.addr_bytes(w.addr),
                    self.max_payload
                )));
            }
        }
        let parts = self.per_chunk(writes.iter().map(|w| w.addr), |r| {
            self.write_chunk(&writes[r])
        });
        let mut crcs = Vec::with_capacity(writes.len());
        let mut timings = Vec::with_capacity(writes.len());
        let mut first_err = None;
        for part in parts {
            match part {
                Ok(p) => {
                    crcs.extend(p.crcs);
                    timings.extend(p.timings);
                    if let Some(e) = p.first_err {
                        first_err.get_or_insert(e);
                    }
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.account(OpKind::Write, &timings);
        match first_err {
            None => Ok(crcs),
            Some(e) => Err(e),
        }
    }

    /// Encodes one chunk of validated writes into pooled buffers and submits it. The outer
    /// error is a dead driver.
    fn write_chunk(&self, writes: &[PageWrite<'_>]) -> Result<ChunkWritten, NvmeError> {
        let mut reqs = Vec::with_capacity(writes.len());
        let mut crcs = Vec::with_capacity(writes.len());
        for w in writes {
            let file = &self.devices[w.addr.device as usize].file;
            // Validated by write_pages: a whole number of units that holds the payload.
            let mut buf = self.pool.get(self.addr_bytes(w.addr) as usize)?;
            crcs.push(page::encode(&mut buf, w.id, w.payload));
            reqs.push(IoRequest::write(file.clone(), self.offset(w.addr), buf)?);
        }
        let done = self.driver.submit(reqs)?;
        let mut timings = Vec::with_capacity(done.len());
        let mut first_err = None;
        for (c, w) in done.into_iter().zip(writes) {
            timings.push(OpTiming::of(&c, w.addr.device));
            match c.result {
                Ok(()) => {
                    self.bytes_written
                        .fetch_add(c.buf.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
            self.pool.put(c.buf);
        }
        Ok(ChunkWritten {
            crcs,
            timings,
            first_err,
        })
    }

    /// fdatasync every device: after this, completed page writes survive power loss.
    pub fn sync(&self) -> Result<(), NvmeError> {
        for d in &self.devices {
            // A failed fdatasync means written pages may not be on the device: a write error.
            d.file.sync_data().inspect_err(|_| {
                self.io_errors.fetch_add(1, Ordering::Relaxed);
            })?;
        }
        Ok(())
    }
}
