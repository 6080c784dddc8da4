//! Helpers shared by the NVMe tier's integration tests (`nvme_drivers`, `nvme_store`,
//! `nvme_faults`, `nvme_workers`, `nvme_pages_upgrade`): scratch directories, payload
//! patterns, page-store configurations and page batches.

#![allow(dead_code)]

use std::sync::Arc;

use kvtier_storage::nvme::io::{Fault, FaultRule, Trigger};
use kvtier_storage::nvme::manifest::{GeometryRecord, PolicyRecord, SessionRecord};
use kvtier_storage::nvme::store::{PageRead, PageWrite};
use kvtier_storage::nvme::BlockRun;
use kvtier_storage::nvme::{
    DeviceConfig, IoDriver, OpKind, PageAddr, PageId, PageStore, PageStoreConfig,
};
use kvtier_tests::kv::xorshift_bytes;
use kvtier_tests::sys::{scratch_dir, ScratchDir};

pub fn test_dir(name: &str) -> ScratchDir {
    scratch_dir(env!("CARGO_TARGET_TMPDIR"), name)
}

pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    xorshift_bytes(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), len)
}

/// A one-layer session record of `blocks` full 16-token blocks (head_dim 8), no pages yet.
pub fn one_layer_record(id: u64, blocks: u32) -> SessionRecord {
    SessionRecord {
        id,
        owner_uid: 0,
        label: String::new(),
        geometry: GeometryRecord {
            layers: 1,
            q_heads: 1,
            kv_heads: 1,
            head_dim: 8,
            dtype: 0,
            block_tokens: 16,
        },
        policy: PolicyRecord {
            sink_blocks: 1,
            local_blocks: 1,
            top_k: 1,
            selector: 0,
            candidates: 0,
        },
        layer_tokens: vec![16 * blocks as u64],
        pages: Vec::new(),
        pinned: false,
        created_unix_ms: 0,
    }
}

/// `payloads` as the runs of layer 0, block i = payload i.
pub fn layer0_runs(payloads: &[Vec<u8>]) -> Vec<BlockRun<'_>> {
    payloads
        .iter()
        .enumerate()
        .map(|(b, p)| BlockRun {
            layer: 0,
            block: b as u32,
            bytes: p,
        })
        .collect()
}

/// Devices `dev0`, `dev1`, ... in `dir`, one a `(capacity_bytes, bandwidth_bytes_per_s)`.
pub fn devices(
    dir: &std::path::Path,
    specs: impl IntoIterator<Item = (u64, f64)>,
) -> Vec<DeviceConfig> {
    specs
        .into_iter()
        .enumerate()
        .map(|(i, (capacity, bw))| DeviceConfig {
            path: dir.join(format!("dev{i}")),
            capacity_bytes: capacity,
            bandwidth_bytes_per_s: bw,
        })
        .collect()
}

/// Devices of `capacity` bytes, one a bandwidth of `bws`, for payloads of up to 10,000 bytes.
pub fn store_cfg(dir: &std::path::Path, bws: &[f64], capacity: u64) -> PageStoreConfig {
    PageStoreConfig {
        devices: devices(dir, bws.iter().map(|&bw| (capacity, bw))),
        max_payload: 10_000,
    }
}

pub fn id(block: u32, generation: u64) -> PageId {
    PageId {
        session: 9,
        layer: 2,
        block,
        generation,
    }
}

// ---- Multi-threaded batches: a store of full pages, faults pinned to chosen pages ----

/// A page whose payload fills it (3 x 4 KiB minus the header): the checksum covers every
/// byte, so a flipped bit anywhere is caught.
pub const FULL_PAYLOAD: usize = 3 * 4096 - 64;
/// Bytes of a page of [`FULL_PAYLOAD`].
pub const FULL_PAGE: u64 = 3 * 4096;
/// Pages per test batch: several chunks (64 pages of 12 KiB each), so several workers.
pub const PAGES: usize = 300;

pub fn full_page_store(
    dir: &std::path::Path,
    driver: Arc<dyn IoDriver>,
    workers: usize,
) -> PageStore {
    let store = PageStore::open(
        &PageStoreConfig {
            devices: vec![DeviceConfig {
                path: dir.join("dev0"),
                capacity_bytes: (PAGES as u64 + 8) * FULL_PAGE,
                bandwidth_bytes_per_s: 1.0,
            }],
            max_payload: FULL_PAYLOAD,
        },
        driver,
    )
    .unwrap();
    assert_eq!(
        (store.unit(), store.page_bytes(FULL_PAYLOAD)),
        (4096, FULL_PAGE)
    );
    assert!(
        PAGES > 2 * PageStore::chunk_pages(FULL_PAGE),
        "the batch spans several chunks"
    );
    store.set_workers(workers).unwrap();
    store
}

pub fn full_payloads() -> Vec<Vec<u8>> {
    (0..PAGES as u64)
        .map(|i| pattern(i + 100, FULL_PAYLOAD))
        .collect()
}

pub fn writes_of<'a>(
    addrs: &[PageAddr],
    payloads: &'a [Vec<u8>],
    only: &[usize],
) -> Vec<PageWrite<'a>> {
    only.iter()
        .map(|&i| PageWrite {
            addr: addrs[i],
            id: id(i as u32, 1),
            payload: &payloads[i],
        })
        .collect()
}

pub fn reads_of(addrs: &[PageAddr], crcs: Option<&[u32]>, only: &[usize]) -> Vec<PageRead> {
    only.iter()
        .map(|&i| PageRead {
            addr: addrs[i],
            id: id(i as u32, 1),
            expected_crc: crcs.map(|c| c[i]),
        })
        .collect()
}

/// A fault on the `store_page`th page of a fresh [`full_page_store`] (which hands out its
/// pages in order, one after another).
pub fn pinned(kind: OpKind, fault: Fault, store_page: usize) -> FaultRule {
    FaultRule {
        kind: Some(kind),
        fault,
        trigger: Trigger::AtOffset(store_page as u64 * FULL_PAGE),
    }
}
