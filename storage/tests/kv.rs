//! KvCache behaviour: layout, incremental bounds, batching invariance, bad appends and
//! in-place appends (restores: kv_restore.rs).

mod kv_common;

use kv_common::*;
use kvtier_storage::sketch::{quarter_of, quarters};
use kvtier_storage::testing::Rng;
use kvtier_storage::{
    ArenaOptions, DType, Geometry, HostArena, InPlaceAppend, KvCache, StorageError,
};
use kvtier_tests::kv::{layer_rows, payload, rows, sub_payload};
use proptest::prelude::*;

#[test]
fn tiles_hold_rows_where_the_layout_says() {
    let g = geo(DType::F32, 4);
    let mut kv = KvCache::new(g, arena(16)).unwrap();
    let p = payload(&g, 6, 1);
    kv.append(0, 6, &p).unwrap();
    let row = g.row_bytes();
    let layer1 = kv.layer(1).unwrap();
    assert_eq!(layer1.blocks(), 2);
    assert_eq!(layer1.valid_tokens(0), 4);
    assert_eq!(layer1.valid_tokens(1), 2);
    // Token 5 of layer 1, kv head 1: block 1, slot 1.
    let (k5, v5) = layer_rows(&g, &p, 6, 1, 5..6);
    let (k_src, v_src) = (&k5[row..2 * row], &v5[row..2 * row]);
    let (kt, vt) = layer1.tile(1, 1);
    assert_eq!(&kt[row..2 * row], k_src);
    assert_eq!(&vt[row..2 * row], v_src);
    assert!(
        kt[2 * row..].iter().all(|&b| b == 0),
        "slots past the tail are zero"
    );
}

#[test]
fn bounds_are_exact_max_and_min_of_stored_keys() {
    for dtype in [DType::Bf16, DType::F16, DType::F32] {
        let g = geo(dtype, 8);
        let kv = cache(g, &arena(16), 21, 7);
        let v = kv.layer(0).unwrap();
        let d = g.head_dim as usize;
        for b in 0..v.blocks() {
            for h in 0..g.kv_heads as usize {
                let (kt, _) = v.tile(b, h);
                let keys = dtype.decode_vec(&kt[..v.valid_tokens(b) * g.row_bytes()]);
                let (mx, mn) = v.bounds(b, h);
                for i in 0..d {
                    let col = keys.chunks(d).map(|r| r[i]);
                    assert_eq!(mx[i], col.clone().fold(f32::MIN, f32::max));
                    assert_eq!(mn[i], col.fold(f32::MAX, f32::min));
                }
            }
        }
    }
}

