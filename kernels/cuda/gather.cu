// Zero-copy gather planning with a per-(session, layer, kv-head) GPU tile cache. The fetch
// itself happens in attend_tile (attend.cu), which reads misses straight from mapped host
// memory.
//
// A layer's keep-set is planned in two parts so that the fixed part can be fetched while the
// selector runs (see attend.cu and CudaBackend::run_layer):
// - plan_fixed (first kernel of a layer, side stream) writes and plans the blocks known without
//   scoring: the sink and the local window, or every block when the layer has no more than KSEL
//   blocks;
// - the selector (select.cu) writes and plans the TOPK distant blocks once they are selected.
// Table position j of a kv head's keep-set row is fixed: [0, SINK) sink, [SINK, SINK + TOPK)
// distant, [SINK + TOPK, KSEL) local; a short layer uses [0, nb) in block order. So the row is
// ascending in both cases, as the CPU selector returns it.
//
// Cache: CACHE_SLOTS tile slots per (session, layer, kv head), LRU by the time of the last use
// (stamps[]: the GPU's global timer when the slot was last planned, lru_now). The time comes
// from the device, not from a launch argument, so that a launch captured in a CUDA graph keeps
// LRU order over its replays. tags[] holds block+1 (0 = empty, so a zeroed buffer is an empty
// cache). Only tiles of blocks that were FULL when fetched are tagged: a partial tail block
// changes with every appended token, so it is refetched until it is full (append-only
// positions make full blocks immutable). Exactly one thread block handles one (session, kv
// head) of a layer in each planning kernel, so the bookkeeping needs no atomics; a batch must
// not name a session twice (checked in Rust). CACHE_SLOTS >= KSEL (checked in Rust).
//
// The two parts of a long layer use disjoint slot regions, [0, DISTANT_SLOT0) for the fixed
// part and [DISTANT_SLOT0, CACHE_SLOTS) for the distant one, so the distant plan needs no
// ordering against the fixed plan or the fixed tiles in flight on the other stream. Each
// region is large enough for its part (CACHE_SLOTS - DISTANT_SLOT0 >= TOPK). A block that
// leaves the local window is fetched once more into the distant region; tags are unique within
// a region (a miss only tags a block no slot of its region holds). A short layer has no
// distant part and plans in the whole cache.
#define DISTANT_SLOT0 (SINK + LOCAL)

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

#define SHORT_LAYER(nb) ((nb) <= (u32)KSEL)

// The cache's clock: the GPU's global nanosecond timer in units of 1.024 us, as a u32 (it wraps
// every ~73 minutes; ages are differences modulo 2^32, so order holds across a wrap for slots
// used within ~36 minutes of each other).
__device__ __forceinline__ u32 lru_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (u32)(t >> 10);
}

