//! A session's record in the remote store: `magic | version | reserved | crc32c | len` (16
//! bytes, little-endian; the crc covers the version, len and the payload) followed by the rkyv
//! bytes of a [`RemoteRecord`].

use kvtier_storage::nvme::manifest::SessionRecord;
use kvtier_storage::Selector;
use rkyv::rancor;

use crate::{RemoteError, Result};

const MAGIC: u32 = u32::from_le_bytes(*b"KVTR");
/// Version 2 added the summaries' checksums and lengths; version 3 changed the key sketch in a
/// summary to one scale per channel. Version 1 records are still read, and version 2 ones; a
/// sketch session's pages of either have no summary this build reads, so it resumes by reading
/// them whole (its sketches rebuilt from the runs).
const VERSION: u16 = 3;
const HEADER: usize = 16;

/// Where one (layer, block) run of a session is in the remote store and what it must verify
/// as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct RemotePage {
    pub layer: u32,
    pub block: u32,
    pub generation: u64,
    pub crc: u32,
    pub payload_len: u32,
    /// The checksum and length of the block's summary (0 and 0: none stored, a version 1
    /// record's page).
    pub summary_crc: u32,
    pub summary_len: u32,
}

/// A version 1 page: no summary.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct PageV1 {
    layer: u32,
    block: u32,
    generation: u64,
    crc: u32,
    payload_len: u32,
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct RecordV1 {
    session: SessionRecord,
    pages: Vec<PageV1>,
    generation: u64,
}

/// A session as the remote store holds it: its manifest record (whose `pages`, the NVMe
/// tier's, are empty here) and its pages, sorted by (layer, block).
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct RemoteRecord {
    pub session: SessionRecord,
    pub pages: Vec<RemotePage>,
    /// The generation of the write that committed this record.
    pub generation: u64,
}

impl RemoteRecord {
    pub fn id(&self) -> u64 {
        self.session.id
    }

    /// The page holding `(layer, block)`.
    pub fn page(&self, layer: u32, block: u32) -> Option<&RemotePage> {
        self.pages
            .binary_search_by_key(&(layer, block), |p| (p.layer, p.block))
            .ok()
            .map(|i| &self.pages[i])
    }

    /// Whether every page has its summary stored (a session written by a node that stored
    /// none resumes by reading its pages whole).
    pub fn has_summaries(&self) -> bool {
        self.pages.iter().all(|p| p.summary_len > 0)
    }

    /// The bytes the store keeps.
    pub fn encode(&self) -> Vec<u8> {
        let body = rkyv::to_bytes::<rancor::Error>(self).expect("serialising a record");
        frame(VERSION, &body)
    }

    /// Verifies and decodes what [`Self::encode`] wrote for session `id`.
    pub fn decode(id: u64, bytes: &[u8]) -> Result<Self> {
        let bad = |reason: String| RemoteError::CorruptRecord {
            session: id,
            reason,
        };
        if bytes.len() < HEADER {
            return Err(bad(format!(
                "{} bytes, shorter than its header",
                bytes.len()
            )));
        }
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4"));
        if u32_at(0) != MAGIC {
            return Err(bad(format!("bad magic {:#x}", u32_at(0))));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        let (stored, len) = (u32_at(8), u32_at(12));
        let body = &bytes[HEADER..];
        if body.len() != len as usize {
            return Err(bad(format!(
                "{} payload bytes, header says {len}",
                body.len()
            )));
        }
        let computed = crc(version, len, body);
        if stored != computed {
            return Err(bad(format!("checksum {stored:#x}, computed {computed:#x}")));
        }
        // rkyv's validated access wants its bytes aligned: copy into an aligned buffer.
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(body.len());
        aligned.extend_from_slice(body);
        let undecodable = |e: rancor::Error| bad(format!("does not decode: {e}"));
        let rec = match version {
            VERSION => {
                rkyv::from_bytes::<RemoteRecord, rancor::Error>(&aligned).map_err(undecodable)?
            }
            2 => {
                let mut r = rkyv::from_bytes::<RemoteRecord, rancor::Error>(&aligned)
                    .map_err(undecodable)?;
                // Its sketches' scales are per key: of a sketch session keep only the runs.
                if r.session.policy.selector != Selector::Bound.code() {
                    for p in &mut r.pages {
                        (p.summary_crc, p.summary_len) = (0, 0);
                    }
                }
                r
            }
            1 => {
                let v1 =
                    rkyv::from_bytes::<RecordV1, rancor::Error>(&aligned).map_err(undecodable)?;
                RemoteRecord {
                    session: v1.session,
                    pages: v1
                        .pages
                        .into_iter()
                        .map(|p| RemotePage {
                            layer: p.layer,
                            block: p.block,
                            generation: p.generation,
                            crc: p.crc,
                            payload_len: p.payload_len,
                            summary_crc: 0,
                            summary_len: 0,
                        })
                        .collect(),
                    generation: v1.generation,
                }
            }
            _ => {
                return Err(bad(format!(
                    "version {version}, this build reads 1 to {VERSION}"
                )))
            }
        };
        if rec.session.id != id {
            return Err(bad(format!("names session {}", rec.session.id)));
        }
        Ok(rec)
    }
}

/// The header (module docs) and `body` of a record of `version`.
fn frame(version: u16, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + body.len());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&crc(version, body.len() as u32, body).to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

fn crc(version: u16, len: u32, body: &[u8]) -> u32 {
    let c = crc32c::crc32c(&version.to_le_bytes());
    let c = crc32c::crc32c_append(c, &len.to_le_bytes());
    crc32c::crc32c_append(c, body)
}

#[cfg(test)]
mod tests {
    use kvtier_storage::nvme::manifest::{GeometryRecord, PolicyRecord};
    use kvtier_storage::{DType, Geometry, Policy};