/// Each stored key's sketch is that key quantized under its block's channel scales (each the
/// channel's absmax / 7) and each quarter's bounds bracket its keys one bf16 step out at most
/// (an independent scalar recomputation of the documented rules); rows past the tail's tokens
/// are zero; a cache made without sketches has none.
#[test]
fn sketches_are_the_stored_keys_quantized_and_zero_past_the_tail() {
    for dtype in [DType::Bf16, DType::F16, DType::F32] {
        // Halves of 32 tokens (B = 64); the third block's second half holds no keys.
        let g = geo(dtype, 64);
        let run = 64 / quarters(64);
        let a = HostArena::new(&ArenaOptions::new(1 << 20, 16 << 10)).unwrap();
        let kv = cache(g, &a, 150, 7);
        let v = kv.layer(0).unwrap();
        let d = g.head_dim as usize;
        let w = d.next_multiple_of(32) / 4;
        let widen = |x: u16| f32::from_bits(u32::from(x) << 16);
        for b in 0..v.blocks() {
            for h in 0..g.kv_heads as usize {
                let (kt, _) = v.tile(b, h);
                let keys = dtype.decode_vec(kt);
                let s = v.sketch(b, h).unwrap();
                // Channel e's scale is the largest |element e| of the block's valid keys / 7.
                for e in 0..d {
                    let amax = keys
                        .chunks(d)
                        .take(v.valid_tokens(b))
                        .map(|k| k[e].abs())
                        .fold(0.0f32, f32::max);
                    assert_eq!(
                        s.channel_scales[e],
                        amax / 7.0,
                        "block {b} head {h} dim {e}"
                    );
                }
                for (t, key) in keys.chunks(d).enumerate() {
                    let row = &s.codes[t * 2 * w..(t + 1) * 2 * w];
                    if t >= v.valid_tokens(b) {
                        assert!(row.iter().all(|&c| c == 0));
                        continue;
                    }
                    for (e, x) in key.iter().enumerate() {
                        let sc = s.channel_scales[e];
                        let want = if sc == 0.0 {
                            0
                        } else {
                            (x / sc).round_ties_even().clamp(-7.0, 7.0) as i8
                        };
                        let word = u16::from_le_bytes([row[2 * (e % w)], row[2 * (e % w) + 1]]);
                        let nib = ((word >> (4 * (e / w))) & 0xf) as u8;
                        assert_eq!(
                            ((nib << 4) as i8) >> 4,
                            want,
                            "block {b} head {h} token {t} dim {e}"
                        );
                    }
                    let j = quarter_of(t, 64);
                    assert_eq!(j, t / run);
                    let qb = &s.quarters[j * 2 * d..(j + 1) * 2 * d];
                    for (e, x) in key.iter().enumerate() {
                        let (hi, lo) = (widen(qb[e]), widen(qb[d + e]));
                        assert!(hi >= *x && lo <= *x, "block {b} head {h} token {t} dim {e}");
                    }
                }
                // Each quarter's bounds are its keys' max and min, rounded outward.
                for (j, qb) in s.quarters.chunks(2 * d).enumerate() {
                    let rows: Vec<&[f32]> = keys
                        .chunks(d)
                        .take(v.valid_tokens(b))
                        .skip(run * j)
                        .take(run)
                        .collect();
                    for e in 0..d {
                        let (hi, lo) = if rows.is_empty() {
                            (f32::NEG_INFINITY, f32::INFINITY)
                        } else {
                            let col = rows.iter().map(|r| r[e]);
                            (
                                widen(kvtier_storage::dtype::bf16_outward(
                                    col.clone().fold(f32::MIN, f32::max),
                                    true,
                                )),
                                widen(kvtier_storage::dtype::bf16_outward(
                                    col.fold(f32::MAX, f32::min),
                                    false,
                                )),
                            )
                        };
                        assert_eq!(
                            (widen(qb[e]), widen(qb[d + e])),
                            (hi, lo),
                            "block {b} quarter {j} dim {e}"
                        );
                    }
                }
                // Quarter codes: one scale, the maxima rounded up and the minima down to its
                // multiples; a quarter without keys an empty box.
                let amax = s
                    .quarters
                    .chunks(2 * d)
                    .filter(|q| widen(q[0]).is_finite())
                    .flat_map(|q| q.iter())
                    .map(|&x| widen(x).abs())
                    .fold(0f32, f32::max);
                assert_eq!(s.quarter_scale, amax / 127.0);
                for (j, (qb, qc)) in s
                    .quarters
                    .chunks(2 * d)
                    .zip(s.quarter_codes.chunks(2 * d))
                    .enumerate()
                {
                    for e in 0..2 * d {
                        let want = match (widen(qb[0]).is_finite(), e < d) {
                            (false, true) => -127,
                            (false, false) => 127,
                            (true, true) => {
                                (widen(qb[e]) / s.quarter_scale).ceil().clamp(-127.0, 127.0) as i8
                            }
                            (true, false) => (widen(qb[e]) / s.quarter_scale)
                                .floor()
                                .clamp(-127.0, 127.0)
                                as i8,
                        };
                        assert_eq!(qc[e], want, "block {b} quarter {j} code {e}");
                    }
                }
            }
        }
        let bare = KvCache::new_with(g, a.clone(), false).unwrap();
        assert!(!bare.has_sketches() && bare.sketch_bytes() == 0);
        assert!(kv.has_sketches());
        let per_block = g.kv_heads as usize * (64 * 2 * w + 4 * d + quarters(64) * 2 * d * 3 + 4);
        assert_eq!(kv.sketch_bytes(), g.layers as usize * 3 * per_block);
    }
}