// Plans the keep-set entries at table positions [pos0, pos0 + n0) then [pos1, pos1 + n1) of
// (batch item i, kv head kvh), whose block ids are ascending in that order, in the cache slots
// [c0, c0 + ns) (n0 + n1 <= ns). Called by a whole thread block once the ids are in global
// memory and a __syncthreads() has passed. For each entry: its cache slot (a hit, or a victim)
// and, for a miss, the host address to fetch from.
__device__ __forceinline__ void plan_tile_cache(
    u32 i, u32 kvh, const u32* row, u32 pos0, u32 n0, u32 pos1, u32 n1, u32 c0, u32 ns,
    const u32* __restrict__ sess, const u32* __restrict__ ntok, u32 layer, u32 max_blocks,
    u32* __restrict__ tags, u32* __restrict__ stamps, const u64* __restrict__ pages,
    u32* __restrict__ slot_of, u64* __restrict__ miss_src, unsigned long long* __restrict__ stats) {
    const u32 tid = threadIdx.x;
    const u32 ih = i * KV_HEADS + kvh;
    const u64 cbase = (((u64)sess[i] * NUM_LAYERS + layer) * KV_HEADS + kvh) * CACHE_SLOTS + c0;
    u32* tg = tags + cbase;
    u32* st = stamps + cbase;
    const u32 nfull = ntok[i] / BLOCK_TOKENS;  // blocks [0, nfull) are complete
    const u32 n = n0 + n1;

    __shared__ u32 s_ids[KSEL];
    __shared__ int s_hit[KSEL];
    __shared__ u64 s_src[KSEL];
    __shared__ u64 s_key[CACHE_SLOTS];
    __shared__ u32 s_victim[CACHE_SLOTS];
    __shared__ u32 s_wmiss[32];
    __shared__ u32 s_now;

    if (tid == 0) s_now = lru_now();
    for (u32 j = tid; j < n; j += blockDim.x) {
        s_ids[j] = row[j < n0 ? pos0 + j : pos1 + (j - n0)];
        s_hit[j] = -1;
    }
    __syncthreads();
    // Every entry's host address is read now, beside the slot lookups, rather than after the
    // victims are ranked: one dependent global round trip fewer (hits simply do not use it).
    const u64* pg = pages + ((u64)sess[i] * NUM_LAYERS + layer) * max_blocks;
    for (u32 j = tid; j < n; j += blockDim.x) s_src[j] = pg[s_ids[j]] + (u64)kvh * TILE_BYTES;
    const u32 now = s_now;
    // A slot hits if its tag is in the (ascending) ids: binary search.
    for (u32 c = tid; c < ns; c += blockDim.x) {
        const u32 t = tg[c];
        const u32 last = st[c];
        bool used = false;
        if (t != 0) {
            const u32 b = t - 1;
            u32 l = 0, h = n;
            while (l < h) {
                const u32 m = (l + h) >> 1;
                if (s_ids[m] < b) l = m + 1; else h = m;
            }
            if (l < n && s_ids[l] == b) {
                s_hit[l] = (int)c;
                used = true;
            }
        }
        // Victim order: empty slots first, then least recently used (the largest age), slot
        // index breaking ties (unique keys); a slot in use gets the largest key, below no other.
        s_key[c] = used ? ~0ull : ((u64)(t != 0) << 62) | ((u64)(~(now - last)) << 24) | c;
    }
    __syncthreads();
    // A free slot's victim rank is the number of free slots with smaller keys: one warp per
    // slot counts them 32 at a time with ballots. (A thread per slot walking all ns keys was
    // ~1 us of the distant plan, bench/gpu/NOTES.md v26.)
    {
        const u32 lane = tid & 31u;
        for (u32 c = tid >> 5; c < ns; c += blockDim.x >> 5) {
            const u64 k = s_key[c];
            if (k == ~0ull) continue;  // uniform across the warp
            u32 rank = 0;
            for (u32 x0 = 0; x0 < ns; x0 += 32) {
                const u32 x = x0 + lane;
                rank += __popc(__ballot_sync(FULL_MASK, x < ns && s_key[x] < k));
            }
            if (lane == 0) s_victim[rank] = c;
        }
    }
    // The r-th miss (in keep-set order) takes the r-th victim.
    auto assign = [&](u32 j, u32 r) {
        const u32 p = j < n0 ? pos0 + j : pos1 + (j - n0);
        const int hit = s_hit[j];
        u32 c;
        if (hit >= 0) {
            c = (u32)hit;
            miss_src[(u64)ih * KSEL + p] = 0;
        } else {
            c = s_victim[r];
            const u32 b = s_ids[j];
            tg[c] = b < nfull ? b + 1 : 0;
            miss_src[(u64)ih * KSEL + p] = s_src[j];
        }
        slot_of[(u64)ih * KSEL + p] = c0 + c;
        st[c] = now;
    };
    u32 misses = 0;
    if (n <= blockDim.x) {
        // One entry per thread: miss ranks from warp ballots (blockDim.x is a multiple of 32).
        const u32 lane = tid & 31u;
        const u32 w = tid >> 5;
        const bool miss = tid < n && s_hit[tid] < 0;
        const u32 bal = __ballot_sync(FULL_MASK, miss);
        if (lane == 0) s_wmiss[w] = __popc(bal);
        __syncthreads();
        u32 r = __popc(bal & ((1u << lane) - 1u));
        for (u32 x = 0; x < w; ++x) r += s_wmiss[x];
        if (tid < n) assign(tid, r);
        if (tid == 0)
            for (u32 x = 0; x < (blockDim.x >> 5); ++x) misses += s_wmiss[x];
    } else {
        __syncthreads();
        for (u32 j = tid; j < n; j += blockDim.x) {
            u32 r = 0;
            for (u32 x = 0; x < j; ++x) r += (s_hit[x] < 0);
            assign(j, r);
        }
        if (tid == 0)
            for (u32 j = 0; j < n; ++j) misses += (s_hit[j] < 0);
    }
    if (tid == 0) {
        unsigned long long* s = stats + (u64)layer * 4;
        atomicAdd(s + 0, (unsigned long long)(n - misses));
        atomicAdd(s + 1, (unsigned long long)misses);
        atomicAdd(s + 2, (unsigned long long)misses * TILE_BYTES);
        atomicAdd(s + 3, (unsigned long long)n);
    }
}

// Writes the fixed part of the keep-set row of (batch item i, kv head kvh) in
// table[batch][KV_HEADS][KSEL] (sink and local, or every block of a short layer), the row's
// size into counts[batch][KV_HEADS], and plans those tiles; a whole thread block calls it.
__device__ __forceinline__ void plan_fixed_role(
    const u32* __restrict__ ntok, u32 max_blocks, u32* table, u32* counts, const u32* __restrict__ sess, u32 layer,
    u32* __restrict__ tags, u32* __restrict__ stamps, const u64* __restrict__ pages, u32* slot_of, u64* miss_src,
    unsigned long long* __restrict__ stats, u32 kvh, u32 i) {
    K_TRACE(0);
    const u32 tid = threadIdx.x;
    const u32 nb = n_blocks_of(ntok[i]);
    u32* row = table + ((u64)i * KV_HEADS + kvh) * KSEL;
    if (SHORT_LAYER(nb)) {
        for (u32 b = tid; b < nb; b += blockDim.x) row[b] = b;
        if (tid == 0) counts[i * KV_HEADS + kvh] = nb;
        __syncthreads();
        plan_tile_cache(i, kvh, row, 0, nb, 0, 0, 0, CACHE_SLOTS, sess, ntok, layer, max_blocks, tags, stamps, pages,
                        slot_of, miss_src, stats);
    } else {
        for (u32 x = tid; x < SINK; x += blockDim.x) row[x] = x;
        for (u32 x = tid; x < LOCAL; x += blockDim.x) row[SINK + TOPK + x] = nb - LOCAL + x;
        if (tid == 0) counts[i * KV_HEADS + kvh] = KSEL;
        __syncthreads();
        plan_tile_cache(i, kvh, row, 0, SINK, SINK + TOPK, LOCAL, 0, DISTANT_SLOT0, sess, ntok, layer, max_blocks,
                        tags, stamps, pages, slot_of, miss_src, stats);
    }
}

// grid (KV_HEADS, batch), block PLAN_THREADS: plan_fixed_role for every (kv head, batch item).
#define PLAN_THREADS 128
extern "C" __global__ void __launch_bounds__(PLAN_THREADS) plan_fixed(PlanFixedParams_FIELDS) {
    plan_fixed_role(ntok, max_blocks, table, counts, sess, layer, tags, stamps, pages, slot_of, miss_src, stats,
                    blockIdx.x, blockIdx.y);
}
