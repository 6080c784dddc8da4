// Block selector: bounds scoring and the per-kv-head top-k.
//
// Bit-exactness with the CPU selector (kvtier_kernels::simd::bound_dot + select::block_score):
// each score is summed in the CPU's exact order: element d of max(q[d]*k_max[d], q[d]*k_min[d])
// is added to lane d % 8 (8 accumulators, increasing d), then the lanes are folded as
// ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) (simd.rs `reduce`). Multiplies and adds are explicit
// round-to-nearest (__fmul_rn/__fadd_rn are never contracted into FMAs). The max over the G
// query heads is order-independent. So scores are bit-identical, and ties are broken by lower
// block index in both implementations.
//
// top_k <= 32 or the sketch selector (TOPK_MERGE): one kernel per layer, select_score, scores,
// keeps each thread block's LW best candidates and merges them in the last thread block of
// each kv head, which also plans the distant tiles. Otherwise select_score writes every score
// and select_topk runs a radix select and the plan.
//
// The sketch selector (SKETCH, kvtier_kernels::select): select_score scores each block by its
// QUARTERS quarter records (bf16 bounds, the same arithmetic per record; the block's score is
// the max over its quarters and the group) and its last thread block per kv head keeps the
// CAND best as candidates instead of the keep-set; select_rerank (a rerank role of
// layer_fused) scores each candidate by its key sketch and the last one per kv head keeps the
// TOPK best and plans their tiles.

#if SUM_BF16
typedef unsigned short sum_t;
#else
typedef float sum_t;
#endif

// Summary records per (block, kv head): its quarters with the sketch selector, else one.
#if SKETCH
#define SUB QUARTERS
#if SUB != 1 && SUB != 2 && SUB != 4
#error "the sketch selector scores 1, 2 or 4 quarter records per block"
#endif
// The first stage ranks units of four records, UNIT_BLOCKS blocks (kvtier_kernels::select::
// unit_blocks): a unit is the four octets of one warp. CAND counts candidate blocks, the
// blocks of CAND_UNITS units (config.rs).
#define UNIT_BLOCKS (4 / SUB)
#define CAND_UNITS (CAND / UNIT_BLOCKS)
#if CAND % UNIT_BLOCKS != 0
#error "CAND must be whole units"
#endif
// A layer of at most SCAN_UNITS distant units skips the first stage: every distant unit is a
// candidate (kvtier_kernels::select::scan_units; SCAN blocks). A (batch item, kv head)'s
// candidate units are CANDW apart in cands.
#define SCAN_UNITS (SCAN / UNIT_BLOCKS)
#if SCAN % UNIT_BLOCKS != 0 || SCAN < CAND || CANDW < SCAN_UNITS
#error "SCAN must be whole units, at least CAND, and fit CANDW"
#endif
// The distant units of a layer of nb blocks (nb > KSEL): SINK / UNIT_BLOCKS and the ones after
// it (kvtier_kernels::select::distant_units).
__device__ __forceinline__ u32 distant_units(u32 nb) {
    return (nb - LOCAL - 1) / UNIT_BLOCKS + 1 - SINK / UNIT_BLOCKS;
}
// A quarter record: its int8 maxima codes [HEAD_DIM], then its minima codes; thread j of the
// scoring octet takes dims [j * HEAD_DIM / 8, (j + 1) * HEAD_DIM / 8) of both, QW u32 words
// each. One f32 scale per (block, kv head) beside them (qscales).
#define QW (HEAD_DIM / 32)
#define QREC_WORDS (HEAD_DIM / 2)  // u32 words of one quarter record
#if HEAD_DIM % 32 != 0
#error "the sketch selector's quarter codes need HEAD_DIM a multiple of 32"
#endif
#else
#define SUB 1
#endif

// The sketch selector's int8 query code of one element (kvtier_kernels::select::quantize_query:
// round half to even of x / scale, clamped; 0 when the scale is 0).
__device__ __forceinline__ int q_code(float x, float qs) {
    return qs == 0.0f ? 0 : (int)fminf(fmaxf(rintf(__fdiv_rn(x, qs)), -127.0f), 127.0f);
}

