//! Small numeric loops written so the compiler vectorises them (fixed 8-lane accumulators, no
//! branches, no libm calls), shared by the selector and attention.

/// Lanes of the partial sums. The reduction order below is part of the selector's definition
/// (a GPU port that wants bit-identical scores sums the same way).
pub const LANES: usize = 8;

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

/// Dot product; element `i` accumulates into lane `i % 8`.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    for (j, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[j] += x * y;
    }
    reduce(acc)
}

/// Quest bound: sum over d of max(q[d]*hi[d], q[d]*lo[d]), an upper bound on q.k for every k
/// with lo <= k <= hi element-wise. Element `d` accumulates into lane `d % 8`.
#[inline(always)]
pub fn bound_dot(q: &[f32], hi: &[f32], lo: &[f32]) -> f32 {
    debug_assert!(q.len() == hi.len() && q.len() == lo.len());
    let mut acc = [0f32; LANES];
    let (cq, ch, cl) = (
        q.chunks_exact(LANES),
        hi.chunks_exact(LANES),
        lo.chunks_exact(LANES),
    );
    let (rq, rh, rl) = (cq.remainder(), ch.remainder(), cl.remainder());
    for ((x, h), l) in cq.zip(ch).zip(cl) {
        for j in 0..LANES {
            acc[j] += (x[j] * h[j]).max(x[j] * l[j]);
        }
    }
    for j in 0..rq.len() {
        acc[j] += (rq[j] * rh[j]).max(rq[j] * rl[j]);
    }
    reduce(acc)
}

/// `acc += a * x`.
#[inline(always)]
pub fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
    for (o, v) in acc.iter_mut().zip(x) {
        *o += a * v;
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
}
