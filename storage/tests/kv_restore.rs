//! KvCache restores: evicted and promoted blocks, stored blocks appended back one by one and
//! in bulk on several threads, all bit-identical to the cache before.

mod kv_common;

use kv_common::*;
use kvtier_storage::testing::Rng;
use kvtier_storage::testing::SavedRuns;
use kvtier_storage::{DType, Geometry, HostArena, KvCache, StorageError};
use kvtier_tests::kv::{payload, rows};
use proptest::prelude::*;

#[test]
fn evicted_blocks_come_back_bit_identical_and_free_their_extents() {
    let g = geo(DType::Bf16, 4);
    let a = arena(32);
    let mut kv = cache(g, &a, 14, 9);
    let before = snapshot(&kv);
    let saved = SavedRuns::of(&kv);
    for l in 0..2 {
        for b in 0..4 {
            assert!(kv.evict(l, b));
        }
    }
    assert_eq!(kv.extents(), 0);
    assert_eq!(
        a.usage().extents_used,
        0,
        "evicted extents went back to the arena"
    );
    assert_eq!(kv.blocks(), 8, "blocks and their summaries stay");
    assert_eq!(kv.cold_tails(), vec![(0, 3), (1, 3)]);
    // The cold partial tail refuses appends with a typed error instead of losing rows.
    let one = payload(&g, 1, 3);
    assert!(matches!(
        kv.append(14, 1, &one),
        Err(StorageError::NotResident { .. })
    ));
    assert_eq!(kv.cold_among(1, &[0, 2, 3]), vec![0, 2, 3]);
    assert_eq!(kv.promote(1, &[0, 2, 3], &saved).unwrap(), 3);
    assert_eq!(
        kv.promote(1, &[0, 2], &saved).unwrap(),
        0,
        "already resident"
    );
    for b in [1, 3] {
        kv.promote(0, &[b], &saved).unwrap();
    }
    kv.promote(0, &[0, 2], &saved).unwrap();
    kv.promote(1, &[1], &saved).unwrap();
    assert_eq!(snapshot(&kv), before);
    // A failing source changes nothing.
    kv.evict(0, 1);
    let empty = SavedRuns::default();
    assert!(matches!(
        kv.promote(0, &[1], &empty),
        Err(StorageError::ColdRead { .. })
    ));
    assert!(!kv.is_resident(0, 1));
    assert_eq!(
        a.usage().extents_used,
        7,
        "the failed promotion's extent was returned"
    );
}

/// Promotion takes extents without zeroing them (the source overwrites every byte): an extent
/// that held another session's bytes must come back as exactly the run followed by zeros.
#[test]
fn a_promoted_extent_holds_the_run_and_zeros_whatever_it_held_before() {
    let g = geo(DType::Bf16, 4);
    let a = arena(16);
    let mut kv = cache(g, &a, 8, 5);
    let saved = SavedRuns::of(&kv);
    for b in 0..2 {
        assert!(kv.evict(0, b));
    }
    // Every free extent now holds 0xA5 bytes.
    let mut dirty = a.alloc_many(a.fits(4096, usize::MAX), 4096).unwrap();
    for f in &mut dirty {
        f.as_mut_slice().fill(0xA5);
    }
    drop(dirty);
    assert_eq!(kv.promote(0, &[0, 1], &saved).unwrap(), 2);
    let view = kv.layer(0).unwrap();
    for b in 0..2u32 {
        let extent = view.extent(b as usize).unwrap().as_slice();
        let run = saved.run(0, b);
        assert_eq!(&extent[..run.len()], run);
        assert!(
            extent[run.len()..].iter().all(|&x| x == 0),
            "block {b}: the extent past the run is zeroed"
        );
    }
}

