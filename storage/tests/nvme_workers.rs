//! The page store's worker threads: batches fanned out over several workers or run on
//! the caller, the worker count's validation, and pipelined bulk reads of a tier.

mod common;

use std::sync::Arc;

use kvtier_storage::nvme::io::{Fault, FaultRule, FaultyDriver, Trigger, UringConfig};
use kvtier_storage::nvme::{
    IoDriver, IoRequest, NvmeError, OpKind, PageStore, PreadDriver, UringDriver,
};

use common::{
    full_page_store, full_payloads, layer0_runs, one_layer_record, pattern, pinned, reads_of,
    test_dir, writes_of, FULL_PAGE, FULL_PAYLOAD, PAGES,
};

/// Records which threads submit to the driver.
struct Recording<E> {
    inner: E,
    threads: parking_lot::Mutex<Vec<std::thread::ThreadId>>,
}

impl<E: IoDriver> IoDriver for Recording<E> {
    fn submit(
        &self,
        reqs: Vec<IoRequest>,
    ) -> Result<Vec<kvtier_storage::nvme::io::IoCompletion>, NvmeError> {
        self.threads.lock().push(std::thread::current().id());
        self.inner.submit(reqs)
    }

    fn name(&self) -> &'static str {
        "recording"
    }
}

#[test]
fn one_worker_runs_every_batch_on_the_caller_with_the_same_bytes_as_several() {
    let payloads = full_payloads();
    let all: Vec<usize> = (0..PAGES).collect();
    let me = std::thread::current().id();
    let mut outcomes = Vec::new();
    for workers in [1, 4] {
        let dir = test_dir(&format!("workers-{workers}"));
        // Each operation holds the device 0.3 ms (a chunk about 20 ms), so while the caller
        // waits on its chunk the other workers take theirs.
        let stall = FaultRule {
            kind: None,
            fault: Fault::Stall(std::time::Duration::from_micros(300)),
            trigger: Trigger::Always,
        };
        let driver = Arc::new(Recording {
            inner: FaultyDriver::new(PreadDriver::new(), vec![stall], 0).unwrap(),
            threads: Default::default(),
        });
        let store = full_page_store(&dir, driver.clone(), workers);
        let chunk = PageStore::chunk_pages(FULL_PAGE);
        let chunks = PAGES.div_ceil(chunk);
        let addrs = store.alloc(9, PAGES, FULL_PAYLOAD).unwrap();
        let crcs = store
            .write_pages(&writes_of(&addrs, &payloads, &all))
            .unwrap();
        let read: Vec<Vec<u8>> = store
            .read_pages(&reads_of(&addrs, Some(&crcs), &all))
            .unwrap()
            .into_iter()
            .map(|r| r.unwrap().payload().to_vec())
            .collect();
        assert_eq!(read, payloads);
        let threads = std::mem::take(&mut *driver.threads.lock());
        assert_eq!(threads.len(), 2 * chunks, "one submission per chunk");
        let distinct: std::collections::HashSet<_> = threads.iter().collect();
        if workers == 1 {
            assert!(
                threads.iter().all(|&t| t == me),
                "set_workers(1): all on the caller"
            );
        } else {
            assert!(
                distinct.len() > 1,
                "several workers: {} threads",
                distinct.len()
            );
        }
        // A batch of one chunk never fans out.
        store
            .read_pages(&reads_of(&addrs, Some(&crcs), &all[..chunk]))
            .unwrap();
        assert_eq!(*driver.threads.lock(), vec![me]);
        let u = store.usage();
        assert_eq!(
            (u.devices[0].read_samples, u.devices[0].write_samples),
            (2, 1),
            "one sample per batch"
        );
        drop(store);
        outcomes.push((crcs, std::fs::read(dir.join("dev0")).unwrap()));
    }
    assert!(
        outcomes[0] == outcomes[1],
        "the same checksums and the same bytes on the device"
    );
}

#[test]
fn workers_are_validated() {
    let dir = test_dir("workers-bad");
    let store = full_page_store(&dir, Arc::new(PreadDriver::new()), 1);
    use kvtier_storage::nvme::store::MAX_WORKERS;
    assert!((1..=8).contains(&kvtier_storage::default_workers()));
    for bad in [0, MAX_WORKERS + 1] {
        assert!(matches!(
            store.set_workers(bad),
            Err(NvmeError::InvalidArgument { .. })
        ));
    }
    assert_eq!(store.workers(), 1, "a rejected value changes nothing");
    store.set_workers(MAX_WORKERS).unwrap();
    assert_eq!(store.workers(), MAX_WORKERS);
}