// The scale of one query head's codes, max |x| / 127, by one whole warp (every lane gets it).
__device__ __forceinline__ float q_scale_warp(const float* qh) {
    const u32 lane = threadIdx.x & 31u;
    float amax = 0.0f;
    for (u32 d = lane; d < HEAD_DIM; d += 32) amax = fmaxf(amax, fabsf(qh[d]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
    return __fdiv_rn(amax, 127.0f);
}
// layer_fused's ready flags per (batch item, kv head): 0 the fixed part is planned, 1 the
// distant part is planned, 2 the sketch selector's candidates are written.
#define READY_FLAGS 3


// The CPU's lane fold (kvtier_kernels::simd::reduce), ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)),
// across an octet whose thread j holds lane j: xor 4 forms l_j + l_{j+4}, xor 2 pairs those
// as (t0+t2) and (t1+t3), xor 1 adds the two. IEEE addition is commutative, so every thread of
// the octet ends with the CPU's sum, bit for bit.
__device__ __forceinline__ float octet_reduce(float a) {
    a = __fadd_rn(a, __shfl_xor_sync(FULL_MASK, a, 4));
    a = __fadd_rn(a, __shfl_xor_sync(FULL_MASK, a, 2));
    return __fadd_rn(a, __shfl_xor_sync(FULL_MASK, a, 1));
}

// Device summary layout (CudaBackend::upload_summaries): the record of one (block, kv head)
// holds its 2 * HEAD_DIM bounds arranged for the scorer below, where thread j of an octet owns
// the CPU's lane j (dims d = j + 8s, s < SEL_S). Lane j's values are (max, min) pairs in
// increasing s, SEL_P pairs per 16-byte vector; vector u of lane j is the record's vector
// u * 8 + j, so one warp load reads whole 128-byte lines of four records.
#define SEL_S (HEAD_DIM / 8)
#if SUM_BF16
#define SEL_P 4
#else
#define SEL_P 2
#endif
#define SEL_V (SEL_S / SEL_P)  // 16-byte vectors per lane per record
#define REC_VECS (8 * SEL_V)   // 16-byte vectors per record
#if SEL_V < 1
#error "HEAD_DIM too small for the summary layout"
#endif

// Unpacks one 16-byte vector of summary values into 2 * SEL_P floats: (max, min) pairs.
__device__ __forceinline__ void unpack_sums(const uint4 v, float* out) {
#if SUM_BF16
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        out[2 * k] = bf16_bits_to_f32(w[k] & 0xffffu);
        out[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
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

// Two-stage top-k (config.rs sets TOPK_MERGE: TOPK <= 32, or the sketch selector's units <=
// 128). Each select_score thread block reduces its blocks to its LW best candidates, a
// descending list; the kv head's last thread block merges the lists. A candidate is a 64-bit
// key: the score's order-preserving bits above the complemented block id, so a larger key is a
// better block and equal scores prefer the lower block (the CPU's tie rule); 0 is "no
// candidate" and below every real key. The global top-N (N <= LW) under this strict order is
// the top-N of the union of the lists' top-LWs, so the result is the radix select's exactly.
// Every step is a warp-wide bitonic network (shuffles and registers, no barriers) except one
// barrier per merge level: the radix version spent ~20 us at 1M tokens on a chain of barriers
// in one thread block per kv head (bench/gpu/NOTES.md v10, v13).
//
// A list is LW = 32 * LIST_R keys held by one warp, LIST_R per lane: element e = r * 32 + lane
// is register r of lane `lane`. Network steps of stride >= 32 compare two registers of one
// lane; shorter strides shuffle.
#define LW (32 * LIST_R)
#if LIST_R != 1 && LIST_R != 2 && LIST_R != 4
#error "LIST_R must be 1, 2 or 4"
#endif
__device__ __forceinline__ u64 cand_key(float score, u32 b) {
    return ((u64)orderable(score) << 32) | (u64)(~b);
}

__device__ __forceinline__ u64 shfl_xor64(u64 v, int m) {
    const u32 lo = __shfl_xor_sync(FULL_MASK, (u32)v, m);
    const u32 hi = __shfl_xor_sync(FULL_MASK, (u32)(v >> 32), m);
    return ((u64)hi << 32) | lo;
}

// One compare-exchange step of stride j over the warp's list of 32 * R keys: element e keeps
// the larger of (e, e ^ j) when `desc(e)`, else the smaller.
#define LIST_STEP_R(v, j, desc, R)                                                     \
    do {                                                                               \
        if ((j) >= 32) {                                                               \
            const u32 jr_ = (j) >> 5;                                                  \
            _Pragma("unroll") for (u32 r_ = 0; r_ < (R); ++r_) {                       \
                if ((r_ & jr_) == 0) {                                                 \
                    const u32 e_ = r_ * 32 + lane;                                     \
                    const u64 a_ = v[r_], b_ = v[r_ | jr_];                            \
                    const u64 hi_ = a_ > b_ ? a_ : b_, lo_ = a_ > b_ ? b_ : a_;        \
                    v[r_] = (desc) ? hi_ : lo_;                                        \
                    v[r_ | jr_] = (desc) ? lo_ : hi_;                                  \
                }                                                                      \
            }                                                                          \
        } else {                                                                       \
            _Pragma("unroll") for (u32 r_ = 0; r_ < (R); ++r_) {                       \
                const u32 e_ = r_ * 32 + lane;                                         \
                const u64 p_ = shfl_xor64(v[r_], (j));                                 \
                const bool take_max_ = ((e_ & (j)) == 0) == (desc);                    \
                v[r_] = take_max_ ? (v[r_] > p_ ? v[r_] : p_) : (v[r_] < p_ ? v[r_] : p_); \
            }                                                                          \
        }                                                                              \
    } while (0)
#define LIST_STEP(v, j, desc) LIST_STEP_R(v, j, desc, LIST_R)

// Sorts the warp's list of 32 * R keys descending (element 0, register 0 of lane 0, is the
// largest).
template <u32 R>
__device__ __forceinline__ void list_sort_desc_r(u64* v) {
    const u32 lane = threadIdx.x & 31u;
#pragma unroll
    for (u32 k = 2; k <= 32 * R; k <<= 1) {
#pragma unroll
        for (u32 j = k >> 1; j > 0; j >>= 1) {
            // Runs of k elements alternate direction; the last (k = 32 R) is one descending run.
            LIST_STEP_R(v, j, (e_ & k) == 0, R);
        }
    }
}
__device__ __forceinline__ void list_sort_desc(u64* v) { list_sort_desc_r<LIST_R>(v); }

// The top LW of two descending lists into `a`, descending. `b_rev` holds the second list
// reversed (element e: its element LW - 1 - e), so max(a, b_rev) is a bitonic sequence holding
// the top LW of both, which one bitonic merge sorts.
__device__ __forceinline__ void list_merge_desc(u64* a, const u64* b_rev) {
    const u32 lane = threadIdx.x & 31u;
#pragma unroll
    for (u32 r = 0; r < LIST_R; ++r) a[r] = a[r] > b_rev[r] ? a[r] : b_rev[r];
#pragma unroll
    for (u32 j = LW >> 1; j > 0; j >>= 1) LIST_STEP(a, j, true);
}

// Loads list `src` (LW keys) into the warp, or reversed; keys past `ok` are 0.
__device__ __forceinline__ void list_load(u64* v, const u64* src, bool ok, bool reversed, bool l2) {
    const u32 lane = threadIdx.x & 31u;
#pragma unroll
    for (u32 r = 0; r < LIST_R; ++r) {
        const u32 e = reversed ? LW - 1 - (r * 32 + lane) : r * 32 + lane;
        v[r] = ok ? (l2 ? __ldcg(src + e) : src[e]) : 0ull;
    }
}

__device__ __forceinline__ void list_store(const u64* v, u64* dst) {
    const u32 lane = threadIdx.x & 31u;
#pragma unroll
    for (u32 r = 0; r < LIST_R; ++r) dst[r * 32 + lane] = v[r];
}

// The ids of the N best keys of the warp's descending list of 32 * R keys, ascending, into
// out[0, N) (a key of 0, no candidate, comes out as 0xffffffff, after every real block).
template <u32 R>
__device__ __forceinline__ void list_ids_ascending_r(const u64* v, u32* out, u32 N) {
    const u32 lane = threadIdx.x & 31u;
    // Winners' complemented ids (the low key word) sorted descending = ids ascending.
    u64 id[R];
#pragma unroll
    for (u32 r = 0; r < R; ++r) id[r] = r * 32 + lane < N ? (u64)(u32)v[r] : 0ull;
    list_sort_desc_r<R>(id);
#pragma unroll
    for (u32 r = 0; r < R; ++r)
        if (r * 32 + lane < N) out[r * 32 + lane] = ~(u32)id[r];
}
__device__ __forceinline__ void list_ids_ascending(const u64* v, u32* out, u32 N) {
    list_ids_ascending_r<LIST_R>(v, out, N);
}

// The top LW keys of `nlists` descending lists into warp 0's `v`, descending, called by a whole
// thread block that found itself last. Each warp merges lists w, w + nw, ... (the next list's
// load in flight during a merge); a barrier-separated tree merges the warps' lists. Lists are
// read from L2 (__ldcg): other thread blocks wrote them during this launch.
__device__ __forceinline__ void merge_lists(const u64* __restrict__ lists, u32 nlists, u64* v) {
    __shared__ u64 s_top[SCORE_THREADS / 32][LW];
    const u32 w = threadIdx.x >> 5;
    const u32 nw = blockDim.x >> 5;
    u64 nxt[LIST_R], cur[LIST_R];
    list_load(v, lists + (u64)w * LW, w < nlists, false, true);
    list_load(nxt, lists + (u64)(w + nw) * LW, w + nw < nlists, true, true);
    for (u32 x = w + nw; x < nlists; x += nw) {
#pragma unroll
        for (u32 r = 0; r < LIST_R; ++r) cur[r] = nxt[r];
        if (x + nw < nlists) list_load(nxt, lists + (u64)(x + nw) * LW, true, true, true);
        list_merge_desc(v, cur);
    }
    list_store(v, s_top[w]);
    __syncthreads();
    // Level s: warp w (a multiple of 2s) takes in warp w + s's list (written at level s / 2).
    for (u32 s = 1; s < nw; s <<= 1) {
        if ((w & (2 * s - 1)) == 0 && w + s < nw && w + s < nlists) {
            list_load(cur, s_top[w + s], true, true, false);
            list_merge_desc(v, cur);
            list_store(v, s_top[w]);
        }
        __syncthreads();
    }
}

// The N best blocks (N <= LW) of `nlists` candidate lists of one (batch item, kv head),
// ascending, into out[0, N) (merge_lists, then warp 0 sorts the winners' block ids).
__device__ __forceinline__ void select_distant_merge(const u64* __restrict__ lists, u32 nlists, u32* out, u32 N) {
    u64 v[LIST_R];
    merge_lists(lists, nlists, v);
    if ((threadIdx.x >> 5) == 0) list_ids_ascending(v, out, N);
}

// select_score: SCORE_THREADS threads = SCORE_OCTETS octets; octet o of thread block x scores
// records x * nbo * SCORE_OCTETS + n * SCORE_OCTETS + o for n < nbo (nbo <= SCORE_NB, chosen
// per launch so that small contexts still spread over many SMs); record r is quarter r % SUB
// of block r / SUB, so the SUB records of a block are consecutive octets of one warp.
#define SCORE_OCTETS (SCORE_THREADS / 8)
// Candidate lists per (batch item, kv head) for nr records: one per select_score thread block.
#define SCORE_LISTS(nr, nbo) (((nr) + (nbo) * SCORE_OCTETS - 1) / ((nbo) * SCORE_OCTETS))
// The lists are merged in two levels: the last thread block of each group of MERGE_GROUP
// consecutive lists merges the group into one list, the last group the groups' lists. One
// thread block merging every list spent ~35 us at 1M tokens in 64-token blocks with 128
// candidates (256 lists of 128 keys); merges of groups run in parallel. (With one group, its
// last thread block is the kv head's.) The result is the same: the top-N of a union is the
// top-N of its parts' top-Ns under the strict key order.
#define MERGE_GROUPS(nlists) (((nlists) + MERGE_GROUP - 1) / MERGE_GROUP)
#define SEL_PREFETCH (SEL_V <= 8)
#if (SCORE_OCTETS * SCORE_NB) % 32 != 0 || SCORE_OCTETS * SCORE_NB / 32 > SCORE_THREADS / 32
#error "SCORE_NB blocks per octet must make whole warp lists"
#endif


#if SKETCH
// The sketch selector's first stage in one score role: key[n] of octet row n (a quarter
// record), as kvtier_kernels::select::QuerySketch::quarter_score computes it: per query head
// the integer bound of the quarter, sum_d pos_d * max_d + neg_d * min_d over its int8 codes
// (dp4a, exact; the octet's lanes summed in any order), the max over the block's quarters (the
// warp's four octets), then f32 * the block's scale * the head's scale (rounded) and the max
// over the group, then the max over the unit's distant blocks (the warp's octets, in floats:
// each block has its own scale). Each unit's key comes from its first record's octet.
__device__ __forceinline__ void score_keys_sketch(const float* __restrict__ q, const sum_t* __restrict__ sums,
                                                  const float* __restrict__ qscales, const u32* __restrict__ sess,
                                                  u32 layer, u32 max_blocks, u32 nbo, u32 i, u32 kvh, u32 nb, u32 nr,
                                                  u32 r0, u64* key) {
    const u32 tid = threadIdx.x;
    const u32 j = tid & 7u;
    const u32 oct = tid >> 3;
    const u32 lane = tid & 31u;
    const u32 w = tid >> 5;
    const u64 srow = (u64)sess[i] * NUM_LAYERS + layer;
    const u32* recs = (const u32*)sums + srow * (u64)max_blocks * KV_HEADS * SUB * QREC_WORDS;
    const float* bsc = qscales + srow * (u64)max_blocks * KV_HEADS;
    // Loads octet row n's record (this thread's QW words of its maxima and of its minima) and
    // its block's scale; zeros past the layer or this launch's rows (predicated loads).
    auto load = [&](u32 n, u32* hi, u32* lo, float* sc) {
        const u32 rec = r0 + n * SCORE_OCTETS + oct;
        const bool ok = rec < nr && n < nbo;
        const u64 blk = (u64)(rec / SUB) * KV_HEADS + kvh;
        const u32* r = recs + (blk * SUB + rec % SUB) * QREC_WORDS + j * QW;
#if QW % 4 == 0
#pragma unroll
        for (int u = 0; u < QW; u += 4) {
            const uint4 h = ok ? __ldg((const uint4*)(r + u)) : make_uint4(0u, 0u, 0u, 0u);
            const uint4 l = ok ? __ldg((const uint4*)(r + HEAD_DIM / 4 + u)) : make_uint4(0u, 0u, 0u, 0u);
            hi[u] = h.x; hi[u + 1] = h.y; hi[u + 2] = h.z; hi[u + 3] = h.w;
            lo[u] = l.x; lo[u + 1] = l.y; lo[u + 2] = l.z; lo[u + 3] = l.w;
        }
#else
#pragma unroll
        for (int u = 0; u < QW; ++u) {
            hi[u] = ok ? __ldg(r + u) : 0u;
            lo[u] = ok ? __ldg(r + HEAD_DIM / 4 + u) : 0u;
        }
#endif
        *sc = ok ? __ldg(bsc + blk) : 0.0f;
    };
    u32 hi[QW], lo[QW];
    float sc;
    load(0, hi, lo, &sc);
    // The first records are in flight; q waits for the previous kernel (common.cuh).
    pdl_wait();
    // The group's codes, split by sign, four to a word in dim order: warp g quantizes head g.
    const float* qh = q + ((u64)i * HQ + (u64)kvh * GROUP) * HEAD_DIM;
    __shared__ u32 s_qp[GROUP][HEAD_DIM / 4];
    __shared__ u32 s_qn[GROUP][HEAD_DIM / 4];
    __shared__ float s_qs[GROUP];
    for (u32 g = w; g < GROUP; g += SCORE_THREADS / 32) {
        const float qs = q_scale_warp(qh + g * HEAD_DIM);
        for (u32 x = lane; x < HEAD_DIM / 4; x += 32) {
            u32 p = 0, m = 0;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int code = q_code(qh[g * HEAD_DIM + 4 * x + c], qs);
                p |= ((u32)max(code, 0) & 0xffu) << (8 * c);
                m |= ((u32)min(code, 0) & 0xffu) << (8 * c);
            }
            s_qp[g][x] = p;
            s_qn[g][x] = m;
        }
        if (lane == 0) s_qs[g] = qs;
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < SCORE_NB; ++n) key[n] = 0ull;
#pragma unroll
    for (int n = 0; n < SCORE_NB; ++n) {
        if ((u32)n >= nbo) break;  // uniform across the thread block
        u32 nhi[QW], nlo[QW];
        float nsc = 0.0f;
        if (n + 1 < SCORE_NB) load(n + 1, nhi, nlo, &nsc);
        int acc[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            acc[g] = 0;
#pragma unroll
            for (int u = 0; u < QW; ++u) {
                acc[g] = __dp4a((int)hi[u], (int)s_qp[g][j * QW + u], acc[g]);
                acc[g] = __dp4a((int)lo[u], (int)s_qn[g][j * QW + u], acc[g]);
            }
        }
        float m = NEG_INF;
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            int a = acc[g];
            // The octet's sum (lane bits 0-2), then the max over the block's SUB quarters
            // (octets of the warp: lane bit 3, and 4 with four).
            a += __shfl_xor_sync(FULL_MASK, a, 4);
            a += __shfl_xor_sync(FULL_MASK, a, 2);
            a += __shfl_xor_sync(FULL_MASK, a, 1);
            if (SUB >= 2) a = max(a, __shfl_xor_sync(FULL_MASK, a, 8));
            if (SUB >= 4) a = max(a, __shfl_xor_sync(FULL_MASK, a, 16));
            m = fmaxf(m, __fmul_rn(__fmul_rn((float)a, sc), s_qs[g]));
        }
        const u32 rec = r0 + n * SCORE_OCTETS + oct;
        const u32 b = rec / SUB;
        const bool distant = b >= SINK && b < nb - LOCAL;
        // The unit's best distant block (lane bit 4 pairs blocks, with bit 3 too for four).
        m = distant ? m : NEG_INF;
        if (UNIT_BLOCKS >= 4) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 8));
        if (UNIT_BLOCKS >= 2) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 16));
        key[n] = (rec % 4 == 0 && m != NEG_INF) ? cand_key(m, rec / 4) : 0ull;
        if (n + 1 < SCORE_NB) {
#pragma unroll
            for (int u = 0; u < QW; ++u) {
                hi[u] = nhi[u];
                lo[u] = nlo[u];
            }
            sc = nsc;
        }
    }
}
#endif

