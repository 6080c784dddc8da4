// Split-k gather-decode attention over the staged keep-set, then a log-sum-exp merge.
//
// attend_tile (and the tile roles of layer_fused, select.cu): one thread block per (session,
// kv head, selected tile). The tile's K and V are fetched once into shared memory and serve all
// GROUP query heads of the kv head. Writes the partial (m, l, acc) with acc unnormalised: acc = sum_t exp(s_t - m) v_t, l = sum_t exp(s_t - m).
// attend_merge: one thread block per (session, query head) combines the partials, and (an
// engine's device call) the engine's tail: tokens it holds on the GPU, attended there.

// ATT_THREADS arrives as a define (config.rs).
#define ATT_WARPS (ATT_THREADS / 32)
#define RG (CPR < 32 ? CPR : 32)  // lanes sharing one K row in the score phase
#define CPL (CPR / RG)            // 16-byte chunks per lane per K row
#define ROWS_PER_WARP (32 / RG)
#define SLICES (ATT_THREADS / CPR)  // V rows processed concurrently in the value phase
#define WSL (CPR < 32 ? 32 / CPR : 1)  // slices within one warp, summed by shuffles
#define RSL (SLICES / WSL)             // slices left for the shared-memory reduction

#if CPR > ATT_THREADS || (CPR & (CPR - 1)) != 0
#error "HEAD_DIM * ELEM_BYTES / 16 must be a power of two <= 128"
#endif

// A lane of the score loop always multiplies the same CPL chunks of q: it keeps them in
// registers when they are few enough (56 floats for the Qwen tile). Reading them from shared
// memory per product made 4-way bank conflicts the score loop's main stall (ncu, v22).
#define ATT_QREG (CPL * GROUP * VEC <= 64)

#define STAGE_UNROLL 8
// V_EARLY: each half of the tile is one round of loads per thread (8 x 16 bytes per half for
// the Qwen tile), so both can be in flight in registers.
#define V_EARLY_LOADS ((BLOCK_TOKENS * CPR + ATT_THREADS - 1) / ATT_THREADS)
#define V_EARLY (V_EARLY_LOADS <= STAGE_UNROLL)

// Tensor-core tiles (config.rs sets ATT_MMA for bf16, GROUP <= 8, HEAD_DIM and BLOCK_TOKENS
// multiples of 16, V_EARLY); compute capability < 8.0 has no bf16 MMA and takes the fp32 path.
#if ATT_MMA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#undef ATT_MMA
#define ATT_MMA 0
#endif
#if ATT_MMA && (ELEM_KIND != 0 || GROUP > 8 || HEAD_DIM % 16 != 0 || BLOCK_TOKENS % 16 != 0 || !V_EARLY)
#error "ATT_MMA needs bf16, GROUP <= 8, HEAD_DIM and BLOCK_TOKENS multiples of 16 and V_EARLY"
#endif
// Score rows: padded by 8 floats on the MMA path so that the value phase's fragment loads (8
// rows, 8 consecutive floats each) fall in distinct banks.
#define SP_STRIDE (ATT_MMA ? BLOCK_TOKENS + 8 : BLOCK_TOKENS)

// Copies rows [0, rows) of a [BLOCK_TOKENS][CPR] uint4 matrix into shared memory with plain
// 16-byte loads, STAGE_UNROLL per thread in flight per round, a warp covering 512 contiguous
// bytes per load. (cp.async from mapped host memory was measured slower on an H200: 35 vs
// 48 GB/s for the same tiles, see bench/gpu/NOTES.md.)
__device__ __forceinline__ void stage_rows(uint4* dst, const uint4* src, u32 rows) {
    const u32 n = rows * CPR;
    for (u32 v0 = threadIdx.x; v0 < n; v0 += STAGE_UNROLL * ATT_THREADS) {
        uint4 r[STAGE_UNROLL];
#pragma unroll
        for (int u = 0; u < STAGE_UNROLL; ++u)
            if (v0 + u * ATT_THREADS < n) r[u] = src[v0 + u * ATT_THREADS];
#pragma unroll
        for (int u = 0; u < STAGE_UNROLL; ++u)
            if (v0 + u * ATT_THREADS < n) dst[v0 + u * ATT_THREADS] = r[u];
    }
}

