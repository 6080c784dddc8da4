//! Geometry, policy and capacity of a CUDA backend, validated before anything touches the GPU.

use kvtier_storage::sketch::{padded_dims, quarters};
use kvtier_storage::{DType, Geometry, Policy, Selector};

use super::error::{CudaError, Result};
use crate::select::{candidate_units, scan_units, unit_blocks, MAX_SCAN_BLOCKS};

/// How block summaries are stored on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SummaryDtype {
    /// Exactly as the CPU holds them: selection is bit-identical to the CPU selector. Stored
    /// as fp32, or as bf16 when the KV dtype is bf16 (lossless, see
    /// [`CudaConfig::summaries_bf16`]).
    F32,
    /// bf16 rounded outward (max up, min down): half the selector's bytes, still an upper bound.
    /// Bit-identical to the CPU selector run on the same rounded summaries.
    Bf16Outward,
}

/// How attend_tile multiplies: the scores (q K^T) and the values (P V) of a tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionMath {
    /// bf16 tensor-core MMAs (m16n8k16, fp32 accumulation) where the geometry allows it: bf16
    /// KV, GQA group <= 8, head_dim and block_tokens multiples of 16, compute capability >= 8.0.
    /// The fp32 factors (q, softmax weights) are split into bf16 high and low parts, two MMAs
    /// each, so they keep ~16 bits of mantissa; elsewhere this falls back to [`Self::Simt`].
    TensorCores,
    /// fp32 FMAs on the CUDA cores, every geometry and dtype.
    Simt,
}

/// Everything a [`super::CudaBackend`] is sized from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaConfig {
    pub geometry: Geometry,
    pub policy: Policy,
    /// Session slots with device state (summaries, page table, tile cache).
    pub max_sessions: u32,
    /// Most blocks per session and layer (context capacity = max_blocks * block_tokens).
    pub max_blocks: u32,
    /// Most sessions in one decode batch.
    pub max_batch: u32,
    /// Tile-cache slots per (session, layer, kv head); at least the keep-set size.
    pub cache_slots: u32,
    pub summary_dtype: SummaryDtype,
    pub attention: AttentionMath,
}

const SMEM_LIMIT: usize = 48 * 1024;
/// Shared memory a rerank role gives its candidates' query codes at most (select.cu
/// rerank_role); past it a role takes one candidate.
const RERANK_QUERY_SMEM: usize = 8 * 1024;
/// Threads per select_score thread block: 32 octets, one octet per scored block
/// (kernels/cuda/select.cu).
pub(crate) const SCORE_THREADS: u32 = 256;
/// Most blocks each select_score octet scores in one launch (the launch picks 1, 2, 4 or 8).
pub(crate) const SCORE_NB: u32 = 8;
/// Candidate lists merged by one thread block at the first level of select.cu's two-level
/// merge (MERGE_GROUPS): 2 per warp of the merging thread block.
pub(crate) const MERGE_GROUP: u32 = 16;
/// Most candidate blocks the sketch selector's second stage ranks on the device (select.cu's
/// rerank list of 32 * RERANK_R keys, RERANK_R <= 8): the CPU's limit too.
pub const MAX_CANDIDATES: u32 = MAX_SCAN_BLOCKS as u32;
/// Most candidate units its first stage keeps (lists of 32 * LIST_R keys, LIST_R <= 4): in
/// 128-token blocks, where a unit is a block, the limit on candidates.
pub const MAX_CANDIDATE_UNITS: u32 = 128;
/// Largest opt-in shared memory per block on compute capability 8.0 / 9.0 (checked against
/// the device at backend creation too).
const SMEM_OPTIN_LIMIT: usize = 227 * 1024;
/// Threads of an attend_tile thread block. 256 measured 18.7 vs 21.5 us/layer for the hot
/// distant attention + merge at 1M tokens, k=32, batch 1 on an H200 (cold: no change);
/// bench/gpu/NOTES.md v12.
const ATT_THREADS: usize = 256;