// grid (lists of the longest session, KV_HEADS, batch), block SCORE_THREADS.
// Each score is summed by one octet in the CPU's exact order: thread j adds element d = j + 8s
// of max(q[d]*k_max[d], q[d]*k_min[d]) into its lane for increasing s (explicit round-to-
// nearest multiplies and adds, never contracted into FMAs), then octet_reduce folds the lanes
// as simd::reduce does; the max over the GROUP query heads is order-independent. So scores are
// bit-identical to kvtier_kernels::select::block_score. (One thread per block with all G x 8
// lanes in registers ran at 2 warps per scheduler, a latency chain; bench/gpu/NOTES.md v13-v17.)
// q: [batch][HQ][HEAD_DIM] f32. sums: [slot][layer][max_blocks][KV_HEADS][SUB][REC_VECS] uint4.
// With TOPK_MERGE each thread block writes the descending list of its LW best distant
// candidates to scratch (u64 [batch][KV_HEADS][lists + MERGE_GROUPS(lists)][LW] with lists =
// SCORE_LISTS(max_blocks * SUB, 1)); the lists are merged in groups (MERGE_GROUPS), and the
// last thread block of a (batch item, kv head) to finish merges that head's group lists into
// the TOPK distant blocks of its keep-set row and plans their tiles (the done[] counters,
// [batch][KV_HEADS][1 + MERGE_GROUPS(lists)], return to 0), or, with SKETCH, into its CAND
// candidates (cands[batch][KV_HEADS][LW]).
// Otherwise every score goes to scratch (f32 [batch][KV_HEADS][max_blocks]) for select_topk.
// score_role is one such thread block, (bx, kvh, i) its grid position. When `ready` is not null
// (layer_fused), the last thread block of the kv head publishes its finished keep-set row and
// plan by storing `stamp` there (a release store).
__device__ __forceinline__ void score_role(
    const float* __restrict__ q, const sum_t* __restrict__ sums, const float* __restrict__ qscales,
    const u32* __restrict__ sess,
    const u32* __restrict__ ntok, u32 layer, u32 max_blocks, u32 nbo, void* __restrict__ scratch,
    u32* __restrict__ done, u32* table, u32* __restrict__ tags, u32* __restrict__ stamps,
    const u64* __restrict__ pages, u32* slot_of, u64* miss_src, unsigned long long* __restrict__ stats,
    u32 stamp, u32* ready, u32 bx, u32 kvh, u32 i, u32* cands) {
#if SEL_TRACE
    const u32 sel_cta = (i * KV_HEADS + kvh) * SCORE_LISTS(max_blocks, 1) + bx;
#endif
    SEL_STAMP(0);
    K_TRACE(2);
    const u32 nb = n_blocks_of(ntok[i]);
    const u32 nr = nb * SUB;
    const u32 r0 = bx * nbo * SCORE_OCTETS;
    const u32 b0 = r0 / SUB;
    // A short layer keeps every block (plan_fixed): nothing to score.
    if (r0 >= nr || SHORT_LAYER(nb)) return;
    const u32 tid = threadIdx.x;
    const u32 j = tid & 7u;    // the CPU lane this thread sums
    const u32 oct = tid >> 3;  // its octet
#if TOPK_MERGE
    // The kv head's last thread block plans the winners: the host address of each (a page
    // table entry, a dependent load once the winners are known) and the distant slots' tags
    // and stamps. Each thread block pulls the entries of its own blocks and those slot lines
    // into L2 while it scores, so that the plan's loads hit L2 (bench/gpu/NOTES.md v26).
    {
        const u64 srow = (u64)sess[i] * NUM_LAYERS + layer;
        const u32 nent = min(nbo * SCORE_OCTETS / SUB, nb - b0);
        if (tid * 16 < nent) prefetch_l2(pages + srow * max_blocks + b0 + tid * 16);
        const u64 cb = (srow * KV_HEADS + kvh) * CACHE_SLOTS + DISTANT_SLOT0;
        // Threads 32, 33, ... take one 128-byte line (32 slots) of each array.
        if (tid >= 32 && (tid - 32) * 32 < CACHE_SLOTS - DISTANT_SLOT0) {
            prefetch_l2(tags + cb + (tid - 32) * 32);
            prefetch_l2(stamps + cb + (tid - 32) * 32);
        }
    }
#endif
    u64 key[SCORE_NB];
#if SKETCH
    score_keys_sketch(q, sums, qscales, sess, layer, max_blocks, nbo, i, kvh, nb, nr, r0, key);
#else
    const uint4* recs = (const uint4*)sums + ((u64)sess[i] * NUM_LAYERS + layer) * (u64)max_blocks * KV_HEADS * SUB * REC_VECS;
    // Loads octet row n's record, zeros past the layer or past this launch's nbo rows. The
    // loads are predicated, not branched over: under a branch the compiler sank the next
    // row's loads below the current row's arithmetic (every row then waited a full memory
    // latency; bench/gpu/NOTES.md v16).
    auto load = [&](u32 n, uint4* v) {
        const u32 rec = r0 + n * SCORE_OCTETS + oct;
        const bool ok = rec < nr && n < nbo;
        const uint4* r = recs + (((u64)(rec / SUB) * KV_HEADS + kvh) * SUB + rec % SUB) * REC_VECS + j;
#pragma unroll
        for (int u = 0; u < SEL_V; ++u) v[u] = ok ? __ldg(r + u * 8) : make_uint4(0u, 0u, 0u, 0u);
    };
    uint4 cur[SEL_V];
    load(0, cur);
    // The first records are in flight; q waits for the previous kernel (common.cuh).
    pdl_wait();
    const float* qh = q + ((u64)i * HQ + (u64)kvh * GROUP) * HEAD_DIM;
    // q in lane-major order, so that the octets of a warp read one broadcast word per
    // (head, dim): q held in registers (G x D/8 per thread) took 176 registers, one thread
    // block per SM, and measured slower (bench/gpu/NOTES.md v17).
    __shared__ float s_q[SEL_S][GROUP][8];
    for (u32 x = tid; x < GROUP * HEAD_DIM; x += SCORE_THREADS) {
        const u32 d = x % HEAD_DIM;
        s_q[d / 8][x / HEAD_DIM][d % 8] = qh[x];
    }
    __syncthreads();
    SEL_STAMP(1);
#pragma unroll
    for (int n = 0; n < SCORE_NB; ++n) key[n] = 0ull;
#pragma unroll
    for (int n = 0; n < SCORE_NB; ++n) {
        if ((u32)n >= nbo) break;  // uniform across the thread block
#if SEL_PREFETCH
        uint4 nxt[SEL_V];
        if (n + 1 < SCORE_NB) load(n + 1, nxt);
#endif
        float acc[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) acc[g] = 0.0f;
#pragma unroll
        for (int u = 0; u < SEL_V; ++u) {
            float v[2 * SEL_P];
            unpack_sums(cur[u], v);
#pragma unroll
            for (int w = 0; w < SEL_P; ++w) {
#pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    const float qd = s_q[u * SEL_P + w][g][j];
                    acc[g] = __fadd_rn(acc[g], fmaxf(__fmul_rn(qd, v[2 * w]), __fmul_rn(qd, v[2 * w + 1])));
                }
            }
        }
        float m = NEG_INF;
#pragma unroll
        for (int g = 0; g < GROUP; ++g) m = fmaxf(m, octet_reduce(acc[g]));
#if SUB > 1
        // The max over the block's quarters: its SUB records are octets of this warp (lane
        // bits 3 and 4 number the octets).
        if (SUB >= 2) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 8));
        if (SUB >= 4) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, 16));
