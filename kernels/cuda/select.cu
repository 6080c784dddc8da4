// Block selector: bounds scoring (select_score) and per-kv-head top-k (select_topk).
//
// Bit-exactness with the CPU selector (kvtier_kernels::simd::bound_dot + select::block_score):
// each score is computed by ONE thread in the CPU's exact order: element d of
// max(q[d]*k_max[d], q[d]*k_min[d]) is added to lane d % 8 (8 accumulators, increasing d), then
// the lanes are folded as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) (simd.rs `reduce`). Multiplies
// and adds are explicit round-to-nearest (__fmul_rn/__fadd_rn are never contracted into FMAs).
// The max over the G query heads is order-independent. So scores are bit-identical, and ties
// are broken by lower block index in both implementations.

#if SUM_BF16
typedef unsigned short sum_t;
__device__ __forceinline__ float sum_to_f32(sum_t v) { return bf16_bits_to_f32(v); }
#else
typedef float sum_t;
__device__ __forceinline__ float sum_to_f32(sum_t v) { return v; }
#endif

#define SCORE_THREADS 128

// The CPU's lane fold (kvtier_kernels::simd::reduce): ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
__device__ __forceinline__ float lanes_reduce(const float* a) {
    const float t0 = __fadd_rn(a[0], a[4]);
    const float t1 = __fadd_rn(a[1], a[5]);
    const float t2 = __fadd_rn(a[2], a[6]);
    const float t3 = __fadd_rn(a[3], a[7]);
    return __fadd_rn(__fadd_rn(t0, t2), __fadd_rn(t1, t3));
}

// Loads 4 consecutive summary values as floats (16 bytes of f32 or 8 bytes of bf16).
__device__ __forceinline__ void load4(const sum_t* p, float* out) {
#if SUM_BF16
    const uint2 v = __ldg((const uint2*)p);
    out[0] = bf16_bits_to_f32(v.x & 0xffffu);
    out[1] = bf16_bits_to_f32(v.x >> 16);
    out[2] = bf16_bits_to_f32(v.y & 0xffffu);
    out[3] = bf16_bits_to_f32(v.y >> 16);
#else
    const float4 v = __ldg((const float4*)p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
#endif
}

// Summary values of one (block, kv head) row chunk staged per step: DCH dims of k_max and of
// k_min (DCH arrives as a define: 32, or 16 when shared memory is short).
#define SC_LOADS (SCORE_THREADS * 2 * DCH / 4 / SCORE_THREADS)  // 4-value loads per thread per chunk

// grid (ceil(max_blocks / SCORE_THREADS), KV_HEADS, batch), block SCORE_THREADS.
// One thread per block keeps GROUP running sums in registers (so each score is one sequential
// fp32 sum over d, as on the CPU). The summaries are read in DCH-dim chunks with coalesced
// loads (a row chunk is 128 contiguous bytes in f32) into padded shared memory; the next
// chunk's loads are issued into registers before the current chunk is computed.
// q: [batch][HQ][HEAD_DIM] f32. sums: [slot][layer][max_blocks][KV_HEADS][2][HEAD_DIM].
// scores: [batch][KV_HEADS][max_blocks].
extern "C" __global__ void __launch_bounds__(SCORE_THREADS) select_score(
    const float* __restrict__ q, const sum_t* __restrict__ sums, const u32* __restrict__ sess,
    const u32* __restrict__ ntok, u32 layer, u32 max_blocks, float* __restrict__ scores) {
    const u32 i = blockIdx.z;
    const u32 kvh = blockIdx.y;
    const u32 nb = n_blocks_of(ntok[i]);
    const u32 b0 = blockIdx.x * SCORE_THREADS;
    if (b0 >= nb) return;
    __shared__ float s_q[GROUP][HEAD_DIM];
    __shared__ float s_mx[SCORE_THREADS][DCH + 1];
    __shared__ float s_mn[SCORE_THREADS][DCH + 1];
    const u32 tid = threadIdx.x;
    const float* qh = q + ((u64)i * HQ + (u64)kvh * GROUP) * HEAD_DIM;
    for (u32 x = tid; x < GROUP * HEAD_DIM; x += SCORE_THREADS) s_q[x / HEAD_DIM][x % HEAD_DIM] = qh[x];
    const sum_t* base = sums + (((u64)sess[i] * NUM_LAYERS + layer) * (u64)max_blocks) * KV_HEADS * 2 * HEAD_DIM;

    // Load slot x of a chunk: row r = x / (2*DCH/4), array (max/min) and 4-value group within.
    float4 pre[SC_LOADS];
    auto load_chunk = [&](u32 c) {
#pragma unroll
        for (int u = 0; u < SC_LOADS; ++u) {
            const u32 x = tid + u * SCORE_THREADS;
            const u32 r = x / (2 * DCH / 4);
            const u32 e = x % (2 * DCH / 4);
            const u32 which = e / (DCH / 4);
            const u32 d = c * DCH + (e % (DCH / 4)) * 4;
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (b0 + r < nb) load4(base + ((u64)(b0 + r) * KV_HEADS + kvh) * 2 * HEAD_DIM + which * HEAD_DIM + d, v);
            pre[u] = make_float4(v[0], v[1], v[2], v[3]);
        }
    };
    load_chunk(0);
    // acc[g][j]: lane j of query head g's bound sum (the CPU's 8 SIMD lanes).
    float acc[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = 0.0f;
    for (u32 c = 0; c < HEAD_DIM / DCH; ++c) {
#pragma unroll
        for (int u = 0; u < SC_LOADS; ++u) {
            const u32 x = tid + u * SCORE_THREADS;
            const u32 r = x / (2 * DCH / 4);
            const u32 e = x % (2 * DCH / 4);
            float* dst = (e / (DCH / 4)) ? &s_mn[r][(e % (DCH / 4)) * 4] : &s_mx[r][(e % (DCH / 4)) * 4];
            dst[0] = pre[u].x;
            dst[1] = pre[u].y;
            dst[2] = pre[u].z;
            dst[3] = pre[u].w;
        }
        __syncthreads();
        if (c + 1 < HEAD_DIM / DCH) load_chunk(c + 1);
        // DCH is a multiple of 8, so dim c*DCH + d0 + j goes to lane j.
        for (u32 d0 = 0; d0 < DCH; d0 += 8) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float mx = s_mx[tid][d0 + j];
                const float mn = s_mn[tid][d0 + j];
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    const float qd = s_q[g][c * DCH + d0 + j];
                    acc[g][j] = __fadd_rn(acc[g][j], fmaxf(__fmul_rn(qd, mx), __fmul_rn(qd, mn)));
                }
            }
        }
        __syncthreads();
    }
    const u32 b = b0 + tid;
    if (b < nb) {
        float m = NEG_INF;
#pragma unroll
        for (int g = 0; g < GROUP; ++g) m = fmaxf(m, lanes_reduce(acc[g]));
        scores[((u64)i * KV_HEADS + kvh) * max_blocks + b] = m;
    }
}

