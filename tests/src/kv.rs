//! Deterministic KV data: random rows, append payloads and queries, reproducible from a seed
//! ([`Rng`], SplitMix64), and byte patterns.
//!
//! A payload of `n` tokens holds, per layer, the K rows then the V rows of every token:
//! `[layer][k|v][token][kv_head][head_dim]`, encoded in the geometry's dtype (the layout of
//! `KvCache::append` and of APPEND_KV).

use std::ops::Range;

use kvtier_storage::testing::Rng;
use kvtier_storage::Geometry;

/// `n` tokens' rows (`[n][kv_heads][head_dim]` standard normals) encoded in `g`'s dtype: the
/// K or the V of `n` tokens of one layer.
pub fn rows(g: &Geometry, n: usize, rng: &mut Rng) -> Vec<u8> {
    g.dtype
        .encode_vec(&rng.normals(n * (g.kv_heads * g.head_dim) as usize))
}

/// A payload of `n` random tokens for every layer (per layer K then V, drawn in that order
/// from one [`Rng`] seeded with `seed`).
pub fn payload(g: &Geometry, n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    (0..g.layers)
        .flat_map(|_| [rows(g, n, &mut rng), rows(g, n, &mut rng)].concat())
        .collect()
}

/// The K and V rows of tokens `tokens` of layer `layer` in payload `p` of `n` tokens.
pub fn layer_rows<'a>(
    g: &Geometry,
    p: &'a [u8],
    n: usize,
    layer: usize,
    tokens: Range<usize>,
) -> (&'a [u8], &'a [u8]) {
    let tb = g.token_bytes();
    let k = 2 * layer * n * tb;
    let v = k + n * tb;
    (
        &p[k + tokens.start * tb..k + tokens.end * tb],
        &p[v + tokens.start * tb..v + tokens.end * tb],
    )
}

/// The payload of tokens `tokens` alone, cut out of payload `p` of `n` tokens.
pub fn sub_payload(g: &Geometry, p: &[u8], n: usize, tokens: Range<usize>) -> Vec<u8> {
    (0..g.layers as usize)
        .flat_map(|l| {
            let (k, v) = layer_rows(g, p, n, l, tokens.clone());
            [k, v].concat()
        })
        .collect()
}

/// A random query of one layer: `q_heads * head_dim` standard normals.
pub fn query(g: &Geometry, rng: &mut Rng) -> Vec<f32> {
    rng.normals((g.q_heads * g.head_dim) as usize)
}

/// Little-endian bytes of `x` (a query as DECODE sends it).
pub fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// `len` bytes of xorshift64 from `state` (made odd, so never stuck at zero): page payloads
/// whose content a verifier can recompute.
pub fn xorshift_bytes(state: u64, len: usize) -> Vec<u8> {
    let mut x = state | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::small_geometry;

    fn geometry() -> Geometry {
        Geometry {
            layers: 3,
            ..small_geometry()
        }
    }

    #[test]
    fn payloads_are_reproducible_and_cut_along_tokens() {
        let g = geometry();
        let p = payload(&g, 7, 3);
        assert_eq!(p, payload(&g, 7, 3));
        assert_ne!(p, payload(&g, 7, 4));
        assert_eq!(p.len(), 7 * 2 * g.layers as usize * g.token_bytes());
        assert_eq!(sub_payload(&g, &p, 7, 0..7), p);
        // Layer 2's V rows of tokens 2..5 come from the right place.
        let (_, v) = layer_rows(&g, &p, 7, 2, 2..5);
        let tb = g.token_bytes();
        let at = (2 * 2 + 1) * 7 * tb + 2 * tb;
        assert_eq!(v, &p[at..at + 3 * tb]);
        // Cutting and gluing back along tokens gives the same per-layer rows.
        let (a, b) = (sub_payload(&g, &p, 7, 0..3), sub_payload(&g, &p, 7, 3..7));
        for l in 0..g.layers as usize {
            let (k, v) = layer_rows(&g, &p, 7, l, 0..7);
            let (ka, va) = layer_rows(&g, &a, 3, l, 0..3);
            let (kb, vb) = layer_rows(&g, &b, 4, l, 0..4);
            assert_eq!((k, v), (&[ka, kb].concat()[..], &[va, vb].concat()[..]));
        }
    }

    #[test]
    fn xorshift_bytes_depend_on_the_state() {
        assert_eq!(xorshift_bytes(5, 64), xorshift_bytes(5, 64));
        assert_ne!(xorshift_bytes(5, 64), xorshift_bytes(6, 64));
        assert!(xorshift_bytes(0, 64).iter().any(|&b| b != 0), "never stuck");
    }
}
