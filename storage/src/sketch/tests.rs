use super::*;

#[test]
fn codes_round_trip_under_their_channel_scales() {
    let key = [0.7f32, -0.35, 0.0, 0.1, -0.7];
    let scales = [0.1f32, 0.1, 0.1, 0.1, 0.0];
    let mut codes = [0u8; 16];
    quantize_key(&key, &scales, &mut codes);
    let mut out = [0i16; 32];
    unpack(&codes, &mut out);
    // -0.35 / 0.1 = -3.5 rounds to even: -4; a channel of scale 0 codes 0; the padding is
    // zero.
    assert_eq!(out[..5], [7, -4, 0, 1, 0]);
    assert!(out[5..].iter().all(|&c| c == 0));
    assert_eq!(channel_scale(0.7), 0.7 / 7.0);
    assert_eq!(key_code(100.0, 1.0), 7);
}

/// The eight-lane quantizer gives every element the scalar rule's code: ties, the clamp,
/// zero and tiny scales, signed zeros and subnormals, at head dims with and without a tail.
#[test]
fn quantize_key_is_the_scalar_rule_element_by_element() {
    let mut rng = crate::testing::Rng::new(0x2545_f491);
    let mut next = || rng.next_u64() as u32;
    let special = [
        0.0f32, -0.0, 0.5, -0.5, 1.5, -2.5, 7.5, -7.5, 7.0, 1e-40, -1e-40, 1e30,
    ];
    for d in [3usize, 8, 20, 40, 128, 256] {
        for round in 0..400 {
            let mut scales = vec![0f32; d];
            let mut key = vec![0f32; d];
            for (s, k) in scales.iter_mut().zip(key.iter_mut()) {
                let r = next();
                *s = match r % 7 {
                    0 => 0.0,
                    1 => 1e-38,
                    2 => 1.0,
                    _ => f32::from_bits(0x3c00_0000 + (next() >> 9)),
                };
                *k = match (r >> 3) % 4 {
                    0 => special[(next() % special.len() as u32) as usize] * s.max(1.0),
                    1 => special[(next() % special.len() as u32) as usize],
                    _ => {
                        f32::from_bits(next() & 0xbfff_ffff) * if round % 2 == 0 { 1.0 } else { *s }
                    }
                };
            }
            let mut codes = vec![0xa5u8; code_bytes(d)]; // stale codes are overwritten
            quantize_key(&key, &scales, &mut codes);
            let mut out = vec![0i16; padded_dims(d)];
            unpack(&codes, &mut out);
            for e in 0..d {
                assert_eq!(
                    out[e],
                    key_code(key[e], scales[e]),
                    "d {d} e {e}: {} / {}",
                    key[e],
                    scales[e]
                );
            }
            assert!(out[d..].iter().all(|&c| c == 0));
        }
    }
}

#[test]
fn every_code_of_every_element_unpacks_to_itself() {
    for d in [2usize, 20, 32, 128, 256] {
        let scales = vec![1f32; d];
        for e in 0..d {
            for c in -KEY_LEVELS..=KEY_LEVELS {
                let mut key = vec![0f32; d];
                key[e] = c as f32;
                key[(e + 1) % d] = 7.0;
                let mut codes = vec![0u8; code_bytes(d)];
                quantize_key(&key, &scales, &mut codes);
                let mut out = vec![0i16; padded_dims(d)];
                unpack(&codes, &mut out);
                let want: Vec<i16> = key.iter().map(|&x| x as i16).collect();
                assert_eq!(out[..d], want[..], "d {d} e {e} c {c}");
                // Rewriting one element's code changes that element only.
                let other = (c + 3).rem_euclid(15) - 7;
                set_code(&mut codes, e, other as i16);
                unpack(&codes, &mut out);
                let mut want = want;
                want[e] = other as i16;
                assert_eq!(out[..d], want[..], "set: d {d} e {e} c {c}");
            }
        }
    }
}