#endif
        const u32 rec = r0 + n * SCORE_OCTETS + oct;
        const u32 b = rec / SUB;
#if TOPK_MERGE
        // Only distant blocks are candidates (nb > KSEL here, so nb - LOCAL > SINK), each once
        // (its first record's octet).
        key[n] = (rec % SUB == 0 && b >= SINK && b < nb - LOCAL) ? cand_key(m, b) : 0ull;
#else
        if (j == 0 && b < nb) ((float*)scratch)[((u64)i * KV_HEADS + kvh) * max_blocks + b] = m;
#endif
#if SEL_PREFETCH
        if (n + 1 < SCORE_NB) {
#pragma unroll
            for (int u = 0; u < SEL_V; ++u) cur[u] = nxt[u];
        }
#else
        if (n + 1 < SCORE_NB) load(n + 1, cur);
#endif
    }
#endif
    SEL_STAMP(2);
#if TOPK_MERGE
    // This thread block's best LW: each warp sorts LW keys, then a tree of warp merges.
#define NSL (SCORE_OCTETS * SCORE_NB / 32)
    __shared__ u64 s_keys[NSL * 32];
    __shared__ u64 s_sl[NSL / LIST_R][LW];
    __shared__ bool s_last;
    if (j == 0) {
#pragma unroll
        for (int n = 0; n < SCORE_NB; ++n) s_keys[n * SCORE_OCTETS + oct] = key[n];
    }
    __syncthreads();
    const u32 w = tid >> 5;
    // Lists of LW keys in use (at least 1): rows past nbo hold keys of 0.
    const u32 nsl = (nbo * SCORE_OCTETS / 32 + LIST_R - 1) / LIST_R;
    u64 v[LIST_R], other[LIST_R];
    if (w < nsl) {
        list_load(v, s_keys + w * LW, true, false, false);
        list_sort_desc(v);
        list_store(v, s_sl[w]);
    }
    __syncthreads();
    for (u32 s = 1; s < nsl; s <<= 1) {
        if ((w & (2 * s - 1)) == 0 && w + s < nsl) {
            list_load(other, s_sl[w + s], true, true, false);
            list_merge_desc(v, other);
            list_store(v, s_sl[w]);
        }
        __syncthreads();
    }
    SEL_STAMP(3);
    // Scratch per (batch item, kv head): the thread blocks' lists, then the groups' lists;
    // counters: the groups' merges done, then each group's lists done (MERGE_GROUPS).
    const u32 ih = i * KV_HEADS + kvh;
    const u32 nlists = SCORE_LISTS(nr, nbo);
    const u32 ngroups = MERGE_GROUPS(nlists);
    const u32 maxl = SCORE_LISTS(max_blocks * SUB, 1);
    u64* lists = (u64*)scratch + (u64)ih * (maxl + MERGE_GROUPS(maxl)) * LW;
    u64* glists = lists + (u64)maxl * LW;
    u32* counters = done + ih * (1 + MERGE_GROUPS(maxl));
    const u32 grp = bx / MERGE_GROUP;
    if (w == 0) {
        list_store(v, lists + (u64)bx * LW);
        // Publish the list device-wide before it is counted (threadFenceReduction pattern).
        __threadfence();
    }
    __syncthreads();
    SEL_STAMP(4);
    if (tid == 0) {
        u32* c = ngroups > 1 ? counters + 1 + grp : counters;
        const u32 prev = atomicAdd(c, 1u);
        s_last = prev == min(MERGE_GROUP, nlists - grp * MERGE_GROUP) - 1;
        if (s_last) *c = 0;  // every list is in; ready for the next launch
    }
    __syncthreads();
    SEL_STAMP(5);
    if (!s_last) {
        SEL_CLEAR(6);
        SEL_CLEAR(7);
        return;
    }
    __threadfence();
    const u64* src = lists;
    u32 nsrc = nlists;
    if (ngroups > 1) {
        merge_lists(lists + (u64)grp * MERGE_GROUP * LW, min(MERGE_GROUP, nlists - grp * MERGE_GROUP), v);
        if (w == 0) {
            list_store(v, glists + (u64)grp * LW);
            __threadfence();
        }
        __syncthreads();
        if (tid == 0) {
            const u32 prev = atomicAdd(counters, 1u);
            s_last = prev == ngroups - 1;
            if (s_last) *counters = 0;
        }
        __syncthreads();
        if (!s_last) {
            SEL_CLEAR(6);
            SEL_CLEAR(7);
            return;
        }
        __threadfence();
        src = glists;
        nsrc = ngroups;
    }