// Where one tile comes from and whether it goes back to its cache slot: the tile of block b in
// cache slot `slot_idx` of (session slot sslot, layer, kv head kvh), fetched from mapped host
// memory at `src` when that is not 0 (a miss) or else read from the slot (a hit). Without a
// cache (null: dense attention) the tile is read from `src` and goes nowhere.
struct TileRef {
    u32 nvalid;          // tokens of the block present (the tail block may be partial)
    uint4* cslot;        // its cache slot
    const uint4* from;   // where the tile is read
    bool fill;           // a miss of a full block: written back to the slot
    __device__ __forceinline__ TileRef(u32 nt, u32 sslot, u32 layer, uint4* cache, u32 kvh, u32 b, u32 slot_idx,
                                       u64 src) {
        nvalid = min((u32)BLOCK_TOKENS, nt - b * BLOCK_TOKENS);
        const u64 slot = (((u64)sslot * NUM_LAYERS + layer) * KV_HEADS + kvh) * CACHE_SLOTS + slot_idx;
        cslot = cache ? cache + slot * (TILE_BYTES / 16) : nullptr;
        from = src ? (const uint4*)src : cslot;
        // Only full blocks are cached (gather_plan tags them); partial tails are refetched.
        fill = src && cache && nvalid == BLOCK_TOKENS;
    }
};

#if V_EARLY
// Both halves' loads go out together (one 16-byte load per thread per chunk), K first (the
// empty asm keeps the two groups in order, so K lands first); V stays in registers while the
// scores and the softmax run on K. Measured (bench/gpu/NOTES.md v19): hot fetch+attend at 128K
// 24.5 -> 18.8 us; a cold tile's transfer is unchanged (the gather is bound by the PCIe reads).
// Chunks of rows >= nvalid are zero.
__device__ __forceinline__ void load_tile_regs(const TileRef& t, uint4* kr, uint4* vr) {
#pragma unroll
    for (int u = 0; u < V_EARLY_LOADS; ++u) {
        const u32 x = threadIdx.x + u * ATT_THREADS;
        kr[u] = x < t.nvalid * CPR ? t.from[x] : make_uint4(0, 0, 0, 0);
    }
    asm volatile("" ::: "memory");
#pragma unroll
    for (int u = 0; u < V_EARLY_LOADS; ++u) {
        const u32 x = threadIdx.x + u * ATT_THREADS;
        vr[u] = x < t.nvalid * CPR ? t.from[BLOCK_TOKENS * CPR + x] : make_uint4(0, 0, 0, 0);
    }
}
#endif

// Per-head max and exp-sum of the scores s_p[g][0, nvalid), one warp per head; s_p[g][r]
// becomes exp(s - m) for r < nexp (entries past nvalid must hold -inf, which gives 0).
__device__ __forceinline__ void tile_softmax(float (*s_p)[SP_STRIDE], float* s_m, float* s_l, u32 nvalid, u32 nexp) {
    const u32 lane = threadIdx.x & 31u;
    for (u32 g = threadIdx.x >> 5; g < GROUP; g += ATT_WARPS) {
        float m = NEG_INF;
        for (u32 r = lane; r < nvalid; r += 32) m = fmaxf(m, s_p[g][r]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
        float l = 0.0f;
        for (u32 r = lane; r < nexp; r += 32) {
            const float p = expf(s_p[g][r] - m);
            s_p[g][r] = p;
            l += p;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(FULL_MASK, l, o);
        if (lane == 0) {
            s_m[g] = m;
            s_l[g] = l;
        }
    }
}

// The partial's (m, l) per query head (after a barrier that follows tile_softmax).
__device__ __forceinline__ void tile_write_ml(float* __restrict__ part_ml, u64 pbase, const float* s_m,
                                              const float* s_l) {
    for (u32 g = threadIdx.x; g < GROUP; g += ATT_THREADS) {
        part_ml[(pbase + g) * 2] = s_m[g];
        part_ml[(pbase + g) * 2 + 1] = s_l[g];
    }
}

#if ATT_MMA
// Tensor-core helpers. The tile's 16-byte chunks sit in shared memory swizzled by row
// (chunk c of row r at c ^ (r & SWZ)), so the 8 rows of an 8x8 ldmatrix hit distinct banks.
#define SWZ (CPR >= 8 ? 7 : CPR - 1)
__device__ __forceinline__ u32 swz(u32 r, u32 c) { return r * CPR + (c ^ (r & SWZ)); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 bf16 matrices; lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// c += a b: a 16x16 bf16 (row major), b 16x8 bf16 (column major), c 16x8 fp32.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (x0, x1) as packed bf16 pairs (x0 in the low half): hi = rn(x), lo = rn(x - hi).
__device__ __forceinline__ void split_bf16(float x0, float x1, u32& hi, u32& lo) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(x1), "f"(x0));
    const float h0 = __uint_as_float(hi << 16), h1 = __uint_as_float(hi & 0xffff0000u);
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(x1 - h1), "f"(x0 - h0));
}
#endif