// Maps a float to a u32 whose unsigned order is the float order (-0 folded into +0 so that
// equal scores compare equal, as on the CPU).
__device__ __forceinline__ u32 orderable(float f) {
    if (f == 0.0f) f = 0.0f;
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#define TOPK_THREADS 1024

// Exclusive prefix sum of a per-thread count across the (1-D) thread block; total in *total.
__device__ __forceinline__ u32 block_excl_sum(u32 v, u32* scratch, u32* total) {
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    const u32 nwarps = blockDim.x >> 5;
    u32 incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= (u32)o) incl += y;
    }
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const u32 x = lane < nwarps ? scratch[lane] : 0u;
        u32 w = x;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u32 y = __shfl_up_sync(FULL_MASK, w, o);
            if (lane >= (u32)o) w += y;
        }
        scratch[lane] = w - x;
        if (lane == 31) scratch[32] = w;
    }
    __syncthreads();
    const u32 r = scratch[warp] + incl - v;
    *total = scratch[32];
    __syncthreads();
    return r;
}

// Top-k of the distant blocks [SINK, nb - LOCAL) plus sink and local, ascending, into out.
__device__ __forceinline__ void select_distant(const float* __restrict__ sc, u32 nb, u32* out) {
    const u32 tid = threadIdx.x;
    const u32 lane = tid & 31u;
    const u32 lo = SINK;
    const u32 hi = nb - LOCAL;
    const u32 c0 = tid * TOPK_KPT;

    __shared__ u32 hist[256];
    __shared__ u32 s_digit;
    __shared__ u32 s_krem;
    __shared__ u32 s_done;
    __shared__ u32 scratch[33];

    u32 key[TOPK_KPT];
#pragma unroll
    for (int u = 0; u < TOPK_KPT; ++u) key[u] = (lo + c0 + u < hi) ? orderable(sc[lo + c0 + u]) : 0u;

    u32 prefix = 0, pmask = 0, krem = TOPK;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 x = tid; x < 256; x += blockDim.x) hist[x] = 0;
        __syncthreads();
