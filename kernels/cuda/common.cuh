// Shared definitions for the kvtier CUDA kernels. Compiled with NVRTC at run time; the
// geometry and policy arrive as -D defines (see kernels/src/cuda/module.rs), so every loop
// bound below is a compile-time constant and no CUDA headers are needed.
//
// Required defines: HEAD_DIM, GROUP (query heads per kv head), KV_HEADS, BLOCK_TOKENS,
// NUM_LAYERS, ELEM_KIND (0 bf16, 1 f16, 2 f32), SUM_BF16 (0 f32 summaries, 1 bf16),
// SINK, LOCAL, TOPK, KSEL (= max keep-set size per kv head), CACHE_SLOTS, TOPK_KPT, SCORE_NB,
// SKETCH (the sketch selector), CAND (its candidate blocks, or TOPK), SCAN (distant blocks up to
// which it scores every one), CANDW (candidate units per kv head), LIST_R (keys per lane of a
// candidate list), RERANK_R and RERANK_R_CAND (of the sketch selector's rerank list for SCAN and
// for CAND keys), QUARTERS (summary records per block), PD (head dim padded to 32: a key
// sketch's codes),
// RED_IN_TILE, ATT_THREADS, SCORE_THREADS, TOPK_MERGE (see kernels/src/cuda/config.rs).
//
// Kernel parameters are declared once, in Rust (kernels/src/cuda/params/mod.rs): each kernel's
// parameter list is generated from its struct there (`#define AttendTileParams_FIELDS const
// float* __restrict__ q, ...`), inserted by module.rs between this file and the kernels, and
// each kernel is declared with it: `attend_tile(AttendTileParams_FIELDS)`.

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

// One KV element as a float.
__device__ __forceinline__ float elem_to_f32(elem_t x) {
#if ELEM_KIND == 0
    return bf16_bits_to_f32(x);
#elif ELEM_KIND == 1
    return f16_bits_to_f32(x);
#else
    return __uint_as_float(x);
#endif
}

// Ready flags of layer_fused's handoffs between roles (select.cu): gpu-scope release store and
// acquire load of a u32 stamp.
__device__ __forceinline__ void st_release(u32* p, u32 v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Waits (thread 0 spinning, then the whole thread block) until `flag` holds `stamp`.
__device__ __forceinline__ void wait_ready(const u32* flag, u32 stamp) {
    if (threadIdx.x == 0)
        while (ld_acquire(flag) != stamp) __nanosleep(32);
    __syncthreads();
}

// Publishes a thread block's global writes: every thread's are visible before `flag` holds
// `stamp`.
__device__ __forceinline__ void signal_ready(u32* flag, u32 stamp) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) st_release(flag, stamp);
}

// Programmatic dependent launch (compute capability 9.0+; no-ops below it and in a grid
// launched without the attribute). Within a call the host launches each layer's merge, and the
// next layer's layer_fused, with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
// (CudaBackend::launch_after): such a grid may start once every thread block of the kernel
// before it has called pdl_trigger or exited. Tile roles trigger once their tile's bytes have
// arrived, the merge at its start, so the next layer's plan and host-frame reads start as the
// link frees up (bench/gpu/NOTES.md v30). Until pdl_wait returns (the kernel before complete,
// its writes visible) a thread block may only touch what no unfinished kernel still uses:
// host frames, block summaries, its own layer's table, counts, cache tags and slots, and the
// shared slot_of/miss_src entries and ready flags (stamped per layer), which every thread
// block of the previous layer has read or waited on before it triggered. q, the partials and
// the selector's scratch come after the wait: in an engine the next layer's query is
// computed from this layer's output.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ u32 n_blocks_of(u32 n_tokens) {
    return (n_tokens + BLOCK_TOKENS - 1) / BLOCK_TOKENS;
}

// Diagnostics (bench/gpu/NOTES.md v24): with -DSEL_TRACE=1 (KVTIER_NVRTC_DEFINES) thread 0 of
// every score role (select.cu) stamps %globaltimer and clock64 at its phase boundaries into
// sel_trace[role][16] (slots 0-7 the global time in ns, 8-15 the SM clock; slots 6-7, the
// merge and the plan, are zero except in a kv head's last thread block).
#ifndef SEL_TRACE
#define SEL_TRACE 0
#endif
#if SEL_TRACE
#define SEL_TRACE_BLOCKS 4096
__device__ unsigned long long sel_trace[SEL_TRACE_BLOCKS * 16];
__device__ __forceinline__ u64 gtime() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void sel_stamp(u32 cta, u32 k, bool clear) {
    if (threadIdx.x != 0 || cta >= SEL_TRACE_BLOCKS) return;
    sel_trace[cta * 16 + k] = clear ? 0ull : gtime();
    sel_trace[cta * 16 + 8 + k] = clear ? 0ull : clock64();
}
// Uses the caller's `sel_cta`: its score role's index (the same in split and fused launches).
#define SEL_STAMP(k) sel_stamp(sel_cta, k, false)
#define SEL_CLEAR(k) sel_stamp(sel_cta, k, true)
// Every kernel's thread 0 also raises k_trace[kind][0] to its thread block's start time and
// k_trace[kind][1] to its end (kinds: 0 plan_fixed, 1 attend_tile fixed part, 2 select_score,
// 3 attend_tile distant part, 4 attend_merge): after a step, the last layer's latest starts
// and ends, the timeline of one layer across both streams.
__device__ unsigned long long k_trace[5 * 2];
struct KTrace {
    u32 kind;
    __device__ __forceinline__ explicit KTrace(u32 k) : kind(k) {
        if (threadIdx.x == 0) atomicMax(&k_trace[kind * 2], gtime());
    }
    __device__ __forceinline__ ~KTrace() {
        if (threadIdx.x == 0) atomicMax(&k_trace[kind * 2 + 1], gtime());
    }
};
#define K_TRACE(kind) const KTrace k_trace_scope_(kind)
#else
#define SEL_STAMP(k)
#define SEL_CLEAR(k)
#define K_TRACE(kind)
#endif