// Fetch and attend of one tile by the whole thread block (ATT_THREADS threads): the tile at
// table position j of (batch item i, kv head kvh), block b, in cache slot `slot_idx` (see
// TileRef). `nt` and `sslot` are the batch item's token count and session slot (ntok[i],
// sess[i]): callers load them beside the table entry, so the tile's load waits on one round
// trip to memory rather than a chain of them. The tile is staged in shared memory, written back
// to its cache slot if it is a miss of a full block, and attended; the partial goes to
// part_acc/part_ml at position j of a row of `row` entries (KSEL; max_blocks for dense). Misses of different tiles and the attention of hits overlap
// across thread blocks.
// q: [batch][HQ][HEAD_DIM] f32. part_acc: [batch][KV_HEADS][KSEL][GROUP][HEAD_DIM].
// part_ml: [batch][KV_HEADS][KSEL][GROUP][2].
// With ATT_MMA, tensor cores (m16n8k16 bf16 MMAs, fp32 accumulation), one warp per 16 rows of the output:
// scores S^T [tokens x 8 heads] = K q^T, 16 tokens per warp (K fragments by ldmatrix); values
// O^T [HEAD_DIM x 8 heads] = V^T P^T, 16 dims per warp over all the tile's tokens (V fragments
// by ldmatrix.trans), so no cross-warp reduction. The fp32 factors (q, and the softmax weights
// p) are split into bf16 hi = rn(x) and lo = rn(x - hi), one MMA each into separate
// accumulators: x - hi - lo is below 2^-17 |x|, and K, V are exact bf16, so the products are
// about as exact as fp32 FMAs. Otherwise fp32 FMAs on the CUDA cores (every geometry and dtype).
__device__ __forceinline__ void attend_one(
    const float* __restrict__ q, u32 nt, u32 sslot, u32 layer, uint4* __restrict__ cache, float scale,
    float* __restrict__ part_acc, float* __restrict__ part_ml, u32 i, u32 kvh, u32 j, u32 b, u32 slot_idx,
    u64 src, u32 row = KSEL) {
    const u32 tid = threadIdx.x;
    const u32 lane = tid & 31u;
    const u32 warp = tid >> 5;
    extern __shared__ uint4 s_tile[];  // K rows, V rows (swizzled on the MMA path), fp32: s_red
    __shared__ __align__(16) float s_p[GROUP][SP_STRIDE];
    __shared__ float s_m[GROUP];
    __shared__ float s_l[GROUP];
    const TileRef t(nt, sslot, layer, cache, kvh, b, slot_idx, src);
    const float* qh = q + ((u64)i * HQ + (u64)kvh * GROUP) * HEAD_DIM;
    const u64 pbase = ((u64)(i * KV_HEADS + kvh) * row + j) * GROUP;
#if ATT_MMA
    const u32 g8 = lane >> 2, tig = lane & 3u;  // the MMA fragments' row group and column pair
    const u32 mi = lane >> 3;                    // the ldmatrix matrix this lane addresses

    // q's B fragments per 16 dims and lane: {lo dims hi part, +8 dims hi, lo dims lo part, +8 lo}.
    __shared__ uint4 s_qf[HEAD_DIM / 16 * 32];
    uint4 kr[V_EARLY_LOADS], vr[V_EARLY_LOADS];
    load_tile_regs(t, kr, vr);
    pdl_wait();  // the tile's loads are in flight; q and the partials wait for the previous kernel
    for (u32 x = tid; x < HEAD_DIM / 16 * 32; x += ATT_THREADS) {
        const u32 h = (x & 31u) >> 2;
        const u32 d = (x >> 5) * 16 + (x & 3u) * 2;
        uint4 f = make_uint4(0, 0, 0, 0);
        if (h < GROUP) {
            const float2 a = *(const float2*)(qh + h * HEAD_DIM + d);
            const float2 c = *(const float2*)(qh + h * HEAD_DIM + d + 8);
            split_bf16(a.x, a.y, f.x, f.z);
            split_bf16(c.x, c.y, f.y, f.w);
        }
        s_qf[x] = f;
    }
#pragma unroll
    for (int u = 0; u < V_EARLY_LOADS; ++u) {
        const u32 x = tid + u * ATT_THREADS;
        if (x < BLOCK_TOKENS * CPR) {
            s_tile[swz(x / CPR, x % CPR)] = kr[u];
            if (t.fill) t.cslot[x] = kr[u];
        }
    }
    __syncthreads();

    // Scores: warp w takes tokens [16 m, 16 m + 16) for m = w, w + ATT_WARPS, ...
    const u32 sk = smem_addr(s_tile);
    for (u32 m = warp; m < BLOCK_TOKENS / 16; m += ATT_WARPS) {
        float ch[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const u32 r = m * 16 + (lane & 7u) + (mi & 1u) * 8;
#pragma unroll
        for (u32 ks = 0; ks < HEAD_DIM / 16; ++ks) {
            u32 a[4];
            ldsm_x4(sk + swz(r, 2 * ks + (mi >> 1)) * 16, a);
            const uint4 f = s_qf[ks * 32 + lane];
            mma_bf16(ch, a, f.x, f.y);
            mma_bf16(cl, a, f.z, f.w);
        }
        // Accumulator e: token 16 m + g8 (+ 8 for e >= 2), head 2 tig + (e & 1).
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 h = 2 * tig + (e & 1);
            const u32 tok = m * 16 + g8 + (e >> 1) * 8;
            if (h < GROUP) s_p[h][tok] = tok < t.nvalid ? (ch[e] + cl[e]) * scale : NEG_INF;
        }
    }
    __syncthreads();

    // Softmax over every row (those past nvalid give p = 0), and V into shared memory meanwhile.
    tile_softmax(s_p, s_m, s_l, t.nvalid, BLOCK_TOKENS);
    uint4* vdst = s_tile + BLOCK_TOKENS * CPR;
#pragma unroll
    for (int u = 0; u < V_EARLY_LOADS; ++u) {
        const u32 x = tid + u * ATT_THREADS;
        if (x < BLOCK_TOKENS * CPR) {
            vdst[swz(x / CPR, x % CPR)] = vr[u];
            if (t.fill) t.cslot[BLOCK_TOKENS * CPR + x] = vr[u];
        }
    }
    __syncthreads();
    // Every byte of the tile has arrived and the rest is arithmetic: once all of this grid's
    // thread blocks are here, the next kernel may start its reads (common.cuh).
    pdl_trigger();

    // Values: warp w takes dims [16 m, 16 m + 16) for m = w, w + ATT_WARPS, ...
    const u32 sv = sk + BLOCK_TOKENS * CPR * 16;
    for (u32 m = warp; m < HEAD_DIM / 16; m += ATT_WARPS) {
        float ch[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
        for (u32 ks = 0; ks < BLOCK_TOKENS / 16; ++ks) {
            u32 a[4];
            ldsm_x4_t(sv + swz(ks * 16 + (lane & 7u) + (mi >> 1) * 8, 2 * m + (mi & 1u)) * 16, a);
            u32 b0h = 0, b0l = 0, b1h = 0, b1l = 0;
            if (g8 < GROUP) {
                const float2 p0 = *(const float2*)&s_p[g8][ks * 16 + 2 * tig];
                const float2 p1 = *(const float2*)&s_p[g8][ks * 16 + 8 + 2 * tig];
                split_bf16(p0.x, p0.y, b0h, b0l);
                split_bf16(p1.x, p1.y, b1h, b1l);
            }
            mma_bf16(ch, a, b0h, b1h);
            mma_bf16(cl, a, b0l, b1l);
        }
        // Accumulator e: dim 16 m + g8 (+ 8 for e >= 2), head 2 tig + (e & 1).
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 h = 2 * tig + (e & 1);
            if (h < GROUP) part_acc[(pbase + h) * HEAD_DIM + m * 16 + g8 + (e >> 1) * 8] = ch[e] + cl[e];
        }
    }
#else
    __shared__ float s_q[GROUP][HEAD_DIM];
#if RED_IN_TILE
    // The K half of the tile is dead once scores are computed; the value phase reduces there.
    float* s_red = (float*)s_tile;
#else
    float* s_red = (float*)(s_tile + 2 * BLOCK_TOKENS * CPR);
#endif

    const u32 nvalid = t.nvalid;
#if V_EARLY
    uint4 kr[V_EARLY_LOADS], vr[V_EARLY_LOADS];
    load_tile_regs(t, kr, vr);
#pragma unroll
    for (int u = 0; u < V_EARLY_LOADS; ++u) {
        const u32 x = tid + u * ATT_THREADS;
        if (x < nvalid * CPR) s_tile[x] = kr[u];
    }
#else
    stage_rows(s_tile, t.from, nvalid);
    stage_rows(s_tile + BLOCK_TOKENS * CPR, t.from + BLOCK_TOKENS * CPR, nvalid);
#endif
    pdl_wait();
    for (u32 x = tid; x < GROUP * HEAD_DIM; x += ATT_THREADS) s_q[x / HEAD_DIM][x % HEAD_DIM] = qh[x];
    __syncthreads();
#if V_EARLY
    if (t.fill)
        for (u32 v = tid; v < BLOCK_TOKENS * CPR; v += ATT_THREADS) t.cslot[v] = s_tile[v];
#else
    if (t.fill)
        for (u32 v = tid; v < 2 * BLOCK_TOKENS * CPR; v += ATT_THREADS) t.cslot[v] = s_tile[v];
#endif
    const uint4* kt = s_tile;
    const uint4* vt = s_tile + BLOCK_TOKENS * CPR;

    // Scores: RG lanes per K row; loop bounds are warp-uniform so the shuffles stay converged.
    const u32 sub = lane / RG;
    const u32 rl = lane % RG;
#if ATT_QREG
    float qr[CPL][GROUP][VEC];
#pragma unroll
    for (int cc = 0; cc < CPL; ++cc)
#pragma unroll
        for (int g = 0; g < GROUP; ++g)
#pragma unroll
            for (int v = 0; v < VEC; ++v) qr[cc][g][v] = s_q[g][(rl + cc * RG) * VEC + v];
#define QV(cc, c, g, v) qr[cc][g][v]
#else
#define QV(cc, c, g, v) s_q[g][(c) * VEC + (v)]
#endif
    for (u32 r0 = warp * ROWS_PER_WARP; r0 < nvalid; r0 += ATT_WARPS * ROWS_PER_WARP) {
        const u32 r = r0 + sub;
        const bool ok = r < nvalid;
        float acc[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) acc[g] = 0.0f;
        if (ok) {
#pragma unroll
            for (int cc = 0; cc < CPL; ++cc) {
                const u32 c = rl + cc * RG;
                float kf[VEC];
                unpack16(kt[(u64)r * CPR + c], kf);
#pragma unroll
                for (int g = 0; g < GROUP; ++g)
#pragma unroll
                    for (int v = 0; v < VEC; ++v) acc[g] += QV(cc, c, g, v) * kf[v];
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g)
#pragma unroll
            for (int o = RG / 2; o > 0; o >>= 1) acc[g] += __shfl_xor_sync(FULL_MASK, acc[g], o);
        if (ok && rl == 0) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g) s_p[g][r] = acc[g] * scale;
        }
    }