#if SKETCH
    // The candidate units for the rerank roles: every distant unit of a layer within
    // SCAN_UNITS, else the CAND_UNITS best.
    const u32 nu = distant_units(nb);
    if (nu <= SCAN_UNITS) {
        for (u32 u = tid; u < nu; u += blockDim.x) cands[(u64)ih * CANDW + u] = SINK / UNIT_BLOCKS + u;
    } else {
        select_distant_merge(src, nsrc, cands + (u64)ih * CANDW, CAND_UNITS);
    }
    if (ready != nullptr) signal_ready(ready, stamp);
#else
    u32* row = table + (u64)ih * KSEL;
    select_distant_merge(src, nsrc, row + SINK, TOPK);
    __syncthreads();
    SEL_STAMP(6);
    plan_tile_cache(i, kvh, row, SINK, TOPK, 0, 0, DISTANT_SLOT0, CACHE_SLOTS - DISTANT_SLOT0, sess, ntok, layer,
                    max_blocks, tags, stamps, pages, slot_of, miss_src, stats);
    SEL_STAMP(7);
    if (ready != nullptr) signal_ready(ready, stamp);
#endif
#undef NSL
#endif
}

// grid (lists of the longest session, KV_HEADS, batch), block SCORE_THREADS: the selector
// alone, followed by attend_tile's distant part (when layer_fused is not used).
extern "C" __global__ void __launch_bounds__(SCORE_THREADS) select_score(SelectScoreParams_FIELDS) {
    score_role(q, sums, qscales, sess, ntok, layer, max_blocks, nbo, scratch, done, table, tags, stamps, pages, slot_of,
               miss_src, stats, 0, nullptr, blockIdx.x, blockIdx.y, blockIdx.z, cands);
}


