// Zero-copy gather planning with a per-(session, layer, kv-head) GPU tile cache, run at the
// end of select_topk. The fetch itself happens in attend_tile (attend.cu), which reads misses
// straight from mapped host memory.
//
// Cache: CACHE_SLOTS tile slots per (session, layer, kv head), LRU by the step stamp of the
// last use. tags[] holds block+1 (0 = empty, so a zeroed buffer is an empty cache). Only tiles
// of blocks that were FULL when fetched are tagged: a partial tail block changes with every
// appended token, so it is refetched until it is full (append-only positions make full blocks
// immutable). Exactly one thread block handles one (session, kv head) of a layer, so the
// bookkeeping needs no atomics; a batch must not name a session twice (checked in Rust).
// CACHE_SLOTS >= KSEL (checked in Rust), so there are always enough unselected victims.

// Called by the whole thread block of select_topk for (batch item i, kv head kvh) once the
// keep-set ids[0..n) (ascending) is in global memory and a __syncthreads() has passed.
__device__ __forceinline__ void plan_tile_cache(
    u32 i, u32 kvh, u32 n, const u32* ids, const u32* __restrict__ sess, const u32* __restrict__ ntok,
    u32 layer, u32 max_blocks, u32* __restrict__ tags, u32* __restrict__ stamps, const u64* __restrict__ pages,
    u32* __restrict__ slot_of, u64* __restrict__ miss_src, unsigned long long* __restrict__ stats, u32 stamp) {
    const u32 tid = threadIdx.x;
    const u32 ih = i * KV_HEADS + kvh;
    const u64 cbase = (((u64)sess[i] * NUM_LAYERS + layer) * KV_HEADS + kvh) * CACHE_SLOTS;
    u32* tg = tags + cbase;
    u32* st = stamps + cbase;
    const u32 nfull = ntok[i] / BLOCK_TOKENS;  // blocks [0, nfull) are complete

    __shared__ u32 s_ids[KSEL];
    __shared__ int s_hit[KSEL];
    __shared__ unsigned char s_used[CACHE_SLOTS];
    __shared__ u64 s_key[CACHE_SLOTS];
    __shared__ u32 s_victim[CACHE_SLOTS];
    __shared__ int s_slot[KSEL];
    __shared__ u32 s_nmiss;

    for (u32 j = tid; j < n; j += blockDim.x) {
        s_ids[j] = ids[j];
        s_hit[j] = -1;
    }
    __syncthreads();
    // A slot hits if its tag is in the (ascending) keep-set: binary search.
    for (u32 c = tid; c < CACHE_SLOTS; c += blockDim.x) {
        const u32 t = tg[c];
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
        s_used[c] = used;
        // Victim order: empty slots first, then least recently used; slot index breaks ties.
        s_key[c] = ((t == 0 ? 0ull : (u64)st[c] + 1ull) << 32) | c;
    }
    __syncthreads();
    for (u32 c = tid; c < CACHE_SLOTS; c += blockDim.x) {
        if (s_used[c]) continue;
        const u64 k = s_key[c];
        u32 rank = 0;
        for (u32 x = 0; x < CACHE_SLOTS; ++x) rank += (!s_used[x] && s_key[x] < k);
        s_victim[rank] = c;
    }
    __syncthreads();
    if (tid == 0) {
        u32 r = 0;
        for (u32 j = 0; j < n; ++j) s_slot[j] = s_hit[j] >= 0 ? s_hit[j] : (int)s_victim[r++];
        s_nmiss = r;
    }
    __syncthreads();
    const u64* pg = pages + ((u64)sess[i] * NUM_LAYERS + layer) * max_blocks;
    for (u32 j = tid; j < n; j += blockDim.x) {
        const u32 c = (u32)s_slot[j];
        const u32 b = s_ids[j];
        slot_of[(u64)ih * KSEL + j] = c;
        st[c] = stamp;
        if (s_hit[j] >= 0) {
            miss_src[(u64)ih * KSEL + j] = 0;
        } else {
            tg[c] = b < nfull ? b + 1 : 0;
            miss_src[(u64)ih * KSEL + j] = pg[b] + (u64)kvh * TILE_BYTES;
        }
    }
    if (tid == 0) {
        unsigned long long* s = stats + (u64)layer * 4;
        atomicAdd(s + 0, (unsigned long long)(n - s_nmiss));
        atomicAdd(s + 1, (unsigned long long)s_nmiss);
        atomicAdd(s + 2, (unsigned long long)s_nmiss * TILE_BYTES);
        atomicAdd(s + 3, (unsigned long long)n);
    }
}