#undef QV
    __syncthreads();

    tile_softmax(s_p, s_m, s_l, nvalid, nvalid);
    __syncthreads();

#if V_EARLY
    {
        uint4* vdst = s_tile + BLOCK_TOKENS * CPR;
#pragma unroll
        for (int u = 0; u < V_EARLY_LOADS; ++u) {
            const u32 x = tid + u * ATT_THREADS;
            if (x < nvalid * CPR) {
                vdst[x] = vr[u];
                if (t.fill) t.cslot[BLOCK_TOKENS * CPR + x] = vr[u];
            }
        }
    }
    __syncthreads();
#endif
    pdl_trigger();
    // Values: thread owns chunk c of the row and every SLICES-th row.
    {
        const u32 c = tid % CPR;
        const u32 slice = tid / CPR;
        float acc[GROUP][VEC];
#pragma unroll
        for (int g = 0; g < GROUP; ++g)
#pragma unroll
            for (int v = 0; v < VEC; ++v) acc[g][v] = 0.0f;
        for (u32 r = slice; r < nvalid; r += SLICES) {
            float vf[VEC];
            unpack16(vt[(u64)r * CPR + c], vf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float p = s_p[g][r];
#pragma unroll
                for (int v = 0; v < VEC; ++v) acc[g][v] += p * vf[v];
            }
        }
        // Lanes CPR apart hold the same chunk of different slices: fold them first.
#pragma unroll
        for (int o = CPR; o < 32; o <<= 1)
#pragma unroll
            for (int g = 0; g < GROUP; ++g)
#pragma unroll
                for (int v = 0; v < VEC; ++v) acc[g][v] += __shfl_xor_sync(FULL_MASK, acc[g][v], o);
        if (slice % WSL == 0) {
#pragma unroll
            for (int g = 0; g < GROUP; ++g)
#pragma unroll
                for (int v = 0; v < VEC; ++v)
                    s_red[(slice / WSL) * GROUP * HEAD_DIM + g * HEAD_DIM + c * VEC + v] = acc[g][v];
        }
    }
    __syncthreads();
    for (u32 x = tid; x < GROUP * HEAD_DIM; x += ATT_THREADS) {
        float s = 0.0f;
#pragma unroll
        for (int sl = 0; sl < RSL; ++sl) s += s_red[sl * GROUP * HEAD_DIM + x];
        part_acc[pbase * HEAD_DIM + x] = s;
    }
