// Block selector: bounds scoring (select_score) and per-kv-head top-k (select_topk).
//
// Bit-exactness with the CPU selector: each score is computed by ONE thread as
//   s = 0; for d in 0..HEAD_DIM: s = s + max(q[d]*k_max[d], q[d]*k_min[d])
// in fp32, with explicit round-to-nearest multiply and add (__fmul_rn/__fadd_rn cannot be
// contracted into FMAs), which is exactly the CPU's sequential order. The max over the G query
// heads is order-independent. So scores are bit-identical, and ties are broken by block index in
// both implementations.

// SB (blocks scored per thread block) arrives as a define sized to the shared-memory limit.

#if SUM_BF16
typedef unsigned short sum_t;
__device__ __forceinline__ float sum_to_f32(sum_t v) { return bf16_bits_to_f32(v); }
#else
typedef float sum_t;
__device__ __forceinline__ float sum_to_f32(sum_t v) { return v; }
#endif

// grid (ceil(max_blocks / SB), KV_HEADS, batch), block SB * GROUP threads.
// q: [batch][HQ][HEAD_DIM] f32. sums: [slot][layer][max_blocks][KV_HEADS][2][HEAD_DIM].
// scores: [batch][KV_HEADS][max_blocks].
extern "C" __global__ void __launch_bounds__(SB * GROUP) select_score(
    const float* __restrict__ q, const sum_t* __restrict__ sums, const u32* __restrict__ sess,
    const u32* __restrict__ ntok, u32 layer, u32 max_blocks, float* __restrict__ scores) {
    const u32 i = blockIdx.z;
    const u32 kvh = blockIdx.y;
    const u32 b0 = blockIdx.x * SB;
    const u32 nb = n_blocks_of(ntok[i]);
    if (b0 >= nb) return;

    // +1 pad: thread t reads row t, so rows must not share a bank.
    __shared__ float s_sum[SB][2 * HEAD_DIM + 1];
    __shared__ float s_q[GROUP][HEAD_DIM];
    __shared__ float s_part[GROUP][SB];

    const float* qh = q + ((u64)i * HQ + (u64)kvh * GROUP) * HEAD_DIM;
    for (u32 x = threadIdx.x; x < GROUP * HEAD_DIM; x += blockDim.x) s_q[x / HEAD_DIM][x % HEAD_DIM] = qh[x];

    const sum_t* base = sums + ((u64)sess[i] * NUM_LAYERS + layer) * (u64)max_blocks * KV_HEADS * 2 * HEAD_DIM;
    for (u32 x = threadIdx.x; x < SB * 2 * HEAD_DIM; x += blockDim.x) {
        const u32 bl = x / (2 * HEAD_DIM);
        const u32 e = x % (2 * HEAD_DIM);
        const u32 b = b0 + bl;
        if (b < nb) s_sum[bl][e] = sum_to_f32(base[((u64)b * KV_HEADS + kvh) * 2 * HEAD_DIM + e]);
    }
    __syncthreads();

    const u32 bl = threadIdx.x % SB;
    const u32 g = threadIdx.x / SB;
    float s = 0.0f;
    if (b0 + bl < nb) {
#pragma unroll 8
        for (u32 d = 0; d < HEAD_DIM; ++d) {
            const float qd = s_q[g][d];
            const float a = __fmul_rn(qd, s_sum[bl][d]);
            const float c = __fmul_rn(qd, s_sum[bl][HEAD_DIM + d]);
            s = __fadd_rn(s, fmaxf(a, c));
        }
    }
    s_part[g][bl] = s;
    __syncthreads();
    if (threadIdx.x < SB && b0 + threadIdx.x < nb) {
        float m = s_part[0][threadIdx.x];
#pragma unroll
        for (u32 gg = 1; gg < GROUP; ++gg) m = fmaxf(m, s_part[gg][threadIdx.x]);
        scores[((u64)i * KV_HEADS + kvh) * max_blocks + b0 + threadIdx.x] = m;
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

// grid (KV_HEADS, batch), block TOPK_THREADS. Writes the keep-set ascending into
// table[batch][KV_HEADS][KSEL] and its size into counts[batch][KV_HEADS].
// Radix select (4 passes of 8 bits, MSB first) finds T = the TOPK-th largest key among the
// distant blocks and how many blocks equal to T are taken; one ordered scan then emits
// key > T, plus the lowest-indexed blocks with key == T (the tie rule), in ascending order.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) select_topk(
    const float* __restrict__ scores, const u32* __restrict__ ntok, u32 max_blocks,
    u32* __restrict__ table, u32* __restrict__ counts) {
    const u32 i = blockIdx.y;
    const u32 kvh = blockIdx.x;
    const u32 tid = threadIdx.x;
    const u32 lane = tid & 31u;
    const u32 nb = n_blocks_of(ntok[i]);
    const float* sc = scores + ((u64)i * KV_HEADS + kvh) * max_blocks;
    u32* out = table + ((u64)i * KV_HEADS + kvh) * KSEL;

    if (nb <= (u32)(SINK + LOCAL + TOPK)) {
        for (u32 b = tid; b < nb; b += blockDim.x) out[b] = b;
        if (tid == 0) counts[i * KV_HEADS + kvh] = nb;
        return;
    }
    const u32 lo = SINK;
    const u32 hi = nb - LOCAL;

    __shared__ u32 hist[256];
    __shared__ u32 s_digit;
    __shared__ u32 s_krem;
    __shared__ u32 scratch[33];

    u32 prefix = 0, pmask = 0, krem = TOPK;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (u32 x = tid; x < 256; x += blockDim.x) hist[x] = 0;
        __syncthreads();
        for (u32 base = lo; base < hi; base += blockDim.x) {
            const u32 b = base + tid;
            u32 digit = 256u;  // sentinel: not a candidate in this pass
            if (b < hi) {
                const u32 key = orderable(sc[b]);
                if ((key & pmask) == prefix) digit = (key >> shift) & 0xffu;
            }
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
        __syncthreads();
    }
    const u32 T = prefix;
    const u32 need_eq = krem;  // blocks with key == T to take, lowest index first

    for (u32 x = tid; x < SINK; x += blockDim.x) out[x] = x;
    for (u32 x = tid; x < LOCAL; x += blockDim.x) out[SINK + TOPK + x] = hi + x;

    u32 run_eq = 0, run_sel = 0;
    for (u32 base = lo; base < hi; base += blockDim.x) {
        const u32 b = base + tid;
        u32 key = 0;
        const bool valid = b < hi;
        if (valid) key = orderable(sc[b]);
        const bool eq = valid && key == T;
        const bool gt = valid && key > T;
        u32 tot_eq, tot_sel;
        const u32 eq_rank = run_eq + block_excl_count(eq, scratch, &tot_eq);
        const bool sel = gt || (eq && eq_rank < need_eq);
        const u32 pos = run_sel + block_excl_count(sel, scratch, &tot_sel);
        if (sel) out[SINK + pos] = b;
        run_eq += tot_eq;
        run_sel += tot_sel;
    }
    if (tid == 0) counts[i * KV_HEADS + kvh] = SINK + TOPK + LOCAL;
}
