//! CUDA backend, block cache and launches: cache hits and appends, the split plan at KSEL cache
//! slots, decode_step and decode_layers against per-layer calls, fused against split launches, and dependent
//! launch, all exact against the CPU selector and the f64 attention reference.
//! Every test is `#[ignore]`d with the reason, so a machine without a GPU reports it as ignored;
//! bench/gpu/run.sh runs them with `--include-ignored`. Run anyway without a device, each prints
//! "skipped: no CUDA device" and passes.
#![cfg(feature = "cuda")]

mod gpu_common;

use gpu_common::{
    check_layer, check_step, gpu, qwen_b32_config, qwen_config, rel_err, step_items, Harness,
    KeyGen, POLICY,
};
use kvtier_kernels::cuda::{DecodeItem, LaunchMode, LayerStats, Timing};

/// On a flushed layer-0 cache, `items` (two sessions, 4 kv heads, the first with a partial
/// tail) run twice: the first call misses everything, the second refetches only the 4 partial
/// tail tiles and gives the same output. Returns the first call's statistics.
fn repeat_refetches_only_partial_tails(h: &mut Harness, items: &[DecodeItem<'_>]) -> LayerStats {
    let first = h.be.decode_layer(0, items).unwrap();
    assert_eq!(first.stats.hits, 0, "cold cache");
    let second = h.be.decode_layer(0, items).unwrap();
    assert_eq!(
        second.stats.misses, 4,
        "only the first session's partial tail tiles (4 kv heads) refetched"
    );
    assert_eq!(first.out, second.out);
    first.stats
}

/// Second identical call hits the cache except partial tail tiles, with identical output;
/// appended tokens (tail refetched, new blocks) are attended correctly.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn block_cache_hits_and_appends() {
    let Some(mut h) = Harness::start(qwen_b32_config(40, 2), 40) else {
        return;
    };
    let a = h.add_session(30 * 32 + 5, KeyGen { templates: 0 }); // partial tail
    let b = h.add_session(30 * 32, KeyGen { templates: 0 }); // full tail
    let (qa, qb) = (h.query(), h.query());
    let items = [
        DecodeItem { slot: a, q: &qa },
        DecodeItem { slot: b, q: &qb },
    ];
    repeat_refetches_only_partial_tails(&mut h, &items);
    // Other layer has its own cache: cold.
    let other = h.be.decode_layer(1, &items).unwrap();
    assert_eq!(other.stats.hits, 0);
    // Append: complete a's tail and start two more blocks; b gets one token.
    h.append(a, 27 + 40);
    h.append(b, 1);
    for _ in 0..3 {
        check_layer(&mut h, 0, &[a, b]);
    }
    // flush -> cold again
    h.be.flush_cache().unwrap();
    let qa = h.query();
    let cold =
        h.be.decode_layer(0, &[DecodeItem { slot: a, q: &qa }])
            .unwrap();
    assert_eq!(cold.stats.hits, 0);
}

/// Long layers are planned in two parts (plan_fixed: sink + local, fetched while the selector
/// runs; select_topk: the distant blocks). With a cache of exactly KSEL slots, a repeated query
/// must still hit every full tile, a changed query must never evict a tile the same call uses,
/// and every output stays exact against the CPU.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn split_plan_keeps_cache_exact_at_ksel_slots() {
    if !gpu() {
        return;
    }
    let mut cfg = qwen_b32_config(200, 2);
    cfg.cache_slots = POLICY.budget() as u32;
    let mut h = Harness::new(cfg, 41);
    let a = h.add_session(150 * 32 + 7, KeyGen { templates: 0 }); // partial tail
    let b = h.add_session(120 * 32, KeyGen { templates: 0 }); // full tail
    let (qa, qb) = (h.query(), h.query());
    let items = [
        DecodeItem { slot: a, q: &qa },
        DecodeItem { slot: b, q: &qb },
    ];
    let first = repeat_refetches_only_partial_tails(&mut h, &items);
    assert_eq!(first.tiles, 2 * 4 * POLICY.budget());
    // Changing queries: the keep-sets move, the cache turns over, results stay exact.
    for _ in 0..6 {
        check_layer(&mut h, 0, &[a, b]);
    }
    h.append(a, 40);
    h.append(b, 33);
    for _ in 0..3 {
        check_layer(&mut h, 0, &[a, b]);
        check_layer(&mut h, 1, &[b, a]);
    }
}

