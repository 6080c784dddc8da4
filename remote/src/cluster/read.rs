//! Reading pages and summaries back, each verified against the record that names it.

use kvtier_storage::nvme::{page, CorruptReason, PageId};
use redis::cluster::cluster_pipe;

use super::{batches, ClusterStore};
use crate::{RemoteError, RemotePage, RemoteRecord, Result};

/// Which of a (layer, block)'s two keys a read wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Part {
    Page,
    Summary,
}

impl Part {
    /// The checksum and length the record names for this part of `pg`.
    fn expected(self, pg: &RemotePage) -> (u32, u32) {
        match self {
            Part::Page => (pg.crc, pg.payload_len),
            Part::Summary => (pg.summary_crc, pg.summary_len),
        }
    }
}

impl ClusterStore {
    /// The `part` of each of `wanted` (layer, block) runs of the session `record` describes,
    /// in order, pipelined over several connections. A run the record does not name (or
    /// names without a summary, when summaries are asked for) is [`RemoteError::NoSuchRun`].
    pub(super) fn read_parts(
        &self,
        record: &RemoteRecord,
        wanted: &[(u32, u32)],
        part: Part,
    ) -> Result<Vec<Vec<u8>>> {
        let id = record.id();
        let mut pages = Vec::with_capacity(wanted.len());
        for &(layer, block) in wanted {
            let pg = record
                .page(layer, block)
                .filter(|pg| part == Part::Page || pg.summary_len > 0)
                .ok_or(RemoteError::NoSuchRun {
                    session: id,
                    layer,
                    block,
                })?;
            pages.push(*pg);
        }
        let sizes = || {
            pages
                .iter()
                .map(|p| page::HEADER_LEN + part.expected(p).1 as usize)
        };
        // A read smaller than a pipeline per connection (a step's keep-set) is still spread
        // over every connection.
        let per_stream = sizes().sum::<usize>().div_ceil(self.cfg.streams.max(1));
        let cut = batches(sizes(), self.cfg.batch_bytes.min(per_stream.max(1)));
        let got: Vec<Vec<Vec<u8>>> = self.in_streams(
            cut.len(),
            |c, b| {
                let mut p = cluster_pipe();
                for pg in &pages[cut[b].clone()] {
                    p.get(match part {
                        Part::Page => self.page_key(id, pg.layer, pg.block, pg.generation),
                        Part::Summary => self.summary_key(id, pg.layer, pg.block, pg.generation),
                    });
                }
                let got: Vec<Option<Vec<u8>>> = p.query(c)?;
                pages[cut[b].clone()]
                    .iter()
                    .zip(got)
                    .map(|(pg, bytes)| verified(id, pg, part, bytes))
                    .collect()
            },
            |_| Ok(()),
        )?;
        Ok(got.into_iter().flatten().collect())
    }
}

/// The payload of a key read for `pg`'s `part` (None: the key is missing), verified against
/// the record: identity, checksum, length.
fn verified(id: u64, pg: &RemotePage, part: Part, bytes: Option<Vec<u8>>) -> Result<Vec<u8>> {
    let Some(mut bytes) = bytes else {
        return Err(RemoteError::MissingPage {
            session: id,
            layer: pg.layer,
            block: pg.block,
            generation: pg.generation,
        });
    };
    let corrupt = |reason| RemoteError::CorruptPage {
        session: id,
        layer: pg.layer,
        block: pg.block,
        reason,
    };
    if bytes.len() < page::HEADER_LEN {
        return Err(corrupt(CorruptReason::BadLength {
            found: bytes.len() as u32,
            max: page::HEADER_LEN,
        }));
    }
    let expected = PageId {
        session: id,
        layer: pg.layer,
        block: pg.block,
        generation: pg.generation,
    };
    let (len, crc) = page::verify(&bytes, expected).map_err(corrupt)?;
    let (want_crc, want_len) = part.expected(pg);
    if crc != want_crc || len != want_len as usize {
        return Err(corrupt(CorruptReason::UnexpectedChecksum {
            expected: want_crc,
            found: crc,
        }));
    }
    bytes.drain(..page::HEADER_LEN);
    bytes.truncate(len);
    Ok(bytes)
}