#if SKETCH
// Key sketches (kvtier_storage::sketch): per (block, kv head) a record of BLOCK_TOKENS keys'
// codes, PD / 2 bytes each, then the block's HEAD_DIM f32 channel scales. A key's codes are W = PD / 4
// u16 words, element e in word e % W at bits 4 (e / W): read as the u32 pairs (a, a + 1) of
// a key's PD / 8 u32 words, nibble slot jn of the pair gives elements jn W + 2a + {0, 2, 1, 3} in
// bytes 0..3 (rerank_codes), what one dp4a takes against the query's codes in that order.
#define SK_WORDS (PD / 8)                    // u32 words of one key's codes
#define SK_CODE_BYTES (PD / 2)
#define SK_REC_BYTES ((u64)BLOCK_TOKENS * SK_CODE_BYTES + 4ull * HEAD_DIM)
#define SK_DP4A (PD / 4)                     // dp4a per key and query head
#define RKW (32 * RERANK_R)                  // rerank keys per (batch item, kv head)
#define I32_MIN (-2147483647 - 1)            // NVRTC compiles without <climits>
#if RERANK_R != 1 && RERANK_R != 2 && RERANK_R != 4 && RERANK_R != 8
#error "RERANK_R must be 1, 2, 4 or 8"
#endif
// Rerank roles per (batch item, kv head): RERANK_PER_ROLE candidates each (config.rs), enough
// for a layer that scans SCAN blocks. A layer's candidates (rerank_lim) need the first
// rerank_roles of them; the others return at once, without waiting or counting.
#define RERANK_ROLES ((SCAN + RERANK_PER_ROLE - 1) / RERANK_PER_ROLE)

// The candidate slots of a layer of nb blocks (nb > KSEL): its distant units' blocks where it
// has at most SCAN_UNITS of them, else CAND.
__device__ __forceinline__ u32 rerank_lim(u32 nb) {
    const u32 nu = distant_units(nb);
    return nu <= SCAN_UNITS ? nu * UNIT_BLOCKS : CAND;
}
__device__ __forceinline__ u32 rerank_roles(u32 nb) {
    return (rerank_lim(nb) + RERANK_PER_ROLE - 1) / RERANK_PER_ROLE;
}

// The TOPK best of the n rerank keys at `keys` (a list of 32 R keys per warp), their ids
// ascending into `out`; by one warp.
template <u32 R>
__device__ __forceinline__ void rerank_top(const u64* keys, u32 n, u32* out) {
    const u32 lane = threadIdx.x & 31u;
    u64 v[R];
#pragma unroll
    for (u32 r = 0; r < R; ++r) v[r] = r * 32 + lane < n ? __ldcg(keys + r * 32 + lane) : 0ull;
    list_sort_desc_r<R>(v);
    list_ids_ascending_r<R>(v, out, TOPK);
}

// The signed codes of nibble slot jn of u32 words x (a) and y (a + 1), as four int8 in one
// word: bytes [e(jn W + 2a), e(jn W + 2a + 2), e(jn W + 2a + 1), e(jn W + 2a + 3)].
__device__ __forceinline__ int rerank_codes(u32 x, u32 y, u32 jn) {
    const u32 v = ((x >> (4 * jn)) & 0x000f000fu) | (((y >> (4 * jn)) & 0x000f000fu) << 8);
    // Sign-extend each nibble within its byte: (n ^ 8) - 8, bytewise.
    return (int)__vsub4(v ^ 0x08080808u, 0x08080808u);
}

// The code words of token t of the sketch record `rec` (SK_WORDS u32, in 16-byte loads).
__device__ __forceinline__ void rerank_load(const unsigned char* rec, u32 t, u32* words) {
    const uint4* src = (const uint4*)(rec + (u64)t * SK_CODE_BYTES);
#pragma unroll
    for (int v = 0; v < SK_WORDS / 4; ++v) {
        const uint4 cw = __ldg(src + v);
        words[4 * v] = cw.x;
        words[4 * v + 1] = cw.y;
        words[4 * v + 2] = cw.z;
        words[4 * v + 3] = cw.w;
    }
}

// Candidate block c of the kv head whose candidate units start at `cands`: block c % UNIT_BLOCKS
// of unit c / UNIT_BLOCKS, or none (0xffffffff) where that block is not distant or the unit
// was not filled.
__device__ __forceinline__ u32 cand_block(const u32* cands, u32 c, u32 nb) {
    const u32 u = __ldcg(cands + c / UNIT_BLOCKS);
    if (u == 0xffffffffu) return u;
    const u32 b = u * UNIT_BLOCKS + c % UNIT_BLOCKS;
    return b >= SINK && b < nb - LOCAL ? b : 0xffffffffu;
}