#[test]
fn bad_appends_are_typed_errors_and_change_nothing() {
    let g = geo(DType::Bf16, 4);
    let mut kv = cache(g, &arena(4), 3, 1);
    let before = snapshot(&kv);
    let one = payload(&g, 1, 2);
    // Backwards, gap, wrong size, bad layer, NaN.
    assert!(matches!(
        kv.append(2, 1, &one),
        Err(StorageError::PositionMismatch {
            expected: 3,
            got: 2,
            ..
        })
    ));
    assert!(matches!(
        kv.append(4, 1, &one),
        Err(StorageError::PositionMismatch {
            expected: 3,
            got: 4,
            ..
        })
    ));
    assert!(matches!(
        kv.append(3, 1, &one[1..]),
        Err(StorageError::PayloadSize { .. })
    ));
    let tb = g.token_bytes();
    assert!(matches!(
        kv.append_layer(2, 3, &one[..tb], &one[tb..2 * tb]),
        Err(StorageError::LayerOutOfRange {
            layer: 2,
            layers: 2
        })
    ));
    // A bf16 NaN as element 1 of layer 1's K rows.
    let mut nan = one.clone();
    nan[2 * tb + 2..2 * tb + 4].copy_from_slice(&0x7FC0u16.to_le_bytes());
    assert!(matches!(
        kv.append(3, 1, &nan),
        Err(StorageError::NonFinite {
            what: "k",
            index: 1
        })
    ));
    // Arena full: 4 extents; 2 used; 8 more tokens need 2 blocks per layer = 4 extents.
    assert!(matches!(
        kv.append(3, 8, &payload(&g, 8, 3)),
        Err(StorageError::ArenaFull { .. })
    ));
    assert_eq!(
        snapshot(&kv),
        before,
        "failed appends left the cache unchanged"
    );
    assert_eq!(kv.arena().usage().extents_used, 2);
    // Per-layer appends may run ahead of each other, but each layer stays contiguous.
    kv.append_layer(0, 3, &one[..tb], &one[tb..2 * tb]).unwrap();
    assert_eq!(kv.tokens(0).unwrap(), 4);
    assert_eq!(kv.min_tokens(), 3);
}

#[test]
fn a_block_run_larger_than_the_largest_extent_is_refused() {
    let mut g = geo(DType::F32, 128);
    g.head_dim = 64;
    assert!(matches!(
        KvCache::new(g, arena(4)),
        Err(StorageError::BlockTooLarge { .. })
    ));
}