/// decode_step (all layers, one sync) equals per-layer calls.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn decode_step_matches_layers() {
    let Some(mut h) = Harness::start(qwen_b32_config(40, 3), 50) else {
        return;
    };
    let slots = h.add_sessions(&[40 * 32, 25 * 32 + 9, 7]);
    let hqd = 28 * 128;
    let qs: Vec<Vec<f32>> = slots
        .iter()
        .map(|_| [h.query(), h.query()].concat())
        .collect();
    h.be.set_timing(Timing::Layers).unwrap();
    let items = step_items(&slots, &qs);
    let step = h.be.decode_step(&items).unwrap();
    assert!(step.step_ms.unwrap() > 0.0);
    assert_eq!(step.timing.as_ref().unwrap().len(), 2);
    for (i, &slot) in slots.iter().enumerate() {
        for l in 0..2 {
            let q = &qs[i][l * hqd..(l + 1) * hqd];
            let want = h.cpu_select(slot as usize, l, q);
            let r = h.cpu_attend(slot as usize, l, q, &want);
            let got = &step.out[(i * 2 + l) * hqd..(i * 2 + l + 1) * hqd];
            let e = rel_err(got, &r);
            assert!(e < 2e-3, "slot {slot} layer {l}: {e}");
        }
    }
    // Step timing: the step's time only, the same outputs; then none.
    h.be.set_timing(Timing::Step).unwrap();
    let coarse = h.be.decode_step(&items).unwrap();
    assert!(coarse.step_ms.unwrap() > 0.0 && coarse.timing.is_none());
    assert_eq!(coarse.out, step.out);
    h.be.set_timing(Timing::Off).unwrap();
    let untimed = h.be.decode_step(&items).unwrap();
    assert!(untimed.step_ms.is_none() && untimed.timing.is_none());
    assert_eq!(untimed.out, step.out);
}

/// decode_layers (several layers, each its own batch, one call: what a daemon's coalesced step
/// runs when its clients are at different layers) equals per-layer calls bit for bit, with the
/// CPU's keep-sets; a session may be in two of its layers; a layer twice is a typed error.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn decode_layers_matches_per_layer_calls() {
    use kvtier_kernels::cuda::CudaError;

    let Some(mut h) = Harness::start(qwen_b32_config(40, 4), 51) else {
        return;
    };
    let slots = h.add_sessions(&[40 * 32, 25 * 32 + 9, 7, 300]);
    let hqd = 28 * 128;
    // Layer 1 for sessions 0 and 2, layer 0 for sessions 3, 1 and 0.
    let groups_of: [(u32, Vec<usize>); 2] = [(1, vec![0, 2]), (0, vec![3, 1, 0])];
    let qs: Vec<Vec<Vec<f32>>> = groups_of
        .iter()
        .map(|(_, idx)| idx.iter().map(|_| h.query()).collect())
        .collect();
    let items: Vec<Vec<DecodeItem<'_>>> = groups_of
        .iter()
        .zip(&qs)
        .map(|((_, idx), q)| {
            idx.iter()
                .zip(q)
                .map(|(&i, q)| DecodeItem { slot: slots[i], q })
                .collect()
        })
        .collect();
    let groups: Vec<(u32, &[DecodeItem<'_>])> = groups_of
        .iter()
        .zip(&items)
        .map(|((l, _), it)| (*l, it.as_slice()))
        .collect();
    let outs = h.be.decode_layers(&groups).unwrap();
    assert_eq!(outs.len(), 2);
    for ((l, idx), (lo, q)) in groups_of.iter().zip(outs.iter().zip(&qs)) {
        assert_eq!(lo.out.len(), idx.len() * hqd);
        let keeps = h.be.last_keep_sets(*l).unwrap();
        assert_eq!(keeps.len(), idx.len(), "layer {l}: its own batch");
        for (j, &i) in idx.iter().enumerate() {
            let want = h.cpu_select(slots[i] as usize, *l as usize, &q[j]);
            assert_eq!(keeps[j], want, "layer {l} session {i}");
            let r = h.cpu_attend(slots[i] as usize, *l as usize, &q[j], &want);
            let e = rel_err(&lo.out[j * hqd..(j + 1) * hqd], &r);
            assert!(e < 2e-3, "layer {l} session {i}: {e}");
        }
        let tiles: u64 = keeps.iter().flatten().map(|k| k.len() as u64).sum();
        assert_eq!(lo.stats.tiles, tiles, "layer {l}: its own statistics");
    }
    for (g, lo) in groups.iter().zip(&outs) {
        let alone = h.be.decode_layer(g.0, g.1).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&alone.out), bits(&lo.out), "layer {}", g.0);
    }
    let twice = [groups[0], (1, groups[1].1)];
    assert!(matches!(
        h.be.decode_layers(&twice),
        Err(CudaError::DuplicateLayer { layer: 1 })
    ));
}