/// Keys appended one by one, each raising some channels' scales (so earlier keys are
/// re-quantized), sketch to the same bits as the block sketched whole, at every length.
#[test]
fn appending_keys_one_by_one_equals_sketching_the_block() {
    use crate::dtype::DType;
    for (dtype, bt, d) in [(DType::Bf16, 64u32, 40u32), (DType::F32, 16, 128)] {
        let geo = Geometry {
            layers: 1,
            q_heads: 4,
            kv_heads: 2,
            head_dim: d,
            dtype,
            block_tokens: bt,
        };
        let (bt, d) = (bt as usize, d as usize);
        let mut run = vec![0u8; geo.block_bytes()];
        let mut x = 0x9e37_79b9_u32;
        let mut layer = LayerSketches::default();
        layer.open_block(&geo);
        let mut key = vec![0f32; d];
        for t in 0..bt {
            for h in 0..geo.kv_heads as usize {
                // Magnitudes growing with t in some channels, shrinking in others.
                let vals: Vec<f32> = (0..d)
                    .map(|c| {
                        x ^= x << 13;
                        x ^= x >> 17;
                        x ^= x << 5;
                        let u = (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                        u * if c % 3 == 0 {
                            1.0 + t as f32
                        } else {
                            40.0 / (1.0 + t as f32)
                        }
                    })
                    .collect();
                let o = geo.k_row_offset(h, t);
                dtype.encode(&vals, &mut run[o..o + geo.row_bytes()]);
                dtype.decode(&run[o..o + geo.row_bytes()], &mut key);
                layer.add(&geo, 0, h, t, &key, &run);
            }
            layer.seal(&geo, 0);
            let mut whole = BlockSketches::new(&geo, 1);
            sketch_block(&geo, &run, t + 1, whole.blocks_mut(&geo).next().unwrap());
            assert_eq!(layer.range(&geo, 0..1).codes, &whole.codes[..], "t {t}");
            assert_eq!(
                layer.range(&geo, 0..1).channel_scales,
                &whole.channel_scales[..],
                "t {t}"
            );
            assert_eq!(
                layer.range(&geo, 0..1).quarters,
                &whole.quarters[..],
                "t {t}"
            );
        }
    }
}

#[test]
fn quarters_partition_the_block() {
    let counts: Vec<usize> = [1, 31, 32, 63, 64, 127, 128, 1024].map(quarters).into();
    assert_eq!(counts, [1, 1, 1, 1, 2, 2, 4, 4]);
    for bt in 1..300usize {
        let n = quarters(bt);
        let mut last = 0;
        for t in 0..bt {
            let q = quarter_of(t, bt);
            assert!(q >= last && q < n, "bt {bt} t {t}");
            assert!((q * bt / n..(q + 1) * bt / n).contains(&t), "bt {bt} t {t}");
            last = q;
        }
        assert_eq!(last, n - 1);
    }
}

/// Quarter codes are the libm rule: the max's code rounded up, the min's down, clamped.
#[test]
fn quarter_codes_are_ceil_and_floor_of_their_bounds() {
    let mut rng = crate::testing::Rng::new(0x5eed_0042);
    let d = 40;
    let f = |b: u16| f32::from_bits(u32::from(b) << 16);
    for round in 0..2000 {
        let mut q = vec![0u16; 4 * 2 * d];
        for b in q.iter_mut() {
            // Finite bf16 bits of every exponent, and zeros of both signs.
            *b = match rng.next_u64() % 9 {
                0 => 0x8000,
                1 => 0,
                _ => loop {
                    let v = rng.next_u64() as u16;
                    if f(v).is_finite() {
                        break v;
                    }
                },
            };
        }
        if round % 3 == 0 {
            reset_quarters(&mut q[3 * 2 * d..], d); // a quarter without tokens
        }
        let mut codes = vec![0i8; q.len()];
        let scale = quantize_quarters(&q, &mut codes, d);
        let lim = BOUND_LEVELS as f32;
        for (i, (&b, &c)) in q.iter().zip(&codes).enumerate() {
            let (quarter, upper) = (i / (2 * d), i % (2 * d) < d);
            let want = if !f(q[quarter * 2 * d]).is_finite() {
                if upper {
                    -127
                } else {
                    127
                }
            } else if scale == 0.0 {
                0
            } else if upper {
                (f(b) / scale).ceil().clamp(-lim, lim) as i8
            } else {
                (f(b) / scale).floor().clamp(-lim, lim) as i8
            };
            assert_eq!(c, want, "round {round} element {i}: {} / {scale}", f(b));
        }
    }
}