fn invalid(reason: impl Into<String>) -> CudaError {
    CudaError::InvalidConfig {
        reason: reason.into(),
    }
}

impl CudaConfig {
    /// `sessions` slots of up to `max_blocks` blocks each, batches of up to `sessions`, a tile
    /// cache of twice the keep-set budget, tensor-core attention.
    pub fn new(
        geometry: Geometry,
        policy: Policy,
        max_blocks: u32,
        sessions: u32,
        summary_dtype: SummaryDtype,
    ) -> CudaConfig {
        CudaConfig {
            geometry,
            policy,
            max_sessions: sessions,
            max_blocks,
            max_batch: sessions,
            cache_slots: 2 * policy.budget() as u32,
            summary_dtype,
            attention: AttentionMath::TensorCores,
        }
    }

    /// Qwen2.5-7B ([`Geometry::QWEN2_5_7B`], the default policy): 8 sessions of up to 8192
    /// blocks (1M tokens), fp32 summaries.
    pub fn qwen2_5_7b() -> CudaConfig {
        CudaConfig::new(
            Geometry::QWEN2_5_7B,
            Policy::default(),
            8192,
            8,
            SummaryDtype::F32,
        )
    }

    /// Checks every limit the kernels rely on; returns the derived kernel constants.
    pub fn validate(&self) -> Result<Derived> {
        let g = &self.geometry;
        let p = &self.policy;
        if g.layers == 0 || g.q_heads == 0 || g.kv_heads == 0 || g.block_tokens == 0 {
            return Err(invalid(
                "layers, q_heads, kv_heads and block_tokens must be non-zero",
            ));
        }
        if !g.q_heads.is_multiple_of(g.kv_heads) {
            return Err(invalid(format!(
                "q_heads {} is not a multiple of kv_heads {}",
                g.q_heads, g.kv_heads
            )));
        }
        let group = g.group();
        if group > 32 {
            return Err(invalid(format!("GQA group {group} exceeds 32")));
        }
        let cpr = g.head_dim as usize * g.dtype.size() / 16;
        let att_threads = ATT_THREADS;
        if !g.head_dim.is_power_of_two() || g.head_dim < 32 || cpr == 0 || cpr > att_threads {
            return Err(invalid(format!(
                "head_dim {} unsupported: must be a power of two >= 32 with head_dim * elem / 16 <= {att_threads}",
                g.head_dim
            )));
        }
        if g.block_tokens > 1024 {
            return Err(invalid(format!(
                "block_tokens {} exceeds 1024",
                g.block_tokens
            )));
        }
        if p.top_k == 0 {
            return Err(invalid("top_k must be at least 1"));
        }
        // The sketch selector's first stage keeps its candidate units in warp lists of at most
        // MAX_CANDIDATE_UNITS keys and its second stage ranks their blocks, at most
        // MAX_CANDIDATES, in one warp; each unit is scored by its four quarter records
        // (crate::select::unit_blocks). Its rerank scores every distant block of a layer of at
        // most `scan` blocks (crate::select::scan_units).
        let (cand, scan) = match p.selector {
            Selector::Bound => (p.top_k, p.top_k),
            Selector::Sketch { candidates } => {
                let bt = g.block_tokens;
                let units = candidate_units(candidates, p.top_k, bt) as u32;
                let c = units * unit_blocks(bt) as u32;
                if units > MAX_CANDIDATE_UNITS || c > MAX_CANDIDATES {
                    return Err(invalid(format!(
                        "the CUDA sketch selector takes at most {MAX_CANDIDATE_UNITS} candidate units and {MAX_CANDIDATES} candidate blocks ({units} units, {c} blocks for candidates {candidates}, top_k {} in {bt}-token blocks)",
                        p.top_k
                    )));
                }
                let scan = scan_units(candidates, p.top_k, bt) * unit_blocks(bt);
                (c, scan as u32)
            }
        };
        if p.local_blocks == 0 {
            return Err(invalid(
                "local_blocks must be at least 1 (the tail block is always kept)",
            ));
        }
        // At most 65,535 (checked below): the u32 keep-set size the kernels are compiled with.
        let ksel = p.budget();
        if ksel > 65_535 {
            return Err(invalid(format!("keep-set size {ksel} exceeds 65535")));
        }
        if u64::from(self.cache_slots) < ksel {
            return Err(invalid(format!(
                "cache_slots {} is smaller than the keep-set size {ksel}",
                self.cache_slots
            )));
        }
        if self.max_sessions == 0 || self.max_blocks == 0 || self.max_batch == 0 {
            return Err(invalid(
                "max_sessions, max_blocks and max_batch must be non-zero",
            ));
        }
        if self.max_batch > self.max_sessions {
            return Err(invalid("max_batch exceeds max_sessions"));
        }
        if self.max_batch as u64 * g.kv_heads as u64 > 65_535 {
            return Err(invalid("max_batch * kv_heads exceeds 65535 (grid limit)"));
        }
        if (self.max_blocks as u64) * (g.block_tokens as u64) > u32::MAX as u64 {
            return Err(invalid(
                "max_blocks * block_tokens exceeds u32 token positions",
            ));
        }
        let d = g.head_dim as usize;
        let gs = group;
        let b = g.block_tokens as usize;
        // Top-k by merging per-thread-block candidate lists (select.cu) where the lists can
        // hold it: the sketch selector's candidates, or top_k <= 32; the radix select over
        // every score otherwise. A list holds 32 * list_r keys, list_r per lane of a warp.
        let topk_merge = self.sketch() || p.top_k <= 32;
        // select_topk (the radix select) keeps ceil(max_blocks / 1024) keys per thread in
        // registers; merged lists have no such limit (1M tokens in 32-token blocks and a
        // decode's worth more).
        let kpt = if topk_merge {
            1
        } else {
            (self.max_blocks as usize).div_ceil(1024)
        };
        if kpt > 32 {
            return Err(invalid(format!(
                "max_blocks {} exceeds 32768 (with top_k above 32 and the key bound)",
                self.max_blocks
            )));
        }
        // select_score: the query values, the thread block's keys and warp lists, the merge
        // tree and the distant plan.
        let q_smem = gs * d * 4;
        let st = SCORE_THREADS as usize;
        // Stage 1's lists hold the sketch selector's candidate units, the rerank's list its
        // candidate blocks (as many in 128-token blocks; G times as many in smaller ones), in
        // `rerank_r` keys per lane for a scanned layer's, `rerank_r_cand` for a longer one's.
        let (list_r, rerank_r, rerank_r_cand) = if self.sketch() {
            let units = cand / unit_blocks(g.block_tokens) as u32;
            (
                units.div_ceil(32).next_power_of_two(),
                scan.div_ceil(32).next_power_of_two(),
                cand.div_ceil(32).next_power_of_two(),
            )
        } else {
            (1, 1, 1)
        };
        let lists_smem = (SCORE_NB as usize * 32 * 2 + st * list_r as usize) * 8;
        // attend_tile: dynamic = tile (+ reduction buffer unless it fits in the dead K half).
        // Value-phase slices left after the in-warp shuffle reduction (attend.cu RSL).
        let slices = att_threads / cpr;
        let per_warp = if cpr < 32 { 32 / cpr } else { 1 };
        let red = slices / per_warp * gs * d * 4;
        let k_half = b * d * g.dtype.size();
        let red_in_tile = red <= k_half;
        let dyn_smem = g.tile_bytes() + if red_in_tile { 0 } else { red };
        let simt_static = (gs * d + gs * b + 2 * gs) * 4;
        // Tensor-core tiles (attend.cu ATT_MMA): both halves of the tile loaded in one round
        // of registers (V_EARLY), q as bf16 fragments ([D/16][32 lanes] x 16 bytes), scores in
        // rows padded by 8 floats. Devices below compute capability 8.0 compile the fp32 path
        // instead, so the shared memory asked for covers both.
        let v_early = (b * cpr).div_ceil(att_threads) <= 8;
        let att_mma = self.attention == AttentionMath::TensorCores
            && g.dtype == DType::Bf16
            && gs <= 8
            && d.is_multiple_of(16)
            && b.is_multiple_of(16)
            && v_early;
        let static_smem = if att_mma {
            let mma_static = d / 16 * 32 * 16 + (gs * (b + 8) + 2 * gs) * 4;
            simt_static.max(mma_static)
        } else {
            simt_static
        };
        if static_smem > SMEM_LIMIT || dyn_smem + static_smem > SMEM_OPTIN_LIMIT {
            return Err(invalid(format!(
                "attention needs {} bytes of shared memory (> {SMEM_OPTIN_LIMIT}) for G={gs}, D={d}, B={b}",
                dyn_smem + static_smem
            )));
        }
        let k = ksel as usize;
        let c = self.cache_slots as usize;
        // plan_tile_cache: ids, hits and host addresses per keep-set entry; key and victim
        // per slot; per-warp miss counts; the clock.
        let plan_smem = k * 16 + c * 12 + 128 + 4;
        if plan_smem > SMEM_LIMIT {
            return Err(invalid(format!(
                "gather plan needs {plan_smem} bytes of shared memory"
            )));
        }
        if self.sketch() && gs * padded_dims(d) > 32 * 1024 {
            return Err(invalid(format!(
                "the sketch selector's query codes need {} bytes of shared memory for G={gs}, D={d}",
                gs * padded_dims(d)
            )));
        }
        if q_smem + lists_smem + plan_smem > SMEM_LIMIT {
            return Err(invalid(format!(
                "selector needs {} bytes of shared memory (> {SMEM_LIMIT}) for G={gs}, D={d}",
                q_smem + lists_smem + plan_smem
            )));
        }
        // Rerank roles take SCORE_THREADS / block_tokens candidates each where a candidate's
        // tokens are whole warps (select.cu rerank_role) and their query codes (G x padded D
        // bytes a candidate) fit RERANK_QUERY_SMEM, else one.
        let bt = g.block_tokens;
        let per_candidate = gs * padded_dims(d);
        let rerank_per_role = if bt.is_multiple_of(32)
            && bt < SCORE_THREADS
            && (SCORE_THREADS / bt) as usize * per_candidate <= RERANK_QUERY_SMEM
        {
            SCORE_THREADS / bt
        } else {
            1
        };
        // Lists: at most one per 32 records (a launch scoring one record per octet), then
        // one per group of MERGE_GROUP of them (select.cu's two-level merge).
        let records = self.max_blocks as usize * self.summary_records() as usize;
        let lists = records.div_ceil(32);
        let merge_groups = lists.div_ceil(MERGE_GROUP as usize);
        let score_scratch = if topk_merge {
            (lists + merge_groups) * 32 * list_r as usize * 8
        } else {
            records * 4
        };
        Ok(Derived {
            topk_merge,
            score_scratch,
            score_counters: 1 + merge_groups,
            keep_max: ksel as u32,
            topk_per_thread: kpt.max(1) as u32,
            att_threads: att_threads as u32,
            att_dyn_smem: dyn_smem as u32,
            att_total_smem: (dyn_smem + static_smem) as u32,
            red_in_tile,
            att_mma,
            fused: topk_merge && att_threads as u32 == SCORE_THREADS,
            candidates: cand,
            scan,
            cand_stride: (32 * list_r).max(scan / unit_blocks(g.block_tokens) as u32),
            rerank_per_role,
            list_r,
            rerank_r,
            rerank_r_cand,
        })
    }