#endif
    tile_write_ml(part_ml, pbase, s_m, s_l);
}

// grid (KSEL or TOPK, KV_HEADS, batch), block ATT_THREADS, dynamic shared memory ATT_DYN_SMEM
// bytes. `part` 0 attends the fixed part of each keep-set (plan_fixed: sink and local, or all
// of a short layer; grid.x = KSEL) and runs on a second stream while the selector scores;
// `part` 1 attends the TOPK distant tiles (grid.x = TOPK) after select_score, when the
// selector is not fused with it (layer_fused, select.cu).
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attend_tile(AttendTileParams_FIELDS) {
    K_TRACE(1 + 2 * part);
    const u32 kvh = blockIdx.y;
    const u32 i = blockIdx.z;
    const u32 x = blockIdx.x;
    // Table position of this thread block's tile (layout in gather.cu) in a long layer (jl,
    // when x is in range) and in a short one (x: the fixed part is all nb blocks). Which
    // applies is known once ntok[i] arrives, but both entries are requested beside it (in
    // bounds either way: grid.x <= KSEL): waiting for the count first, then the entry, then
    // the session slot put three memory round trips before every tile's load. The entry that
    // does not apply is discarded unread; it may be one the other stream's kernel is writing
    // (the selector's distant positions, or a short layer's plan), which is harmless for a
    // value never used.
    const bool in_long = part == 0 ? x < SINK + LOCAL : x < TOPK;  // grid.x is at least 1
    const u32 jl = in_long ? (part == 0 ? (x < SINK ? x : x + TOPK) : SINK + x) : 0;
    const u64 el = (u64)(i * KV_HEADS + kvh) * KSEL + jl;
    const u64 es = (u64)(i * KV_HEADS + kvh) * KSEL + x;
    const u32 nt = ntok[i];
    const u32 sslot = sess[i];
    const u32 bl = table[el], bs = table[es];
    const u32 cl = slot_of[el], cs = slot_of[es];
    const u64 ml = miss_src[el], ms = miss_src[es];
    const u32 nb = n_blocks_of(nt);
    if (SHORT_LAYER(nb)) {
        // plan_fixed's count for a short layer is nb.
        if (part != 0 || x >= nb) return;
        attend_one(q, nt, sslot, layer, cache, scale, part_acc, part_ml, i, kvh, x, bs, cs, ms);
    } else {
        if (!in_long) return;
        attend_one(q, nt, sslot, layer, cache, scale, part_acc, part_ml, i, kvh, jl, bl, cl, ml);
    }
}

