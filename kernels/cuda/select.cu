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


// The CPU's lane fold (kvtier_kernels::simd::reduce): ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
__device__ __forceinline__ float lanes_reduce(const float* a) {
    const float t0 = __fadd_rn(a[0], a[4]);
    const float t1 = __fadd_rn(a[1], a[5]);
    const float t2 = __fadd_rn(a[2], a[6]);
    const float t3 = __fadd_rn(a[3], a[7]);
    return __fadd_rn(__fadd_rn(t0, t2), __fadd_rn(t1, t3));
}

// Summary values per 16-byte load, and 16-byte loads per (block row, DCH-dim chunk): the
// chunk's k_max half then its k_min half.
#if SUM_BF16
#define SV 8
#else
#define SV 4
#endif
#define LPR (2 * DCH / SV)

// Unpacks one 16-byte load of summary values into SV floats.
__device__ __forceinline__ void unpack_sums(const uint4 v, float* out) {
#if SUM_BF16
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        out[2 * k] = bf16_bits_to_f32(w[k] & 0xffffu);
        out[2 * k + 1] = bf16_bits_to_f32(w[k] >> 16);
    }
#else
    out[0] = __uint_as_float(v.x);
    out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z);
    out[3] = __uint_as_float(v.w);
#endif
}

// Maps a float to a u32 whose unsigned order is the float order (-0 folded into +0 so that
// equal scores compare equal, as on the CPU).
__device__ __forceinline__ u32 orderable(float f) {
    if (f == 0.0f) f = 0.0f;
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Two-stage top-k (TOPK <= 32; config.rs sets TOPK_MERGE). select_score reduces each thread
// block's SCORE_THREADS blocks to its 32 best candidates, a descending list; select_topk merges
// the lists of a kv head. A candidate is a 64-bit key: the score's order-preserving bits above
// the complemented block id, so a larger key is a better block and equal scores prefer the
// lower block (the CPU's tie rule); 0 is "no candidate" and below every real key. The global
// top-k under this strict order is the top-k of the union of the lists' top-32s, so the result
// is the radix select's exactly. Every step is a warp-wide bitonic network (shuffles, no
// barriers) except one barrier per merge level: the radix version spent ~20 us at 1M tokens on
// a chain of barriers in one thread block per kv head (bench/gpu/NOTES.md v10, v13).
__device__ __forceinline__ u64 cand_key(float score, u32 b) {
    return ((u64)orderable(score) << 32) | (u64)(~b);
}

__device__ __forceinline__ u64 shfl_xor64(u64 v, int m) {
    const u32 lo = __shfl_xor_sync(FULL_MASK, (u32)v, m);
    const u32 hi = __shfl_xor_sync(FULL_MASK, (u32)(v >> 32), m);
    return ((u64)hi << 32) | lo;
}

// Sorts one key per lane across the warp, descending (lane 0 holds the largest).
__device__ __forceinline__ u64 warp_sort_desc(u64 v) {
    const u32 lane = threadIdx.x & 31u;
#pragma unroll
    for (u32 k = 2; k <= 32; k <<= 1) {
#pragma unroll
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            const u64 p = shfl_xor64(v, j);
            // Runs of k lanes alternate direction; the last (k = 32) is one descending run.
            const bool take_max = ((lane & j) == 0) == ((lane & k) == 0);
            v = take_max ? (v > p ? v : p) : (v < p ? v : p);
        }
    }
    return v;
}

// The top 32 of two descending warp lists, descending. `b_rev` holds the second list reversed
// (lane l: its element 31 - l), so max(a, b_rev) is a bitonic sequence holding the top 32 of
// both, which one bitonic merge sorts.
__device__ __forceinline__ u64 warp_merge_desc(u64 a, u64 b_rev) {
    const u32 lane = threadIdx.x & 31u;
    u64 v = a > b_rev ? a : b_rev;
#pragma unroll
    for (u32 j = 16; j > 0; j >>= 1) {
        const u64 p = shfl_xor64(v, j);
        v = (lane & j) == 0 ? (v > p ? v : p) : (v < p ? v : p);
    }
    return v;
}

// Candidate lists per (batch item, kv head): one per select_score thread block.
#define SCORE_LISTS(max_blocks) (((max_blocks) + SCORE_THREADS - 1) / SCORE_THREADS)