    /// Whether the device holds summaries as bf16. Besides [`SummaryDtype::Bf16Outward`], this is
    /// the case for bf16 KV with [`SummaryDtype::F32`]: the bounds of bf16 keys are bf16 values,
    /// so storing them in bf16 rounds nothing (selection stays bit-identical to the CPU) and
    /// halves the selector's bytes.
    pub fn summaries_bf16(&self) -> bool {
        self.summary_dtype == SummaryDtype::Bf16Outward
            || self.geometry.dtype == DType::Bf16
            || self.sketch()
    }

    /// Whether the policy ranks by key sketches: the device then holds each block's quarter
    /// codes in place of its bounds, and its key sketches.
    pub fn sketch(&self) -> bool {
        self.policy.selector.needs_sketches()
    }

    /// Summary records per (block, kv head) on the device: its quarters with the sketch
    /// selector (kvtier_storage::sketch::quarters: 4, 2 or 1), else one.
    pub fn summary_records(&self) -> u32 {
        if self.sketch() {
            quarters(self.geometry.block_tokens as usize) as u32
        } else {
            1
        }
    }

    /// Bytes of one (block, kv head)'s summary records on the device: its bounds (f32 or bf16),
    /// or with the sketch selector its quarters' int8 codes (maxima, then minima).
    pub fn summary_record_bytes(&self) -> usize {
        let d = self.geometry.head_dim as usize;
        if self.sketch() {
            self.summary_records() as usize * 2 * d
        } else {
            2 * d * if self.summaries_bf16() { 2 } else { 4 }
        }
    }

