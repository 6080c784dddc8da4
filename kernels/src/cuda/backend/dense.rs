//! Dense attention over every block of a layer: the baseline the sparse path is benchmarked
//! against (`gpu_bench`), with the KV read from pinned host memory (every tile crosses PCIe,
//! zero-copy) or from a copy in GPU memory ([`DeviceKv`]). No selector and no block cache: one
//! thread block per (block, kv head) attends the tile as the sparse path does (kernels/cuda/
//! attend.cu, `attend_dense`), and a two-step log-sum-exp merge folds the partials.

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::step::by_batch;
use super::{CudaBackend, DevBuf, LayerInput, LayerStats, StepItem, StepOutput};
use crate::cuda::error::{CudaError, Result};
use crate::cuda::params::{
    AttendDenseParams, CopyRunsParams, DenseMergeOutParams, DenseMergePartParams,
};

/// Thread blocks per query head in the merge's first step (each folds 1/64 of the partials).
const MERGE_SPLITS: u32 = 64;

/// Where dense attention reads the sessions' KV.
#[derive(Clone, Copy)]
pub enum DenseKv<'a> {
    /// The pinned host extents the sessions' blocks are mapped to.
    Host,
    /// A copy in GPU memory ([`CudaBackend::copy_kv_to_device`]).
    Device(&'a DeviceKv),
}

/// Sessions' KV copied into GPU memory, with a page table laid out like the backend's
/// (`[slot][layer][max_blocks]` device addresses). A snapshot: blocks appended after the copy
/// are not in it, and a call that needs them is refused ([`CudaError::KvNotOnDevice`]).
pub struct DeviceKv {
    _buf: CudaSlice<u8>,
    pages: DevBuf<u64>,
    /// Per slot: blocks copied per layer (empty for slots not copied).
    copied: Vec<Vec<u32>>,
    bytes: u64,
}

