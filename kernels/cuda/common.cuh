// Shared definitions for the kvtier CUDA kernels. Compiled with NVRTC at run time; the
// geometry and policy arrive as -D defines (see kernels/src/cuda/module.rs), so every loop
// bound below is a compile-time constant and no CUDA headers are needed.
//
// Required defines: HEAD_DIM, GROUP (query heads per kv head), KV_HEADS, BLOCK_TOKENS,
// NUM_LAYERS, ELEM_KIND (0 bf16, 1 f16, 2 f32), SUM_BF16 (0 f32 summaries, 1 bf16),
// SINK, LOCAL, TOPK, KSEL (= max keep-set size per kv head), CACHE_SLOTS, TOPK_KPT, SCORE_NB,
// RED_IN_TILE, ATT_THREADS, SCORE_THREADS, TOPK_MERGE (see kernels/src/cuda/config.rs).

#define HQ (KV_HEADS * GROUP)
#if ELEM_KIND == 2
typedef unsigned int elem_t;
#define ELEM_BYTES 4
#else
typedef unsigned short elem_t;
#define ELEM_BYTES 2
#endif
// Elements per 16-byte vector and 16-byte chunks per head-dim row.
#define VEC (16 / ELEM_BYTES)
#define CPR (HEAD_DIM / VEC)
// One tile = K [BLOCK_TOKENS x HEAD_DIM] then V, same shape.
#define TILE_ELEMS (2 * BLOCK_TOKENS * HEAD_DIM)
#define TILE_BYTES ((unsigned long long)TILE_ELEMS * ELEM_BYTES)
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ float bf16_bits_to_f32(unsigned int h) {
    return __uint_as_float(h << 16);
}

__device__ __forceinline__ float f16_bits_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Unpacks one 16-byte vector of KV elements into VEC floats.
__device__ __forceinline__ void unpack16(const uint4 v, float* out) {
#if ELEM_KIND == 2
    out[0] = __uint_as_float(v.x);
    out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z);
    out[3] = __uint_as_float(v.w);
#else
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#if ELEM_KIND == 0
        out[2 * k] = bf16_bits_to_f32(w[k] & 0xffffu);
        out[2 * k + 1] = bf16_bits_to_f32(w[k] >> 16);
#else
        out[2 * k] = f16_bits_to_f32((unsigned short)(w[k] & 0xffffu));
        out[2 * k + 1] = f16_bits_to_f32((unsigned short)(w[k] >> 16));
#endif
    }
#endif
}

__device__ __forceinline__ u32 n_blocks_of(u32 n_tokens) {
    return (n_tokens + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
}