// grid (ceil(max_blocks / SCORE_THREADS), KV_HEADS, batch), block SCORE_THREADS.
// One thread per scored block keeps GROUP x 8 running sums in registers (per query head, the
// CPU's 8 lanes, each summed over d in increasing order exactly as on the CPU). The summaries
// are read in DCH-dim chunks with coalesced 16-byte loads into padded shared memory; the next
// chunk's loads are issued into registers before the current chunk is used. (Two threads per
// scored block, each owning 4 lanes, measured the same 15.5 us at 1M tokens on an H200: the
// kernel is issue-bound, not short of threads; bench/gpu/NOTES.md v10.)
// q: [batch][HQ][HEAD_DIM] f32. sums: [slot][layer][max_blocks][KV_HEADS][2][HEAD_DIM].
// scratch: with TOPK_MERGE, each thread block's descending list of its 32 best distant
// candidates, u64 [batch][KV_HEADS][SCORE_LISTS(max_blocks)][32]; otherwise every score, f32
// [batch][KV_HEADS][max_blocks].
extern "C" __global__ void __launch_bounds__(SCORE_THREADS) select_score(
    const float* __restrict__ q, const sum_t* __restrict__ sums, const u32* __restrict__ sess,
    const u32* __restrict__ ntok, u32 layer, u32 max_blocks, void* __restrict__ scratch) {
    const u32 i = blockIdx.z;
    const u32 kvh = blockIdx.y;
    const u32 nb = n_blocks_of(ntok[i]);
    const u32 b0 = blockIdx.x * SCORE_THREADS;
    // A short layer keeps every block (plan_fixed): nothing to score.
    if (b0 >= nb || SHORT_LAYER(nb)) return;
    __shared__ float s_q[GROUP][HEAD_DIM];
    __shared__ float s_mx[SCORE_THREADS][DCH + 1];
    __shared__ float s_mn[SCORE_THREADS][DCH + 1];
    const u32 tid = threadIdx.x;
    const float* qh = q + ((u64)i * HQ + (u64)kvh * GROUP) * HEAD_DIM;
    for (u32 x = tid; x < GROUP * HEAD_DIM; x += SCORE_THREADS) s_q[x / HEAD_DIM][x % HEAD_DIM] = qh[x];
    const sum_t* base = sums + (((u64)sess[i] * NUM_LAYERS + layer) * (u64)max_blocks) * KV_HEADS * 2 * HEAD_DIM;

    // Load x of a chunk: row r = x / LPR; which half (max/min) and SV-value group within it.
    uint4 pre[LPR];
    auto load_chunk = [&](u32 c) {
#pragma unroll
        for (int u = 0; u < LPR; ++u) {
            const u32 x = tid + u * SCORE_THREADS;
            const u32 r = x / LPR;
            const u32 e = x % LPR;
            const u32 which = e / (LPR / 2);
            const u32 d = c * DCH + (e % (LPR / 2)) * SV;
            pre[u] = make_uint4(0u, 0u, 0u, 0u);
            if (b0 + r < nb)
                pre[u] = __ldg((const uint4*)(base + ((u64)(b0 + r) * KV_HEADS + kvh) * 2 * HEAD_DIM + which * HEAD_DIM + d));
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
        for (int u = 0; u < LPR; ++u) {
            const u32 x = tid + u * SCORE_THREADS;
            const u32 r = x / LPR;
            const u32 e = x % LPR;
            float* dst = (e / (LPR / 2)) ? &s_mn[r][(e % (LPR / 2)) * SV] : &s_mx[r][(e % (LPR / 2)) * SV];
            float v[SV];
            unpack_sums(pre[u], v);
#pragma unroll
            for (int k = 0; k < SV; ++k) dst[k] = v[k];
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
    float m = NEG_INF;
#pragma unroll
    for (int g = 0; g < GROUP; ++g) m = fmaxf(m, lanes_reduce(acc[g]));
#if TOPK_MERGE
    // Only distant blocks are candidates (nb > KSEL here, so nb - LOCAL > SINK).
    u64 key = (b >= SINK && b < nb - LOCAL) ? cand_key(m, b) : 0ull;
    key = warp_sort_desc(key);
    __shared__ u64 s_list[SCORE_THREADS / 32][32];
    const u32 lane = tid & 31u;
    const u32 w = tid >> 5;
    s_list[w][lane] = key;
    __syncthreads();
    if (w == 0) {
#pragma unroll
        for (u32 o = 1; o < SCORE_THREADS / 32; ++o) key = warp_merge_desc(key, s_list[o][31 - lane]);
        u64* lists = (u64*)scratch;
        lists[(((u64)i * KV_HEADS + kvh) * SCORE_LISTS(max_blocks) + blockIdx.x) * 32 + lane] = key;
    }
#else
    if (b < nb) ((float*)scratch)[((u64)i * KV_HEADS + kvh) * max_blocks + b] = m;
#endif
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

// Top-k of the distant blocks [SINK, nb - LOCAL), ascending, into out[SINK, SINK + TOPK).
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

// Top-k of the distant blocks, ascending, into out[SINK, SINK + TOPK), from the candidate lists
// select_score wrote for this (batch item, kv head) (TOPK <= 32). Each warp merges lists
// w, w + 32, ...; a barrier-separated tree merges the warps' lists; warp 0 then sorts the
// TOPK winners' block ids ascending.
__device__ __forceinline__ void select_distant_merge(const u64* __restrict__ lists, u32 nb, u32* out) {
    __shared__ u64 s_top[TOPK_THREADS / 32][32];
    const u32 lane = threadIdx.x & 31u;
    const u32 w = threadIdx.x >> 5;
    const u32 nw = blockDim.x >> 5;
    const u32 nlists = SCORE_LISTS(nb);
    u64 v = w < nlists ? lists[(u64)w * 32 + lane] : 0ull;
    for (u32 x = w + nw; x < nlists; x += nw) v = warp_merge_desc(v, lists[(u64)x * 32 + 31 - lane]);
    s_top[w][lane] = v;
    __syncthreads();
    // Level s: warp w (a multiple of 2s) takes in warp w + s's list (written at level s / 2).
    for (u32 s = 1; s < nw; s <<= 1) {
        if ((w & (2 * s - 1)) == 0 && w + s < nw && w + s < nlists) {
            v = warp_merge_desc(v, s_top[w + s][31 - lane]);
            s_top[w][lane] = v;
        }
        __syncthreads();
    }
    if (w == 0) {
        // Winners' complemented ids (the low key word) sorted descending = ids ascending.
        u64 id = lane < TOPK ? (u64)(u32)v : 0ull;
        id = warp_sort_desc(id);
        if (lane < TOPK) out[SINK + lane] = ~(u32)id;
    }
}

// grid (KV_HEADS, batch), block TOPK_THREADS. For a layer longer than KSEL blocks, writes the
// TOPK distant blocks of each keep-set row (positions [SINK, SINK + TOPK) of
// table[batch][KV_HEADS][KSEL]; plan_fixed wrote the rest and the counts) and plans them.
// Thread t owns the TOPK_KPT consecutive distant candidates starting at t * TOPK_KPT, kept in
// registers as order-preserving u32 keys. Radix select (4 passes of 8 bits, MSB first) finds
// T = the TOPK-th largest key and how many blocks equal to T are taken; two block-wide
// prefix sums then emit key > T, plus the lowest-indexed blocks with key == T (the tie
// rule), in ascending order.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) select_topk(
    const void* __restrict__ scratch, const u32* __restrict__ ntok, u32 max_blocks, u32* table,
    const u32* __restrict__ sess, u32 layer, u32* __restrict__ tags, u32* __restrict__ stamps,
    const u64* __restrict__ pages, u32* __restrict__ slot_of, u64* __restrict__ miss_src,
    unsigned long long* __restrict__ stats, u32 stamp) {
    const u32 i = blockIdx.y;
    const u32 kvh = blockIdx.x;
    const u32 nb = n_blocks_of(ntok[i]);
    if (SHORT_LAYER(nb)) return;
    u32* row = table + ((u64)i * KV_HEADS + kvh) * KSEL;
#if TOPK_MERGE
    select_distant_merge((const u64*)scratch + ((u64)i * KV_HEADS + kvh) * SCORE_LISTS(max_blocks) * 32, nb, row);
#else
    select_distant((const float*)scratch + ((u64)i * KV_HEADS + kvh) * max_blocks, nb, row);
#endif
    __syncthreads();
    plan_tile_cache(i, kvh, row, SINK, TOPK, 0, 0, true, sess, ntok, layer, max_blocks, tags, stamps, pages,
                    slot_of, miss_src, stats, stamp);
}