/// layer_fused (a layer but its merge in one launch, available for the Qwen geometry) against
/// split launches (plan_fixed and the fixed tiles beside select_score, then the distant tiles):
/// the same keep-sets, cache decisions and bit-identical outputs, cold and warm, at batch 1 and
/// 3 (with a short layer), over several steps (the ticket count carries across launches), and
/// exact against the CPU.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn fused_launch_matches_split_launches() {
    let Some(mut h) = Harness::start(qwen_config(300, 3), 90) else {
        return;
    };

    let slots = h.add_sessions(&[300 * 128, 211 * 128 + 17, 20 * 128]);
    h.be.set_timing(Timing::Layers).unwrap();
    for batch in [1, 3] {
        let qs: Vec<Vec<f32>> = slots[..batch]
            .iter()
            .map(|_| [h.query(), h.query()].concat())
            .collect();
        let items = step_items(&slots[..batch], &qs);
        for warm in [false, true] {
            let mut runs = Vec::new();
            for fused in [true, false, true] {
                h.be.set_launch_mode(if fused {
                    LaunchMode::Fused
                } else {
                    LaunchMode::Split
                });
                if !warm {
                    h.be.flush_cache().unwrap();
                }
                let step = h.be.decode_step(&items).unwrap();
                let t = &step.timing.as_ref().unwrap()[0];
                assert_eq!(
                    t.select_ms.is_none(),
                    fused,
                    "per-kernel times only when split"
                );
                assert!(t.layer_ms > 0.0);
                let keeps: Vec<_> = (0..2).map(|l| h.be.last_keep_sets(l).unwrap()).collect();
                runs.push((step.out, step.stats, keeps));
            }
            for r in &runs[1..] {
                assert_eq!(r.0, runs[0].0, "outputs (batch {batch}, warm {warm})");
                assert_eq!(r.2, runs[0].2, "keep-sets (batch {batch}, warm {warm})");
                if !warm {
                    assert_eq!(r.1, runs[0].1, "cold cache statistics");
                }
            }
            if warm {
                // The repeated query hits every full tile it fetched before.
                let last = &runs[2].1;
                assert!(last.iter().all(|s| s.hits + s.misses == s.tiles));
                assert!(last.iter().all(|s| s.misses <= 4 * batch as u64));
            }
            check_step(&h, &slots[..batch], &qs, 2, &runs[0].0, &runs[0].2);
        }
        // Auto decides from each layer's previous call: after a flush the call runs fused, and
        // so does its repeat (the call before it missed); once a call has hit (all tiles but
        // partial tails), the next runs split. The output never changes.
        h.be.set_launch_mode(LaunchMode::Auto);
        h.be.flush_cache().unwrap();
        let mut outs = Vec::new();
        for want_split in [false, false, true, true] {
            let step = h.be.decode_step(&items).unwrap();
            let t = step.timing.as_ref().unwrap();
            assert!(
                t.iter().all(|t| t.select_ms.is_some() == want_split),
                "split {want_split}"
            );
            outs.push(step.out);
        }
        assert!(outs.iter().all(|o| *o == outs[0]));
    }
}