// One rerank role: candidates [x R, x R + R) of (batch item i, kv head kvh) with R =
// RERANK_PER_ROLE, each scored by its key sketch as kvtier_kernels::select::QuerySketch::score
// does (per candidate each query head times the block's channel scales, quantized to int8; integer
// dots, exact, their max over tokens; then f32(max) * that query scale, rounded, max over the
// group), its key written to rkeys; the kv head's last role to finish keeps the TOPK best (ties to
// the lower block), writes them ascending into the distant part of the keep-set row and plans
// their tiles, then (layer_fused) publishes the row by storing `stamp` in `ready`. Thread t takes
// candidate t / BLOCK_TOKENS of the role: with R > 1 a candidate's tokens are whole warps
// (config.rs). (One candidate per role left half or more of the threads idle in blocks of 64 or
// 128 tokens.)
__device__ __forceinline__ void rerank_role(
    const float* __restrict__ q, const unsigned char* __restrict__ sk, const u32* __restrict__ sess,
    const u32* __restrict__ ntok, u32 layer, u32 max_blocks, const u32* cands, u64* rkeys,
    u32* __restrict__ done, u32* table, u32* __restrict__ tags, u32* __restrict__ stamps,
    const u64* __restrict__ pages, u32* slot_of, u64* miss_src, unsigned long long* __restrict__ stats,
    u32 stamp, u32* ready, u32 x, u32 kvh, u32 i) {
    const u32 tid = threadIdx.x;
    const u32 lane = tid & 31u;
    const u32 w = tid >> 5;
    const u32 nw = blockDim.x >> 5;
    const u32 ih = i * KV_HEADS + kvh;
    const u32 nb = n_blocks_of(ntok[i]);
    if (SHORT_LAYER(nb) || x >= rerank_roles(nb)) return;
    __shared__ int s_qc[RERANK_PER_ROLE][GROUP][SK_DP4A];
    __shared__ float s_qs[RERANK_PER_ROLE][GROUP];
    __shared__ int s_best[SCORE_THREADS / 32][GROUP];
    __shared__ bool s_last;
    pdl_wait();
    const u32 lim = rerank_lim(nb);
    const u64 rec0 = (((u64)sess[i] * NUM_LAYERS + layer) * max_blocks) * KV_HEADS + kvh;
    // This thread's candidate r of the role (RERANK_PER_ROLE > 1: tid < R * BLOCK_TOKENS <=
    // blockDim.x).
    const u32 r = RERANK_PER_ROLE > 1 ? tid / BLOCK_TOKENS : 0u;
    const u32 c = x * RERANK_PER_ROLE + r;
    const bool has = (RERANK_PER_ROLE == 1 || tid < RERANK_PER_ROLE * BLOCK_TOKENS) && c < lim;
    const u32 b = has ? cand_block(cands + (u64)ih * CANDW, c, nb) : 0xffffffffu;
    const unsigned char* rec = b != 0xffffffffu ? sk + (rec0 + (u64)b * KV_HEADS) * SK_REC_BYTES : nullptr;
    // This thread's first token's codes, loaded now: their latency overlaps the query codes'.
    const u32 t0 = RERANK_PER_ROLE > 1 ? tid % BLOCK_TOKENS : tid;
    u32 words[SK_WORDS];
    if (rec != nullptr && t0 < BLOCK_TOKENS) rerank_load(rec, t0, words);
    // Each candidate's query codes: half-warp task (candidate rc, head g) quantizes q_g times
    // the block's channel scales (absmax / 127, round half to even); a role's R x G tasks take
    // one round of its 16 half-warps where they fit (R = 2, G <= 8).
    const float* qh = q + ((u64)i * HQ + (u64)kvh * GROUP) * HEAD_DIM;
    const u32 hl = tid & 15u;
    for (u32 task0 = 0; task0 < RERANK_PER_ROLE * GROUP; task0 += blockDim.x >> 4) {
        const u32 task = task0 + (tid >> 4);
        const u32 rc = task / GROUP, g = task % GROUP;
        const u32 cc = x * RERANK_PER_ROLE + rc;
        const u32 bc = task < RERANK_PER_ROLE * GROUP && cc < lim ? cand_block(cands + (u64)ih * CANDW, cc, nb)
                                                                  : 0xffffffffu;
        // Every lane takes part in the shuffles; a half without a candidate writes nothing.
        const float* cs = bc != 0xffffffffu ? (const float*)(sk + (rec0 + (u64)bc * KV_HEADS) * SK_REC_BYTES +
                                                             (u64)BLOCK_TOKENS * SK_CODE_BYTES)
                                            : nullptr;
        float amax = 0.0f;
        if (cs != nullptr)
            for (u32 d = hl; d < HEAD_DIM; d += 16) amax = fmaxf(amax, fabsf(__fmul_rn(qh[g * HEAD_DIM + d], __ldg(cs + d))));
#pragma unroll
        for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
        if (cs == nullptr) continue;
        const float qs = __fdiv_rn(amax, 127.0f);
        // Word k of the dp4a order: nibble slot jn = k / (PD / 16), pair a = 2 (k % (PD / 16)).
        for (u32 k = hl; k < SK_DP4A; k += 16) {
            const u32 jn = k / (PD / 16), a = 2 * (k % (PD / 16));
            const u32 e0 = jn * (PD / 4) + 2 * a;
            const u32 es[4] = {e0, e0 + 2, e0 + 1, e0 + 3};
            u32 word = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int code =
                    es[j] < HEAD_DIM ? q_code(__fmul_rn(qh[g * HEAD_DIM + es[j]], __ldg(cs + es[j])), qs) : 0;
                word |= ((u32)code & 0xffu) << (8 * j);
            }
            s_qc[rc][g][k] = (int)word;
        }
        if (hl == 0) s_qs[rc][g] = qs;
    }
    __syncthreads();
    int best[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) best[g] = I32_MIN;
    if (rec != nullptr) {
        for (u32 t = t0; t < BLOCK_TOKENS; t += RERANK_PER_ROLE > 1 ? BLOCK_TOKENS : blockDim.x) {
            if (t != t0) rerank_load(rec, t, words);
            int acc[GROUP];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) acc[g] = 0;
#pragma unroll
            for (int k = 0; k < SK_DP4A; ++k) {
                const u32 jn = k / (PD / 16), a = 2 * (k % (PD / 16));
                const int kc = rerank_codes(words[a], words[a + 1], jn);
#pragma unroll
                for (int g = 0; g < GROUP; ++g) acc[g] = __dp4a(kc, s_qc[r][g][k], acc[g]);
            }
#pragma unroll
            for (int g = 0; g < GROUP; ++g) best[g] = max(best[g], acc[g]);
        }
    }
    // Max over the thread block per head, then the query scale and the max over heads.
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        int m = best[g];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(FULL_MASK, m, o));
        if (lane == 0) s_best[w][g] = m;
    }
    __syncthreads();
    // Thread r keys the role's candidate r from the warps that scored it.
    constexpr u32 WPC = RERANK_PER_ROLE > 1 ? BLOCK_TOKENS / 32 : SCORE_THREADS / 32;
    if (tid < RERANK_PER_ROLE && x * RERANK_PER_ROLE + tid < lim) {
        const u32 cr = x * RERANK_PER_ROLE + tid;
        const u32 br = cand_block(cands + (u64)ih * CANDW, cr, nb);
        float score = NEG_INF;
        for (int g = 0; g < GROUP; ++g) {
            int m = I32_MIN;
            for (u32 v = tid * WPC; v < min((tid + 1) * WPC, nw); ++v) m = max(m, s_best[v][g]);
            score = fmaxf(score, __fmul_rn((float)m, s_qs[tid][g]));
        }
        rkeys[(u64)ih * RKW + cr] = br != 0xffffffffu ? cand_key(score, br) : 0ull;
        // Publish the key device-wide before it is counted (threadFenceReduction pattern).
        __threadfence();
    }
    __syncthreads();
    if (tid == 0) {
        const u32 prev = atomicAdd(&done[ih], 1u);
        s_last = prev == rerank_roles(nb) - 1;
        if (s_last) done[ih] = 0;  // every key is in; ready for the next launch
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    u32* row = table + (u64)ih * KSEL;
    if (w == 0) {
        // The TOPK best keys, then their ids ascending: in the shorter list where the
        // candidates fit it (a layer past SCAN_UNITS).
        if (lim <= 32 * RERANK_R_CAND) {
            rerank_top<RERANK_R_CAND>(rkeys + (u64)ih * RKW, lim, row + SINK);
        } else {
            rerank_top<RERANK_R>(rkeys + (u64)ih * RKW, lim, row + SINK);
        }
    }
    __syncthreads();
    plan_tile_cache(i, kvh, row, SINK, TOPK, 0, 0, DISTANT_SLOT0, CACHE_SLOTS - DISTANT_SLOT0, sess, ntok, layer,
                    max_blocks, tags, stamps, pages, slot_of, miss_src, stats);
    if (ready != nullptr) signal_ready(ready, stamp);
}
#endif