// Dense attention, the baseline the sparse path is measured against (gpu_bench): every block of
// the layer, no selector and no block cache. attend_dense: grid (max_nb, KV_HEADS, batch), block
// ATT_THREADS, dynamic shared memory ATT_DYN_SMEM; the tile of block b is read at
// pages[sess][layer][b] + kvh * TILE_BYTES, a device address of GPU memory or of mapped host
// memory, and its partial goes to row entry b (rows of max_blocks entries).
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attend_dense(AttendDenseParams_FIELDS) {
    const u32 b = blockIdx.x, kvh = blockIdx.y, i = blockIdx.z;
    const u32 nt = ntok[i];
    if (b >= n_blocks_of(nt)) return;
    const u64 src = pages[((u64)sess[i] * NUM_LAYERS + layer) * max_blocks + b] + (u64)kvh * TILE_BYTES;
    attend_one(q, nt, 0, layer, nullptr, scale, part_acc, part_ml, i, kvh, b, b, 0, src, max_blocks);
}

// Online log-sum-exp fold of partial (m, l, acc) into (M, L, A); an empty partial (l = 0) is
// skipped, so -inf maxima never meet.
__device__ __forceinline__ void fold_partial(float m, float l, float acc, float& M, float& L, float& A) {
    if (l == 0.0f) return;
    const float nm = fmaxf(M, m);
    const float a = L == 0.0f ? 0.0f : expf(M - nm), c = expf(m - nm);
    L = L * a + l * c;
    A = A * a + acc * c;
    M = nm;
}

