//! CUDA backend, errors: bad inputs get typed errors, and pinned host regions register in
//! chunks and clean up after a failure.
//! Every test is `#[ignore]`d with the reason, so a machine without a GPU reports it as ignored;
//! bench/gpu/run.sh runs them with `--include-ignored`. Run anyway without a device, each prints
//! "skipped: no CUDA device" and passes.
#![cfg(feature = "cuda")]

mod gpu_common;

use gpu_common::{geom, gpu, Harness, KeyGen, POLICY};
use kvtier_kernels::cuda::{
    AnonMapping, CudaBackend, CudaConfig, CudaError, DecodeItem, PinnedRegion, SummaryDtype,
};
use kvtier_storage::DType;

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn bad_inputs_get_typed_errors() {
    let cfg = CudaConfig::new(
        geom(8, 2, 64, 16, DType::Bf16),
        POLICY,
        20,
        2,
        SummaryDtype::F32,
    );
    let Some(mut h) = Harness::start(cfg, 60) else {
        return;
    };
    let s = h.add_session(100, KeyGen { templates: 0 });
    let q = h.query();
    let be = &mut h.be;
    let one = |slot| [DecodeItem { slot, q: &q }];
    assert!(matches!(
        be.decode_layer(2, &one(s)),
        Err(CudaError::LayerOutOfRange { .. })
    ));
    assert!(matches!(
        be.decode_layer(0, &one(1)),
        Err(CudaError::SessionNotOpen { slot: 1 })
    ));
    assert!(matches!(
        be.decode_layer(0, &one(7)),
        Err(CudaError::SlotOutOfRange { .. })
    ));
    assert!(matches!(
        be.decode_layer(0, &[]),
        Err(CudaError::EmptyBatch)
    ));
    let dup = [DecodeItem { slot: s, q: &q }, DecodeItem { slot: s, q: &q }];
    assert!(matches!(
        be.decode_layer(0, &dup),
        Err(CudaError::DuplicateSession { .. })
    ));
    let three = [
        DecodeItem { slot: s, q: &q },
        DecodeItem { slot: 1, q: &q },
        DecodeItem { slot: 0, q: &q },
    ];
    assert!(matches!(
        be.decode_layer(0, &three),
        Err(CudaError::BatchTooLarge { .. })
    ));
    assert!(matches!(
        be.decode_layer(
            0,
            &[DecodeItem {
                slot: s,
                q: &q[1..]
            }]
        ),
        Err(CudaError::BadLength { .. })
    ));
    let mut qn = q.clone();
    qn[5] = f32::NAN;
    assert!(matches!(
        be.decode_layer(0, &[DecodeItem { slot: s, q: &qn }]),
        Err(CudaError::NonFinite { index: 5, .. })
    ));
    // Tokens beyond the mapped/summarised blocks: refused, never attended.
    be.set_tokens(s, 0, 200).unwrap();
    assert!(matches!(
        be.decode_layer(0, &one(s)),
        Err(CudaError::NotReady { .. })
    ));
    assert!(matches!(
        be.set_tokens(s, 0, 150),
        Err(CudaError::BadTokenCount { .. })
    ));
    assert!(matches!(
        be.set_tokens(s, 0, 20 * 16 + 1),
        Err(CudaError::BadTokenCount { .. })
    ));
    be.open_session(1).unwrap();
    assert!(matches!(
        be.decode_layer(0, &one(1)),
        Err(CudaError::EmptySession { .. })
    ));
    assert!(matches!(
        be.open_session(1),
        Err(CudaError::SessionAlreadyOpen { .. })
    ));
    assert!(matches!(
        be.upload_summaries(s, 0, 0, &[0.0; 7]),
        Err(CudaError::BadLength { .. })
    ));
    let per = 2 * 2 * 64;
    assert!(matches!(
        be.upload_summaries(s, 0, 19, &vec![0.0; 2 * per]),
        Err(CudaError::BlockOutOfRange { .. })
    ));
    let mut bad = vec![0.0; per];
    bad[3] = f32::INFINITY;
    assert!(matches!(
        be.upload_summaries(s, 0, 0, &bad),
        Err(CudaError::NonFinite { .. })
    ));
    let region_len = be.host_mut().unwrap().len() as u64;
    assert!(matches!(
        be.map_blocks(s, 0, 0, &[region_len]),
        Err(CudaError::HostRange { .. })
    ));
    assert!(matches!(
        be.map_blocks(s, 0, 0, &[u64::MAX - 3]),
        Err(CudaError::HostRange { .. })
    ));
    let map = AnonMapping::new(1 << 20).unwrap();
    let other = PinnedRegion::register_owned(be.context(), map).unwrap();
    assert!(matches!(
        be.attach_host(other),
        Err(CudaError::HostRegionAttached)
    ));
    be.close_session(1).unwrap();
    assert!(matches!(
        be.close_session(1),
        Err(CudaError::SessionNotOpen { .. })
    ));
    assert!(matches!(
        be.detach_host(),
        Err(CudaError::SessionsOpen { open: 1 })
    ));
    be.close_session(s).unwrap();
    let region = be.detach_host().unwrap();
    assert!(matches!(be.detach_host(), Err(CudaError::NoHostRegion)));
    be.attach_host(region).unwrap();

    let mut fresh = CudaBackend::new(0, cfg).unwrap();
    fresh.open_session(0).unwrap();
    assert!(matches!(
        fresh.map_blocks(0, 0, 0, &[0]),
        Err(CudaError::NoHostRegion)
    ));
    assert!(matches!(
        CudaBackend::new(4096, cfg),
        Err(CudaError::NoDevice { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn pinned_region_chunks_and_cleanup() {
    if !gpu() {
        return;
    }
    let cfg = CudaConfig::new(
        geom(8, 2, 64, 16, DType::Bf16),
        POLICY,
        20,
        1,
        SummaryDtype::F32,
    );
    let be = CudaBackend::new(0, cfg).unwrap();
    let ctx = be.context();
    let mut map = AnonMapping::new(1 << 20).unwrap();
    let base = map.as_mut_slice().as_mut_ptr();
    {
        // SAFETY: `map` outlives the region (dropped at the end of this block).
        let r = unsafe { PinnedRegion::register_chunked(ctx, base, 1 << 20, 64 << 10) }.unwrap();
        assert_eq!(r.chunk_count(), 16);
        assert!(r.device_addr(0, 64 << 10).is_ok());
        assert!(
            r.device_addr((64 << 10) - 16, 32).is_err(),
            "range crossing a chunk"
        );
        assert!(r.device_addr(1 << 20, 1).is_err());
        // The second half is registered already: a registration overlapping it fails after
        // registering its own first chunks, and must hand those back.
        // SAFETY: same live mapping.
        let e = unsafe { PinnedRegion::register_chunked(ctx, base, 1 << 20, 64 << 10) };
        assert!(matches!(e, Err(CudaError::Pin { offset: 0, .. })));
    }
    let mut map2 = AnonMapping::new(1 << 20).unwrap();
    let base2 = map2.as_mut_slice().as_mut_ptr();
    // SAFETY: map2 outlives r2 within this scope.
    let r2 = unsafe {
        PinnedRegion::register_chunked(ctx, base2.wrapping_add(512 << 10), 512 << 10, 64 << 10)
    }
    .unwrap();
    // SAFETY: as above; overlaps r2 from offset 512 KiB, so it fails at that chunk.
    let e = unsafe { PinnedRegion::register_chunked(ctx, base2, 1 << 20, 64 << 10) };
    assert!(
        matches!(e, Err(CudaError::Pin { offset, .. }) if offset == 512 << 10),
        "{e:?}"
    );
    // Its first 8 chunks were unregistered on failure: registering them again works.
    // SAFETY: as above.
    let again = unsafe { PinnedRegion::register_chunked(ctx, base2, 512 << 10, 64 << 10) };
    assert!(again.is_ok(), "{:?}", again.err());
    drop(again);
    drop(r2);
    drop(map2);
    drop(map);
    assert!(matches!(AnonMapping::new(0), Err(CudaError::EmptyRegion)));
    // SAFETY: misaligned base is rejected before any driver call.
    let e = unsafe { PinnedRegion::register(ctx, 0x1001 as *mut u8, 4096) };
    assert!(matches!(e, Err(CudaError::Misaligned { .. })));
}