#pragma unroll
        for (int u = 0; u < TOPK_KPT; ++u) {
            u32 digit = 256u;  // sentinel: not a candidate in this pass
            if (lo + c0 + u < hi && (key[u] & pmask) == prefix) digit = (key[u] >> shift) & 0xffu;
            // Warp-aggregated increments: scores cluster in few top digits.
            const u32 grp = __match_any_sync(FULL_MASK, digit);
            if (digit < 256u && lane == (u32)(__ffs(grp) - 1)) atomicAdd(&hist[digit], __popc(grp));
        }
        __syncthreads();
        if (tid < 32) {
            // Lane l owns top-down positions 8l..8l+7, i.e. bins 255-8l down to 248-8l.
            u32 c[8];
            u32 sum = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                c[k] = hist[255 - (lane * 8 + k)];
                sum += c[k];
            }
            u32 incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 y = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= (u32)o) incl += y;
            }
            const u32 excl = incl - sum;
            if (excl < krem && krem <= incl) {
                u32 cum = excl;
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    if (cum + c[k] >= krem) {
                        s_digit = 255 - (lane * 8 + k);
                        s_krem = krem - cum;
                        // The whole boundary bin is taken: no need to resolve it further.
                        s_done = (krem - cum == c[k]);
                        break;
                    }
                    cum += c[k];
                }
            }
        }
        __syncthreads();
        prefix |= s_digit << shift;
        pmask |= 0xffu << shift;
        krem = s_krem;
        const bool done = s_done;
        __syncthreads();
        if (done) break;
    }
    // Blocks whose key, masked to the resolved bits, is above `prefix` are in; of those equal
    // to it, the `need_eq` lowest-indexed are in (all of them when the loop exited early;
    // with every bit resolved this is exactly "ties go to the lower block").
    const u32 need_eq = krem;

    for (u32 x = tid; x < SINK; x += blockDim.x) out[x] = x;
    for (u32 x = tid; x < LOCAL; x += blockDim.x) out[SINK + TOPK + x] = hi + x;

    u32 n_eq = 0;
#pragma unroll
    for (int u = 0; u < TOPK_KPT; ++u) n_eq += (lo + c0 + u < hi && (key[u] & pmask) == prefix);
    u32 tot;
    u32 eq_rank = block_excl_sum(n_eq, scratch, &tot);
    u32 n_sel = 0;
    u32 selmask = 0;  // TOPK_KPT <= 32 (checked in Rust)
#pragma unroll
    for (int u = 0; u < TOPK_KPT; ++u) {
        const bool valid = lo + c0 + u < hi;
        bool sel = valid && (key[u] & pmask) > prefix;
        if (valid && (key[u] & pmask) == prefix) {
            sel = eq_rank < need_eq;
            ++eq_rank;
        }
        if (sel) {
            selmask |= 1u << u;
            ++n_sel;
        }
    }
    u32 pos = block_excl_sum(n_sel, scratch, &tot);
#pragma unroll
    for (int u = 0; u < TOPK_KPT; ++u)
        if (selmask & (1u << u)) out[SINK + pos++] = lo + c0 + u;
}

// grid (KV_HEADS, batch), block TOPK_THREADS. Writes the keep-set ascending into
// table[batch][KV_HEADS][KSEL] and its size into counts[batch][KV_HEADS].
// Thread t owns the TOPK_KPT consecutive distant candidates starting at t * TOPK_KPT, kept in
// registers as order-preserving u32 keys. Radix select (4 passes of 8 bits, MSB first) finds
// T = the TOPK-th largest key and how many blocks equal to T are taken; two block-wide
// prefix sums then emit key > T, plus the lowest-indexed blocks with key == T (the tie
// rule), in ascending order.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) select_topk(
    const float* __restrict__ scores, const u32* __restrict__ ntok, u32 max_blocks, u32* table,
    u32* __restrict__ counts, const u32* __restrict__ sess, u32 layer, u32* __restrict__ tags,
    u32* __restrict__ stamps, const u64* __restrict__ pages, u32* __restrict__ slot_of,
    u64* __restrict__ miss_src, unsigned long long* __restrict__ stats, u32 stamp) {
    const u32 i = blockIdx.y;
    const u32 kvh = blockIdx.x;
    const u32 tid = threadIdx.x;
    const u32 nb = n_blocks_of(ntok[i]);
    const float* sc = scores + ((u64)i * KV_HEADS + kvh) * max_blocks;
    u32* out = table + ((u64)i * KV_HEADS + kvh) * KSEL;

    if (nb <= (u32)(SINK + LOCAL + TOPK)) {
        for (u32 b = tid; b < nb; b += blockDim.x) out[b] = b;
        if (tid == 0) counts[i * KV_HEADS + kvh] = nb;
    } else {
        select_distant(sc, nb, out);
        if (tid == 0) counts[i * KV_HEADS + kvh] = SINK + TOPK + LOCAL;
    }
    __syncthreads();
    const u32 n = nb <= (u32)(SINK + LOCAL + TOPK) ? nb : (u32)(SINK + LOCAL + TOPK);
    plan_tile_cache(i, kvh, n, out, sess, ntok, layer, max_blocks, tags, stamps, pages, slot_of, miss_src, stats,
                    stamp);
}