// grid (RERANK_ROLES, KV_HEADS, batch), block SCORE_THREADS: the sketch selector's second stage after
// select_score (when layer_fused is not used); empty without SKETCH.
extern "C" __global__ void __launch_bounds__(SCORE_THREADS) select_rerank(SelectRerankParams_FIELDS) {
#if SKETCH
    rerank_role(q, sketches, sess, ntok, layer, max_blocks, cands, rkeys, rdone, table, tags, stamps, pages, slot_of,
                miss_src, stats, 0, nullptr, blockIdx.x, blockIdx.y, blockIdx.z);
#endif
}

#if TOPK_MERGE && ATT_THREADS == SCORE_THREADS
// layer_fused (select_score's parameters, the ready flags' stamp, then the attention's): a whole
// layer but the merge in one launch (everything plan_fixed, attend_tile and select_score do in split launches), so
// that no kernel boundary sits between the selector and the distant gather: between two kernels the gather waited for the selector's
// completion, which the fixed part's zero-copy reads in flight delayed by ~25 us per layer
// (bench/gpu/NOTES.md v24), and the side stream's kernels competed with it for SM slots.
// 1-D grid of roles, block SCORE_THREADS (= ATT_THREADS), dynamic shared memory ATT_DYN_SMEM,
// H = KV_HEADS * batch heads, in ticket order:
//   [0, H)                       plan the fixed part of head h (plan_fixed_role), then ready[h][0];
//   next nfixed * H              fixed tile x of head h: waits ready[h][0], attends table
//                                position x (short layer) or the x-th sink/local tile;
//   next lists * H               score roles (score_role); the head's last sets ready[h][1]
//                                (with SKETCH: writes the candidates, sets ready[h][2]);
//   next RERANK_ROLES * H        rerank roles (rerank_role, SKETCH): wait ready[h][2]; the head's
//                                last sets ready[h][1];
//   next TOPK * H                distant tile x of head h: waits ready[h][1].
// A thread block takes its role from a ticket (atomicAdd on tickets[0], minus ticket0: the
// tickets of earlier launches), not from blockIdx: every role waits only for roles with lower
// tickets, which are running or done whatever order the hardware starts thread blocks in (the
// dynamic tile numbering of single-pass scans), so the spins cannot deadlock. Entries written
// during this launch (table, counts, slots, sources) are read through L2 after the wait.
extern "C" __global__ void __launch_bounds__(SCORE_THREADS) layer_fused(LayerFusedParams_FIELDS) {
    __shared__ u32 s_ticket;
    if (threadIdx.x == 0) s_ticket = atomicAdd(tickets, 1u) - ticket0;
    __syncthreads();
    const u32 heads = KV_HEADS * batch;
    u32 t = s_ticket;
    if (t < heads) {
        plan_fixed_role(ntok, max_blocks, table, counts, sess, layer, tags, stamps, pages, slot_of, miss_src, stats,
                        t % KV_HEADS, t / KV_HEADS);
        signal_ready(ready + READY_FLAGS * t, stamp);
        return;
    }
    t -= heads;
    u32 x, h, j, part, nt;
    if (t < nfixed * heads) {
        x = t % nfixed;
        h = t / nfixed;
        nt = ntok[h / KV_HEADS];
        const u32 nb = n_blocks_of(nt);
        if (SHORT_LAYER(nb)) {
            if (x >= nb) return;
            j = x;
        } else {
            if (x >= SINK + LOCAL) return;
            j = x < SINK ? x : x + TOPK;
        }
        part = 0;
    } else {
        t -= nfixed * heads;
        if (t < lists * heads) {
            const u32 hs = t / lists;
            score_role(q, sums, qscales, sess, ntok, layer, max_blocks, nbo, scratch, done, table, tags, stamps, pages,
                       slot_of, miss_src, stats, stamp, ready + READY_FLAGS * hs + (SKETCH ? 2 : 1), t % lists,
                       hs % KV_HEADS, hs / KV_HEADS, cands);
            return;
        }
        t -= lists * heads;
#if SKETCH
        if (t < RERANK_ROLES * heads) {
            const u32 hs = t / RERANK_ROLES;
            const u32 nb = n_blocks_of(ntok[hs / KV_HEADS]);
            if (SHORT_LAYER(nb) || t % RERANK_ROLES >= rerank_roles(nb)) return;
            wait_ready(ready + READY_FLAGS * hs + 2, stamp);
            rerank_role(q, sketches, sess, ntok, layer, max_blocks, cands, rkeys, rdone, table, tags, stamps, pages,
                        slot_of, miss_src, stats, stamp, ready + READY_FLAGS * hs + 1, t % RERANK_ROLES,
                        hs % KV_HEADS, hs / KV_HEADS);
            return;
        }
        t -= RERANK_ROLES * heads;
#endif
        x = t % TOPK;
        h = t / TOPK;
        // A short layer has no distant part (its fixed part is every block).
        if (h >= heads) return;
        nt = ntok[h / KV_HEADS];
        if (SHORT_LAYER(n_blocks_of(nt))) return;
        j = SINK + x;
        part = 1;
    }
    K_TRACE(1 + 2 * part);
    // The session slot is an input of the launch: loaded before the wait, not after it.
    const u32 sslot = sess[h / KV_HEADS];
    wait_ready(ready + READY_FLAGS * h + part, stamp);
    const u64 e = (u64)h * KSEL + j;
    attend_one(q, nt, sslot, layer, cache, scale, part_acc, part_ml, h / KV_HEADS, h % KV_HEADS, j, __ldcg(table + e),
               __ldcg(slot_of + e), __ldcg(miss_src + e));
}
#endif

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

// grid (KV_HEADS, batch), block TOPK_THREADS; launched only when TOPK > 32 (no TOPK_MERGE).
// For a layer longer than KSEL blocks, writes the TOPK distant blocks of each keep-set row
// (positions [SINK, SINK + TOPK) of table[batch][KV_HEADS][KSEL]; plan_fixed wrote the rest
// and the counts) and plans them in the distant cache region.
// Thread t owns the TOPK_KPT consecutive distant candidates starting at t * TOPK_KPT, kept in
// registers as order-preserving u32 keys. Radix select (4 passes of 8 bits, MSB first) finds
// T = the TOPK-th largest key and how many blocks equal to T are taken; two block-wide
// prefix sums then emit key > T, plus the lowest-indexed blocks with key == T (the tie
// rule), in ascending order.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS) select_topk(SelectTopkParams_FIELDS) {
#if !TOPK_MERGE
    const u32 i = blockIdx.y;
    const u32 kvh = blockIdx.x;
    const u32 nb = n_blocks_of(ntok[i]);
    if (SHORT_LAYER(nb)) return;
    u32* row = table + ((u64)i * KV_HEADS + kvh) * KSEL;
    select_distant((const float*)scratch + ((u64)i * KV_HEADS + kvh) * max_blocks, nb, row);
    __syncthreads();
    plan_tile_cache(i, kvh, row, SINK, TOPK, 0, 0, DISTANT_SLOT0, CACHE_SLOTS - DISTANT_SLOT0, sess, ntok, layer,
                    max_blocks, tags, stamps, pages, slot_of, miss_src, stats);
#endif
}
