//! Session geometry, the tile layout it implies, and the selection policy.

use crate::dtype::DType;
use crate::ModelError;

type Result<T> = std::result::Result<T, ModelError>;

/// Largest values accepted; they bound every size computed from a geometry so none overflows.
pub const MAX_LAYERS: u32 = 1024;
pub const MAX_HEADS: u32 = 1024;
pub const MAX_HEAD_DIM: u32 = 1024;
pub const MAX_BLOCK_TOKENS: u32 = 4096;

/// Attention geometry of one session: the shape of its KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Geometry {
    pub layers: u32,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub dtype: DType,
    /// Tokens per block (B); the unit of selection and transfer.
    pub block_tokens: u32,
}

impl Geometry {
    /// Qwen2.5-7B attention geometry, the reference model of the design brief.
    pub const QWEN2_5_7B: Geometry = Geometry::new(28, 28, 4, 128, DType::Bf16, 128);

    /// A geometry from its fields, in declaration order (not validated: see [`Self::validate`]).
    pub const fn new(
        layers: u32,
        q_heads: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: DType,
        block_tokens: u32,
    ) -> Geometry {
        Geometry {
            layers,
            q_heads,
            kv_heads,
            head_dim,
            dtype,
            block_tokens,
        }
    }

    /// Checks every field; the error names the field and says what is wrong.
    pub fn validate(&self) -> Result<()> {
        fn bad(field: &'static str, reason: String) -> Result<()> {
            Err(ModelError::InvalidGeometry { field, reason })
        }
        let in_range = |field, v: u32, max: u32| {
            if v == 0 || v > max {
                bad(field, format!("must be in 1..={max}, got {v}"))
            } else {
                Ok(())
            }
        };
        in_range("layers", self.layers, MAX_LAYERS)?;
        in_range("q_heads", self.q_heads, MAX_HEADS)?;
        in_range("kv_heads", self.kv_heads, MAX_HEADS)?;
        in_range("head_dim", self.head_dim, MAX_HEAD_DIM)?;
        in_range("block_tokens", self.block_tokens, MAX_BLOCK_TOKENS)?;
        if !self.q_heads.is_multiple_of(self.kv_heads) {
            return bad(
                "q_heads",
                format!(
                    "must be a multiple of kv_heads ({} is not a multiple of {})",
                    self.q_heads, self.kv_heads
                ),
            );
        }
        Ok(())
    }

    /// Query heads per KV head (G).
    pub fn group(&self) -> usize {
        (self.q_heads / self.kv_heads) as usize
    }

    /// Bytes of one K (or V) row of one head: D elements.
    pub fn row_bytes(&self) -> usize {
        self.head_dim as usize * self.dtype.size()
    }

    /// Bytes of one K tile (or one V tile): B x D elements.
    pub fn half_tile_bytes(&self) -> usize {
        self.block_tokens as usize * self.row_bytes()
    }

    /// Bytes of one tile: the K tile followed by the V tile of one (layer, block, kv-head).
    pub fn tile_bytes(&self) -> usize {
        2 * self.half_tile_bytes()
    }

    /// Bytes of one (layer, block) run: the tiles of all KV heads back to back.
    pub fn block_bytes(&self) -> usize {
        self.kv_heads as usize * self.tile_bytes()
    }

    /// Byte offset of the K tile of `kv_head` inside a block run; the V tile follows it.
    pub fn tile_offset(&self, kv_head: usize) -> usize {
        kv_head * self.tile_bytes()
    }

    /// Byte offset of token `slot`'s K row of `kv_head` inside a block run.
    pub fn k_row_offset(&self, kv_head: usize, slot: usize) -> usize {
        self.tile_offset(kv_head) + slot * self.row_bytes()
    }

    /// Byte offset of token `slot`'s V row of `kv_head` inside a block run.
    pub fn v_row_offset(&self, kv_head: usize, slot: usize) -> usize {
        self.k_row_offset(kv_head, slot) + self.half_tile_bytes()
    }

    /// Bytes of K (or V) for one token of one layer, all KV heads: the engine's `[Hkv, D]` row.
    pub fn token_bytes(&self) -> usize {
        self.kv_heads as usize * self.row_bytes()
    }