#[test]
fn restoring_stored_blocks_rebuilds_identical_tiles_and_bounds() {
    for n in [1usize, 4, 13, 16] {
        let g = geo(DType::F16, 4);
        let kv = cache(g, &arena(32), n, 21);
        let saved = SavedRuns::of(&kv);
        let mut back = KvCache::new(g, arena(32)).unwrap();
        for l in 0..2 {
            for b in 0..g.blocks_for(n as u64) as u32 {
                let valid = (n - 4 * b as usize).min(4);
                back.restore_block(l, saved.run(l, b), valid, true).unwrap();
            }
        }
        assert_eq!(snapshot(&back), snapshot(&kv), "n={n}");
        // Restored cold, then promoted: the same.
        let mut cold = KvCache::new(g, arena(32)).unwrap();
        for l in 0..2 {
            for b in 0..g.blocks_for(n as u64) as u32 {
                let valid = (n - 4 * b as usize).min(4);
                cold.restore_block(l, saved.run(l, b), valid, false)
                    .unwrap();
            }
            let all: Vec<u32> = (0..g.blocks_for(n as u64) as u32).collect();
            cold.promote(l, &all, &saved).unwrap();
        }
        assert_eq!(snapshot(&cold), snapshot(&kv), "n={n} via cold restore");
    }
}

// ---- restore_blocks: many blocks at once, on several threads ----

use kvtier_storage::StoredBlock;

/// Everything a cache holds, cold blocks included: per layer its tokens, its bounds' bits
/// and, per block, the whole extent (padding too) if it is resident.
type FullState = Vec<(u64, Vec<u32>, Vec<Option<Vec<u8>>>)>;

fn full_state(kv: &KvCache) -> FullState {
    (0..kv.geometry().layers)
        .map(|l| {
            let v = kv.layer(l).unwrap();
            let extents = (0..v.blocks())
                .map(|b| v.extent(b).map(|f| f.as_slice().to_vec()))
                .collect();
            let sums = summary_bits(&v);
            (v.tokens(), sums, extents)
        })
        .collect()
}

/// An arena whose free extents hold garbage, so a restore that forgets to zero an extent's
/// padding shows up as a different extent.
fn dirty_arena(extents: usize) -> HostArena {
    let a = arena(extents);
    for mut f in a.alloc_many(extents, 4096).unwrap() {
        f.as_mut_slice().fill(0xA5);
    }
    a
}

/// `tokens[l]` random tokens appended to each layer `l` (layers may differ).
fn uneven_cache(g: Geometry, tokens: &[usize], seed: u64) -> KvCache {
    let mut kv = KvCache::new(g, arena(256)).unwrap();
    let mut rng = Rng::new(seed);
    for (l, &n) in tokens.iter().enumerate() {
        let (k, v) = (rows(&g, n, &mut rng), rows(&g, n, &mut rng));
        kv.append_layer(l as u32, 0, &k, &v).unwrap();
    }
    kv
}

/// Every stored block of `kv` as owned runs `(layer, run, valid)`, layers interleaved in a
/// random order that keeps each layer's blocks in order.
fn stored_runs(kv: &KvCache, seed: u64) -> Vec<(u32, Vec<u8>, usize)> {
    let g = *kv.geometry();
    let bt = g.block_tokens as u64;
    let mut next = vec![0u32; g.layers as usize];
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    loop {
        let open: Vec<u32> = (0..g.layers)
            .filter(|&l| (next[l as usize] as usize) < kv.layer(l).unwrap().blocks())
            .collect();
        if open.is_empty() {
            return out;
        }
        let l = open[rng.below(open.len() as u64) as usize];
        let b = next[l as usize];
        next[l as usize] += 1;
        let valid = (kv.tokens(l).unwrap() - b as u64 * bt).min(bt) as usize;
        out.push((l, kv.run(l, b).unwrap().to_vec(), valid));
    }
}