#[test]
fn read_runs_pipelined_delivers_every_batch_in_order_and_stops_at_the_first_error() {
    use kvtier_storage::nvme::tier::BULK_BATCH_UNMEASURED_PAGES;
    use kvtier_storage::nvme::NvmeTier;

    let dir = test_dir("pipelined");
    let n = 200usize;
    let eio_run = 77;
    let driver = Arc::new(
        FaultyDriver::new(
            UringDriver::new(UringConfig::default()).unwrap(),
            vec![pinned(OpKind::Read, Fault::Eio, eio_run)],
            0,
        )
        .unwrap(),
    );
    let store = full_page_store(&dir, driver, 4);
    let (tier, _) = NvmeTier::open(store, &dir.join("manifest")).unwrap();
    let payloads: Vec<Vec<u8>> = (0..n as u64).map(|i| pattern(i, 9000)).collect();
    let runs = layer0_runs(&payloads);
    let record = one_layer_record(1, n as u32);
    tier.put_session(&record, &runs).unwrap();
    let s = tier.session(1).unwrap();
    assert_eq!(
        s.page(0, eio_run as u32).unwrap().page,
        eio_run as u64 * 3,
        "pages in order, 3 units each"
    );
    // Block n is not stored: its own error, the others unaffected.
    let wanted: Vec<(u32, u32)> = (0..=n as u32).map(|b| (0, b)).collect();

    // Before any read is timed, batches go by count: several of them. The consumer's error
    // stops the read; no later batch is consumed.
    assert!(tier.store().read_links().is_none());
    let mut calls = 0;
    let e = tier
        .read_runs_pipelined(1, &wanted, |_, _| {
            calls += 1;
            if calls == 2 {
                Err(NvmeError::ShortRead {
                    offset: 0,
                    expected: 1,
                    got: 0,
                })
            } else {
                Ok(())
            }
        })
        .unwrap_err();
    assert!(matches!(e, NvmeError::ShortRead { .. }), "{e:?}");
    assert_eq!(calls, 2, "batches of {BULK_BATCH_UNMEASURED_PAGES}");

    // Every run once, in order, in the batches the planner makes (by the tracked rates now).
    let expected = tier.plan_batches(1, &wanted).unwrap();
    let mut seen = Vec::new();
    tier.read_runs_pipelined(1, &wanted, |r, pages| {
        assert_eq!(pages.len(), r.len());
        for (i, p) in r.clone().zip(pages) {
            match p {
                Ok(d) => assert_eq!(d.payload(), &payloads[i][..], "run {i}"),
                Err(NvmeError::Io { source, .. }) if i == eio_run => {
                    assert_eq!(source.raw_os_error(), Some(libc::EIO))
                }
                Err(NvmeError::InvalidArgument { .. }) if i == n => {}
                Err(e) => panic!("run {i}: {e}"),
            }
        }
        seen.push(r);
        Ok::<(), NvmeError>(())
    })
    .unwrap();
    assert_eq!(seen, expected);
    assert_eq!((seen[0].start, seen.last().unwrap().end), (0, n + 1));

    // A whole-batch error (unknown session) comes back as such, nothing consumed.
    let e = tier
        .read_runs_pipelined(7, &wanted, |_, _| -> Result<(), NvmeError> {
            panic!("nothing to consume")
        })
        .unwrap_err();
    assert!(matches!(e, NvmeError::InvalidArgument { .. }), "{e:?}");

    // One batch: read inline, same results.
    let mut one = 0;
    tier.read_runs_pipelined(1, &wanted[..5], |r, pages| {
        one += 1;
        assert_eq!(r, 0..5);
        assert!(pages.iter().all(|p| p.is_ok()));
        Ok::<(), NvmeError>(())
    })
    .unwrap();
    assert_eq!(one, 1);
}

/// A pipelined read of large pages holds at most PIPELINE_BATCH_BYTES of them per batch,
/// counting the bytes of the actual pages (3 MiB runs: ten to a batch).
#[test]
fn read_runs_pipelined_cuts_batches_by_the_bytes_of_the_pages() {
    use kvtier_storage::nvme::tier::PIPELINE_BATCH_BYTES;
    use kvtier_storage::nvme::{BlockRun, DeviceConfig, NvmeTier, PageStoreConfig};

    let dir = test_dir("pipelined-large");
    let run = 3 << 20;
    let n = 12usize;
    let store = PageStore::open(
        &PageStoreConfig {
            devices: vec![DeviceConfig {
                path: dir.join("dev0"),
                capacity_bytes: 40 << 20,
                bandwidth_bytes_per_s: 1.0,
            }],
            max_payload: run,
        },
        Arc::new(UringDriver::new(UringConfig::default()).unwrap()),
    )
    .unwrap();
    let page = store.page_bytes(run);
    let per_batch = (PIPELINE_BATCH_BYTES as u64 / page) as usize;
    assert_eq!(per_batch, 10);
    let (tier, _) = NvmeTier::open(store, &dir.join("manifest")).unwrap();
    let payloads: Vec<Vec<u8>> = (0..n as u64).map(|i| pattern(i, run)).collect();
    tier.put_session(&one_layer_record(1, n as u32), &layer0_runs(&payloads))
        .unwrap();
    let wanted: Vec<(u32, u32)> = (0..n as u32).map(|b| (0, b)).collect();
    let mut seen = Vec::new();
    tier.read_runs_pipelined(1, &wanted, |r, pages| {
        for (i, p) in r.clone().zip(pages) {
            assert_eq!(p.unwrap().payload(), &payloads[i][..], "run {i}");
        }
        seen.push(r);
        Ok::<(), NvmeError>(())
    })
    .unwrap();
    assert_eq!(seen, [0..per_batch, per_batch..n]);

    // Quotas count the bytes of pages: a rewritten run replaces its page, a new one adds its
    // own, whatever their sizes.
    let small = vec![1u8; 20 << 10];
    let more = [
        BlockRun {
            layer: 0,
            block: 0,
            bytes: &small,
        },
        BlockRun {
            layer: 0,
            block: n as u32,
            bytes: &payloads[0],
        },
    ];
    let small_page = tier.store().page_bytes(small.len());
    assert_eq!(small_page, 24 << 10);
    assert_eq!(
        tier.owner_bytes_after(0, 1, &more),
        n as u64 * page - page + small_page + page
    );
    assert_eq!(tier.owner_bytes_after(0, 1, &[]), n as u64 * page);
    assert_eq!(
        tier.owner_bytes_after(7, 2, &more),
        small_page + page,
        "another owner's new session"
    );
}
