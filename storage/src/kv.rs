//! The KV cache of one session: per layer, a block table of arena frames and the blocks'
//! key-bound summaries, grown by appends that never reorder or rewrite positions.

use crate::arena::{Frame, HostArena};
use crate::error::{Result, StorageError};
use crate::geometry::{Geometry, MAX_HEAD_DIM};

struct LayerKv {
    tokens: u64,
    /// Frame of block `b` at index `b`.
    frames: Vec<Frame>,
    /// `[block][kv_head][max|min][D]` in f32 of the stored (dtype-rounded) keys.
    summaries: Vec<f32>,
}

/// One session's full KV cache in the host tier.
pub struct KvCache {
    geo: Geometry,
    arena: HostArena,
    layers: Vec<LayerKv>,
    max_tokens: u64,
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("geometry", &self.geo)
            .field("tokens", &self.min_tokens())
            .finish()
    }
}

impl KvCache {
    /// An empty cache. Fails if the geometry is invalid or a block run does not fit a frame.
    pub fn new(geo: Geometry, arena: HostArena) -> Result<Self> {
        geo.validate()?;
        if geo.block_bytes() > arena.frame_bytes() {
            return Err(StorageError::BlockTooLarge {
                block_bytes: geo.block_bytes(),
                frame_bytes: arena.frame_bytes(),
            });
        }
        let layers = (0..geo.layers)
            .map(|_| LayerKv {
                tokens: 0,
                frames: Vec::new(),
                summaries: Vec::new(),
            })
            .collect();
        Ok(KvCache {
            geo,
            arena,
            layers,
            // Block indices are u32 everywhere (selections, page tables, the wire).
            max_tokens: u32::MAX as u64 * geo.block_tokens as u64,
        })
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }

    pub fn arena(&self) -> &HostArena {
        &self.arena
    }

    /// Tokens stored at `layer`.
    pub fn tokens(&self, layer: u32) -> Result<u64> {
        Ok(self.layer_kv(layer)?.tokens)
    }

    /// Fewest tokens of any layer: the length of the prefix present in every layer.
    pub fn min_tokens(&self) -> u64 {
        self.layers.iter().map(|l| l.tokens).min().unwrap_or(0)
    }

    pub fn max_tokens_stored(&self) -> u64 {
        self.layers.iter().map(|l| l.tokens).max().unwrap_or(0)
    }

    /// Blocks held over all layers (each is one arena frame).
    pub fn frames(&self) -> usize {
        self.layers.iter().map(|l| l.frames.len()).sum()
    }

    /// Host bytes held (whole frames).
    pub fn host_bytes(&self) -> usize {
        self.frames() * self.arena.frame_bytes()
    }

    fn layer_kv(&self, layer: u32) -> Result<&LayerKv> {
        self.layers
            .get(layer as usize)
            .ok_or(StorageError::LayerOutOfRange {
                layer,
                layers: self.geo.layers,
            })
    }