    /// KV bytes per token over all layers (K and V): 57,344 for Qwen2.5-7B in bf16.
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.layers as usize * self.token_bytes()
    }

    /// f32 elements of one layer-block's summaries: `[kv_head][max|min][D]`.
    pub fn summary_floats_per_block(&self) -> usize {
        self.kv_heads as usize * 2 * self.head_dim as usize
    }

    /// Number of blocks holding `tokens` tokens.
    pub fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_tokens as u64)
    }

    // Checked sizes for geometries not validated yet (a request straight off the wire).

    /// Bytes of one query `[Hq][D]` f32 (also one decode output). None on overflow.
    pub fn q_bytes(&self) -> Option<u64> {
        u64::from(self.q_heads)
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(4)
    }

    /// Bytes of one token's K (or V) for one layer, `[Hkv][D]` in dtype. None on overflow.
    pub fn kv_token_bytes(&self) -> Option<u64> {
        u64::from(self.kv_heads)
            .checked_mul(u64::from(self.head_dim))?
            .checked_mul(self.dtype.size() as u64)
    }

    /// Bytes of an APPEND_KV payload of `n_tokens`: for every layer K `[n][Hkv][D]` then
    /// V `[n][Hkv][D]`. None on overflow.
    pub fn append_payload_bytes(&self, n_tokens: u32) -> Option<u64> {
        self.kv_token_bytes()?
            .checked_mul(u64::from(n_tokens))?
            .checked_mul(2)?
            .checked_mul(u64::from(self.layers))
    }
}

/// How a decode step ranks a kv head's distant blocks to pick the top-k.
///
/// Both rules read only what lives beside the blocks in RAM (summaries, sketches), never the
/// blocks themselves, so selection never waits for a colder tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize),
    serde(tag = "kind", rename_all = "lowercase")
)]
pub enum Selector {
    /// Quest-style key bounds: a block's score is the largest, over the group's query heads,
    /// of an upper bound on its keys' logits from the element-wise max and min of its keys.
    /// Cheap (one summary per block) but loose on varied text: kept for comparison and for
    /// sessions created before the sketch selector.
    Bound,
    /// Two stages: the `max(candidates, top_k)` best distant blocks by their quarter bounds
    /// (a key bound per quarter of the block from int8 codes of its keys' extremes, the
    /// largest over the quarters and the group's query heads) are the candidates; they are
    /// ranked by int4 key sketches (one scale per channel of a block; a block's score is its
    /// best sketched logit over its tokens and the group's heads), and the top-k kept.
    /// `candidates` at least the number of distant blocks scores every block's sketch.
    Sketch { candidates: u32 },
}

impl Selector {
    /// Wire and manifest code: 0 bound, 1 sketch.
    pub fn code(&self) -> u32 {
        match self {
            Selector::Bound => 0,
            Selector::Sketch { .. } => 1,
        }
    }

    /// The selector of a wire or manifest code and its candidate count (ignored for the
    /// bound); `None` for an unknown code.
    pub fn from_code(code: u32, candidates: u32) -> Option<Selector> {
        match code {
            0 => Some(Selector::Bound),
            1 => Some(Selector::Sketch { candidates }),
            _ => None,
        }
    }

    /// The candidate count on the wire and in the manifest (0 for the bound).
    pub const fn candidates(&self) -> u32 {
        match self {
            Selector::Bound => 0,
            Selector::Sketch { candidates } => *candidates,
        }
    }

    /// Whether sessions under this selector keep per-token key sketches.
    pub fn needs_sketches(&self) -> bool {
        matches!(self, Selector::Sketch { .. })
    }
}

/// Candidates per kv head of the default sketch selector (see [`Selector::Sketch`]).
pub const DEFAULT_CANDIDATES: u32 = 64;

impl Default for Selector {
    fn default() -> Self {
        Selector::Sketch {
            candidates: DEFAULT_CANDIDATES,
        }
    }
}

/// Which blocks a decode step keeps: sink blocks, the local window, and the top-k distant blocks
/// as ranked by the selector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Policy {
    pub sink_blocks: u32,
    pub local_blocks: u32,
    pub top_k: u32,
    pub selector: Selector,
}