#[test]
fn dropping_a_cache_returns_its_extents() {
    let g = geo(DType::Bf16, 4);
    let a = arena(8);
    let kv = cache(g, &a, 9, 5);
    assert_eq!(a.usage().extents_used, 6);
    assert_eq!(kv.host_bytes(), 6 * 4096);
    drop(kv);
    assert_eq!(a.usage().extents_used, 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// However the appends are batched, tiles and summaries are bit-identical.
    #[test]
    fn batching_does_not_change_a_single_bit(
        n in 1usize..40,
        cuts in proptest::collection::vec(0usize..40, 0..8),
        bt in prop_oneof![Just(1u32), Just(3), Just(4), Just(8)],
        dt in prop_oneof![Just(DType::Bf16), Just(DType::F16), Just(DType::F32)],
        seed in any::<u64>(),
    ) {
        let g = geo(dt, bt);
        let p = payload(&g, n, seed);
        let mut whole = KvCache::new(g, arena(128)).unwrap();
        whole.append(0, n as u64, &p).unwrap();
        let mut cuts: Vec<usize> = cuts.into_iter().filter(|&c| c < n).collect();
        cuts.sort_unstable();
        let mut chunked = KvCache::new(g, arena(128)).unwrap();
        append_in_chunks(&mut chunked, &p, n, &cuts);
        let mut single = KvCache::new(g, arena(128)).unwrap();
        append_in_chunks(&mut single, &p, n, &(1..n).collect::<Vec<_>>());
        prop_assert_eq!(snapshot(&whole), snapshot(&chunked));
        prop_assert_eq!(snapshot(&whole), snapshot(&single));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Truncating back to any earlier length equals never having appended the rest.
    #[test]
    fn truncate_equals_never_appending(n in 1usize..30, cut in 0usize..30, seed in any::<u64>()) {
        let cut = cut.min(n);
        let g = geo(DType::Bf16, 4);
        let p = payload(&g, n, seed);
        let mut full = KvCache::new(g, arena(64)).unwrap();
        full.append(0, n as u64, &p).unwrap();
        full.truncate(cut as u64);
        let mut fresh = KvCache::new(g, arena(64)).unwrap();
        fresh.append(0, cut as u64, &sub_payload(&g, &p, n, 0..cut)).unwrap();
        prop_assert_eq!(snapshot(&full), snapshot(&fresh));
        prop_assert_eq!(full.extents(), fresh.extents());
    }
}

/// An append large enough to spread its layers over threads (over 4 MiB) leaves tiles and
/// bounds bit-identical to appending the same rows one token at a time, and a NaN in its last
/// layer is the same typed error as for a small append, with nothing changed.
#[test]
fn a_large_append_on_several_threads_equals_appending_token_by_token() {
    let g = Geometry {
        layers: 6,
        q_heads: 8,
        kv_heads: 4,
        head_dim: 64,
        dtype: DType::Bf16,
        block_tokens: 16,
    };
    let big_arena = || HostArena::new(&ArenaOptions::new(64 << 20, 64 << 10)).unwrap();
    let n = 1000; // 6 layers x 2 x 1000 x 512 bytes = 6.1 MB
    let p = payload(&g, n, 42);
    assert!(p.len() > 4 << 20);
    let mut whole = KvCache::new(g, big_arena()).unwrap();
    whole.append(0, 7, &sub_payload(&g, &p, n, 0..7)).unwrap();
    let rest = sub_payload(&g, &p, n, 7..n);
    let before = snapshot(&whole);
    // A NaN in the last layer's V: refused, nothing written.
    let mut bad = rest.clone();
    let at = bad.len() - 2;
    bad[at..].copy_from_slice(&0x7FC0u16.to_le_bytes());
    assert!(matches!(
        whole.append(7, (n - 7) as u64, &bad),
        Err(StorageError::NonFinite { what: "v", .. })
    ));
    assert_eq!(snapshot(&whole), before);
    whole.append(7, (n - 7) as u64, &rest).unwrap();
    let mut single = KvCache::new(g, big_arena()).unwrap();
    append_in_chunks(&mut single, &p, n, &(1..n).collect::<Vec<_>>());
    assert_eq!(snapshot(&whole), snapshot(&single));
}

#[test]
fn appends_into_extents_a_former_owner_left_dirty_equal_appends_into_clean_ones() {
    // New extents are not zeroed when taken: the append zeroes what its rows leave (the rest of
    // a partial block, the padding past each run). One thread (small) and several (large),
    // both starting mid-block.
    for (layers, n) in [(2u32, 21usize), (6, 4000)] {
        let g = Geometry {
            layers,
            q_heads: 4,
            kv_heads: 2,
            head_dim: 24, // 3 KiB runs in 4 KiB extents: 1 KiB of padding each
            dtype: DType::Bf16,
            block_tokens: 16,
        };
        let mut opts = ArenaOptions::new(8 << 20, 64 << 10);
        opts.shared = true;
        let dirty = HostArena::new(&opts).unwrap();
        let fd = dirty.shared_fd().unwrap().try_clone_to_owned().unwrap();
        // SAFETY: the memfd is sealed against shrinking; the mapping is dropped with the test.
        let mut map = unsafe { memmap2::MmapMut::map_mut(&std::fs::File::from(fd)) }.unwrap();
        map.fill(0x5A);
        let clean = HostArena::new(&ArenaOptions::new(8 << 20, 64 << 10)).unwrap();
        let (mut kv, mut want) = (
            KvCache::new(g, dirty).unwrap(),
            KvCache::new(g, clean).unwrap(),
        );
        let p = payload(&g, n, 9);
        assert_eq!(p.len() > 4 << 20, n == 4000);
        append_in_chunks(&mut kv, &p, n, &[3]);
        append_in_chunks(&mut want, &p, n, &[3]);
        assert_eq!(snapshot(&kv), snapshot(&want), "{n} tokens");
        for l in 0..layers {
            let v = kv.layer(l).unwrap();
            for b in 0..v.blocks() {
                let end = v.extent(b).unwrap().offset() + g.block_bytes();
                assert!(
                    map[end..end + 1024].iter().all(|&x| x == 0),
                    "layer {l} block {b}"
                );
            }
        }
    }
}

// ---- In-place appends (RESERVE / COMMIT): rows written through a second mapping ----

/// A cache in a shared (memfd) arena holding `n` tokens, and a second writable mapping of that
/// arena: what an engine process maps from LEASE's descriptor.
fn shared_cache(g: Geometry, n: usize, seed: u64) -> (KvCache, memmap2::MmapMut) {
    shared_cache_of(64 * 4096, g, n, seed)
}

/// [`shared_cache`] in an arena of `bytes`.
fn shared_cache_of(bytes: usize, g: Geometry, n: usize, seed: u64) -> (KvCache, memmap2::MmapMut) {
    let mut opts = ArenaOptions::new(bytes, 4096);
    opts.shared = true;
    let a = HostArena::new(&opts).unwrap();
    let fd = a.shared_fd().unwrap().try_clone_to_owned().unwrap();
    // SAFETY: the memfd is sealed against shrinking; the mapping is dropped with the test.
    let map = unsafe { memmap2::MmapMut::map_mut(&std::fs::File::from(fd)) }.unwrap();
    (cache(g, &a, n, seed), map)
}

/// Writes tokens `tokens` of payload `p` (of `n` tokens) in place: where `offsets` (per layer)
/// say, as an engine does after RESERVE.
fn write_in_place(
    g: &Geometry,
    map: &mut [u8],
    offsets: &[Vec<u64>],
    start: u64,
    p: &[u8],
    n: usize,
    tokens: std::ops::Range<usize>,
) {
    let row = g.row_bytes();
    for (l, offs) in offsets.iter().enumerate() {
        let (k, v) = layer_rows(g, p, n, l, tokens.clone());
        for i in 0..tokens.len() {
            for h in 0..g.kv_heads as usize {
                let (ko, vo) = kvtier_storage::in_place_row(g, offs, start, i as u64, h);
                let src = (i * g.kv_heads as usize + h) * row;
                map[ko as usize..ko as usize + row].copy_from_slice(&k[src..src + row]);
                map[vo as usize..vo as usize + row].copy_from_slice(&v[src..src + row]);
            }
        }
    }
}

/// Reserves `tokens` rows after the cache's `start` tokens and writes them in place from
/// payload `p` (of `n` tokens), as an engine does: the reservation and its offsets.
fn reserve_and_write(
    kv: &KvCache,
    map: &mut [u8],
    g: &Geometry,
    p: &[u8],
    n: usize,
    start: usize,
    tokens: usize,
) -> (InPlaceAppend, Vec<Vec<u64>>) {
    let ip = kv.begin_in_place(tokens as u64).unwrap();
    let offsets = kv.in_place_offsets(&ip);
    write_in_place(g, map, &offsets, start as u64, p, n, start..start + tokens);
    (ip, offsets)
}

#[test]
fn an_in_place_append_is_bit_identical_to_an_append_of_the_same_rows() {
    // Starting inside a block, at a block boundary, and spanning several blocks; committed at
    // once, or some layers first (ranges (first, end) staged in turn, then the COMMIT).
    let orders: [&[(usize, usize)]; 4] = [&[], &[(1, 2)], &[(0, 1), (1, 2)], &[(1, 2), (0, 1)]];
    for ((dtype, bt, before, n), order) in [
        (DType::Bf16, 8, 5, 1),
        (DType::Bf16, 8, 5, 20),
        (DType::F32, 8, 16, 8),
        (DType::F16, 4, 0, 9),
    ]
    .into_iter()
    .flat_map(|case| orders.map(|o| (case, o)))
    {
        let g = geo(dtype, bt);
        let p = payload(&g, before + n, 7);
        let (mut kv, mut map) = shared_cache(g, 0, 0);
        // Every free byte holds a former owner's data: RESERVE does not zero the extents it
        // opens, so the commit must leave nothing of it (rows past the end, padding).
        map.fill(0x5A);
        let (mut want, _) = shared_cache(g, 0, 0);
        append_in_chunks(
            &mut kv,
            &sub_payload(&g, &p, before + n, 0..before),
            before,
            &[],
        );
        want.append(0, (before + n) as u64, &p).unwrap();

        let used = kv.arena().usage().bytes_used;
        let mut ip = kv.begin_in_place(n as u64).unwrap();
        assert_eq!((ip.start(), ip.tokens()), (before as u64, n as u64));
        let offsets = kv.in_place_offsets(&ip);
        let blocks = g.blocks_for((before + n) as u64) - (before as u64 / bt as u64);
        assert!(
            offsets.iter().all(|o| o.len() as u64 == blocks),
            "{offsets:?}"
        );
        // Reserved rows are invisible until committed.
        assert_eq!(kv.min_tokens(), before as u64);
        write_in_place(
            &g,
            &mut map,
            &offsets,
            before as u64,
            &p,
            before + n,
            before..before + n,
        );
        let seen = visible(&kv);
        for &(first, end) in order {
            kv.stage_in_place(&mut ip, n as u64, first..end).unwrap();
            // Staged layers are invisible until the commit adopts every layer.
            assert_eq!(visible(&kv), seen, "{order:?}");
        }
        kv.commit_in_place(ip, n as u64).unwrap();
        assert_eq!(
            snapshot(&kv),
            snapshot(&want),
            "{dtype:?} bt={bt} {before}+{n} {order:?}"
        );
        assert!(kv.arena().usage().bytes_used >= used);
        // Past each run, to the end of its 4 KiB extent: zero.
        for o in offsets.iter().flatten() {
            let run_end = *o as usize + g.block_bytes();
            assert!(
                map[run_end..run_end.next_multiple_of(4096)]
                    .iter()
                    .all(|&b| b == 0),
                "padding after the run at {o}"
            );
        }
    }
}

/// What [`snapshot`] reads.
type Snapshot = Vec<(u64, Vec<u8>, Vec<u32>)>;

/// What the cache holds and the arena bytes in use: all that a refused or aborted in-place
/// append must leave as it was.
fn contents_and_usage(kv: &KvCache) -> (Snapshot, usize) {
    (snapshot(kv), kv.arena().usage().bytes_used)
}

/// Tokens and bounds and sketches of every layer: what readers see (not the runs' bytes past
/// the stored rows, which a writer in place changes before it commits).
fn visible(kv: &KvCache) -> Vec<(u64, Vec<u32>)> {
    snapshot(kv).into_iter().map(|(t, _, s)| (t, s)).collect()
}

#[test]
fn a_partial_commit_is_refused_for_a_layer_twice_other_tokens_or_a_bad_row() {
    let g = geo(DType::F32, 8);
    let p = payload(&g, 20, 5);
    let (mut kv, mut map) = shared_cache(g, 5, 9);
    let before = contents_and_usage(&kv);
    let (mut ip, offsets) = reserve_and_write(&kv, &mut map, &g, &p, 20, 5, 10);
    kv.stage_in_place(&mut ip, 10, 0..1).unwrap();
    // A layer twice, other tokens, a layer past the last.
    for (tokens, layers, want) in [
        (10, 0..2, "LayerCommitted { layer: 0 }"),
        (9, 1..2, "CommitTokens { expected: 10, got: 9 }"),
        (10, 1..3, "LayerOutOfRange { layer: 2, layers: 2 }"),
        (
            10,
            1..1,
            "PayloadSize { what: \"layers committed\", expected: 1, got: 0 }",
        ),
    ] {
        let e = kv.stage_in_place(&mut ip, tokens, layers).unwrap_err();
        assert_eq!(format!("{e:?}"), want);
    }
    // A NaN in layer 1: refused by its stage, and by the commit that would stage it.
    let (_, vo) = kvtier_storage::in_place_row(&g, &offsets[1], 5, 7, 1);
    map[vo as usize + 12..vo as usize + 16].copy_from_slice(&f32::NAN.to_le_bytes());
    let e = kv.stage_in_place(&mut ip, 10, 1..2).unwrap_err();
    assert!(
        matches!(e, StorageError::NonFinite { what: "v", .. }),
        "{e}"
    );
    let e = kv.commit_in_place(ip, 10).unwrap_err();
    assert!(
        matches!(e, StorageError::NonFinite { what: "v", .. }),
        "{e}"
    );
    // Nothing was appended; the opened extents went back.
    assert_eq!(contents_and_usage(&kv), before);
}

#[test]
fn committing_fewer_rows_than_reserved_zeroes_the_rest_and_returns_their_extents() {
    let g = geo(DType::Bf16, 8);
    let p = payload(&g, 30, 3);
    let (mut kv, mut map) = shared_cache(g, 0, 0);
    map.fill(0x5A); // a former owner's bytes in every free extent
    kv.append(0, 6, &sub_payload(&g, &p, 30, 0..6)).unwrap();
    let (mut want, _) = shared_cache(g, 0, 0);
    want.append(0, 9, &sub_payload(&g, &p, 30, 0..9)).unwrap();
    // The engine wrote all 24 rows but commits 3: rows 9.. must read zero, as in `want`.
    let (ip, _) = reserve_and_write(&kv, &mut map, &g, &p, 30, 6, 24);
    kv.commit_in_place(ip, 3).unwrap();
    assert_eq!(snapshot(&kv), snapshot(&want));
    assert_eq!(kv.extents(), want.extents());
    assert_eq!(kv.arena().usage().bytes_used, kv.extents() * 4096);
}

#[test]
fn a_non_finite_row_written_in_place_is_refused_and_nothing_changes() {
    let g = geo(DType::F32, 8);
    let p = payload(&g, 20, 5);
    let (mut kv, mut map) = shared_cache(g, 5, 9);
    let before = contents_and_usage(&kv);
    let (ip, offsets) = reserve_and_write(&kv, &mut map, &g, &p, 20, 5, 10);
    // Row 7 of the append, kv head 1, V element 3 of layer 1: a NaN.
    let (_, vo) = kvtier_storage::in_place_row(&g, &offsets[1], 5, 7, 1);
    let at = vo as usize + 3 * 4;
    map[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let e = kv.commit_in_place(ip, 10).unwrap_err();
    let want_index = (7 * g.kv_heads as usize + 1) * g.head_dim as usize + 3;
    assert!(
        matches!(e, StorageError::NonFinite { what: "v", index } if index == want_index),
        "{e}"
    );
    // The rows written into the tail block are zero again; the opened extents went back.
    assert_eq!(contents_and_usage(&kv), before);
    // And the cache takes appends as before.
    kv.append(5, 1, &sub_payload(&g, &p, 20, 5..6)).unwrap();
}

/// A one-layer COMMIT of a prefill's size checks its rows on several threads, in chunks: the
/// error still names the first non-finite element in row order, wherever the chunks split.
#[test]
fn a_large_one_layer_commit_names_its_first_non_finite_row() {
    let g = geo(DType::F32, 16);
    let n = 20_000; // 5 MB of rows a layer: past the parallel threshold
    let p = payload(&g, n, 3);
    let (mut kv, mut map) = shared_cache_of(48 << 20, g, 0, 0);
    let (mut ip, offsets) = reserve_and_write(&kv, &mut map, &g, &p, n, 0, n);
    let mut poison = |row: u64, head: usize, v: bool, element: usize| {
        let (ko, vo) = kvtier_storage::in_place_row(&g, &offsets[0], 0, row, head);
        let at = if v { vo } else { ko } as usize + element * 4;
        map[at..at + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
    };
    poison(15_000, 0, false, 1);
    poison(9_001, 1, true, 2);
    poison(9_000, 1, true, 5);
    let e = kv.stage_in_place(&mut ip, n as u64, 0..1).unwrap_err();
    let want = (9_000 * g.kv_heads as usize + 1) * g.head_dim as usize + 5;
    assert!(
        matches!(e, StorageError::NonFinite { what: "v", index } if index == want),
        "{e}"
    );
}

#[test]
fn an_aborted_in_place_append_leaves_the_cache_as_it_was() {
    let g = geo(DType::Bf16, 8);
    let p = payload(&g, 40, 2);
    let (mut kv, mut map) = shared_cache(g, 3, 4);
    let before = contents_and_usage(&kv);
    let (ip, _) = reserve_and_write(&kv, &mut map, &g, &p, 40, 3, 30);
    kv.abort_in_place(ip);
    assert_eq!(contents_and_usage(&kv), before);
    // Committing zero rows is an abort too, after a layer was staged as well.
    for stage in [false, true] {
        let (mut ip, _) = reserve_and_write(&kv, &mut map, &g, &p, 40, 3, 2);
        if stage {
            kv.stage_in_place(&mut ip, 2, 0..1).unwrap();
        }
        kv.commit_in_place(ip, 0).unwrap();
        assert_eq!(contents_and_usage(&kv), before);
    }
}

#[test]
fn an_in_place_append_needs_even_layers_some_rows_and_room() {
    let g = geo(DType::Bf16, 8);
    let (mut kv, _map) = shared_cache(g, 4, 1);
    let (k, v) = (rows(&g, 1, &mut Rng::new(1)), rows(&g, 1, &mut Rng::new(2)));
    kv.append_layer(0, 4, &k, &v).unwrap();
    assert!(matches!(
        kv.begin_in_place(1),
        Err(StorageError::UnevenLayers { min: 4, max: 5 })
    ));
    kv.append_layer(1, 4, &k, &v).unwrap();
    assert!(matches!(
        kv.begin_in_place(0),
        Err(StorageError::PayloadSize { .. })
    ));
    // 64 extents of arena; 2 layers x 40 blocks do not fit.
    assert!(matches!(
        kv.begin_in_place(8 * 40),
        Err(StorageError::ArenaFull { .. })
    ));
    assert!(kv.begin_in_place(8).is_ok());
}