/// Dependent launch (a layer's layer_fused starting while the previous layer's merge runs,
/// its reads of host extents overlapping it) changes nothing but timing: over 4 layers, with
/// fused, Auto and split launches, cold and warm, batch 1 and 3 (with a short layer), the
/// outputs, keep-sets and cold cache statistics are bit-identical with it off, exact against
/// the CPU, and per-layer calls give the same outputs.
#[test]
#[ignore = "needs a CUDA device: bench/gpu/run.sh runs it with --include-ignored"]
fn dependent_launch_changes_only_timing() {
    if !gpu() {
        return;
    }
    let mut cfg = qwen_config(120, 3);
    cfg.geometry.layers = 4;
    let mut h = Harness::new(cfg, 91);
    let (major, _) = h.be.context().compute_capability().unwrap();
    let slots = h.add_sessions(&[120 * 128, 90 * 128 + 5, 20 * 128]);
    let hqd = 28 * 128;
    // Per-layer events would sit between the kernels and turn it off.
    h.be.set_timing(Timing::Layers).unwrap();
    assert!(!h.be.dependent_launch());
    h.be.set_timing(Timing::Step).unwrap();
    assert_eq!(
        h.be.dependent_launch(),
        major >= 9,
        "on where the device has it"
    );
    for batch in [1, 3] {
        let qs: Vec<Vec<f32>> = slots[..batch]
            .iter()
            .map(|_| (0..4).flat_map(|_| h.query()).collect())
            .collect();
        let items = step_items(&slots[..batch], &qs);
        for mode in [LaunchMode::Fused, LaunchMode::Auto, LaunchMode::Split] {
            h.be.set_launch_mode(mode);
            for warm in [false, true] {
                let mut runs = Vec::new();
                for pdl in [true, false, true] {
                    h.be.set_dependent_launch(pdl);
                    if !warm {
                        h.be.flush_cache().unwrap();
                    }
                    let step = h.be.decode_step(&items).unwrap();
                    assert!(
                        step.out.iter().all(|x| x.is_finite()),
                        "every output written"
                    );
                    let keeps: Vec<_> = (0..4).map(|l| h.be.last_keep_sets(l).unwrap()).collect();
                    runs.push((step.out, step.stats, keeps));
                }
                for r in &runs[1..] {
                    let what = format!("batch {batch}, {mode:?}, warm {warm}");
                    assert_eq!(r.0, runs[0].0, "outputs ({what})");
                    assert_eq!(r.2, runs[0].2, "keep-sets ({what})");
                    if !warm {
                        assert_eq!(r.1, runs[0].1, "cold cache statistics ({what})");
                    }
                }
                check_step(&h, &slots[..batch], &qs, 4, &runs[0].0, &runs[0].2);
            }
        }
        // Per-layer calls (the daemon's path: each call's first launch follows uploads, not a
        // kernel) give the step's outputs.
        h.be.set_dependent_launch(true);
        h.be.set_launch_mode(LaunchMode::Auto);
        h.be.flush_cache().unwrap();
        let step = h.be.decode_step(&items).unwrap();
        h.be.flush_cache().unwrap();
        for l in 0..4u32 {
            let layer_items: Vec<DecodeItem> = slots[..batch]
                .iter()
                .zip(&qs)
                .map(|(&slot, q)| DecodeItem {
                    slot,
                    q: &q[l as usize * hqd..(l as usize + 1) * hqd],
                })
                .collect();
            let out = h.be.decode_layer(l, &layer_items).unwrap().out;
            for i in 0..batch {
                let l = l as usize;
                assert_eq!(
                    &out[i * hqd..(i + 1) * hqd],
                    &step.out[(i * 4 + l) * hqd..(i * 4 + l + 1) * hqd],
                    "layer {l} item {i}"
                );
            }
        }
    }
}