    /// Bytes of one (block, kv head)'s key sketch on the device: the codes of its keys, then
    /// its f32 channel scales (kvtier_storage::sketch's layout). 0 without the sketch
    /// selector.
    pub fn sketch_record_bytes(&self) -> usize {
        if !self.sketch() {
            return 0;
        }
        let g = &self.geometry;
        g.block_tokens as usize * padded_dims(g.head_dim as usize) / 2 + 4 * g.head_dim as usize
    }

    /// The -D defines the kernels are compiled with.
    pub(crate) fn defines(&self, derived: &Derived) -> Vec<String> {
        let g = &self.geometry;
        let p = &self.policy;
        [
            ("HEAD_DIM", g.head_dim),
            ("GROUP", g.group() as u32),
            ("KV_HEADS", g.kv_heads),
            ("BLOCK_TOKENS", g.block_tokens),
            ("NUM_LAYERS", g.layers),
            ("ELEM_KIND", u32::from(g.dtype.code())),
            ("SUM_BF16", u32::from(self.summaries_bf16())),
            ("SINK", p.sink_blocks),
            ("LOCAL", p.local_blocks),
            ("TOPK", p.top_k),
            ("KSEL", derived.keep_max),
            ("CACHE_SLOTS", self.cache_slots),
            ("TOPK_KPT", derived.topk_per_thread),
            ("TOPK_MERGE", u32::from(derived.topk_merge)),
            ("RED_IN_TILE", u32::from(derived.red_in_tile)),
            ("ATT_MMA", u32::from(derived.att_mma)),
            ("ATT_THREADS", derived.att_threads),
            ("SCORE_THREADS", SCORE_THREADS),
            ("SCORE_NB", SCORE_NB),
            ("MERGE_GROUP", MERGE_GROUP),
            ("SKETCH", u32::from(self.sketch())),
            ("CAND", derived.candidates),
            ("SCAN", derived.scan),
            ("CANDW", derived.cand_stride),
            ("RERANK_PER_ROLE", derived.rerank_per_role),
            ("LIST_R", derived.list_r),
            ("RERANK_R", derived.rerank_r),
            ("RERANK_R_CAND", derived.rerank_r_cand),
            ("QUARTERS", self.summary_records()),
            ("PD", padded_dims(g.head_dim as usize) as u32),
        ]
        .iter()
        .map(|(k, v)| format!("-D{k}={v}"))
        .collect()
    }
}