impl Default for Policy {
    /// 1 sink, 4 local, top-32 distant, ranked by the sketch selector.
    fn default() -> Self {
        Policy {
            sink_blocks: 1,
            local_blocks: 4,
            top_k: 32,
            selector: Selector::default(),
        }
    }
}

/// Upper bound on each policy field: a keep-set larger than this is dense attention in disguise.
pub const MAX_POLICY_BLOCKS: u32 = 1 << 20;

impl Policy {
    /// The policy with the old bound selector (the rule before sketches).
    pub const fn bound(sink_blocks: u32, local_blocks: u32, top_k: u32) -> Policy {
        Policy {
            sink_blocks,
            local_blocks,
            top_k,
            selector: Selector::Bound,
        }
    }

    /// The policy with the sketch selector and `candidates` per kv head.
    pub const fn sketch(
        sink_blocks: u32,
        local_blocks: u32,
        top_k: u32,
        candidates: u32,
    ) -> Policy {
        Policy {
            sink_blocks,
            local_blocks,
            top_k,
            selector: Selector::Sketch { candidates },
        }
    }

    pub fn validate(&self) -> Result<()> {
        for (field, v) in [
            ("sink_blocks", self.sink_blocks),
            ("local_blocks", self.local_blocks),
            ("top_k", self.top_k),
            ("candidates", self.selector.candidates()),
        ] {
            if v > MAX_POLICY_BLOCKS {
                return Err(ModelError::InvalidPolicy {
                    field,
                    reason: format!("must be at most {MAX_POLICY_BLOCKS}, got {v}"),
                });
            }
        }
        if self.local_blocks == 0 {
            // The newest token must always be attended to; it lives in the tail block.
            return Err(ModelError::InvalidPolicy {
                field: "local_blocks",
                reason: "must be at least 1 (the tail block holds the current token)".into(),
            });
        }
        Ok(())
    }

    /// Blocks kept per KV head when a context has at least this many blocks.
    pub fn budget(&self) -> u64 {
        self.sink_blocks as u64 + self.local_blocks as u64 + self.top_k as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen_sizes_match_the_design_brief() {
        let g = Geometry::QWEN2_5_7B;
        g.validate().unwrap();
        assert_eq!(g.group(), 7);
        assert_eq!(g.tile_bytes(), 64 * 1024);
        assert_eq!(g.block_bytes(), 256 * 1024);
        assert_eq!(g.kv_bytes_per_token(), 57_344);
        assert_eq!(g.v_row_offset(1, 2), 64 * 1024 + 32 * 1024 + 2 * 256);
    }

    #[test]
    fn invalid_geometry_names_the_field() {
        let mut g = Geometry::QWEN2_5_7B;
        g.q_heads = 30;
        let e = g.validate().unwrap_err().to_string();
        assert!(
            e.contains("q_heads") && e.contains("multiple of kv_heads"),
            "{e}"
        );
        let mut g = Geometry::QWEN2_5_7B;
        g.head_dim = 0;
        assert!(g.validate().unwrap_err().to_string().contains("head_dim"));
        let mut g = Geometry::QWEN2_5_7B;
        g.block_tokens = MAX_BLOCK_TOKENS + 1;
        assert!(g
            .validate()
            .unwrap_err()
            .to_string()
            .contains("block_tokens"));
    }

    #[test]
    fn policy_needs_a_local_block() {
        let p = Policy {
            local_blocks: 0,
            ..Policy::default()
        };
        assert!(p
            .validate()
            .unwrap_err()
            .to_string()
            .contains("local_blocks"));
        Policy::default().validate().unwrap();
    }

    #[test]
    fn sketch_policies_validate_their_candidates() {
        Policy::sketch(1, 4, 8, 0).validate().unwrap();
        Policy::bound(1, 4, 8).validate().unwrap();
        let e = Policy::sketch(1, 4, 8, MAX_POLICY_BLOCKS + 1)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("candidates"), "{e}");
        for s in [Selector::Bound, Selector::Sketch { candidates: 9 }] {
            assert_eq!(Selector::from_code(s.code(), s.candidates()), Some(s));
        }
        assert_eq!(Selector::from_code(2, 0), None);
    }
}