// attend_dense's merge in two steps (one thread block per query head would walk up to max_blocks
// partials alone). dense_merge_part: grid (HQ, batch, splits), block HEAD_DIM; folds the
// partials of blocks [z * per, (z + 1) * per) into stage (m, l) [batch][HQ][splits][2] and
// stage acc [batch][HQ][splits][HEAD_DIM].
extern "C" __global__ void dense_merge_part(DenseMergePartParams_FIELDS) {
    const u32 h = blockIdx.x, i = blockIdx.y, z = blockIdx.z, splits = gridDim.z;
    const u32 kvh = h / GROUP, g = h % GROUP, d = threadIdx.x;
    const u32 n = n_blocks_of(ntok[i]);
    const u32 per = (n + splits - 1) / splits;
    const u32 j0 = min(n, z * per), j1 = min(n, j0 + per);
    const u64 row = (u64)(i * KV_HEADS + kvh) * max_blocks;
    float M = NEG_INF, L = 0.0f, A = 0.0f;
    for (u32 j = j0; j < j1; ++j) {
        const u64 e = (row + j) * GROUP + g;
        const float2 ml = *(const float2*)&part_ml[e * 2];
        fold_partial(ml.x, ml.y, part_acc[e * HEAD_DIM + d], M, L, A);
    }
    const u64 o = ((u64)i * HQ + h) * splits + z;
    st_acc[o * HEAD_DIM + d] = A;
    if (d == 0) {
        st_ml[o * 2] = M;
        st_ml[o * 2 + 1] = L;
    }
}

// dense_merge_out: grid (HQ, batch), block HEAD_DIM; folds the `splits` stage partials into out
// [batch][HQ][HEAD_DIM].
extern "C" __global__ void dense_merge_out(DenseMergeOutParams_FIELDS) {
    const u32 h = blockIdx.x, i = blockIdx.y, d = threadIdx.x;
    float M = NEG_INF, L = 0.0f, A = 0.0f;
    for (u32 z = 0; z < splits; ++z) {
        const u64 o = ((u64)i * HQ + h) * splits + z;
        fold_partial(st_ml[o * 2], st_ml[o * 2 + 1], st_acc[o * HEAD_DIM + d], M, L, A);
    }
    out[((u64)i * HQ + h) * HEAD_DIM + d] = A / L;
}

// copy_runs: grid (blocks, layers), block 256; copies block run (layer, b) of a session, its
// KV_HEADS tiles (run_vecs 16-byte vectors), from from[layer][b] to to[layer][b] (device
// addresses: the page-table rows of one session slot; a 0 in `to` skips the block).
extern "C" __global__ void __launch_bounds__(256) copy_runs(CopyRunsParams_FIELDS) {
    const u32 b = blockIdx.x, l = blockIdx.y;
    if (b >= n_blocks) return;
    const u64 e = (u64)l * max_blocks + b;
    if (to[e] == 0) return;  // past this layer's blocks
    const uint4* __restrict__ src = (const uint4*)from[e];
    uint4* __restrict__ dst = (uint4*)to[e];
    // Eight loads in flight per thread before their stores: host reads are ~2 us round trips.
    for (u64 v0 = threadIdx.x; v0 < run_vecs; v0 += 256 * 8) {
        uint4 r[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const u64 v = v0 + u * 256;
            r[u] = v < run_vecs ? src[v] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const u64 v = v0 + u * 256;
            if (v < run_vecs) dst[v] = r[u];
        }
    }
}