impl DeviceKv {
    /// Bytes of KV held in GPU memory.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Dense partials and the merge's stage, sized for max_batch sessions of max_blocks blocks.
pub(super) struct DenseScratch {
    acc: DevBuf<f32>,
    ml: DevBuf<f32>,
    st_acc: DevBuf<f32>,
    st_ml: DevBuf<f32>,
}

impl CudaBackend {
    /// Copies every block of every layer of `slots` (blocks up to each layer's token count,
    /// which must have their host extents mapped) from the host extents into one GPU buffer.
    /// Fails with the driver's error when GPU memory is short.
    pub fn copy_kv_to_device(&self, slots: &[u32]) -> Result<DeviceKv> {
        let g = self.cfg.geometry;
        let (nl, mb) = (g.layers as usize, self.cfg.max_blocks as usize);
        let run = g.block_bytes() as u64;
        let mut copied = vec![Vec::new(); self.cfg.max_sessions as usize];
        let mut runs = 0u64;
        for &slot in slots {
            let s = self.check_slot(slot)?;
            let sess = self.sessions[s]
                .as_ref()
                .ok_or(CudaError::SessionNotOpen { slot })?;
            if !copied[s].is_empty() {
                return Err(CudaError::DuplicateSession { slot });
            }
            copied[s] = (0..nl)
                .map(|l| sess.blocks_ready(slot, l, g.block_tokens))
                .collect::<Result<Vec<u32>>>()?;
            runs += copied[s].iter().map(|&n| n as u64).sum::<u64>();
        }
        let buf = self
            .stream
            .alloc_zeros::<u8>((runs * run).max(1) as usize)
            .map_err(CudaError::driver("cuMemAlloc"))?;
        let base = {
            let (ptr, _sync) = buf.device_ptr(&self.stream);
            ptr
        };
        let mut table = vec![0u64; copied.len() * nl * mb];
        let mut next = base;
        for (s, per_layer) in copied.iter().enumerate() {
            for (l, &nb) in per_layer.iter().enumerate() {
                for b in 0..nb as usize {
                    table[(s * nl + l) * mb + b] = next;
                    next += run;
                }
            }
        }
        let pages = DevBuf::<u64>::zeros(&self.stream, table.len())?;
        self.htod(pages.ptr, &table)?;
        for (s, per_layer) in copied.iter().enumerate() {
            let Some(&most) = per_layer.iter().max() else {
                continue;
            };
            let row = s * nl * mb;
            self.launch(
                &self.stream,
                &self.k.copy_runs,
                LaunchConfig {
                    grid_dim: (most.max(1), nl as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                },
                &CopyRunsParams {
                    from: self.pages.at(row),
                    to: pages.at(row),
                    max_blocks: mb as u32,
                    n_blocks: most,
                    run_vecs: run / 16,
                },
            )?;
        }
        self.sync()?;
        Ok(DeviceKv {
            _buf: buf,
            pages,
            copied,
            bytes: runs * run,
        })
    }

    /// Dense attention over every block of every layer for a batch of sessions, reading the KV
    /// from `kv`, with one synchronization at the end; outputs and timing as
    /// [`Self::decode_step`]'s (per-layer timing gives only `layer_ms`). Statistics count every
    /// tile: as misses and bytes moved when read from host memory, as hits from GPU memory. The
    /// block cache and `LaunchMode::Auto`'s per-layer history are left as they were.
    pub fn dense_step(&mut self, items: &[StepItem<'_>], kv: DenseKv<'_>) -> Result<StepOutput> {
        let g = self.cfg.geometry;
        let (layers, hkv) = (g.layers as usize, g.kv_heads);
        let slots: Vec<u32> = items.iter().map(|it| it.slot).collect();
        let per_layer = self.step_inputs(items)?;
        let host = matches!(kv, DenseKv::Host);
        let mut stats = Vec::with_capacity(layers);
        for LayerInput { layer: l, ntok, .. } in &per_layer {
            let mut tiles = 0u64;
            for (&slot, &n) in slots.iter().zip(ntok) {
                let nb = n.div_ceil(g.block_tokens);
                if let DenseKv::Device(d) = kv {
                    let copied = d.copied[slot as usize].get(*l).copied().unwrap_or(0);
                    if nb > copied {
                        return Err(CudaError::KvNotOnDevice {
                            slot,
                            layer: *l as u32,
                            n_blocks: nb,
                            copied,
                        });
                    }
                }
                tiles += (nb * hkv) as u64;
            }
            stats.push(LayerStats {
                tiles,
                hits: if host { 0 } else { tiles },
                misses: if host { tiles } else { 0 },
                bytes_moved: if host {
                    tiles * g.tile_bytes() as u64
                } else {
                    0
                },
            });
        }
        self.prepare(&per_layer)?;
        if self.dense.is_none() {
            let rows = (self.cfg.max_batch * hkv * self.cfg.max_blocks * g.group() as u32) as usize;
            let stage = (self.cfg.max_batch * g.q_heads * MERGE_SPLITS) as usize;
            let d = g.head_dim as usize;
            self.dense = Some(DenseScratch {
                acc: DevBuf::zeros(&self.stream, rows * d)?,
                ml: DevBuf::zeros(&self.stream, rows * 2)?,
                st_acc: DevBuf::zeros(&self.stream, stage * d)?,
                st_ml: DevBuf::zeros(&self.stream, stage * 2)?,
            });
        }
        let pages = match kv {
            DenseKv::Host => self.pages.ptr,
            DenseKv::Device(d) => d.pages.ptr,
        };
        let b = items.len();
        let bu = b as u32;
        let scale = self.softmax_scale();
        let hit_share = self.hit_share.clone();
        self.record_step(0)?;
        for (li, input) in per_layer.iter().enumerate() {
            let l = input.layer;
            let (_, max_nb) = self.blocks_of(&input.ntok);
            self.enqueue_dense(l, li, bu, max_nb, pages, scale)?;
            self.fused[l] = true; // one kernel sequence: only layer_ms is timed
        }
        self.record_step(1)?;
        let all: Vec<usize> = (0..layers).collect();
        let mut out = self.finish(&all, layers * b)?;
        out.out = by_batch(&out.out, layers, b, (g.q_heads * g.head_dim) as usize);
        self.hit_share = hit_share;
        out.stats = stats;
        Ok(out)
    }

    fn enqueue_dense(
        &self,
        l: usize,
        li: usize,
        bu: u32,
        max_nb: u32,
        pages: u64,
        scale: f32,
    ) -> Result<()> {
        let g = self.cfg.geometry;
        let sc = self.dense.as_ref().expect("allocated by dense_step");
        let hqd = (g.q_heads * g.head_dim) as usize;
        let b = bu as usize;
        let (mb, d) = (self.cfg.max_blocks, g.head_dim);
        let grid = |grid_dim: (u32, u32, u32), threads: u32, smem: u32| LaunchConfig {
            grid_dim,
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        self.record(l, 0)?;
        self.launch(
            &self.stream,
            &self.k.attend_dense,
            grid(
                (max_nb, g.kv_heads, bu),
                self.derived.att_threads,
                self.derived.att_dyn_smem,
            ),
            &AttendDenseParams {
                q: self.q.at(li * b * hqd),
                sess: self.sess.at(li * b),
                ntok: self.ntok.at(li * b),
                pages,
                part_acc: sc.acc.ptr,
                part_ml: sc.ml.ptr,
                layer: l as u32,
                max_blocks: mb,
                scale,
            },
        )?;
        self.record(l, 1)?;
        self.launch(
            &self.stream,
            &self.k.dense_merge_part,
            grid((g.q_heads, bu, MERGE_SPLITS), d, 0),
            &DenseMergePartParams {
                ntok: self.ntok.at(li * b),
                part_acc: sc.acc.ptr,
                part_ml: sc.ml.ptr,
                st_acc: sc.st_acc.ptr,
                st_ml: sc.st_ml.ptr,
                max_blocks: mb,
            },
        )?;
        self.launch(
            &self.stream,
            &self.k.dense_merge_out,
            grid((g.q_heads, bu, 1), d, 0),
            &DenseMergeOutParams {
                st_acc: sc.st_acc.ptr,
                st_ml: sc.st_ml.ptr,
                out: self.out.at(li * b * hqd),
                splits: MERGE_SPLITS,
            },
        )?;
        self.record(l, 2)
    }
}
