//! The correctness oracle: plain softmax attention in f64 over explicit K/V arrays.
//!
//! Deliberately shares nothing with the sparse kernel but the formula: no tiles, no online
//! softmax, no f32 accumulation. Dense mode of the sparse path must equal it; the sparse path
//! must equal it restricted (by `mask`) to the keep-set.

use kvtier_storage::Geometry;

/// `out[qh] = softmax(q[qh] . K^T / sqrt(D)) V` over the tokens `t` with `mask(kv_head, t)`.
/// `k` and `v` are `[tokens][kv_heads][head_dim]` f32 (the values as stored). Returns
/// `[q_heads][head_dim]`.
pub fn reference_attention(
    geo: &Geometry,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: impl Fn(usize, usize) -> bool,
) -> Vec<f32> {
    let (hq, hkv, d) = (
        geo.q_heads as usize,
        geo.kv_heads as usize,
        geo.head_dim as usize,
    );
    let g = geo.group();
    let tokens = k.len() / (hkv * d);
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f32; hq * d];
    for qh in 0..hq {
        let h = qh / g;
        let qv = &q[qh * d..(qh + 1) * d];
        let scores: Vec<(usize, f64)> = (0..tokens)
            .filter(|&t| mask(h, t))
            .map(|t| {
                let kr = &k[(t * hkv + h) * d..(t * hkv + h + 1) * d];
                let s: f64 = qv.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum();
                (t, s * scale)
            })
            .collect();
        let m = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = scores.iter().map(|s| (s.1 - m).exp()).sum();
        for (i, o) in out[qh * d..(qh + 1) * d].iter_mut().enumerate() {
            let num: f64 = scores
                .iter()
                .map(|&(t, s)| (s - m).exp() * v[(t * hkv + h) * d + i] as f64)
                .sum();
            *o = (num / z) as f32;
        }
    }
    out
}

/// Largest relative error of `got` against `want`, measured against the larger of each value's
/// magnitude and the output's RMS (so near-zero components do not dominate).
pub fn max_rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let rms = (want.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / want.len() as f64).sqrt();
    got.iter()
        .zip(want)
        .map(|(a, b)| (*a as f64 - *b as f64).abs() / (*b as f64).abs().max(rms).max(1e-30))
        .fold(0.0, f64::max)
}