// The log-sum-exp over shared x[0, n), by the block's first warp between two barriers (every
// thread of the block calls it): *M = the largest x, each x[j] becomes exp(x[j] - *M), and
// *L = sum_j w[j] exp(x[j] - *M) (w null: weights 1).
__device__ __forceinline__ void block_lse(float* x, const float* w, u32 n, float* M, float* L) {
    __syncthreads();
    const u32 lane = threadIdx.x;
    if (lane < 32) {
        float m = NEG_INF;
        for (u32 j = lane; j < n; j += 32) m = fmaxf(m, x[j]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
        float l = 0.0f;
        for (u32 j = lane; j < n; j += 32) {
            const float e = expf(x[j] - m);
            l += (w != nullptr ? w[j] : 1.0f) * e;
            x[j] = e;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(FULL_MASK, l, o);
        if (lane == 0) {
            *M = m;
            *L = l;
        }
    }
    __syncthreads();
}

// The tail partial of attend_merge's thread block (session i, query head h of kv head kvh):
// rows 0..=tail_last[i] of the session's tail, scores q . k * scale with each thread scoring
// whole rows (16-byte loads), then (m, l) and this thread's dimension d of
// acc = sum_t exp(s_t - m) v_t. Every thread of the block calls it. An engine's tail is at
// most one block of tokens, so it costs about as much as merging one more partial, and the
// engine needs no kernels of its own for it (they were ~20 small launches per layer).
__device__ __forceinline__ void tail_partial(const float* __restrict__ q, const elem_t* __restrict__ tail_kv,
                                             long long last, float scale, u32 i, u32 h, u32 kvh,
                                             float& t_m, float& t_l, float& t_acc) {
    __shared__ float s_q[HEAD_DIM];
    __shared__ float s_p[BLOCK_TOKENS];
    __shared__ float s_tm;
    __shared__ float s_tl;
    const u32 d = threadIdx.x;
    const u32 c = last < 0 ? 0u : last >= BLOCK_TOKENS ? (u32)BLOCK_TOKENS : (u32)last + 1;
    s_q[d] = q[((u64)i * HQ + h) * HEAD_DIM + d];
    __syncthreads();
    const elem_t* tk = tail_kv + ((u64)i * KV_HEADS + kvh) * 2 * BLOCK_TOKENS * HEAD_DIM;
    for (u32 t = d; t < c; t += blockDim.x) {
        const uint4* row = (const uint4*)(tk + (u64)t * HEAD_DIM);
        float s = 0.0f;
#pragma unroll 4
        for (int x = 0; x < CPR; ++x) {
            float f[VEC];
            unpack16(row[x], f);
#pragma unroll
            for (int e = 0; e < VEC; ++e) s += s_q[x * VEC + e] * f[e];
        }
        s_p[t] = s * scale;
    }
    block_lse(s_p, nullptr, c, &s_tm, &s_tl);
    const elem_t* tv = tk + (u64)BLOCK_TOKENS * HEAD_DIM + d;
    float acc = 0.0f;
#pragma unroll 4
    for (u32 t = 0; t < c; ++t) acc += s_p[t] * elem_to_f32(tv[(u64)t * HEAD_DIM]);
    t_m = s_tm;
    t_l = s_tl;
    t_acc = acc;
}

// grid (HQ, batch), block HEAD_DIM threads. out: [batch][HQ][HEAD_DIM] f32.
// The (m, l) pairs are loaded in parallel into shared memory first: a serial chain of
// dependent global loads made this kernel 12 us long.
extern "C" __global__ void attend_merge(AttendMergeParams_FIELDS) {
    K_TRACE(4);
    // The next layer's first kernel may start now (its reads of host frames overlap this
    // merge); this one's inputs are complete once the previous kernel is.
    pdl_trigger();
    pdl_wait();
    const u32 h = blockIdx.x;
    const u32 i = blockIdx.y;
    const u32 kvh = h / GROUP;
    const u32 g = h % GROUP;
    const u32 ih = i * KV_HEADS + kvh;
    const u32 n = counts[ih];
    const u32 d = threadIdx.x;
    __shared__ float s_w[KSEL];
    __shared__ float s_l[KSEL];
    __shared__ float s_L;
    __shared__ float s_M;
    const float* acc_of = part_acc + ((u64)ih * KSEL * GROUP + g) * HEAD_DIM + d;  // + j * GROUP * HEAD_DIM
#if KSEL <= 64
    // Every partial's value is loaded up front (independent loads in flight together): a
    // loop of dependent rounds made this kernel several microseconds long.
    float pa[KSEL];
#pragma unroll
    for (int j = 0; j < KSEL; ++j) pa[j] = (u32)j < n ? acc_of[(u64)j * GROUP * HEAD_DIM] : 0.0f;
#endif
    for (u32 j = d; j < n; j += blockDim.x) {
        const float2 ml = *(const float2*)&part_ml[(((u64)ih * KSEL + j) * GROUP + g) * 2];
        s_w[j] = ml.x;
        s_l[j] = ml.y;
    }
    block_lse(s_w, s_l, n, &s_M, &s_L);
    float acc = 0.0f;
#if KSEL <= 64
#pragma unroll
    for (int j = 0; j < KSEL; ++j)
        if ((u32)j < n) acc += pa[j] * s_w[j];
#else
#pragma unroll 4
    for (u32 j = 0; j < n; ++j) acc += acc_of[(u64)j * GROUP * HEAD_DIM] * s_w[j];
#endif
    float M = s_M, L = s_L;
    if (tail_kv != nullptr) {
        float t_m, t_l, t_acc;
        tail_partial(q, tail_kv, tail_last[i], scale, i, h, kvh, t_m, t_l, t_acc);
        if (t_l > 0.0f) {  // not an empty tail
            const float m2 = fmaxf(M, t_m);
            const float a = expf(M - m2), b = expf(t_m - m2);
            acc = acc * a + t_acc * b;
            L = L * a + t_l * b;
            M = m2;
        }
    }
    out[((u64)i * HQ + h) * HEAD_DIM + d] = acc / L;
    // The output's log-sum-exp (of the scaled scores), for an engine that merges this layer's
    // attention with attention over tokens it holds itself.
    if (lse != nullptr && d == 0) lse[(u64)i * HQ + h] = M + logf(L);
}