    /// A read-only view of one layer for selection and attention.
    pub fn layer(&self, layer: u32) -> Result<LayerView<'_>> {
        let l = self.layer_kv(layer)?;
        Ok(LayerView {
            geo: &self.geo,
            tokens: l.tokens,
            frames: &l.frames,
            summaries: &l.summaries,
        })
    }

    /// Appends `n` tokens to one layer starting at `start`, which must equal the layer's length.
    /// `k` and `v` are `[n][kv_heads][head_dim]` in the session dtype (the engine's layout).
    /// All-or-nothing: on error nothing changed.
    pub fn append_layer(&mut self, layer: u32, start: u64, k: &[u8], v: &[u8]) -> Result<()> {
        let need = self.check_layer_append(layer, start, k, v)?;
        let mut fresh = self.arena.alloc_many(need)?;
        self.append_layer_reserved(layer, start, k, v, &mut fresh)
    }

    /// Validates a one-layer append without changing anything; returns how many new frames it
    /// needs. Lets a batch of appends over many sessions reserve all frames before touching any.
    pub fn check_layer_append(&self, layer: u32, start: u64, k: &[u8], v: &[u8]) -> Result<usize> {
        let n = self.check_rows(layer, start, k, v)?;
        Ok(self.frames_needed(start, n))
    }

    /// [`KvCache::append_layer`] taking its new frames from `reserved` (at least
    /// [`KvCache::check_layer_append`]'s count).
    pub fn append_layer_reserved(
        &mut self,
        layer: u32,
        start: u64,
        k: &[u8],
        v: &[u8],
        reserved: &mut Vec<Frame>,
    ) -> Result<()> {
        let n = self.check_rows(layer, start, k, v)?;
        let need = self.frames_needed(start, n);
        if reserved.len() < need {
            return Err(StorageError::ArenaFull {
                frames: self.arena.usage().frames_total,
                frame_bytes: self.arena.frame_bytes(),
            });
        }
        self.write_layer(layer, k, v, n, reserved);
        Ok(())
    }

    /// Appends `n` tokens to every layer. `payload` is, for each layer in order, K then V, each
    /// `[n][kv_heads][head_dim]`: `2 * layers * n * token_bytes` bytes. All layers must have the
    /// same length `start`. All-or-nothing.
    pub fn append(&mut self, start: u64, n: u64, payload: &[u8]) -> Result<()> {
        let tb = self.geo.token_bytes() as u64;
        let expected = n
            .checked_mul(tb)
            .and_then(|x| x.checked_mul(2 * self.geo.layers as u64))
            .filter(|&x| x <= usize::MAX as u64)
            .ok_or(StorageError::TooManyTokens {
                max: self.max_tokens,
            })? as usize;
        if payload.len() != expected {
            return Err(StorageError::PayloadSize {
                what: "append payload",
                expected,
                got: payload.len(),
            });
        }
        let half = (n * tb) as usize;
        let mut need = 0;
        for layer in 0..self.geo.layers {
            let at = 2 * half * layer as usize;
            let (k, v) = (&payload[at..at + half], &payload[at + half..at + 2 * half]);
            need += self.check_layer_append(layer, start, k, v)?;
        }
        let mut fresh = self.arena.alloc_many(need)?;
        for layer in 0..self.geo.layers {
            let at = 2 * half * layer as usize;
            let (k, v) = (&payload[at..at + half], &payload[at + half..at + 2 * half]);
            self.write_layer(layer, k, v, n, &mut fresh);
        }
        debug_assert!(fresh.is_empty());
        Ok(())
    }

    /// Validates one layer's rows; returns the token count.
    fn check_rows(&self, layer: u32, start: u64, k: &[u8], v: &[u8]) -> Result<u64> {
        let l = self.layer_kv(layer)?;
        if start != l.tokens {
            return Err(StorageError::PositionMismatch {
                layer,
                expected: l.tokens,
                got: start,
            });
        }
        let tb = self.geo.token_bytes();
        if !k.len().is_multiple_of(tb) {
            return Err(StorageError::PayloadSize {
                what: "k",
                expected: (k.len() / tb + 1) * tb,
                got: k.len(),
            });
        }
        if v.len() != k.len() {
            return Err(StorageError::PayloadSize {
                what: "v",
                expected: k.len(),
                got: v.len(),
            });
        }
        let n = (k.len() / tb) as u64;
        if l.tokens + n > self.max_tokens {
            return Err(StorageError::TooManyTokens {
                max: self.max_tokens,
            });
        }
        // A NaN key would poison every bound and score of its block; a NaN value every output.
        for (what, bytes) in [("k", k), ("v", v)] {
            if let Some(index) = self.geo.dtype.first_non_finite(bytes) {
                return Err(StorageError::NonFinite { what, index });
            }
        }
        Ok(n)
    }

    fn frames_needed(&self, tokens: u64, n: u64) -> usize {
        (self.geo.blocks_for(tokens + n) - self.geo.blocks_for(tokens)) as usize
    }

    /// Copies validated rows into the tail frames (opening blocks from `fresh`) and folds the
    /// keys into the blocks' bounds. Cannot fail.
    fn write_layer(&mut self, layer: u32, k: &[u8], v: &[u8], n: u64, fresh: &mut Vec<Frame>) {
        let geo = self.geo;
        let (bt, hkv, d) = (
            geo.block_tokens as u64,
            geo.kv_heads as usize,
            geo.head_dim as usize,
        );
        let row = geo.row_bytes();
        let spb = geo.summary_floats_per_block();
        let mut key = [0f32; MAX_HEAD_DIM as usize];
        let key = &mut key[..d];
        let l = &mut self.layers[layer as usize];
        for i in 0..n as usize {
            let pos = l.tokens;
            let (block, slot) = ((pos / bt) as usize, (pos % bt) as usize);
            if block == l.frames.len() {
                l.frames.push(fresh.pop().expect("frames were reserved"));
                // Empty bounds: every fold replaces them.
                for h in 0..hkv {
                    let at = l.summaries.len();
                    l.summaries.resize(at + d, f32::NEG_INFINITY);
                    l.summaries.resize(at + 2 * d, f32::INFINITY);
                    debug_assert_eq!(at, (block * hkv + h) * 2 * d);
                }
            }
            let frame = l.frames[block].as_mut_slice();
            let summ = &mut l.summaries[block * spb..(block + 1) * spb];
            for h in 0..hkv {
                let src = (i * hkv + h) * row;
                let (ks, vs) = (&k[src..src + row], &v[src..src + row]);
                let ko = geo.k_row_offset(h, slot);
                let vo = geo.v_row_offset(h, slot);
                frame[ko..ko + row].copy_from_slice(ks);
                frame[vo..vo + row].copy_from_slice(vs);
                // Bounds of the stored (rounded) key, so scores bound what attention will see.
                geo.dtype.decode(ks, key);
                let s = &mut summ[h * 2 * d..(h + 1) * 2 * d];
                let (mx, mn) = s.split_at_mut(d);
                for ((m, x), kv) in mx.iter_mut().zip(mn.iter_mut()).zip(key.iter()) {
                    *m = m.max(*kv);
                    *x = x.min(*kv);
                }
            }
            l.tokens += 1;
        }
    }
}