fn as_blocks<'a>(runs: &'a [(u32, Vec<u8>, usize)], keep: &[bool]) -> Vec<StoredBlock<'a>> {
    runs.iter()
        .zip(keep)
        .map(|((layer, run, valid), &keep)| StoredBlock {
            layer: *layer,
            run,
            valid: *valid,
            keep,
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Restoring in batches (any cuts, any thread count, any interleaving of layers, any mix
    /// of resident and cold) leaves the cache bit-identical to restoring block by block:
    /// tiles, extent padding, bounds, lengths and residency. And the bounds are those the
    /// original appends built.
    #[test]
    fn restore_blocks_equals_restore_block_bit_for_bit(
        dtype in 0u8..3,
        block_tokens in prop::sample::select(vec![1u32, 3, 4, 8]),
        kv_heads in 1u32..3,
        tokens in proptest::collection::vec(0usize..40, 1..4),
        cuts in proptest::collection::vec(0usize..60, 0..5),
        threads in 1usize..6,
        seed in any::<u64>(),
    ) {
        let g = Geometry {
            layers: tokens.len() as u32,
            q_heads: kv_heads * 2,
            kv_heads,
            head_dim: 8,
            dtype: DType::from_code(dtype).unwrap(),
            block_tokens,
        };
        let src = uneven_cache(g, &tokens, seed);
        let runs = stored_runs(&src, seed ^ 1);
        let mut rng = Rng::new(seed ^ 2);
        let keep: Vec<bool> = runs.iter().map(|_| rng.below(3) != 0).collect();
        let blocks = as_blocks(&runs, &keep);

        let (a, b) = (dirty_arena(256), dirty_arena(256));
        let mut one = KvCache::new(g, a.clone()).unwrap();
        for s in &blocks {
            one.restore_block(s.layer, s.run, s.valid, s.keep).unwrap();
        }
        let mut many = KvCache::new(g, b.clone()).unwrap();
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(blocks.len())).collect();
        cuts.sort_unstable();
        let mut start = 0;
        for end in cuts.into_iter().chain(std::iter::once(blocks.len())) {
            many.restore_blocks(&blocks[start..end], threads).unwrap();
            start = end;
        }
        prop_assert_eq!(full_state(&many), full_state(&one));
        prop_assert_eq!(a.usage(), b.usage());
        for l in 0..g.layers {
            prop_assert_eq!(
                summary_bits(&many.layer(l).unwrap()),
                summary_bits(&src.layer(l).unwrap())
            );
        }
    }
}

#[test]
fn restore_blocks_is_all_or_nothing_with_the_block_by_block_error() {
    let g = Geometry {
        layers: 3,
        ..geo(DType::Bf16, 4)
    };
    // 3 layers of 10 tokens: blocks of 4, 4 and 2 tokens, layer by layer.
    let src = uneven_cache(g, &[10, 10, 10], 5);
    let good: Vec<(u32, Vec<u8>, usize)> = (0..3u32)
        .flat_map(|l| (0..3u32).map(move |b| (l, b)))
        .map(|(l, b)| {
            (
                l,
                src.run(l, b).unwrap().to_vec(),
                (10 - 4 * b as usize).min(4),
            )
        })
        .collect();
    type Edit = fn(&mut Vec<(u32, Vec<u8>, usize)>, &mut Vec<bool>);
    // (name, edit of the good blocks and keep flags, free extents in the arena)
    let cases: Vec<(&str, Edit, usize)> = vec![
        (
            "non-finite in block 4",
            |r, _| {
                r[4].1 = {
                    let mut x = r[4].1.clone();
                    x[34..36].copy_from_slice(&0xFF80u16.to_le_bytes());
                    x
                }
            },
            64,
        ),
        (
            "short run in block 6",
            |r, _| {
                r[6].1.pop();
            },
            64,
        ),
        (
            "partial block before the layer's end",
            |r, _| r[3].2 = 3,
            64,
        ),
        ("layer out of range", |r, _| r[7].0 = 9, 64),
        ("arena full at the 5th kept block", |_, _| {}, 4),
        // Both a full arena and a bad run: whichever block comes first decides.
        (
            "arena full before a short run",
            |r, _| {
                r[8].1.pop();
            },
            4,
        ),
        (
            "short run before the arena fills",
            |r, _| {
                r[2].1.pop();
            },
            4,
        ),
        (
            "non-finite before the arena fills",
            |r, _| {
                r[1].1 = {
                    let mut x = r[1].1.clone();
                    x[0..2].copy_from_slice(&0x7F80u16.to_le_bytes());
                    x
                }
            },
            4,
        ),
        (
            "cold blocks need no extent",
            |_, k| k.iter_mut().for_each(|k| *k = false),
            0,
        ),
    ];
    for (name, edit, free) in cases {
        let mut runs = good.clone();
        let mut keep = vec![true; runs.len()];
        edit(&mut runs, &mut keep);
        let blocks = as_blocks(&runs, &keep);
        // One block restored before, so "unchanged" covers a non-empty cache.
        let fresh = || {
            let a = dirty_arena(1 + free);
            let mut kv = KvCache::new(g, a.clone()).unwrap();
            kv.restore_block(0, &good[0].1, 4, true).unwrap();
            (kv, a)
        };
        let (mut seq, _sa) = fresh();
        let seq_err = blocks[1..]
            .iter()
            .find_map(|s| seq.restore_block(s.layer, s.run, s.valid, s.keep).err());
        for threads in [1, 4] {
            let (mut kv, a) = fresh();
            let before = (full_state(&kv), a.usage());
            let got = kv.restore_blocks(&blocks[1..], threads);
            match (&seq_err, got) {
                (None, Ok(())) => assert_eq!(full_state(&kv), full_state(&seq), "{name}"),
                (Some(want), Err(e)) => {
                    assert_eq!(
                        format!("{e:?}"),
                        format!("{want:?}"),
                        "{name}, {threads} threads"
                    );
                    assert_eq!(
                        (full_state(&kv), a.usage()),
                        before,
                        "{name}: changed on error"
                    );
                }
                (want, got) => panic!("{name}: block by block {want:?}, batched {got:?}"),
            }
        }
    }
}

/// A cache rebuilt from block summaries alone (a resume before the runs arrive) selects as the
/// original: bounds and sketches bit-identical, every block cold until promoted, then the
/// same cache; a summary of the wrong size is refused.
#[test]
fn a_cache_rebuilt_from_summaries_selects_as_the_original() {
    for bt in [4, 16, 32, 64, 128] {
        let g = Geometry {
            head_dim: 32,
            ..geo(DType::Bf16, bt)
        };
        let n = 3 * bt as usize + 5;
        let a = HostArena::new(&kvtier_storage::ArenaOptions::new(64 << 20, 64 << 10)).unwrap();
        let src = {
            let mut kv = KvCache::new(g, a.clone()).unwrap();
            kv.append(0, n as u64, &payload(&g, n, bt as u64)).unwrap();
            kv
        };
        let mut back = KvCache::new(g, a.clone()).unwrap();
        for l in 0..g.layers {
            let v = src.layer(l).unwrap();
            for b in 0..v.blocks() {
                let s = src.block_summary(l, b as u32).unwrap();
                assert_eq!(s.len(), kvtier_storage::summary_bytes(&g, true));
                back.restore_summary(l, &s, v.valid_tokens(b)).unwrap();
                assert!(!back.is_resident(l, b as u32));
            }
            let got = back.layer(l).unwrap();
            assert_eq!(got.tokens(), v.tokens());
            assert_eq!(summary_bits(&got), summary_bits(&v), "block_tokens {bt}");
        }
        let saved = SavedRuns::of(&src);
        for l in 0..g.layers {
            let all: Vec<u32> = (0..src.layer(l).unwrap().blocks() as u32).collect();
            back.promote(l, &all, &saved).unwrap();
        }
        assert_eq!(snapshot(&back), snapshot(&src));
        let s = src.block_summary(0, 0).unwrap();
        let mut fresh = KvCache::new(g, a.clone()).unwrap();
        assert!(matches!(
            fresh.restore_summary(0, &s[1..], bt as usize),
            Err(StorageError::PayloadSize { .. })
        ));
        assert!(matches!(
            src.block_summary(0, 99),
            Err(StorageError::BlockOutOfRange { block: 99, .. })
        ));
    }
    // Without sketches the summary is the bounds alone.
    let g = geo(DType::Bf16, 16);
    let kv = KvCache::new_with(g, arena(8), false).unwrap();
    assert_eq!(
        kvtier_storage::summary_bytes(&g, false),
        4 * g.summary_floats_per_block()
    );
    assert!(kv.block_summary(0, 0).is_err());
}
