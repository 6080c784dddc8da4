//! Helpers shared by the KvCache tests (`kv`, `kv_restore`): a small geometry, arenas, caches
//! and what a cache holds, bit for bit.

#![allow(dead_code)]

use kvtier_storage::{ArenaOptions, DType, Geometry, HostArena, KvCache, LayerView};
use kvtier_tests::kv::{payload, sub_payload};

pub fn geo(dtype: DType, block_tokens: u32) -> Geometry {
    Geometry {
        layers: 2,
        q_heads: 6,
        kv_heads: 2,
        head_dim: 16,
        dtype,
        block_tokens,
    }
}

pub fn arena(extents: usize) -> HostArena {
    HostArena::new(&ArenaOptions::new(extents * 4096, 4096)).unwrap()
}

/// A cache in arena `a` holding `n` random tokens (the payload of `seed`).
pub fn cache(g: Geometry, a: &HostArena, n: usize, seed: u64) -> KvCache {
    let mut kv = KvCache::new(g, a.clone()).unwrap();
    kv.append(0, n as u64, &payload(&g, n, seed)).unwrap();
    kv
}

/// A layer's bounds and key sketches (codes and channel scales), as bits: what selection reads.
pub fn summary_bits(v: &LayerView<'_>) -> Vec<u32> {
    let mut bits: Vec<u32> = v.summaries().iter().map(|x| x.to_bits()).collect();
    for b in 0..v.blocks() {
        for h in 0..v.geometry().kv_heads as usize {
            let s = v.sketch(b, h).expect("the caches here keep sketches");
            bits.extend(s.codes.iter().map(|&c| u32::from(c)));
            bits.extend(s.channel_scales.iter().map(|x| x.to_bits()));
            bits.extend(s.quarters.iter().map(|&x| u32::from(x)));
            bits.extend(s.quarter_codes.iter().map(|&x| x as u32));
            bits.push(s.quarter_scale.to_bits());
        }
    }
    bits
}

pub fn snapshot(kv: &KvCache) -> Vec<(u64, Vec<u8>, Vec<u32>)> {
    (0..kv.geometry().layers)
        .map(|l| {
            let v = kv.layer(l).unwrap();
            let bytes = (0..v.blocks())
                .flat_map(|b| v.block_run(b).to_vec())
                .collect();
            let sums = summary_bits(&v);
            (v.tokens(), bytes, sums)
        })
        .collect()
}

/// Appends `p` (all layers, `n` tokens) in the chunks given by `cuts`.
pub fn append_in_chunks(kv: &mut KvCache, p: &[u8], n: usize, cuts: &[usize]) {
    let g = *kv.geometry();
    let mut start = 0;
    for &end in cuts.iter().chain(std::iter::once(&n)) {
        if end <= start {
            continue;
        }
        let chunk = sub_payload(&g, p, n, start..end);
        kv.append(start as u64, (end - start) as u64, &chunk)
            .unwrap();
        start = end;
    }
}