/// Kernel constants derived from a validated config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Derived {
    /// Whether select_score merges its per-thread-block candidate lists (the sketch selector,
    /// or top_k <= 32) instead of select_topk running a radix select over every score.
    pub topk_merge: bool,
    /// Bytes of selector scratch per (batch item, kv head): the candidate lists or the scores.
    pub score_scratch: usize,
    /// select_score's completion counters per (batch item, kv head): the kv head's, then one
    /// per merge group.
    pub score_counters: usize,
    /// Keep-set size bound per kv head (sink + local + top_k).
    pub keep_max: u32,
    /// Distant candidates per select_topk thread (registers).
    pub topk_per_thread: u32,
    /// Threads per attend_tile thread block.
    pub att_threads: u32,
    /// Dynamic shared memory of attend_tile in bytes.
    pub att_dyn_smem: u32,
    /// Static + dynamic shared memory of attend_tile in bytes.
    pub att_total_smem: u32,
    /// Whether the value-phase reduction reuses the tile's K half.
    pub red_in_tile: bool,
    /// Whether attend_tile uses tensor cores ([`AttentionMath::TensorCores`] and a geometry
    /// that allows them).
    pub att_mma: bool,
    /// Whether layer_fused can run a layer (but its merge) in one launch: the list-merge
    /// top-k, and as many attention threads as scoring threads.
    pub fused: bool,
    /// Blocks the selector's first stage keeps: the sketch selector's candidate blocks (those
    /// of `crate::select::candidate_units`), else top_k.
    pub candidates: u32,
    /// Distant blocks up to which the sketch selector's second stage scores every distant
    /// block (those of `crate::select::scan_units`; at least `candidates`): the rerank roles
    /// and list are sized for it.
    pub scan: u32,
    /// Candidate units held per (batch item, kv head) (select.cu CANDW): the first stage's
    /// list, or every distant unit of a layer within `scan`.
    pub cand_stride: u32,
    /// Candidates each rerank role of the sketch selector scores.
    pub rerank_per_role: u32,
    /// Keys per lane of a candidate list (1, 2 or 4): a list holds `32 * list_r` keys, at
    /// least the candidate units with the sketch selector.
    pub list_r: u32,
    /// Keys per lane of the sketch selector's rerank list (1, 2, 4 or 8): at least `scan`.
    pub rerank_r: u32,
    /// Keys per lane of the rerank list of a layer past `scan`: at least `candidates`.
    pub rerank_r_cand: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen() -> CudaConfig {
        CudaConfig::qwen2_5_7b()
    }

    #[test]
    fn qwen_geometry_is_valid() {
        assert_eq!(qwen().cache_slots, 74);
        let d = qwen().validate().unwrap();
        assert_eq!(d.keep_max, 37);
        // The sketch selector merges lists: the radix select's registers are not used.
        assert_eq!(d.topk_per_thread, 1);
        assert!(d.red_in_tile);
        assert!(d.att_mma);
        assert_eq!(d.att_dyn_smem, 64 * 1024);
        let mut c = qwen();
        c.attention = AttentionMath::Simt;
        assert!(!c.validate().unwrap().att_mma);
        assert_eq!(qwen().geometry.block_bytes(), 256 * 1024);
    }

    /// Tensor cores only where attend.cu's fragments fit; every other geometry takes fp32.
    #[test]
    fn tensor_core_attention_falls_back_outside_its_geometry() {
        let mma = |f: &dyn Fn(&mut CudaConfig)| {
            let mut c = qwen();
            f(&mut c);
            c.validate().map(|d| d.att_mma).map_err(|e| e.to_string())
        };
        assert_eq!(mma(&|c| c.geometry.block_tokens = 16), Ok(true));
        assert_eq!(mma(&|c| c.geometry.q_heads = 32), Ok(true)); // group 8
        assert_eq!(mma(&|c| c.geometry.q_heads = 36), Ok(false)); // group 9
        assert_eq!(mma(&|c| c.geometry.dtype = DType::F16), Ok(false));
        assert_eq!(mma(&|c| c.geometry.dtype = DType::F32), Ok(false));
        assert_eq!(mma(&|c| c.geometry.block_tokens = 24), Ok(false));
        // 512 rows x 8 chunks are 16 loads per thread per half: not V_EARLY.
        let long_rows = |c: &mut CudaConfig| {
            c.geometry.block_tokens = 512;
            c.geometry.head_dim = 64;
        };
        assert_eq!(mma(&long_rows), Ok(false));
        let mut c = qwen();
        c.geometry.q_heads = 32;
        let d = c.validate().unwrap();
        // q fragments (4 KiB) outgrow the fp32 q (4 KiB at group 8) plus padded score rows.
        assert_eq!(
            d.att_total_smem as usize,
            64 * 1024 + 128 * 32 + (8 * 136 + 16) * 4
        );
    }

    #[test]
    fn bad_configs_are_rejected() {
        let bad: [fn(&mut CudaConfig); 10] = [
            |c| c.geometry.q_heads = 30,
            |c| c.geometry.head_dim = 96,
            |c| c.cache_slots = 36,
            |c| c.policy.top_k = 0,
            |c| c.policy.local_blocks = 0,
            |c| c.max_batch = 9,
            |c| c.geometry.q_heads = 4 * 33,
            |c| {
                // The radix select (the key bound, top_k > 32) holds at most 32,768 blocks.
                c.policy = Policy::bound(1, 4, 64);
                c.max_blocks = 40_000;
            },
            |c| {
                c.geometry.block_tokens = 1024;
                c.geometry.dtype = DType::F32;
            },
            |c| c.geometry.kv_heads = 0,
        ];
        let mut radix = qwen();
        radix.policy = Policy::bound(1, 4, 64);
        assert_eq!(radix.validate().unwrap().topk_per_thread, 8);
        for (i, f) in bad.iter().enumerate() {
            let mut c = qwen();
            f(&mut c);
            assert!(
                matches!(c.validate(), Err(CudaError::InvalidConfig { .. })),
                "case {i}"
            );
        }
    }

    /// The sketch selector's first stage takes units of four quarter records: its lists hold
    /// the units, the rerank's list their blocks; 1M tokens in 32-token blocks fit.
    #[test]
    fn sketch_candidates_are_whole_units() {
        let at = |bt: u32, k: u32, c: u32| {
            let mut cfg = qwen();
            cfg.geometry.block_tokens = bt;
            cfg.policy = Policy::sketch(128 / bt, 512 / bt, k, c);
            cfg.max_blocks = (1u32 << 20) / bt + 64;
            cfg.cache_slots = 74 * 128 / bt;
            cfg.validate().unwrap()
        };
        // (blocks, k, candidates) -> candidate blocks, scan blocks, list_r, rerank_r (for the
        // scan) and rerank_r_cand.
        for (bt, k, c, cand, scan, list_r, rerank_r, rerank_r_cand) in [
            (128, 8, 64, 64, 128, 2, 4, 2),
            (128, 8, 128, 128, 128, 4, 4, 4),
            (64, 16, 64, 64, 256, 1, 8, 2),
            (64, 16, 128, 128, 256, 2, 8, 4),
            (32, 32, 128, 128, 256, 1, 8, 4),
            (32, 32, 8, 40, 256, 1, 8, 2), // never fewer than k + 2 (G - 1) blocks
            (32, 32, 256, 256, 256, 2, 8, 8),
        ] {
            let d = at(bt, k, c);
            assert_eq!(
                (d.candidates, d.scan, d.list_r, d.rerank_r, d.rerank_r_cand),
                (cand, scan, list_r, rerank_r, rerank_r_cand),
                "{bt}-token blocks, k {k}, {c} candidates"
            );
        }
    }
}