/// Read-only view of one layer of a session's cache.
#[derive(Clone, Copy)]
pub struct LayerView<'a> {
    geo: &'a Geometry,
    tokens: u64,
    frames: &'a [Frame],
    summaries: &'a [f32],
}

impl<'a> LayerView<'a> {
    pub fn geometry(&self) -> &'a Geometry {
        self.geo
    }

    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    pub fn blocks(&self) -> usize {
        self.frames.len()
    }

    /// All summaries of the layer: `[block][kv_head][max|min][D]` f32.
    pub fn summaries(&self) -> &'a [f32] {
        self.summaries
    }

    /// `(k_max, k_min)` of one (block, kv-head).
    pub fn bounds(&self, block: usize, kv_head: usize) -> (&'a [f32], &'a [f32]) {
        let d = self.geo.head_dim as usize;
        let at = (block * self.geo.kv_heads as usize + kv_head) * 2 * d;
        let s = &self.summaries[at..at + 2 * d];
        s.split_at(d)
    }

    /// Tokens present in `block`: B except for the tail block.
    pub fn valid_tokens(&self, block: usize) -> usize {
        let bt = self.geo.block_tokens as u64;
        (self.tokens - block as u64 * bt).min(bt) as usize
    }

    /// The arena frame holding `block`.
    pub fn frame(&self, block: usize) -> &'a Frame {
        &self.frames[block]
    }

    /// The (layer, block) run: every KV head's K tile then V tile.
    pub fn block_run(&self, block: usize) -> &'a [u8] {
        &self.frames[block].as_slice()[..self.geo.block_bytes()]
    }

    /// `(K tile, V tile)` of one (block, kv-head); rows past `valid_tokens` are zero.
    pub fn tile(&self, block: usize, kv_head: usize) -> (&'a [u8], &'a [u8]) {
        let at = self.geo.tile_offset(kv_head);
        let half = self.geo.half_tile_bytes();
        let run = self.block_run(block);
        (&run[at..at + half], &run[at + half..at + 2 * half])
    }
}
