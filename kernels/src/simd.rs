//! Small numeric loops written so the compiler vectorises them (fixed 8-lane accumulators, no
//! branches, no libm calls), shared by the selector and attention.

//! Explicit SIMD via `wide::f32x8` (SSE pairs on baseline x86-64, AVX where enabled). Products
//! and sums are separate operations, never fused, so results are identical on every target.

use wide::f32x8;

/// Lanes of the partial sums. The reduction order below is part of the selector's definition
/// (a GPU port that wants bit-identical scores sums the same way).
pub const LANES: usize = 8;

#[inline(always)]
fn load(s: &[f32]) -> f32x8 {
    f32x8::new(s[..LANES].try_into().expect("8 lanes"))
}

/// Folds the 8 lane sums in a fixed tree: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
#[inline(always)]
pub fn reduce(acc: [f32; LANES]) -> f32 {
    let t = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    (t[0] + t[2]) + (t[1] + t[3])
}

/// Dot product; element `i` accumulates into lane `i % 8` in increasing `i`, then [`reduce`].
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    dots([a], b)[0]
}

/// `N` dot products of one shared vector `x` with `N` rows `qs`, each summed exactly as [`dot`]:
/// `x` is loaded once per chunk and the `N` accumulators are independent dependency chains,
/// which keeps the FP units busy (a single chain is latency-bound).
#[inline(always)]
pub fn dots<const N: usize>(qs: [&[f32]; N], x: &[f32]) -> [f32; N] {
    let full = x.len() / LANES * LANES;
    let mut acc = [f32x8::ZERO; N];
    for c in (0..full).step_by(LANES) {
        let xc = load(&x[c..]);
        for (a, q) in acc.iter_mut().zip(&qs) {
            *a += load(&q[c..]) * xc;
        }
    }
    let mut out = [0f32; N];
    for ((o, a), q) in out.iter_mut().zip(acc).zip(&qs) {
        let mut lanes = a.to_array();
        for (j, i) in (full..x.len()).enumerate() {
            lanes[j] += q[i] * x[i];
        }
        *o = reduce(lanes);
    }
    out
}

/// Quest bound: sum over d of max(q[d]*hi[d], q[d]*lo[d]), an upper bound on q.k for every k
/// with lo <= k <= hi element-wise. Summed in [`dot`]'s order, so (rounding being monotone) it
/// bounds [`dot`] of every such k exactly, not just up to rounding.
#[inline(always)]
pub fn bound_dot(q: &[f32], hi: &[f32], lo: &[f32]) -> f32 {
    debug_assert!(q.len() == hi.len() && q.len() == lo.len());
    let full = q.len() / LANES * LANES;
    let mut acc = f32x8::ZERO;
    for c in (0..full).step_by(LANES) {
        let x = load(&q[c..]);
        acc += (x * load(&hi[c..])).fast_max(x * load(&lo[c..]));
    }
    let mut lanes = acc.to_array();
    for (j, i) in (full..q.len()).enumerate() {
        lanes[j] += (q[i] * hi[i]).max(q[i] * lo[i]);
    }
    reduce(lanes)
}

/// `acc += a * x`.
#[inline(always)]
pub fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
    for (o, v) in acc.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// `acc += sum_t w[t] * rows[t]` for rows of `acc.len()` columns: 32 columns at a time held in
/// registers across the whole token loop, instead of streaming `acc` through memory per token.
#[inline(always)]
pub fn weighted_rows(w: &[f32], rows: &[f32], acc: &mut [f32]) {
    const COLS: usize = 4 * LANES;
    let d = acc.len();
    let mut c0 = 0;
    while c0 + COLS <= d {
        let mut r = [0, 1, 2, 3].map(|i| load(&acc[c0 + i * LANES..]));
        for (wt, row) in w.iter().zip(rows.chunks_exact(d)) {
            let wv = f32x8::splat(*wt);
            for (i, ri) in r.iter_mut().enumerate() {
                *ri += wv * load(&row[c0 + i * LANES..]);
            }
        }
        for (i, ri) in r.iter().enumerate() {
            acc[c0 + i * LANES..c0 + (i + 1) * LANES].copy_from_slice(&ri.to_array());
        }
        c0 += COLS;
    }
    if c0 < d {
        for (wt, row) in w.iter().zip(rows.chunks_exact(d)) {
            axpy(&mut acc[c0..], *wt, &row[c0..]);
        }
    }
}

/// `e^x` for x <= 0 (softmax arguments after max subtraction), vectorisable: Cephes' expf
/// polynomial after range reduction by ln 2; relative error about 1e-7 on [-87, 0]. Inputs below
/// -87 flush to zero (their weight is below f32's normal range anyway).
#[inline(always)]
pub fn exp_nonpos(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const C1: f32 = 0.693_359_4; // ln 2, high part (exact in few bits)
    const C2: f32 = -2.121_944_4e-4; // ln 2, low part
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let xc = x.max(-87.0);
    let n = (xc * LOG2E + ROUND) - ROUND;
    let r = xc - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    let y = e * scale;
    if x < -87.0 {
        0.0
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_libm() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let got = exp_nonpos(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpos(0.0), 1.0);
        assert_eq!(exp_nonpos(-1000.0), 0.0);
        assert_eq!(exp_nonpos(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn bound_dot_bounds_every_key_in_the_box() {
        let q = [1.0f32, -2.0, 0.5, 0.0, 3.0, -1.0, 2.0, 1.0, -0.5, 4.0];
        let hi = [1.0f32, 1.0, 2.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0];
        let lo = [-1.0f32, -3.0, 0.0, -1.0, -0.5, 0.0, -1.0, 0.0, -2.0, -1.0];
        let b = bound_dot(&q, &hi, &lo);
        let exact: f32 = q
            .iter()
            .zip(hi.iter().zip(&lo))
            .map(|(q, (h, l))| (q * h).max(q * l))
            .sum();
        assert!((b - exact).abs() < 1e-5);
        // The corners are attained: picking the better endpoint per coordinate equals the bound.
        assert!(dot(&q, &hi) <= b && dot(&q, &lo) <= b);
    }

    #[test]
    fn dots_are_bit_identical_to_dot() {
        let mut rng = kvtier_storage::testing::Rng::new(3);
        for len in [1, 7, 8, 20, 128, 131] {
            let x = rng.normals(len);
            let q: Vec<Vec<f32>> = (0..4).map(|_| rng.normals(len)).collect();
            let got = dots([&q[0][..], &q[1], &q[2], &q[3]], &x);
            for (g, qi) in got.iter().zip(&q) {
                assert_eq!(g.to_bits(), dot(qi, &x).to_bits(), "len {len}");
            }
        }
    }
}