    use super::*;

    fn record() -> RemoteRecord {
        let g = Geometry {
            layers: 2,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 8,
            dtype: DType::F16,
            block_tokens: 16,
        };
        RemoteRecord {
            session: SessionRecord {
                id: 9,
                owner_uid: 1000,
                label: "chat".into(),
                geometry: GeometryRecord::from(&g),
                policy: PolicyRecord::from(&Policy::sketch(1, 1, 2, 2)),
                layer_tokens: vec![20, 20],
                pages: Vec::new(),
                pinned: false,
                created_unix_ms: 5,
            },
            pages: vec![RemotePage {
                layer: 0,
                block: 1,
                generation: 3,
                crc: 77,
                payload_len: 512,
                summary_crc: 78,
                summary_len: 96,
            }],
            generation: 3,
        }
    }

    #[test]
    fn a_record_round_trips_and_every_flipped_byte_is_refused() {
        let r = record();
        let bytes = r.encode();
        assert_eq!(RemoteRecord::decode(9, &bytes).unwrap(), r);
        assert_eq!(r.page(0, 1).unwrap().generation, 3);
        assert!(r.page(1, 1).is_none());
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            // The reserved field (6..8) is outside the checksum: a flip there is harmless.
            if (6..8).contains(&i) {
                continue;
            }
            let e = RemoteRecord::decode(9, &b).expect_err("a flipped byte");
            assert!(e.is_data_loss(), "{e}");
        }
        assert!(RemoteRecord::decode(9, &bytes[..10]).is_err());
        assert!(r.has_summaries());
        assert!(
            RemoteRecord::decode(8, &bytes).is_err(),
            "another session's record"
        );
    }

    /// A version 1 record (written before summaries were stored) still reads: its pages
    /// have no summary, so its session resumes by reading them whole.
    #[test]
    fn a_version_1_record_reads_without_summaries() {
        let r = record();
        let v1 = RecordV1 {
            session: r.session.clone(),
            pages: r
                .pages
                .iter()
                .map(|p| PageV1 {
                    layer: p.layer,
                    block: p.block,
                    generation: p.generation,
                    crc: p.crc,
                    payload_len: p.payload_len,
                })
                .collect(),
            generation: r.generation,
        };
        let bytes = frame(1, &rkyv::to_bytes::<rancor::Error>(&v1).unwrap());
        let got = RemoteRecord::decode(9, &bytes).unwrap();
        assert_eq!(got.pages[0].payload_len, 512);
        assert_eq!((got.pages[0].summary_crc, got.pages[0].summary_len), (0, 0));
        assert!(!got.has_summaries());
        assert_eq!(got.session, r.session);
    }

    /// A version 2 record's summaries hold per-key sketch scales: a sketch session's are
    /// dropped (it resumes by reading its pages whole), a bound session's, bounds only, kept.
    #[test]
    fn a_version_2_record_keeps_summaries_of_bound_sessions_only() {
        for (policy, kept) in [
            (Policy::sketch(1, 1, 2, 2), false),
            (Policy::bound(1, 1, 2), true),
        ] {
            let mut r = record();
            r.session.policy = PolicyRecord::from(&policy);
            let bytes = frame(2, &rkyv::to_bytes::<rancor::Error>(&r).unwrap());
            let got = RemoteRecord::decode(9, &bytes).unwrap();
            assert_eq!(got.has_summaries(), kept, "{policy:?}");
            assert_eq!(got.pages[0].payload_len, 512);
            assert_eq!(got.session, r.session);
        }
    }
}
